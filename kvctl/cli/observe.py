"""`kvctl health`, `stats`, `top`: is every component up, and what do the caches do — for one
instance or a fleet (`--instance all` with a kvctl.yaml inventory)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Annotated, Any

import typer

from kvctl.cli.fleet import report_errors
from kvctl.cli.options import FleetInstance, InventoryOption, StateOption, TimeoutOption
from kvctl.core.common.display import format_bytes
from kvctl.core.errors import ExitCode
from kvctl.output import Table


def health(ctx: typer.Context, instance: FleetInstance = None, state: StateOption = None,
           inventory: InventoryOption = None, timeout: TimeoutOption = 10.0) -> None:
    """Check every component (vLLM, LMCache APIs, offload socket, MP server, coordinator, Redis, disk) and its latency.

    Exit code for probes: 0 all healthy, 3 nothing answers, 6 some components down.
    """
    payload, items, code = health_frame(instance, state, inventory, timeout)
    ctx.obj.emit(payload, items)
    raise typer.Exit(code)


def health_frame(instance, state, inventory, timeout) -> tuple[dict[str, Any], list, ExitCode]:
    from kvctl.core.diagnose.observe import Check, checks_as_dicts, health_exit_code, instance_health
    from kvctl.core.instance import addresses

    targets = addresses.resolve(instance, state, inventory)
    redis = addresses.shared_redis(inventory)
    outcomes = addresses.fan_out(targets, lambda target: instance_health(target, redis), timeout)
    every_check: list[Check] = []
    reports, rows = [], []
    for outcome in outcomes:
        checks = outcome.result or [Check("instance", outcome.instance, False, None, outcome.error or "no answer")]
        every_check.extend(checks)
        reports.append({"instance": outcome.instance, "healthy": all(c.ok for c in checks),
                        "checks": checks_as_dicts(checks)})
        rows.extend((outcome.instance, c.component, c.target, "ok" if c.ok else "DOWN",
                     "" if c.latency_ms is None else f"{c.latency_ms:.1f}", c.detail) for c in checks)
    code = health_exit_code(every_check)
    payload = {"healthy": code == ExitCode.OK, "instances": reports}
    return payload, [Table(["instance", "component", "target", "status", "ms", "detail"], rows)], code


def stats(ctx: typer.Context, instance: FleetInstance = None, state: StateOption = None,
          inventory: InventoryOption = None, timeout: TimeoutOption = 10.0) -> None:
    """Hit rates, usage vs capacity per tier, evictions and pins: LMCache's counters live, the rest from /metrics.

    LMCache's counters are read as of now through kvctl's routes (from /metrics, up to 10 s old, on an
    engine without them). Hit rates: LMCache's lookup vs retrieve hits, vLLM's prefix cache, and
    LMCache's share of the hits.
    """
    payload, items, code = stats_frame(instance, state, inventory, timeout)
    ctx.obj.emit(payload, items)
    report_errors(ctx.obj, payload["instances"])
    raise typer.Exit(code)


def stats_frame(instance, state, inventory, timeout) -> tuple[dict[str, Any], list, ExitCode]:
    from kvctl.core.diagnose.observe import instance_stats
    from kvctl.core.instance import addresses

    outcomes = addresses.fan_out(addresses.resolve(instance, state, inventory), instance_stats, timeout)
    reports, code = addresses.fleet_reports(outcomes, lambda stats: stats)
    return {"instances": reports}, [item for report in reports for item in _stats_tables(report)], code


def _stats_tables(report: dict[str, Any]) -> list:
    name = report["instance"]
    rows = []
    lmcache, vllm = report.get("lmcache"), report.get("vllm")
    if "controller_index" in report:  # an instance only its controller answers for
        return [Table(["metric", "value", "detail"], [("chunks in the controller's index",
                      _number(report["controller_index"]["chunks"]), " ".join(report["notes"]))], title=name)]
    if not (lmcache or vllm):
        return []
    if lmcache:
        for kind in ("lookup", "retrieve"):
            part = lmcache[kind]
            rows.append((f"LMCache {kind} hit rate", _percent(part["hit_rate"]),
                         f"{_number(part['hit_tokens'])} of {_number(part['tokens'])} tokens, "
                         f"{_number(part['requests'])} requests{_age(part)}"))
        rows.append(("LMCache stored tokens", _number(lmcache["store"]["tokens"]),
                     f"{_number(lmcache['store']['requests'])} store requests{_age(lmcache['store'])}"))
        evictions = lmcache["evictions"]
        rows.append(("CPU evictions", _number(evictions["cpu"]), f"{_number(evictions['cpu_failed'])} failed"))
        pins = lmcache["pins"]
        if pins:
            rows.append(("pins", _number(pins["kvctl"]), f"kvctl pins; LMCache pinned objects "
                         f"{_number(pins['pinned_objects'])}, forced unpins {_number(pins['forced_unpins'])}"))
    if vllm:
        for kind, label in (("prefix_cache", "vLLM prefix cache hit rate"),
                            ("external_cache", "vLLM hit rate from LMCache")):
            part = vllm[kind]
            rows.append((label, _percent(part["hit_rate"]), f"{_number(part['hits'])} of {_number(part['queries'])} "
                         "tokens"))
        rows.append(("vLLM KV cache usage", _percent(vllm["kv_cache_usage"]),
                     f"{_number(vllm['requests_running'])} running, {_number(vllm['requests_waiting'])} waiting"))
    items: list = [Table(["metric", "value", "detail"], rows, title=f"{name} ({report.get('mode', '?')})")]
    if lmcache and lmcache["tiers"]:
        items.append(Table(["tier", "chunks", "used", "capacity", "usage", "policy"],
                           [(t["tier"], _number(t["chunks"]), format_bytes(t["used_bytes"]),
                             format_bytes(t["capacity_bytes"]), _percent(t["usage"]), t.get("maxmemory_policy") or "")
                            for t in lmcache["tiers"]]))
    return items


def top(ctx: typer.Context, instance: FleetInstance = None, state: StateOption = None,
        inventory: InventoryOption = None, timeout: TimeoutOption = 5.0,
        interval: Annotated[float, typer.Option("--interval", min=0.2, help="Seconds between redraws.")] = 2.0,
        once: Annotated[bool, typer.Option("--once", help="Print one frame and exit (JSON with "
                                           "--format json).")] = False) -> None:
    """A live view of health and stats that redraws in place (Ctrl-C to leave); --once exits like health."""
    health_code = [ExitCode.OK]

    def frame() -> tuple[dict[str, Any], list]:
        """Health and stats side by side: a frame takes one --timeout at most, not two."""
        (health_payload, health_items, health_code[0]), (stats_payload, stats_items, _) = side_by_side(
            lambda: health_frame(instance, state, inventory, timeout),
            lambda: stats_frame(instance, state, inventory, timeout))
        return {"health": health_payload, "stats": stats_payload}, [*health_items, *stats_items]

    out = ctx.obj
    if once or out.json:
        payload, items = frame()
        out.emit(payload, items)
        raise typer.Exit(health_code[0])
    previous = signal.signal(signal.SIGTERM, _leave)
    try:
        out.watch(frame, interval)
    except KeyboardInterrupt:
        return
    finally:
        signal.signal(signal.SIGTERM, previous)


def _leave(_signum, _frame) -> None:
    """SIGTERM leaves `top` like Ctrl-C: the terminal restored, at once."""
    raise KeyboardInterrupt


def side_by_side(*calls: Callable[[], Any]) -> list[Any]:
    """Each call's result, run concurrently on daemon threads: leaving (Ctrl-C, SIGTERM) never waits for a
    probe still in flight. The first call's exception is raised."""
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(index: int, call: Callable[[], Any]) -> None:
        try:
            results[index] = call()
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(index, call), daemon=True) for index, call in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def _age(part: dict[str, Any]) -> str:
    """How old a group of counters may be, when they are not read as of now."""
    return f" (/metrics: up to {part['max_age_s']} s old)" if part.get("source") == "metrics" else ""


def _number(value) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _percent(value) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"
