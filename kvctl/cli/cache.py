"""`kvctl ls`, `pin` (a group too: `pin apply`, kvctl.cli.pinsets), `unpin`, `pins`: what an instance
holds and what it keeps. Each command opens the instance (kvctl.core.instance.protocol) and asks it one thing;
how an in-process engine, an MP server or a configuration with no engine answers is theirs to know.

MP pins without a known coordinator are refused with exit 2 (usage): kvctl has no pin of its own
there, and pretending to pin would be worse than saying so."""

from __future__ import annotations

from typing import Annotated

import typer

from kvctl.cli import pinsets
from kvctl.cli.fleet import emit_fleet, on_instances, open_one, run_fleet
from kvctl.cli.options import (
    TierOption,
    TimeoutOption,
    prompt_flags,
    selector_flags,
    tier_names,
)
from kvctl.core.errors import ExitCode, UsageError
from kvctl.core.pins.durations import parse_duration
from kvctl.output import Table

__all__ = ["ls", "pin", "pin_app", "pins", "unpin", "parse_duration"]


@selector_flags("config", "instance", "state", "inventory", "model")
def ls(
    ctx: typer.Context, chosen,
    tier: TierOption = None,
    limit: Annotated[int, typer.Option("--limit", min=1, help="At most this many chunks listed per tier (totals "
                                       "count them all).")] = 100,
    timeout: TimeoutOption = 30.0,
) -> None:
    """List cached chunks per tier: key, size, pin state, age where known; totals per tier.

    A running in-process instance answers for its CPU and disk tiers (pins included); an MP server
    for its L1 (cpu; "pinned" = locked by a reader), with the L2 stores of its configuration (give
    --config with an MP server's URL); Redis, and the disk directory of a --config with no instance,
    are read directly. With --instance all, every instance of the inventory is listed
    ({"instances": [...]} in JSON).
    """
    tiers = tier_names(tier)

    def list_one(found):
        return found.list(tiers, chosen.model, limit)

    if chosen.fleet:
        emit_fleet(ctx.obj, run_fleet(chosen, list_one, timeout), _listing_tables)
    else:
        render_listing(ctx.obj, list_one(open_one(chosen)))


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


@prompt_flags
@selector_flags("model", "vllm_url", "instance", "state", "inventory", "coordinator")
def pin(
    ctx: typer.Context, prompt, chosen,
    ttl: Annotated[str | None, typer.Option("--ttl", help="How long: 600, 30s, 10m, 2h, 1d (default: until "
                                            "unpinned; in-process only).")] = None,
    tier: TierOption = None, timeout: TimeoutOption = 30.0,
) -> None:
    """Pin a prompt's chunks: eviction skips them until unpinned (or the TTL ends).

    In-process: on the CPU and disk tiers, by kvctl. MP: in L2, fleet-wide, by the LMCache coordinator
    (so with --instance all, only in-process instances pin: MP ones say to pin once by name).
    `kvctl pin apply FILE` pins a whole set of prompts declared in a file.
    """
    if ctx.invoked_subcommand:  # `kvctl pin apply …`: this runs first; its options go after the subcommand
        given = [p.opts[0] for p in ctx.command.params if ctx.get_parameter_source(p.name).name == "COMMANDLINE"]
        if given:
            raise UsageError(f"'kvctl pin {ctx.invoked_subcommand}' takes its options after "
                             f"'{ctx.invoked_subcommand}' (got {', '.join(given)} before it)",
                             hint=f"see 'kvctl pin {ctx.invoked_subcommand} --help'")
        return
    ttl_s, model = parse_duration(ttl) if ttl else None, chosen.model

    def pin_one(found):
        return found.pin(found.tokenize(prompt, model), ttl_s, tier_names(tier), model)

    on_instances(ctx.obj, chosen, pin_one, _tables, timeout)


# `kvctl pin` pins a prompt and, with a subcommand, `kvctl pin apply FILE` pins a set (kvctl.cli.pinsets).
pin_app = typer.Typer(invoke_without_command=True, subcommand_metavar="[apply FILE [OPTIONS]]")
pin_app.callback()(pin)
pin_app.command("apply")(pinsets.apply)


def _tables(result, title: str | None = None) -> list:
    """A pin's or a list of pins' table, as its kind describes itself (kvctl's, the coordinator's, the
    controller's)."""
    return [Table(result.columns, result.rows(), title=title)]


@prompt_flags
@selector_flags("model", "vllm_url", "instance", "state", "inventory", "coordinator")
def unpin(
    ctx: typer.Context, prompt, chosen,
    pin_id: Annotated[str | None, typer.Option("--pin-id", help="The pin to release (in-process).")] = None,
    everything: Annotated[bool, typer.Option("--all", help="Release every kvctl pin (in-process).")] = False,
    timeout: TimeoutOption = 30.0,
) -> None:
    """Release pins: one by id, every pin holding a prompt's chunks, or all (MP: one pin of a prompt)."""
    model = chosen.model
    if sum(bool(x) for x in (pin_id, prompt.given, everything)) != 1:
        raise UsageError("give exactly one of --pin-id, a prompt (--prompt-file/--chat/--tokens-file), --all",
                         hint="kvctl pins lists the pin ids")

    def unpin_one(found):
        tokens = found.tokenize(prompt, model) if prompt.given else None
        return found.unpin(pin_id=pin_id, tokens=tokens, everything=everything, model=model)

    on_instances(ctx.obj, chosen, unpin_one, _unpin_tables, timeout)


def _unpin_tables(result, title: str | None = None) -> list:
    return [Table(result.unpinned_columns, result.unpinned_rows(), title=f"{title}: unpinned" if title else "unpinned")]


@selector_flags("instance", "state", "inventory", "coordinator", "model")
def pins(ctx: typer.Context, chosen, timeout: TimeoutOption = 30.0) -> None:
    """List the pins: kvctl's on an in-process instance; the coordinator's pinned keys in MP mode."""
    on_instances(ctx.obj, chosen, lambda found: found.pins(chosen.model), _tables, timeout)
