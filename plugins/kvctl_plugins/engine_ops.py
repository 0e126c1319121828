"""Management operations on a live LMCacheEngine: what LMCache 0.5.6 lacks over HTTP.

Lookups here never pin and never touch eviction order (backend `contains(key, pin=False)` only).
Tiers are named as users say them: cpu (LocalCPUBackend), disk (LocalDiskBackend), redis (a
RemoteBackend on a redis URL; other remotes are "remote").
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec

from kvctl_plugins import engine_keys, protocol, wire
from kvctl_plugins.protocol import BadRequest, NotFound

PINNABLE = ("cpu", "disk")  # remote tiers have no pins in LMCache 0.5.6 (no-ops)
PIN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}").fullmatch


def tier_of(backend_name: str, engine) -> str:
    if backend_name == "LocalCPUBackend":
        return "cpu"
    if backend_name == "LocalDiskBackend":
        return "disk"
    if backend_name.startswith("RemoteBackend"):
        url = str(getattr(engine.config, "remote_url", "") or "")
        return "redis" if url.startswith(("redis", "rediss", "unix")) else "remote"
    return backend_name


def backends(engine) -> list[tuple[str, str, Any]]:
    """(tier, LMCache backend name, backend) in LMCache's lookup order."""
    return [(tier_of(name, engine), name, backend) for name, backend in engine.storage_manager.storage_backends.items()]


def select_backends(engine, tiers: list[str] | None) -> list[tuple[str, str, Any]]:
    chosen = backends(engine)
    if not tiers or "all" in tiers:
        return chosen
    known = {tier for tier, _, _ in chosen}
    unknown = [tier for tier in tiers if tier not in known]
    if unknown:
        raise BadRequest(f"no such tier here: {', '.join(unknown)} (this engine has {', '.join(sorted(known))})")
    return [entry for entry in chosen if entry[0] in tiers]


def chunk_keys(engine, tokens: Any) -> list[tuple[int, int, Any]]:
    """(start, end, CacheEngineKey) per chunk of a request's token ids, as the engine makes them."""
    return engine_keys.chunk_keys(engine, protocol.tokens(tokens))


def parse_keys(texts: Any) -> list[Any]:
    """The distinct chunk keys named, in order."""
    from lmcache.utils import CacheEngineKey

    keys = []
    for text in dict.fromkeys(protocol.strings(texts, "keys", protocol.MAX_KEYS)):
        try:
            keys.append(CacheEngineKey.from_string(text))
        except Exception:  # noqa: BLE001 - any parse failure is the client's
            raise BadRequest(f"not an LMCache chunk key: {text!r}") from None
    return keys


# -- lookup and info ------------------------------------------------------------------------------


class LookupBody(msgspec.Struct, forbid_unknown_fields=True):
    """A lookup's body as protocol.tokens accepts it: a non-empty list of token ids, nothing else."""

    tokens: Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=protocol.MAX_TOKEN_ID)]],
                      msgspec.Meta(min_length=1, max_length=protocol.MAX_TOKENS)]


LOOKUP_BODY = msgspec.json.Decoder(LookupBody)


def lookup_tokens(raw: bytes) -> list[int]:
    """A lookup body's token ids, parsed and checked in one pass of C: json.loads and a check per token
    in Python were most of a 128K-token lookup. What that pass refuses (a mistake, or another field)
    goes the common way, to be answered or refused exactly as before."""
    try:
        return LOOKUP_BODY.decode(raw).tokens
    except msgspec.DecodeError:  # ValidationError too
        return protocol.tokens(protocol.parse_body(raw).get("tokens"))


def lookup(engine, tokens: list[int]) -> dict[str, Any]:
    """What each tier holds of the prompt `tokens` (checked already: lookup_tokens)."""
    chunks = engine_keys.chunk_keys(engine, tokens)
    order = backends(engine)
    tiers = [tier for tier, _, _ in order]  # LMCache's lookup order: the walk the hit total follows
    presence = {tier: [backend.contains(key, False) for _, _, key in chunks] for tier, _, backend in order}
    sizes = [end - start for start, end, _ in chunks]
    return {
        "prompt_tokens": len(tokens),
        "chunks": [{"index": i, "start": start, "end": end, "key": key.to_string(),
                    "tiers": [tier for tier in tiers if presence[tier][i]]}
                   for i, (start, end, key) in enumerate(chunks)],
        "hit_tokens": wire.hit_tokens(presence, sizes, tiers),
        "tiers_checked": tiers,
    }


def info(engine, pins: PinRegistry) -> dict[str, Any]:
    from kvctl_plugins import __version__
    from kvctl_plugins.disk_index import rebuild_reports

    config, metadata = engine.config, engine.metadata
    tiers = []
    for tier, name, backend in backends(engine):
        entry = {"tier": tier, "backend": name}
        if name == "LocalCPUBackend":
            keys = backend.get_keys()
            entry.update(capacity_bytes=int(config.max_local_cpu_size * 1024**3), keys=len(keys),
                         used_bytes=sum(_cpu_size(backend, key) for key in keys))
        elif name == "LocalDiskBackend":
            entry.update(capacity_bytes=int(backend.max_cache_size), keys=len(backend.dict),
                         used_bytes=int(backend.current_cache_size), path=backend.path)
        tiers.append(entry)
    return {
        "plugin_version": __version__,
        "model": metadata.model_name,
        "chunk_size": config.chunk_size,
        "hash_algorithm": config.pre_caching_hash_algorithm,
        "save_unfull_chunk": config.save_unfull_chunk,
        "world_size": metadata.world_size,
        "worker_id": metadata.worker_id,
        "kv_dtype": str(metadata.kv_dtype).removeprefix("torch."),
        "instance_id": config.lmcache_instance_id,
        "tiers": tiers,
        "pins": len(pins.list()),
        "disk_index": rebuild_reports(),
    }


def _cpu_size(backend, key) -> int:
    memory_obj = backend.hot_cache.get(key)
    return int(memory_obj.get_size()) if memory_obj is not None else 0


# -- listing --------------------------------------------------------------------------------------


def list_keys(engine, tier: str, offset: int, limit: int, pins: PinRegistry) -> dict[str, Any]:
    (tier_name, name, backend), = select_backends(engine, [tier])
    if name == "LocalCPUBackend":
        keys = backend.get_keys()  # LRU -> MRU
        entry = lambda key: {"size": _cpu_size(backend, key),  # noqa: E731
                             "pinned": bool(getattr(backend.hot_cache.get(key), "is_pinned", False))}
    elif name == "LocalDiskBackend":
        with backend.disk_lock:
            keys = list(backend.dict.keys())
        entry = lambda key: {"size": int(getattr(backend.dict.get(key), "size", 0)),  # noqa: E731
                             "pinned": bool(getattr(backend.dict.get(key), "is_pinned", False))}
    else:
        raise BadRequest(f"the {tier_name} tier cannot be listed from inside LMCache; kvctl reads Redis directly")
    page = keys[offset:offset + limit]
    return {
        "tier": tier_name,
        "total": len(keys),
        "offset": offset,
        "next_offset": offset + len(page) if offset + len(page) < len(keys) else None,
        "keys": [{"key": key.to_string(), **entry(key), "kvctl_pinned": pins.holds(key)} for key in page],
    }


# -- pins -----------------------------------------------------------------------------------------


@dataclass
class Pin:
    pin_id: str
    keys: dict[str, list[Any]]  # backend name -> pinned keys
    created: float
    expires: float | None
    tokens: int
    chunks: int

    def as_dict(self, engine=None) -> dict[str, Any]:
        return {"pin_id": self.pin_id, "chunks": self.chunks, "tokens": self.tokens, "created": self.created,
                "expires": self.expires,
                "ttl_remaining_s": None if self.expires is None else max(0.0, round(self.expires - time.time(), 1)),
                "pinned": {tier_of(name, engine) if engine else name: len(keys) for name, keys in self.keys.items()}}


@dataclass
class PinRegistry:
    """kvctl's explicit pins: each holds one LMCache pin per chunk and tier until unpinned or expired.

    LMCache's PinMonitor force-unpins objects pinned longer than pin_timeout_sec (300 s); the keeper
    thread re-registers kvctl's pinned objects with it, so a kvctl pin lasts as long as its TTL.
    """

    pins: dict[str, Pin] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    engine: Any = None
    keeper: threading.Thread | None = None

    def holds(self, key) -> bool:
        with self.lock:
            return any(key in keys for pin in self.pins.values() for keys in pin.keys.values())

    def pinned_keys(self) -> set:
        with self.lock:
            return {key for pin in self.pins.values() for keys in pin.keys.values() for key in keys}

    def pin(self, engine, tokens: list[int], ttl_s: Any, tiers: list[str] | None, pin_id: Any = None,
            replace: bool = False) -> Pin:
        """Pin a prompt's chunks on the given tiers, or on whichever of cpu and disk the engine has. A
        client pinning on every tensor-parallel worker gives them all one `pin_id`. With `replace`, a pin
        of that id is released only once the new one holds its chunks (a pin set's refresh: its chunks
        are never unpinned in between)."""
        ttl_s = protocol.ttl_seconds(ttl_s)
        if pin_id is not None and not PIN_ID(protocol.string(pin_id, "pin_id")):
            raise BadRequest("pin_id must be 1-64 letters, digits, '-' or '_'")
        chunks = chunk_keys(engine, tokens)
        pinned: dict[str, list[Any]] = {}
        for tier, name, backend in select_backends(engine, tiers):
            if tier not in PINNABLE:
                continue
            keys = [key for _, _, key in chunks if backend.pin(key)]
            if keys:
                pinned[name] = keys
        pin = Pin(pin_id or uuid.uuid4().hex[:12], pinned, time.time(), None if ttl_s is None else time.time() + ttl_s,
                  sum(end - start for start, end, _ in chunks), len(chunks))
        with self.lock:
            replaced = self.pins.get(pin.pin_id)
            if replaced is not None and not replace:
                self._release(pin)
                raise BadRequest(f"pin {pin.pin_id!r} exists already")
            self.pins[pin.pin_id] = pin
            if replaced is not None:
                self._release(replaced)
        self._start_keeper(engine)
        return pin

    def unpin(self, pin_id: str) -> Pin:
        with self.lock:
            pin = self.pins.pop(pin_id, None)
        if pin is None:
            raise NotFound(f"no pin {pin_id!r}")
        self._release(pin)
        return pin

    def unpin_tokens(self, engine, tokens: list[int]) -> list[Pin]:
        wanted = {key for _, _, key in chunk_keys(engine, tokens)}
        with self.lock:
            matching = [pin_id for pin_id, pin in self.pins.items()
                        if any(key in wanted for keys in pin.keys.values() for key in keys)]
        return [self.unpin(pin_id) for pin_id in matching]

    def unpin_all(self) -> list[Pin]:
        with self.lock:
            pin_ids = list(self.pins)
        return [self.unpin(pin_id) for pin_id in pin_ids]

    def forget(self, backend_name: str, key) -> None:
        """Drop a removed chunk from every pin: its LMCache pins went with it, and an unpin must never
        reach a chunk stored again under the same key."""
        with self.lock:
            for pin in self.pins.values():
                held = pin.keys.get(backend_name, [])
                if key in held:
                    remaining = [other for other in held if other != key]
                    if remaining:
                        pin.keys[backend_name] = remaining
                    else:
                        del pin.keys[backend_name]

    def list(self) -> list[Pin]:
        self.expire()
        with self.lock:
            return list(self.pins.values())

    def expire(self) -> None:
        now = time.time()
        with self.lock:
            expired = [pin_id for pin_id, pin in self.pins.items() if pin.expires is not None and pin.expires <= now]
        for pin_id in expired:
            try:
                self.unpin(pin_id)
            except NotFound:
                pass

    def _release(self, pin: Pin) -> None:
        for name, keys in pin.keys.items():
            backend = self.engine.storage_manager.storage_backends.get(name) if self.engine else None
            if backend is not None:
                for key in keys:
                    backend.unpin(key)

    def _refresh(self) -> None:
        """Re-register kvctl-pinned CPU objects with PinMonitor so its timeout never fires on them."""
        from lmcache.v1.pin_monitor import PinMonitor

        monitor = PinMonitor.GetOrCreate(self.engine.config)
        cpu = self.engine.storage_manager.storage_backends.get("LocalCPUBackend")
        if cpu is None:
            return
        for key in self.pinned_keys():
            memory_obj = cpu.hot_cache.get(key)
            if memory_obj is not None and memory_obj.is_pinned:
                monitor.on_pin(memory_obj)

    def _start_keeper(self, engine) -> None:
        self.engine = engine
        if self.keeper is not None and self.keeper.is_alive():
            return
        interval = max(1.0, min(30.0, float(getattr(engine.config, "pin_timeout_sec", 300)) / 4))

        def keep() -> None:
            while True:
                time.sleep(interval)
                try:
                    self.expire()
                    self._refresh()
                except Exception:  # noqa: BLE001 - the keeper must outlive a bad round
                    pass

        self.keeper = threading.Thread(target=keep, name="kvctl-pin-keeper", daemon=True)
        self.keeper.start()


# -- eviction -------------------------------------------------------------------------------------

REMOVED, KVCTL_PIN, LMCACHE_HOLD = "removed", "kvctl_pin", "lmcache_hold"  # what evict did with one chunk


def evict(engine, pins: PinRegistry, *, tokens: list[int] | None = None, keys: list[str] | None = None,
          tiers: list[str] | None = None, all_keys: bool = False, dry_run: bool = False,
          force: bool = False) -> dict[str, Any]:
    """Remove chunks from the selected tiers. Unless `force`, a chunk stays where it is held: by a
    kvctl pin (on every tier), or by LMCache itself (its pin count, a reader or writer holding it,
    a write in flight). skipped_pinned counts both; held_by_lmcache the second kind."""
    selectors = sum(x is not None and x is not False for x in (tokens, keys)) + (1 if all_keys else 0)
    if selectors != 1:
        raise BadRequest("give exactly one of tokens, keys, or all (with tiers)")
    chosen = select_backends(engine, tiers)
    if tokens is not None:
        targets = [key for _, _, key in chunk_keys(engine, tokens)]
    elif keys is not None:
        targets = parse_keys(keys)
    else:
        targets = None
    protected = set() if force else pins.pinned_keys()
    result: dict[str, Any] = {"dry_run": dry_run, "removed": {}, "skipped_pinned": {}, "held_by_lmcache": {},
                              "chunks": []}
    for tier, name, backend in chosen:
        take = _TAKE.get(name, _plan_other)
        outcomes = [(key, take(backend, key, key in protected, force, dry_run))
                    for key in (_all_keys(tier, name, backend) if targets is None else targets)]
        going = [key for key, outcome in outcomes if outcome == REMOVED]
        if not dry_run:
            if take is _plan_other:
                going = (_remove_from_redis(engine, going) if tier == "redis"
                         else [key for key in going if backend.remove(key, True)])
            for key in going:
                pins.forget(name, key)
        held = [outcome for _, outcome in outcomes if outcome in (KVCTL_PIN, LMCACHE_HOLD)]
        result["removed"][tier] = len(going)
        result["skipped_pinned"][tier] = len(held)
        result["held_by_lmcache"][tier] = held.count(LMCACHE_HOLD)
        result["chunks"].extend({"tier": tier, "key": key.to_string()} for key in going)
    return result


def _all_keys(tier: str, name: str, backend) -> list[Any]:
    if name == "LocalCPUBackend":
        return backend.get_keys()
    if name == "LocalDiskBackend":
        with backend.disk_lock:
            return list(backend.dict.keys())
    raise BadRequest(f"'all' cannot enumerate the {tier} tier from inside LMCache; evict it by keys "
                     "(kvctl evict --tier redis lists Redis directly)")


def _take_cpu(backend, key, protected: bool, force: bool, dry_run: bool) -> str | None:
    """Check and remove under the backend's lock, as LMCache's own eviction does, so that no lookup can
    pin the chunk in between. An object at rest has ref count 1 (the hot cache's own reference)."""
    if force and not dry_run:  # LMCache's forced remove also drops the object's pins
        return REMOVED if backend.remove(key, True) else None
    with backend.cpu_lock:
        memory_obj = backend.hot_cache.get(key)
        if memory_obj is None:
            return None
        if protected:
            return KVCTL_PIN
        if not force and (memory_obj.is_pinned or memory_obj.get_ref_count() > 1):
            return LMCACHE_HOLD
        if not dry_run:
            backend.remove(key, force=False)
            backend.cache_policy.update_on_force_evict(key)
    return REMOVED


def _take_disk(backend, key, protected: bool, force: bool, dry_run: bool) -> str | None:
    """LMCache 0.5.6's LocalDiskBackend.remove() never lowers current_cache_size: only its put-path
    eviction does, under disk_lock, before batched_remove. Without that the tier stays "full" and
    refuses every later store ("Insufficient evictable disk cache space"). remove() itself lowers
    `usage` and updates the stats monitor."""
    with backend.disk_lock:
        entry = backend.dict.get(key)
        if entry is None:
            return None
        if protected:
            return KVCTL_PIN
        if not force and (entry.is_pinned or backend.exists_in_put_tasks(key)):
            return LMCACHE_HOLD
        if not dry_run:
            backend.current_cache_size -= entry.size
            with contextlib.suppress(FileNotFoundError):  # removed from the index before the file
                backend.remove(key, force=False)
            backend.cache_policy.update_on_force_evict(key)
    return REMOVED


def _plan_other(backend, key, protected: bool, force: bool, dry_run: bool) -> str | None:
    """Remote tiers: removed in one batch after planning (no pins; a write in flight would restore it)."""
    if not backend.contains(key, False):
        return None
    if protected:
        return KVCTL_PIN
    if not force and backend.exists_in_put_tasks(key):
        return LMCACHE_HOLD
    return REMOVED


_TAKE = {"LocalCPUBackend": _take_cpu, "LocalDiskBackend": _take_disk}


def _remove_from_redis(engine, keys: list[Any]) -> list[Any]:
    """Delete chunks from the Redis tier (LMCache 0.5.6's RedisConnector has no remove_sync) with one
    pipelined UNLINK per chunk of both names RedisConnector writes, "<key>kv_bytes" and
    "<key>metadata"; the chunks removed are those whose UNLINK deleted something."""
    import redis

    url = str(engine.config.remote_url)
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise BadRequest(f"evicting from {url.split('://')[0]}:// remotes is not supported; "
                         "use kvctl evict --tier redis")
    if not keys:
        return []
    client = redis.Redis.from_url(url)
    try:
        pipeline = client.pipeline(transaction=False)
        for key in keys:
            name = key.to_string()
            pipeline.unlink(name + "kv_bytes", name + "metadata")
        return [key for key, deleted in zip(keys, pipeline.execute()) if deleted]
    finally:
        client.close()


# -- prefetch -------------------------------------------------------------------------------------


def prefetch(engine, tokens: list[int]) -> dict[str, Any]:
    """Copy a prompt's chunks that are on disk or in the remote tier into the CPU tier."""
    manager = engine.storage_manager
    cpu = manager.storage_backends.get("LocalCPUBackend")
    if cpu is None:
        raise BadRequest("this engine has no CPU tier to prefetch into")
    loaded, already, missing = 0, 0, 0
    for _, _, key in chunk_keys(engine, tokens):
        if cpu.contains(key, False):
            already += 1
            continue
        lower = [name for name, backend in manager.storage_backends.items()
                 if name != "LocalCPUBackend" and backend.contains(key, False)]
        if not lower:
            missing += 1
            continue
        memory_obj = manager.get(key, location=lower[0])  # LMCache writes the chunk back to the CPU tier
        if memory_obj is None:
            missing += 1
            continue
        memory_obj.ref_count_down()
        loaded += 1
    return {"loaded": loaded, "already_in_cpu": already, "missing": missing}


# -- live counters ------------------------------------------------------------------------------------

# LMCache's stats monitor counts into interval_* fields that its stats logger folds into /metrics every
# 10 s, then zeroes: until then /metrics miss what just happened. These are those counters, by the names
# /metrics gives them (lmcache:<name>); the monitor's field is interval_<name without num_>.
MONITOR_COUNTERS = ("num_lookup_requests", "num_lookup_tokens", "num_lookup_hits", "num_retrieve_requests",
                    "num_requested_tokens", "num_hit_tokens", "num_store_requests", "num_stored_tokens",
                    "num_vllm_hit_tokens", "num_prompt_tokens", "num_remote_read_requests", "num_remote_read_bytes",
                    "num_remote_write_requests", "num_remote_write_bytes", "local_cpu_evict_count",
                    "local_cpu_evict_keys_count", "local_cpu_evict_failed_count", "forced_unpin_count",
                    "lookup_0_hit_requests")


def _interval_field(counter: str) -> str:
    return "interval_" + counter.removeprefix("num_")


def keep_monitor_totals() -> None:
    """Have LMCache's stats monitor add each interval to totals of kvctl's before it zeroes it (its _clear
    runs under the monitor's lock), so live_counters can answer what /metrics will say once exported."""
    from lmcache.observability import LMCStatsMonitor

    original = LMCStatsMonitor._clear
    if getattr(original, "kvctl_wrapped", False):
        return

    def _clear(self) -> None:
        totals = self.__dict__.setdefault("kvctl_totals", dict.fromkeys(MONITOR_COUNTERS, 0))
        for counter in MONITOR_COUNTERS:
            totals[counter] += int(getattr(self, _interval_field(counter), 0))  # some are 0-d tensors
        original(self)

    _clear.kvctl_wrapped = True
    LMCStatsMonitor._clear = _clear


def live_counters() -> dict[str, int]:
    """This process's LMCache counters since its engine started, as of now: exported totals plus the
    interval not yet exported, read under the monitor's own lock."""
    from lmcache.observability import LMCStatsMonitor
    from lmcache.utils import _shared_observability_lock

    monitor = LMCStatsMonitor.GetOrCreate()
    with _shared_observability_lock:
        totals = getattr(monitor, "kvctl_totals", {})
        return {counter: int(totals.get(counter, 0) + getattr(monitor, _interval_field(counter), 0))
                for counter in MONITOR_COUNTERS}
