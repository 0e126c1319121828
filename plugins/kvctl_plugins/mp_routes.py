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
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kvctl_plugins import protocol
from kvctl_plugins.protocol import BadRequest
from kvctl_plugins.wire import PREFIX

HTTP_SERVER_MODULE = "lmcache.v1.multiprocess.http_server"
router = APIRouter(prefix=PREFIX)


def build_server_modules(_build_context) -> None:
    """LMCache's --server-module factory: mount the routes on the HTTP app that is starting."""
    from lmcache.logging import init_logger

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


async def _serve(request: Request, operation) -> JSONResponse:
    engine = getattr(request.app.state, "engine", None)
    return await protocol.serve(request, engine, operation, "the MP server is still starting")


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
    return {"engine": "mp", "models": [{"model": model, "world_size": world_size}
                                       for model, world_size in _registered_models(context)],
            "chunk_size": context.chunk_size, "hash_algorithm": context.token_hasher.hash_algorithm_name,
            "l1": l1, "l2_adapters": [adapter.get("type") for adapter in status["l2_adapters"]]}


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
