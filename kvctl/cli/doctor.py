"""`kvctl doctor`: why would this deployment miss? Findings over one instance, a configuration
directory or the fleet; exit 1 on any error-level finding."""

from __future__ import annotations

import typer

from kvctl.cli.options import TimeoutOption, selector_flags
from kvctl.output import Table

LEVEL_STYLES = {"error": "bold red", "warning": "yellow", "info": "dim"}


class FindingsTable(Table):
    """The findings, each row's level coloured (Rich drops the colour off a terminal and with NO_COLOR)."""

    def render(self):
        from rich.table import Table as RichTable
        from rich.text import Text

        from kvctl.output import printable

        table = RichTable(title=self.title, title_justify="left")
        for column in self.columns:
            table.add_column(column, overflow="fold")
        for row in self.rows:
            table.add_row(Text(row[0], style=LEVEL_STYLES.get(row[0], "")),
                          *(Text(printable(cell, lines=False)) for cell in row[1:]))
        return table


@selector_flags("instance", "state", "inventory", "config")
def doctor(ctx: typer.Context, chosen, timeout: TimeoutOption = 10.0) -> None:
    """Why would this deployment miss? What splits keys, overrides files, wastes tiers or exposes routes.

    Key compatibility across members and against the files (chunk size, hash algorithm, PYTHONHASHSEED,
    model, KV dtype, world size, versions), LMCACHE_* overrides, unusable disk files and budgets, Redis
    eviction and headroom, exposed management routes and secrets, and lookups that hit while retrieves
    do not.

    --config DIR alone checks a configuration with no engine; --instance all checks the inventory's fleet.
    Exit 1 on any error-level finding.
    """
    from kvctl.core.diagnose.doctor import diagnose

    report = diagnose(chosen, timeout)
    payload = report.as_dict()
    with_instance = any("instance" in finding for finding in payload["findings"])
    columns = ["level", "check", *(["instance"] if with_instance else []), "what", "hint"]
    rows = [(f["level"], f["check"], *([f.get("instance") or ""] if with_instance else []),
             f["what"] if f["level"] == "info" else f"{f['what']} (costs: {f['cost']})", f["hint"] or "")
            for f in payload["findings"]]
    title = f"{payload['errors']} error(s), {payload['warnings']} warning(s)"
    ctx.obj.emit(payload, [FindingsTable(columns, rows, title=title)] if rows else [title])
    raise typer.Exit(report.exit_code)
