"""The LMCache MP server's HTTP API (`lmcache server`, default http://127.0.0.1:8080): the stock
0.5.6 endpoints kvctl uses and kvctl's /kvctl/v1 routes (kvctl_plugins.mp_routes).

Keys are EncodedObjectKey dicts (kvctl.core.keys.ObjectKey.encoded()); tiers are "l1", "l2", "all".
"""

from __future__ import annotations

from typing import Any

from kvctl_plugins.wire import PREFIX

from kvctl.clients.http import HTTPClient

TIMEOUT_S = 10.0


class MPServerClient(HTTPClient):
    server = "the LMCache MP server"
    unreachable_hint = "check that 'lmcache server' runs and its --http-host/--http-port"
    no_routes_hint = ("start the server with kvctl's routes: kvctl serve --mode mp, or add "
                      "--server-module '{\"module_path\": \"kvctl_plugins.mp_routes\"}' to lmcache server")
    log_hint = "check the LMCache server's log"

    def __init__(self, url: str, timeout: float = TIMEOUT_S) -> None:
        super().__init__(url, timeout)

    # -- stock LMCache endpoints -------------------------------------------------------------------

    def healthcheck(self) -> dict[str, Any]:
        return self.request("GET", "/healthcheck")

    def status(self) -> dict[str, Any]:
        return self.request("GET", "/status")

    def adapters(self) -> list[dict[str, Any]]:
        return self.request("GET", "/config/adapters")["adapters"]

    def list_objects(self, adapter: str | None = None, model: str | None = None, page_size: int = 500,
                     page_token: str | None = None) -> dict[str, Any]:
        """One page of L2 keys; LMCache 0.5.6 answers 503 for every adapter but S3."""
        params = {"tier": "l2", "adapter": adapter, "model_name": model, "page_size": page_size,
                  "page_token": page_token}
        return self.request("GET", "/cache/objects", params={k: v for k, v in params.items() if v is not None})

    def delete_objects(self, keys: list[dict[str, Any]], tier: str = "all", force: bool = False,
                       adapter: str | None = None) -> dict[str, Any]:
        return self.request("DELETE", "/cache/objects",
                            {"keys": keys, "tier": tier, "force": force, "adapter": adapter})

    def clear(self, force: bool = False) -> dict[str, Any]:
        """Empties L1 (the only tier /cache/clear takes); force also drops locked objects."""
        return self.request("POST", "/cache/clear", {"tier": "l1", "force": force})

    def prefetch(self, model: str, tokens: list[int], world_size: int = 1, cache_salt: str = "") -> dict[str, Any]:
        return self.request("POST", "/cache/prefetches", {"model_name": model, "world_size": world_size,
                                                          "token_ids": tokens, "cache_salt": cache_salt})

    def prefetch_status(self, request_id: str) -> dict[str, Any]:
        return self.request("GET", f"/cache/prefetches/{request_id}")

    def quotas(self) -> dict[str, Any]:
        """{"users": {salt: {"limit_gb", "current_usage_gb"}}} ("_default" is the empty salt)."""
        return self.request("GET", "/quota")

    def quota(self, salt: str) -> dict[str, Any]:
        return self.request("GET", f"/quota/{_segment(salt)}")

    def set_quota(self, salt: str, limit_gb: float) -> dict[str, Any]:
        return self.request("PUT", f"/quota/{_segment(salt)}", {"limit_gb": limit_gb})

    def delete_quota(self, salt: str) -> dict[str, Any]:
        return self.request("DELETE", f"/quota/{_segment(salt)}")

    # -- kvctl routes --------------------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        return self.request("GET", f"{PREFIX}/info")

    def keys(self, offset: int = 0, limit: int = 1000, model: str | None = None) -> dict[str, Any]:
        """A page of L1's objects ({"total", "next_offset", "keys": [{"key", "size", "locked"}]})."""
        params = {"tier": "cpu", "offset": offset, "limit": limit, "model": model}
        return self.request("GET", f"{PREFIX}/keys", params={k: v for k, v in params.items() if v is not None})

    def lookup(self, tokens: list[int], model: str | None = None, world_size: int | None = None,
               cache_salt: str = "") -> dict[str, Any]:
        """Which chunks L1 holds, per chunk with its keys (every object group and rank)."""
        body = {"tokens": tokens, "model": model, "world_size": world_size, "cache_salt": cache_salt}
        return self.request("POST", f"{PREFIX}/lookup", {k: v for k, v in body.items() if v})


def _segment(text: str) -> str:
    """One URL path segment: a cache salt may hold any character."""
    from urllib.parse import quote

    return quote(text, safe="")
