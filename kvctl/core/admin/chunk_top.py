"""`kvctl chunk-stats top`: the hottest chunks and prompts, from LMCache's own chunk statistics files.

LMCache's chunk statistics keep counts only, except with `chunk_statistics_strategy: file_hash`, whose
recorder appends one JSON line per request to `chunk_hashes_*.jsonl` files in its output directory:
`{"timestamp", "lookup_id", "chunk_hashes": [hex, …]}`, a prefix hash per chunk of the prompt. A
chunk's hash covers its whole prefix, so how many requests carried it is how often that prefix
recurred, and the last hash of a request names its whole prompt. Only those files are read, each
line checked; LMCache rotates and deletes them itself (this reads, never writes).
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvctl.core.errors import KvctlError, UsageError

FILE_GLOB = "chunk_hashes_*.jsonl"
MAX_LINE = 64 * 1024 * 1024  # a 1M-token prompt's line is about 90 KB per 1000 chunks


@dataclass
class Hot:
    chunk_hash: str  # LMCache's statistics hash (its own hashing, not necessarily the cache keys')
    chunks: int  # the chunk's position + 1: how many chunks of prefix the hash covers
    requests: int
    last_seen: float

    def as_dict(self) -> dict[str, Any]:
        return {"chunk_hash": self.chunk_hash, "chunks": self.chunks, "requests": self.requests,
                "last_seen": self.last_seen}


@dataclass
class ChunkTop:
    directory: str
    files: int
    requests: int
    chunk_refs: int  # chunks over every request
    chunks: list[Hot] = field(default_factory=list)  # most recurring prefixes first
    prompts: list[Hot] = field(default_factory=list)  # whole prompts (a request's last hash), most frequent first
    skipped_lines: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"directory": self.directory, "files": self.files, "requests": self.requests,
                "chunk_refs": self.chunk_refs, "chunks": [hot.as_dict() for hot in self.chunks],
                "prompts": [hot.as_dict() for hot in self.prompts], "skipped_lines": self.skipped_lines}


def top(directory: str | os.PathLike, limit: int) -> ChunkTop:
    """The `limit` most recurring chunk prefixes and prompts recorded in `directory`."""
    root = Path(directory)
    if not root.is_dir():
        raise UsageError(f"no chunk statistics directory at {root}",
                         hint="give LMCache's chunk_statistics_file_output_dir (extra_config) with --dir")
    chunks: dict[str, Hot] = {}
    prompts: dict[str, Hot] = {}
    result = ChunkTop(str(root), 0, 0, 0)
    for path in sorted(root.glob(FILE_GLOB)):
        file = _open_regular(path)
        if file is None:
            continue
        result.files += 1
        for line in _lines(file, path):
            record = _record(line)
            if record is None:
                result.skipped_lines += 1
                continue
            seen, hashes = record
            result.requests += 1
            result.chunk_refs += len(hashes)
            for position, chunk_hash in enumerate(hashes):
                _count(chunks, chunk_hash, position + 1, seen)
            if hashes:
                _count(prompts, hashes[-1], len(hashes), seen)
    if not result.files:
        raise KvctlError(f"{root} holds no {FILE_GLOB} files", hint="LMCache writes them with chunk_statistics_"
                         "strategy: file_hash once statistics are started (kvctl chunk-stats start)")
    result.chunks, result.prompts = _hottest(chunks, limit), _hottest(prompts, limit)
    return result


def _hottest(table: dict[str, Hot], limit: int) -> list[Hot]:
    """Most requests first; among equals the longer prefix, then the one seen last."""
    return sorted(table.values(), key=lambda hot: (-hot.requests, -hot.chunks, -hot.last_seen))[:limit]


def _count(table: dict[str, Hot], chunk_hash: str, chunks: int, seen: float) -> None:
    hot = table.get(chunk_hash)
    if hot is None:
        table[chunk_hash] = Hot(chunk_hash, chunks, 1, seen)
    else:
        hot.requests += 1
        hot.last_seen = max(hot.last_seen, seen)


def _open_regular(path: Path):
    """The file open for reading, or None for what is not a regular file (a FIFO is never opened for
    reading, and one swapped in after the check is found on the open descriptor)."""
    try:
        if not stat.S_ISREG(path.lstat().st_mode):
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        raise _unreadable(path, error) from None
    file = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        file.close()
        return None
    return file


def _lines(file, path: Path):
    """The file's lines one at a time (LMCache lets each file grow to 100 MB), then the file closed."""
    with file:
        try:
            yield from iter(lambda: file.readline(MAX_LINE), b"")
        except OSError as error:
            raise _unreadable(path, error) from None


def _unreadable(path: Path, error: OSError) -> KvctlError:
    return KvctlError(f"cannot read {path}: {error.strerror}",
                      hint="run kvctl as a user that can read LMCache's chunk statistics files")


def _record(line: bytes) -> tuple[float, list[str]] | None:
    try:
        record = json.loads(line)
        seen, hashes = float(record["timestamp"]), record["chunk_hashes"]
    except (ValueError, KeyError, TypeError, RecursionError, OverflowError):  # nested past the stack, 400 digits
        return None
    if not isinstance(hashes, list) or not all(isinstance(h, str) and len(h) <= 40 for h in hashes):
        return None
    return seen, hashes
