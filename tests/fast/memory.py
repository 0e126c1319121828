"""In-memory implementations of kvctl's own protocols, for the fast tests.

MemoryStore is a tier read directly (kvctl.core.instance.ChunkStore), MemorySource a store that answers
presence questions (kvctl.core.lookup.Source). Both hold stored names in a set; `stored_names` writes the
names LMCache gives chunk keys on each layout, spelled out here rather than taken from the code under test.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvctl.core.keys import ObjectKey, parse_key
from kvctl.core.target import DISK_SUFFIXES


class MemoryStore:
    """A tier's chunks in memory. As the real stores, only canonical chunk keys count: other names
    (stray files, foreign Redis keys) are never listed, held or removed."""

    def __init__(self, tier: str, keys: Iterable[str] = ()) -> None:
        self.tier = tier
        self.names = set(keys)

    def chunk_keys(self, model: str | None) -> list[str]:
        chunks = []
        for name in sorted(self.names):
            parsed = parse_key(name)
            if parsed is not None and (model is None or parsed.model_name == model):
                chunks.append(name)
        return chunks

    def held(self, keys: Sequence[str]) -> list[str]:
        return [key for key in keys if key in self.names and parse_key(key) is not None]

    def remove(self, keys: Sequence[str]) -> list[str]:
        gone = list(dict.fromkeys(self.held(keys)))
        self.names.difference_update(gone)
        return gone


class MemorySource:
    """A lookup source over stored names; like the disk tier, its listing drops the file suffix."""

    def __init__(self, layout: str, names: Iterable[str] = ()) -> None:
        self.suffix = DISK_SUFFIXES.get(layout, "")
        self.names = set(names)

    def exists(self, names: Sequence[str]) -> list[bool]:
        return [name in self.names for name in names]

    def stored_names(self, limit: int) -> list[str]:
        return [name.removesuffix(self.suffix) for name in sorted(self.names)][:limit]


def stored_names(layout: str, keys: Iterable[str | ObjectKey]) -> list[str]:
    """The names LMCache writes for these chunk keys: disk files (with '/' in the model replaced), Redis
    metadata keys, the MP server's fs files and resp keys."""
    if layout == "lmcache-disk":
        return [key.replace("/", "-") + ".pt" for key in keys]
    if layout == "lmcache-redis":
        return [key + "metadata" for key in keys]
    if layout == "mp-fs":
        return [key.fs_file_name() for key in keys]
    return [key.native_key() for key in keys]
