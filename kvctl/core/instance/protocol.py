"""One model of an instance: whatever a cache command talks to, as one protocol.

`open_instance()` (kvctl.core.instance.opening) turns the selector flags (--instance, --state, --config,
--inventory) into one of the implementations, each of which answers the same operations in its own way:

    InProcessInstance  kvctl's routes on every worker (kvctl.core.instance.inprocess)
    StockEngineInstance an in-process engine without them: LMCache's own routes, its stores read
                       directly, its CPU tier not visible (kvctl.core.instance.stock)
    MPInstance         the lmcache server, its L2 stores and the coordinator (kvctl.core.instance.mp)
    OfflineInstance    a configuration directory with no engine: its disk directory and Redis (or
                       fs / resp L2 stores) read and written directly (kvctl.core.instance.offline)

A command is then: parse -> open_instance -> one operation -> render a typed result. What an
implementation cannot do it refuses with `Unsupported` (one line and a hint, exit 2).

Eviction follows huggingface_hub's scan -> plan -> execute: `plan_eviction(selection)` is the dry
run the user sees and confirms, a frozen EvictionPlan; `execute_eviction(plan)` removes exactly the
planned chunks (each implementation removes a tier its own way; execute_plan goes tier by tier).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from kvctl.core.errors import KvctlError, UsageError

if TYPE_CHECKING:
    from kvctl.core.cache.listing import Listing
    from kvctl.core.cache.lookup import LookupResult
    from kvctl.core.instance.address import Address
    from kvctl.core.lmcache.key_facts import KeyFacts
    from kvctl.core.lmcache.tokens import PromptSource


class Unsupported(UsageError):
    """An operation this kind of instance cannot do (pins with no engine, TTLs on coordinator pins)."""


KINDS = {"inprocess": "an in-process engine", "stock": "an in-process engine", "mp": "an MP server",
         "offline": "a configuration with no engine", "controller": "an engine known only to the controller"}
ENGINE_HINT = "address an in-process engine (its worker 0 internal API) with --instance"
MP_SERVER_HINT = "address an lmcache server (its HTTP URL) with --instance"


def lacks(instance, feature: str, hint: str) -> Unsupported:
    """What an instance of another kind answers when asked for `feature` (a phrase naming whose it is)."""
    return Unsupported(f"{feature}; {KINDS.get(instance.kind, 'this instance')} has none", hint=hint)


class NoManagement:
    """An instance with neither an in-process engine's nor an MP server's management routes."""

    def engine_address(self, feature: str) -> Address:
        raise lacks(self, f"{feature} is an in-process LMCache feature", ENGINE_HINT)

    def mp_server_url(self, feature: str) -> str:
        raise lacks(self, f"{feature} are an MP server feature (lmcache server)", MP_SERVER_HINT)


@dataclass(frozen=True)
class Selection:
    """What an eviction takes: a prompt's chunks (`tokens`), given chunk keys, or (neither) every chunk
    of `model` on the selected tiers. `tiers` None means every tier the instance has."""

    tokens: tuple[int, ...] | None = None
    keys: tuple[str, ...] | None = None
    tiers: tuple[str, ...] | None = None
    force: bool = False
    model: str | None = None

    @property
    def whole_tiers(self) -> bool:
        return self.tokens is None and self.keys is None

    def chosen(self, present: Sequence[str]) -> list[str]:
        """The selected tiers among those present ("all" or none given: every one)."""
        return list(present) if not self.tiers or "all" in self.tiers else [t for t in self.tiers if t in present]

    def missing(self, present: Sequence[str]) -> list[str]:
        return [] if not self.tiers else [t for t in self.tiers if t != "all" and t not in present]


@dataclass(frozen=True)
class EvictionPlan:
    """Per tier: how many chunks go (`removed`), how many stay because a pin holds them
    (`skipped_pinned`) or LMCache itself does (`held_by_lmcache`), and exactly which (`chunks`).
    A plan is data only (`dry_run`): the instance that made it executes it (Instance.execute_eviction)
    and answers the result in the same shape. A tier a server can only clear whole, without naming
    its chunks first (LMCache's /cache/clear), is in `cleared_whole`: counted after the clear, never
    before. `selection` is what the plan was made for (how the instance removes: forced or not)."""

    removed: dict[str, int] = field(default_factory=dict)
    skipped_pinned: dict[str, int] = field(default_factory=dict)
    chunks: tuple[dict[str, str], ...] = ()  # {"tier", "key"}
    held_by_lmcache: dict[str, int] | None = None
    dry_run: bool = True
    errors: dict[str, str] = field(default_factory=dict)  # tier -> why its removal failed (the others went on)
    cleared_whole: tuple[str, ...] = ()
    selection: Selection | None = None

    @property
    def total(self) -> int:
        return sum(self.removed.values())

    @property
    def forced(self) -> bool:
        """Whether pinned chunks were planned too, so executing removes them regardless."""
        return self.selection is not None and self.selection.force

    def merged(self, other: EvictionPlan) -> EvictionPlan:
        """This plan with another part's counts and chunks added (ranks, tiers)."""
        counts = {}
        for name in ("removed", "skipped_pinned", "held_by_lmcache"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine is None and theirs is None:
                counts[name] = None
                continue
            total = dict(mine or {})
            for tier, count in (theirs or {}).items():
                total[tier] = total.get(tier, 0) + count
            counts[name] = total
        return replace(self, **counts, chunks=self.chunks + tuple(other.chunks))

    def untouched(self) -> EvictionPlan:
        """What executing it answers before any tier is removed: nothing removed yet, what stays as planned."""
        return replace(self, removed=dict.fromkeys(self.removed, 0), chunks=(), dry_run=False, errors={})

    def as_dict(self) -> dict[str, Any]:
        answer: dict[str, Any] = {"dry_run": self.dry_run, "removed": self.removed,
                                  "skipped_pinned": self.skipped_pinned}
        if self.held_by_lmcache is not None:
            answer["held_by_lmcache"] = self.held_by_lmcache
        answer["chunks"] = list(self.chunks)
        if self.cleared_whole:
            answer["cleared_whole"] = list(self.cleared_whole)
        if self.errors:
            answer["errors"] = self.errors
        return answer

    @classmethod
    def from_dict(cls, answer: dict[str, Any], selection: Selection | None = None) -> EvictionPlan:
        return cls(dict(answer.get("removed", {})), dict(answer.get("skipped_pinned", {})), tuple(answer["chunks"]),
                   None if "held_by_lmcache" not in answer else dict(answer["held_by_lmcache"]),
                   answer.get("dry_run", True), dict(answer.get("errors", {})),
                   tuple(answer.get("cleared_whole", ())), selection)


TierRemover = Callable[[str, list[str]], EvictionPlan]  # (tier, planned keys) -> what that tier's removal did


def execute_plan(plan: EvictionPlan, remove: TierRemover) -> EvictionPlan:
    """Remove exactly the planned chunks through an instance's `remove`, tier by tier (chunks written
    since the plan are not taken); what got held since is kept and counted. A tier that fails is named
    in `errors` and the others go on, so what was removed is still reported; when every tier fails,
    its error. The answer keeps the plan's class (its extra fields as planned)."""
    by_tier: dict[str, list[str]] = {tier: [] for tier in plan.cleared_whole}
    for chunk in plan.chunks:
        by_tier.setdefault(chunk["tier"], []).append(chunk["key"])
    done, errors, failures = plan.untouched(), {}, []
    for tier, keys in by_tier.items():
        try:
            answer = remove(tier, keys)
        except KvctlError as error:
            errors[tier] = error.message
            failures.append(error)
            continue
        done = replace(done, removed={**done.removed, tier: answer.removed.get(tier, 0)}).merged(
            EvictionPlan({}, answer.skipped_pinned, answer.chunks, answer.held_by_lmcache))
    if failures and len(failures) == len(by_tier):
        raise failures[0]
    return replace(done, errors=errors)


def removed_from(tier: str, gone: Sequence[str]) -> EvictionPlan:
    """One tier's part of an executed plan: the chunks `gone` were removed from `tier`."""
    return EvictionPlan({tier: len(gone)}, {tier: 0}, tuple({"tier": tier, "key": key} for key in gone),
                        dry_run=False)


# A pin set's pins are `set-NAME-DIGEST` (kvctl.core.pins.pinsets): the engine's pin ids are 1-64 of [A-Za-z0-9_-].
PIN_SET_ID = re.compile(r"set-([A-Za-z0-9_-]+)-([0-9a-f]{12})")
SET_NAME_MAX = 64 - len("set--") - 12


@dataclass
class Pin:
    """A kvctl pin on an in-process instance, counted over every rank (`pinned`: chunks per tier);
    `set` is the pin set that holds it (None: a plain pin)."""

    pin_id: str
    chunks: int
    tokens: int
    pinned: dict[str, int]
    ttl_remaining_s: float | None = None
    created: float | None = None
    expires: float | None = None
    ranks: int = 1

    @property
    def set(self) -> str | None:
        match = PIN_SET_ID.fullmatch(self.pin_id)
        return match.group(1) if match else None

    columns = ("pin id", "chunks", "tokens", "pinned", "expires in")
    listed_columns = ("pin id", "set", "chunks", "tokens", "pinned", "expires in")  # in `pins`

    def rows(self) -> list[tuple]:
        expires = "never" if self.ttl_remaining_s is None else f"{self.ttl_remaining_s} s"
        pinned = " ".join(f"{t}:{n}" for t, n in self.pinned.items()) or "nothing cached: nothing pinned"
        return [(self.pin_id, self.chunks, self.tokens, pinned, expires)]

    def listed_rows(self) -> list[tuple]:
        return [(pin_id, self.set or "", *rest) for pin_id, *rest in self.rows()]

    def as_dict(self) -> dict[str, Any]:
        """`set` only for a pin set's pin: a plain pin's answer keeps the shape it always had."""
        held = {"set": self.set} if self.set is not None else {}
        return {"pin_id": self.pin_id, **held, "chunks": self.chunks, "tokens": self.tokens,
                "created": self.created, "expires": self.expires, "ttl_remaining_s": self.ttl_remaining_s,
                "pinned": self.pinned, "ranks": self.ranks}


@dataclass
class CoordinatorPin:
    """A pin or unpin through the LMCache coordinator (MP): it counts pins per key and has no ids."""

    model: str
    requested: int  # chunks of the prompt
    affected: int  # keys pinned (every rank and object group)
    status: str
    columns = ("model", "chunks", "keys", "status")

    def rows(self) -> list[tuple]:
        return [(self.model, self.requested, self.affected, self.status)]

    unpinned_columns, unpinned_rows = columns, rows  # an unpin through the coordinator answers the same

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "requested": self.requested, "affected": self.affected, "status": self.status}


@dataclass
class ControllerPin:
    """A pin the controller made: LMCache holds the chunks until its pin timeout (it has no unpin)."""

    location: str
    pinned_tokens: int
    columns = ("answered by", "location", "pinned tokens", "expires")

    def rows(self) -> list[tuple]:
        return [("controller", self.location, self.pinned_tokens, "at LMCache's pin timeout")]

    def as_dict(self) -> dict[str, Any]:
        return {"answered_by": "controller", "location": self.location, "pinned_tokens": self.pinned_tokens}


@dataclass
class PinnedKey:
    """A key the coordinator holds pinned, with how many pins hold it."""

    key: str
    pin_count: int
    listed_columns = ("key", "pins")

    def listed_rows(self) -> list[tuple]:
        return [(self.key, self.pin_count)]

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "pin_count": self.pin_count}


@dataclass
class PinList:
    pins: list[Pin] | list[PinnedKey]

    @property
    def columns(self) -> tuple:
        return self.pins[0].listed_columns if self.pins else Pin.listed_columns

    def rows(self) -> list[tuple]:
        return [row for pin in self.pins for row in pin.listed_rows()]

    def as_dict(self) -> dict[str, Any]:
        return {"pins": [pin.as_dict() for pin in self.pins]}


@dataclass
class Unpinned:
    unpinned: list[Pin]
    unpinned_columns = ("pin id", "chunks", "tokens")

    def unpinned_rows(self) -> list[tuple]:
        return [(pin.pin_id, pin.chunks, pin.tokens) for pin in self.unpinned]

    def as_dict(self) -> dict[str, Any]:
        return {"unpinned": [pin.as_dict() for pin in self.unpinned]}


@dataclass(frozen=True)
class StoredChunk:
    """One chunk as a tier keeps it (snapshots): LMCache's data bytes under its key, and LMCache's
    RemoteMetadata header (shape, dtype, format) where the tier keeps one (Redis does, a disk file not)."""

    key: str
    data: bytes | memoryview
    metadata: bytes | None = None


class ChunkStore(Protocol):
    """One tier's store read and written directly (a disk directory, Redis, an MP L2 store): only
    canonical chunk keys count, so stray files and foreign Redis keys are never listed or removed."""

    tier: str

    def chunk_keys(self, model: str | None) -> list[str]:
        """Every chunk key of `model` (None: of every model) the store holds."""

    def held(self, keys: Sequence[str]) -> list[str]:
        """Those of `keys` the store holds."""

    def remove(self, keys: Sequence[str]) -> list[str]:
        """Remove these chunks (every name each occupies); the keys actually removed."""


def plan_store_eviction(stores: Sequence[ChunkStore], selection: Selection, model: str | None,
                        wanted: Sequence[str] | None = None,
                        pinned: frozenset[str] | set[str] = frozenset()) -> EvictionPlan:
    """Plan an eviction over stores read directly. `wanted`: the selected chunk keys (a prompt's or
    given ones; None: every chunk of `model`). Pinned keys stay unless `selection.force`."""
    removed, skipped, chunks = {}, {}, []
    by_tier = {store.tier: store for store in stores}
    for tier in selection.chosen(list(by_tier)):
        store = by_tier[tier]
        held = store.chunk_keys(model) if wanted is None else store.held(list(dict.fromkeys(wanted)))
        going = [key for key in held if selection.force or key not in pinned]
        removed[tier], skipped[tier] = len(going), len(held) - len(going)
        chunks.extend({"tier": tier, "key": key} for key in going)
    return EvictionPlan(removed, skipped, tuple(chunks), selection=selection)


def store_remover(stores: Sequence[ChunkStore],
                  remove: Callable[[ChunkStore, list[str]], list[str]] | None = None) -> TierRemover:
    """Removal from stores read directly, through `remove(store, keys)` (default: the store's own), each
    tier counted from what really went."""
    by_tier = {store.tier: store for store in stores}

    def remove_keys(tier: str, keys: list[str]) -> EvictionPlan:
        if tier not in by_tier:
            raise UsageError(f"this instance has no {tier} tier (it has {', '.join(by_tier) or 'none'})")
        store = by_tier[tier]
        return removed_from(tier, store.remove(keys) if remove is None else remove(store, keys))

    return remove_keys


class Instance(Protocol):
    """What every cache command can ask of an instance."""

    name: str
    kind: str  # "inprocess", "mp", "offline": for messages, never for branching in the CLI
    vllm_url: str | None  # the vLLM that serves through this instance, where known
    settle_s: float  # how long a report after a write waits for it to land on every tier
    notes: list[str]  # what the last operation could not look at, and why
    pin_ids: bool  # whether pin() takes a pin_id (and pins() reports it): what pin sets need
    key_format: str  # what chunks are stored under: "chunk" (LMCache's in-process keys) or "mp-object"

    def model_name(self, model: str | None = None) -> str:
        """The model whose keys a prompt makes here: `model`, or the one the instance serves."""

    def tokenize(self, prompt: PromptSource, model: str | None = None) -> list[int]:
        """The prompt's token ids, tokenized as this instance's vLLM would."""

    def lookup(self, tokens: list[int], model: str | None = None) -> LookupResult:
        """Which chunks of the tokens each tier holds, and the hit tokens."""

    def list(self, tiers: Sequence[str] | None, model: str | None, limit: int) -> Listing:
        """The chunks per tier."""

    def plan_eviction(self, selection: Selection) -> EvictionPlan:
        """The dry run: what an eviction of `selection` removes here, chunk by chunk."""

    def execute_eviction(self, plan: EvictionPlan) -> EvictionPlan:
        """Remove exactly what `plan` (this instance's own) names, through execute_plan: the executed result."""

    def pin(self, tokens: list[int], ttl_s: float | None, tiers: Sequence[str] | None,
            model: str | None = None) -> Pin | CoordinatorPin | ControllerPin: ...

    def unpin(self, *, pin_id: str | None = None, tokens: list[int] | None = None, everything: bool = False,
              model: str | None = None) -> Unpinned | CoordinatorPin: ...

    def pins(self, model: str | None = None) -> PinList: ...

    def pin_scope(self) -> str:
        """Only where pins have no ids (not pin_ids): where they live, which a pin set's ledger is kept for."""

    def prefetch(self, tokens: list[int]) -> dict[str, int]:
        """Copy a prompt's chunks from the lower tiers into the CPU tier: {"loaded", "already_in_cpu", "missing"}."""

    def prompt_keys(self, tokens: list[int], model: str | None = None) -> list[str]:
        """The keys a prompt's chunks are stored under here, chunk by chunk: every rank's (and, MP,
        every object group's), as a snapshot must hold them."""

    def key_facts(self, model: str | None = None) -> KeyFacts:
        """What makes this instance's chunk keys (chunk size, hashing, seed, model,
        KV dtype, world size) and its LMCache version, None where not known."""

    def read_chunks(self, keys: Sequence[str]) -> Iterator[StoredChunk]:
        """Those of `keys` some tier holds, each from the first tier in lookup order that holds it."""

    def write_chunks(self, chunks: Iterable[StoredChunk], tier: str | None = None) -> dict[str, dict[str, int]]:
        """Store the chunks on `tier` (None: the instance's first); {"written": {tier: n}, "already":
        {tier: n}} (chunks the tier held before, left as they were)."""

    def stages_writes(self, tier: str | None = None) -> bool:
        """Whether write_chunks on `tier` makes no chunk visible before its chunks ran out without an
        error: a snapshot load then checks checksums while it writes, else all of them first."""

    def engine_address(self, feature: str) -> Address:
        """The address of an in-process engine, whose LMCache routes (freeze, backends, /conf, chunk
        statistics) serve `feature`; Unsupported naming the feature elsewhere."""

    def mp_server_url(self, feature: str) -> str:
        """The MP server's HTTP URL, whose LMCache routes (quotas, reconfiguration, checksums) serve
        `feature`; Unsupported naming the feature elsewhere."""


class ChunkKeyed:
    """An instance whose chunks are stored under LMCache's in-process chunk keys (an engine, or a
    configuration's disk directory and Redis): a prompt's keys are its lookup's, rank 0's as lookups
    name them, with every other rank's beside each."""

    key_format = "chunk"

    def prompt_keys(self, tokens: list[int], model: str | None = None) -> list[str]:
        from kvctl.core.lmcache.keys import key_of_rank, parse_key

        keys = []
        for chunk in self.lookup(tokens, model).chunks:
            parsed = parse_key(chunk.key)
            keys.extend(key_of_rank(chunk.key, rank) for rank in range(parsed.world_size if parsed else 1))
        return keys
