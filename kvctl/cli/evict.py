"""`kvctl evict`: plan, confirm, execute. The instance plans (kvctl.core.instance.protocol.EvictionPlan), the
user sees and confirms exactly that plan, and the instance removes only the planned chunks: a dry run
shows the plan, a real run what executing it did (an empty plan executes to an empty result). A configuration
directory alone (--config, no --instance) is evicted with no engine: its disk directory and Redis."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Annotated

import typer

from kvctl.cli.fleet import emit_fleet, open_one, run_fleet
from kvctl.cli.options import (
    SELECTOR_FLAGS,
    TierOption,
    TimeoutOption,
    prompt_flags,
    selector_flags,
    tier_names,
)
from kvctl.core.errors import ExitCode, UsageError
from kvctl.output import Table


@prompt_flags
@selector_flags(*SELECTOR_FLAGS)
def evict(
    ctx: typer.Context, prompt, chosen,
    key: Annotated[list[str] | None, typer.Option("--key", help="A chunk key (repeatable).")] = None,
    tier: TierOption = None,
    everything: Annotated[bool, typer.Option("--all", help="Every chunk of the selected tiers (in Redis, in every MP "
                                             "tier and with no engine: those of the model only).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List exactly what would be removed; remove "
                                          "nothing.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask (required when not on a terminal).")] = False,
    force: Annotated[bool, typer.Option("--force", help="Remove pinned chunks too (MP: locked L1 objects and "
                                        "coordinator-pinned L2 chunks; with no engine: even while one of the "
                                        "configuration runs).")] = False,
    timeout: TimeoutOption = 60.0,
) -> None:
    """Remove chunks from the CPU, disk and Redis tiers: a prompt's, given keys, or a whole tier.

    With --config DIR and no --instance, no engine is needed: the configuration's disk directory and
    Redis (MP: its fs and resp L2 stores) are evicted directly, refused while an engine of it runs.
    With --instance all, every instance of the inventory plans at once, one question covers them all,
    and each evicts its own.
    """
    from kvctl.core.instance.protocol import Selection

    model = chosen.model
    if sum((prompt.given, bool(key), everything)) != 1 and not (tier and not prompt.given and not key):
        raise UsageError("say what to evict: a prompt, --key, or --tier T / --all",
                         hint="add --dry-run to see what would go first")

    def plan(found):
        tokens = tuple(found.tokenize(prompt, model)) if prompt.given else None
        planned = found.plan_eviction(Selection(tokens, tuple(key) if key else None, tier_names(tier), force, model))
        for note in found.notes:
            ctx.obj.info(f"note: {found.name}: {note}" if chosen.fleet else f"note: {note}")
        return planned

    if chosen.fleet:
        _evict_fleet(ctx.obj, chosen, plan, dry_run, yes, timeout)
    found = open_one(chosen)
    planned = plan(found)
    _confirm(planned.removed, planned.cleared_whole, dry_run, yes)
    result = planned if dry_run else found.execute_eviction(planned)
    ctx.obj.emit(result.as_dict(), _eviction_tables(result))
    for failed, message in result.errors.items():
        ctx.obj.error(f"{failed} tier: {message}")
    if result.errors:
        raise typer.Exit(ExitCode.PARTIAL)


def _confirm(counts: dict[str, int], whole: Sequence[str], dry_run: bool, yes: bool) -> None:
    """Ask before removing anything, or refuse off a terminal without --yes."""
    total = sum(counts.values())
    if dry_run or (total == 0 and not whole) or yes:
        return
    listed = ", ".join(f"{tier}: {n}" for tier, n in counts.items())
    what = " and ".join(part for part in (f"{total} chunks ({listed})" if total else "",
                                          f"the whole {'/'.join(sorted(set(whole)))} tier (cleared by LMCache, "
                                          "counted after)" if whole else "") if part)
    if not sys.stdin.isatty():
        raise UsageError(f"refusing to evict {what} without --yes (not on a terminal)",
                         hint="add --yes, or --dry-run to list them")
    if not typer.confirm(f"evict {what}?", err=True):
        raise typer.Exit(ExitCode.ERROR)


def _eviction_tables(result, title: str | None = None) -> list:
    rows = [(t, n, result.skipped_pinned.get(t, 0)) for t, n in result.removed.items()]
    rows += [(t, "whole tier" if result.dry_run else "", "") for t in result.cleared_whole if t not in result.removed]
    heading = "would evict (dry run)" if result.dry_run else "evicted"
    tables = [Table(["tier", "chunks", "kept (pinned)"], rows, title=f"{title}: {heading}" if title else heading)]
    if result.dry_run and result.chunks:  # the dry run lists exactly what the real run would remove
        tables.append(Table(["tier", "key"], [(chunk["tier"], chunk["key"]) for chunk in result.chunks],
                            title=f"{title}: chunks" if title else "chunks"))
    return tables


def _evict_fleet(out, chosen, plan, dry_run: bool, yes: bool, timeout: float) -> None:
    """Plan on every instance at once, ask once for the total, then each that planned executes its plan."""
    from collections import Counter

    from kvctl.core.instance.address import Address
    from kvctl.core.instance.addresses import FleetReport, fan_out

    planned = run_fleet(chosen, lambda found: (found, plan(found)), timeout)
    members = {outcome.instance: outcome.result for outcome in planned.succeeded()}  # name -> (instance, plan)
    counts: Counter = Counter()
    for _found, each in members.values():
        counts.update(each.removed)
    whole = [tier for _found, each in members.values() for tier in each.cleared_whole]
    _confirm(dict(counts), whole, dry_run, yes)
    outcomes = [replace(outcome, result=members[outcome.instance][1]) if outcome.error is None else outcome
                for outcome in planned.outcomes]
    if not dry_run:
        done = {o.instance: o for o in fan_out([Address(name) for name in members],
                                               lambda member: members[member.name][0].execute_eviction(
                                                   members[member.name][1]), timeout)}
        outcomes = [done.get(outcome.instance, outcome) for outcome in outcomes]
    emit_fleet(out, FleetReport(outcomes), _eviction_tables, dry_run=dry_run)

