"""One instance or every instance of the inventory: open it, run one operation, render the typed
result; a fleet's results are one report per member, failures on stderr, one exit-code rule."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import typer


def selector(instance=None, state=None, inventory=None, config=None, vllm_url=None, coordinator=None, **keys):
    from kvctl.core.instance.opening import Selector

    return Selector(instance, state, config, inventory, vllm_url, coordinator, **keys)


def open_one(chosen):
    from kvctl.core.instance.opening import open_instance

    return open_instance(chosen)


def run_fleet(chosen, operation: Callable[[Any], Any], timeout: float):
    """`operation(instance)` on every fleet member at once (the inventory's, or a controller's; each
    opened on its own thread)."""
    from kvctl.core.instance import addresses
    from kvctl.core.instance.opening import open_instance

    members = addresses.resolve(chosen.instance, chosen.state, chosen.inventory)
    outcomes = addresses.fan_out(members, lambda address: operation(open_instance(chosen, address)), timeout)
    return addresses.FleetReport(outcomes)


def on_instances(out, chosen, operation: Callable[[Any], Any], tables: Callable[..., list], timeout: float) -> None:
    """One instance: its result; --instance all: every member's, with the failures named (exit 6)."""
    if not chosen.fleet:
        result = operation(open_one(chosen))
        out.emit(result.as_dict(), tables(result))
        return
    emit_fleet(out, run_fleet(chosen, operation, timeout), tables)


def emit_fleet(out, report, tables: Callable[..., list], **extra: Any) -> None:
    reports, code = report.reports_and_code()
    out.emit({**extra, "instances": reports},
             [item for outcome in report.succeeded() for item in tables(outcome.result, outcome.instance)])
    report_errors(out, reports)
    raise typer.Exit(code)


def report_errors(out, reports: list[dict[str, Any]]) -> None:
    """One stderr line per failure: `instance: what failed: why`, with the hint of a failed instance."""
    for report in reports:
        for where, message in (report.get("errors") or {}).items():
            if where == "instance":
                out.error(f"{report['instance']}: {message}", report.get("hint"))
            else:
                out.error(f"{report['instance']}: {where}: {message}")
