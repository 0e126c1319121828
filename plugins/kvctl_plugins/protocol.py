"""The request checks of kvctl's /kvctl/v1 routes, shared by the in-process routes (routes.py) and the
MP server's (mp_routes.py); what kvctl's client must agree on (prefix, page cap, token variable,
error body) is in wire.py, which imports nothing.

Both servers are LMCache's, bound to 127.0.0.1 and without any authentication, so every request is
checked before it reaches an engine: a loopback Host where the connection is on loopback (DNS
rebinding), a JSON body only (cross-site form posts; the chunk-bytes routes take
application/octet-stream, which a form cannot send either), a size cap, bounded parameters. The engine
work runs on a worker thread, never on the event loop that also serves LMCache's own routes. A
malformed request is a 4xx with {"error", "message"}; only a failure inside the engine is a 500.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import math
import os
from typing import Any, Callable

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from kvctl_plugins import wire
from kvctl_plugins.wire import (
    FRAMES_TYPE,
    MAX_CHUNKS_BODY,
    MAX_PAGE,
    NEXT_HEADER,
    OPEN_PROBES,
    PREFIX,
    TOKEN_FILE_VARIABLE,
    TOKEN_VARIABLE,
    error_body,
)

MAX_BODY_BYTES = 16 * 1024 * 1024  # a 128K-token lookup is about 1 MiB of JSON
JSON_TYPE = "application/json"
MAX_FRAMES_BODY = MAX_CHUNKS_BODY + 16 * 1024 * 1024  # the chunk bytes and their frame headers
MAX_TOKENS = 1024 * 1024
MAX_TOKEN_ID = 2**31 - 1
MAX_KEYS = 100_000
MAX_STRING = 4096
MAX_TTL_S = 30 * 24 * 3600.0
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
MAX_TOKEN_FILE = 4096

logger = logging.getLogger(__name__)
_routes_token: list[str | None] = []  # [token] once adopted: read once per process, at install


def adopt_routes_token() -> str | None:
    """The routes token, read once when the plugins install: KVCTL_ROUTES_TOKEN, which is then removed
    from this process's environment (LMCache's unauthenticated GET /env shows every variable, and child
    processes inherit them), else the file KVCTL_ROUTES_TOKEN_FILE names (only its path stays in the
    environment). A named file that cannot be read stops the install: routes meant to be guarded never
    answer unguarded."""
    if not _routes_token:
        token = os.environ.pop(TOKEN_VARIABLE, None) or None
        path = os.environ.get(TOKEN_FILE_VARIABLE)
        if token is None and path:
            try:
                with open(path, "rb") as file:
                    token = file.read(MAX_TOKEN_FILE + 1).decode().strip() or None
            except (OSError, UnicodeDecodeError) as failure:
                raise RuntimeError(f"kvctl plugins: cannot read the routes token file {path} "
                                   f"({TOKEN_FILE_VARIABLE}): {failure}") from None
            if token is None or len(token) > MAX_TOKEN_FILE:
                raise RuntimeError(f"kvctl plugins: the routes token file {path} ({TOKEN_FILE_VARIABLE}) "
                                   f"must hold one token of 1 to {MAX_TOKEN_FILE} characters")
        _routes_token.append(token)
    return _routes_token[0]


class Rejected(Exception):
    """A request the route refuses; the HTTP status and error code travel with it."""

    status = 400
    code = "bad_request"


class BadRequest(Rejected, ValueError):
    """The client asked for something malformed (HTTP 400)."""


class NotFound(Rejected, LookupError):
    """The client named something that does not exist (HTTP 404)."""

    status, code = 404, "not_found"


class Forbidden(Rejected):
    status, code = 403, "forbidden"


class Unauthorized(Rejected):
    status, code = 401, "unauthorized"


class TooLarge(Rejected):
    status, code = 413, "too_large"


class NotJSON(Rejected):
    """A body of another media type than the route takes (JSON; chunk frames on the chunk routes)."""

    status, code = 415, "unsupported_media_type"


class NoRoom(Rejected):
    """The engine cannot make room for what it was asked to hold (HTTP 507)."""

    status, code = 507, "no_room"


def error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse(error_body(code, message), status_code=status)


async def serve(request: Request, engine: Any, operation: Callable[[Any, Any], Any], no_engine: str,
                frames: bool = False, parse: Callable[[bytes], Any] | None = None) -> Response:
    """Check the request, then answer operation(engine, body) computed on a worker thread. The body is
    a JSON object (or what `parse` makes of the raw JSON body), or with `frames` the raw bytes of an
    application/octet-stream body of chunk frames (wire.py); the operation answers JSON, or a Response of
    its own (chunk bytes)."""
    try:
        check_host(request)
        check_token(request, adopt_routes_token())
        raw = await (read_body(request, FRAMES_TYPE, MAX_FRAMES_BODY) if frames else read_body(request))
        if engine is None:
            return error(503, "no_engine", no_engine)

        def work() -> Response:
            answer = operation(engine, raw if frames else (parse or parse_body)(raw))
            return answer if isinstance(answer, Response) else JSONResponse(answer)

        return await run_in_threadpool(work)
    except Rejected as rejected:
        return error(rejected.status, rejected.code, str(rejected))
    except Exception as failure:  # noqa: BLE001 - an engine failure still answers in the routes' shape
        logger.exception("kvctl route %s failed", request.url.path)
        return error(500, "internal_error", f"{type(failure).__name__}: {failure} (see the server's log)")


def check_host(request: Request) -> None:
    """On a loopback connection the Host must name loopback: a page whose DNS name was rebound to
    127.0.0.1 sends its own name (a Unix socket cannot be reached from a browser at all)."""
    server = request.scope.get("server")
    if not server or not _is_loopback_address(server[0]):
        return
    host = request.headers.get("host", "").strip().lower()
    name = host[1:host.find("]")] if host.startswith("[") else host.rsplit(":", 1)[0]
    if name not in LOOPBACK_NAMES:
        raise Forbidden(f"Host {host[:100]!r} is not a loopback name; this server answers 127.0.0.1, localhost "
                        "and [::1] only")


def check_token(request: Request, token: str | None) -> None:
    """The routes pin, evict and read prompts' token ids: beyond loopback they answer only a bearer of
    the process's routes token (and none at all without one); with a token set, always."""
    if not token:
        if beyond_loopback(request):
            raise Forbidden(f"this server's management routes are off beyond loopback without a routes token; "
                            f"set {TOKEN_FILE_VARIABLE} (or {TOKEN_VARIABLE}) in the engine's environment "
                            "(kvctl config init writes one to env.sh)")
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise Unauthorized(f"a bearer token is required: send 'Authorization: Bearer ${TOKEN_VARIABLE}' "
                           "(source the configuration's env.sh)")


def beyond_loopback(request: Request) -> bool:
    """Whether the connection came over TCP to an address other than loopback (a Unix socket has none)."""
    server = request.scope.get("server")
    return bool(server and server[1] is not None and not _is_loopback_address(server[0]))


class LMCacheRouteGuard:
    """LMCache's own routes on an internal API server that also serves kvctl's (ASGI middleware): a
    loopback Host on a loopback connection, as for kvctl's routes (a rebound DNS name must not read
    /env); on a connection beyond loopback, the routes token for all but the read-only probes
    (OPEN_PROBES): /env, /conf, /cache/*, /backends, /freeze/*, /run_script, /metrics/reset and the
    rest read secrets or act, and answer nobody there without it."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and not scope["path"].startswith(PREFIX):  # kvctl's routes check themselves
            request = Request(scope)
            try:
                check_host(request)
                probe = scope["method"] in ("GET", "HEAD") and scope["path"].rstrip("/") in OPEN_PROBES
                if beyond_loopback(request) and not probe:
                    check_token(request, adopt_routes_token())
            except Rejected as rejected:
                await error(rejected.status, rejected.code, str(rejected))(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _is_loopback_address(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return ip.is_loopback or bool(getattr(ip, "ipv4_mapped", None) and ip.ipv4_mapped.is_loopback)


async def read_body(request: Request, media: str = JSON_TYPE, limit: int = MAX_BODY_BYTES) -> bytes:
    """The raw body, at most `limit` bytes, and only ever of the one media type the route takes."""
    length = request.headers.get("content-length")
    try:
        declared = int(length) if length is not None else 0
    except ValueError:
        raise BadRequest("Content-Length is not a number") from None
    if declared > limit:
        raise TooLarge(f"the body is {declared} bytes; the limit is {limit}")
    if declared > 0 or "transfer-encoding" in request.headers:
        media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media_type != media:
            raise NotJSON(f"the body must be {media}, not {media_type[:100] or 'untyped'}")
    raw = bytearray()
    try:
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > limit:
                raise TooLarge(f"the body is over the limit of {limit} bytes")
    except ClientDisconnect:
        raise BadRequest("the client went away before the end of its body") from None
    return bytes(raw)


def parse_body(raw: bytes) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the interpreter's limit
        raise BadRequest("the request body is not valid JSON (or nests too deeply)") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def tokens(value: Any) -> list[int]:
    if (type(value) is not list or not 0 < len(value) <= MAX_TOKENS
            or not all(type(token) is int and 0 <= token <= MAX_TOKEN_ID for token in value)):
        raise BadRequest(f"tokens must be a non-empty list of at most {MAX_TOKENS} token ids (0..{MAX_TOKEN_ID})")
    return value


def string(value: Any, what: str, limit: int = MAX_STRING) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise BadRequest(f"{what} must be a string of at most {limit} characters")
    return value


def strings(value: Any, what: str, limit: int) -> list[str]:
    if (not isinstance(value, list) or not 0 < len(value) <= limit
            or not all(isinstance(text, str) and len(text) <= MAX_STRING for text in value)):
        raise BadRequest(f"{what} must be a non-empty list of at most {limit} strings")
    return value


def ttl_seconds(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and 0 < value <= MAX_TTL_S):
        raise BadRequest(f"ttl_s must be a positive number of seconds up to {MAX_TTL_S:.0f} (30 days), "
                         "or null: until unpinned")
    return float(value)


def framed(names: list[str], find: Callable[[str], tuple[bytes, bytes | None] | None]) -> tuple[bytes, int | None]:
    """A chunks/read body for `names` (each once, in the order asked): the frames of what find(name)
    returns as (data, metadata), skipping None; and the index into `names` of the first name left out
    because its frame would take the chunk bytes over wire.MAX_CHUNKS_BODY (None: all were answered;
    the first frame always goes, so a client that asks again from there gets on)."""
    parts, size, seen, next_index = [], 0, set(), None
    for index, name in enumerate(names):
        if name in seen:
            continue
        seen.add(name)
        found = find(name)
        if found is None:
            continue
        data, metadata = found
        if parts and size + len(data) > wire.MAX_CHUNKS_BODY:
            next_index = index
            break
        parts += [wire.frame_header(name, len(data), metadata), data]
        size += len(data)
    return b"".join(parts), next_index


def frames_response(body: bytes, next_index: int | None) -> Response:
    """A chunks/read answer: the frames, and where a client asks again from when it was cut short."""
    return Response(body, media_type=FRAMES_TYPE, headers={} if next_index is None else {NEXT_HEADER: str(next_index)})


def frames(raw: bytes) -> list[tuple[str, memoryview, bytes | None]]:
    """(key, data, metadata) of every frame of a chunks/write body; BadRequest for a malformed, empty or
    cut-short body or a key that comes twice, TooLarge over wire.MAX_CHUNKS_BODY of chunk bytes."""
    try:
        found = list(wire.read_frames(raw))
    except ValueError as failure:
        raise BadRequest(f"the body is not chunk frames: {failure}") from None
    if not found:
        raise BadRequest("the body holds no chunk frames")
    if sum(len(data) for _, data, _ in found) > wire.MAX_CHUNKS_BODY:
        raise TooLarge(f"the chunks are over {wire.MAX_CHUNKS_BODY} bytes; send them in several requests")
    seen: set[str] = set()
    for key, _, _ in found:
        if key in seen:
            raise BadRequest(f"{key!r} comes twice in the body")
        seen.add(key)
    return found


def page(query: dict[str, str], default_limit: int) -> tuple[int, int]:
    """(offset, limit) from a query string."""
    try:
        offset, limit = int(query.get("offset", 0)), int(query.get("limit", default_limit))
    except ValueError:
        raise BadRequest("offset and limit must be integers") from None
    if offset < 0 or not 1 <= limit <= MAX_PAGE:
        raise BadRequest(f"offset must be >= 0 and limit between 1 and {MAX_PAGE}")
    return offset, limit
