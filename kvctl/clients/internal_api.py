"""LMCache's in-process internal API server: its stock endpoints and kvctl's /kvctl/v1 routes.

One server per vLLM process (scheduler at port_start, worker r at port_start + 1 + r), over TCP
(`http://127.0.0.1:7000`) or a Unix socket (`unix:/path/prefix_7000`).
"""

from __future__ import annotations

from typing import Any

from kvctl_plugins.wire import FRAMES_TYPE, NEXT_HEADER, PREFIX

from kvctl.clients.http import HTTPClient

TIMEOUT_S = 10.0
CHUNKS_TIMEOUT_S = 300.0  # one chunk-bytes request carries up to wire.MAX_CHUNKS_BODY (256 MiB), from disk or Redis


class InternalAPIClient(HTTPClient):
    server = "LMCache's internal API"
    unreachable_hint = ("check that the engine runs with internal_api_server_enabled and the port "
                        "(worker r listens on port_start + 1 + r)")
    no_routes_hint = ("start the engine with kvctl's plugins: kvctl serve, or "
                      "kv_connector_module_path=kvctl_plugins.vllm_connector")
    log_hint = "check the engine's log"
    carries_routes_token = True

    def __init__(self, url: str, timeout: float = TIMEOUT_S) -> None:
        super().__init__(url, timeout)

    # -- stock LMCache endpoints -------------------------------------------------------------------

    def version(self) -> str:
        return self.request("GET", "/lmc_version")

    def conf(self, names: list[str] | None = None) -> dict[str, Any]:
        return self.request("GET", "/conf", params={"names": ",".join(names)} if names else None)

    def meta(self) -> dict[str, Any]:
        return self.request("GET", "/meta")

    def env(self) -> dict[str, str]:
        return self.request("GET", "/env")

    def backends(self) -> dict[str, str]:
        return self.request("GET", "/backends")

    def metrics(self) -> str:
        return self.request("GET", "/metrics")

    def clear(self, locations: list[str] | None = None) -> dict[str, Any]:
        return self.request("DELETE", "/cache/clear", params={"locations": locations} if locations else None)

    def freeze(self, enabled: bool | None = None) -> dict[str, Any]:
        if enabled is None:
            return self.request("GET", "/freeze/status")
        return self.request("PUT", "/freeze/enable" if enabled else "/freeze/disable")

    def hot_cache(self, enabled: bool | None = None) -> dict[str, Any]:
        if enabled is None:
            return self.request("GET", "/hot_cache/status")
        return self.request("PUT", "/hot_cache/enable" if enabled else "/hot_cache/disable")

    def set_conf(self, values: dict[str, Any]) -> dict[str, Any]:
        """POST /conf: {"updated": {key: value}, "errors": {key: why}} (400 when nothing was updated)."""
        return self.request("POST", "/conf", values)

    def create_backends(self) -> dict[str, Any]:
        """Create the backends the current configuration names and the engine lacks."""
        return self.request("POST", "/backends")

    def close_backend(self, name: str) -> dict[str, Any]:
        return self.request("DELETE", f"/backends/{name}")

    def recreate_backend(self, name: str) -> dict[str, Any]:
        return self.request("POST", f"/backends/{name}/recreate")

    def bypass_list(self) -> dict[str, Any]:
        return self.request("GET", "/bypass/list")

    def bypass(self, name: str, bypassed: bool) -> dict[str, Any]:
        return self.request("PUT", "/bypass/add" if bypassed else "/bypass/remove", params={"backend_name": name})

    def chunk_statistics(self, action: str) -> dict[str, Any]:
        """start, stop, reset (POST) or status (GET) of the scheduler's chunk statistics."""
        if action == "status":
            return self.request("GET", "/chunk_statistics/status")
        return self.request("POST", f"/chunk_statistics/{action}")

    # -- kvctl routes --------------------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        return self.request("GET", f"{PREFIX}/info")

    def live_counters(self) -> dict[str, int]:
        """LMCache's counters (named as /metrics names them, without `lmcache:`) as of now: /metrics
        lag them by up to LMCache's export interval."""
        return self.request("GET", f"{PREFIX}/stats")["counters"]

    def lookup(self, tokens: list[int]) -> dict[str, Any]:
        import msgspec  # 128K tokens are ~1 MiB of JSON: written in C (json.dumps was a third of the round trip)

        return self.send("POST", f"{PREFIX}/lookup", content=msgspec.json.encode({"tokens": tokens}),
                         headers={"content-type": "application/json"}).json()

    def keys(self, tier: str, offset: int = 0, limit: int = 100) -> dict[str, Any]:
        return self.request("GET", f"{PREFIX}/keys", params={"tier": tier, "offset": offset, "limit": limit})

    def pin(self, tokens: list[int], ttl_s: float | None = None, tiers: list[str] | None = None,
            pin_id: str | None = None, replace: bool = False) -> dict[str, Any]:
        body = {"tokens": tokens, "ttl_s": ttl_s, "tiers": tiers, "pin_id": pin_id, "replace": replace or None}
        return self.request("POST", f"{PREFIX}/pin", {k: v for k, v in body.items() if v is not None})

    def unpin(self, pin_id: str | None = None, tokens: list[int] | None = None, everything: bool = False) -> dict:
        if everything:
            body: dict[str, Any] = {"all": True}
        elif pin_id is not None:
            body = {"pin_id": pin_id}
        else:
            body = {"tokens": tokens}
        return self.request("POST", f"{PREFIX}/unpin", body)

    def pins(self) -> list[dict[str, Any]]:
        return self.request("GET", f"{PREFIX}/pins")["pins"]

    def evict(self, *, tokens: list[int] | None = None, keys: list[str] | None = None, tiers: list[str] | None = None,
              everything: bool = False, dry_run: bool = False, force: bool = False) -> dict[str, Any]:
        body = {"tokens": tokens, "keys": keys, "tiers": tiers, "all": everything, "dry_run": dry_run, "force": force}
        return self.request("POST", f"{PREFIX}/evict", {k: v for k, v in body.items() if v not in (None, False)})

    def prefetch(self, tokens: list[int]) -> dict[str, Any]:
        return self.request("POST", f"{PREFIX}/prefetch", {"tokens": tokens})

    def read_chunks(self, keys: list[str], tiers: list[str] | None = None) -> tuple[bytes, list[str]]:
        """(a body of frames for those of `keys` this worker holds, each from the first tier that holds
        it; the keys still to ask for, when the answer stopped at its size cap: empty when done)."""
        body: dict[str, Any] = {"keys": keys} if tiers is None else {"keys": keys, "tiers": tiers}
        response = self.send("POST", f"{PREFIX}/chunks/read", json=body, timeout=CHUNKS_TIMEOUT_S)
        next_index = response.headers.get(NEXT_HEADER)
        return response.content, [] if next_index is None else keys[int(next_index):]

    def write_chunks(self, body: bytes, tiers: list[str] | None = None) -> dict[str, Any]:
        """Store a body of frames on `tiers` (None: the engine's first, the CPU tier): {"written",
        "already", "dropped"}, each {tier: chunks}. Any frame the engine cannot take: RejectedError,
        and nothing is written."""
        response = self.send("POST", f"{PREFIX}/chunks/write", content=body, headers={"Content-Type": FRAMES_TYPE},
                             params={"tiers": ",".join(tiers)} if tiers else None, timeout=CHUNKS_TIMEOUT_S)
        return response.json()
