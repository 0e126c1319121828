"""/kvctl/v1 routes on LMCache's internal API server (JSON in, JSON out; chunk bytes as frames).

Mounted on every internal API server the process creates, bound where that server is bound
(127.0.0.1 by default). Requests are checked and engine work runs off the server's event loop as
protocol.py says; a client mistake is a 4xx with {"error", "message"}, never a 500.

Chunk bytes (snapshots), as bodies of frames (wire.py), application/octet-stream:
    POST chunks/read   {"keys": [...], "tiers": [...]?} -> the frames of the keys held; when the next
                       frame would take the chunk bytes over MAX_CHUNKS_BODY the answer stops there
                       and NEXT_HEADER gives the index into "keys" to ask again from
    POST chunks/write?tiers=cpu,disk   frames -> {"written", "already", "dropped"}: {tier: chunks}
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvctl_plugins import chunk_bytes, engine_ops, protocol
from kvctl_plugins.engine_ops import PinRegistry
from kvctl_plugins.protocol import BadRequest
from kvctl_plugins.wire import PREFIX

router = APIRouter(prefix=PREFIX)
PINS = PinRegistry()
NO_ENGINE = ("this process has no LMCache engine (a vLLM scheduler process); "
             "ask a worker's port (port_start + 1 + worker id)")
MAX_TIERS = 8


async def _serve(request: Request, operation, frames: bool = False) -> Response:
    manager = getattr(request.app.state, "lmcache_adapter", None)
    return await protocol.serve(request, getattr(manager, "lmcache_engine", None), operation, NO_ENGINE, frames)


def _tiers(body: dict[str, Any]) -> list[str] | None:
    tiers = body.get("tiers")
    return None if tiers is None else protocol.strings(tiers, "tiers (cpu, disk, redis, all)", MAX_TIERS)


@router.get("/info")
async def info(request: Request) -> JSONResponse:
    # routes_guard: what doctor reads to tell a guarded exposed port from an open one
    return await _serve(request, lambda engine, _: {**engine_ops.info(engine, PINS), "routes_guard": {
        "token": protocol.adopt_routes_token() is not None, "lmcache_routes": True}})


@router.post("/lookup")
async def lookup(request: Request) -> JSONResponse:
    return await _serve(request, lambda engine, body: engine_ops.lookup(engine, body.get("tokens")))


@router.get("/keys")
async def keys(request: Request) -> JSONResponse:
    def operation(engine, _):
        query = request.query_params
        offset, limit = protocol.page(query, default_limit=100)
        return engine_ops.list_keys(engine, protocol.string(query.get("tier", "cpu"), "tier", 64), offset, limit, PINS)

    return await _serve(request, operation)


@router.post("/pin")
async def pin(request: Request) -> JSONResponse:
    def operation(engine, body):
        return PINS.pin(engine, body.get("tokens"), body.get("ttl_s"), _tiers(body), body.get("pin_id"),
                        body.get("replace") is True).as_dict(engine)

    return await _serve(request, operation)


@router.post("/unpin")
async def unpin(request: Request) -> JSONResponse:
    def operation(engine, body):
        if body.get("all") is True:
            released = PINS.unpin_all()
        elif "pin_id" in body:
            released = [PINS.unpin(protocol.string(body["pin_id"], "pin_id", 64))]
        elif "tokens" in body:
            released = PINS.unpin_tokens(engine, body["tokens"])
        else:
            raise BadRequest("give pin_id, tokens, or all: true")
        return {"unpinned": [pin.as_dict(engine) for pin in released]}

    return await _serve(request, operation)


@router.get("/pins")
async def pins(request: Request) -> JSONResponse:
    return await _serve(request, lambda engine, _: {"pins": [pin.as_dict(engine) for pin in PINS.list()]})


@router.post("/evict")
async def evict(request: Request) -> JSONResponse:
    def operation(engine, body):
        return engine_ops.evict(engine, PINS, tokens=body.get("tokens"), keys=body.get("keys"),
                                tiers=_tiers(body), all_keys=body.get("all") is True,
                                dry_run=body.get("dry_run") is True, force=body.get("force") is True)

    return await _serve(request, operation)


@router.post("/prefetch")
async def prefetch(request: Request) -> JSONResponse:
    return await _serve(request, lambda engine, body: engine_ops.prefetch(engine, body.get("tokens")))


@router.post("/chunks/read")
async def read_chunks(request: Request) -> Response:
    def operation(engine, body):
        return protocol.frames_response(*chunk_bytes.read_chunks(engine, body.get("keys"), _tiers(body)))

    return await _serve(request, operation)


@router.post("/chunks/write")
async def write_chunks(request: Request) -> Response:
    def operation(engine, raw):
        tiers = request.query_params.get("tiers")
        chosen = None if tiers is None else protocol.strings(tiers.split(","), "tiers (cpu, disk, redis)", MAX_TIERS)
        return chunk_bytes.write_chunks(engine, raw, chosen)

    return await _serve(request, operation, frames=True)


def install() -> None:
    """Mount the router, and the guard of LMCache's own routes, on every internal API server LMCache
    creates from now on; the routes token is taken out of the environment now (protocol.py)."""
    from lmcache.v1.internal_api_server.api_registry import APIRegistry

    protocol.adopt_routes_token()
    original = APIRegistry.register_all_apis
    if getattr(original, "kvctl_wrapped", False):
        return

    def register_all_apis(self, categories=None):
        original(self, categories)
        self.app.include_router(router)
        self.app.add_middleware(protocol.LMCacheRouteGuard)

    register_all_apis.kvctl_wrapped = True
    APIRegistry.register_all_apis = register_all_apis
