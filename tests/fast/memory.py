"""In-memory implementations of kvctl's own protocols, for the fast tests.

MemoryStore is a tier read directly (kvctl.core.instance.protocol.ChunkStore), MemorySource a store that answers
presence questions (kvctl.core.cache.lookup.Source). Both hold stored names in a set; `stored_names` writes the
names LMCache gives chunk keys on each layout, spelled out here rather than taken from the code under test.

MemoryInstance is a whole instance (kvctl.core.instance.protocol.Instance) over MemoryStores, for running the CLI in
process; CoordinatorMemoryInstance pins as the MP coordinator does; FailingInstance and HangingInstance are
fleet members that fail or never answer.
"""

from __future__ import annotations

import struct
import threading
import time
import zlib
from collections.abc import Iterable, Iterator, Sequence

from kvctl.core.cache.listing import Chunk, Listing, TierListing, collect, selected
from kvctl.core.cache.lookup import Chunk as LookupChunk
from kvctl.core.cache.lookup import LookupResult
from kvctl.core.errors import KvctlError, RejectedError, UnreachableError
from kvctl.core.instance.protocol import (
    ChunkKeyed,
    CoordinatorPin,
    EvictionPlan,
    Pin,
    PinList,
    PinnedKey,
    Selection,
    StoredChunk,
    Unpinned,
    Unsupported,
    execute_plan,
    plan_store_eviction,
    store_remover,
)
from kvctl.core.lmcache.deployment import DISK_SUFFIXES
from kvctl.core.lmcache.key_facts import KeyFacts
from kvctl.core.lmcache.keys import KeyRecipe, ObjectKey, key_string, parse_key
from kvctl.core.lmcache.tokens import PromptSource


class MemoryStore:
    """A tier's chunks in memory. As the real stores, only canonical chunk keys count: other names
    (stray files, foreign Redis keys) are never listed, held or removed."""

    removal_error: KvctlError | None = None  # set: every removal fails with it (a store that went away)

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
        if self.removal_error is not None:
            raise self.removal_error
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


# -- an instance -------------------------------------------------------------------------------

CHUNK_TOKENS = 4  # the fake's chunk size
CHUNK_BYTES = 1024  # what every chunk weighs in a listing


def memory_keys(tokens: Sequence[int], model: str) -> list[str]:
    """The fake's key rule: one canonical chunk key per complete chunk of CHUNK_TOKENS tokens, whose hash is
    the CRC-32 of every token up to the chunk's end (so, as in LMCache, a chunk's key depends on its prefix)."""
    recipe = KeyRecipe(model, chunk_size=CHUNK_TOKENS, kv_dtype="half")
    return [key_string(recipe, zlib.crc32(repr(tuple(tokens[:end])).encode()))
            for end in range(CHUNK_TOKENS, len(tokens) + 1, CHUNK_TOKENS)]


class MemoryInstance(ChunkKeyed):
    """kvctl.core.instance.protocol.Instance over MemoryStores: lists, evicts (plan_store_eviction, pinned keys kept
    unless forced) and pins (kvctl's typed pins, which hold a prompt's keys) in memory. `failing` names tiers
    whose listing fails with the given error, `notes` go into every listing; prompts come only as token-ids
    files."""

    kind = "memory"
    pin_ids = False
    settle_s = 0.0
    vllm_url = None

    def __init__(self, name: str, stores: Sequence[MemoryStore], model: str = "llama",
                 failing: dict[str, KvctlError] | None = None) -> None:
        self.name, self.stores, self.model = name, list(stores), model
        self.failing = failing or {}
        self.notes: list[str] = []
        self.held: dict[str, tuple[Pin, list[str]]] = {}  # pin id -> (the pin, the keys it holds)
        self.data: dict[str, bytes] = {}  # chunk bytes written to it (snapshots)
        self.hash_seed = "0"

    @property
    def pinned_keys(self) -> set[str]:
        return {key for _pin, keys in self.held.values() for key in keys}

    def model_name(self, model: str | None = None) -> str:
        return model or self.model

    def tokenize(self, prompt: PromptSource, model: str | None = None) -> list[int]:
        return prompt.token_ids(None)

    def list(self, tiers: Sequence[str] | None, model: str | None, limit: int) -> Listing:
        def lister(store: MemoryStore):
            def listed() -> TierListing:
                if store.tier in self.failing:
                    raise self.failing[store.tier]
                keys = store.chunk_keys(model)
                return TierListing(store.tier, "memory", len(keys), [
                    Chunk(key, CHUNK_BYTES, False, key in self.pinned_keys) for key in keys[:limit]])
            return listed

        listing = collect({store.tier: lister(store) for store in self.stores
                           if selected(store.tier, list(tiers) if tiers else None)})
        listing.notes = list(self.notes)
        return listing

    def plan_eviction(self, selection: Selection) -> EvictionPlan:
        wanted = (memory_keys(selection.tokens, self.model_name(selection.model)) if selection.tokens is not None
                  else None if selection.keys is None else list(selection.keys))
        model = self.model_name(selection.model) if wanted is None else None
        return plan_store_eviction(self.stores, selection, model, wanted, self.pinned_keys)

    def execute_eviction(self, plan: EvictionPlan) -> EvictionPlan:
        return execute_plan(plan, store_remover(self.stores))

    def pin(self, tokens: list[int], ttl_s: float | None, tiers: Sequence[str] | None,
            model: str | None = None) -> Pin:
        keys = memory_keys(tokens, self.model_name(model))
        now = time.time()
        pin = Pin(f"pin{len(self.held) + 1}", len(keys), len(tokens),
                  {store.tier: len(store.held(keys)) for store in self.stores
                   if selected(store.tier, list(tiers) if tiers else None)},
                  ttl_s, now, None if ttl_s is None else now + ttl_s)
        self.held[pin.pin_id] = (pin, keys)
        return pin

    def unpin(self, *, pin_id: str | None = None, tokens: list[int] | None = None, everything: bool = False,
              model: str | None = None) -> Unpinned:
        if pin_id is not None and pin_id not in self.held:
            raise RejectedError(f"no pin {pin_id!r}", hint="kvctl pins lists the pin ids")
        prompt = set(memory_keys(tokens, self.model_name(model))) if tokens is not None else set()
        going = [held for held, (_pin, keys) in self.held.items()
                 if everything or held == pin_id or prompt.intersection(keys)]
        return Unpinned([self.held.pop(held)[0] for held in going])

    def pins(self, model: str | None = None) -> PinList:
        return PinList([pin for pin, _keys in self.held.values()])

    def prefetch(self, tokens: list[int]) -> dict[str, int]:
        raise Unsupported("a memory instance has no tier to prefetch from", hint="drop --from-tier")

    # -- snapshots: a chunk's bytes are kept in `data` (default: chunk_bytes(key)) -------------------

    def key_facts(self, model: str | None = None) -> KeyFacts:
        return KeyFacts(CHUNK_TOKENS, "crc32", self.hash_seed, self.model_name(model), "half", 1, "memory")

    def lookup(self, tokens: list[int], model: str | None = None) -> LookupResult:
        keys = memory_keys(tokens, self.model_name(model))
        chunks = [LookupChunk(index, index * CHUNK_TOKENS, (index + 1) * CHUNK_TOKENS, key,
                              [store.tier for store in self.stores if store.held([key])])
                  for index, key in enumerate(keys)]
        cached = next((chunk.index for chunk in chunks if not chunk.tiers), len(chunks))
        return LookupResult(self.model_name(model), "memory", CHUNK_TOKENS, len(tokens), chunks,
                            {"total": cached * CHUNK_TOKENS}, [store.tier for store in self.stores])

    def read_chunks(self, keys: Sequence[str]) -> Iterator[StoredChunk]:
        for key in dict.fromkeys(keys):
            if any(store.held([key]) for store in self.stores):
                data = self.data.get(key, chunk_bytes(key))
                yield StoredChunk(key, data, remote_metadata(len(data)))

    def write_chunks(self, chunks: Iterable[StoredChunk], tier: str | None = None) -> dict[str, dict[str, int]]:
        store = next(store for store in self.stores if tier in (None, store.tier))
        written = already = 0
        for chunk in chunks:
            if store.held([chunk.key]):
                already += 1
                continue
            store.names.add(chunk.key)
            self.data[chunk.key] = bytes(chunk.data)
            written += 1
        return {"written": {store.tier: written}, "already": {store.tier: already}}

    def stages_writes(self, tier: str | None = None) -> bool:
        return False  # each chunk is stored as it comes


def remote_metadata(size: int) -> bytes:
    """LMCache's RemoteMetadata header of `size` bytes of float16 (the keys' half) as one flat group."""
    return struct.pack("=7i", size, 1, 2, size // 2, 0, 0, 0)


def chunk_bytes(key: str) -> bytes:
    """What a stored chunk holds unless written otherwise: its key's bytes, repeated to CHUNK_BYTES."""
    return (key.encode() * (CHUNK_BYTES // len(key) + 1))[:CHUNK_BYTES]


class CoordinatorMemoryInstance(MemoryInstance):
    """Pins as the LMCache coordinator keeps them (MP): counted per key, no ids, no TTL, released by prompt."""

    kind = "memory-mp"

    def __init__(self, name: str, stores: Sequence[MemoryStore], model: str = "llama") -> None:
        super().__init__(name, stores, model)
        self.counts: dict[str, int] = {}

    def pin(self, tokens: list[int], ttl_s: float | None, tiers: Sequence[str] | None,
            model: str | None = None) -> CoordinatorPin:
        if ttl_s is not None or tiers:
            raise Unsupported("coordinator pins hold a prompt's chunks until unpinned: no --ttl or --tier",
                              hint="drop --ttl and --tier")
        return self._count(tokens, model, +1, "pinned")

    def unpin(self, *, pin_id: str | None = None, tokens: list[int] | None = None, everything: bool = False,
              model: str | None = None) -> CoordinatorPin:
        if tokens is None:
            raise Unsupported("the coordinator unpins by prompt only (its pins have no ids)",
                              hint="give the prompt you pinned")
        return self._count(tokens, model, -1, "unpinned")

    def pins(self, model: str | None = None) -> PinList:
        return PinList([PinnedKey(key, count) for key, count in sorted(self.counts.items())])

    def pin_scope(self) -> str:
        return f"memory-coordinator-{self.name}"

    def _count(self, tokens: list[int], model: str | None, step: int, status: str) -> CoordinatorPin:
        name = self.model_name(model)
        keys = memory_keys(tokens, name)
        held = [key for key in keys if any(key in store.names for store in self.stores)]
        for key in held:
            self.counts[key] = self.counts.get(key, 0) + step
            if not self.counts[key]:
                del self.counts[key]
        return CoordinatorPin(name, len(keys), len(held), status)


class FailingInstance:
    """A member whose every operation fails with `error` (an instance that refuses, or that is down)."""

    kind = "memory"
    pin_ids = False
    settle_s = 0.0
    vllm_url = None

    def __init__(self, name: str, error: KvctlError) -> None:
        self.name, self.error, self.notes = name, error, []

    def __getattr__(self, operation: str):
        def fail(*_args, **_kwargs):
            raise self.error
        return fail


class HangingInstance(FailingInstance):
    """A member that never answers: every operation waits until `release` is set (the test's end)."""

    def __init__(self, name: str, release: threading.Event) -> None:
        super().__init__(name, UnreachableError("released at the end of the test"))
        self.release = release

    def __getattr__(self, operation: str):
        def hang(*_args, **_kwargs):
            self.release.wait(30)
            raise self.error
        return hang
