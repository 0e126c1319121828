"""`kvctl version`: what kvctl runs with."""

from __future__ import annotations

import typer

from kvctl.output import Table


def version(ctx: typer.Context) -> None:
    """Show the versions of kvctl, LMCache, vLLM, torch and Python, and whether this is a CPU or GPU machine."""
    from kvctl.core.lmcache.versions import version_report

    report = version_report()
    labels = {"vllm_distribution": "vllm distribution", "platform": "platform (cpu/gpu)"}
    rows = [(labels.get(name, name), value if value is not None else "not installed") for name, value in report.items()]
    ctx.obj.emit(report, [Table(["component", "version"], rows)])
