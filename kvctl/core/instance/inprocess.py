"""Cache operations on a running in-process instance, on every tensor-parallel worker.

Each worker's LMCache engine holds its own rank's chunks (the worker id is part of every key) and
its own kvctl pins, so pin, unpin and evict go to every worker: worker r's kvctl routes answer on
worker 0's port + r. A chunk counts once per rank it was taken from, as its keys differ.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

from kvctl.core.instance.protocol import ChunkKeyed, NoManagement
from kvctl.core.lmcache.keys import given_chunk_keys, parse_key

if TYPE_CHECKING:
    from kvctl.core.cache.listing import Listing
    from kvctl.core.cache.lookup import LookupResult
    from kvctl.core.instance.address import Address
    from kvctl.core.instance.protocol import EvictionPlan, Pin, PinList, Selection, StoredChunk, Unpinned
    from kvctl.core.lmcache.key_facts import KeyFacts
    from kvctl.core.lmcache.tokens import PromptSource

ROUTE_BATCH = 10_000  # keys per evict request: well inside the routes' body cap
READ_BATCH = 64  # keys per chunks/read request (an answer that would pass the routes' byte cap stops early)
WRITE_BATCH_BYTES = 64 * 1024 * 1024  # chunk bytes per chunks/write request (a larger chunk goes alone)


class Workers:
    """One engine's workers, each client opened once for all the operations of a command, with worker 0's
    /kvctl/v1/info asked once (open_instance already has it)."""

    def __init__(self, worker0: str, info: dict[str, Any] | None = None, first=None) -> None:
        self.worker0 = worker0
        self._info = info
        if first is not None:
            self.first = first  # worker 0's client, as open_instance opened it

    @cached_property
    def first(self):
        from kvctl.clients.internal_api import InternalAPIClient

        return InternalAPIClient(self.worker0)

    @property
    def info(self) -> dict[str, Any]:
        """Worker 0's description of the engine (model, chunk size, tiers, world size)."""
        if self._info is None:
            self._info = self.first.info()
        return self._info

    @cached_property
    def clients(self) -> list:
        """A client per worker, in rank order (worker r answers on worker 0's port + r)."""
        from kvctl.clients.internal_api import InternalAPIClient
        from kvctl.core.instance.addresses import worker_url

        return [self.first] + [InternalAPIClient(worker_url(self.worker0, rank))
                               for rank in range(1, self.info["world_size"])]


def pin(engine: Workers, tokens: list[int], ttl_s: float | None, tiers: list[str] | None,
        pin_id: str | None = None, replace: bool = False) -> dict[str, Any]:
    """One pin, under one id (`pin_id`, default a random one), on every worker; `pinned` counts the
    chunks pinned on every rank. `replace`: a pin of that id gives way only once the new one holds."""
    pin_id = pin_id or uuid.uuid4().hex[:12]
    answers = []
    try:
        for worker in engine.clients:
            answers.append(worker.pin(tokens, ttl_s, tiers, pin_id=pin_id, replace=replace))
    except BaseException:
        for worker in engine.clients[:len(answers)]:  # no half pin left behind
            worker.unpin(pin_id=pin_id)
        raise
    return _merged_pin(answers)


def _merged_pin(answers: list[dict[str, Any]]) -> dict[str, Any]:
    tiers = set().union(*(answer["pinned"] for answer in answers))
    return {**answers[0], "pinned": {tier: min(answer["pinned"].get(tier, 0) for answer in answers) for tier in tiers},
            "ranks": len(answers)}


def unpin(engine: Workers, pin_id: str | None = None, tokens: list[int] | None = None,
          everything: bool = False) -> dict[str, Any]:
    """Release pins on every worker; each pin is reported once."""
    from kvctl.core.errors import RejectedError

    released: dict[str, list[dict[str, Any]]] = {}
    for rank, worker in enumerate(engine.clients):
        try:
            answer = worker.unpin(pin_id=pin_id, tokens=tokens, everything=everything)
        except RejectedError:
            if pin_id is None or rank == 0:
                raise
            continue  # a worker that never held this pin (it was pinned before a restart of that rank)
        for entry in answer["unpinned"]:
            released.setdefault(entry["pin_id"], []).append(entry)
    return {"unpinned": [_merged_pin(entries) for entries in released.values()]}


def pins(engine: Workers) -> list[dict[str, Any]]:
    """kvctl's pins, each once, counting the chunks pinned on every rank."""
    held: dict[str, list[dict[str, Any]]] = {}
    for worker in engine.clients:
        for entry in worker.pins():
            held.setdefault(entry["pin_id"], []).append(entry)
    return [_merged_pin(entries) for entries in held.values()]


def evict(engine: Workers, *, tiers: list[str] | None, everything: bool, dry_run: bool,
          **selection: Any) -> dict[str, Any]:
    """Evict through every worker's routes, except Redis: kvctl removes a prompt's, given or all chunks
    there itself, from what Redis holds (an engine's remote backend may answer for what it never
    wrote), pipelined and counted from what Redis removed, after asking each worker which of its
    rank's chunks its pins hold. A whole Redis tier is enumerated by SCAN, since LMCache cannot list it:
    only chunks of the engine's own model are taken from a Redis that others may share. Given keys
    go to the worker of their rank."""
    from kvctl.core.cache.listing import engine_redis_store, redis_tier_keys, stored_redis_keys, unlink_chunks

    result: dict[str, Any] = {"dry_run": dry_run, "removed": {}, "skipped_pinned": {}, "chunks": []}
    workers, info = engine.clients, engine.info
    present = [entry["tier"] for entry in info["tiers"]]
    chosen = present if not tiers or "all" in tiers else tiers
    direct = ["redis"] if "redis" in chosen and "redis" in present else []
    routed = [tier for tier in chosen if tier not in direct]
    keys = given_chunk_keys(selection.pop("keys")) if "keys" in selection else None
    if routed:
        for rank, worker in enumerate(workers):
            if keys is None:
                _add(result, worker.evict(tiers=routed, everything=everything, dry_run=dry_run, **selection))
            else:
                for batch in _batches(_of_rank(keys, rank)):
                    _add(result, worker.evict(tiers=routed, keys=batch, dry_run=dry_run, **selection))
    if direct:
        store = engine_redis_store(workers[0])
        if "tokens" in selection:  # each rank's keys for the prompt, from its engine
            keys = [chunk["key"] for worker in workers for chunk in worker.lookup(selection["tokens"])["chunks"]]
        candidates = redis_tier_keys(store, info["model"]) if keys is None else stored_redis_keys(store, keys)
        going, kept = candidates, 0
        if not selection.get("force") and candidates:
            going, kept = _unpinned(workers, candidates)
        if not dry_run:
            going = unlink_chunks(store, going)
        _add(result, {"removed": {"redis": len(going)}, "skipped_pinned": {"redis": kept},
                      "chunks": [{"tier": "redis", "key": key} for key in going]})
    return result


def _unpinned(workers: list, keys: list[str]) -> tuple[list[str], int]:
    """(the keys no worker's kvctl pin holds, how many are held), each rank asked about its own."""
    going, kept = [], 0
    for rank, worker in enumerate(workers):
        if not worker.pins():
            going.extend(_of_rank(keys, rank))
            continue
        for batch in _batches(_of_rank(keys, rank)):
            planned = worker.evict(keys=batch, tiers=["redis"], dry_run=True)
            kept += planned["skipped_pinned"]["redis"]
            going.extend(chunk["key"] for chunk in planned["chunks"])
    return going, kept


def _add(result: dict[str, Any], answer: dict[str, Any]) -> None:
    for field in ("removed", "skipped_pinned", "held_by_lmcache"):
        for tier, count in answer.get(field, {}).items():
            result.setdefault(field, {})[tier] = result.get(field, {}).get(tier, 0) + count
    result["chunks"].extend(answer["chunks"])


def _of_rank(keys: list[str], rank: int) -> list[str]:
    return [key for key in keys if parse_key(key).worker_id == rank]


def _batches(keys: list[str], size: int = ROUTE_BATCH) -> Iterator[list[str]]:
    for start in range(0, len(keys), size):
        yield keys[start:start + size]


def read_chunks(engine: Workers, keys: Iterable[str]) -> Iterator:
    """StoredChunks of those of `keys` the engine holds, each asked of the worker of its rank (a key of a
    rank beyond the world size is held by none)."""
    keys = given_chunk_keys(list(keys))
    for rank, worker in enumerate(engine.clients):
        yield from client_chunks(worker, _of_rank(keys, rank))


def client_chunks(client, keys: list[str]) -> Iterator:
    """StoredChunks of those of `keys` a server's chunks/read route answers (a worker's, the MP
    server's), READ_BATCH keys a request; an answer that stopped at the routes' byte cap is asked again
    for the rest."""
    from kvctl.core.instance.protocol import StoredChunk

    for batch in _batches(keys, READ_BATCH):
        while batch:
            body, batch = client.read_chunks(batch)
            for key, data, metadata in _frames(body, client.url):
                yield StoredChunk(key, data, metadata)


def _frames(body: bytes, url: str) -> list:
    from kvctl_plugins.wire import read_frames

    from kvctl.core.errors import ServerError

    try:
        return list(read_frames(body))
    except ValueError as error:
        raise ServerError(f"{url} answered chunk bytes that are not frames: {error}",
                          hint="check that kvctl and the engine's kvctl plugins are the same version") from None


def write_chunks(engine: Workers, chunks: Iterable, tier: str | None) -> dict[str, dict[str, int]]:
    """Store StoredChunks on `tier` (None: the engine's first, the CPU tier), each through the worker of
    its key's rank, at most WRITE_BATCH_BYTES of chunk bytes a request; the routes' counts summed over
    requests: {"written", "already", "dropped"}, each {tier: chunks}. A request the engine refuses
    raises, and writes nothing of its own; the requests before it stay written."""
    workers = engine.clients
    return batched_writes(chunks, lambda rank, body: workers[rank].write_chunks(body, [tier] if tier else None),
                          lambda chunk: _rank_of(chunk.key, len(workers)))


def batched_writes(chunks: Iterable, write: Callable[[Any, bytes], dict[str, Any]],
                   destination: Callable[[Any], Any] = lambda _chunk: None) -> dict[str, dict[str, int]]:
    """Send StoredChunks to write(destination, body of frames), at most WRITE_BATCH_BYTES of chunk bytes
    a body per destination (a larger chunk goes alone); the answers' counts summed: {"written",
    "already", "dropped"}, each {tier: chunks}. A failed request's error also says what the requests
    before it wrote, which stays written."""
    from kvctl_plugins.wire import frame_header

    from kvctl.core.errors import KvctlError

    totals: dict[str, dict[str, int]] = {"written": {}, "already": {}, "dropped": {}}
    pending: dict[Any, tuple[list, int]] = {}  # destination -> (frame parts, chunk bytes)

    def send(to) -> None:
        parts, _size = pending.pop(to)
        try:
            answer = write(to, b"".join(parts))
        except KvctlError as error:
            if any(totals["written"].values()):
                written = ", ".join(f"{count} chunks to {tier}" for tier, count in totals["written"].items())
                error.message += f"; the requests before it wrote {written}, which stay written"
                error.args = (error.message,)
            raise
        for field, counts in totals.items():
            for name, count in answer.get(field, {}).items():
                counts[name] = counts.get(name, 0) + count

    for chunk in chunks:
        to = destination(chunk)
        if to in pending and pending[to][1] + len(chunk.data) > WRITE_BATCH_BYTES:
            send(to)
        parts, size = pending.get(to, ([], 0))
        parts += [frame_header(chunk.key, len(chunk.data), chunk.metadata), chunk.data]
        pending[to] = (parts, size + len(chunk.data))
    for to in list(pending):
        send(to)
    return totals


def _rank_of(key: str, world_size: int) -> int:
    from kvctl.core.errors import UsageError

    parsed = parse_key(key)
    if parsed is None:
        raise UsageError(f"not an LMCache chunk key: {key!r}")
    if parsed.worker_id >= world_size:
        raise UsageError(f"{key!r} is a chunk of worker {parsed.worker_id}; this instance has {world_size} worker(s)",
                         hint="load a snapshot into an instance of the same tensor-parallel size")
    return parsed.worker_id


class InProcessInstance(ChunkKeyed, NoManagement):
    """A running in-process engine: kvctl's routes on every worker answer for the CPU and disk tiers
    and for pins; Redis is read and written directly (see `evict`)."""

    kind = "inprocess"
    pin_ids = True  # kvctl's pins carry ids: a pin set finds its own

    def __init__(self, address, info: dict[str, Any] | None = None, worker0_client=None) -> None:
        self.address = address
        self.name = address.name
        self.worker0 = address.worker
        self.notes: list[str] = []
        self.workers = Workers(address.worker, info, worker0_client)  # as open_instance asked and opened them

    @property
    def info(self) -> dict[str, Any]:
        """Worker 0's description of the engine (model, chunk size, tiers, world size), asked once."""
        return self.workers.info

    @property
    def vllm_url(self) -> str | None:
        return self.address.vllm

    def model_name(self, model: str | None = None) -> str:
        return model or self.info["model"]

    def tokenize(self, prompt: PromptSource, model: str | None = None) -> list[int]:
        from kvctl.core.lmcache.tokens import local_model_dir

        return prompt.token_ids(model or local_model_dir(self.info["model"]), self.address.vllm, self.info["model"])

    settle_s = 0.0  # the engine's own answer is current

    def lookup(self, tokens: list[int], model: str | None = None) -> LookupResult:
        """Every worker's answer (the engine's own keys: `model` is its model)."""
        from kvctl.core.cache.lookup import engine_lookup

        return engine_lookup(self.workers.clients, self.info, tokens)

    def list(self, tiers: Sequence[str] | None, model: str | None, limit: int) -> Listing:
        from kvctl.core.cache.listing import collect, engine_listers

        return collect(engine_listers(self.workers.first, self.info, tiers, limit, model))

    def plan_eviction(self, selection: Selection) -> EvictionPlan:
        from kvctl.core.instance.protocol import EvictionPlan

        chosen: dict[str, Any] = {"tiers": list(selection.tiers) if selection.tiers else None,
                                  "force": selection.force, "everything": selection.whole_tiers}
        if selection.tokens is not None:
            chosen["tokens"] = list(selection.tokens)
        elif selection.keys is not None:
            chosen["keys"] = list(selection.keys)

        return EvictionPlan.from_dict(evict(self.workers, dry_run=True, **chosen), selection)

    def execute_eviction(self, plan: EvictionPlan) -> EvictionPlan:
        """Each tier's planned keys, by key through every worker's routes (Redis directly)."""
        from kvctl.core.instance.protocol import EvictionPlan, execute_plan

        return execute_plan(plan, lambda tier, keys: EvictionPlan.from_dict(
            evict(self.workers, dry_run=False, tiers=[tier], everything=False, keys=keys, force=plan.forced)))

    def pin(self, tokens: list[int], ttl_s: float | None, tiers: Sequence[str] | None, model: str | None = None,
            pin_id: str | None = None, replace: bool = False) -> Pin:
        return _typed_pin(pin(self.workers, tokens, ttl_s, list(tiers) if tiers else None, pin_id, replace))

    def unpin(self, *, pin_id: str | None = None, tokens: list[int] | None = None, everything: bool = False,
              model: str | None = None) -> Unpinned:
        from kvctl.core.instance.protocol import Unpinned

        released = unpin(self.workers, pin_id=pin_id, tokens=tokens, everything=everything)
        return Unpinned([_typed_pin(entry) for entry in released["unpinned"]])

    def pins(self, model: str | None = None) -> PinList:
        from kvctl.core.instance.protocol import PinList

        return PinList([_typed_pin(entry) for entry in pins(self.workers)])

    def prefetch(self, tokens: list[int]) -> dict[str, int]:
        return self.workers.first.prefetch(tokens)

    def key_facts(self, model: str | None = None) -> KeyFacts:
        """What makes the engine's keys, as doctor reads them from worker 0 (its own model: `model` is it)."""
        from kvctl.core.instance.running import read_running

        return read_running(self.address).facts

    def read_chunks(self, keys: Sequence[str]) -> Iterator[StoredChunk]:
        return read_chunks(self.workers, keys)

    def write_chunks(self, chunks: Iterable[StoredChunk], tier: str | None = None) -> dict[str, dict[str, int]]:
        """{"written", "already", "dropped"}, each {tier: chunks}: "dropped" what a tier did not take
        (no room on a full disk tier, a failed remote put)."""
        return write_chunks(self.workers, chunks, tier)

    def stages_writes(self, tier: str | None = None) -> bool:
        return False  # each request's chunks are stored as it is answered

    def engine_address(self, feature: str) -> Address:
        return self.address


def _typed_pin(entry: dict[str, Any]) -> Pin:
    from kvctl.core.instance.protocol import Pin

    return Pin(entry["pin_id"], entry["chunks"], entry["tokens"], entry["pinned"], entry.get("ttl_remaining_s"),
               entry.get("created"), entry.get("expires"), entry.get("ranks", 1))
