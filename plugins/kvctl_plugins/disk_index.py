"""A local disk tier that survives restarts.

LMCache 0.5.6 keeps LocalDiskBackend's index in memory only, so a restarted engine ignores the
files its predecessor wrote (LMCache issues #562, #1175, #1788). At backend start this rebuilds
the index from the directory: a file's name is its chunk key, and its shape follows from the
engine's metadata and the file size. Files of other engines (another model, rank or dtype) are
left alone; files that cannot be a chunk of this engine are skipped and reported; the size budget
counts what is indexed, and files beyond it are reported, never deleted. Oldest files go in first,
so they are the first LRU candidates.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger("kvctl_plugins.disk_index")
_REPORTS: list[dict[str, Any]] = []
REPORT_SAMPLE = 10


def rebuild_reports() -> list[dict[str, Any]]:
    return list(_REPORTS)


def _parse_name(stem: str) -> tuple[str, int, int, str, str, tuple[str, ...]] | None:
    """(model-with-slashes-replaced, world size, worker id, hash hex, dtype, tags) of a file stem."""
    parts = stem.split("@")
    tags: list[str] = []
    while len(parts) > 5 and "%" in parts[-1]:
        tags.insert(0, parts.pop())
    if len(parts) < 5 or not parts[-4].isdigit() or not parts[-3].isdigit():
        return None
    try:
        int(parts[-2], 16)
    except ValueError:
        return None
    return "@".join(parts[:-4]), int(parts[-4]), int(parts[-3]), parts[-2], parts[-1], tuple(tags)


def token_bytes(metadata, chunk_size: int) -> int:
    """The bytes one token of this engine's KV cache takes, over every layer group."""
    shapes, dtypes = metadata.get_shapes(chunk_size), metadata.get_dtypes()
    return sum(shape.numel() * dtype.itemsize for shape, dtype in zip(shapes, dtypes, strict=True)) // chunk_size


def chunk_tokens(size: int, per_token: int, config) -> int | None:
    """The tokens a chunk of `size` bytes holds, where it can be one this engine stores (whole tokens, at
    most a chunk, fewer only with save_unfull_chunk); None where it cannot."""
    tokens, remainder = divmod(size, per_token)
    if remainder or not 0 < tokens <= config.chunk_size or (tokens < config.chunk_size
                                                            and not config.save_unfull_chunk):
        return None
    return tokens


def rebuild(backend, config, metadata) -> dict[str, Any]:
    import torch
    from lmcache.utils import TORCH_DTYPE_TO_STR_DTYPE, CacheEngineKey
    from lmcache.v1.memory_management import MemoryFormat

    report: dict[str, Any] = {"path": backend.path, "indexed": 0, "indexed_bytes": 0, "other_engines": 0,
                              "untrusted": 0, "over_budget": 0, "untrusted_files": [], "reason": None}
    _REPORTS.append(report)
    if metadata is None or getattr(config, "use_layerwise", False):
        report["reason"] = "layer-wise keys or no engine metadata: not rebuilt"
        return report
    shapes, dtypes = metadata.get_shapes(config.chunk_size), metadata.get_dtypes()
    if len(shapes) != 1:
        report["reason"] = "several KV layer groups: not rebuilt"
        return report
    dtype = dtypes[0]
    bytes_per_token = token_bytes(metadata, config.chunk_size)
    fmt = MemoryFormat.KV_MLA_FMT if metadata.use_mla else MemoryFormat.KV_2LTD
    world_size = 1 if (config.get_extra_config_value("save_only_first_rank", metadata.use_mla)
                       and metadata.use_mla) else metadata.world_size
    ours = (metadata.model_name.replace("/", "-"), world_size, metadata.worker_id, TORCH_DTYPE_TO_STR_DTYPE[dtype])
    candidates = []
    try:
        entries = list(os.scandir(backend.path))
    except OSError as error:
        report["reason"] = f"cannot list {backend.path}: {error.strerror}"
        return report
    for entry in entries:
        if not entry.name.endswith(".pt") or not entry.is_file(follow_symlinks=False):
            continue
        parsed = _parse_name(entry.name[:-3])
        if parsed is None:
            _untrusted(report, entry.name, "name is not a chunk key")
            continue
        if parsed[:3] + (parsed[4],) != ours:
            report["other_engines"] += 1
            continue
        stat = entry.stat()
        tokens = chunk_tokens(stat.st_size, bytes_per_token, config)
        if tokens is None:
            _untrusted(report, entry.name, f"{stat.st_size} bytes is not a chunk of this engine")
            continue
        request_configs = {"lmcache.tag." + tag.split("%", 1)[0]: tag.split("%", 1)[1] for tag in parsed[5]} or None
        key = CacheEngineKey(metadata.model_name, world_size, metadata.worker_id, int(parsed[3], 16), dtype,
                             request_configs)
        if backend._key_to_path(key) != entry.path:
            _untrusted(report, entry.name, "does not round-trip to its own key")
            continue
        candidates.append((stat.st_mtime, entry.path, key, tokens, stat.st_size))
    budget = backend.max_cache_size - backend.current_cache_size
    chosen = []
    for mtime, _path, key, tokens, size in sorted(candidates, key=lambda c: c[0], reverse=True):  # newest first
        if size > budget:
            report["over_budget"] += 1
            continue
        budget -= size
        chosen.append((mtime, key, tokens, size))
    for _, key, tokens, size in sorted(chosen, key=lambda c: c[0]):  # oldest first: first to be evicted
        shape = metadata.get_shapes(tokens)[0]
        backend.insert_key(key, size, torch.Size(shape), dtype, fmt)
        backend.current_cache_size += size
        backend.usage += size
        report["indexed"] += 1
        report["indexed_bytes"] += size
    if hasattr(backend, "stats_monitor"):
        backend.stats_monitor.update_local_storage_usage(backend.usage)
    logger.warning("kvctl: disk tier %s: indexed %d chunk files (%d bytes) from earlier runs; skipped %d untrusted, "
                   "%d over budget, %d of other engines", backend.path, report["indexed"], report["indexed_bytes"],
                   report["untrusted"], report["over_budget"], report["other_engines"])
    return report


def _untrusted(report: dict[str, Any], name: str, why: str) -> None:
    report["untrusted"] += 1
    if len(report["untrusted_files"]) < REPORT_SAMPLE:
        report["untrusted_files"].append({"file": name, "reason": why})


def install() -> None:
    from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

    original = LocalDiskBackend.__init__
    if getattr(original, "kvctl_wrapped", False):
        return

    def __init__(self, config, loop, local_cpu_backend, *args, **kwargs):
        original(self, config, loop, local_cpu_backend, *args, **kwargs)
        metadata = kwargs.get("metadata", args[2] if len(args) > 2 else None)
        try:
            rebuild(self, config, metadata)
        except Exception as error:  # noqa: BLE001 - a failed rebuild must not stop the engine
            logger.warning("kvctl: disk index rebuild failed for %s: %s", getattr(self, "path", "?"), error)

    __init__.kvctl_wrapped = True
    LocalDiskBackend.__init__ = __init__
