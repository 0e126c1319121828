"""Management operations on a live LMCacheEngine: what LMCache 0.5.6 lacks over HTTP.

Lookups here never pin and never touch eviction order (backend `contains(key, pin=False)` only).
Tiers are named as users say them: cpu (LocalCPUBackend), disk (LocalDiskBackend), redis (a
RemoteBackend on a redis URL; other remotes are "remote").
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any


class BadRequest(ValueError):
    """The client asked for something malformed (HTTP 400)."""


class NotFound(LookupError):
    """The client named something that does not exist (HTTP 404)."""


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


def validate_tokens(tokens: Any) -> list[int]:
    if not isinstance(tokens, list) or not tokens or not all(
            isinstance(token, int) and not isinstance(token, bool) and token >= 0 for token in tokens):
        raise BadRequest("tokens must be a non-empty list of non-negative integers")
    return tokens


def chunk_keys(engine, tokens: list[int]) -> list[tuple[int, int, Any]]:
    """(start, end, CacheEngineKey) per chunk, from the engine's own token database."""
    return list(engine.token_database.process_tokens(tokens=validate_tokens(tokens)))


def parse_keys(engine, texts: Any) -> list[Any]:
    from lmcache.utils import CacheEngineKey

    if not isinstance(texts, list) or not texts or not all(isinstance(text, str) for text in texts):
        raise BadRequest("keys must be a non-empty list of key strings")
    keys = []
    for text in texts:
        try:
            keys.append(CacheEngineKey.from_string(text))
        except Exception:  # noqa: BLE001 - any parse failure is the client's
            raise BadRequest(f"not an LMCache chunk key: {text!r}") from None
    return keys


# -- lookup and info ------------------------------------------------------------------------------


def lookup(engine, tokens: list[int]) -> dict[str, Any]:
    chunks = chunk_keys(engine, tokens)
    order = backends(engine)
    presence = {tier: [backend.contains(key, False) for _, _, key in chunks] for tier, _, backend in order}
    sizes = [end - start for start, end, _ in chunks]
    hit_tokens = {tier: _prefix_tokens(flags, sizes) for tier, flags in presence.items()}
    total = 0
    for tier, _, _ in order:  # StorageManager.batched_contains: each tier serves the next prefix
        flags = presence[tier]
        while total < len(flags) and flags[total]:
            total += 1
    hit_tokens["total"] = sum(sizes[:total])
    return {
        "prompt_tokens": len(tokens),
        "chunks": [{"index": i, "start": start, "end": end, "key": key.to_string(),
                    "tiers": [tier for tier, _, _ in order if presence[tier][i]]}
                   for i, (start, end, key) in enumerate(chunks)],
        "hit_tokens": hit_tokens,
        "tiers_checked": [tier for tier, _, _ in order],
    }


def _prefix_tokens(flags: list[bool], sizes: list[int]) -> int:
    count = 0
    while count < len(flags) and flags[count]:
        count += 1
    return sum(sizes[:count])


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
    if offset < 0 or not 0 < limit <= 10000:
        raise BadRequest("offset must be >= 0 and limit between 1 and 10000")
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

    def pin(self, engine, tokens: list[int], ttl_s: float | None, tiers: list[str] | None) -> Pin:
        if ttl_s is not None and not (isinstance(ttl_s, (int, float)) and ttl_s > 0):
            raise BadRequest("ttl_s must be a positive number of seconds (or null: until unpinned)")
        chunks = chunk_keys(engine, tokens)
        pinned: dict[str, list[Any]] = {}
        for tier, name, backend in select_backends(engine, tiers or ["cpu", "disk"]):
            if tier not in ("cpu", "disk"):
                continue  # remote tiers have no pins in LMCache 0.5.6 (no-ops)
            keys = [key for _, _, key in chunks if backend.pin(key)]
            if keys:
                pinned[name] = keys
        pin = Pin(uuid.uuid4().hex[:12], pinned, time.time(), None if ttl_s is None else time.time() + ttl_s,
                  sum(end - start for start, end, _ in chunks), len(chunks))
        with self.lock:
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


def evict(engine, pins: PinRegistry, *, tokens: list[int] | None = None, keys: list[str] | None = None,
          tiers: list[str] | None = None, all_keys: bool = False, dry_run: bool = False,
          force: bool = False) -> dict[str, Any]:
    """Remove chunks from the selected tiers; kvctl-pinned chunks stay unless `force`."""
    selectors = sum(x is not None and x is not False for x in (tokens, keys)) + (1 if all_keys else 0)
    if selectors != 1:
        raise BadRequest("give exactly one of tokens, keys, or all (with tiers)")
    chosen = select_backends(engine, tiers)
    if tokens is not None:
        targets = [key for _, _, key in chunk_keys(engine, tokens)]
    elif keys is not None:
        targets = parse_keys(engine, keys)
    else:
        targets = None
    protected = set() if force else pins.pinned_keys()
    removed: dict[str, int] = {}
    skipped: dict[str, int] = {}
    listed: list[dict[str, Any]] = []
    for tier, name, backend in chosen:
        if targets is None:
            if name == "LocalCPUBackend":
                candidates = backend.get_keys()
            elif name == "LocalDiskBackend":
                with backend.disk_lock:
                    candidates = list(backend.dict.keys())
            else:
                raise BadRequest(f"'all' cannot enumerate the {tier} tier from inside LMCache; evict it by keys "
                                 "(kvctl evict --tier redis lists Redis directly)")
        else:
            candidates = [key for key in targets if backend.contains(key, False)]
        keep = [key for key in candidates if key in protected]
        go = [key for key in candidates if key not in protected]
        skipped[tier] = len(keep)
        listed.extend({"tier": tier, "key": key.to_string()} for key in go)
        if dry_run:
            removed[tier] = len(go)
        elif tier == "redis":
            removed[tier] = _remove_from_redis(engine, go)
        else:
            removed[tier] = sum(1 for key in go if backend.remove(key, True))
    return {"dry_run": dry_run, "removed": removed, "skipped_pinned": skipped, "chunks": listed}


def _remove_from_redis(engine, keys: list[Any]) -> int:
    """Delete chunks from the Redis tier; LMCache 0.5.6's RedisConnector has no remove_sync.

    RedisConnector writes two entries per chunk, "<key>kv_bytes" and "<key>metadata".
    """
    import redis

    url = str(engine.config.remote_url)
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise BadRequest(f"evicting from {url.split('://')[0]}:// remotes is not supported; use kvctl evict --tier redis")
    client = redis.Redis.from_url(url)
    try:
        removed = 0
        for key in keys:
            name = key.to_string()
            removed += 1 if client.unlink(name + "kv_bytes", name + "metadata") else 0
        return removed
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
