"""LMCache's cache controller (in-process mode, `python -m lmcache.v1.api_server`, default :9000): the
fleet's registry of engines (instance id, worker id, address, heartbeats) and its index of chunk hashes.

Its errors are HTTP 500 with {"detail"} (its handlers assert on message types), which the shared
client shows verbatim. Its /health forwards to the instance and has no timeout of its own (a dead
instance hangs it): every call here runs under kvctl's timeout.
"""

from __future__ import annotations

from typing import Any

from kvctl.clients.http import HTTPClient

TIMEOUT_S = 10.0


class ControllerClient(HTTPClient):
    server = "LMCache's controller"
    unreachable_hint = ("check that the controller runs (python -m lmcache.v1.api_server, or kvctl serve "
                        "--controller) and its URL (controller://HOST:PORT, kvctl.yaml's controller:)")
    log_hint = "check the controller's log"

    def __init__(self, url: str, timeout: float = TIMEOUT_S) -> None:
        super().__init__(url, timeout)

    def instance_ids(self) -> list[str]:
        """Every registered instance, read from the registry itself (GET /controller/key-stats); the
        listings of "all" (/query_worker_info, GET /controller/workers) are cached for 30 s."""
        return [str(entry["instance_id"]) for entry in self.key_stats().get("instances", [])]

    def workers(self, instance_id: str) -> list[dict[str, Any]]:
        """One instance's registered workers, afresh: {"instance_id", "worker_id", "ip", "port",
        "registration_time", "last_heartbeat_time", ...}."""
        return self.request("POST", "/query_worker_info", {"instance_id": instance_id, "worker_ids": None})[
            "worker_infos"]

    def key_stats(self) -> dict[str, Any]:
        return self.request("GET", "/controller/key-stats")

    def key_counts(self) -> dict[tuple[str, int], int]:
        """(instance id, worker id) -> how many chunk hashes the controller's index holds for it."""
        answer = self.request("GET", "/controller/workers")
        return {(worker["instance_id"], worker["worker_id"]): worker.get("key_count", 0)
                for worker in answer.get("workers", [])}

    def lookup(self, tokens: list[int]) -> dict[str, tuple[str, int]]:
        """instance id -> (location, matched prefix end) by the controller's own hashing (builtin, chunk 256)."""
        layout = self.request("POST", "/lookup", {"tokens": tokens}).get("layout_info") or {}
        return {instance: (entry[0], int(entry[1])) for instance, entry in layout.items()}

    def health(self, instance_id: str) -> dict[str, int]:
        """worker id -> 0 (healthy) or -1, as the instance's workers answer the controller."""
        return self.request("POST", "/health", {"instance_id": instance_id})["error_codes"]

    def pin(self, instance_id: str, location: str, tokens: list[int]) -> int:
        return int(self.request("POST", "/pin", {"instance_id": instance_id, "location": location,
                                                  "tokens": tokens})["num_tokens"])

    def clear(self, instance_id: str, location: str) -> int:
        return int(self.request("POST", "/clear", {"instance_id": instance_id, "location": location})["num_tokens"])
