"""`kvctl prewarm`: fill the cache with prompts, then prove it with a lookup per prompt."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from kvctl.cli.lookup import instance_target
from kvctl.cli.options import PrefetchTier
from kvctl.core.errors import ExitCode, KvctlError, UsageError
from kvctl.core.lookup import read_tiers
from kvctl.output import Table


def prewarm(
    ctx: typer.Context,
    prompts: Annotated[list[str], typer.Argument(help="Prompt files, directories of them, or JSONL files "
                                                 "({\"prompt\": …} or {\"messages\": […]} per line).")],
    chat: Annotated[bool, typer.Option("--chat", help="Files are JSON lists of chat messages.")] = False,
    concurrency: Annotated[int, typer.Option(help="Requests in flight at once.")] = 4,
    from_tier: Annotated[PrefetchTier | None, typer.Option("--from-tier", help="Instead of prefilling, copy chunks "
                                                           "already stored on this tier into the CPU tier.")] = None,
    instance: Annotated[str | None, typer.Option("--instance", help="A 'kvctl serve --name' name, or the internal "
                                                 "API URL of worker 0 (in-process mode).")] = None,
    vllm_url: Annotated[str | None, typer.Option("--vllm-url", help="vLLM's OpenAI server URL.")] = None,
    state: Annotated[Path | None, typer.Option("--state", help="The state file of a 'kvctl serve' (default: the "
                                               "most recent one).")] = None,
) -> None:
    """Send prompts to vLLM as prefill-only requests (max_tokens 1), then report what is cached, per prompt."""
    from kvctl.clients.vllm import VLLMClient
    from kvctl.core.prewarm import load_prompts

    items = load_prompts(prompts, chat)
    instance, config, vllm_url = instance_target(instance, state, vllm_url)
    if not vllm_url:
        raise UsageError("which vLLM?", hint="pass --vllm-url, or start one with kvctl serve")
    out = ctx.obj
    with VLLMClient(vllm_url) as vllm:
        model = vllm.models()[0]
        if from_tier is None:
            outcomes, elapsed = _prefill(out, vllm_url, model, items, concurrency)
        else:
            outcomes, elapsed = _prefetch(out, vllm, model, items, instance, config)
        for outcome in outcomes:
            if outcome.error is None and not outcome.token_ids:
                kwargs = {"messages": outcome.prompt.messages} if outcome.prompt.messages is not None else {
                    "prompt": outcome.prompt.text}
                outcome.token_ids = vllm.tokenize(model, **kwargs)
    rows, report = [], []
    for outcome in outcomes:
        cached = _settled(outcome.token_ids, instance, config, model) if outcome.error is None else None
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


def _prefill(out, vllm_url, model, items, concurrency):
    from kvctl.core.prewarm import prefill

    with out.progress(len(items), "prefilling") as advance:
        return prefill(vllm_url, model, items, concurrency, lambda outcome: advance(outcome.prompt_tokens))


def _prefetch(out, vllm, model, items, instance, config):
    """Copy already-stored chunks into the CPU tier: kvctl's prefetch route (in-process)."""
    from kvctl.clients.internal_api import InternalAPIClient
    from kvctl.core.prewarm import Outcome

    if instance is None or config is not None:
        raise UsageError("--from-tier needs an in-process instance with kvctl's routes",
                         hint="MP mode prefetches on its own when vLLM looks a prompt up; use plain prewarm there")
    outcomes = []
    start = time.perf_counter()
    with InternalAPIClient(instance) as worker, out.progress(len(items), "prefetching") as advance:
        for item in items:
            began = time.perf_counter()
            kwargs = {"messages": item.messages} if item.messages is not None else {"prompt": item.text}
            outcome = Outcome(item, token_ids=vllm.tokenize(model, **kwargs))
            outcome.prompt_tokens = len(outcome.token_ids)
            try:
                worker.prefetch(outcome.token_ids)
            except KvctlError as error:
                outcome.error = error.message
            outcome.seconds = time.perf_counter() - began
            outcomes.append(outcome)
            advance(outcome.prompt_tokens)
    return outcomes, time.perf_counter() - start


SETTLE_S = 10.0


def _settled(token_ids, instance, config, model):
    """What is cached once the server's asynchronous writes have landed: MP servers write L2 after
    answering, so an offline lookup is repeated (up to SETTLE_S) until every chunk is on every tier."""
    deadline = time.monotonic() + (0 if instance and config is None else SETTLE_S)
    while True:
        cached, everywhere = _cached(token_ids, instance, config, model)
        if everywhere or time.monotonic() >= deadline:
            return cached
        time.sleep(0.5)


def _cached(token_ids, instance, config, model):
    """Chunks of the prompt now cached and where, from the same lookup `kvctl lookup` does; and whether
    every chunk is on every tier looked at."""
    if instance and config is None:
        from kvctl.clients.internal_api import InternalAPIClient
        from kvctl.core.lookup import engine_lookup

        with InternalAPIClient(instance) as worker:
            info = worker.info()
        result = engine_lookup(instance, info, token_ids)
    else:
        from kvctl.core.target import target_from_config

        result = read_tiers(token_ids, target_from_config(config, model, "bfloat16"), instance)
    tiers = sorted({tier for chunk in result.chunks for tier in chunk.tiers}, key=("cpu", "disk", "redis").index)
    everywhere = all(set(chunk.tiers) == set(result.tiers_checked) for chunk in result.chunks)
    return {"chunks": len(result.chunks), "cached_chunks": sum(1 for chunk in result.chunks if chunk.tiers),
            "hit_tokens": result.hit_tokens["total"], "tiers": tiers, "tier_errors": result.errors}, everywhere
