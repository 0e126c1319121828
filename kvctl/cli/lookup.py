"""`kvctl keys` and `kvctl lookup`: a prompt's chunk keys, and which tiers hold them."""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated

import typer

from kvctl.cli.fleet import emit_fleet, open_one, run_fleet
from kvctl.cli.options import (
    ConfigOption,
    HashSeed,
    KvDtype,
    ModelOption,
    TimeoutOption,
    VllmOption,
    WorldSize,
    prompt_flags,
    selector_flags,
)
from kvctl.core.errors import ExitCode, UsageError
from kvctl.output import Table, escape


@prompt_flags
def keys(
    ctx: typer.Context, prompt,
    model: ModelOption = None, config: ConfigOption = None, kv_dtype: KvDtype = None,
    world_size: WorldSize = 1, hash_seed: HashSeed = None, vllm_url: VllmOption = None,
) -> None:
    """Print the chunk keys LMCache makes for a prompt (per rank in tensor-parallel deployments)."""
    from kvctl.core.lmcache.deployment import target_from_config
    from kvctl.core.lmcache.keys import prompt_chunk_keys

    if config is None:
        raise UsageError("which deployment? kvctl needs its LMCache configuration",
                         hint="pass --config with a 'kvctl config init' directory or an lmcache.yaml")
    target = target_from_config(config, model, kv_dtype, world_size, hash_seed)
    recipe = target.recipe
    token_ids = prompt.token_ids(target.model_dir, vllm_url, recipe.model_name)
    chunks = prompt_chunk_keys(token_ids, recipe)
    rows = [(c["index"], f"{c['start']}-{c['end']}", "\n".join(c["keys"])) for c in chunks]
    ctx.obj.emit({"model": recipe.model_name, "mode": target.mode, "chunk_size": recipe.chunk_size,
                  "prompt_tokens": len(token_ids), "chunks": chunks},
                 [Table(["chunk", "tokens", "key"], rows, title=f"{len(chunks)} chunks of {len(token_ids)} tokens")])


@prompt_flags
@selector_flags("model", "config", "kv_dtype", "world_size", "hash_seed", "vllm_url", "instance", "state", "inventory")
def lookup(
    ctx: typer.Context, prompt, chosen,
    offline: Annotated[bool, typer.Option("--offline", help="Read the disk and Redis tiers directly, no server "
                                          "(needs --config).")] = False,
    timeout: TimeoutOption = 60.0,
) -> None:
    """Which chunks of a prompt are cached, on which tier, how many tokens vLLM would get, and why not.

    Side-effect free: never pins a chunk, never changes eviction order, never reads a value.
    """
    from kvctl.core.instance.controller_fleet import routing
    from kvctl.core.lmcache.controller import is_controller
    if offline and chosen.config is None:
        raise UsageError("--offline reads the tiers named in a configuration", hint="pass --config DIR")
    chosen, model = replace(chosen, instance=None) if offline else chosen, chosen.model
    out = ctx.obj

    tokenized: list[list[int]] = []  # the prompt's token ids, as the first instance to answer made them

    def lookup_one(found):
        tokens = found.tokenize(prompt, model)
        tokenized.append(tokens)
        result = found.lookup(tokens)
        for note in found.notes:
            out.info(f"note: {note}")
        return result

    if chosen.fleet:
        report = run_fleet(chosen, lookup_one, timeout)
        extra = {}
        if is_controller(chosen.instance):  # the routing question, and the controller's second opinion
            extra["routing"] = routing(chosen.instance, report.outcomes, tokenized[0] if tokenized else None)
            best = extra["routing"]["best"]
            out.info(f"longest cached prefix: {best['instance']} ({best['hit_tokens']} tokens)" if best else
                     "longest cached prefix: no instance holds any of it")
            for disagreement in extra["routing"]["disagreements"]:
                out.warn(disagreement)
        emit_fleet(out, report, _fleet_items, **extra)
    result = lookup_one(open_one(chosen))
    out.emit(result.as_dict(), render_lookup(result))
    for tier, message in result.errors.items():
        out.error(f"{tier} tier: {message}")
    if result.errors:
        raise typer.Exit(ExitCode.PARTIAL if result.tiers_checked else ExitCode.UNREACHABLE)


def _fleet_items(result, title: str) -> list:
    return [f"[bold]{escape(title)}[/]", *render_lookup(result)]


def render_lookup(result) -> list:
    marks = {tier: tier[0].upper() for tier in ("cpu", "disk", "redis")}
    rows = []
    for chunk in result.chunks:
        tiers = " ".join(marks[tier] if tier in chunk.tiers else "·" for tier in result.tiers_checked)
        rows.append((chunk.index, f"{chunk.start}-{chunk.end}", tiers or "-", chunk.key))
    hits = result.hit_tokens
    summary = (f"hit tokens: {hits['total']} of {result.prompt_tokens} "
               + "(" + ", ".join(f"{tier} {'-' if hits[tier] is None else hits[tier]}" for tier in marks)
               + "); tiers checked: "
               f"{', '.join(result.tiers_checked) or 'none'}")
    checked = " ".join(marks.get(t, t) for t in result.tiers_checked)  # or where the answer came from
    items: list = [Table(["chunk", "tokens", checked or "tiers", "key"], rows,
                         title=f"{result.model} ({result.mode}, chunk {result.chunk_size})", caption=summary)]
    for diagnostic in result.diagnostics:
        line = f"[yellow]{diagnostic.cause}[/]: {escape(diagnostic.message)}"
        if diagnostic.hint:
            line += f" [cyan](hint: {escape(diagnostic.hint)})[/]"
        items.append(line)
    return items
