"""The HTTP plumbing the server clients share: one connection pool, closed with the client, and
one mapping of failures to kvctl's errors: unreachable/timeout (exit 3), 4xx rejected (4), 5xx
server error (5). Subclasses name their server and the hints that fit it.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from kvctl_plugins.wire import BUSY, ERROR_CODE, ERROR_MESSAGE, PREFIX, TOKEN_VARIABLE  # the routes' contract

from kvctl.core.errors import RejectedError, RoutesAbsent, ServerError, UnreachableError


class RoutesTokens:
    """Which management server gets which routes token. An instance's token is granted to its own
    servers' URLs when the instance is resolved (kvctl.core.instance.addresses) and to nothing else, so vLLM's
    /tokenize, a coordinator or another fleet member never receives it."""

    def __init__(self) -> None:
        self._tokens: dict[str, str] = {}

    def grant(self, url: str, token: str | None) -> None:
        if token:
            self._tokens[url.rstrip("/")] = token

    def share(self, url: str, derived: str) -> None:
        """A URL derived from another of the same instance (worker r's from worker 0's) gets its token."""
        self.grant(derived, self._tokens.get(url.rstrip("/")))

    def get(self, url: str) -> str | None:
        return self._tokens.get(url.rstrip("/"))


routes_tokens = RoutesTokens()
_TLS: list = []
_TLS_LOCK = threading.Lock()


def tls_context():
    """httpx's default TLS context (its CA bundle, verification on), made once per process: making one
    costs ~28 ms of CPU under the GIL, which every client paid and a fleet's members paid one after
    another (fleet commands grew by ~100 ms per member)."""
    with _TLS_LOCK:
        if not _TLS:
            import httpx

            _TLS.append(httpx.create_ssl_context())
        return _TLS[0]


class HTTPClient:
    server = "the server"
    unreachable_hint = "check that the server runs and the URL"
    no_routes_hint = "start the server with kvctl's plugins (kvctl serve)"
    log_hint = "check the server's log"
    # An instance's own management server (internal API, MP server) gets the instance's routes token on
    # every request: kvctl's routes want it, and beyond loopback so do LMCache's own routes beside them.
    carries_routes_token = False

    def __init__(self, url: str, timeout: float) -> None:
        import httpx

        self.url = url.rstrip("/")
        token = routes_tokens.get(self.url) if self.carries_routes_token else None
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # trust_env=False: kvctl's servers are local, and prompts' token ids never go through a proxy
        if url.startswith("unix:"):  # unix:/path/to/socket
            transport = httpx.HTTPTransport(uds=url[len("unix:"):], verify=tls_context())
            self._client = httpx.Client(transport=transport, base_url="http://localhost", timeout=timeout,
                                        headers=headers, trust_env=False)
        else:
            self._client = httpx.Client(base_url=self.url, timeout=timeout, headers=headers, trust_env=False,
                                        verify=tls_context())

    def request(self, method: str, path: str, body: Any = None, params: dict | None = None) -> Any:
        """The parsed body (JSON when it parses, else text), or kvctl's error for the failure."""
        return _payload(self.send(method, path, json=body, params=params))

    def send(self, method: str, path: str, **options: Any):
        """The httpx response (`options` as httpx takes them: json, content, headers, params, timeout), or
        kvctl's error for the failure: for answers that are not JSON (chunk bytes)."""
        import httpx

        try:
            response = self._client.request(method, path, **options)
        except httpx.TimeoutException:
            raise UnreachableError(f"{self.url} did not answer {method} {path} in time",
                                   hint="the server may be busy; retry, or " + self.log_hint) from None
        except httpx.TransportError as error:
            raise UnreachableError(f"cannot reach {self.server} at {self.url}: {error}",
                                   hint=self.unreachable_hint) from None
        if response.status_code < 400:
            return response
        payload = _payload(response)
        if response.status_code == 404 and path.startswith(PREFIX) and _is_route_missing(payload):
            raise RoutesAbsent(f"{self.url} has no kvctl routes: {method} {path} is missing (LMCache's own server "
                               "without kvctl's plugins)", hint=self.no_routes_hint)
        if response.status_code == 401 and path.startswith(PREFIX):
            raise RejectedError(f"{self.url} wants a bearer token for kvctl's routes: {_message(payload)}",
                                hint=f"set {TOKEN_VARIABLE} (source the configuration's env.sh) for an instance "
                                "named by URL, or give its inventory entry token_file: or env_file:")
        if response.status_code == 503 and isinstance(payload, dict) and payload.get(ERROR_CODE) == BUSY:
            raise ServerError(f"{self.url} is busy: {_message(payload)}",
                              hint="another kvctl (a snapshot save or load?) is moving chunk bytes there; "
                              "retry when it has finished")
        if response.status_code < 500:
            raise RejectedError(f"{self.url} rejected {method} {path}: {_message(payload)}",
                                hint="check the request; the server's message says what it wants")
        raise ServerError(f"{self.url} failed {method} {path} (HTTP {response.status_code}): {_message(payload)}",
                          hint=self.log_hint)

    def close(self) -> None:
        self._client.close()

    def __enter__(self):
        return self

    def __exit__(self, *_exc) -> None:
        self.close()


def _payload(response) -> Any:
    text = response.text
    try:
        return json.loads(text) if text else None
    except ValueError:
        return text


def _message(payload: Any) -> str:
    if isinstance(payload, dict):
        # kvctl's routes answer {ERROR_CODE, ERROR_MESSAGE}; FastAPI's own refusals {"detail"}
        return str(payload.get(ERROR_MESSAGE) or payload.get("detail") or payload.get(ERROR_CODE) or payload)
    return str(payload)[:300]


def _is_route_missing(payload: Any) -> bool:
    """FastAPI's own 404 for an unknown path, as opposed to a kvctl route's not_found answer."""
    return isinstance(payload, dict) and payload.get("detail") == "Not Found"
