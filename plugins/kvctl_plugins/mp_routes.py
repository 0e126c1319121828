"""/kvctl/v1 routes on the MP server's HTTP app (`lmcache server`), loaded through the server's own
extension flag:

    lmcache server … --server-module '{"module_path": "kvctl_plugins.mp_routes"}'

LMCache calls `build_server_modules` while the server starts, before it accepts requests; it mounts
the routes on the running HTTP app and adds no request-plane module. The lookup answers from the
L1 managers' object table (`L1Manager.get_object_state`, a dict read): it reads no value, takes no
lock on any object and never touches the eviction order, unlike the request plane's `lookup`,
which prefetches and read-locks. Keys come from the server's own TokenHasher and key resolver.
The key listing copies the L1 object table under the manager's own mutex (the same brief hold
`get_object_state` takes) and reads each object's size and read-lock state: no value, no lock on an
object, no eviction-order touch. Requests are checked and the work runs off the event loop (which
also answers /healthcheck) as protocol.py says.

Chunk bytes (snapshots), as bodies of frames (wire.py) under the resp adapter's key spelling
(`model@kv_rank:08x@group:x@hash[@salt]`, metadata null):
    POST chunks/read   {"keys": [...]} -> the frames of the L1 objects held (NEXT_HEADER as in-process).
                       Each object is copied under a read lock of its own, taken and given back around
                       the copy (L1Manager.reserve_read/finish_read), so no eviction frees it meanwhile;
                       LMCache's eviction policies take recency only from touch_keys, never from reads,
                       so the eviction order is unchanged.
    POST chunks/write  frames -> {"written", "already", "dropped"}: {"cpu": objects}. Every frame is
                       checked first (a key of a model and world size some KV cache registered, an
                       object group it has, exactly that group's object size); then each object goes
                       through StorageManager.reserve_write / finish_write_by_owner like a store, so
                       L1's accounting, eviction, L2 store policy and coordinator events see a write.
                       A failure while storing answers 500 with the same counts for the objects before
                       it (admitted objects stay: the L2 store policy may already be copying them).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvctl_plugins import protocol
from kvctl_plugins.protocol import BadRequest
from kvctl_plugins.wire import MP_HASH_BYTES, PREFIX, error_body

HTTP_SERVER_MODULE = "lmcache.v1.multiprocess.http_server"
router = APIRouter(prefix=PREFIX)
ROOM_WAIT_S = 5.0  # how long a write waits for L1's eviction controller to make room (it runs in the background)
ROOM_POLL_S = 0.25  # between reservations while L1 is full
logger = logging.getLogger(__name__)


def build_server_modules(_build_context) -> None:
    """LMCache's --server-module factory: mount the routes on the HTTP app that is starting."""
    from kvctl_plugins import lmcache_names

    lmcache_names.require(lmcache_names.MP_SERVER)
    from lmcache.logging import init_logger

    protocol.adopt_routes_token()  # out of the environment before the server answers GET /env
    app = running_app()
    if app is None:
        init_logger(__name__).warning("kvctl routes not mounted: this server has no HTTP app")
        return None
    if not any(getattr(route, "path", "").startswith(PREFIX) for route in app.routes):
        app.include_router(router)
    return None


def running_app():
    """The HTTP app being served: `lmcache server` imports the HTTP server module, while
    `python -m lmcache.v1.multiprocess.http_server` runs it as __main__; either way the module
    that serves is the one whose run_http_server has filled in its configs."""
    for name in (HTTP_SERVER_MODULE, "__main__"):
        module = sys.modules.get(name)
        if getattr(module, "_configs", None) and hasattr(module, "app"):
            return module.app
    return None


async def _serve(request: Request, operation, frames: bool = False) -> Response:
    engine = getattr(request.app.state, "engine", None)
    return await protocol.serve(request, engine, operation, "the MP server is still starting", frames)


def _registered_models(context) -> list[tuple[str, int]]:
    """(model, world size) pairs whose KV caches are registered (LMCache has no public listing)."""
    registry = context.layout_desc_registry
    with registry._lock:
        return sorted(registry._registry)


def _l1_managers(storage_manager) -> list:
    return list(storage_manager._l1_managers_by_id.values())


def info(engine) -> dict[str, Any]:
    context = engine.context
    status = context.storage_manager.report_status()
    l1 = {tag: {key: manager[key] for key in ("total_object_count", "memory_used_bytes", "memory_total_bytes",
                                               "memory_usage_ratio")}
          for tag, manager in status["l1_managers"].items()}
    return {"engine": "mp", "models": [{"model": model, "world_size": world_size,
                                        "kv_dtype": _kv_dtype(context, model, world_size)}
                                       for model, world_size in _registered_models(context)],
            "chunk_size": context.chunk_size, "hash_algorithm": context.token_hasher.hash_algorithm_name,
            "l1": l1, "l2_adapters": [adapter.get("type") for adapter in status["l2_adapters"]]}


def _kv_dtype(context, model: str, world_size: int) -> str | None:
    """The KV dtype(s) a model's registered layouts hold ("bfloat16"; several joined by "+"): no MP key
    names it, so a snapshot records it to refuse loading bf16 bytes where fp16 of the same size is read."""
    groups = context.layout_desc_registry.find_group_layout_descs(model, world_size) or {}
    names = sorted({str(dtype).removeprefix("torch.") for layout in groups.values() for dtype in layout.dtypes})
    return "+".join(names) or None


def _key_rows(context, model: str, world_size: int, tokens: list[int], salt: str) -> list[list]:
    """Chunk-ordered key rows, one per (object group, rank): every group the model registered,
    or group 0 when no vLLM has registered the model yet."""
    from lmcache.v1.multiprocess.cache_control.key_resolver import (
        resolve_grouped_object_keys,
        resolve_object_keys,
    )

    groups = context.layout_desc_registry.find_group_layout_descs(model, world_size)
    try:
        if groups:
            attn = context.layout_desc_registry.find_attn_desc(model, world_size)
            rows, _ = resolve_grouped_object_keys(context.token_hasher, model, world_size, tokens, salt, groups, attn)
            return [row.keys for row in rows]
        keys, chunks = resolve_object_keys(context.token_hasher, model, world_size, tokens, salt)
    except ValueError as error:
        raise BadRequest(str(error)) from None
    ranks = len(keys) // chunks if chunks else 0
    return [keys[rank::ranks] for rank in range(ranks)]


def lookup(engine, body: dict[str, Any]) -> dict[str, Any]:
    context = engine.context
    tokens = protocol.tokens(body.get("tokens"))
    models = _registered_models(context)
    model = body.get("model") or (models[0][0] if len(models) == 1 else None)
    if not model:
        raise BadRequest(f"which model? registered: {[name for name, _ in models] or 'none'}; pass model")
    model = protocol.string(model, "model")
    world_size = body.get("world_size") or next((ws for name, ws in models if name == model), 1)
    largest = max((ws for _, ws in models), default=1)  # keys are made per rank: bounded by what registered
    if type(world_size) is not int or not 1 <= world_size <= largest:
        raise BadRequest(f"world_size must be an integer from 1 to {largest} (the largest this server registered)")
    salt = protocol.string(body.get("cache_salt") or "", "cache_salt")
    rows = _key_rows(context, model, world_size, tokens, salt)
    managers = _l1_managers(context.storage_manager)
    chunk_size = context.chunk_size
    chunks = []
    for index in range(len(rows[0]) if rows else 0):
        resident = all(any(manager.get_object_state(row[index]) is not None for manager in managers) for row in rows)
        chunks.append({"index": index, "start": index * chunk_size, "end": (index + 1) * chunk_size,
                       "keys": [dataclasses.asdict(row[index].to_encoded_object_key()) for row in rows],
                       "tiers": ["cpu"] if resident else []})
    return {"model": model, "world_size": world_size, "chunk_size": chunk_size,
            "hash_algorithm": context.token_hasher.hash_algorithm_name, "prompt_tokens": len(tokens),
            "chunks": chunks, "tiers_checked": ["cpu"]}


def l1_keys(engine, query) -> dict[str, Any]:
    """A page of the L1 objects (of one model, if given), oldest write first: encoded key, size, and
    whether a reader holds it (the objects /cache/objects deletes only with force)."""
    offset, limit = protocol.page(query, default_limit=1000)
    if query.get("tier", "cpu") != "cpu":
        raise BadRequest("tier must be cpu (L1): kvctl reads the L2 stores directly")
    model = query.get("model")
    entries = []
    for manager in _l1_managers(engine.context.storage_manager):
        with manager._lock:
            entries.extend(manager._objects.items())
    if model:
        entries = [(key, state) for key, state in entries if key.model_name == model]
    page = entries[offset:offset + limit]
    end = offset + len(page)
    return {"tier": "cpu", "total": len(entries), "next_offset": end if end < len(entries) else None,
            "keys": [{"key": dataclasses.asdict(key.to_encoded_object_key()), "size": state.memory_obj.get_size(),
                      "locked": state.read_lock.is_locked()} for key, state in page]}


def object_key(text: str):
    """The ObjectKey a text names; it must be the resp adapter's own spelling of that key."""
    from lmcache.v1.distributed.api import ObjectKey

    parts = text.split("@")
    try:
        if len(parts) not in (4, 5):
            raise ValueError
        key = ObjectKey(bytes.fromhex(parts[3]), parts[0], int(parts[1], 16), int(parts[2], 16),
                        parts[4] if len(parts) == 5 else "")
    except ValueError:
        key = None
    if key is None or not key.model_name or len(key.chunk_hash) not in MP_HASH_BYTES or _spelled(key) != text:
        raise BadRequest(f"not an MP object key (model@kv_rank@group@hash[@salt]): {text[:300]!r}")
    return key


def _spelled(key) -> str:
    base = f"{key.model_name}@{key.kv_rank:08x}@{key.object_group_id:x}@{key.chunk_hash.hex()}"
    return f"{base}@{key.cache_salt}" if key.cache_salt else base


def read_chunks(engine, body: dict[str, Any]) -> tuple[bytes, int | None]:
    names = protocol.strings(body.get("keys"), "keys", protocol.MAX_KEYS)
    managers = _l1_managers(engine.context.storage_manager)
    return protocol.framed(names, lambda name: _l1_copy(managers, object_key(name)))


def _l1_copy(managers: list, key) -> tuple[bytes, None] | None:
    """The bytes of the resident L1 object, copied between a read lock's reserve and finish. Temporary
    objects (a retrieve's staging copies, freed at their last read) are no chunks L1 keeps. The eviction
    order stays (LMCache's L1 policy ignores finished reads), but the read counts in LMCache's L1 read
    metrics and access times, as any read does."""
    for manager in managers:
        state = manager.get_object_state(key)
        if state is None or state.is_temporary:
            continue
        _, memory_obj = manager.reserve_read([key])[key]
        if memory_obj is None:  # deleted or evicted since
            continue
        try:
            return bytes(memory_obj.byte_array), None
        finally:
            manager.finish_read([key])
    return None


def write_chunks(engine, raw: bytes, tiers: str | None) -> dict[str, Any]:
    """Store frames into L1; "already" counts objects L1 held (or another writer admitted meanwhile), "dropped"
    those L1 found no room for within ROOM_WAIT_S of the request's start (one wait per request, not per object)."""
    if tiers not in (None, "cpu"):
        raise BadRequest("an MP server takes chunks into L1 (cpu) only; its L2 store policy copies them on")
    context = engine.context
    checked = _checked_frames(context, raw)
    storage = context.storage_manager
    managers = _l1_managers(storage)
    counts = {"written": 0, "already": 0, "dropped": 0}
    deadline = time.monotonic() + ROOM_WAIT_S
    try:
        for key, data, layout in checked:
            outcome = "already" if _resident(managers, key) else _store(storage, managers, key, data, layout, deadline)
            counts[outcome] += 1
    except Exception as failure:  # noqa: BLE001 - answered with what was stored before it
        done = sum(counts.values())
        logger.exception("kvctl chunks/write failed after %s of %s objects", done, len(checked))
        message = (f"{type(failure).__name__}: {failure} (see the server's log), storing object {done + 1} of "
                   f"{len(checked)}; before it {counts['written']} were written into L1 and stay there, "
                   f"{counts['already']} were there already, {counts['dropped']} dropped")
        return JSONResponse({**error_body("internal_error", message), **_per_tier(counts)}, status_code=500)
    return _per_tier(counts)


def _per_tier(counts: dict[str, int]) -> dict[str, dict[str, int]]:
    """The in-process write route's answer shape: {"written", "already", "dropped"}: {tier: objects}."""
    return {outcome: {"cpu": count} for outcome, count in counts.items()}


def _resident(managers: list, key) -> bool:
    return any(manager.get_object_state(key) is not None for manager in managers)


def _checked_frames(context, raw: bytes) -> list[tuple[Any, memoryview, Any]]:
    """(key, data, layout) of every frame; BadRequest naming the first one this server cannot take."""
    from lmcache.utils import get_size_bytes

    registered = _registered_models(context)
    checked = []
    for text, data, metadata in protocol.frames(raw):
        key = object_key(text)
        if metadata is not None:
            raise BadRequest(f"{text!r} carries a metadata header: MP objects have none (an in-process chunk?)")
        world_size, rank = key.kv_rank >> 24, (key.kv_rank >> 16) & 0xFF
        local_world_size, local_rank = (key.kv_rank >> 8) & 0xFF, key.kv_rank & 0xFF
        if not (rank < world_size and local_rank < local_world_size <= world_size):
            raise BadRequest(f"{text!r} has kv_rank {key.kv_rank:#010x}, which no worker makes")
        if (key.model_name, world_size) not in registered:
            known = ", ".join(f"{model} (world size {size})" for model, size in registered) or "none"
            raise BadRequest(f"{text!r} is an object of {key.model_name!r} at world size {world_size}, which no KV "
                             f"cache registered with this server has (registered: {known}); load once vLLM has "
                             "connected with that model")
        groups = context.layout_desc_registry.find_group_layout_descs(key.model_name, world_size) or {}
        layout = groups.get(key.object_group_id)
        if layout is None:
            raise BadRequest(f"{text!r} is of object group {key.object_group_id}; {key.model_name!r} registered "
                             f"groups {sorted(groups)}")
        size = get_size_bytes(layout.shapes, layout.dtypes)
        if len(data) != size:
            raise BadRequest(f"{text!r} has {len(data)} bytes; an object of group {key.object_group_id} of "
                             f"{key.model_name!r} here is {size} bytes (another KV layout, dtype or chunk size)")
        checked.append((key, data, layout))
    return checked


def _store(storage, managers: list, key, data: memoryview, layout, deadline: float) -> str:
    """One object through the storage manager's own write path: reserve (while L1 is full, retrying
    until the request's `deadline`; each failed reservation counts in LMCache's allocation-failure
    metrics, so not often), copy, finish; a reservation that cannot be completed is discarded."""
    from lmcache.v1.distributed.storage_manager import _L1_WRITE_TAG

    while (memory_obj := storage.reserve_write([key], layout).get(key)) is None:
        if _resident(managers, key):  # another writer got there first
            return "already"
        if time.monotonic() >= deadline:
            return "dropped"
        time.sleep(ROOM_POLL_S)
    try:
        view = memory_obj.byte_array
        view = view.cast("B") if view.format != "B" else view
        view[:] = data  # a length mismatch raises: nothing is admitted
    except BaseException:
        storage._l1_managers_by_id[memory_obj.get_l1_manager()].finish_write_and_delete([key], tag=_L1_WRITE_TAG)
        raise
    storage.finish_write_by_owner(storage.prepare_write_completion({key: memory_obj}))
    return "written" if _resident(managers, key) else "dropped"


@router.get("/info")
async def info_route(request: Request) -> JSONResponse:
    return await _serve(request, lambda engine, _: info(engine))


@router.get("/keys")
async def keys_route(request: Request) -> JSONResponse:
    return await _serve(request, lambda engine, _: l1_keys(engine, request.query_params))


@router.post("/lookup")
async def lookup_route(request: Request) -> JSONResponse:
    # hashing a long prompt takes tens of milliseconds: protocol.serve keeps it off the event loop
    return await _serve(request, lookup)


@router.post("/chunks/read")
async def read_chunks_route(request: Request) -> Response:
    return await _serve(request, lambda engine, body: protocol.frames_response(*read_chunks(engine, body)))


@router.post("/chunks/write")
async def write_chunks_route(request: Request) -> Response:
    tiers = request.query_params.get("tiers")
    return await _serve(request, lambda engine, raw: write_chunks(engine, raw, tiers), frames=True)
