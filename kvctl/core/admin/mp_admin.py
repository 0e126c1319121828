"""An MP server's storage at runtime and the checksums of a worker's KV blocks.

Reconfiguration: LMCache 0.5.6 can add, remove and resize the devices of a Device-DAX L2 adapter
started with hotplug_enabled (a /dev/dax device or a regular, mmap-able file), and add or drain
Device-DAX arenas of an L1 started with --l1-devdax-path; no other backend is reconfigurable. The
server checks every request (the path, the size against the slot size and the file, other owners
of the device): kvctl passes it through and shows the server's refusal (exit 4).

Checksums: MD5 of the KV cache blocks a registered worker (instance_id) holds, `chunk_size`
BLOCKS per chunk (not tokens), for comparing two workers or a store against a retrieve.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

from kvctl.core.common.display import shown
from kvctl.core.errors import RejectedError, UsageError

BACKEND = "dax"  # the only reconfigurable backend of 0.5.6
L2_MODES = {"add": (), "remove": ("migrate", "evict", "drain"), "resize": ("migrate", "evict")}
L1_MODES = {"add": (), "remove": ("drain",)}
DEFAULT_MODE = {"l2": "migrate", "l1": "drain"}
GONE = ("removed", "closed", "failed")  # device states the server no longer counts as mapped
# Binary units, as LMCache's own size strings ("4GiB", "512mb", "1048576").
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([a-z]*)$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}
MAX_BLOCKS = 1 << 20  # more block ids than any KV cache has: a typo like 0-99999999 is refused, not sent


# -- pure parts -------------------------------------------------------------------------------------

def parse_size(text: str) -> int:
    """Bytes of a size as LMCache reads it: 4GiB, 512MiB, 1.5g, 1048576 (units are powers of 1024)."""
    match = _SIZE.match(text.strip())
    unit = match.group(2).lower() if match else None
    size = float(match.group(1)) * _UNITS[unit] if unit in _UNITS else math.nan
    if not math.isfinite(size) or int(size) <= 0:  # 400 digits make an infinite float, which no int holds
        raise UsageError(f"bad size {shown(text, quoted=True)}", hint="write it as bytes or with a unit: 4GiB, "
                         "512MiB, 1.5GiB")
    return int(size)


def parse_blocks(text: str) -> list[int]:
    """Block ids from `0-15,32,40-47` (ranges inclusive), in the order written."""
    hint = "write block ids and inclusive ranges, e.g. 0-15,32,40-47"
    ids: list[int] = []
    for item in text.split(","):
        first, dash, last = item.strip().partition("-")
        if not first.strip().isdigit() or (dash and not last.strip().isdigit()):
            raise UsageError(f"bad block range {shown(item.strip(), quoted=True)} in --blocks", hint=hint)
        start, end = int(first), int(last) if dash else int(first)
        if end < start:
            raise UsageError(f"block range {start}-{end} runs backwards", hint=hint)
        if len(ids) + end - start + 1 > MAX_BLOCKS:
            raise UsageError(f"--blocks names more than {MAX_BLOCKS} blocks", hint=hint)
        ids.extend(range(start, end + 1))
    return ids


def format_blocks(ids: list[int]) -> str:
    """The --blocks form of block ids: runs of consecutive ids as START-END."""
    runs: list[list[int]] = []
    for block in ids:
        if runs and block == runs[-1][1] + 1:
            runs[-1][1] = block
        else:
            runs.append([block, block])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


# -- reconfiguration --------------------------------------------------------------------------------

@dataclass
class StorageStatus:
    """The server's adapters (GET /config/adapters), each reconfigurable L2 adapter with its devices,
    and L1's Device-DAX arenas (`l1["dax"]` False, with the server's reason, when L1 is DRAM)."""

    adapters: list[dict[str, Any]]
    l2: list[dict[str, Any]]
    l1: dict[str, Any]

    def devices(self) -> list[dict[str, Any]]:
        """One row per device or arena: tier, backend, adapter, device, capacity, used, state."""
        rows = []
        for adapter in self.l2:
            for device in adapter.get("status", {}).get("devices", []):
                rows.append({"tier": "l2", "backend": adapter.get("backend"), "adapter": adapter.get("adapter_index"),
                             "device": device.get("device_path"), "capacity_bytes": device.get("max_dax_size_bytes"),
                             "used_bytes": int(device.get("live_slot_count", 0)) * int(device.get("slot_bytes", 0)),
                             "state": device.get("state")})
        for arena in self.l1.get("arenas", []):
            rows.append({"tier": "l1", "backend": BACKEND, "adapter": None, "device": arena.get("device_path"),
                         "capacity_bytes": arena.get("size_in_bytes"), "used_bytes": arena.get("used_bytes"),
                         "state": arena.get("state")})
        return rows

    def device(self, tier: str, path: str, adapter: int = 0) -> dict[str, Any] | None:
        """The live device at `path` (as the server matches it: stripped; removed, closed and failed
        devices are not live), if the server has one."""
        for row in self.devices():
            if (row["tier"], row["device"]) == (tier, path.strip()) and row["state"] not in GONE and (
                    tier == "l1" or row["adapter"] == adapter):
                return row
        return None

    def as_dict(self) -> dict[str, Any]:
        return {"adapters": self.adapters, "devices": self.devices(), "l2": self.l2, "l1": self.l1}


def storage_status(server) -> StorageStatus:
    adapters = server.adapters()
    backends = dict.fromkeys(a["type_name"] for a in adapters if a.get("tier") == "l2" and a.get("reconfigurable"))
    l2 = [adapter for backend in backends for adapter in server.reconfigure_status(backend).get("adapters", [])]
    try:
        l1: dict[str, Any] = {"dax": True, "arenas": server.l1_dax_status().get("arenas", [])}
    except RejectedError as error:  # 409: L1 is not Device-DAX backed (--l1-devdax-path not set)
        l1 = {"dax": False, "reason": error.message}
    return StorageStatus(adapters, l2, l1)


def status(instance) -> StorageStatus:
    from kvctl.clients.mp_server import MPServerClient

    with MPServerClient(instance.mp_server_url("storage reconfigurations")) as server:
        return storage_status(server)


@dataclass(frozen=True)
class Change:
    """One reconfiguration: what is sent, why it needs a yes (`risk`, None: it cannot drop cached
    data), the server's answer (None in a dry run) and the status (before a dry run, after a change)."""

    action: str
    tier: str
    device: str
    path: str
    body: dict[str, Any]
    status: StorageStatus
    risk: str | None = None
    dry_run: bool = False
    answer: dict[str, Any] | None = field(default=None)

    def as_dict(self) -> dict[str, Any]:
        return {"action": self.action, "tier": self.tier, "backend": BACKEND, "device": self.device,
                "dry_run": self.dry_run, "request": {"method": "POST", "path": self.path, "body": self.body},
                "risk": self.risk, "answer": self.answer, "status": self.status.as_dict()}


def request_body(action: str, tier: str, device: str, size: int | None = None, mode: str | None = None,
                 force: bool = False, adapter: int | None = None) -> dict[str, Any]:
    """The body LMCache takes for `action` on `tier`; what it would refuse or ignore is a usage error."""
    modes = (L2_MODES if tier == "l2" else L1_MODES).get(action)
    if modes is None:
        raise UsageError(f"{tier.upper()} devices cannot be {action}d at runtime",
                         hint="LMCache 0.5.6 resizes L2 DAX devices only; remove and add an L1 arena instead")
    if tier == "l1" and (adapter is not None or force):
        raise UsageError("--adapter and --force are for L2 adapters", hint="drop them with --tier l1")
    if not device.strip():
        raise UsageError("--device is empty", hint="give the DAX device or file, e.g. --device /dev/dax0.0")
    if mode is not None and mode not in modes:
        allowed = ", ".join(modes) or "none"
        raise UsageError(f"--mode {mode} does not apply to {tier} {action}", hint=f"modes it takes: {allowed}")
    if force and action == "add":
        raise UsageError("--force does not apply to add", hint="it is for remove and resize")
    if (size is None) != (action == "remove"):
        raise UsageError(f"{action} {'needs' if size is None else 'takes no'} --size",
                         hint="e.g. --size 4GiB" if size is None else "remove takes --mode instead")
    body: dict[str, Any] = {"device_path": device}
    if tier == "l2":
        body["adapter_index"] = adapter or 0
    if size is not None:
        body["size"] = size
    if mode is not None:
        body["mode"] = mode
    if force:
        body["force"] = True
    return body


def risk(action: str, tier: str, body: dict[str, Any], current: dict[str, Any] | None) -> str | None:
    """Why a change can drop cached chunks (asks for a yes); None when it cannot: add, a drain, a
    resize that grows a known device."""
    mode = body.get("mode", DEFAULT_MODE[tier])
    if action == "remove" and mode != "drain":
        what = "deletes its chunks" if mode == "evict" else "moves its chunks to the adapter's other devices"
        return f"{what} and unmaps it" + ("; --force takes locked chunks too" if body.get("force") else "")
    if action == "resize":
        if current is None or current.get("capacity_bytes") is None:
            return "its current size is unknown: a shrink moves or evicts the chunks past the new end"
        if body["size"] < current["capacity_bytes"] or body.get("force"):
            what = "evicts" if mode == "evict" else "moves"
            return f"shrinks it: {what} the chunks past the new end"
    return None


def plan(instance, action: str, tier: str, device: str, size: int | None = None, mode: str | None = None,
         force: bool = False, adapter: int | None = None) -> Change:
    """The request for `action` and the current status, nothing changed (a dry run, and the
    question before a change that can drop cached chunks)."""
    from kvctl.clients.mp_server import MPServerClient

    body = request_body(action, tier, device, size, mode, force, adapter)
    with MPServerClient(instance.mp_server_url("storage reconfigurations")) as server:
        current = storage_status(server)
    path = MPServerClient.reconfigure_path(BACKEND, tier, action)
    return Change(action, tier, device, path, body, current,
                  risk(action, tier, body, current.device(tier, device, body.get("adapter_index", 0))), True)


def apply(instance, change: Change) -> Change:
    """Send `change` (from plan): the change sent, with the server's answer and the status after it."""
    from kvctl.clients.mp_server import MPServerClient

    with MPServerClient(instance.mp_server_url("storage reconfigurations")) as server:
        try:
            answer = server.reconfigure(change.path, change.body)
        except RejectedError as error:
            error.hint = "the server's reason says why; kvctl reconfigure status shows its devices"
            raise
        return replace(change, answer=answer, status=storage_status(server), dry_run=False)


# -- checksums --------------------------------------------------------------------------------------

@dataclass
class Checksums:
    worker: int
    chunk_size: int
    layerwise: bool
    chunks: list[dict[str, Any]]

    def as_dict(self) -> dict[str, Any]:
        return {"worker": self.worker, "chunk_size": self.chunk_size, "layerwise": self.layerwise,
                "num_chunks": len(self.chunks), "chunks": self.chunks}


def worker_layout(server_status: dict[str, Any], worker: int) -> dict[str, Any] | None:
    """The KV layout a worker registered (num_blocks, kernel_groups with tokens_per_block), if it did."""
    entry = (server_status.get("cache_context_meta") or {}).get(str(worker))
    return entry.get("kv_cache_layout") or {} if isinstance(entry, dict) else None


def blocks_per_chunk(server_status: dict[str, Any], worker: int) -> int:
    """The server's chunk (tokens) in the worker's blocks, from its registered KV layout."""
    layout = worker_layout(server_status, worker)
    if layout is None:
        registered = ", ".join(sorted(server_status.get("cache_context_meta") or {})) or "none"
        raise RejectedError(f"worker {worker} has no KV cache registered with the server",
                            hint=f"registered workers: {registered}; pick one with --worker")
    block = (layout.get("kernel_groups") or [{}])[0].get("tokens_per_block")
    if not isinstance(block, int) or block <= 0 or server_status.get("chunk_size", 0) % block:
        raise UsageError(f"cannot tell worker {worker}'s block size from the server's status",
                         hint="pass --chunk-size (blocks per chunk)")
    return server_status["chunk_size"] // block


def checksums(instance, blocks: list[int], chunk_size: int | None = None, worker: int = 0,
              layerwise: bool = False) -> Checksums:
    """MD5 per chunk of `blocks` (default chunk: the server's chunk size in the worker's blocks).
    Blocks past the worker's KV cache are refused here: LMCache answers them with a bare 500."""
    from kvctl.clients.mp_server import MPServerClient

    if not blocks:
        raise UsageError("no blocks to checksum", hint="pass --blocks, e.g. 0-15")
    with MPServerClient(instance.mp_server_url("KV block checksums")) as server:
        server_status = server.status()
        size = chunk_size or blocks_per_chunk(server_status, worker)
        count = (worker_layout(server_status, worker) or {}).get("num_blocks")
        if isinstance(count, int) and max(blocks) >= count:
            raise UsageError(f"block {max(blocks)} is past worker {worker}'s KV cache ({count} blocks)",
                             hint=f"block ids run from 0 to {count - 1}")
        answer = server.checksums(blocks, size, worker, layerwise)
    size = int(answer.get("chunk_size", size))
    digests = answer.get("chunk_checksums", [])
    chunks = []
    for index in range(int(answer.get("num_chunks", len(digests)))):
        entry: dict[str, Any] = {"index": index, "blocks": format_blocks(blocks[index * size:(index + 1) * size])}
        if layerwise:
            entry["layers"] = {layer: values[index] for layer, values in digests.items()}
        else:
            entry["md5"] = digests[index]
        chunks.append(entry)
    return Checksums(worker, size, layerwise, chunks)
