"""`kvctl freeze`, `hot-cache`, `chunk-stats`, `conf`: LMCache's runtime switches and settings.
Each command parses, opens the instance and calls kvctl.core.admin.manage, which knows where in LMCache
each thing lives and refuses (exit 2) what this kind of instance cannot do. A status that differs
between an engine's workers is shown and exits 6."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from kvctl.cli.fleet import emit_fleet, open_one, run_fleet, selector
from kvctl.cli.options import FleetInstance, InstanceOption, InventoryOption, StateOption, TimeoutOption
from kvctl.core.errors import ExitCode
from kvctl.output import Table


class Switch(str, Enum):
    on = "on"
    off = "off"
    status = "status"


class StatsAction(str, Enum):
    start = "start"
    stop = "stop"
    reset = "reset"
    status = "status"
    top = "top"


SwitchArgument = Annotated[Switch, typer.Argument(help="on, off, or status (default).")]


def run_one_or_fleet(out, chosen, operation, tables, timeout: float, fleet_ok: bool) -> None:
    """One instance: its result (exit 6 when its processes differ or some failed); --instance all
    (reads only): every member's."""
    if chosen.fleet and fleet_ok:
        emit_fleet(out, run_fleet(chosen, operation, timeout), tables)
    result = operation(open_one(chosen))
    out.emit(result.as_dict(), tables(result))
    failed = [p for p in getattr(result, "processes", []) if "error" in p]
    for process in failed:
        out.error(f"{process['process']} ({process['url']}): {process['error']}")
    if getattr(result, "partial", False):
        if not failed:
            out.warn("the engine's processes differ (see the table)")
        raise typer.Exit(ExitCode.PARTIAL)


def process_tables(state: str):
    def tables(result, title: str | None = None) -> list:
        rows = [(p["process"], p["url"], _shown(p.get(state)) if "error" not in p else f"error: {p['error']}")
                for p in result.processes]
        value = result.value()
        caption = f"{state}: {_shown(value)}" if result.consistent else f"{state}: differs between processes"
        return [Table(["process", "url", state], rows, title=title, caption=caption)]

    return tables


def _shown(value) -> str:
    return "on" if value is True else "off" if value is False else "" if value is None else str(value)


def freeze(ctx: typer.Context, state: SwitchArgument = Switch.status, instance: FleetInstance = None,
           state_file: StateOption = None, inventory: InventoryOption = None, timeout: TimeoutOption = 30.0) -> None:
    """Freeze an in-process engine: store no new chunks, keep serving what is cached (from the CPU tier).

    Switched on every worker; `status` reports each worker (with --instance all, every instance).
    """
    from kvctl.core.admin import manage

    enabled = None if state is Switch.status else state is Switch.on
    run_one_or_fleet(ctx.obj, selector(instance, state_file, inventory), lambda found: manage.freeze(found, enabled),
                     process_tables("freeze"), timeout, enabled is None)


def hot_cache(ctx: typer.Context, state: SwitchArgument = Switch.status, instance: FleetInstance = None,
              state_file: StateOption = None, inventory: InventoryOption = None,
              timeout: TimeoutOption = 30.0) -> None:
    """The CPU tier's hot cache of an in-process engine: on, off (which also empties it) or status.

    Switched on every worker; `status` reports each worker (with --instance all, every instance).
    """
    from kvctl.core.admin import manage

    enabled = None if state is Switch.status else state is Switch.on
    run_one_or_fleet(ctx.obj, selector(instance, state_file, inventory),
                     lambda found: manage.hot_cache(found, enabled), process_tables("hot_cache"), timeout,
                     enabled is None)


def chunk_stats(ctx: typer.Context,
                action: Annotated[StatsAction, typer.Argument(help="start, stop, reset, status (default): the "
                                                              "reuse summary, or top: the hottest chunks and "
                                                              "prompts.")] = StatsAction.status,
                limit: Annotated[int, typer.Option("--limit", min=1, help="top: how many of each.")] = 20,
                directory: Annotated[Path | None, typer.Option("--dir", help="top: LMCache's chunk statistics "
                                                               "directory, read with no engine (default: the one "
                                                               "the scheduler reports).", file_okay=False)] = None,
                instance: InstanceOption = None, state_file: StateOption = None,
                inventory: InventoryOption = None) -> None:
    """LMCache's chunk statistics (how often prompts' chunks recur), kept by vLLM's scheduler process.

    Needs an engine started with enable_chunk_statistics (exit 2 and a hint otherwise). `top` needs
    chunk_statistics_strategy: file_hash, whose files name each request's chunks (the default bloom
    filter keeps counts only); it reads them from --dir or where the scheduler says they are.
    """
    from kvctl.core.admin import manage

    if action is StatsAction.top:
        found = None if directory else open_one(selector(instance, state_file, inventory))
        hottest = manage.chunk_top(found, directory, limit)
        ctx.obj.emit(hottest.as_dict(), _top_tables(hottest))
        return
    result = manage.chunk_stats(open_one(selector(instance, state_file, inventory)), action.value)
    if action is StatsAction.status:
        rows = [(key, value) for key, value in result.summary().items()]
        tables = [Table(["statistic", "value"], rows, title=f"chunk statistics ({result.url})")]
    else:
        tables = [f"chunk statistics: {result.answer.get('message', action.value)}"]
    ctx.obj.emit(result.as_dict(), tables)


def _top_tables(hottest) -> list:
    skipped = f"; {hottest.skipped_lines} unreadable lines" if hottest.skipped_lines else ""
    caption = (f"{hottest.requests} requests, {hottest.chunk_refs} chunks, {hottest.files} files in "
               f"{hottest.directory}{skipped}")
    return [Table(["chunk hash", "prefix chunks", "requests", "share"],
                  [(hot.chunk_hash, hot.chunks, hot.requests, f"{hot.requests / max(hottest.requests, 1):.0%}")
                   for hot in table], title=title, caption=caption if table is hottest.prompts else None)
            for title, table in (("hottest chunk prefixes", hottest.chunks), ("hottest prompts", hottest.prompts))]


conf_app = typer.Typer(help="LMCache's settings on a running in-process engine (GET/POST /conf).",
                       no_args_is_help=True)


def _conf_tables(result, title: str | None = None) -> list:
    rows = [(key, _value(value), "differs" if key in result.differs else "") for key, value in result.values.items()]
    tables = [Table(["key", "value", ""], rows, title=title or "settings",
                    caption="from " + ", ".join(p["process"] for p in result.processes if "error" not in p))]
    return tables


def _value(value) -> str:
    import json

    return value if isinstance(value, str) else json.dumps(value)


@conf_app.command("get")
def conf_get(ctx: typer.Context,
             keys: Annotated[list[str] | None, typer.Argument(help="Settings to show (default: all).")] = None,
             instance: FleetInstance = None, state_file: StateOption = None, inventory: InventoryOption = None,
             timeout: TimeoutOption = 30.0) -> None:
    """Show settings as the engine's processes hold them now (secrets redacted).

    Values that differ between the scheduler and the workers are marked (exit 6).
    """
    from kvctl.core.admin import manage

    run_one_or_fleet(ctx.obj, selector(instance, state_file, inventory),
                     lambda found: manage.conf_get(found, list(keys or [])), _conf_tables, timeout, True)


@conf_app.command("set")
def conf_set(ctx: typer.Context,
             assignments: Annotated[list[str], typer.Argument(help="KEY=VALUE (repeatable).",
                                                              metavar="KEY=VALUE...")],
             instance: InstanceOption = None, state_file: StateOption = None,
             inventory: InventoryOption = None) -> None:
    """Change settings live, on the scheduler and every worker.

    Only the settings LMCache reads on every request are taken: min_retrieve_tokens,
    save_decode_cache, priority_limit, blocking_timeout_secs. Any other (chunk_size, the hash
    algorithm, tier sizes and paths, remote_url, ...) is read when the engine is built: refused with
    exit 2, nothing changed. So are values LMCache would misbehave on: min_retrieve_tokens below 0,
    blocking_timeout_secs below 1 (every Redis get would time out).
    """
    from kvctl.core.admin import manage

    values = manage.parse_assignments(assignments)
    run_one_or_fleet(ctx.obj, selector(instance, state_file, inventory),
                     lambda found: manage.conf_set(found, values), _conf_tables, 0, False)
