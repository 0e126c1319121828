"""`kvctl ls`, `pin`, `unpin`, `pins`, `evict`: cache operations on a running instance. In-process:
through kvctl's /kvctl/v1 routes in the engine. MP: L1 through the server's HTTP API and kvctl's MP
routes, L2 through the server's adapters, pins through the LMCache coordinator (kvctl.core.mp_cache).

MP pins without a known coordinator are refused with exit 2 (usage): kvctl has no pin of its own
there, and pretending to pin would be worse than saying so."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Annotated

import typer

from kvctl.cli.lookup import (
    ChatFile,
    ConfigOption,
    ModelOption,
    PromptFile,
    TokensFile,
    VllmOption,
    load_tokens,
)
from kvctl.cli.observe import report_errors
from kvctl.cli.options import (
    FleetInstance,
    InventoryOption,
    StateOption,
    Tier,
    TimeoutOption,
)
from kvctl.core.errors import ExitCode, KvctlError, UsageError
from kvctl.output import Table

TierOption = Annotated[list[Tier] | None, typer.Option("--tier", help="cpu, disk, redis or all (repeatable).")]
CoordinatorOption = Annotated[str | None, typer.Option("--coordinator", help="MP mode: the LMCache coordinator's URL, "
                                                       "where pins live (default: 'coordinator:' in kvctl.yaml).")]
DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhd]?)$")
UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    match = DURATION.match(text.strip())
    if not match or float(match.group(1)) <= 0:
        raise UsageError(f"bad duration {text!r}", hint="write it as 600, 30s, 10m, 2h or 1d")
    return float(match.group(1)) * UNITS[match.group(2)]


def _open(found, vllm_url: str | None = None):
    """(worker 0's client and info, or None and None for an MP instance; the instance, identified)."""
    from kvctl.clients.internal_api import InternalAPIClient
    from kvctl.core.instances import identify

    found = identify(found)
    found.vllm = vllm_url or found.vllm
    if found.mode != "mp" and found.worker:
        worker = InternalAPIClient(found.worker)
        try:
            return worker, worker.info(), found
        except KvctlError:
            worker.close()
            raise
    if not found.mp_http:
        raise UsageError(f"the HTTP URL of the MP instance {found.name}'s server is unknown",
                         hint="pass --instance with the lmcache server's HTTP URL")
    return None, None, found


def _on_instances(out, instance, state, inventory, timeout, operation, tables) -> None:
    """Run `operation(instance) -> result` on one instance, or on every inventory instance at once
    (--instance all: results per instance, exit 6 naming the failures)."""
    from kvctl.core import instances as fleet

    targets = fleet.resolve(instance, state, inventory)
    if instance != "all":
        result = operation(targets[0])
        out.emit(result, tables(result))
        return
    reports, code = fleet.fleet_reports(fleet.fan_out(targets, operation, timeout), lambda result: result)
    out.emit({"instances": reports}, [t for r in reports if "errors" not in r for t in tables(r, r["instance"])])
    report_errors(out, reports)
    raise typer.Exit(code)


def _tokens(model_name, prompt_file, chat, tokens_file, model, vllm_url):
    model_dir = model or (model_name if model_name and Path(model_name).is_dir() else None)
    return load_tokens(prompt_file, chat, tokens_file, model_dir, vllm_url, model_name)


def _mp_model(found, model: str | None) -> tuple[str, int]:
    """(model, world size) of an MP instance: --model, the one it was served with, or the one registered."""
    from kvctl.clients.mp_server import MPServerClient
    from kvctl.core.mp_cache import registered_model

    with MPServerClient(found.mp_http) as server:
        return registered_model(server, model or found.model)


def _coordinator(url: str | None, found) -> str:
    from kvctl.core.mp_cache import COORDINATOR_HINT, NO_COORDINATOR, coordinator_url

    url = coordinator_url(url, found.config_dir, found.coordinator)
    if not url:
        raise UsageError(NO_COORDINATOR, hint=COORDINATOR_HINT)
    return url


def tier_names(tiers: list[Tier] | None) -> list[str] | None:
    return [tier.value for tier in tiers] if tiers else None


def ls(
    ctx: typer.Context,
    tier: TierOption = None,
    model: Annotated[str | None, typer.Option("--model", help="Only chunks of this model (the value of vLLM's "
                                              "--model).")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, help="At most this many chunks listed per tier (totals "
                                       "count them all).")] = 100,
    config: ConfigOption = None, instance: FleetInstance = None, state: StateOption = None,
    inventory: InventoryOption = None, timeout: TimeoutOption = 30.0,
) -> None:
    """List cached chunks per tier: key, size, pin state, age where known; totals per tier.

    A running in-process instance answers for its CPU and disk tiers (pins included); an MP server
    for its L1 (cpu; "pinned" = locked by a reader), with the L2 stores of its configuration (give
    --config with an MP server's URL); Redis, and the disk directory of a --config with no instance,
    are read directly. With --instance all, every instance of the inventory is listed
    ({"instances": [...]} in JSON).
    """
    from dataclasses import replace

    from kvctl.core import instances as fleet
    from kvctl.core import listing

    selected = tier_names(tier)
    out = ctx.obj
    if config is not None and instance is None:
        render_listing(out, listing.list_stores(listing.config_stores(config), selected, limit, model))
        return
    targets = fleet.resolve(instance, state, inventory)
    if instance != "all":
        target = targets[0] if config is None else replace(targets[0], config_dir=str(config))
        render_listing(out, listing.list_instance(target, selected, limit, model))
        return
    outcomes = fleet.fan_out(targets, lambda target: listing.list_instance(target, selected, limit, model), timeout)
    reports, code = fleet.fleet_reports(outcomes, lambda found: found.as_dict())
    out.emit({"instances": reports}, [table for outcome in outcomes if outcome.error is None
                                      for table in _listing_tables(outcome.result, title=outcome.instance)])
    report_errors(out, reports)
    raise typer.Exit(code)


def _listing_tables(result, title: str | None = None) -> list:
    rows = []
    for tier in result.tiers:
        for chunk in tier.chunks:
            pinned = "kvctl" if chunk.kvctl_pinned else "lmcache" if chunk.pinned else ""
            age = "" if chunk.age_s is None else f"{chunk.age_s:.0f} s"
            rows.append((tier.tier, chunk.key, "" if chunk.size is None else chunk.size, pinned, age))
    totals = "; ".join(f"{t.tier}: {t.total} chunks" + (f" ({len(t.chunks)} listed)" if len(t.chunks) < t.total else "")
                       for t in result.tiers)
    return [Table(["tier", "key", "bytes", "pinned", "age"], rows, title=title, caption=totals or "no tiers")]


def render_listing(out, result) -> None:
    out.emit(result.as_dict(), _listing_tables(result))
    for note in result.notes:
        out.info(f"note: {note}")
    for tier, message in result.errors.items():
        out.error(f"{tier} tier: {message}")
    if result.errors:
        raise typer.Exit(ExitCode.PARTIAL if result.tiers else result.failure_code)


def pin(
    ctx: typer.Context,
    prompt_file: PromptFile = None, chat: ChatFile = None, tokens_file: TokensFile = None,
    model: ModelOption = None, vllm_url: VllmOption = None,
    ttl: Annotated[str | None, typer.Option("--ttl", help="How long: 600, 30s, 10m, 2h, 1d (default: until "
                                            "unpinned; in-process only).")] = None,
    tier: TierOption = None, instance: FleetInstance = None, state: StateOption = None,
    inventory: InventoryOption = None, timeout: TimeoutOption = 30.0, coordinator: CoordinatorOption = None,
) -> None:
    """Pin a prompt's chunks: eviction skips them until unpinned (or the TTL ends).

    In-process: on the CPU and disk tiers, by kvctl. MP: in L2, fleet-wide, by the LMCache coordinator
    (so with --instance all, only in-process instances pin: MP ones say to pin once by name).
    """
    ttl_s = parse_duration(ttl) if ttl else None

    def pin_one(found) -> dict:
        worker, info, found = _open(found, vllm_url)
        if worker is None:
            if ttl or tier:
                raise UsageError("MP pins (the coordinator's) hold a prompt's chunks in L2 until unpinned: no --ttl "
                                 "or --tier", hint="drop --ttl and --tier")
            _no_mp_fan_out(instance)
            return _mp_pin("pin", found, coordinator, prompt_file, chat, tokens_file, model)
        from kvctl.core import inprocess

        worker.close()
        token_ids = _tokens(info["model"], prompt_file, chat, tokens_file, model, found.vllm)
        return inprocess.pin(found.worker, token_ids, ttl_s, tier_names(tier))

    _on_instances(ctx.obj, instance, state, inventory, timeout, pin_one, _pin_tables)


def _pin_tables(result: dict, title: str | None = None) -> list:
    if "pin_id" not in result:
        return _mp_pin_tables(result, title)
    expires = "never" if result["ttl_remaining_s"] is None else f"{result['ttl_remaining_s']} s"
    pinned = " ".join(f"{t}:{n}" for t, n in result["pinned"].items()) or "nothing cached: nothing pinned"
    return [Table(["pin id", "chunks", "tokens", "pinned", "expires in"],
                  [(result["pin_id"], result["chunks"], result["tokens"], pinned, expires)], title=title)]


def _no_mp_fan_out(instance: str | None) -> None:
    if instance == "all":
        raise UsageError("MP pins live in the coordinator, for the whole fleet at once",
                         hint="pin once with --instance NAME of one MP instance")


def _mp_pin(action: str, found, coordinator, prompt_file, chat, tokens_file, model) -> dict:
    """Pin or unpin a prompt through the coordinator, which hashes the tokens itself."""
    from kvctl.clients.coordinator import CoordinatorClient

    url = _coordinator(coordinator, found)
    name, world_size = _mp_model(found, model)
    token_ids = _tokens(name, prompt_file, chat, tokens_file, model, found.vllm)
    with CoordinatorClient(url) as client:
        return {"model": name, **getattr(client, action)(name, token_ids, world_size)}


def _mp_pin_tables(result: dict, title: str | None = None) -> list:
    return [Table(["model", "chunks", "keys", "status"],
                  [(result["model"], result["requested"], result["affected"], result["status"])], title=title)]


def unpin(
    ctx: typer.Context,
    pin_id: Annotated[str | None, typer.Option("--pin-id", help="The pin to release (in-process).")] = None,
    prompt_file: PromptFile = None, chat: ChatFile = None, tokens_file: TokensFile = None,
    model: ModelOption = None, vllm_url: VllmOption = None,
    everything: Annotated[bool, typer.Option("--all", help="Release every kvctl pin (in-process).")] = False,
    instance: FleetInstance = None, state: StateOption = None, inventory: InventoryOption = None,
    timeout: TimeoutOption = 30.0, coordinator: CoordinatorOption = None,
) -> None:
    """Release pins: one by id, every pin holding a prompt's chunks, or all (MP: one pin of a prompt)."""
    chosen = sum(bool(x) for x in (pin_id, prompt_file or chat or tokens_file, everything))
    if chosen != 1:
        raise UsageError("give exactly one of --pin-id, a prompt (--prompt-file/--chat/--tokens-file), --all",
                         hint="kvctl pins lists the pin ids")

    def unpin_one(found) -> dict:
        worker, info, found = _open(found, vllm_url)
        if worker is None:
            if pin_id or everything:
                raise UsageError("the LMCache coordinator unpins by prompt only (its pins have no ids)",
                                 hint="pass the prompt that was pinned (--prompt-file/--chat/--tokens-file)")
            _no_mp_fan_out(instance)
            return _mp_pin("unpin", found, coordinator, prompt_file, chat, tokens_file, model)
        from kvctl.core import inprocess

        worker.close()
        if pin_id or everything:
            return inprocess.unpin(found.worker, pin_id=pin_id, everything=everything)
        return inprocess.unpin(found.worker, tokens=_tokens(info["model"], prompt_file, chat, tokens_file, model,
                                                            found.vllm))

    _on_instances(ctx.obj, instance, state, inventory, timeout, unpin_one, _unpin_tables)


def _unpin_tables(result: dict, title: str | None = None) -> list:
    if "unpinned" not in result:
        return _mp_pin_tables(result, title)
    rows = [(entry["pin_id"], entry["chunks"], entry["tokens"]) for entry in result["unpinned"]]
    return [Table(["pin id", "chunks", "tokens"], rows, title=f"{title}: unpinned" if title else "unpinned")]


def pins(ctx: typer.Context, instance: FleetInstance = None, state: StateOption = None,
         inventory: InventoryOption = None, timeout: TimeoutOption = 30.0, coordinator: CoordinatorOption = None,
         model: Annotated[str | None, typer.Option("--model", help="MP: only pins of this model.")] = None) -> None:
    """List the pins: kvctl's on an in-process instance; the coordinator's pinned keys in MP mode."""
    def pins_one(found) -> dict:
        worker, _info, found = _open(found)
        if worker is None:
            from kvctl.core.mp_cache import coordinator_pins

            return {"pins": coordinator_pins(_coordinator(coordinator, found), model)}
        from kvctl.core import inprocess

        worker.close()
        return {"pins": inprocess.pins(found.worker)}

    _on_instances(ctx.obj, instance, state, inventory, timeout, pins_one, _pins_tables)


def _pins_tables(result: dict, title: str | None = None) -> list:
    listed = result["pins"]
    if listed and "pin_id" not in listed[0]:
        return [Table(["key", "pins"], [(p["key"], p["pin_count"]) for p in listed], title=title)]
    rows = [(p["pin_id"], p["chunks"], p["tokens"], " ".join(f"{t}:{n}" for t, n in p["pinned"].items()),
             "never" if p["ttl_remaining_s"] is None else f"{p['ttl_remaining_s']} s") for p in listed]
    return [Table(["pin id", "chunks", "tokens", "pinned", "expires in"], rows, title=title)]


def evict(
    ctx: typer.Context,
    prompt_file: PromptFile = None, chat: ChatFile = None, tokens_file: TokensFile = None,
    key: Annotated[list[str] | None, typer.Option("--key", help="A chunk key (repeatable).")] = None,
    tier: TierOption = None,
    everything: Annotated[bool, typer.Option("--all", help="Every chunk of the selected tiers (in Redis, and in "
                                             "every MP tier: those of this instance's model).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List exactly what would be removed; remove "
                                          "nothing.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask (required when not on a terminal).")] = False,
    force: Annotated[bool, typer.Option("--force", help="Remove pinned chunks too (MP: locked L1 objects and "
                                        "coordinator-pinned L2 chunks).")] = False,
    model: ModelOption = None, vllm_url: VllmOption = None, instance: FleetInstance = None, state: StateOption = None,
    inventory: InventoryOption = None, timeout: TimeoutOption = 60.0,
    coordinator: CoordinatorOption = None,
    config: Annotated[Path | None, typer.Option("--config", help="MP: the server's 'kvctl config init' directory "
                                                "(its L2 stores), when --instance is its URL.")] = None,
) -> None:
    """Remove chunks from the CPU, disk and Redis tiers: a prompt's, given keys, or a whole tier.

    With --instance all, every instance of the inventory plans at once, one question covers them all,
    and each evicts its own.
    """
    from functools import partial

    from kvctl.core import instances as fleet

    prompt_given = bool(prompt_file or chat or tokens_file)
    if sum((prompt_given, bool(key), everything)) != 1 and not (tier and not prompt_given and not key):
        raise UsageError("say what to evict: a prompt, --key, or --tier T / --all",
                         hint="add --dry-run to see what would go first")
    prepare = partial(_eviction, prompt=(prompt_file, chat, tokens_file) if prompt_given else None, keys=key,
                      tiers=tier_names(tier), force=force, model=model, vllm_url=vllm_url, coordinator=coordinator,
                      config=config)
    targets = fleet.resolve(instance, state, inventory)
    if instance != "all":
        eviction = prepare(targets[0])
        planned = eviction.plan()
        total = sum(planned["removed"].values())
        _confirm(total, planned["removed"], dry_run, yes)
        result = eviction.execute(planned) if total and not dry_run else {**planned, "dry_run": dry_run}
        ctx.obj.emit(result, _eviction_tables(result))
        return
    _evict_fleet(ctx.obj, targets, prepare, dry_run, yes, timeout)


class Eviction:
    """One instance's eviction: `plan()` is the dry run the user sees, `execute(plan)` removes exactly
    the planned chunks, tier by tier, through `evict_keys(tier, keys)`."""

    def __init__(self, plan, evict_keys) -> None:
        self.plan = plan
        self.evict_keys = evict_keys

    def execute(self, planned: dict) -> dict:
        from kvctl.core.listing import execute_plan

        return execute_plan(planned, self.evict_keys)


def _eviction(found, *, prompt, keys, tiers, force, model, vllm_url, coordinator, config) -> Eviction:
    """One instance's eviction, its prompt tokenized once up front."""
    from kvctl.core import listing, mp_cache

    worker, info, found = _open(found, vllm_url)
    if worker is None:
        config_dir = config or found.config_dir
        target = mp_cache.MPTarget(found.mp_http, listing.config_stores(config_dir), model or found.model,
                                   mp_cache.coordinator_url(coordinator, config_dir, found.coordinator))
        selection = {"tiers": tiers, "force": force, "keys": keys}
        if prompt:
            selection["tokens"] = _tokens(target.model or _mp_model(found, None)[0], *prompt, model, found.vllm)
        return Eviction(lambda: mp_cache.evict(target, dry_run=True, **selection),
                        lambda tier, chunk_keys: mp_cache.evict(target, dry_run=False, tiers=[tier], force=force,
                                                                keys=chunk_keys))
    worker.close()  # each run opens its own: a fleet plans and evicts on other threads
    from kvctl.core import inprocess

    selection = {"tiers": tiers, "force": force, "everything": not (prompt or keys)}
    if prompt:
        selection["tokens"] = _tokens(info["model"], *prompt, model, found.vllm)
    elif keys:
        selection["keys"] = keys

    return Eviction(lambda: inprocess.evict(found.worker, dry_run=True, **selection),
                    lambda tier, chunk_keys: inprocess.evict(found.worker, dry_run=False, tiers=[tier],
                                                             everything=False, keys=chunk_keys, force=force))


def _confirm(total: int, counts: dict[str, int], dry_run: bool, yes: bool) -> None:
    """Ask before removing anything, or refuse off a terminal without --yes."""
    if dry_run or total == 0 or yes:
        return
    if not sys.stdin.isatty():
        raise UsageError(f"refusing to evict {total} chunks without --yes (not on a terminal)",
                         hint="add --yes, or --dry-run to list them")
    listed = ", ".join(f"{tier}: {n}" for tier, n in counts.items())
    if not typer.confirm(f"evict {total} chunks ({listed})?", err=True):
        raise typer.Exit(ExitCode.ERROR)


def _eviction_tables(result: dict, title: str | None = None) -> list:
    rows = [(t, n, result["skipped_pinned"].get(t, 0)) for t, n in result["removed"].items()]
    heading = "would evict (dry run)" if result["dry_run"] else "evicted"
    return [Table(["tier", "chunks", "kept (pinned)"], rows, title=f"{title}: {heading}" if title else heading)]


def _evict_fleet(out, targets, prepare, dry_run: bool, yes: bool, timeout: float) -> None:
    """Plan on every instance at once, ask once for the total, then evict on each that planned."""
    from collections import Counter

    from kvctl.core import instances as fleet

    evictions: dict[str, Eviction] = {}

    def plan(found):
        evictions[found.name] = prepare(found)
        return evictions[found.name].plan()

    outcomes = fleet.fan_out(targets, plan, timeout)
    plans = {outcome.instance: outcome.result for outcome in outcomes if outcome.error is None}
    counts: Counter = Counter()
    for planned in plans.values():
        counts.update(planned["removed"])
    _confirm(sum(counts.values()), dict(counts), dry_run, yes)
    if not dry_run and sum(counts.values()):
        done = {o.instance: o for o in fleet.fan_out([t for t in targets if t.name in plans],
                                                      lambda found: evictions[found.name].execute(plans[found.name]),
                                                      timeout)}
        outcomes = [done.get(outcome.instance, outcome) for outcome in outcomes]
    reports, code = fleet.fleet_reports(outcomes, lambda result: {**result, "dry_run": dry_run})
    out.emit({"dry_run": dry_run, "instances": reports},
             [table for r in reports if "removed" in r for table in _eviction_tables(r, r["instance"])])
    report_errors(out, reports)
    raise typer.Exit(code)
