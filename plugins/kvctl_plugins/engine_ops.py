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
from typing import Any

from kvctl_plugins import protocol, wire
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


def chunk_keys(engine, tokens: list[int]) -> list[tuple[int, int, Any]]:
    """(start, end, CacheEngineKey) per chunk, from the engine's own token database."""
    return list(engine.token_database.process_tokens(tokens=protocol.tokens(tokens)))


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


def lookup(engine, tokens: list[int]) -> dict[str, Any]:
    chunks = chunk_keys(engine, tokens)
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

    def pin(self, engine, tokens: list[int], ttl_s: Any, tiers: list[str] | None, pin_id: Any = None) -> Pin:
        """Pin a prompt's chunks on the given tiers, or on whichever of cpu and disk the engine has. A
        client pinning on every tensor-parallel worker gives them all one `pin_id`."""
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
            if pin.pin_id in self.pins:
                self._release(pin)
                raise BadRequest(f"pin {pin.pin_id!r} exists already")
            self.pins[pin.pin_id] = pin
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


# -- chunk bytes (snapshots) ----------------------------------------------------------------------

SETTLE_S = 30.0  # how long a write waits for the disk and remote tiers' asynchronous puts to land


def read_chunks(engine, texts: Any, tiers: list[str] | None) -> tuple[bytes, int | None]:
    """A body of frames (wire.py) for those of the named keys a selected tier holds, in the order asked,
    each from the first tier in lookup order that holds it; and the index into `texts` of the first key
    left out because its frame would take the chunk bytes over wire.MAX_CHUNKS_BODY (None: all were
    answered; the first frame always goes, so a client that asks again from there gets on).

    Reading changes nothing LMCache keeps: no pin, no write-back into the CPU tier (which
    StorageManager.get adds for a disk or remote hit), no move in the disk tier's LRU order."""
    names = protocol.strings(texts, "keys", protocol.MAX_KEYS)
    chosen = select_backends(engine, tiers)
    parts, size, seen = [], 0, set()
    for index, name in enumerate(names):
        if name in seen:
            continue
        seen.add(name)
        found = _first_copy(engine, chosen, _chunk_key(name))
        if found is None:
            continue
        data, metadata = found
        if parts and size + len(data) > wire.MAX_CHUNKS_BODY:
            return b"".join(parts), index
        parts += [wire.frame_header(name, len(data), metadata), data]
        size += len(data)
    return b"".join(parts), None


def _chunk_key(text: str):
    """The CacheEngineKey a text names; it must be LMCache's own spelling of that key."""
    from lmcache.utils import CacheEngineKey

    try:
        key = CacheEngineKey.from_string(text)
    except Exception:  # noqa: BLE001 - any parse failure is the client's
        key = None
    if key is None or key.to_string() != text:
        raise BadRequest(f"not an LMCache chunk key: {text[:300]!r}")
    return key


def _first_copy(engine, chosen: list[tuple[str, str, Any]], key) -> tuple[bytes, bytes] | None:
    for _, name, backend in chosen:
        found = _read(engine, name, backend, key)
        if found is not None:
            return found
    return None


def _read(engine, name: str, backend, key) -> tuple[bytes, bytes] | None:
    """(data, RemoteMetadata header) of a chunk this backend holds. The CPU tier's get_blocking only
    takes a reference (no LRU move); a remote's allocates a CPU buffer for the copy (LMCache's
    allocate may evict CPU chunks to find one, as every remote read does). Either way the reference
    is given back here."""
    if name == "LocalDiskBackend":
        return _read_disk_file(engine, backend, key)
    memory_obj = backend.get_blocking(key)
    if memory_obj is None:
        return None
    try:
        data = bytes(memory_obj.byte_array)
        return data, remote_metadata(engine, len(data), memory_obj.get_shapes(), memory_obj.get_dtypes(),
                                     memory_obj.get_memory_format())
    finally:
        memory_obj.ref_count_down()


def _read_disk_file(engine, backend, key) -> tuple[bytes, bytes] | None:
    """The chunk's file, read directly. LocalDiskBackend.get_blocking would move the chunk to the LRU's
    recent end, stage it in a CPU buffer (evicting CPU chunks to make room) and raise KeyError when the
    file has gone; a file evicted or rewritten meanwhile is simply not held."""
    with backend.disk_lock:
        entry = backend.dict.get(key)
        if entry is None:
            return None
        path, shape, dtype, fmt = entry.path, entry.shape, entry.dtype, entry.fmt
    size = shape.numel() * dtype.itemsize
    try:
        with open(path, "rb") as file:
            data = file.read(size + 1)
    except FileNotFoundError:
        return None
    if len(data) != size:
        return None
    return data, remote_metadata(engine, size, [shape], [dtype], fmt)


def remote_metadata(engine, length: int, shapes, dtypes, fmt) -> bytes:
    """LMCache's RemoteMetadata header, exactly as its Redis connector stores it beside a chunk."""
    from lmcache.v1 import protocol as lmcache_protocol

    if lmcache_protocol.REMOTE_METADATA_FMT is None:  # set up by a remote connector, and this engine has none
        lmcache_protocol.init_remote_metadata_info(engine.metadata.get_num_groups())
    return lmcache_protocol.RemoteMetadata(length, list(shapes), list(dtypes), fmt).serialize()


def write_chunks(engine, raw: bytes, tiers: list[str] | None) -> dict[str, Any]:
    """Store a body of frames on the chosen tiers (default: the first that keeps chunks, the CPU tier).
    Every frame is checked before anything is written (_checked_frames). Per tier, a chunk the tier
    holds or is writing already is counted under "already"; the others are copied into memory objects
    from LMCache's allocator and handed to StorageManager.batched_put for that backend alone, which
    keeps the references the backend takes and drops ours. "written" counts what the tier then holds,
    once its asynchronous puts are done; "dropped" what it did not take (a full disk tier refuses)."""
    from lmcache.v1.memory_management import MemoryFormat

    manager = engine.storage_manager
    chosen = select_backends(engine, tiers) if tiers else [entry for entry in backends(engine)
                                                           if _keeps_chunks(entry[2], entry[1])][:1]
    if not chosen:
        raise BadRequest("this engine has no tier that keeps chunks")
    for tier, name, backend in chosen:
        if manager.is_backend_bypassed(name):
            raise BadRequest(f"the {tier} tier is bypassed (kvctl backends unbypass {tier})")
        if not _keeps_chunks(backend, name):
            raise BadRequest("the cpu tier keeps no chunks here (local_cpu is off or the hot cache is disabled)")
    fmt = MemoryFormat.KV_MLA_FMT if engine.metadata.use_mla else MemoryFormat.KV_2LTD
    chunks = _checked_frames(engine, raw, fmt)
    dtypes = engine.metadata.get_dtypes()
    result: dict[str, Any] = {"written": {}, "already": {}, "dropped": {}}
    for tier, name, backend in chosen:
        new = [chunk for chunk in chunks
               if not backend.exists_in_put_tasks(chunk[0]) and not backend.contains(chunk[0], False)]
        memory_objs = _filled(manager, new, dtypes, fmt)
        if new:
            manager.batched_put([key for key, _, _ in new], memory_objs, location=name)
        written = _landed(name, backend, [key for key, _, _ in new])
        result["written"][tier] = written
        result["already"][tier] = len(chunks) - len(new)
        result["dropped"][tier] = len(new) - written
    return result


def _keeps_chunks(backend, name: str) -> bool:
    return name != "LocalCPUBackend" or bool(getattr(backend, "use_hot", True))


def _checked_frames(engine, raw: bytes, fmt) -> list[tuple[Any, memoryview, list]]:
    """(key, data, shapes) of every frame; BadRequest naming the first one this engine cannot take: a
    malformed or cut-short body, a key of another engine (model, world size, worker id, KV dtype), a
    size that is no whole chunk of this engine, a metadata header other than the one this engine
    makes for that many tokens."""
    from lmcache.utils import TORCH_DTYPE_TO_STR_DTYPE

    config, metadata = engine.config, engine.metadata
    if getattr(config, "use_layerwise", False):
        raise BadRequest("this engine stores chunks layer by layer, under per-layer keys: chunk frames cannot be "
                         "loaded into it")
    try:
        frames = list(wire.read_frames(raw))
    except ValueError as failure:
        raise BadRequest(f"the body is not chunk frames: {failure}") from None
    if not frames:
        raise BadRequest("the body holds no chunk frames")
    if sum(len(data) for _, data, _ in frames) > wire.MAX_CHUNKS_BODY:
        raise protocol.TooLarge(f"the chunks are over {wire.MAX_CHUNKS_BODY} bytes; send them in several requests")
    chunk_size, dtypes = config.chunk_size, metadata.get_dtypes()
    full = metadata.get_shapes(chunk_size)
    token_bytes = sum(shape.numel() * dtype.itemsize for shape, dtype in zip(full, dtypes, strict=True)) // chunk_size
    world_size = 1 if getattr(engine.token_database, "save_only_first_rank", False) else metadata.world_size
    ours = {"model": metadata.model_name, "world size": world_size, "worker id": metadata.worker_id,
            "KV dtype": TORCH_DTYPE_TO_STR_DTYPE[metadata.kv_dtype]}
    checked, seen = [], set()
    for text, data, header in frames:
        key = _chunk_key(text)
        if text in seen:
            raise BadRequest(f"{text!r} comes twice in the body")
        seen.add(text)
        theirs = {"model": key.model_name, "world size": key.world_size, "worker id": key.worker_id,
                  "KV dtype": TORCH_DTYPE_TO_STR_DTYPE[key.dtype]}
        for what, value in ours.items():
            if theirs[what] != value:
                raise BadRequest(f"{text!r} is a chunk of {what} {theirs[what]!r}; this engine's {what} is {value!r}")
        tokens, rest = divmod(len(data), token_bytes)
        if rest or not 0 < tokens <= chunk_size or (tokens < chunk_size and not config.save_unfull_chunk):
            raise BadRequest(f"{text!r} has {len(data)} bytes: not a chunk of this engine (a whole chunk is "
                             f"{token_bytes * chunk_size} bytes, {token_bytes} a token"
                             f"{'' if config.save_unfull_chunk else '; save_unfull_chunk is off'})")
        shapes = metadata.get_shapes(tokens)
        if header is not None and header != remote_metadata(engine, len(data), shapes, dtypes, fmt):
            raise BadRequest(f"the metadata of {text!r} ({_described(header)}) is not what this engine makes for "
                             f"{tokens} tokens ({_described(remote_metadata(engine, len(data), shapes, dtypes, fmt))})")
        checked.append((key, data, shapes))
    return checked


def _described(header: bytes) -> str:
    from lmcache.v1 import protocol as lmcache_protocol

    try:
        if len(header) != lmcache_protocol.get_remote_metadata_bytes():
            raise ValueError
        parsed = lmcache_protocol.RemoteMetadata.deserialize(header)
    except Exception:  # noqa: BLE001 - whatever it is, it is not a header of this engine
        return f"{len(header)} bytes that are no RemoteMetadata header here"
    shapes = ", ".join(str(list(shape)) for shape in parsed.shapes)
    dtypes = ", ".join(str(dtype).removeprefix("torch.") for dtype in parsed.dtypes)
    return f"length {parsed.length}, shape {shapes}, dtype {dtypes}, format {parsed.fmt.name}"


def _filled(manager, chunks: list[tuple[Any, memoryview, list]], dtypes, fmt) -> list[Any]:
    """A memory object from LMCache's allocator per chunk, holding its bytes (allocating may evict CPU
    chunks, as a store does; it never waits). NoRoom, with nothing kept, when LMCache has no room."""
    memory_objs: list[Any] = []
    try:
        for _key, data, shapes in chunks:
            memory_obj = manager.allocate(shapes, dtypes, fmt, busy_loop=False)
            if memory_obj is None:
                raise protocol.NoRoom(f"LMCache's CPU memory has no room for {len(chunks)} chunks at once "
                                      f"({sum(len(chunk[1]) for chunk in chunks)} bytes; what is pinned or in use "
                                      "cannot be evicted); send fewer per request")
            view = memory_obj.byte_array
            view = view.cast("B") if view.format != "B" else view
            memory_objs.append(memory_obj)
            view[:] = data
    except BaseException:
        for memory_obj in memory_objs:
            memory_obj.ref_count_down()
        raise
    return memory_objs


def _landed(name: str, backend, keys: list[Any]) -> int:
    """How many of `keys` the backend holds once its puts are done: the CPU tier's at once, the disk
    tier's when its writer leaves the put tasks (it indexes a file before that), a remote's when the
    remote has it, for at most SETTLE_S."""
    deadline = time.monotonic() + SETTLE_S
    pending, landed = list(keys), 0
    while True:
        waiting = []
        for key in pending:
            in_flight = name != "LocalCPUBackend" and (name != "LocalDiskBackend" or backend.exists_in_put_tasks(key))
            if backend.contains(key, False):
                landed += 1
            elif in_flight:
                waiting.append(key)
        pending = waiting
        if not pending or time.monotonic() >= deadline:
            return landed
        time.sleep(0.05)
