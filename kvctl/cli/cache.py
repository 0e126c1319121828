"""`kvctl pin`, `unpin`, `pins`, `evict`: cache operations on a running in-process instance, through
kvctl's /kvctl/v1 routes."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Annotated

import typer

from kvctl.cli.lookup import (
    ChatFile,
    ConfigOption,
    ModelOption,
    PromptFile,
    TokensFile,
    VllmOption,
    instance_target,
    load_tokens,
)
from kvctl.cli.observe import FleetInstance, InventoryOption, report_errors
from kvctl.cli.options import Tier
from kvctl.core.errors import ExitCode, UsageError
from kvctl.output import Table

InstanceOption = Annotated[str | None, typer.Option("--instance", help="A 'kvctl serve --name' name, or the internal "
                                                    "API URL of worker 0.")]
StateOption = Annotated[Path | None, typer.Option("--state", help="The state file of a 'kvctl serve' (default: the "
                                                  "most recent one).")]
TierOption = Annotated[list[Tier] | None, typer.Option("--tier", help="cpu, disk, redis or all (repeatable).")]
DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhd]?)$")
UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    match = DURATION.match(text.strip())
    if not match or float(match.group(1)) <= 0:
        raise UsageError(f"bad duration {text!r}", hint="write it as 600, 30s, 10m, 2h or 1d")
    return float(match.group(1)) * UNITS[match.group(2)]


def _worker(instance: str | None, state: Path | None, vllm_url: str | None = None):
    """(client of worker 0's routes, vLLM URL for tokenizing) of an in-process instance."""
    from kvctl.clients.internal_api import InternalAPIClient

    url, _config, vllm_url = instance_target(instance, state, vllm_url)
    if url is None:
        raise UsageError("pins and evictions by prompt need an in-process instance with kvctl's routes",
                         hint="MP mode: pin through LMCache's coordinator (/cache/pins); this is not supported here yet")
    return InternalAPIClient(url), vllm_url


def _tokens(worker, prompt_file, chat, tokens_file, model, vllm_url):
    info = worker.info()
    model_dir = model or (info["model"] if Path(info["model"]).is_dir() else None)
    return load_tokens(prompt_file, chat, tokens_file, model_dir, vllm_url, info["model"])


def tier_names(tiers: list[Tier] | None) -> list[str] | None:
    return [tier.value for tier in tiers] if tiers else None


def ls(
    ctx: typer.Context,
    tier: TierOption = None,
    model: Annotated[str | None, typer.Option("--model", help="Only chunks of this model (the value of vLLM's "
                                              "--model).")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, help="At most this many chunks listed per tier (totals "
                                       "count them all).")] = 100,
    config: ConfigOption = None, instance: FleetInstance = None, state: StateOption = None,
    inventory: InventoryOption = None,
) -> None:
    """List cached chunks per tier: key, size, pin state, age where known; totals per tier.

    A running in-process instance answers for its CPU and disk tiers (pins included); Redis, and the
    disk directory of a --config with no instance, are read directly. With --instance all, every
    instance of the inventory is listed ({"instances": [...]} in JSON).
    """
    from kvctl.core import instances as fleet
    from kvctl.core import listing

    selected = tier_names(tier)
    out = ctx.obj
    if config is not None:
        from kvctl.core.target import read_deployment

        render_listing(out, listing.list_stores(read_deployment(config).stores, selected, limit, model))
        return
    targets = fleet.resolve(instance, state, inventory)
    if instance != "all":
        render_listing(out, listing.list_instance(targets[0], selected, limit, model))
        return
    outcomes = fleet.fan_out(targets, lambda target: listing.list_instance(target, selected, limit, model))
    reports, items = [], []
    for outcome in outcomes:
        found = outcome.result
        if found:
            reports.append({"instance": outcome.instance, **found.as_dict()})
            items.extend(_listing_tables(found, title=outcome.instance))
        else:
            reports.append({"instance": outcome.instance, "tiers": [], "errors": {"instance": outcome.error},
                            "hint": outcome.hint})
    out.emit({"instances": reports}, items)
    report_errors(out, reports)
    code = fleet.fleet_exit_code(outcomes)
    raise typer.Exit(ExitCode.PARTIAL if code == ExitCode.OK and any(r["errors"] for r in reports) else code)


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
    for tier, message in result.errors.items():
        out.error(f"{tier} tier: {message}")
    if result.errors:
        raise typer.Exit(ExitCode.PARTIAL if result.tiers else result.failure_code)


def pin(
    ctx: typer.Context,
    prompt_file: PromptFile = None, chat: ChatFile = None, tokens_file: TokensFile = None,
    model: ModelOption = None, vllm_url: VllmOption = None,
    ttl: Annotated[str | None, typer.Option("--ttl", help="How long: 600, 30s, 10m, 2h, 1d (default: until "
                                            "unpinned).")] = None,
    tier: TierOption = None, instance: InstanceOption = None, state: StateOption = None,
) -> None:
    """Pin a prompt's chunks on the CPU and disk tiers: eviction skips them until unpinned or the TTL ends."""
    ttl_s = parse_duration(ttl) if ttl else None
    worker, vllm_url = _worker(instance, state, vllm_url)
    with worker:
        token_ids = _tokens(worker, prompt_file, chat, tokens_file, model, vllm_url)
        result = worker.pin(token_ids, ttl_s, tier_names(tier))
    ctx.obj.emit(result, [Table(["pin id", "chunks", "tokens", "pinned", "expires in"],
                                [(result["pin_id"], result["chunks"], result["tokens"],
                                  " ".join(f"{t}:{n}" for t, n in result["pinned"].items()),
                                  "never" if result["ttl_remaining_s"] is None else f"{result['ttl_remaining_s']} s")])])
    if not result["pinned"]:
        ctx.obj.warn("no chunk of this prompt is cached: nothing was pinned (prewarm it first)")


def unpin(
    ctx: typer.Context,
    pin_id: Annotated[str | None, typer.Option("--pin-id", help="The pin to release.")] = None,
    prompt_file: PromptFile = None, chat: ChatFile = None, tokens_file: TokensFile = None,
    model: ModelOption = None, vllm_url: VllmOption = None,
    everything: Annotated[bool, typer.Option("--all", help="Release every kvctl pin.")] = False,
    instance: InstanceOption = None, state: StateOption = None,
) -> None:
    """Release kvctl pins: one by id, every pin holding a prompt's chunks, or all."""
    chosen = sum(bool(x) for x in (pin_id, prompt_file or chat or tokens_file, everything))
    if chosen != 1:
        raise UsageError("give exactly one of --pin-id, a prompt (--prompt-file/--chat/--tokens-file), --all",
                         hint="kvctl pins lists the pin ids")
    worker, vllm_url = _worker(instance, state, vllm_url)
    with worker:
        if pin_id or everything:
            result = worker.unpin(pin_id=pin_id, everything=everything)
        else:
            token_ids = _tokens(worker, prompt_file, chat, tokens_file, model, vllm_url)
            result = worker.unpin(tokens=token_ids)
    rows = [(entry["pin_id"], entry["chunks"], entry["tokens"]) for entry in result["unpinned"]]
    ctx.obj.emit(result, [Table(["pin id", "chunks", "tokens"], rows, title="unpinned")])


def pins(ctx: typer.Context, instance: InstanceOption = None, state: StateOption = None) -> None:
    """List kvctl's pins on the instance."""
    worker, _vllm_url = _worker(instance, state)
    with worker:
        listed = worker.pins()
    rows = [(p["pin_id"], p["chunks"], p["tokens"], " ".join(f"{t}:{n}" for t, n in p["pinned"].items()),
             "never" if p["ttl_remaining_s"] is None else f"{p['ttl_remaining_s']} s") for p in listed]
    ctx.obj.emit({"pins": listed}, [Table(["pin id", "chunks", "tokens", "pinned", "expires in"], rows)])


def evict(
    ctx: typer.Context,
    prompt_file: PromptFile = None, chat: ChatFile = None, tokens_file: TokensFile = None,
    key: Annotated[list[str] | None, typer.Option("--key", help="A chunk key (repeatable).")] = None,
    tier: TierOption = None,
    everything: Annotated[bool, typer.Option("--all", help="Every chunk of the selected tiers (in Redis: those of this instance's model).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List exactly what would be removed; remove "
                                          "nothing.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask (required when not on a terminal).")] = False,
    force: Annotated[bool, typer.Option("--force", help="Remove kvctl-pinned chunks too.")] = False,
    model: ModelOption = None, vllm_url: VllmOption = None, instance: InstanceOption = None, state: StateOption = None,
) -> None:
    """Remove chunks from the CPU, disk and Redis tiers: a prompt's, given keys, or a whole tier."""
    prompt_given = bool(prompt_file or chat or tokens_file)
    if sum((prompt_given, bool(key), everything)) != 1 and not (tier and not prompt_given and not key):
        raise UsageError("say what to evict: a prompt, --key, or --tier T / --all",
                         hint="add --dry-run to see what would go first")
    from kvctl.core.listing import evict_from_instance

    out = ctx.obj
    worker, vllm_url = _worker(instance, state, vllm_url)
    with worker:
        selection = {"tiers": tier_names(tier), "force": force, "everything": not (prompt_given or key)}
        if prompt_given:
            selection["tokens"] = _tokens(worker, prompt_file, chat, tokens_file, model, vllm_url)
        elif key:
            selection["keys"] = key
        planned = evict_from_instance(worker, dry_run=True, **selection)
        total = sum(planned["removed"].values())
        if dry_run or total == 0:
            result = planned
        else:
            if not yes:
                if not sys.stdin.isatty():
                    raise UsageError(f"refusing to evict {total} chunks without --yes (not on a terminal)",
                                     hint="add --yes, or --dry-run to list them")
                counts = ", ".join(f"{tier_}: {n}" for tier_, n in planned["removed"].items())
                if not typer.confirm(f"evict {total} chunks ({counts})?", err=True):
                    raise typer.Exit(ExitCode.ERROR)
            result = evict_from_instance(worker, dry_run=False, **selection)
    rows = [(t, n, result["skipped_pinned"].get(t, 0)) for t, n in result["removed"].items()]
    title = "would evict (dry run)" if result["dry_run"] else "evicted"
    out.emit(result, [Table(["tier", "chunks", "kept (pinned)"], rows, title=title)])
