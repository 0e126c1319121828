"""Which running instances a command talks to: one (a URL, a `kvctl serve` state file or name) or a
fleet from an inventory file, and running one operation on many of them concurrently.

Inventory (`kvctl.yaml`; `--inventory`, `$KVCTL_INVENTORY`, `./kvctl.yaml`, or the user's config dir):

    instances:
      a: {state: /path/to/state.json}                 # a kvctl serve on this or a shared file system
      b: {internal_api: http://127.0.0.1:7001, vllm: http://127.0.0.1:8001}
    redis: redis://127.0.0.1:6379/0                  # shared Redis tier (optional)
    coordinator: http://127.0.0.1:9300               # LMCache MP coordinator (optional)
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from kvctl.core.errors import ExitCode, KvctlError, UsageError
from kvctl.core.paths import config_home

INVENTORY_FILE = "kvctl.yaml"
DEFAULT_FANOUT_TIMEOUT_S = 30.0


@dataclass
class Instance:
    name: str
    mode: str = "inprocess"  # "inprocess" or "mp"
    internal_api: list[str] = field(default_factory=list)  # scheduler, then worker 0, 1, ...
    vllm: str | None = None
    offload_socket: str | None = None
    mp_http: str | None = None
    config_dir: str | None = None
    model: str | None = None

    @property
    def worker(self) -> str | None:
        """Worker 0's internal API URL, where kvctl's routes answer for the engine."""
        return self.internal_api[1] if len(self.internal_api) > 1 else (self.internal_api or [None])[0]


def from_state(state: dict[str, Any], name: str | None = None) -> Instance:
    endpoints = state.get("endpoints", {})
    return Instance(name or state.get("name", "default"), state.get("mode", "inprocess"),
                    list(endpoints.get("internal_api") or []), endpoints.get("vllm"), endpoints.get("offload_socket"),
                    endpoints.get("mp_http"), state.get("config_dir"), state.get("model"))


def from_url(url: str) -> Instance:
    """An instance known only by worker 0's internal API URL."""
    return Instance(url, internal_api=[url])


def find_inventory(path: Path | None = None) -> Path | None:
    if path is not None:
        if not path.is_file():
            raise UsageError(f"no inventory file at {path}", hint="write one (see 'kvctl health --help') or drop "
                             "--inventory")
        return path
    for candidate in (os.environ.get("KVCTL_INVENTORY"), INVENTORY_FILE, config_home() / INVENTORY_FILE):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def read_inventory(path: Path) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as error:
        raise KvctlError(f"cannot read the inventory {path}: {str(error).splitlines()[0]}",
                         hint="fix the YAML; see 'kvctl health --help' for its shape") from None
    instances = data.get("instances") if isinstance(data, dict) else None
    if not isinstance(instances, dict) or not instances:
        raise KvctlError(f"the inventory {path} names no instances",
                         hint="add an 'instances:' mapping of name -> {state: FILE} or {internal_api: URL}")
    return data


def _from_inventory(name: str, entry: Any, path: Path) -> Instance:
    from kvctl.core.launch import read_state

    if not isinstance(entry, dict):
        raise KvctlError(f"instance {name!r} in {path} is not a mapping", hint="give it state: FILE or internal_api: URL")
    if "state" in entry:
        return from_state(read_state(Path(entry["state"]).expanduser()), name)
    if "internal_api" in entry:
        urls = entry["internal_api"]
        urls = [urls] if isinstance(urls, str) else list(urls)
        return Instance(name, entry.get("mode", "inprocess"), urls, entry.get("vllm"), entry.get("offload_socket"),
                        entry.get("mp_http"), entry.get("config_dir"), entry.get("model"))
    if "mp_http" in entry:
        return Instance(name, "mp", [], entry.get("vllm"), None, entry["mp_http"], entry.get("config_dir"),
                        entry.get("model"))
    raise KvctlError(f"instance {name!r} in {path} has no state, internal_api or mp_http",
                     hint="say where to find it")


def resolve(instance: str | None, state: Path | None = None, inventory: Path | None = None) -> list[Instance]:
    """The instances a command addresses: `all` (the inventory), an inventory name, a `kvctl serve` name,
    a URL, or (nothing given) the most recent `kvctl serve`."""
    from kvctl.core.launch import is_url, read_state

    if instance and is_url(instance):
        return [from_url(instance)]
    path = find_inventory(inventory)
    entries = read_inventory(path)["instances"] if path else {}
    if instance == "all":
        if not path:
            raise UsageError("--instance all needs an inventory", hint=f"write {INVENTORY_FILE} (see 'kvctl health "
                             "--help') or pass --inventory FILE")
        return [_from_inventory(name, entry, path) for name, entry in entries.items()]
    if instance and instance in entries:
        return [_from_inventory(instance, entries[instance], path)]
    return [from_state(read_state(state, instance), instance)]


def inventory_value(name: str, inventory: Path | None = None) -> Any:
    """A fleet-wide setting of the inventory (`redis`, `coordinator`), None without one."""
    path = find_inventory(inventory)
    return read_inventory(path).get(name) if path else None


def shared_redis(inventory: Path | None = None) -> str | None:
    return inventory_value("redis", inventory)


@dataclass
class Outcome:
    instance: str
    result: Any = None
    error: str | None = None
    exit_code: ExitCode = ExitCode.OK
    hint: str | None = None


def fan_out(instances: list[Instance], operation: Callable[[Instance], Any],
            timeout: float = DEFAULT_FANOUT_TIMEOUT_S) -> list[Outcome]:
    """Run `operation` on every instance at once; each gets `timeout` seconds and fails on its own."""
    pool = ThreadPoolExecutor(max_workers=min(32, max(1, len(instances))), thread_name_prefix="kvctl-fanout")
    futures = {pool.submit(operation, instance): instance for instance in instances}
    done, _pending = wait(futures, timeout=timeout)
    outcomes = []
    for future, instance in futures.items():
        if future not in done:
            outcomes.append(Outcome(instance.name, error=f"no answer in {timeout:.0f} s",
                                    exit_code=ExitCode.UNREACHABLE, hint="raise --timeout, or check the instance"))
            continue
        try:
            outcomes.append(Outcome(instance.name, future.result()))
        except KvctlError as error:
            outcomes.append(Outcome(instance.name, error=error.message, exit_code=error.exit_code, hint=error.hint))
    pool.shutdown(wait=False, cancel_futures=True)
    return outcomes


def fleet_exit_code(outcomes: list[Outcome]) -> ExitCode:
    """0 when all succeeded; the failure's own code when the only (or every) target failed alike; else 6."""
    failed = [outcome for outcome in outcomes if outcome.error is not None]
    if not failed:
        return ExitCode.OK
    if len(failed) == len(outcomes) and len({outcome.exit_code for outcome in failed}) == 1:
        return failed[0].exit_code
    return ExitCode.PARTIAL

