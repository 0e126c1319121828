"""An instance registered with LMCache's controller whose internal API kvctl cannot find (an engine
someone else configured): what the controller itself answers for it, and nothing else.

The controller can check it (/health, under kvctl's timeout: the controller's own has none), say
what its index holds of a prompt (/lookup, by the controller's own hashing), pin a prompt's chunks
(/pin: LMCache then holds them until its pin timeout; there is no unpin) and clear a whole location
(/clear). Every answer says that it came from the controller; what needs the engine itself (listing,
statistics, snapshots, kvctl's pins) is refused, naming how to reach it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from kvctl.core.instance.protocol import (
    ControllerPin,
    EvictionPlan,
    NoManagement,
    PinList,
    Selection,
    StoredChunk,
    Unpinned,
    Unsupported,
    execute_plan,
)

if TYPE_CHECKING:
    from kvctl.core.cache.listing import Listing
    from kvctl.core.cache.lookup import LookupResult
    from kvctl.core.lmcache.key_facts import KeyFacts
    from kvctl.core.lmcache.tokens import PromptSource

LOCATIONS = {"cpu": "LocalCPUBackend", "disk": "LocalDiskBackend"}
CLEARABLE = ("cpu",)  # LMCache 0.5.6 clears only LocalCPUBackend whole (disk and remote skip clear())
CONTROLLER_CHUNK = 256  # the controller hashes prompts with builtin and chunk size 256 only
UNREACHED_HINT = ("configure it with kvctl config init --controller, or name its internal API in kvctl.yaml's "
                  "instances")


def tier_of(location: str) -> str:
    return next((tier for tier, name in LOCATIONS.items() if name == location), "redis")


class ControllerOnlyInstance(NoManagement):
    """A registered instance answered for by the controller alone."""

    kind = "controller"
    vllm_url = None
    settle_s = 0.0
    pin_ids = False
    key_format = "chunk"

    def __init__(self, address, model: str | None = None) -> None:
        self.address, self.name, self.model = address, address.name, model
        self.notes: list[str] = []

    def _controller(self):
        from kvctl.clients.controller import ControllerClient
        from kvctl.core.lmcache.controller import DISCOVERY_TIMEOUT_S

        return ControllerClient(self.address.controller, DISCOVERY_TIMEOUT_S)

    def _refuse(self, what: str) -> Unsupported:
        return Unsupported(f"{what} needs the engine's internal API, which kvctl cannot find for {self.name} (only "
                           "its controller answers for it)", hint=UNREACHED_HINT)

    def tokenize(self, prompt: PromptSource, model: str | None = None) -> list[int]:
        from kvctl.core.lmcache.tokens import local_model_dir

        name = model or self.model  # a token-ids file needs none; a prompt, a local tokenizer's
        return prompt.token_ids(local_model_dir(name), None, name)

    def lookup(self, tokens: list[int], model: str | None = None) -> LookupResult:
        """The controller's index answer for this instance: the prefix it holds and where."""
        from kvctl.core.cache.lookup import Diagnostic, LookupResult

        with self._controller() as controller:
            location, end = controller.lookup(tokens).get(self.name, (None, 0))
        tier = tier_of(location) if location else None
        hits = {"cpu": None, "disk": None, "redis": None, "total": end}  # null: not asked of the engine
        if tier:
            hits[tier] = end
        note = Diagnostic("controller_index", f"answered by the controller's index: {self.name}'s internal API is "
                          "unknown; the index hashes with builtin and chunk size 256 only and names one holder "
                          "per chunk", UNREACHED_HINT)
        return LookupResult(model or self.model, "inprocess", CONTROLLER_CHUNK, len(tokens), [], hits,
                            ["controller_index"], {}, [note])

    def plan_eviction(self, selection: Selection) -> EvictionPlan:
        """A whole CPU tier, cleared by the controller; a prompt's or given chunks need the engine."""
        if not selection.whole_tiers:
            raise self._refuse("evicting chunks by prompt or key")
        tiers = selection.chosen(list(LOCATIONS))
        if any(tier not in CLEARABLE for tier in tiers):
            raise Unsupported(f"the controller clears only the CPU tier of {self.name} (LMCache 0.5.6 has no clear "
                              "for disk or remote stores)", hint="pass --tier cpu")

        self.notes.append("the CPU tier is cleared whole by the controller (/clear): its chunks are counted only "
                          "after, and pinned ones stay")
        return EvictionPlan(cleared_whole=tuple(tiers), selection=selection)

    def execute_eviction(self, plan: EvictionPlan) -> EvictionPlan:
        """Each tier cleared whole by the controller, counted from the tokens it says it cleared."""
        def clear(tier: str, _keys: list[str]) -> EvictionPlan:
            with self._controller() as controller:
                cleared = controller.clear(self.name, LOCATIONS[tier])
            return EvictionPlan({tier: cleared // CONTROLLER_CHUNK}, {tier: 0}, dry_run=False)

        return execute_plan(plan, clear)

    def pin(self, tokens: list[int], ttl_s: float | None, tiers: Sequence[str] | None,
            model: str | None = None) -> ControllerPin:
        if ttl_s is not None:
            raise Unsupported("a pin through the controller has no TTL of kvctl's: LMCache holds it until its own "
                              "pin timeout (pin_timeout_sec)", hint="pin without --ttl")
        with self._controller() as controller:
            return ControllerPin(LOCATIONS["cpu"], controller.pin(self.name, LOCATIONS["cpu"], tokens))

    def unpin(self, *, pin_id: str | None = None, tokens: list[int] | None = None, everything: bool = False,
              model: str | None = None) -> Unpinned:
        raise Unsupported("LMCache's controller has no unpin: its pins end after the engine's pin timeout "
                          "(pin_timeout_sec)", hint=UNREACHED_HINT)

    def pins(self, model: str | None = None) -> PinList:
        raise self._refuse("listing pins")

    def pin_scope(self) -> str:
        return f"controller:{self.name}"

    def list(self, tiers: Sequence[str] | None, model: str | None, limit: int) -> Listing:
        raise self._refuse("listing chunks")

    def prefetch(self, tokens: list[int]) -> dict[str, int]:
        raise self._refuse("prefetching")

    def prompt_keys(self, tokens: list[int], model: str | None = None) -> list[str]:
        raise self._refuse("reading chunk keys")

    def key_facts(self, model: str | None = None) -> KeyFacts:
        raise self._refuse("a snapshot")

    def read_chunks(self, keys: Sequence[str]) -> Iterator[StoredChunk]:
        raise self._refuse("reading chunks")

    def write_chunks(self, chunks: Iterable[StoredChunk], tier: str | None = None) -> dict[str, dict[str, int]]:
        raise self._refuse("writing chunks")

    def stages_writes(self, tier: str | None = None) -> bool:
        return False


def controller_health(address, timeout: float) -> str:
    """Its workers' health as the controller asks them (under kvctl's timeout), for `kvctl health`."""
    from kvctl.clients.controller import ControllerClient
    from kvctl.core.errors import UnreachableError

    with ControllerClient(address.controller, timeout) as controller:
        codes = controller.health(address.name)
    failing = sorted(str(worker) for worker, code in codes.items() if code != 0)
    if failing or not codes:
        raise UnreachableError(f"the controller says worker(s) {', '.join(failing) or 'none'} of {address.name} "
                               "do not answer", hint="check the engine's log")
    return (f"{len(codes)} worker(s) answer the controller (heartbeat {address.heartbeat_age_s:g} s ago); its "
            "internal API is unknown, so only the controller was asked")


def controller_stats(address) -> dict[str, Any]:
    """What the controller knows of it for `kvctl stats`: how many chunk hashes its index holds."""
    from kvctl.clients.controller import ControllerClient
    from kvctl.core.lmcache.controller import DISCOVERY_TIMEOUT_S

    with ControllerClient(address.controller, DISCOVERY_TIMEOUT_S) as controller:
        counts = controller.key_counts()
    indexed = sum(count for (instance, _worker), count in counts.items() if instance == address.name)
    return {"instance": address.name, "mode": "inprocess", "controller_index": {"chunks": indexed},
            "heartbeat_age_s": address.heartbeat_age_s, "errors": {},
            "notes": [f"only the controller answers for {address.name} (its internal API is unknown): the chunk "
                      "hashes its index holds, not the engine's own figures"]}
