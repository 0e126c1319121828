"""`kvctl serve`: vLLM with LMCache (and the LMCache server in MP mode), supervised."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated

import typer

from kvctl.cli.options import Mode
from kvctl.core.errors import ExitCode
from kvctl.output import Table, escape


def serve(
    ctx: typer.Context,
    model: Annotated[str | None, typer.Argument(help="Model directory or hub id (default: kvctl's tiny model, "
                                                "built on first use).")] = None,
    mode: Annotated[Mode, typer.Option(help="inprocess (LMCacheConnectorV1) or mp (LMCacheMPConnector + "
                                       "lmcache server).")] = Mode.inprocess,
    tier: Annotated[list[str] | None, typer.Option(help="Cache tiers as for 'kvctl config init' (default: cpu and "
                                                   "disk, sized from this machine).")] = None,
    config: Annotated[Path | None, typer.Option(help="Use this 'kvctl config init' directory instead of "
                                                "generating one.", file_okay=False)] = None,
    host: Annotated[str, typer.Option(help="Address vLLM listens on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="vLLM's OpenAI server port.")] = 8000,
    internal_api_port_start: Annotated[int, typer.Option(help="LMCache internal API ports (in-process).")] = 6999,
    mp_port: Annotated[int, typer.Option(help="MP mode: the lmcache server's request port.")] = 5555,
    mp_http_port: Annotated[int, typer.Option(help="MP mode: the lmcache server's HTTP port.")] = 8080,
    coordinator: Annotated[str | None, typer.Option(help="MP mode: use this LMCache coordinator (URL) instead of "
                                                    "starting one.")] = None,
    coordinator_port: Annotated[int, typer.Option(help="MP mode: the port of the coordinator kvctl starts on "
                                                  "127.0.0.1.")] = 9300,
    no_coordinator: Annotated[bool, typer.Option("--no-coordinator", help="MP mode: start no coordinator (MP "
                                                 "pins need one).")] = False,
    controller: Annotated[bool, typer.Option("--controller", help="In-process mode: start LMCache's controller on "
                                             "127.0.0.1 (--controller-port and the next three ports) and register "
                                             "with it.")] = False,
    controller_url: Annotated[str | None, typer.Option(help="In-process mode: register with this LMCache controller "
                                                       "(HOST:PORT of its HTTP API) instead of starting one.")] = None,
    controller_port: Annotated[int, typer.Option(help="The HTTP port of the controller --controller starts.")] = 9000,
    keep_lmcache_env: Annotated[bool, typer.Option("--keep-lmcache-env", help="Pass inherited LMCACHE_* variables "
                                                   "on to vLLM and LMCache, where they override the configuration "
                                                   "(by default they are left out, and named).")] = False,
    name: Annotated[str, typer.Option(help="Name of this instance (its files live under kvctl's cache).")] = "default",
    state: Annotated[Path | None, typer.Option(help="State file other kvctl commands read (default: kvctl's "
                                               "cache/serve/state.json).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the commands and environment; start "
                                          "nothing.")] = False,
    pins: Annotated[Path | None, typer.Option("--pins", help="A pin set file to apply once the engine is ready, "
                                              "on every start (default: the `pins:` of this --name in the "
                                              "inventory).", dir_okay=False)] = None,
) -> None:
    """Launch vLLM with LMCache, wait until every part is ready, print the endpoints, and supervise.

    Extra vLLM arguments go after `--`. Ctrl-C (or SIGTERM) stops everything in order.
    """
    from kvctl.core.common.display import shown
    from kvctl.core.errors import UsageError
    from kvctl.core.lmcache.tiers import parse_tier
    from kvctl.core.serve.launch import build_plan, preflight

    out = ctx.obj
    extra_vllm_args = list(ctx.args)
    if model is not None and model.startswith("-"):  # `kvctl serve -- --flag …`: no model, only vLLM arguments
        extra_vllm_args.insert(0, model)
        model = None
    if coordinator is not None and (no_coordinator or not coordinator.startswith(("http://", "https://"))):
        raise UsageError(f"--coordinator {shown(coordinator)} " + ("with --no-coordinator" if no_coordinator else
                                                              "is not an http:// or https:// URL"),
                         hint="give the coordinator's URL (e.g. http://127.0.0.1:9300), or --no-coordinator alone")
    pins = _pin_set(out, name, pins)
    plan = build_plan(name=name, model=model, mode=mode.value, tiers=[parse_tier(t) for t in tier or []], config=config,
                      host=host, port=port, internal_api_port_start=internal_api_port_start, mp_port=mp_port,
                      mp_http_port=mp_http_port, state_file=state, extra_vllm_args=extra_vllm_args,
                      coordinator=coordinator, start_coordinator=not no_coordinator, coordinator_port=coordinator_port,
                      keep_lmcache_env=keep_lmcache_env, controller=controller_url,
                      start_controller=controller and not controller_url, controller_port=controller_port,
                      write=not dry_run)
    if dry_run:
        shown_plan = plan.as_dict()
        out.emit(shown_plan, _plan_lines(shown_plan))
        return
    preflight(plan)
    _announce_lmcache_env(out, plan)
    _run(out, plan, pins)


def _pin_set(out, name: str, pins: Path | None) -> Path | None:
    """The pin set to apply after each start, checked now (a bad file stops serve before it starts
    anything); an inventory's `pins:` that cannot be read is a warning."""
    from kvctl.core.errors import KvctlError
    from kvctl.core.instance.addresses import pin_set_file
    from kvctl.core.pins import pinsets

    if pins is None:
        try:
            pins = pin_set_file(name)
        except KvctlError as error:
            out.warn(f"no pin set applied: {error.message}")
            return None
    if pins is not None:
        pinsets.load(pins)
    return pins


def _announce_lmcache_env(out, plan) -> None:
    """Name the inherited LMCACHE_* variables the children do not get: LMCache would take them over the
    plan's configuration file."""
    if plan.unset_env:
        out.warn(f"leaving {', '.join(plan.unset_env)} out of vLLM's and LMCache's environment: LMCache reads "
                 "LMCACHE_* variables over the configuration file (--keep-lmcache-env passes them on)")


def _run(out, plan, pins: Path | None = None) -> None:
    from kvctl.core.serve.launch import offload_endpoint, remove_state, write_state
    from kvctl.core.serve.supervisor import Supervisor

    supervisor = Supervisor(plan)
    previous = {signum: signal.signal(signum, supervisor.request_stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    served = False
    try:
        with out.status("preparing") as update:
            supervisor.on_progress = update
            _ensure_tiny_model(plan, update)
            pids = supervisor.start()
        if supervisor.stop_requested is None:
            extra = offload_endpoint(plan)
            state_paths = write_state(plan, pids, extra)
            endpoints = {**plan.endpoints, **extra}
            pin_set = {} if pins is None else {"pin_set": _apply_pins(out, state_paths[0], pins)}
            out.emit({"name": plan.name, "mode": plan.mode, "model": plan.model, "endpoints": endpoints,
                      "logs": {c.name: c.log for c in plan.components}, "state_file": str(state_paths[0]),
                      **pin_set},
                     [Table(["endpoint", "address"], [(k, ", ".join(v) if isinstance(v, list) else v)
                                                     for k, v in endpoints.items()],
                            title=f"kvctl serve {plan.name} ({plan.mode}) is ready",
                            caption=f"logs in {Path(plan.components[0].log).parent}; Ctrl-C stops")])
            served = True
            supervisor.watch()
    finally:
        with out.status("stopping") as update:
            supervisor.on_progress = update
            supervisor.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        remove_state(plan)
    if supervisor.stop_requested == signal.SIGINT and not served:  # Ctrl-C once serving is the way to stop
        raise typer.Exit(ExitCode.INTERRUPTED)
    out.success(f"stopped {plan.name}")


def _apply_pins(out, state_file: Path, pins: Path) -> dict:
    """Apply the pin set to the engine just started: what it did, or (a warning; serve goes on) why not."""
    from kvctl.core.errors import KvctlError
    from kvctl.core.pins import pinsets

    try:
        result = pinsets.apply_after_start(state_file, pins)
    except KvctlError as error:
        out.warn(f"pin set {pins} not applied: {error.message}" + (f" ({error.hint})" if error.hint else ""))
        return {"file": str(pins), "error": error.message}
    counts = ", ".join(f"{count} {action}" for action, count in result.as_dict()["counts"].items() if count)
    out.info(f"pin set {result.set}: {counts or 'nothing to do'}")
    for where, message in result.errors.items():
        out.warn(f"pin set {result.set}: {where}: {message}")
    return result.as_dict()


def _ensure_tiny_model(plan, update) -> None:
    from kvctl.core.common.paths import models_dir
    from kvctl.core.serve.tiny_model import build_tiny_model

    if plan.model == str(models_dir() / "tiny"):
        update("building the tiny model")
        build_tiny_model(Path(plan.model))


def _plan_lines(plan: dict) -> list[str]:
    """The plan (as printed: secrets hidden) as shell commands a person could paste, one block per component."""
    import shlex

    lines = []
    unset = "".join(f"-u {name} " for name in plan["unset_env"])
    for component in plan["components"]:
        env = " ".join(f"{key}={shlex.quote(value)}" for key, value in sorted(component["env"].items()))
        lines.append(escape(f"# {component['name']} (log: {component['log']})\nenv {unset}{env} \\\n"
                            f"  {shlex.join(component['argv'])}\n"))
    lines.append(escape(f"# configuration: {plan['config_dir']}; state file: {plan['state_file']}"))
    return lines
