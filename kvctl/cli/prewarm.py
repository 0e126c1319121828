"""`kvctl prewarm`: fill the cache with prompts, then prove it with a lookup per prompt."""

from __future__ import annotations

from typing import Annotated

import typer

from kvctl.cli.fleet import open_one, selector
from kvctl.cli.options import PrefetchTier, StateOption
from kvctl.core.errors import ExitCode, UsageError
from kvctl.output import Table


def prewarm(
    ctx: typer.Context,
    prompts: Annotated[list[str], typer.Argument(help="Prompt files, directories of them, or JSONL files "
                                                 "({\"prompt\": …} or {\"messages\": […]} per line).")],
    chat: Annotated[bool, typer.Option("--chat", help="Files are JSON lists of chat messages.")] = False,
    concurrency: Annotated[int, typer.Option(help="Requests in flight at once.")] = 4,
    from_tier: Annotated[PrefetchTier | None, typer.Option("--from-tier", help="Instead of prefilling, copy chunks "
                                                           "already stored on this tier into the CPU tier.")] = None,
    instance: Annotated[str | None, typer.Option("--instance", help="A 'kvctl serve --name' or inventory name, or a "
                                                 "URL (worker 0's internal API, or the lmcache server's HTTP "
                                                 "API).")] = None,
    vllm_url: Annotated[str | None, typer.Option("--vllm-url", help="vLLM's OpenAI server URL.")] = None,
    state: StateOption = None,
) -> None:
    """Send prompts to vLLM as prefill-only requests (max_tokens 1), then report what is cached, per prompt."""
    from kvctl.clients.vllm import VLLMClient
    from kvctl.core.prewarm import cached_now, load_prompts, prefetch, prefill

    items = load_prompts(prompts, chat)
    found = open_one(selector(instance, state, vllm_url=vllm_url, kv_dtype="bfloat16"))
    vllm_url = found.address.vllm
    if not vllm_url:
        raise UsageError("which vLLM?", hint="pass --vllm-url, or start one with kvctl serve")
    out = ctx.obj
    with VLLMClient(vllm_url) as vllm:
        model = vllm.models()[0]
        with out.progress(len(items), "prefilling" if from_tier is None else "prefetching") as advance:
            if from_tier is None:
                outcomes, elapsed = prefill(vllm_url, model, items, concurrency,
                                            lambda outcome: advance(outcome.prompt_tokens))
            else:
                outcomes, elapsed = prefetch(found, vllm, model, items, lambda outcome: advance(outcome.prompt_tokens))
        for outcome in outcomes:
            if outcome.error is None and not outcome.token_ids:
                outcome.token_ids = vllm.tokenize(model, **outcome.prompt.request())
    rows, report = [], []
    for outcome in outcomes:
        cached = cached_now(found, outcome.token_ids, model) if outcome.error is None else None
        entry = {"name": outcome.prompt.name, "prompt_tokens": outcome.prompt_tokens or len(outcome.token_ids),
                 "seconds": round(outcome.seconds, 3), "error": outcome.error, **(cached or {})}
        report.append(entry)
        rows.append((entry["name"], entry["prompt_tokens"],
                     f"{entry.get('cached_chunks', 0)}/{entry.get('chunks', 0)}", " ".join(entry.get("tiers", [])),
                     outcome.error or "ok"))
    tokens = sum(entry["prompt_tokens"] for entry in report if entry["error"] is None)
    failed = sum(1 for entry in report if entry["error"])
    unknown = {tier: message for entry in report for tier, message in entry.get("tier_errors", {}).items()}
    out.emit({"prompts": report, "tokens": tokens, "seconds": round(elapsed, 3),
              "tokens_per_s": round(tokens / elapsed, 1) if elapsed else None, "failed": failed},
             [Table(["prompt", "tokens", "cached chunks", "tiers", "status"], rows,
                    caption=f"{len(report) - failed} of {len(report)} prompts, {tokens} tokens in {elapsed:.1f} s")])
    for tier, message in unknown.items():
        out.error(f"{tier} tier: {message} (what it holds is not in the report)")
    if failed:
        out.error(f"{failed} of {len(report)} prompts failed", hint="see the status column (or 'error' in JSON)")
        raise typer.Exit(ExitCode.PARTIAL if failed < len(report) else ExitCode.ERROR)
    if unknown:
        raise typer.Exit(ExitCode.PARTIAL)
