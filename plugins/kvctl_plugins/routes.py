"""/kvctl/v1 routes on LMCache's internal API server (JSON in, JSON out; chunk bytes as frames).

Mounted on every internal API server the process creates, bound where that server is bound
(127.0.0.1 by default). Requests are checked and engine work runs off the server's event loop as
protocol.py says; a client mistake is a 4xx with {"error", "message"}, never a 500.

Chunk bytes (snapshots), as bodies of frames (wire.py), application/octet-stream:
    POST chunks/read   {"keys": [...], "tiers": [...]?} -> the frames of the keys held, streamed as they
                       are read; when the next chunk would take the answer over MAX_CHUNKS_BODY it
                       stops there and NEXT_HEADER gives the index into "keys" to ask again from
    POST chunks/write?tiers=cpu,disk   frames -> {"written", "already", "dropped"}: {tier: chunks}
A process serves at most MAX_CHUNK_TRANSFERS of these at once (ChunkTransfers); one more is a 503 BUSY.

    GET stats   -> {"counters": {name: n}}: LMCache's counters (lookups, retrieves, stores...) as of now,
                   named as /metrics names them; /metrics lag them by up to LMCache's 10 s export interval
"""

from __future__ import annotations

import threading
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvctl_plugins import chunk_bytes, engine_ops, protocol
from kvctl_plugins.engine_ops import PinRegistry
from kvctl_plugins.protocol import BadRequest
from kvctl_plugins.wire import BUSY, FRAMES_TYPE, NEXT_HEADER, PREFIX

router = APIRouter(prefix=PREFIX)
PINS = PinRegistry()
NO_ENGINE = ("this process has no LMCache engine (a vLLM scheduler process); "
             "ask a worker's port (port_start + 1 + worker id)")
MAX_TIERS = 8
# chunk requests one process serves at once: a write holds its whole body (up to protocol.MAX_FRAMES_BODY,
# ~270 MiB) until it is stored, so without a bound one local client could grow a worker's memory at will
MAX_CHUNK_TRANSFERS = 2
CHUNK_PATHS = frozenset({f"{PREFIX}/chunks/read", f"{PREFIX}/chunks/write"})
RETRY_AFTER_S = 5


async def _serve(request: Request, operation, frames: bool = False, parse=None) -> Response:
    manager = getattr(request.app.state, "lmcache_adapter", None)
    return await protocol.serve(request, getattr(manager, "lmcache_engine", None), operation, NO_ENGINE, frames, parse)


def _tiers(body: dict[str, Any]) -> list[str] | None:
    tiers = body.get("tiers")
    return None if tiers is None else protocol.strings(tiers, "tiers (cpu, disk, redis, all)", MAX_TIERS)


@router.get("/info")
async def info(request: Request) -> JSONResponse:
    # routes_guard: what doctor reads to tell a guarded exposed port from an open one
    return await _serve(request, lambda engine, _: {**engine_ops.info(engine, PINS), "routes_guard": {
        "token": protocol.adopt_routes_token() is not None, "lmcache_routes": True}})


@router.get("/stats")
async def stats(request: Request) -> JSONResponse:
    return await _serve(request, lambda engine, _: {"counters": engine_ops.live_counters()})


@router.post("/lookup")
async def lookup(request: Request) -> Response:
    # msgspec encodes the answer (512 chunks for 128K tokens) in C, as compact UTF-8 JSON as JSONResponse's
    return await _serve(request, lambda engine, tokens: Response(msgspec.json.encode(engine_ops.lookup(engine, tokens)),
                                                                 media_type="application/json"),
                        parse=engine_ops.lookup_tokens)


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
        frames, next_index = chunk_bytes.read_chunks(engine, body.get("keys"), _tiers(body))
        return StreamingResponse(frames, media_type=FRAMES_TYPE,
                                 headers={} if next_index is None else {NEXT_HEADER: str(next_index)})

    return await _serve(request, operation)


@router.post("/chunks/write")
async def write_chunks(request: Request) -> Response:
    def operation(engine, raw):
        tiers = request.query_params.get("tiers")
        chosen = None if tiers is None else protocol.strings(tiers.split(","), "tiers (cpu, disk, redis)", MAX_TIERS)
        return chunk_bytes.write_chunks(engine, raw, chosen)

    return await _serve(request, operation, frames=True)


class ChunkTransfers:
    """ASGI middleware: at most MAX_CHUNK_TRANSFERS chunk requests at a time in this process (every
    internal API server in it together), each counted from before its body is read until its answer is
    sent or its client is gone. One more is answered 503 BUSY at once, its body unread."""

    _lock = threading.Lock()
    _active = 0

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] not in CHUNK_PATHS:
            await self.app(scope, receive, send)
            return
        with ChunkTransfers._lock:
            admitted = ChunkTransfers._active < MAX_CHUNK_TRANSFERS
            if admitted:
                ChunkTransfers._active += 1
        if not admitted:
            refusal = protocol.error(503, BUSY, f"this engine is already moving chunk bytes for "
                                                f"{MAX_CHUNK_TRANSFERS} requests, its most at once")
            refusal.headers["Retry-After"] = str(RETRY_AFTER_S)
            await refusal(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            with ChunkTransfers._lock:
                ChunkTransfers._active -= 1


def install() -> None:
    """Mount the router, and the guard of LMCache's own routes, on every internal API server LMCache
    creates from now on; the routes token is taken out of the environment now (protocol.py)."""
    from lmcache.v1.internal_api_server.api_registry import APIRegistry

    protocol.adopt_routes_token()
    engine_ops.keep_monitor_totals()
    original = APIRegistry.register_all_apis
    if getattr(original, "kvctl_wrapped", False):
        return

    def register_all_apis(self, categories=None):
        original(self, categories)
        self.app.include_router(router)
        self.app.add_middleware(protocol.LMCacheRouteGuard)
        self.app.add_middleware(ChunkTransfers)

    register_all_apis.kvctl_wrapped = True
    APIRegistry.register_all_apis = register_all_apis
