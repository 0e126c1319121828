"""`kvctl serve`'s launch plan: which processes to start, with which command lines and environment,
and how to tell that each is ready. Building a plan starts nothing (`--dry-run` prints it).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from importlib.metadata import PackageNotFoundError, version
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from kvctl.core.common.display import PATH_CHARS, shown
from kvctl.core.common.paths import models_dir
from kvctl.core.common.safe_files import read_text
from kvctl.core.config.init import (
    DEFAULT_INTERNAL_API_PORT_START,
    DEFAULT_MP_HTTP_PORT,
    DEFAULT_MP_PORT,
    ConfigRequest,
    build_config,
    mp_server_launch,
    write_files,
)
from kvctl.core.errors import KvctlError, UsageError
from kvctl.core.lmcache.config import (
    CONFIG_FILE,
    ENV_FILE,
    KV_TRANSFER_FILE,
    MP_CONNECTOR,
    is_secret,
    load_mapping,
    parse_env_file,
    redact,
)
from kvctl.core.lmcache.tiers import TierSpec
from kvctl.core.serve.platform import vllm_block_size
from kvctl.core.serve.state import default_state_file, named_state_file, serve_dir
from kvctl.core.serve.tiny_model import is_tiny_model

DEFAULT_PORT = 8000
DEFAULT_COORDINATOR_PORT = 9300
DEFAULT_CONTROLLER_PORT = 9000  # LMCache's controller (in-process fleets); its ZMQ ports are the next three
LOOPBACK = "127.0.0.1"
QUIET_ENV = {"LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1",
             "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")

# kvctl's /kvctl/v1 routes on the MP server's HTTP app, through the server's own extension flag.
MP_ROUTES_ARGV = ["--server-module", json.dumps({"module_path": "kvctl_plugins.mp_routes"})]
PORT_CHOICES = ("choose other ports: --port, --internal-api-port-start (worker r listens on start + 1 + r), --mp-port, "
                "--mp-http-port, --coordinator-port, or those in --config's lmcache.yaml")
COORDINATOR_METADATA = "coordinator-metadata.json"  # the coordinator's pins and quotas, beside serve's logs
HEALTHY = {"status": "healthy"}  # what LMCache's MP server (/healthcheck) and coordinator (/healthz) answer


@dataclass
class Readiness:
    """Proof that a component is up and is the one kvctl started, not whatever else answers on its port:
    GET `target` answers 200 with JSON equal to `expect` ("json"), listing the model `expect` ("models"), or
    an object with every key in `expect` ("keys")."""

    kind: str  # "json", "models" or "keys"
    target: str
    label: str
    expect: Any


@dataclass
class PortUse:
    port: int
    host: str
    owner: str  # who binds it, as an error message names it


@dataclass
class Component:
    name: str
    argv: list[str]
    env: dict[str, str]
    log: str
    ready: list[Readiness] = field(default_factory=list)


@dataclass
class LaunchPlan:
    name: str
    mode: str
    model: str
    config_dir: str
    state_file: str
    components: list[Component]
    endpoints: dict[str, Any]
    ports: list[PortUse] = field(default_factory=list)
    unset_env: list[str] = field(default_factory=list)  # inherited variables the children do not get

    def as_dict(self) -> dict[str, Any]:
        """The plan for printing (`--dry-run`): secrets in command lines and environments replaced by ***."""
        plan = asdict(self)
        for component in plan["components"]:
            component["argv"] = _redacted_argv(component["argv"])
            component["env"] = {name: redact(name, value) for name, value in component["env"].items()}
        return plan


def _redacted_argv(argv: list[str]) -> list[str]:
    """Passwords in URLs and JSON arguments hidden, and the value of a flag like --api-key or --password."""
    shown_argv: list[str] = []
    for arg in argv:
        flag, equals, _value = arg.partition("=")
        if shown_argv and shown_argv[-1].startswith("-") and is_secret(shown_argv[-1]):
            shown_argv.append("***")
        elif arg.startswith("-") and equals and is_secret(flag):
            shown_argv.append(f"{flag}=***")
        else:
            try:
                parsed = json.loads(arg) if arg.startswith("{") else None
            except ValueError:
                parsed = None
            shown_argv.append(json.dumps(redact("argv", parsed)) if isinstance(parsed, dict) else redact("argv", arg))
    return shown_argv


def port_free(port: int, host: str = LOOPBACK) -> bool:
    host = host.strip("[]")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def url_host(host: str) -> str:
    """A host as a URL has it: an IPv6 address in brackets."""
    host = host.strip("[]")
    return f"[{host}]" if ":" in host else host


def reach_host(host: str) -> str:
    """Where kvctl connects to a server that binds `host`: a wildcard address is reached on loopback."""
    host = host.strip("[]")
    return {"0.0.0.0": LOOPBACK, "::": "::1", "": LOOPBACK}.get(host, host)


def flag_value(argv: list[str], *names: str) -> str | None:
    """The value of the last of vLLM's `names` flags in `argv` (`--flag V` or `--flag=V`; vLLM also
    accepts underscores in flag names), or None."""
    found = None
    for index, arg in enumerate(argv):
        flag, equals, value = arg.partition("=")
        if flag.replace("_", "-") in names:
            found = value if equals else (argv[index + 1] if index + 1 < len(argv) else None)
    return found


def world_size(vllm_args: list[str]) -> int:
    """vLLM's ranks (tensor x pipeline parallel): LMCache gives each its own worker API port."""
    size = 1
    for names in (("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp")):
        value = flag_value(vllm_args, *names) or "1"
        if not value.isdigit() or int(value) < 1:
            raise UsageError(f"{names[0]} {shown(value)} is not a positive number", hint=f"pass {names[0]} N")
        size *= int(value)
    return size


def lmcache_version() -> str:
    """The installed LMCache's version, which its servers' /lmc_version answer (no lmcache import)."""
    try:
        return version("lmcache")
    except PackageNotFoundError:
        return ""


def check_model_dir(model: str) -> None:
    path = Path(model)
    if not path.is_dir():
        return  # a hub id: vLLM resolves it (offline, from its cache)
    if not (path / "config.json").is_file():
        raise UsageError(f"{shown(model, PATH_CHARS)} has no config.json: not a model directory",
                         hint="give a Hugging Face model directory")
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise UsageError(f"{shown(model, PATH_CHARS)} has no tokenizer",
                         hint="give a model directory that includes its tokenizer")


def check_installed() -> None:
    missing = [name for name in ("vllm", "lmcache") if find_spec(name) is None]
    if missing:
        raise KvctlError(f"{' and '.join(missing)} not installed in this environment",
                         hint="run the set-up command: ./scripts/setup (or make setup)")


COMPILE_FLAGS = ("--enforce-eager", "--no-enforce-eager", "-O", "--compilation-config", "-cc")


TINY_KV_CACHE_BYTES = 256 * 2**20  # the tiny model's KV is 512 bytes a token: half a million tokens


def tiny_model_args(vllm_args: list[str]) -> list[str]:
    """The tiny model runs eagerly (compiling two random layers costs a start 15 s or more and saves nothing)
    on a 256 MiB KV cache: vLLM CPU zeroes its whole KV cache at start, ~3 s per GiB here, and would take
    GiBs. The user's own compilation or KV cache flags win (and VLLM_CPU_KVCACHE_SPACE, which vLLM puts
    above the flag)."""
    flags = {arg.split("=", 1)[0] for arg in vllm_args}
    eager = [] if flags & set(COMPILE_FLAGS) or any(arg.startswith("-O") for arg in vllm_args) else [
        "--enforce-eager"]
    kv_cache = [] if "--kv-cache-memory-bytes" in flags else ["--kv-cache-memory-bytes", str(TINY_KV_CACHE_BYTES)]
    return [*eager, *kv_cache, *vllm_args]


def build_plan(*, name: str = "default", model: str | None, mode: str = "inprocess", tiers: list[TierSpec],
               config: Path | None, host: str = LOOPBACK, port: int = DEFAULT_PORT,
               internal_api_port_start: int = DEFAULT_INTERNAL_API_PORT_START, mp_port: int = DEFAULT_MP_PORT,
               mp_http_port: int = DEFAULT_MP_HTTP_PORT, state_file: Path | None = None,
               extra_vllm_args: list[str] = (), coordinator: str | None = None, start_coordinator: bool = True,
               coordinator_port: int = DEFAULT_COORDINATOR_PORT, keep_lmcache_env: bool = False,
               controller: str | None = None, start_controller: bool = False,
               controller_port: int = DEFAULT_CONTROLLER_PORT, write: bool = True) -> LaunchPlan:
    """The plan; with `write`, the generated configuration is written to kvctl's serve directory.

    MP mode starts an LMCache coordinator on loopback (where `kvctl pin` keeps pins) unless `coordinator`
    names one, the configuration already has one, or `start_coordinator` is off. In-process mode joins
    LMCache's controller at `controller` (HOST:PORT or URL), or with `start_controller` starts one on
    loopback (first, so that it is stopped last) and joins that."""
    model = model or str(models_dir() / "tiny")
    base = serve_dir(name)
    generated = None
    if (controller or start_controller) and mode == "mp":
        raise UsageError("--controller is for in-process mode: LMCache's controller registers in-process engines "
                         "(MP servers register with the coordinator)", hint="drop --controller, or serve without "
                         "--mode mp")
    if start_controller and not controller:
        controller = f"{LOOPBACK}:{controller_port}"
    if config is None:
        config = base / "config"
        request = ConfigRequest(mode=mode, tiers=tiers or [TierSpec("cpu"), TierSpec("disk", path=str(base / "disk"))],
                                internal_api_port_start=internal_api_port_start, mp_port=mp_port,
                                mp_http_port=mp_http_port, model=model, instance_id=f"kvctl-{name}",
                                controller=controller)
        generated = build_config(request, config)
        lmcache_values, kv_transfer, env_file = generated.lmcache, generated.kv_transfer, generated.env
    else:
        lmcache_values, kv_transfer = load_mapping(config / CONFIG_FILE), load_mapping(config / KV_TRANSFER_FILE)
        env_file = parse_env_file(read_text(config / ENV_FILE)) if (config / ENV_FILE).exists() else {}
        mode = "mp" if kv_transfer.get("kv_connector") == MP_CONNECTOR else "inprocess"
        chunk, block = lmcache_values.get("chunk_size", 256), vllm_block_size()
        if not str(chunk).isdigit() or int(chunk) % block:
            raise UsageError(f"{shown(str(config / CONFIG_FILE), PATH_CHARS)} has chunk_size {shown(chunk)}, not a "
                             f"multiple of vLLM's block size {block} on this platform",
                             hint=f"run 'kvctl config validate {shown(str(config), PATH_CHARS)}' and fix it")
        if controller and not lmcache_values.get("enable_controller"):
            raise UsageError(f"{shown(str(config), PATH_CHARS)} does not register with a controller",
                             hint=f"write it with 'kvctl config init --controller {controller}', or drop --controller")
    if coordinator is not None and mode != "mp":
        raise UsageError("--coordinator is for MP mode: the LMCache coordinator works with 'lmcache server'",
                         hint="drop --coordinator, or serve with --mode mp")
    logs = base / "logs"
    env = {**QUIET_ENV, **loopback_bypasses_proxies(os.environ), "PYTHONHASHSEED": env_file.get("PYTHONHASHSEED", "0")}
    components, ports = [], [PortUse(port, host, "vLLM")]
    vllm_url = f"http://{url_host(host)}:{port}"
    endpoints: dict[str, Any] = {"openai": f"{vllm_url}/v1", "vllm": vllm_url}
    if start_controller:
        components.append(_controller(controller_port, env, logs))
        ports += [PortUse(controller_port + offset, LOOPBACK, f"LMCache's controller ({role})")
                  for offset, role in enumerate(("HTTP", "pull", "reply", "heartbeat"))]
    if controller:
        endpoints["controller"] = f"http://{controller}" if "://" not in controller else controller
    if mode == "mp":
        lmcache_values = dict(lmcache_values)
        coordinator = coordinator or lmcache_values.get("coordinator_url")
        if coordinator is None and start_coordinator:
            components.append(_coordinator(lmcache_values, coordinator_port, env, logs))
            ports.append(PortUse(coordinator_port, LOOPBACK, "the LMCache coordinator"))
            coordinator = f"http://{LOOPBACK}:{coordinator_port}"
            lmcache_values.setdefault("coordinator_advertise_ip", reach_host(lmcache_values.get("http_host", LOOPBACK)))
        if coordinator is not None:
            lmcache_values["coordinator_url"] = endpoints["coordinator"] = coordinator
        http_host = lmcache_values.get("http_host", LOOPBACK)
        http_port = int(lmcache_values.get("http_port", mp_http_port))
        ports += [PortUse(int(lmcache_values.get("port", mp_port)), lmcache_values.get("host", LOOPBACK),
                          "the MP server's request port"),
                  PortUse(http_port, http_host, "the MP server's HTTP port")]
        server_argv, credentials = mp_server_launch(lmcache_values)
        components.append(Component("lmcache-server", [sys.executable, "-m", "lmcache.v1.multiprocess.http_server",
                                                       *server_argv, *MP_ROUTES_ARGV],
                                    {**env, **credentials}, str(logs / "lmcache-server.log"),
                                    [Readiness("json", f"http://{url_host(reach_host(http_host))}:{http_port}"
                                                       f"/healthcheck", "the LMCache MP server", HEALTHY)]))
        endpoints["mp_http"] = f"http://{url_host(http_host)}:{http_port}"
        lmcache_ready = []
    else:
        env = {**env, "LMCACHE_CONFIG_FILE": str((config / CONFIG_FILE).absolute())}
        start = int(lmcache_values.get("internal_api_server_port_start", internal_api_port_start))
        api_host = lmcache_values.get("internal_api_server_host", LOOPBACK)
        roles = ["scheduler"] + [f"worker {rank}" for rank in range(world_size(extra_vllm_args))]
        ports += [PortUse(start + offset, api_host, f"LMCache's {role} API") for offset, role in enumerate(roles)]
        if lmcache_values.get("enable_controller"):  # each worker's socket for the controller (LMCache binds *)
            worker_ports = list(lmcache_values.get("lmcache_worker_ports") or [])
            ports += [PortUse(int(worker_port), "0.0.0.0", f"LMCache's worker {rank} controller socket")
                      for rank, worker_port in enumerate(worker_ports[:len(roles) - 1])]
        endpoints["internal_api"] = [f"http://{LOOPBACK}:{start + offset}" for offset in range(len(roles))]
        lmcache_ready = [Readiness("json", f"{url}/lmc_version", f"LMCache's {role} API", lmcache_version())
                         for url, role in zip(endpoints["internal_api"], roles)]
    if generated is not None and write:
        write_files(replace(generated, lmcache=lmcache_values).render(config.absolute()), config, force=True)
    if model == str(models_dir() / "tiny") or is_tiny_model(model):  # the embedded default, or one by path
        extra_vllm_args = tiny_model_args(extra_vllm_args)
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host.strip("[]"),
            "--port", str(port), "--kv-transfer-config", json.dumps(kv_transfer), *extra_vllm_args]
    served = flag_value(extra_vllm_args, "--served-model-name") or model
    ready = [Readiness("models", f"http://{url_host(reach_host(host))}:{port}/v1/models", "vLLM", served),
             *lmcache_ready]
    components.append(Component("vllm", argv, dict(env), str(logs / "vllm.log"), ready))
    inherited = sorted(name for name in os.environ if name.startswith("LMCACHE_") and name not in QUIET_ENV)
    return LaunchPlan(name, mode, model, str(config.absolute()), str(state_file or default_state_file()),
                      components, endpoints, ports, [] if keep_lmcache_env else inherited)


def loopback_bypasses_proxies(environ) -> dict[str, str]:
    """NO_PROXY (both spellings) with the loopback names added: the children talk to each other on
    127.0.0.1 through clients that honour HTTP_PROXY (the MP server registers with the coordinator and
    sends it events through httpx), and an operator's proxy would swallow those requests."""
    present = [entry.strip() for entry in (environ.get("NO_PROXY") or environ.get("no_proxy") or "").split(",")
               if entry.strip()]
    merged = ",".join(present + [name for name in LOOPBACK_NAMES if name not in present])
    return {"NO_PROXY": merged, "no_proxy": merged}


def _coordinator(server_values: dict[str, Any], port: int, env: dict[str, str], logs: Path) -> Component:
    """`lmcache coordinator` on loopback (its module entry point, in this environment), hashing prompts as
    the server does: it computes the chunk keys of what `kvctl pin` sends it. Its pins and quotas are
    kept in a file beside the logs (--metadata-path), so they outlive a restart of the instance."""
    argv = [sys.executable, "-m", "lmcache.v1.mp_coordinator", "--host", LOOPBACK, "--port", str(port),
            "--chunk-size", str(server_values.get("chunk_size", 256)),
            "--hash-algorithm", str(server_values.get("hash_algorithm", "blake3")),
            "--metadata-path", str(logs.parent / COORDINATOR_METADATA)]
    return Component("lmcache-coordinator", argv, dict(env), str(logs / "lmcache-coordinator.log"),
                     [Readiness("json", f"http://{LOOPBACK}:{port}/healthz", "the LMCache coordinator", HEALTHY)])


def _controller(port: int, env: dict[str, str], logs: Path) -> Component:
    """LMCache's controller on loopback: HTTP on `port`, its ZMQ sockets (pull, reply, heartbeat) on the
    next three ports, as `kvctl config init --controller` expects them. Ready when its registry answers."""
    from kvctl.core.config.init import controller_ports

    argv = [sys.executable, "-m", "lmcache.v1.api_server", "--host", LOOPBACK, "--port", str(port),
            "--monitor-ports", json.dumps(controller_ports(port))]
    return Component("lmcache-controller", argv, dict(env), str(logs / "lmcache-controller.log"),
                     [Readiness("keys", f"http://{LOOPBACK}:{port}/controller/key-stats", "LMCache's controller",
                                ["total_instance_count", "instances"])])


def preflight(plan: LaunchPlan) -> None:
    """Refuse clearly before starting anything: ports out of range, taken twice by the plan itself, or
    already in use; a model directory that is none; vLLM or LMCache missing."""
    check_installed()
    owners: dict[int, list[str]] = defaultdict(list)
    for use in plan.ports:
        if not 0 < use.port < 65536:
            raise UsageError(f"port {use.port} ({use.owner}) is out of range", hint=PORT_CHOICES)
        owners[use.port].append(use.owner)
    clashes = [f"{port} is taken by {' and by '.join(names)}" for port, names in owners.items() if len(names) > 1]
    if clashes:
        raise UsageError(f"ports collide in this plan: {'; '.join(clashes)}", hint=PORT_CHOICES)
    for use in plan.ports:
        if not port_free(use.port, use.host):
            raise UsageError(f"port {use.port} ({use.owner}) is already in use",
                             hint=f"stop what listens there, or {PORT_CHOICES}")
    if plan.model != str(models_dir() / "tiny"):  # the embedded default is built right before launch
        check_model_dir(plan.model)


def state_files(plan: LaunchPlan) -> list[Path]:
    """The state file asked for (or the most recent one) and the instance's own, by name."""
    return list(dict.fromkeys([Path(plan.state_file), named_state_file(plan.name)]))


def write_state(plan: LaunchPlan, pids: dict[str, int], extra: dict[str, Any]) -> list[Path]:
    state = {"name": plan.name, "mode": plan.mode, "model": plan.model, "config_dir": plan.config_dir,
             "kvctl_pid": os.getpid(), "endpoints": {**plan.endpoints, **extra},
             "processes": [{"name": c.name, "pid": pids.get(c.name), "log": c.log} for c in plan.components]}
    paths = state_files(plan)
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_suffix(".tmp")
        temp.write_text(json.dumps(state, indent=2) + "\n")
        os.replace(temp, path)
    return paths


def remove_state(plan: LaunchPlan) -> None:
    """Forget this instance, leaving state files that a newer `kvctl serve` has taken over."""
    for path in state_files(plan):
        try:
            if json.loads(path.read_text()).get("kvctl_pid") == os.getpid():
                path.unlink()
        except (OSError, ValueError):
            continue


def offload_endpoint(plan) -> dict:
    """In-process mode: where worker 0's ZMQ offload server listens (its engine id is in /meta)."""
    if plan.mode != "inprocess":
        return {}
    from kvctl.clients.http import routes_tokens
    from kvctl.clients.internal_api import InternalAPIClient
    from kvctl.clients.offload import offload_socket_path
    from kvctl.core.instance.addresses import config_token

    url = plan.endpoints["internal_api"][1]
    routes_tokens.grant(url, config_token(plan.config_dir))  # its own routes token (beyond loopback)
    with InternalAPIClient(url) as worker:
        return {"offload_socket": offload_socket_path(worker.meta().get("engine_id") or "default")}
