"""`kvctl reconfigure` (an MP server's Device-DAX devices at runtime) and `kvctl checksums` (MD5 of a
registered worker's KV blocks). Each parses, calls kvctl.core.admin.mp_admin, renders; the server's
refusals are exit 4 with its reason."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer

from kvctl.cli.fleet import open_one, selector
from kvctl.cli.manage_backends import Yes, confirm
from kvctl.cli.options import InstanceOption, InventoryOption, StateOption
from kvctl.core.common.display import format_bytes
from kvctl.output import Table


class Mode(str, Enum):
    migrate = "migrate"
    evict = "evict"
    drain = "drain"


class DaxTier(str, Enum):
    l2 = "l2"
    l1 = "l1"


app = typer.Typer(help="An MP server's storage at runtime: add, remove and resize Device-DAX devices (L2 adapter, "
                  "L1 arenas).", no_args_is_help=True)
DeviceOption = Annotated[str, typer.Option("--device", help="The DAX device or mmap-able file, as the server sees it.",
                                           metavar="PATH")]
SizeOption = Annotated[str | None, typer.Option("--size", help="Bytes to map: 4GiB, 512MiB, 1048576.")]
ModeOption = Annotated[Mode | None, typer.Option("--mode", help="remove: migrate (L2 default: move chunks to other "
                                                 "devices), evict, drain (stop new writes; L1's only mode); resize: "
                                                 "migrate or evict.")]
ForceOption = Annotated[bool, typer.Option("--force", help="L2: move or evict locked chunks too.")]
AdapterOption = Annotated[int | None, typer.Option("--adapter", min=0, help="Which DAX L2 adapter (default 0).")]
TierOption = Annotated[DaxTier, typer.Option("--tier", help="l2 (a DAX L2 adapter's devices) or l1 (Device-DAX L1 "
                                             "arenas).")]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Show the request and the current status; change nothing.")]


def _status_tables(status, title: str = "devices") -> list:
    adapters = Table(["index", "type", "tier", "primary", "reconfigurable"],
                     [(a.get("index"), a.get("type_name"), a.get("tier"), "yes" if a.get("primary") else "",
                       "yes" if a.get("reconfigurable") else "") for a in status.adapters], title="storage adapters")
    caption = None if status.l1.get("dax") else f"L1: {status.l1.get('reason', 'not Device-DAX backed')}"
    devices = Table(["tier", "adapter", "device", "capacity", "used", "state"],
                    [(d["tier"], d["adapter"], d["device"], format_bytes(d["capacity_bytes"]),
                      format_bytes(d["used_bytes"]), d["state"]) for d in status.devices()],
                    title=title, caption=caption)
    return [adapters, devices]


def _change_tables(change) -> list:
    import json

    done = "would send" if change.dry_run else "sent"
    lines = [f"{done}: POST {change.path} {json.dumps(change.body)}"]
    if change.answer is not None:
        lines.append(f"server: {change.answer.get('status', 'ok')}")
    return [*lines, *_status_tables(change.status, "devices (now)" if change.dry_run else "devices (after)")]


@app.command("status")
def status(ctx: typer.Context, instance: InstanceOption = None, state_file: StateOption = None,
           inventory: InventoryOption = None) -> None:
    """The server's storage adapters and every Device-DAX device: capacity, used, state."""
    from kvctl.core.admin import mp_admin

    result = mp_admin.status(open_one(selector(instance, state_file, inventory)))
    ctx.obj.emit(result.as_dict(), _status_tables(result))


def _change(ctx: typer.Context, action: str, device: str, size: str | None, mode: Mode | None, force: bool,
            adapter: int | None, tier: DaxTier, dry_run: bool, yes: bool, instance, state_file, inventory) -> None:
    from kvctl.core.admin import mp_admin

    found = open_one(selector(instance, state_file, inventory))
    change = mp_admin.plan(found, action, tier.value, device, mp_admin.parse_size(size) if size else None,
                           mode.value if mode else None, force, adapter)
    if not dry_run:
        if change.risk:
            confirm(f"{action} {device}? it {change.risk}", f"refusing to {action} {device}",
                    "add --yes, or --dry-run to see the request and the devices", yes)
        change = mp_admin.apply(found, change)
    ctx.obj.emit(change.as_dict(), _change_tables(change))


@app.command("add")
def add(ctx: typer.Context, device: DeviceOption, size: SizeOption = None, adapter: AdapterOption = None,
        tier: TierOption = DaxTier.l2, dry_run: DryRun = False, instance: InstanceOption = None,
        state_file: StateOption = None, inventory: InventoryOption = None) -> None:
    """Map one more device (needs --size): an L2 adapter started with hotplug_enabled, or an L1 arena."""
    _change(ctx, "add", device, size, None, False, adapter, tier, dry_run, True, instance, state_file, inventory)


@app.command("remove")
def remove(ctx: typer.Context, device: DeviceOption, mode: ModeOption = None, force: ForceOption = False,
           adapter: AdapterOption = None, tier: TierOption = DaxTier.l2, dry_run: DryRun = False, yes: Yes = False,
           instance: InstanceOption = None, state_file: StateOption = None,
           inventory: InventoryOption = None) -> None:
    """Unmap a device; asks, or needs --yes, unless --mode drain.

    migrate (L2's default) moves its chunks to the adapter's other devices, evict deletes them, drain
    only stops new writes (L1 arenas take drain only).
    """
    _change(ctx, "remove", device, None, mode, force, adapter, tier, dry_run, yes, instance, state_file, inventory)


@app.command("resize")
def resize(ctx: typer.Context, device: DeviceOption, size: SizeOption = None, mode: ModeOption = None,
           force: ForceOption = False, adapter: AdapterOption = None, dry_run: DryRun = False, yes: Yes = False,
           instance: InstanceOption = None, state_file: StateOption = None,
           inventory: InventoryOption = None) -> None:
    """Map an L2 device with a new --size; a shrink asks, or needs --yes.

    A shrink migrates (default) or evicts the chunks past the new end; a file must be at least as
    large as the new size.
    """
    _change(ctx, "resize", device, size, mode, force, adapter, DaxTier.l2, dry_run, yes, instance, state_file,
            inventory)


def checksums(ctx: typer.Context,
              blocks: Annotated[str, typer.Option("--blocks", help="Block ids and inclusive ranges: 0-15,32,40-47.")],
              chunk_size: Annotated[int | None, typer.Option("--chunk-size", min=1, help="Blocks per chunk (default: "
                                                             "the server's chunk size in the worker's blocks).")]
              = None,
              worker: Annotated[int, typer.Option("--worker", min=0, help="The worker's instance_id, as it "
                                                  "registered its KV cache.")] = 0,
              layerwise: Annotated[bool, typer.Option("--layerwise", help="One MD5 per layer and chunk.")] = False,
              instance: InstanceOption = None, state_file: StateOption = None,
              inventory: InventoryOption = None) -> None:
    """MD5 per chunk of the KV cache blocks a worker registered with an MP server holds.

    Compare two workers, or a block range before a store and after a retrieve: equal digests are
    equal bytes. The worker must have registered its KV cache (exit 4 otherwise).
    """
    from kvctl.core.admin import mp_admin

    ids = mp_admin.parse_blocks(blocks)
    result = mp_admin.checksums(open_one(selector(instance, state_file, inventory)), ids, chunk_size, worker,
                                layerwise)
    caption = f"worker {result.worker}, {result.chunk_size} blocks per chunk"
    if layerwise:
        rows = [(c["index"], c["blocks"], layer, md5) for c in result.chunks for layer, md5 in c["layers"].items()]
        table = Table(["chunk", "blocks", "layer", "md5"], rows, title="KV block checksums", caption=caption)
    else:
        table = Table(["chunk", "blocks", "md5"], [(c["index"], c["blocks"], c["md5"]) for c in result.chunks],
                      title="KV block checksums", caption=caption)
    ctx.obj.emit(result.as_dict(), [table])
