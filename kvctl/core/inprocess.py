"""Cache operations on a running in-process instance, on every tensor-parallel worker.

Each worker's LMCache engine holds its own rank's chunks (the worker id is part of every key) and
its own kvctl pins, so pin, unpin and evict go to every worker: worker r's kvctl routes answer on
worker 0's port + r. A chunk counts once per rank it was taken from, as its keys differ.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from kvctl.core.keys import parse_key

ROUTE_BATCH = 10_000  # keys per evict request: well inside the routes' body cap


@contextmanager
def open_workers(worker0: str) -> Iterator[tuple[list, dict[str, Any]]]:
    """(a client per worker, rank order; worker 0's info)."""
    from kvctl.clients.internal_api import InternalAPIClient
    from kvctl.core.instances import worker_url

    with ExitStack() as stack:
        first = stack.enter_context(InternalAPIClient(worker0))
        info = first.info()
        workers = [first] + [stack.enter_context(InternalAPIClient(worker_url(worker0, rank)))
                             for rank in range(1, info["world_size"])]
        yield workers, info


def pin(worker0: str, tokens: list[int], ttl_s: float | None, tiers: list[str] | None) -> dict[str, Any]:
    """One pin, under one id, on every worker; `pinned` counts the chunks pinned on every rank."""
    pin_id = uuid.uuid4().hex[:12]
    with open_workers(worker0) as (workers, _info):
        answers = []
        try:
            for worker in workers:
                answers.append(worker.pin(tokens, ttl_s, tiers, pin_id=pin_id))
        except BaseException:
            for worker in workers[:len(answers)]:  # no half pin left behind
                worker.unpin(pin_id=pin_id)
            raise
    return _merged_pin(answers)


def _merged_pin(answers: list[dict[str, Any]]) -> dict[str, Any]:
    tiers = set().union(*(answer["pinned"] for answer in answers))
    return {**answers[0], "pinned": {tier: min(answer["pinned"].get(tier, 0) for answer in answers) for tier in tiers},
            "ranks": len(answers)}


def unpin(worker0: str, pin_id: str | None = None, tokens: list[int] | None = None,
          everything: bool = False) -> dict[str, Any]:
    """Release pins on every worker; each pin is reported once."""
    from kvctl.core.errors import RejectedError

    released: dict[str, list[dict[str, Any]]] = {}
    with open_workers(worker0) as (workers, _info):
        for rank, worker in enumerate(workers):
            try:
                answer = worker.unpin(pin_id=pin_id, tokens=tokens, everything=everything)
            except RejectedError:
                if pin_id is None or rank == 0:
                    raise
                continue  # a worker that never held this pin (it was pinned before a restart of that rank)
            for entry in answer["unpinned"]:
                released.setdefault(entry["pin_id"], []).append(entry)
    return {"unpinned": [_merged_pin(entries) for entries in released.values()]}


def pins(worker0: str) -> list[dict[str, Any]]:
    """kvctl's pins, each once, counting the chunks pinned on every rank."""
    held: dict[str, list[dict[str, Any]]] = {}
    with open_workers(worker0) as (workers, _info):
        for worker in workers:
            for entry in worker.pins():
                held.setdefault(entry["pin_id"], []).append(entry)
    return [_merged_pin(entries) for entries in held.values()]


def evict(worker0: str, *, tiers: list[str] | None, everything: bool, dry_run: bool,
          **selection: Any) -> dict[str, Any]:
    """Evict through every worker's routes, except Redis: kvctl removes a prompt's, given or all chunks
    there itself, from what Redis holds (an engine's remote backend may answer for what it never
    wrote), pipelined and counted from what Redis removed, after asking each worker which of its
    rank's chunks its pins hold. A whole Redis tier is enumerated by SCAN, since LMCache cannot list it:
    only chunks of the engine's own model are taken from a Redis that others may share. Given keys
    go to the worker of their rank."""
    from kvctl.core.listing import engine_redis_store, redis_tier_keys, stored_redis_keys, unlink_chunks

    result: dict[str, Any] = {"dry_run": dry_run, "removed": {}, "skipped_pinned": {}, "chunks": []}
    with open_workers(worker0) as (workers, info):
        present = [entry["tier"] for entry in info["tiers"]]
        chosen = present if not tiers or "all" in tiers else tiers
        direct = ["redis"] if "redis" in chosen and "redis" in present else []
        routed = [tier for tier in chosen if tier not in direct]
        keys = _chunk_keys(selection.pop("keys")) if "keys" in selection else None
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


def _batches(keys: list[str]) -> Iterator[list[str]]:
    for start in range(0, len(keys), ROUTE_BATCH):
        yield keys[start:start + ROUTE_BATCH]


def _chunk_keys(keys: list[str]) -> list[str]:
    from kvctl.core.errors import UsageError

    bad = [key for key in keys if parse_key(key) is None]
    if bad:
        raise UsageError(f"not an LMCache chunk key: {bad[0]!r}",
                         hint="keys read model@world_size@worker@hash@dtype; kvctl ls and kvctl keys print them")
    return list(dict.fromkeys(keys))
