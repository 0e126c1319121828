"""The LMCache MP server's HTTP API (`lmcache server`, default http://127.0.0.1:8080): the stock
0.5.6 endpoints kvctl uses and kvctl's /kvctl/v1 routes (kvctl_plugins.mp_routes).

Keys are EncodedObjectKey dicts (kvctl.core.lmcache.keys.ObjectKey.encoded()); tiers are "l1", "l2", "all".
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
    carries_routes_token = True

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

    def reconfigure_status(self, backend: str) -> dict[str, Any]:
        """{"enabled", "backend", "num_adapters", "adapters": [{"adapter_index", "status": {"devices": […]}}]}."""
        return self.request("GET", f"/reconfigure/{_segment(backend)}/l2/status")

    def l1_dax_status(self) -> dict[str, Any]:
        """{"arenas": [{"device_path", "size_in_bytes", "used_bytes", "state", …}]}; 409 when L1 is not DAX."""
        return self.request("GET", "/reconfigure/dax/l1/status")

    @staticmethod
    def reconfigure_path(backend: str, tier: str, operation: str) -> str:
        """/reconfigure/{backend}/{tier}/{operation} (tier l2, or l1 for Device-DAX L1)."""
        return f"/reconfigure/{_segment(backend)}/{tier}/{_segment(operation)}"

    def reconfigure(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST a reconfigure_path: add, remove or resize a device at runtime."""
        return self.request("POST", path, body)

    def checksums(self, block_ids: list[int], chunk_size: int, instance_id: int = 0,
                  layerwise: bool = False) -> dict[str, Any]:
        """MD5 per `chunk_size` blocks of a registered worker's KV cache (per layer with `layerwise`)."""
        return self.request("POST", "/cache/checksums", {"block_ids": block_ids, "chunk_size": chunk_size,
                                                         "instance_id": instance_id, "layerwise": layerwise})

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

    def read_chunks(self, keys: list[str]) -> tuple[bytes, list[str]]:
        """(a body of frames for those of `keys` (native object keys) L1 holds; the keys still to ask
        for when the answer stopped at its size cap: empty when done)."""
        from kvctl_plugins.wire import NEXT_HEADER

        from kvctl.clients.internal_api import CHUNKS_TIMEOUT_S

        response = self.send("POST", f"{PREFIX}/chunks/read", json={"keys": keys}, timeout=CHUNKS_TIMEOUT_S)
        next_index = response.headers.get(NEXT_HEADER)
        return response.content, [] if next_index is None else keys[int(next_index):]

    def write_chunks(self, body: bytes) -> dict[str, Any]:
        """Store a body of frames into L1: {"written", "already", "dropped"}, each {"cpu": objects}. Any
        frame the server cannot take: RejectedError, and nothing of this body is written; a server error
        while writing leaves the objects before it written (each whole)."""
        from kvctl_plugins.wire import FRAMES_TYPE

        from kvctl.clients.internal_api import CHUNKS_TIMEOUT_S

        response = self.send("POST", f"{PREFIX}/chunks/write", content=body, headers={"Content-Type": FRAMES_TYPE},
                             timeout=CHUNKS_TIMEOUT_S)
        return response.json()


def _segment(text: str) -> str:
    """One URL path segment: a cache salt may hold any character."""
    from urllib.parse import quote

    return quote(text, safe="")
