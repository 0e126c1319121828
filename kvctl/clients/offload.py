"""LMCache's ZMQ offload server (in-process mode, one per vLLM worker).

It answers one kind of request, OffloadMsg{hashes, slot_mapping, offsets}: "store these chunk
hashes from these KV slots". In LMCache 0.5.6 a request that raises inside the server leaves its
REP socket without a reply, and every later client stalls (LMCache issue #4985), so kvctl
validates each message before sending it, and uses a fresh REQ socket with a receive timeout and
no linger for every request.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time

from kvctl.core.errors import UnreachableError, UsageError

IPC_SOCKET_PATH_MAX_LEN = 107  # sockaddr_un
DEFAULT_RPC_PORT = 100
TIMEOUT_S = 5.0


def offload_socket_path(engine_id: str, rank: int = 0, rpc_port: int | None = None,
                        base_path: str | None = None) -> str:
    """The ipc path LMCache's ZMQOffloadServer binds, derived exactly as LMCache does.

    engine_id is vLLM's kv_transfer_config.engine_id ("default" when unset; GET /meta on a worker
    says); rpc_port is LMCACHE_OFFLOAD_RPC_PORT (default 100); base_path is VLLM_RPC_BASE_PATH
    (default: the temporary directory).
    """
    if rpc_port is None:
        rpc_port = int(os.environ.get("LMCACHE_OFFLOAD_RPC_PORT", DEFAULT_RPC_PORT))
    base = base_path or os.environ.get("VLLM_RPC_BASE_PATH") or tempfile.gettempdir()
    path = f"{base}/engine_{engine_id or 'default'}_service_offload_lmcache_rpc_port_{rpc_port + rank}"
    if len(os.fsencode(path)) <= IPC_SOCKET_PATH_MAX_LEN:
        return path
    shortened = os.path.join(base, "lmcache_rpc_" + hashlib.sha256(os.fsencode(path)).hexdigest()[:16])
    if len(os.fsencode(shortened)) > IPC_SOCKET_PATH_MAX_LEN:
        raise UsageError(f"the offload socket directory {base!r} is too long for a Unix socket path",
                         hint="set VLLM_RPC_BASE_PATH to a shorter directory, for vLLM and kvctl alike")
    return shortened


def validate_offload(hashes: list[int], slot_mapping: list[int], offsets: list[int]) -> None:
    """Refuse what would raise inside the server (and so stall it for good)."""
    def ints(values, name, low, high):
        if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise UsageError(f"{name} must be a list of integers", hint="check the offload request")
        if any(not low <= v <= high for v in values):
            raise UsageError(f"{name} has values outside [{low}, {high}]", hint="check the offload request")

    ints(hashes, "hashes", -(2**63), 2**64 - 1)
    ints(slot_mapping, "slot_mapping", 0, 2**63 - 1)
    ints(offsets, "offsets", 1, 2**31 - 1)
    if len(hashes) != len(offsets):
        raise UsageError(f"{len(hashes)} hashes but {len(offsets)} offsets",
                         hint="give one offset (token count) per hash")
    if sum(offsets) != len(slot_mapping):
        raise UsageError(f"the offsets cover {sum(offsets)} tokens but slot_mapping has {len(slot_mapping)}",
                         hint="give one KV slot per token")


class OffloadClient:
    def __init__(self, path: str, timeout: float = TIMEOUT_S) -> None:
        self.path = path
        self.timeout = timeout

    def _request(self, hashes: list[int], slot_mapping: list[int], offsets: list[int]) -> bool:
        import msgspec
        import zmq

        if not os.path.exists(self.path):
            raise UnreachableError(f"no offload socket at {self.path}",
                                   hint="check the engine id (GET /meta on a worker) and that vLLM runs with "
                                   "LMCacheConnectorV1")
        context = zmq.Context.instance()
        sock = context.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, int(self.timeout * 1000))
        sock.setsockopt(zmq.SNDTIMEO, int(self.timeout * 1000))
        try:
            sock.connect(f"ipc://{self.path}")
            sock.send(msgspec.msgpack.encode({"hashes": hashes, "slot_mapping": slot_mapping, "offsets": offsets}))
            reply = msgspec.msgpack.decode(sock.recv())
        except zmq.Again:
            raise UnreachableError(f"the offload server at {self.path} did not answer in {self.timeout:.0f} s",
                                   hint="it may be stalled by an earlier bad request (LMCache issue #4985); "
                                   "restart vLLM") from None
        finally:
            sock.close(linger=0)
        return bool(isinstance(reply, dict) and reply.get("success"))

    def health(self) -> float:
        """Round-trip seconds of an empty offload request (stores nothing)."""
        start = time.perf_counter()
        if not self._request([], [], []):
            raise UnreachableError(f"the offload server at {self.path} answered without success",
                                   hint="check the vLLM worker's log")
        return time.perf_counter() - start

    def offload(self, hashes: list[int], slot_mapping: list[int], offsets: list[int]) -> bool:
        validate_offload(hashes, slot_mapping, offsets)
        return self._request(hashes, slot_mapping, offsets)
