"""`kvctl prewarm`: fill the cache with prompts, then prove it with a lookup per prompt."""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated

import typer

from kvctl.cli.fleet import open_one
from kvctl.cli.options import InstanceOption, PrefetchTier, selector_flags
from kvctl.core.errors import ExitCode
from kvctl.output import Table


@selector_flags("instance", "vllm_url", "state", instance=InstanceOption)
def prewarm(
    ctx: typer.Context, chosen,
    prompts: Annotated[list[str], typer.Argument(help="Prompt files, directories of them, or JSONL files "
                                                 "({\"prompt\": …} or {\"messages\": […]} per line).")],
    chat: Annotated[bool, typer.Option("--chat", help="Files are JSON lists of chat messages.")] = False,
    concurrency: Annotated[int, typer.Option(help="Requests in flight at once.")] = 4,
    from_tier: Annotated[PrefetchTier | None, typer.Option("--from-tier", help="Instead of prefilling, copy chunks "
                                                           "already stored on this tier into the CPU tier.")] = None,
) -> None:
    """Send prompts to vLLM as prefill-only requests (max_tokens 1), then report what is cached, per prompt."""
    from kvctl.core.cache.prewarm import load_prompts
    from kvctl.core.cache.prewarm import prewarm as run_prewarm

    items = load_prompts(prompts, chat)
    found = open_one(replace(chosen, kv_dtype="bfloat16"))
    out = ctx.obj
    with out.progress(len(items), "prefilling" if from_tier is None else "prefetching") as advance:
        result = run_prewarm(found, items, concurrency, from_tier is not None,
                             lambda outcome: advance(outcome.prompt_tokens))
    rows = [(entry["name"], entry["prompt_tokens"], f"{entry.get('cached_chunks', 0)}/{entry.get('chunks', 0)}",
             " ".join(entry.get("tiers", [])), entry["error"] or "ok") for entry in result.prompts]
    total, failed = len(result.prompts), result.failed
    out.emit(result.as_dict(), [Table(["prompt", "tokens", "cached chunks", "tiers", "status"], rows,
                                      caption=f"{total - failed} of {total} prompts, {result.tokens} tokens in "
                                      f"{result.seconds:.1f} s")])
    for tier, message in result.tier_errors.items():
        out.error(f"{tier} tier: {message} (what it holds is not in the report)")
    if failed:
        out.error(f"{failed} of {total} prompts failed", hint="see the status column (or 'error' in JSON)")
        raise typer.Exit(ExitCode.PARTIAL if failed < total else ExitCode.ERROR)
    if result.tier_errors:
        raise typer.Exit(ExitCode.PARTIAL)
