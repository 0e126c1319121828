"""LMCache's management surface: freeze, hot cache, storage backends (tiers) at runtime, runtime
configuration, chunk statistics, and the MP server's tenant quotas.

In-process, each of these lives in one LMCache process: the engine's state (freeze, hot cache,
backends, bypass) in every worker, whose internal API answers on worker 0's port + r (freeze and hot
cache also in the scheduler where it holds an engine: enable_scheduler_bypass_lookup); chunk
statistics in the scheduler (the port below worker 0's); the configuration in each process, as its
own copy. So a switch goes to every worker and is reported per worker; a status that differs
between workers is shown as such (`consistent: false`, exit 6 in the CLI).

What one kind of instance cannot do is refused with `Unsupported` (exit 2): an MP server has no
freeze, hot cache, backends or /conf; an in-process engine has no tenant quotas.

Runtime configuration (`POST /conf`) accepts every key in 0.5.6, but almost every key is copied
when the engine, a lookup client or a backend is built, so setting it live changes nothing (or,
for chunk_size or the hash algorithm, would split the keys). kvctl allows only LIVE_KEYS, each
read again on every request (checked in the 0.5.6 source), and refuses the rest.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvctl.core.errors import KvctlError, RejectedError, UsageError

# Keys LMCache 0.5.6 reads again on every request, so `POST /conf` takes effect: where it is read.
LIVE_KEYS: dict[str, str] = {
    "min_retrieve_tokens": "scheduler: get_num_new_matched_tokens",
    "save_decode_cache": "scheduler: build_connector_meta",
    "priority_limit": "scheduler: build_connector_meta",
    "blocking_timeout_secs": "workers: RemoteBackend gets",
}
# Why the others are refused, for the keys users reach for most.
REFUSED_WHY: dict[str, str] = {
    "chunk_size": "it is part of every chunk key: changing it live would split the cache",
    "pre_caching_hash_algorithm": "it makes the chunk keys: changing it live would split the cache",
    "save_unfull_chunk": "it changes which chunks are stored and their keys",
    "enable_chunk_statistics": "the statistics client is built at start",
    "store_location": "the engine copies it at start",
    "retrieve_locations": "the engine copies it at start",
}
REFUSED_DEFAULT = "LMCache reads it only when the engine, its lookup client or a backend is built"
# Tier names as users say them, and LMCache's storage backend names.
BACKENDS = {"cpu": "LocalCPUBackend", "disk": "LocalDiskBackend", "redis": "RemoteBackend",
            "remote": "RemoteBackend", "gds": "GdsBackend", "p2p": "P2PBackend", "pd": "PDBackend"}
TIERS = {"LocalCPUBackend": "cpu", "LocalDiskBackend": "disk", "RemoteBackend": "redis"}
# LocalCPUBackend is the engine's allocator: closing it leaves every store without memory.
NOT_DETACHABLE = {"LocalCPUBackend"}


# -- pure parts -------------------------------------------------------------------------------------

def backend_name(name: str) -> str:
    """LMCache's backend name for a tier name (cpu, disk, redis) or a backend name in any case."""
    text = name.strip()
    if text.lower() in BACKENDS:
        return BACKENDS[text.lower()]
    for known in (*BACKENDS.values(), *TIERS):
        if text.lower() == known.lower():
            return known
    if not text or "/" in text:
        raise UsageError(f"bad backend name {name!r}", hint="use cpu, disk, redis or a name from kvctl backends ls")
    return text  # a plugin's backend (RemoteBackend-<plugin>, a storage plugin): as LMCache names it


def tier_of(backend: str) -> str:
    return TIERS.get(backend, backend)


def refusal(key: str) -> str | None:
    """Why `key` cannot be set on a running engine (None: it can)."""
    from kvctl.core.lmcache.schema import inprocess_keys

    if key not in inprocess_keys():
        return "unknown"
    if key in LIVE_KEYS:
        return None
    return REFUSED_WHY.get(key, REFUSED_DEFAULT)


def parse_assignments(items: list[str]) -> dict[str, Any]:
    """KEY=VALUE words as LMCache's typed values; unknown and not-live keys are refused (exit 2)."""
    from kvctl.core.lmcache.config import ConversionError, convert_value
    from kvctl.core.lmcache.schema import load_schema

    aliases = load_schema()["inprocess"].get("aliases", {})
    values: dict[str, Any] = {}
    for item in items:
        key, equals, raw = item.partition("=")
        key = key.strip()
        if not equals or not key:
            raise UsageError(f"expected KEY=VALUE, got {item!r}", hint="e.g. kvctl conf set min_retrieve_tokens=512")
        key = aliases.get(key, key)
        why = refusal(key)
        if why == "unknown":
            raise UsageError(f"unknown LMCache setting {key!r}", hint="kvctl conf get lists every setting")
        if why:
            raise UsageError(f"{key} cannot be changed on a running engine: {why}",
                             hint="set it in lmcache.yaml and restart; live settings: " + ", ".join(LIVE_KEYS))
        try:
            values[key] = convert_value(key, None if raw.strip().lower() in ("null", "none") else raw)
        except ConversionError as error:
            raise UsageError(f"{key}: {error}", hint="kvctl config show lists the types") from None
    if not values:
        raise UsageError("nothing to set", hint="give KEY=VALUE, e.g. min_retrieve_tokens=512")
    return values


# -- results ----------------------------------------------------------------------------------------

@dataclass
class PerProcess:
    """One operation on every process it goes to: an answer (or an error) per process. `state`
    names the state reported (freeze, hot_cache); its value is the common one, or None when the
    processes differ (`consistent` False) or none answered."""

    state: str
    processes: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def answered(self) -> list[dict[str, Any]]:
        return [p for p in self.processes if "error" not in p]

    @property
    def consistent(self) -> bool:
        values = {repr(p.get(self.state)) for p in self.answered}
        return len(values) <= 1

    @property
    def partial(self) -> bool:
        return not self.consistent or len(self.answered) < len(self.processes)

    def value(self) -> Any:
        return self.answered[0].get(self.state) if self.answered and self.consistent else None

    def as_dict(self) -> dict[str, Any]:
        return {self.state: self.value(), "consistent": self.consistent, **self.extra, "processes": self.processes}


def _fan(targets: list[tuple[str, int | None, str]], call: Callable[[Any], dict[str, Any]], name: str,
         extra: dict[str, Any] | None = None) -> PerProcess:
    """`call(client)` on every (role, rank, url); errors per process; all failed: the first error."""
    from kvctl.clients.internal_api import InternalAPIClient

    result = PerProcess(name, extra=extra or {})
    failures: list[KvctlError] = []
    for role, rank, url in targets:
        entry: dict[str, Any] = {"process": role if rank is None else f"{role} {rank}", "url": url}
        try:
            with InternalAPIClient(url) as client:
                entry.update(call(client))
        except KvctlError as error:
            failures.append(error)
            entry["error"] = error.message
        result.processes.append(entry)
    if failures and len(failures) == len(targets):
        raise failures[0]
    return result


# -- in-process plumbing ----------------------------------------------------------------------------

def workers(instance, what: str) -> list[tuple[str, int | None, str]]:
    """('worker', r, url) for every worker of an in-process instance: the world size from worker 0's
    LMCache /meta, which every engine serves, kvctl's routes or not."""
    from kvctl.clients.internal_api import InternalAPIClient
    from kvctl.core.instance.addresses import worker_url

    worker0 = instance.engine_address(what).worker
    with InternalAPIClient(worker0) as worker:
        world_size = worker.meta().get("world_size") or 1
    return [("worker", rank, worker_url(worker0, rank)) for rank in range(int(world_size))]


def scheduler(instance, what: str) -> tuple[str, bool]:
    """The scheduler's internal API URL and whether it is known (else worker 0's port - 1, guessed)."""
    from kvctl.core.instance.addresses import worker_url

    address = instance.engine_address(what)
    if len(address.internal_api) > 1:
        return address.internal_api[0], True
    return worker_url(address.worker, -1), False


# -- freeze and hot cache ---------------------------------------------------------------------------

def _engine_targets(instance, what: str, status: Callable[[Any], Any]) -> list[tuple[str, int | None, str]]:
    """Every worker, and the scheduler when it is known and holds an engine too (it does with
    enable_scheduler_bypass_lookup; otherwise its engine routes answer 503 and it is left out)."""
    from kvctl.clients.internal_api import InternalAPIClient

    targets = workers(instance, what)
    url, known = scheduler(instance, what)
    if known:
        try:
            with InternalAPIClient(url) as client:
                status(client)
        except KvctlError:
            return targets
        return [("scheduler", None, url), *targets]
    return targets


def freeze(instance, enabled: bool | None) -> PerProcess:
    """Freeze on/off (None: status) on every worker: frozen, LMCache stores nothing new and retrieves
    from the CPU tier only."""
    targets = _engine_targets(instance, "freeze", lambda client: client.freeze())
    return _fan(targets, lambda c: {"freeze": c.freeze(enabled)["freeze"]}, "freeze")


def hot_cache(instance, enabled: bool | None) -> PerProcess:
    """The CPU tier's hot cache on/off (None: status) on every worker; off also empties it."""
    targets = _engine_targets(instance, "the hot cache", lambda client: client.hot_cache())
    return _fan(targets, lambda c: {"hot_cache": c.hot_cache(enabled)["hot_cache"]}, "hot_cache")


# -- backends ---------------------------------------------------------------------------------------

@dataclass
class Backends:
    """Every worker's backends; `backends` merges them: name, tier, class, on how many workers."""

    processes: list[dict[str, Any]]
    action: str | None = None
    backend: str | None = None
    dry_run: bool = False

    @property
    def partial(self) -> bool:
        return any("error" in p for p in self.processes) or not self.consistent

    @property
    def consistent(self) -> bool:
        return len({tuple(p.get("backends", [])) for p in self.processes if "error" not in p}) <= 1

    def merged(self) -> list[dict[str, Any]]:
        merged: dict[str, dict[str, Any]] = {}
        for process in self.processes:
            for name, kind in process.get("classes", {}).items():
                entry = merged.setdefault(name, {"name": name, "tier": tier_of(name), "class": kind, "workers": 0,
                                                 "bypassed": False})
                entry["workers"] += 1
                entry["bypassed"] = entry["bypassed"] or name in process.get("bypassed", [])
        return list(merged.values())

    def as_dict(self) -> dict[str, Any]:
        head = {} if self.action is None else {"action": self.action, "backend": self.backend, "dry_run": self.dry_run}
        processes = [{k: v for k, v in p.items() if k != "classes"} for p in self.processes]
        return {**head, "backends": self.merged(), "consistent": self.consistent, "processes": processes}


def _listing(client) -> dict[str, Any]:
    classes = client.backends()
    try:
        bypassed = client.bypass_list().get("bypassed_backends", [])
    except KvctlError:
        bypassed = []
    return {"backends": list(classes), "classes": classes, "bypassed": bypassed}


def backends(instance) -> Backends:
    return Backends(_fan(workers(instance, "backends"), _listing, "backends").processes)


def change_backend(instance, action: str, name: str | None = None, dry_run: bool = False) -> Backends:
    """attach (create the missing backends from the current configuration), detach NAME (close it),
    recreate NAME (close and create it again), bypass/unbypass NAME, on every worker. A dry run
    changes nothing and says on which workers NAME is."""
    targets = workers(instance, "backends")
    backend = backend_name(name) if name is not None else None
    if backend in NOT_DETACHABLE and action in ("detach", "recreate"):
        raise UsageError(f"refusing to {action} {backend}: it is LMCache's allocator (the CPU tier); every store "
                         "would fail", hint="to stop using it, freeze the engine (kvctl freeze on) instead")
    if backend is not None and action in ("detach", "recreate", "bypass"):
        present = backends(instance)
        if not any(backend in p.get("backends", []) for p in present.processes):
            raise RejectedError(f"no backend {backend} on this engine",
                                hint="kvctl backends ls lists them (cpu, disk, redis are accepted too)")
        if dry_run:
            for process in present.processes:
                process["present"] = backend in process.get("backends", [])
            return Backends(present.processes, action, backend, True)

    def call(client) -> dict[str, Any]:
        if action == "attach":
            answer = client.create_backends()
            done = {"created": list(answer.get("created", {}))}
        elif action == "detach":
            answer = client.close_backend(backend)
            done = {}
        elif action == "recreate":
            answer = client.recreate_backend(backend)
            done = {"created": list(answer.get("recreated", {}))}
        else:
            answer = client.bypass(backend, action == "bypass")
            done = {}
        listing = _listing(client)
        return {**done, **listing} if "backends" in listing else {**done, "backends": list(answer["backends"])}

    return Backends(_fan(targets, call, "backends").processes, action, backend, False)


# -- configuration ----------------------------------------------------------------------------------

@dataclass
class Conf:
    """Settings as every process reports them (secrets redacted); `differs` names keys whose values
    differ between processes."""

    values: dict[str, Any]
    processes: list[dict[str, Any]]
    updated: dict[str, Any] | None = None
    differs: list[str] = field(default_factory=list)

    @property
    def partial(self) -> bool:
        return bool(self.differs) or any("error" in p for p in self.processes)

    def as_dict(self) -> dict[str, Any]:
        head = {} if self.updated is None else {"updated": self.updated}
        return {**head, "values": self.values, "differs": self.differs, "processes": self.processes}


def _redacted(values: dict[str, Any]) -> dict[str, Any]:
    from kvctl.core.lmcache.config import redact

    return {key: redact(key, value) for key, value in values.items()}


def _conf_targets(instance) -> list[tuple[str, int | None, str]]:
    """Every worker, and the scheduler where it answers (a standalone engine has none)."""
    from kvctl.clients.internal_api import InternalAPIClient

    targets = workers(instance, "runtime configuration")
    url, known = scheduler(instance, "runtime configuration")
    if not known:
        try:
            with InternalAPIClient(url, timeout=2.0) as client:
                client.version()
        except KvctlError:
            return targets
    return [("scheduler", None, url), *targets]


def conf_get(instance, keys: list[str] | None = None) -> Conf:
    from kvctl.core.lmcache.schema import inprocess_keys

    unknown = [key for key in keys or [] if key not in inprocess_keys()]
    if unknown:
        raise UsageError(f"unknown LMCache setting(s): {', '.join(unknown)}", hint="kvctl conf get lists them all")
    fanned = _fan(_conf_targets(instance), lambda c: {"values": _redacted(c.conf(keys or None))}, "values")
    return _conf(fanned.processes)


def conf_set(instance, values: dict[str, Any]) -> Conf:
    """POST /conf on every process; the values as each then reports them."""

    def call(client) -> dict[str, Any]:
        answer = client.set_conf(values)
        entry: dict[str, Any] = {"values": _redacted(client.conf(list(values)))}
        if answer.get("errors"):
            entry["error"] = "; ".join(f"{key}: {why}" for key, why in answer["errors"].items())
        return entry

    fanned = _fan(_conf_targets(instance), call, "values")
    result = _conf(fanned.processes)
    result.updated = _redacted(values)
    return result


def _conf(processes: list[dict[str, Any]]) -> Conf:
    answered = [p["values"] for p in processes if "values" in p]
    keys = list(dict.fromkeys(key for values in answered for key in values))
    differs = [key for key in keys if len({repr(values.get(key)) for values in answered}) > 1]
    values = {key: answered[0].get(key) for key in keys} if answered else {}
    return Conf(values, [{k: v for k, v in p.items() if k != "values"} for p in processes], differs=differs)


# -- chunk statistics -------------------------------------------------------------------------------

@dataclass
class ChunkStats:
    action: str
    url: str
    answer: dict[str, Any]

    def summary(self) -> dict[str, Any]:
        answer = self.answer
        keys = ("enabled", "total_requests", "total_chunks", "unique_chunks", "duplicate_chunks", "reuse_rate")
        return {key: answer.get(key) for key in keys if key in answer}

    def as_dict(self) -> dict[str, Any]:
        return {"action": self.action, "scheduler": self.url, **({"summary": self.summary()}
                                                                if self.action == "status" else {}),
                "answer": self.answer}


def chunk_stats(instance, action: str) -> ChunkStats:
    """start, stop, reset or status of LMCache's chunk statistics (in the scheduler process). Refused
    (exit 2) when the engine was not started with enable_chunk_statistics."""
    from kvctl.clients.internal_api import InternalAPIClient

    hint = ("start the engine with enable_chunk_statistics: true in lmcache.yaml (and optionally "
            "chunk_statistics_auto_start_statistics: true)")
    worker_list = workers(instance, "chunk statistics")
    with InternalAPIClient(worker_list[0][2]) as worker:
        enabled = worker.conf(["enable_chunk_statistics"]).get("enable_chunk_statistics")
    if not enabled:
        raise UsageError("chunk statistics are off: the engine was not started with enable_chunk_statistics",
                         hint=hint)
    url, known = scheduler(instance, "chunk statistics")
    try:
        with InternalAPIClient(url) as client:
            answer = client.chunk_statistics(action)
    except RejectedError as error:
        raise UsageError(f"the scheduler at {url} keeps no chunk statistics: {error.message}", hint=hint) from None
    except KvctlError as error:
        if not known:
            error.hint = (f"chunk statistics live in vLLM's scheduler process, whose internal API kvctl guessed at "
                          f"{url} (worker 0's port - 1); a standalone engine has none")
        raise
    return ChunkStats(action, url, answer)


def chunk_top(instance, directory: str | os.PathLike | None, limit: int):
    """The hottest chunk prefixes and prompts (kvctl.core.admin.chunk_top), from `directory` or from where the
    instance's scheduler says its file_hash recorder writes."""
    from kvctl.core.admin.chunk_top import top

    if directory is None:
        answer = chunk_stats(instance, "status").answer
        recorder = answer.get("file_hash")
        if not isinstance(recorder, dict) or not isinstance(recorder.get("output_dir"), str):
            raise UsageError("the hottest chunks need chunk_statistics_strategy: file_hash (the default bloom filter "
                             "keeps counts, not chunks)", hint="set chunk_statistics_strategy: file_hash in "
                             "lmcache.yaml and restart; kvctl chunk-stats status shows the reuse summary meanwhile")
        directory = recorder["output_dir"]
        if not os.path.isabs(directory):
            raise UsageError(f"LMCache writes the chunk statistics to {directory}, relative to vLLM's working "
                             "directory", hint="pass --dir with that directory, or set extra_config."
                             "chunk_statistics_file_output_dir to an absolute path")
    return top(directory, limit)


# -- MP: tenant quotas ------------------------------------------------------------------------------

DEFAULT_SALT = "_default"  # the empty cache salt, as LMCache's HTTP API spells it


@dataclass
class Quotas:
    quotas: list[dict[str, Any]]
    action: str = "list"
    status: str | None = None

    def as_dict(self) -> dict[str, Any]:
        head = {"action": self.action} if self.status is None else {"action": self.action, "status": self.status}
        return {**head, "quotas": self.quotas}


def quota(instance, action: str, salt: str | None = None, limit_gb: float | None = None,
          confirm_shrink: Callable[[dict[str, Any]], None] | None = None) -> Quotas:
    """list, get SALT, set SALT LIMIT_GB, rm SALT on an MP server (soft per-cache_salt limits of its
    L2 IsolatedLRU eviction; a salt without a quota has an effective limit of 0). A set that lowers an
    existing quota evicts what is over it, as rm does: `confirm_shrink(current quota)` is asked first."""
    from kvctl.clients.mp_server import MPServerClient

    name = salt if salt else DEFAULT_SALT
    with MPServerClient(instance.mp_server_url("tenant quotas")) as server:
        if action == "list":
            users = server.quotas().get("users", {})
            return Quotas([{"cache_salt": s, **v} for s, v in users.items()])
        if action == "set":
            if limit_gb is None or not math.isfinite(limit_gb) or limit_gb < 0:
                raise UsageError("a quota is a size in GB, 0 or more", hint="e.g. kvctl quota set tenant-a 20")
            current = server.quota(name)
            if confirm_shrink is not None and current.get("exists") and limit_gb < current.get("limit_gb", 0):
                confirm_shrink(current)
            answer = server.set_quota(name, limit_gb)
            return Quotas([server.quota(name)], "set", answer.get("status"))
        if action == "rm":
            answer = server.delete_quota(name)
            if answer.get("status") == "not_found":
                raise RejectedError(f"no quota for cache salt {name}", hint="kvctl quota ls lists them")
            return Quotas([], "rm", answer.get("status"))
        return Quotas([server.quota(name)], "get")

