"""`kvctl backends` (an in-process engine's storage backends, i.e. its tiers, at runtime) and `kvctl
quota` (an MP server's per-cache_salt quotas). Names as users say them (cpu, disk, redis) or as
LMCache does (LocalCPUBackend, LocalDiskBackend, RemoteBackend)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from kvctl.cli.fleet import open_one, selector
from kvctl.cli.manage import run_one_or_fleet
from kvctl.cli.options import FleetInstance, InstanceOption, InventoryOption, StateOption, TimeoutOption
from kvctl.core.errors import ExitCode, UsageError
from kvctl.output import Table

app = typer.Typer(help="An in-process engine's storage backends (tiers) at runtime, on every worker.",
                  no_args_is_help=True)
NameArgument = Annotated[str, typer.Argument(help="cpu, disk, redis, or LMCache's backend name.", metavar="NAME")]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Say on which workers it is; change nothing.")]
Yes = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask (required when not on a terminal).")]


def _tables(result, title: str | None = None) -> list:
    heading = title or ("backends" if result.action is None else
                        f"{result.action} {result.backend or ''}".strip() + (" (dry run)" if result.dry_run else ""))
    rows = [(b["tier"], b["name"], b["class"], b["workers"], "yes" if b["bypassed"] else "") for b in result.merged()]
    tables = [Table(["tier", "backend", "class", "workers", "bypassed"], rows, title=heading,
                    caption=None if result.consistent else "the workers' backends differ")]
    if result.dry_run:
        tables.append(Table(["process", "has it"], [(p["process"], "yes" if p.get("present") else "no")
                                                    for p in result.processes], title="would change"))
    return tables


def _change(ctx: typer.Context, action: str, name: str | None, instance, state_file, inventory,
            dry_run: bool = False) -> None:
    from kvctl.core.admin import manage

    run_one_or_fleet(ctx.obj, selector(instance, state_file, inventory),
                     lambda found: manage.change_backend(found, action, name, dry_run), _tables, 0, False)


@app.command("ls")
def ls(ctx: typer.Context, instance: FleetInstance = None, state_file: StateOption = None,
       inventory: InventoryOption = None, timeout: TimeoutOption = 30.0) -> None:
    """The backends of every worker: tier, LMCache's name and class, on how many workers, bypassed."""
    from kvctl.core.admin import manage

    run_one_or_fleet(ctx.obj, selector(instance, state_file, inventory), manage.backends, _tables, timeout, True)


@app.command("attach")
def attach(ctx: typer.Context, instance: InstanceOption = None, state_file: StateOption = None,
           inventory: InventoryOption = None) -> None:
    """Create the backends the engine's current configuration names and it lacks (after a detach)."""
    _change(ctx, "attach", None, instance, state_file, inventory)


@app.command("detach")
def detach(ctx: typer.Context, name: NameArgument, dry_run: DryRun = False, yes: Yes = False,
           instance: InstanceOption = None, state_file: StateOption = None,
           inventory: InventoryOption = None) -> None:
    """Close a backend on every worker (until `kvctl backends attach`); asks, or needs --yes.

    Its chunks stay where they are (a disk directory, Redis) but the engine stops reading and
    writing them. The CPU tier cannot be detached: it is LMCache's allocator.
    """
    from kvctl.core.admin import manage

    backend = manage.backend_name(name)
    if not dry_run:
        confirm(f"detach {backend} on every worker?", f"refusing to detach {backend}",
                "add --yes, or --dry-run to see where it is", yes)
    _change(ctx, "detach", name, instance, state_file, inventory, dry_run)


@app.command("recreate")
def recreate(ctx: typer.Context, name: NameArgument, instance: InstanceOption = None,
             state_file: StateOption = None, inventory: InventoryOption = None) -> None:
    """Close a backend and create it again from the current configuration (e.g. to reconnect Redis)."""
    _change(ctx, "recreate", name, instance, state_file, inventory)


@app.command("bypass")
def bypass(ctx: typer.Context, name: NameArgument, instance: InstanceOption = None,
           state_file: StateOption = None, inventory: InventoryOption = None) -> None:
    """Skip a backend on lookups, stores and retrieves (it stays open); `unbypass` ends that."""
    _change(ctx, "bypass", name, instance, state_file, inventory)


@app.command("unbypass")
def unbypass(ctx: typer.Context, name: NameArgument, instance: InstanceOption = None,
             state_file: StateOption = None, inventory: InventoryOption = None) -> None:
    """Use a bypassed backend again."""
    _change(ctx, "unbypass", name, instance, state_file, inventory)


quota_app = typer.Typer(help="An MP server's soft per-cache_salt quotas (its L2 IsolatedLRU eviction).",
                        no_args_is_help=True)
SaltArgument = Annotated[str, typer.Argument(help="The cache_salt ('' or _default: requests without one).",
                                             metavar="SALT")]


def _quota_tables(result, title: str | None = None) -> list:
    rows = [(q["cache_salt"], q.get("limit_gb"), q.get("current_usage_gb"), q.get("exists", True))
            for q in result.quotas]
    return [Table(["cache salt", "limit GB", "used GB", "has quota"], rows, title=title or "quotas",
                  caption=None if result.status is None else f"{result.action}: {result.status}")]


def confirm(question: str, refusal: str, hint: str, yes: bool) -> None:
    """Ask on a terminal; refuse (exit 2) elsewhere unless --yes."""
    if yes:
        return
    if not sys.stdin.isatty():
        raise UsageError(f"{refusal} without --yes (not on a terminal)", hint=hint)
    if not typer.confirm(question, err=True):
        raise typer.Exit(ExitCode.ERROR)


def _quota(ctx: typer.Context, action: str, instance, state_file, inventory, salt=None, limit_gb=None,
           confirm_shrink=None) -> None:
    from kvctl.core.admin import manage

    result = manage.quota(open_one(selector(instance, state_file, inventory)), action, salt, limit_gb,
                          confirm_shrink)
    ctx.obj.emit(result.as_dict(), _quota_tables(result))


@quota_app.command("ls")
def quota_ls(ctx: typer.Context, instance: InstanceOption = None, state_file: StateOption = None,
             inventory: InventoryOption = None) -> None:
    """Every quota with its live usage."""
    _quota(ctx, "list", instance, state_file, inventory)


@quota_app.command("get")
def quota_get(ctx: typer.Context, salt: SaltArgument, instance: InstanceOption = None,
              state_file: StateOption = None, inventory: InventoryOption = None) -> None:
    """One salt's quota and usage."""
    _quota(ctx, "get", instance, state_file, inventory, salt)


@quota_app.command("set")
def quota_set(ctx: typer.Context, salt: SaltArgument,
              limit_gb: Annotated[float, typer.Argument(help="The limit in GB (0 or more).", metavar="LIMIT_GB",
                                                        min=0)],
              yes: Yes = False, instance: InstanceOption = None, state_file: StateOption = None,
              inventory: InventoryOption = None) -> None:
    """Set a salt's quota: over-budget chunks go at the next eviction cycle (about a second).

    Lowering an existing quota asks first, or needs --yes (0 evicts all of the salt's chunks, as rm does).
    """
    def shrink(current: dict) -> None:
        change = f"the quota of {salt or '_default'} from {current['limit_gb']:g} GB to {limit_gb:g} GB"
        used = current.get("current_usage_gb") or 0
        confirm(f"lower {change} ({used:g} GB used; what is over the limit will be evicted)?",
                f"refusing to lower {change}", "add --yes: its chunks over the new limit are evicted", yes)

    _quota(ctx, "set", instance, state_file, inventory, salt, limit_gb, shrink)


@quota_app.command("rm")
def quota_rm(ctx: typer.Context, salt: SaltArgument, yes: Yes = False, instance: InstanceOption = None,
             state_file: StateOption = None, inventory: InventoryOption = None) -> None:
    """Remove a salt's quota (asks, or needs --yes).

    Its limit becomes 0, so its chunks go at the next eviction cycle.
    """
    confirm(f"remove the quota of {salt or '_default'} (its chunks will be evicted)?",
            f"refusing to remove the quota of {salt or '_default'}", "add --yes", yes)
    _quota(ctx, "rm", instance, state_file, inventory, salt)
