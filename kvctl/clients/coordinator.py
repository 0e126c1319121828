"""The LMCache MP coordinator's pin table (`lmcache coordinator`, default http://127.0.0.1:9300):
fleet-wide pins that keep a prompt's chunks out of the L2 eviction plan. The coordinator hashes the
tokens itself, with its own --chunk-size and --hash-algorithm (which must match the servers').
"""

from __future__ import annotations

from typing import Any

from kvctl.clients.http import HTTPClient

TIMEOUT_S = 10.0
PAGE = 10_000  # the coordinator's largest page


class CoordinatorClient(HTTPClient):
    server = "the LMCache coordinator"
    unreachable_hint = "check that 'lmcache coordinator' runs and the coordinator URL (--coordinator, kvctl.yaml)"
    log_hint = "check the coordinator's log"

    def __init__(self, url: str, timeout: float = TIMEOUT_S) -> None:
        super().__init__(url, timeout)

    def healthz(self) -> dict[str, Any]:
        return self.request("GET", "/healthz")

    def pin(self, model: str, tokens: list[int], world_size: int = 1, cache_salt: str = "") -> dict[str, Any]:
        """{"requested": chunks, "affected": keys, "status": "pinned"}; pins count, one unpin undoes one pin."""
        return self.request("POST", "/cache/pins", _body(model, tokens, world_size, cache_salt))

    def unpin(self, model: str, tokens: list[int], world_size: int = 1, cache_salt: str = "") -> dict[str, Any]:
        return self.request("DELETE", "/cache/pins", _body(model, tokens, world_size, cache_salt))

    def pins(self, model: str | None = None) -> list[dict[str, Any]]:
        """Every pinned key ({"key": EncodedObjectKey, "pin_count"}), of one model or all."""
        listed: list[dict[str, Any]] = []
        while True:
            page = self.request("GET", "/cache/pins", params={"model_name": model or "", "offset": len(listed),
                                                              "limit": PAGE})
            listed.extend(page["pins"])
            if not page["pins"] or len(listed) >= page["total"]:
                return listed


def _body(model: str, tokens: list[int], world_size: int, cache_salt: str) -> dict[str, Any]:
    return {"model_name": model, "world_size": world_size, "token_ids": tokens, "cache_salt": cache_salt}
