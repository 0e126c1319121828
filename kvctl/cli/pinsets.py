"""`kvctl pin apply FILE`: make an instance's pins what a pin set file declares (kvctl.core.pins.pinsets).
A subcommand of the `pin` group (kvctl.cli.cache.pin_app), whose own callback pins one prompt."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvctl.cli.fleet import emit_fleet, open_one, run_fleet
from kvctl.cli.options import (
    TimeoutOption,
    selector_flags,
)
from kvctl.core.errors import ExitCode
from kvctl.output import Table


@selector_flags("model", "vllm_url", "instance", "state", "inventory", "coordinator", "config")
def apply(
    ctx: typer.Context, chosen,
    file: Annotated[Path, typer.Argument(help="The pin set: YAML with name: and pins: (prompt_file, chat or "
                                         "tokens_file, each with an optional ttl and tiers).", dir_okay=False)],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would be pinned, refreshed and released; "
                                          "change nothing.")] = False,
    no_prewarm: Annotated[bool, typer.Option("--no-prewarm", help="Pin only what is cached; by default an entry "
                                             "with chunks not cached is first prefilled through the instance's "
                                             "vLLM, where known.")] = False,
    timeout: TimeoutOption = 30.0,
) -> None:
    """Apply a pin set: pin its prompts that are not pinned, pin those with a TTL again (a fresh TTL),
    release the pins this set made that the file no longer lists. Plain pins and other sets' pins stay.

    Each pin's id is set-NAME-DIGEST (`kvctl pins` shows the set), so re-applying, also after a
    restart of the engine (its pins are gone then), finds what is pinned. An entry with chunks not
    cached is prefilled through the instance's vLLM first, where known. Per entry: its chunks and how
    many are cached (pinned). MP: the coordinator's pins have no ids, so kvctl keeps a ledger of the
    set's pins per coordinator; entries there take no ttl or tiers.
    """
    from kvctl.core.pins import pinsets

    pin_set = pinsets.load(file)  # a bad file is one error, before any instance is asked
    model = chosen.model

    def apply_one(found):
        application = pinsets.plan(pin_set, found, model)
        return application if dry_run else pinsets.execute(application, found, model, prewarm=not no_prewarm)

    if chosen.fleet:
        emit_fleet(ctx.obj, run_fleet(chosen, apply_one, timeout), tables)
    result = apply_one(open_one(chosen))
    ctx.obj.emit(result.as_dict(), tables(result))
    for where, message in result.errors.items():
        ctx.obj.error(f"{where}: {message}")
    if result.errors:
        raise typer.Exit(ExitCode.PARTIAL)


def tables(result, title: str | None = None) -> list:
    rows = []
    for step in result.steps:
        entry = step.entry
        cached = "" if step.chunks is None else f"{step.cached_chunks}/{step.chunks}"
        ttl = "" if entry is None else "never" if entry.ttl_s is None else f"{entry.ttl_s:g} s"
        notes = [step.error, step.why, step.prewarm,
                 "not cached: prewarm it" if step.chunks and not step.cached_chunks and not step.prewarm else None]
        note = "; ".join(note for note in notes if note)
        rows.append((step.action, entry.label if entry else "", step.pin_id, cached, ttl, note))
    counts = ", ".join(f"{len(result.of(action))} {action}" for action in ("pin", "refresh", "release", "unchanged"))
    name = f"pin set {result.set}" + (f" on {title}" if title else "") + (" (dry run)" if result.dry_run else "")
    return [Table(["action", "file", "pin id", "cached", "ttl", "note"], rows, title=name, caption=counts)]
