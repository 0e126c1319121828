"""`kvctl config init`: LMCache + vLLM configuration that kvctl's management commands can work with.

Whatever the user picks, the result always has: the internal API server on 127.0.0.1 (in-process),
a fixed PYTHONHASHSEED and an explicit chunk-hash algorithm (so keys can be recomputed outside
the serving process), a stable instance id, and never the run_script API.
"""

from __future__ import annotations

import ipaddress
import json
import re
import secrets
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvctl_plugins.wire import TOKEN_VARIABLE

from kvctl import __version__
from kvctl.core.common.display import PATH_CHARS, shown
from kvctl.core.common.safe_files import write_private
from kvctl.core.errors import KvctlError, UsageError
from kvctl.core.lmcache.config import (
    CONFIG_FILE,
    ENV_FILE,
    HASH_SEED,
    INPROCESS_CONNECTOR,
    INPROCESS_HASH_ALGORITHMS,
    KV_TRANSFER_FILE,
    MP_CONNECTOR,
    MP_HASH_ALGORITHMS,
)
from kvctl.core.lmcache.schema import inprocess_keys
from kvctl.core.lmcache.tiers import TierSpec
from kvctl.core.serve import platform

DEFAULT_CHUNK_SIZE = 256
DEFAULT_INTERNAL_API_PORT_START = 6999
DEFAULT_MP_PORT = 5555
DEFAULT_MP_HTTP_PORT = 8080
LOOPBACK = "127.0.0.1"
PLUGIN_MODULE = "kvctl_plugins.vllm_connector"


@dataclass
class ConfigRequest:
    mode: str = "inprocess"
    tiers: list[TierSpec] = field(default_factory=list)
    chunk_size: int = DEFAULT_CHUNK_SIZE
    hash_algorithm: str | None = None
    internal_api_port_start: int = DEFAULT_INTERNAL_API_PORT_START
    mp_port: int = DEFAULT_MP_PORT
    mp_http_port: int = DEFAULT_MP_HTTP_PORT
    model: str | None = None
    instance_id: str | None = None
    platform: str | None = None
    plugins: bool = True
    internal_api_host: str = LOOPBACK
    controller: str | None = None  # LMCache's controller (in-process): controller://HOST:PORT or http://HOST:PORT


@dataclass
class GeneratedConfig:
    mode: str
    lmcache: dict[str, Any]
    kv_transfer: dict[str, Any]
    env: dict[str, str]
    notes: list[str]

    def render(self, config_dir: Path) -> dict[str, str]:
        """File name -> text of the three files."""
        return {
            CONFIG_FILE: _render_yaml(self, config_dir),
            KV_TRANSFER_FILE: json.dumps(self.kv_transfer, indent=2) + "\n",
            ENV_FILE: _render_env(self),
        }


def default_tiers(out_dir: Path) -> list[TierSpec]:
    """CPU plus a disk tier under the configuration directory, both sized from this machine."""
    return [TierSpec("cpu"), TierSpec("disk", path=str(out_dir / "disk-cache"))]


def instance_id_for(out_dir: Path) -> str:
    """A stable id from the directory name, so regenerating the same config keeps the same id."""
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", out_dir.resolve().name).strip("-") or "default"
    return name if name.startswith("kvctl") else f"kvctl-{name}"


def build_config(request: ConfigRequest, out_dir: Path) -> GeneratedConfig:
    out_dir = out_dir.expanduser().absolute()
    tiers = request.tiers or default_tiers(out_dir)
    _check_tiers(tiers)
    block = platform.vllm_block_size(request.platform)
    if request.chunk_size <= 0 or request.chunk_size % block:
        raise UsageError(
            f"chunk size {request.chunk_size} is not a multiple of vLLM's block size {block} on this platform",
            hint=f"use --chunk-size {max(block, request.chunk_size // block * block)} or another multiple of {block}",
        )
    instance_id = request.instance_id or instance_id_for(out_dir)
    if request.mode == "mp":
        return _build_mp(request, tiers, instance_id)
    return _build_inprocess(request, tiers, instance_id, out_dir)


def _check_tiers(tiers: list[TierSpec]) -> None:
    names = [tier.name for tier in tiers]
    for name in ("cpu", "redis"):
        if names.count(name) > 1:
            raise UsageError(f"--tier {name} given more than once", hint=f"give one {name} tier")
    if names.count("disk") > 1 and len({tier.size_gb for tier in tiers if tier.name == "disk"}) > 1:
        raise UsageError("disk tiers with different sizes", hint="LMCache has one disk budget: give one size")


def _sized(tier: TierSpec) -> float:
    if tier.size_gb is not None:
        return tier.size_gb
    return platform.default_cpu_tier_gb() if tier.name == "cpu" else platform.default_disk_tier_gb(tier.path or ".")


def _build_inprocess(request: ConfigRequest, tiers: list[TierSpec], instance_id: str, out_dir: Path) -> GeneratedConfig:
    algorithm = request.hash_algorithm or "sha256_cbor"
    if algorithm not in INPROCESS_HASH_ALGORITHMS:
        raise UsageError(f"hash algorithm {algorithm!r} is not one LMCache's in-process mode accepts",
                         hint=f"use one of {', '.join(INPROCESS_HASH_ALGORITHMS)}")
    cpu = next((tier for tier in tiers if tier.name == "cpu"), None)
    disks = [tier for tier in tiers if tier.name == "disk"]
    redis = next((tier for tier in tiers if tier.name == "redis"), None)
    values: dict[str, Any] = {"chunk_size": request.chunk_size}
    # The CPU tier is always created on workers (other tiers stage through it); without --tier cpu
    # it gets the smallest useful size.
    values["local_cpu"] = True
    values["max_local_cpu_size"] = _sized(cpu) if cpu else 0.5
    if disks:
        values["local_disk"] = ",".join("file://" + str(Path(tier.path).expanduser().absolute()) + "/"
                                        for tier in disks)
        values["max_local_disk_size"] = _sized(disks[0])
    if redis:
        values["remote_url"] = redis.redis.url()
        values["remote_serde"] = "naive"
    values.update({
        "save_unfull_chunk": False,
        "pre_caching_hash_algorithm": algorithm,
        "lmcache_instance_id": instance_id,
        "internal_api_server_enabled": True,
        "internal_api_server_host": request.internal_api_host,
        "internal_api_server_port_start": request.internal_api_port_start,
        "run_script_api_enabled": False,
    })
    controller_notes = _controller_keys(request, values, algorithm) if request.controller else []
    schema = inprocess_keys()
    env = {"PYTHONHASHSEED": HASH_SEED, **_model_env(request)}
    env.update({schema[key]["env"]: _env_text(value) for key, value in values.items()})
    kv_transfer = {"kv_connector": INPROCESS_CONNECTOR, "kv_role": "kv_both"}
    if request.plugins:
        # vLLM imports this module in the scheduler and every worker and takes LMCacheConnectorV1 from it:
        # kvctl's management routes, the CPU connector and the restart-proof disk tier come along.
        kv_transfer["kv_connector_module_path"] = PLUGIN_MODULE
    notes = list(controller_notes)
    if not cpu:
        notes.append("no --tier cpu given: LMCache still needs a CPU staging tier, sized at 0.5 GB")
    if redis and redis.redis.scheme == "redis-sentinel":
        notes.append("LMCache 0.5.6's redis-sentinel connector stores nothing (it never awaits Redis); use redis:// to "
                     "the master or redis-cluster://")
    if not is_loopback(request.internal_api_host):
        env[TOKEN_VARIABLE] = secrets.token_urlsafe(32)
        notes.append(f"the internal API binds {shown(request.internal_api_host)}, beyond this machine: kvctl's routes "
                     f"answer only the bearer of {TOKEN_VARIABLE} (in env.sh, 0600; source it where kvctl runs)")
    return GeneratedConfig("inprocess", values, kv_transfer, env, notes)


CONTROLLER_RANKS = 8  # worker ports written for tensor-parallel sizes up to 8 (one per rank)


def controller_ports(http_port: int) -> dict[str, int]:
    """The ZMQ ports of a controller kvctl starts (kvctl serve --controller), beside its HTTP port."""
    return {"pull": http_port + 1, "reply": http_port + 2, "heartbeat": http_port + 3}


def _controller_keys(request: ConfigRequest, values: dict[str, Any], algorithm: str) -> list[str]:
    """Register every worker with LMCache's controller: its pull/reply sockets (kvctl's layout beside
    the HTTP port), heartbeats on, and worker r's controller port at its internal API port +
    WORKER_PORT_OFFSET, the relation kvctl's controller discovery relies on (and checks)."""
    from kvctl.core.lmcache.controller import WORKER_PORT_OFFSET, http_url

    url = http_url(request.controller if "://" in request.controller else "controller://" + request.controller)
    host, _, port = url.split("://", 1)[1].rpartition(":")
    try:
        ports = controller_ports(int(port))
    except ValueError:
        raise UsageError(f"{request.controller!r} names no controller port", hint="--controller HOST:PORT") from None
    first_worker = request.internal_api_port_start + 1
    values.update({
        "enable_controller": True,
        "controller_pull_url": f"{host}:{ports['pull']}",
        "controller_reply_url": f"{host}:{ports['reply']}",
        "lmcache_worker_ports": [first_worker + rank + WORKER_PORT_OFFSET for rank in range(CONTROLLER_RANKS)],
        "lmcache_worker_heartbeat_time": 5,
        "lmcache_worker_heartbeat_delay_time": 2,
    })
    notes = [f"the controller's ZMQ ports are taken as kvctl's layout: pull {ports['pull']}, reply {ports['reply']}, "
             f"heartbeat {ports['heartbeat']} (kvctl serve --controller starts it so)"]
    if algorithm != "builtin" or request.chunk_size != 256:
        notes.append(f"the controller's /lookup hashes tokens with builtin and chunk size 256 only: with {algorithm} "
                     f"and chunk size {request.chunk_size} it finds nothing; kvctl lookup --instance controller://… "
                     "asks the instances themselves (or pass --hash-algorithm builtin --chunk-size 256)")
    return notes


def is_loopback(host: str) -> bool:
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _build_mp(request: ConfigRequest, tiers: list[TierSpec], instance_id: str) -> GeneratedConfig:
    algorithm = request.hash_algorithm or "blake3"
    if algorithm not in MP_HASH_ALGORITHMS:
        raise UsageError(f"hash algorithm {algorithm!r} is not one the LMCache MP server accepts",
                         hint=f"use one of {', '.join(MP_HASH_ALGORITHMS)}")
    cpu = next((tier for tier in tiers if tier.name == "cpu"), None)
    adapters: list[dict[str, Any]] = []
    notes = []
    for tier in tiers:
        if tier.name == "disk":
            adapters.append({"type": "fs", "base_path": str(Path(tier.path).expanduser().absolute())})
            if tier.size_gb is not None:
                notes.append(f"the MP server's fs L2 adapter has no size budget; {tier.size_gb} GB for "
                             f"{tier.path} is not enforced")
        elif tier.name == "redis":
            adapters.append(_resp_adapter(tier))
    values: dict[str, Any] = {
        "host": LOOPBACK,
        "port": request.mp_port,
        "http_host": LOOPBACK,
        "http_port": request.mp_http_port,
        "chunk_size": request.chunk_size,
        "hash_algorithm": algorithm,
        "l1_size_gb": _sized(cpu) if cpu else platform.default_cpu_tier_gb(),
        "eviction_policy": "LRU",
        # vLLM on CPU resolves the connector's transfer mode to engine-driven; `auto` serves both.
        "supported_transfer_mode": "auto",
        "instance_id": instance_id,
    }
    if platform.platform_name() == "cpu":
        values["l1_use_lazy"] = False  # lazy L1 needs pinnable memory, which a CPU-only machine lacks
    if adapters:
        values["l2_adapter"] = adapters
    extra = {
        "lmcache.mp.host": f"tcp://{LOOPBACK}",
        "lmcache.mp.port": request.mp_port,
        "lmcache.mp.hash_algorithm": algorithm,
    }
    kv_transfer = {"kv_connector": MP_CONNECTOR, "kv_role": "kv_both", "kv_connector_extra_config": extra}
    return GeneratedConfig("mp", values, kv_transfer, {"PYTHONHASHSEED": HASH_SEED, **_model_env(request)}, notes)


def _model_env(request: ConfigRequest) -> dict[str, str]:
    """The model kvctl's own commands use by default for this configuration."""
    return {"KVCTL_MODEL": request.model} if request.model else {}


def _resp_adapter(tier: TierSpec) -> dict[str, Any]:
    url = tier.redis
    if url.scheme != "redis" or len(url.hosts) != 1 or url.db:
        raise UsageError(
            f"the MP server's Redis adapter (resp) takes one plain redis://host:port, not {url.url(redact=True)}",
            hint="use redis://[user:pass@]host:port in --mode mp, or --mode inprocess for TLS, sentinel, cluster "
            "or a db",
        )
    adapter: dict[str, Any] = {"type": "resp", "host": url.hosts[0][0], "port": url.hosts[0][1]}
    if url.username:
        adapter["username"] = url.username
    if url.password:
        adapter["password"] = url.password
    return adapter


def mp_server_argv(values: dict[str, Any]) -> list[str]:
    """`lmcache server` flags for an MP-mode lmcache.yaml (keys are the server's own flag names)."""
    from kvctl.core.lmcache.schema import mp_server_flags

    flags = mp_server_flags()
    argv: list[str] = []
    for key, value in values.items():
        spec = flags[key]
        flag = spec["flag"]
        if spec["type"] == "bool":
            if spec["negatable"]:
                argv.append(flag if value else "--no-" + flag[2:])
            elif value:
                argv.append(flag)
            continue
        items = value if isinstance(value, list) else [value]
        texts = [json.dumps(item) if isinstance(item, dict) else str(item) for item in items]
        if spec["repeatable"]:
            for text in texts:
                argv += [flag, text]
        else:
            argv += [flag, *texts]
    return argv


# The resp L2 adapter of LMCache 0.5.6 reads these when its own username / password are empty.
RESP_CREDENTIAL_ENV = {"username": "LMCACHE_RESP_USERNAME", "password": "LMCACHE_RESP_PASSWORD"}


def mp_server_launch(values: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """`lmcache server` flags plus the environment they need: the resp adapters' username and password go
    in LMCACHE_RESP_USERNAME / LMCACHE_RESP_PASSWORD, never on a command line that `ps` shows everyone."""
    env = resp_credentials(values)
    if not values.get("l2_adapter"):
        return mp_server_argv(values), env
    plain = [{key: item for key, item in adapter.items() if key not in RESP_CREDENTIAL_ENV} if _is_resp(adapter)
             else adapter for adapter in _adapters(values)]
    return mp_server_argv({**values, "l2_adapter": plain}), env


def resp_credentials(values: dict[str, Any]) -> dict[str, str]:
    """LMCACHE_RESP_USERNAME / LMCACHE_RESP_PASSWORD for the resp adapters of an MP lmcache.yaml; one
    environment holds one pair, so adapters with different credentials are refused."""
    credentials = {tuple(str(adapter.get(field) or "") for field in RESP_CREDENTIAL_ENV)
                   for adapter in _adapters(values) if _is_resp(adapter)}
    if len(credentials) > 1:
        raise UsageError("resp L2 adapters with different credentials: lmcache server 0.5.6 takes one Redis username "
                         "and password for all of them (kvctl passes it in the environment, not on the command line)",
                         hint="use the same Redis user and password for every resp adapter")
    return {name: value for name, value in zip(RESP_CREDENTIAL_ENV.values(), next(iter(credentials), ())) if value}


def _adapters(values: dict[str, Any]) -> list[Any]:
    adapters = values.get("l2_adapter") or []
    return [_adapter_mapping(adapter) for adapter in (adapters if isinstance(adapters, list) else [adapters])]


def _is_resp(adapter: Any) -> bool:
    return isinstance(adapter, dict) and adapter.get("type") == "resp"


def _adapter_mapping(adapter: Any) -> Any:
    """An l2_adapter given as a JSON string (as on the command line) as its mapping; anything else unchanged."""
    if isinstance(adapter, str):
        try:
            return json.loads(adapter)
        except ValueError:
            return adapter
    return adapter


def _env_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list) and all(isinstance(item, (int, float, str)) for item in value):
        return ",".join(str(item) for item in value)  # LMCache splits list values of LMCACHE_* on commas
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def _yaml_line(key: str, value: Any) -> str:
    import yaml

    return yaml.safe_dump({key: value}, default_flow_style=False, sort_keys=False, width=1000).rstrip("\n")


INPROCESS_COMMENTS = {
    "chunk_size": "tokens per chunk; part of every chunk key",
    "max_local_cpu_size": "GB of host memory for the CPU tier",
    "local_disk": "disk tier directory (file names are the chunk keys)",
    "max_local_disk_size": "GB budget of the disk tier (0 would silently disable it)",
    "remote_url": "Redis tier",
    "save_unfull_chunk": "false: the last partial chunk of a prompt is not stored",
    "pre_caching_hash_algorithm": "explicit, so kvctl can recompute chunk keys (with PYTHONHASHSEED from env.sh)",
    "lmcache_instance_id": "stable id (LMCache would pick a random one per start)",
    "internal_api_server_enabled": "kvctl's management commands talk to this server",
    "internal_api_server_host": "where the internal API binds (127.0.0.1: this machine only)",
    "internal_api_server_port_start": "scheduler = start, worker r = start + 1 + r",
    "run_script_api_enabled": "never: /run_script executes arbitrary code",
}


def _render_yaml(generated: GeneratedConfig, config_dir: Path) -> str:
    header = [f"# Generated by kvctl {__version__} (kvctl config init) for LMCache 0.5.6."]
    if generated.mode == "inprocess":
        header += [
            "# In-process mode: vLLM's LMCacheConnectorV1 reads this file through LMCACHE_CONFIG_FILE.",
            f"# Use: PYTHONHASHSEED={HASH_SEED} LMCACHE_CONFIG_FILE={config_dir / CONFIG_FILE} \\",
            f"#        vllm serve MODEL --kv-transfer-config \"$(cat {config_dir / KV_TRANSFER_FILE})\"",
            f"# ({config_dir / ENV_FILE} sets the same values as environment variables instead.)",
            "# Check: kvctl config validate " + str(config_dir),
        ]
        comments = INPROCESS_COMMENTS
    else:
        argv, secret_env = mp_server_launch(generated.lmcache)
        header += [
            "# Multiprocess mode: settings of `lmcache server`, one key per server flag (kvctl serve",
            "# turns them into flags); vLLM connects with LMCacheMPConnector (kv-transfer-config.json).",
            "# Equivalent command:",
            "#   lmcache server " + shlex.join(argv),
        ]
        if secret_env:
            header.append(f"# with {' and '.join(secret_env)} set to the resp adapter's credentials (kept off the "
                          "command line)")
        comments = {}
    for note in generated.notes:
        header.append(f"# Note: {note}")
    lines = header + [""]
    for key, value in generated.lmcache.items():
        line = _yaml_line(key, value)
        comment = comments.get(key)
        lines.append(f"{line}  # {comment}" if comment and "\n" not in line else line)
    return "\n".join(lines) + "\n"


def _render_env(generated: GeneratedConfig) -> str:
    lines = [
        f"# Generated by kvctl {__version__} (kvctl config init). Source it before starting vLLM / LMCache:",
        "#   source env.sh",
        "# PYTHONHASHSEED must be the same in every process that computes chunk keys.",
    ]
    if generated.mode == "inprocess":
        lines.append("# The LMCACHE_* variables are lmcache.yaml as environment variables: use one or the other.")
    lines += [f"export {name}={shlex.quote(value)}" for name, value in generated.env.items()]
    return "\n".join(lines) + "\n"


def write_files(files: dict[str, str], out_dir: Path, force: bool) -> list[Path]:
    """Write all files atomically (temp file + rename), owner-only (0600) from their creation on: they may hold
    a Redis password; refuse to replace any without `force`."""
    out_dir = out_dir.expanduser()
    targets = [out_dir / name for name in files]
    existing = [path for path in targets if path.exists()]
    if existing and not force:
        raise KvctlError(
            f"{', '.join(shown(str(path), PATH_CHARS) for path in existing)} "
            f"already exist{'s' if len(existing) == 1 else ''}",
            hint="pass --force to replace them, or choose another --out directory",
        )
    if out_dir.exists() and not out_dir.is_dir():
        raise KvctlError(f"{shown(str(out_dir), PATH_CHARS)} is not a directory", hint="choose another --out directory")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for path, text in zip(targets, files.values()):
            write_private(path, text)  # created 0600, never wider
    except OSError as error:
        raise KvctlError(f"cannot write to {shown(str(out_dir), PATH_CHARS)}: {error.strerror}",
                         hint="check the directory's permissions") from None
    return targets
