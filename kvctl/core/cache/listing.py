"""`kvctl ls`: the chunks each tier holds, with size, pin state and age where known, and totals per tier.

A live in-process engine answers for its CPU and disk tiers through kvctl's routes (the only view
that knows pins); an MP server answers for its L1 (cpu) tier through kvctl's MP routes; Redis, and
the disk directory when no engine runs, are read directly. MP chunks are named by their native key
(model@kv_rank@group@hash[@salt]) on every tier, as `kvctl keys` and `kvctl lookup` print them.
Nothing here reads a value, pins a chunk or moves it in an eviction order.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvctl_plugins.wire import MAX_PAGE as ENGINE_PAGE  # the routes' largest page (in-process and MP alike)

from kvctl.core.lmcache.deployment import DISK_SUFFIXES, REDIS_PATTERNS, REDIS_SUFFIXES, Store
from kvctl.core.lmcache.keys import CANONICAL_COUNT, CANONICAL_HASH, KEY_DTYPES, ObjectKey, parse_key, parse_object_key

EVERYTHING = 2**62


@dataclass
class Chunk:
    key: str
    size: int | None = None
    pinned: bool | None = None  # held by LMCache: its pin count, or in MP L1 a reader's lock (None: unknown)
    kvctl_pinned: bool | None = None  # held by a kvctl pin
    age_s: float | None = None  # since it was written, where the source knows


@dataclass
class TierListing:
    tier: str
    source: str  # "engine", "directory", "redis"
    total: int  # chunks in the tier (of the selected model), not just the listed ones
    chunks: list[Chunk] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        sizes = [chunk.size for chunk in self.chunks if chunk.size is not None]
        return {"tier": self.tier, "source": self.source, "total": self.total, "listed": len(self.chunks),
                "listed_bytes": sum(sizes) if sizes else None,
                "pinned": sum(bool(chunk.pinned or chunk.kvctl_pinned) for chunk in self.chunks),
                "chunks": [asdict(chunk) for chunk in self.chunks]}


def _of_model(parsed, model: str | None, mangled: bool = False) -> bool:
    """Whether a parsed chunk key (None: not a chunk key) belongs to `model`, the whole model field
    ('llama@v2' is not 'llama'). LocalDiskBackend's file names carry the model with '/' replaced by
    '-' (`mangled`), so there 'org/m' and a model named 'org-m' cannot be told apart."""
    return parsed is not None and (model is None
                                   or parsed.model_name == (model.replace("/", "-") if mangled else model))


def from_engine(worker, tier: str, limit: int, model: str | None = None) -> TierListing:
    """A live engine's CPU or disk tier, in the engine's order (LRU first for the CPU tier)."""
    listing = TierListing(tier, "engine", 0)
    offset: int | None = 0
    while offset is not None:
        page = worker.keys(tier, offset, ENGINE_PAGE if model else max(1, min(limit, ENGINE_PAGE)))
        for entry in page["keys"]:
            if model is not None and not _of_model(parse_key(entry["key"]), model):
                continue
            listing.total += 1
            if len(listing.chunks) < limit:
                listing.chunks.append(Chunk(entry["key"], entry["size"], entry["pinned"], entry["kvctl_pinned"]))
        if model is None:
            listing.total = page["total"]
            if len(listing.chunks) >= limit:
                break
        offset = page["next_offset"]
    return listing


def from_mp_l1(url: str, limit: int, model: str | None = None) -> TierListing:
    """The MP server's L1 through kvctl's MP routes, oldest write first; `pinned` = a reader holds it."""
    from kvctl.clients.mp_server import MPServerClient

    with MPServerClient(url) as server:
        entries, total = l1_entries(server, model, limit)
    return TierListing("cpu", "server", total, [Chunk(ObjectKey.from_encoded(entry["key"]).native_key(), entry["size"],
                                                      entry["locked"]) for entry in entries])


def l1_entries(server, model: str | None, limit: int = EVERYTHING) -> tuple[list[dict[str, Any]], int]:
    """(the first `limit` L1 objects, of `model` or all: {"key": encoded, "size", "locked"}; how many)."""
    entries: list[dict[str, Any]] = []
    offset, total = 0, 0
    while offset is not None and len(entries) < limit:
        page = server.keys(offset, min(ENGINE_PAGE, limit - len(entries)), model)
        entries.extend(page["keys"])
        total, offset = page["total"], page["next_offset"]
    return entries, total


def disk_chunks(store: Store, model: str | None = None) -> dict[str, str]:
    """{chunk key: file name} of a disk tier; files that name no chunk are left out."""
    from kvctl.clients.disk_tier import DiskTier

    suffix = DISK_SUFFIXES[store.layout]
    found = {}
    for name in DiskTier(store.directories, suffix).names():
        if store.layout == "mp-fs":
            parsed = parse_object_key(name)
            if _of_model(parsed, model):
                found[parsed.native_key()] = name
        elif _of_model(parse_key(name[: -len(suffix)]), model, mangled=True):
            found[name[: -len(suffix)]] = name
    return found


def from_directory(store: Store, limit: int, model: str | None = None) -> TierListing:
    """A disk tier's chunk files, oldest first (size and age from the file)."""
    found = disk_chunks(store, model)
    now = time.time()
    entries = []
    for key, name in found.items():
        for directory in store.directories:
            try:
                info = os.stat(os.path.join(directory, name))
            except OSError:
                continue
            entries.append(Chunk(key, info.st_size, age_s=round(max(0.0, now - info.st_mtime), 1)))
            break
    entries.sort(key=lambda chunk: -(chunk.age_s or 0))
    return TierListing(store.tier, "directory", len(entries), entries[:limit])


def from_redis(store: Store, limit: int, model: str | None = None) -> TierListing:
    """LMCache's chunks in Redis, found by SCAN; sizes by STRLEN of the value key (never a GET)."""
    from kvctl.clients.redis_tier import RedisTier

    with RedisTier(store.redis) as redis:
        keys, total = scan_chunks(redis, store.layout, model, limit)
        value_names = [key + "kv_bytes" for key in keys] if store.layout == "lmcache-redis" else keys
        sizes = redis.value_sizes(value_names)
    return TierListing(store.tier, "redis", total, [Chunk(key, size) for key, size in zip(keys, sizes)])


def scan_chunks(redis, layout: str, model: str | None, limit: int) -> tuple[list[str], int]:
    """(the first `limit` chunk keys in Redis, of `model` or all; how many there are). A glob also
    matches foreign keys that look alike: only names that parse as chunk keys of `model` count."""
    parse = native_object_key if layout == "mp-resp" else parse_key
    suffix = REDIS_SUFFIXES[layout]
    written = _lmcache_name(layout, model)

    def chunk_keys(names: list[str]) -> list[str]:
        return [name.removesuffix(suffix) for name in names
                if written(name) or _of_model(parse(name.removesuffix(suffix)), model)]

    keys = redis.scan(redis_pattern(layout, model), EVERYTHING, chunk_keys)  # page by page, while Redis scans on
    return keys[:limit], len(keys)


def _lmcache_name(layout: str, model: str | None):
    """A quick test for what LMCache writes most, in one regular expression per name: a chunk name of
    `model` without tags. A name it accepts is one parse_key takes for `model` (its fields spelled as
    parse_key's own patterns demand); one it refuses goes to parse_key, which decides."""
    if layout != "lmcache-redis" or not model or model.startswith("@"):  # parse_key refuses an empty first part
        return lambda _name: False
    count, chunk_hash = CANONICAL_COUNT.__self__.pattern, CANONICAL_HASH.__self__.pattern
    dtypes = "|".join(map(re.escape, sorted(KEY_DTYPES)))
    return re.compile(f"{re.escape(model)}@(?!0@)(?:{count})@(?:{count})@(?:{chunk_hash})@(?:{dtypes})"
                      f"{re.escape(REDIS_SUFFIXES[layout])}").fullmatch


def native_object_key(name: str) -> ObjectKey | None:
    """The object key a resp adapter's Redis name spells, in that adapter's own spelling only: a name
    spelled like an fs adapter file (`model@0x…@0@hash.data`) is someone else's key (None)."""
    parsed = parse_object_key(name)
    return parsed if parsed is not None and parsed.native_key() == name else None


def redis_pattern(layout: str, model: str | None) -> str:
    """SCAN pattern for a layout's chunks, of one model or of all."""
    pattern = REDIS_PATTERNS[layout]
    return pattern if model is None else _glob_escape(model) + "@" + pattern.split("@", 1)[1]


def redis_chunk_names(key: str, layout: str) -> list[str]:
    """The Redis names one chunk occupies (LMCache's connector writes two per chunk)."""
    return [key + "kv_bytes", key + "metadata"] if layout == "lmcache-redis" else [key]


def _glob_escape(text: str) -> str:
    return "".join(f"\\{char}" if char in "*?[]\\" else char for char in text)


@dataclass
class Listing:
    tiers: list[TierListing]
    errors: dict[str, str] = field(default_factory=dict)  # tier -> why it could not be listed
    failure_code: int | None = None  # the exit code of the last failure, for when nothing could be listed
    notes: list[str] = field(default_factory=list)  # what was not looked at, and why

    def as_dict(self) -> dict[str, Any]:
        return {"tiers": [tier.as_dict() for tier in self.tiers], "errors": self.errors, "notes": self.notes}


def collect(listers: dict[str, Any]) -> Listing:
    """Run each tier's lister; a tier that fails is named in `errors` and the others still list."""
    from kvctl.core.errors import KvctlError, tier_error

    listing = Listing([])
    for tier, lister in listers.items():
        try:
            listing.tiers.append(lister())
        except KvctlError as error:
            listing.errors[tier] = tier_error(error)
            listing.failure_code = error.exit_code
    return listing


def store_lister(store: Store, limit: int, model: str | None):
    return lambda: (from_directory if store.layout in DISK_SUFFIXES else from_redis)(store, limit, model)


def selected(tier: str, tiers: list[str] | None) -> bool:
    return not tiers or "all" in tiers or tier in tiers


def engine_listers(worker, info: dict[str, Any], tiers: list[str] | None, limit: int,
                   model: str | None) -> dict[str, Any]:
    """Listers for a live in-process engine's tiers: CPU and disk from the engine, Redis directly."""
    listers: dict[str, Any] = {}
    for entry in info["tiers"]:
        tier = entry["tier"]
        if not selected(tier, tiers):
            continue
        if tier in ("cpu", "disk"):
            listers[tier] = lambda tier=tier: from_engine(worker, tier, limit, model)
        elif tier == "redis":
            listers[tier] = store_lister(engine_redis_store(worker), limit, model)
    return listers


def engine_redis_store(worker) -> Store:
    """The Redis tier of a live in-process engine, from its own configuration."""
    from kvctl.core.lmcache.tiers import parse_redis_url

    return Store("redis", "lmcache-redis", redis=parse_redis_url(worker.conf(["remote_url"])["remote_url"]))


def redis_tier_keys(store: Store, model: str) -> list[str]:
    """The chunk keys of `model` in a Redis tier, by SCAN: other models' chunks and non-LMCache keys
    never match the pattern."""
    from kvctl.clients.redis_tier import RedisTier

    with RedisTier(store.redis) as redis:
        return scan_chunks(redis, store.layout, model, EVERYTHING)[0]


def unlink_chunks(store: Store, keys: list[str]) -> list[str]:
    """Remove chunks from a Redis tier, every name each one occupies; the keys of the chunks Redis
    actually removed (a name that was already gone removes nothing)."""
    from kvctl.clients.redis_tier import RedisTier

    with RedisTier(store.redis) as redis:
        removed = redis.unlink_each(keys, redis_chunk_names("", store.layout))
    return [key for key, count in zip(keys, removed) if count]


def stored_redis_keys(store: Store, keys: list[str]) -> list[str]:
    """Those of `keys` whose chunk Redis holds (LMCache's presence test: the metadata name)."""
    from kvctl.clients.redis_tier import RedisTier

    with RedisTier(store.redis) as redis:
        held = redis.exists([key + REDIS_SUFFIXES[store.layout] for key in keys])
    return [key for key, present in zip(keys, held) if present]


def store_listers(stores: list[Store], tiers: list[str] | None, limit: int, model: str | None) -> dict[str, Any]:
    return {store.tier: store_lister(store, limit, model) for store in stores if selected(store.tier, tiers)}


def list_stores(stores: list[Store], tiers: list[str] | None, limit: int, model: str | None) -> Listing:
    return collect(store_listers(stores, tiers, limit, model))


def config_stores(config_dir) -> list[Store]:
    """The stores a configuration names (none known without one; for an MP server, its L2)."""
    from kvctl.core.lmcache.deployment import read_deployment

    return read_deployment(config_dir).stores if config_dir else []
