"""Which running instances a command talks to: one (a URL, a `kvctl serve` state file or name) or a
fleet from an inventory file, and running one operation on many of them concurrently.

Inventory (`kvctl.yaml`; `--inventory`, `$KVCTL_INVENTORY`, `./kvctl.yaml`, or the user's config dir):

    instances:
      a: {state: /path/to/state.json}                 # a kvctl serve on this or a shared file system
      b: {internal_api: http://127.0.0.1:7001, vllm: http://127.0.0.1:8001, token_file: b.token}
    redis: redis://127.0.0.1:6379/0                  # shared Redis tier (optional)
    coordinator: http://127.0.0.1:9300               # LMCache MP coordinator (optional)
    controller: http://127.0.0.1:9000                # LMCache's controller: its instances join `all`

`--instance controller://HOST:PORT` is a fleet from the controller alone (kvctl.core.instance.controller_fleet).

An instance's routes token (kvctl's routes, and LMCache's own beyond loopback) is its own: `token_file:`
(the token alone) or `env_file:` (an env.sh), relative to the inventory, else its configuration's env.sh;
kvctl's environment (KVCTL_ROUTES_TOKEN) serves only an instance addressed alone. It is sent to that
instance's internal API or MP server and nowhere else.

An instance's `pins: FILE` (relative to the inventory) is the pin set `kvctl serve --name NAME` re-applies
after every start (kvctl.core.pins.pinsets).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kvctl.core.common.display import shown
from kvctl.core.common.paths import config_home
from kvctl.core.errors import ExitCode, KvctlError, UnreachableError, UsageError
from kvctl.core.instance.address import Address

INVENTORY_FILE = "kvctl.yaml"
DEFAULT_FANOUT_TIMEOUT_S = 30.0
IDENTIFY_TIMEOUT_S = 5.0


def from_state(state: dict[str, Any], name: str | None = None) -> Address:
    """A `kvctl serve`'s instance; its routes token is its configuration's (env.sh), if any."""
    endpoints = state.get("endpoints", {})
    address = Address(name or state.get("name", "default"), state.get("mode", "inprocess"),
                      list(endpoints.get("internal_api") or []), endpoints.get("vllm"),
                      endpoints.get("offload_socket"), endpoints.get("mp_http"), state.get("config_dir"),
                      state.get("model"), coordinator=endpoints.get("coordinator"))
    return grant_token(address, config_token(address.config_dir))


def worker_url(url: str, rank: int) -> str:
    """Worker r's internal API, from worker 0's: it listens on worker 0's port + r (port_start + 1 + r),
    and answers to the same routes token."""
    from kvctl.clients.http import routes_tokens

    head, _, port = url.rstrip("/").rpartition(":") if not url.startswith("unix:") else url.rpartition("_")
    separator = "_" if url.startswith("unix:") else ":"
    derived = f"{head}{separator}{int(port) + rank}"
    routes_tokens.share(url, derived)
    return derived


def from_url(url: str) -> Address:
    """An instance known only by worker 0's internal API URL, addressed alone: the routes token of
    kvctl's own environment (KVCTL_ROUTES_TOKEN, or KVCTL_ROUTES_TOKEN_FILE) is its."""
    return grant_token(Address(url, internal_api=[url]), environment_token())


# -- routes tokens: each instance's own, sent only to its servers (kvctl.clients.http.routes_tokens) --

def grant_token(address: Address, token: str | None) -> Address:
    from kvctl.clients.http import routes_tokens

    for url in [*address.internal_api, address.mp_http]:
        if url:
            routes_tokens.grant(url, token)
    return address


def has_token(address: Address) -> bool:
    from kvctl.clients.http import routes_tokens

    return any(routes_tokens.get(url) for url in [*address.internal_api, address.mp_http] if url)


def token_in(env: dict[str, str], where: str) -> str | None:
    """A routes token as a deployment's environment gives it: the value, or the file it names."""
    from kvctl_plugins.wire import TOKEN_FILE_VARIABLE, TOKEN_VARIABLE

    from kvctl.core.common.safe_files import read_text

    if env.get(TOKEN_VARIABLE):
        return env[TOKEN_VARIABLE].strip()
    if env.get(TOKEN_FILE_VARIABLE):
        try:
            return read_text(Path(env[TOKEN_FILE_VARIABLE]).expanduser()).strip() or None
        except KvctlError as error:
            raise KvctlError(f"the routes token file of {where} ({TOKEN_FILE_VARIABLE}): {error.message}",
                             hint=error.hint) from None
    return None


def environment_token() -> str | None:
    return token_in(dict(os.environ), "kvctl's environment")


def config_token(config_dir: str | os.PathLike | None) -> str | None:
    """The routes token a configuration's env.sh gives its engine, None without one."""
    from kvctl.core.common.safe_files import read_text
    from kvctl.core.lmcache.config import ENV_FILE, parse_env_file

    env_file = Path(config_dir) / ENV_FILE if config_dir else None
    if env_file is None or not env_file.is_file():
        return None
    return token_in(parse_env_file(read_text(env_file)), str(env_file))


def entry_token(name: str, entry: dict[str, Any], path: Path) -> str | None:
    """An inventory member's routes token: its own `token_file:` (the token alone) or `env_file:` (an
    env.sh), relative to the inventory; never kvctl's environment, which is no one member's."""
    from kvctl.core.common.safe_files import read_text
    from kvctl.core.lmcache.config import parse_env_file

    for key in ("token_file", "env_file"):
        if entry.get(key) is None:
            continue
        if not isinstance(entry[key], str) or not entry[key]:
            raise KvctlError(f"instance {name!r} in {path}: {key} is not a file name", hint=f"write {key}: FILE")
        file = path.parent / Path(entry[key]).expanduser()
        text = read_text(file)
        return (text.strip() or None) if key == "token_file" else token_in(parse_env_file(text), str(file))
    return None


def announce_inventory(path: Path) -> None:
    """Say which inventory is in use; the CLI replaces this with a line on stderr."""

_announced: set[Path] = set()


def find_inventory(path: Path | None = None) -> Path | None:
    """--inventory, $KVCTL_INVENTORY, ./kvctl.yaml or the user's; one found by looking (a kvctl.yaml in
    whatever directory kvctl runs in names servers that receive token ids) is announced, once."""
    if path is not None:
        if not path.is_file():
            raise UsageError(f"no inventory file at {path}", hint="write one (see 'kvctl health --help') or drop "
                             "--inventory")
        return path
    if os.environ.get("KVCTL_INVENTORY") and Path(os.environ["KVCTL_INVENTORY"]).is_file():
        return Path(os.environ["KVCTL_INVENTORY"])
    for candidate in (Path(INVENTORY_FILE), config_home() / INVENTORY_FILE):
        if candidate.is_file():
            if candidate.resolve() not in _announced:
                _announced.add(candidate.resolve())
                announce_inventory(candidate)
            return candidate
    return None


def read_inventory(path: Path) -> dict[str, Any]:
    import yaml

    from kvctl.core.common.safe_files import load_yaml_file

    try:
        data = load_yaml_file(path) or {}
    except (OSError, yaml.YAMLError) as error:
        raise KvctlError(f"cannot read the inventory {path}: {str(error).splitlines()[0]}",
                         hint="fix the YAML; see 'kvctl health --help' for its shape") from None
    if not isinstance(data, dict) or not isinstance(data.get("instances") or {}, dict):
        raise KvctlError(f"the inventory {path} is not a mapping with an 'instances:' mapping",
                         hint="see 'kvctl health --help' for its shape")
    return {**data, "instances": data.get("instances") or {}}


def _from_inventory(name: str, entry: Any, path: Path) -> Address:
    from kvctl.core.serve.state import read_state

    if not isinstance(entry, dict):
        raise KvctlError(f"instance {name!r} in {path} is not a mapping",
                         hint="give it state: FILE or internal_api: URL")
    wrong = next((key for key, value in entry.items() if not _entry_value(key, value)), None)
    if wrong is not None:
        raise KvctlError(f"instance {shown(str(name))} in {path}: {shown(str(wrong))} is not "
                         + ("a URL or a list of URLs" if wrong == "internal_api" else "a string"),
                         hint="see 'kvctl health --help' for the inventory's shape")
    if "state" in entry:
        address = from_state(read_state(Path(entry["state"]).expanduser()), name)
    elif "internal_api" in entry:
        urls = entry["internal_api"]
        urls = [urls] if isinstance(urls, str) else list(urls)
        address = Address(name, entry.get("mode", "inprocess"), urls, entry.get("vllm"), entry.get("offload_socket"),
                          entry.get("mp_http"), entry.get("config_dir"), entry.get("model"))
    elif "mp_http" in entry:
        address = Address(name, "mp", [], entry.get("vllm"), None, entry["mp_http"], entry.get("config_dir"),
                          entry.get("model"))
    else:
        raise KvctlError(f"instance {name!r} in {path} has no state, internal_api or mp_http",
                         hint="say where to find it")
    return grant_token(address, entry_token(name, entry, path) or config_token(address.config_dir))


def _entry_value(key: Any, value: Any) -> bool:
    """An inventory entry's value has the type its key needs (strings; internal_api may list them)."""
    if key == "internal_api" and isinstance(value, list):
        return bool(value) and all(isinstance(url, str) for url in value)
    return isinstance(value, str) and bool(value) or (value is None and key not in ("state", "internal_api",
                                                                                    "mp_http"))


def resolve(instance: str | None, state: Path | None = None, inventory: Path | None = None) -> list[Address]:
    """The instances a command addresses: `all` (the inventory), an inventory name, a `kvctl serve` name,
    a URL, or (nothing given) the most recent `kvctl serve`."""
    from kvctl.core.instance.controller_fleet import discover
    from kvctl.core.lmcache.controller import is_controller
    from kvctl.core.serve.state import read_state

    if is_controller(instance):
        return discover(instance)
    if instance and is_url(instance):
        return [from_url(instance)]
    path = find_inventory(inventory)
    inventory_data = read_inventory(path) if path else {"instances": {}}
    entries = inventory_data["instances"]
    if instance == "all":
        controller = inventory_data.get("controller")
        if not entries and not controller:
            raise UsageError("--instance all needs an inventory that names instances or a controller",
                             hint=f"write {INVENTORY_FILE} (see 'kvctl health --help'), pass --inventory FILE, or "
                             "--instance controller://HOST:PORT")
        members = [_member(name, entry, path) for name, entry in entries.items()]
        if controller:  # the controller's instances the inventory does not name itself
            members += [found for found in discover(str(controller)) if found.name not in entries]
        return members
    if instance and instance in entries:
        return [_from_inventory(instance, entries[instance], path)]
    address = from_state(read_state(state, instance), instance)
    return [address if has_token(address) else grant_token(address, environment_token())]  # addressed alone


def _member(name: str, entry: Any, path: Path) -> Address:
    """A fleet member; one that cannot be found (a stopped kvctl serve's state file is gone) carries
    its problem, so that the fan-out reports it and goes on with the others."""
    try:
        return _from_inventory(name, entry, path)
    except KvctlError as error:
        return Address(name, problem=error.message)


def identify(instance: Address) -> Address:
    """An instance known by one URL is an in-process worker or an MP server: LMCache's own GET /status
    says which (an MP server answers engine_type MPCacheServer; an internal API server has no such
    route), so a stock server, without kvctl's routes, is told apart as well as kvctl's."""
    from dataclasses import replace

    from kvctl.clients.internal_api import InternalAPIClient

    if instance.mode != "inprocess" or len(instance.internal_api) != 1 or instance.mp_http:
        return instance
    with InternalAPIClient(instance.internal_api[0], IDENTIFY_TIMEOUT_S) as server:
        try:
            status = server.request("GET", "/status")
        except KvctlError:
            return instance  # an in-process engine (404), or whoever reports on it says what is wrong
    is_mp = isinstance(status, dict) and status.get("engine_type") == "MPCacheServer"
    return replace(instance, mode="mp", internal_api=[], mp_http=instance.internal_api[0]) if is_mp else instance


def inventory_value(name: str, inventory: Path | None = None) -> Any:
    """A fleet-wide setting of the inventory (`redis`, `coordinator`), None without one."""
    path = find_inventory(inventory)
    return read_inventory(path).get(name) if path else None


def pin_set_file(name: str, inventory: Path | None = None) -> Path | None:
    """The `pins:` file of the inventory's instance `name` (relative to the inventory), None without one."""
    path = find_inventory(inventory)
    entry = read_inventory(path)["instances"].get(name) if path else None
    if not isinstance(entry, dict) or entry.get("pins") is None:
        return None
    if not isinstance(entry["pins"], str) or not entry["pins"]:
        raise KvctlError(f"instance {name!r} in {path}: pins is not a file name", hint="write pins: FILE (a pin set)")
    return path.parent / Path(entry["pins"]).expanduser()


def shared_redis(inventory: Path | None = None) -> str | None:
    return inventory_value("redis", inventory)


@dataclass
class Outcome:
    instance: str
    result: Any = None
    error: str | None = None
    exit_code: ExitCode = ExitCode.OK
    hint: str | None = None


def fan_out(instances: list[Address], operation: Callable[[Address], Any],
            timeout: float = DEFAULT_FANOUT_TIMEOUT_S) -> list[Outcome]:
    """Run `operation` on every instance at once; each gets `timeout` seconds and fails on its own.

    Daemon threads: a member that hangs past its time is reported and left behind, never waited for."""
    outcomes = {instance.name: Outcome(instance.name, error=f"no answer in {timeout:g} s",
                                       exit_code=ExitCode.UNREACHABLE, hint="raise --timeout, or check the instance")
                for instance in instances}

    def run(instance: Address) -> None:
        try:
            if instance.problem:
                raise UnreachableError(instance.problem, hint=instance.hint or "start it, or fix its entry in the "
                                       "inventory")
            outcomes[instance.name] = Outcome(instance.name, operation(instance))
        except KvctlError as error:
            outcomes[instance.name] = Outcome(instance.name, error=error.message, exit_code=error.exit_code,
                                              hint=error.hint)
        except Exception as error:  # noqa: BLE001 - one member's surprise must not sink the others
            outcomes[instance.name] = Outcome(instance.name, error=f"unexpected {type(error).__name__}: {error}",
                                              exit_code=ExitCode.ERROR, hint="rerun for this instance with --debug")

    threads = [threading.Thread(target=run, args=(instance,), daemon=True, name=f"kvctl-{instance.name}")
               for instance in instances]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [outcomes[instance.name] for instance in instances]


@dataclass
class FleetReport:
    """One operation's outcome on every member of a fleet: a report per member and one exit code."""

    outcomes: list[Outcome]

    def succeeded(self) -> list[Outcome]:
        return [outcome for outcome in self.outcomes if outcome.error is None]

    def reports_and_code(self) -> tuple[list[dict], ExitCode]:
        return fleet_reports(self.outcomes, lambda result: result.as_dict() if hasattr(result, "as_dict") else result)


def fleet_reports(outcomes: list[Outcome], payload: Callable[[Any], dict[str, Any]]) -> tuple[list[dict], ExitCode]:
    """One JSON report per member (its payload, or its failure with the hint), and the exit code of the
    whole: a member that answered only in part (its own `errors`) makes the whole partial."""
    reports = [{"instance": outcome.instance, **payload(outcome.result)} if outcome.error is None else
               {"instance": outcome.instance, "errors": {"instance": outcome.error}, "hint": outcome.hint}
               for outcome in outcomes]
    code = fleet_exit_code(outcomes)
    if code == ExitCode.OK and any(report.get("errors") for report in reports):
        code = ExitCode.PARTIAL
    return reports, code


def fleet_exit_code(outcomes: list[Outcome]) -> ExitCode:
    """0 when all succeeded; the failure's own code when the only (or every) target failed alike; else 6."""
    failed = [outcome for outcome in outcomes if outcome.error is not None]
    if not failed:
        return ExitCode.OK
    if len(failed) == len(outcomes) and len({outcome.exit_code for outcome in failed}) == 1:
        return failed[0].exit_code
    return ExitCode.PARTIAL


def coordinator_url(explicit: str | None, config_dir: str | None, served: str | None = None) -> str | None:
    """Where an MP fleet's pins live (the coordinator receives the prompt's token ids): --coordinator,
    else the server's own --coordinator-url from its configuration, else the one kvctl serve started
    for it, else the inventory's `coordinator:` (an inventory never overrides what the server uses)."""
    from kvctl.core.lmcache.deployment import read_deployment

    own = read_deployment(config_dir).values.get("coordinator_url") if config_dir else None
    return explicit or own or served or inventory_value("coordinator")


def is_url(instance: str) -> bool:
    return "://" in instance or instance.startswith("unix:")
