"""/kvctl/v1 routes on LMCache's internal API server (JSON in, JSON out).

Mounted on every internal API server the process creates, bound where that server is bound
(127.0.0.1 by default). A client mistake is a 4xx with {"error", "message"}, never a 500.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kvctl_plugins import engine_ops
from kvctl_plugins.engine_ops import BadRequest, NotFound, PinRegistry

PREFIX = "/kvctl/v1"
router = APIRouter(prefix=PREFIX)
PINS = PinRegistry()


def _error(status: int, error: str, message: str) -> JSONResponse:
    return JSONResponse({"error": error, "message": message}, status_code=status)


def _engine(request: Request):
    manager = getattr(request.app.state, "lmcache_adapter", None)
    return getattr(manager, "lmcache_engine", None)


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except ValueError:
        raise BadRequest("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


async def _handle(request: Request, operation) -> JSONResponse:
    engine = _engine(request)
    if engine is None:
        return _error(503, "no_engine", "this process has no LMCache engine (a vLLM scheduler process); "
                      "ask a worker's port (port_start + 1 + worker id)")
    try:
        return JSONResponse(operation(engine, await _body(request)))
    except BadRequest as error:
        return _error(400, "bad_request", str(error))
    except NotFound as error:
        return _error(404, "not_found", str(error))


def _tiers(body: dict[str, Any]) -> list[str] | None:
    tiers = body.get("tiers")
    if tiers is not None and (not isinstance(tiers, list) or not all(isinstance(t, str) for t in tiers)):
        raise BadRequest("tiers must be a list of tier names (cpu, disk, redis, all)")
    return tiers


@router.get("/info")
async def info(request: Request) -> JSONResponse:
    return await _handle(request, lambda engine, _: engine_ops.info(engine, PINS))


@router.post("/lookup")
async def lookup(request: Request) -> JSONResponse:
    return await _handle(request, lambda engine, body: engine_ops.lookup(engine, body.get("tokens")))


@router.get("/keys")
async def keys(request: Request, tier: str = "cpu", offset: int = 0, limit: int = 100) -> JSONResponse:
    return await _handle(request, lambda engine, _: engine_ops.list_keys(engine, tier, offset, limit, PINS))


@router.post("/pin")
async def pin(request: Request) -> JSONResponse:
    def operation(engine, body):
        return PINS.pin(engine, body.get("tokens"), body.get("ttl_s"), _tiers(body)).as_dict(engine)

    return await _handle(request, operation)


@router.post("/unpin")
async def unpin(request: Request) -> JSONResponse:
    def operation(engine, body):
        if body.get("all") is True:
            released = PINS.unpin_all()
        elif isinstance(body.get("pin_id"), str):
            released = [PINS.unpin(body["pin_id"])]
        elif "tokens" in body:
            released = PINS.unpin_tokens(engine, body["tokens"])
        else:
            raise BadRequest("give pin_id, tokens, or all: true")
        return {"unpinned": [pin.as_dict(engine) for pin in released]}

    return await _handle(request, operation)


@router.get("/pins")
async def pins(request: Request) -> JSONResponse:
    return await _handle(request, lambda engine, _: {"pins": [pin.as_dict(engine) for pin in PINS.list()]})


@router.post("/evict")
async def evict(request: Request) -> JSONResponse:
    def operation(engine, body):
        return engine_ops.evict(engine, PINS, tokens=body.get("tokens"), keys=body.get("keys"),
                                tiers=_tiers(body), all_keys=body.get("all") is True,
                                dry_run=body.get("dry_run") is True, force=body.get("force") is True)

    return await _handle(request, operation)


@router.post("/prefetch")
async def prefetch(request: Request) -> JSONResponse:
    return await _handle(request, lambda engine, body: engine_ops.prefetch(engine, body.get("tokens")))


def install() -> None:
    """Mount the router on every internal API server LMCache creates from now on."""
    from lmcache.v1.internal_api_server.api_registry import APIRegistry

    original = APIRegistry.register_all_apis
    if getattr(original, "kvctl_wrapped", False):
        return

    def register_all_apis(self, categories=None):
        original(self, categories)
        self.app.include_router(router)

    register_all_apis.kvctl_wrapped = True
    APIRegistry.register_all_apis = register_all_apis
