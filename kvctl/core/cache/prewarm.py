"""Prompts to prewarm: files, directories and JSONL, and sending them to vLLM as prefill-only requests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvctl.core.errors import KvctlError, UsageError
from kvctl.core.lmcache.tokens import read_chat, read_text


@dataclass
class Prompt:
    name: str
    text: str | None = None
    messages: list[dict[str, Any]] | None = None

    def request(self) -> dict[str, Any]:
        """The prompt as vLLM's tokenize and completion endpoints take it."""
        return {"messages": self.messages} if self.messages is not None else {"prompt": self.text}


@dataclass
class Outcome:
    prompt: Prompt
    prompt_tokens: int = 0
    seconds: float = 0.0
    error: str | None = None
    token_ids: list[int] = field(default_factory=list)


def load_prompts(paths: list[str], chat: bool) -> list[Prompt]:
    """Prompts from files (text, or JSON messages with --chat), directories (their files, sorted) and JSONL
    (`{"prompt": …}` or `{"messages": […]}` per line)."""
    prompts: list[Prompt] = []
    for given in paths:
        path = Path(given)
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
            if not files:
                raise KvctlError(f"{path} holds no files",
                                 hint="give prompt files, a directory of them, or a JSONL file")
            for file in files:
                prompts += _from_path(file, chat)
        else:
            prompts += _from_path(path, chat)
    if not prompts:
        raise UsageError("no prompts given", hint="kvctl prewarm PROMPT_FILE… (files, directories or JSONL)")
    return prompts


def _from_path(path: Path, chat: bool) -> list[Prompt]:
    if path.suffix == ".jsonl":
        return _from_jsonl(path)
    if chat:
        return [Prompt(str(path), messages=read_chat(str(path)))]
    return [Prompt(str(path), text=read_text(str(path)))]


def _from_jsonl(path: Path) -> list[Prompt]:
    prompts = []
    for number, line in enumerate(read_text(str(path)).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than Python parses
            raise KvctlError(f"{path}:{number} is not valid JSON",
                             hint='each line is {"prompt": …} or {"messages": […]}') from None
        name = f"{path}:{number}"
        if isinstance(entry, dict) and isinstance(entry.get("prompt"), str):
            prompts.append(Prompt(name, text=entry["prompt"]))
        elif isinstance(entry, dict) and isinstance(entry.get("messages"), list):
            prompts.append(Prompt(name, messages=entry["messages"]))
        else:
            raise KvctlError(f"{path}:{number} has neither a prompt nor messages",
                             hint='each line is {"prompt": …} or {"messages": […]}')
    return prompts


async def _send(client, url: str, model: str, prompt: Prompt) -> Outcome:
    outcome = Outcome(prompt)
    body: dict[str, Any] = {"model": model, "max_tokens": 1, "temperature": 0}
    if prompt.messages is not None:
        body["messages"], path = prompt.messages, "/v1/chat/completions"
    else:
        body["prompt"], path = prompt.text, "/v1/completions"
    start = time.perf_counter()
    try:
        response = await client.post(f"{url}{path}", json=body)
        if response.status_code != 200:
            message = response.text[:200]
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            outcome.error = f"HTTP {response.status_code}: {message}"
        else:
            outcome.prompt_tokens = response.json()["usage"]["prompt_tokens"]
    except Exception as error:  # noqa: BLE001 - every failure is reported per prompt
        outcome.error = f"{type(error).__name__}: {error}"
    outcome.seconds = time.perf_counter() - start
    return outcome


async def _prefill_all(url: str, model: str, prompts: list[Prompt], concurrency: int,
                       on_done: Callable[[Outcome], None]) -> tuple[list[Outcome], float]:
    import httpx

    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
        # httpx loads its transport (82 modules, ~28 ms) on the first request: made here, before the clock,
        # a prompt's time is the server's (an error here shows again on every prompt)
        with contextlib.suppress(httpx.HTTPError):
            await client.get(f"{url}/v1/models")

        async def one(prompt: Prompt) -> Outcome:
            async with limit:
                outcome = await _send(client, url, model, prompt)
            on_done(outcome)
            return outcome

        start = time.perf_counter()
        outcomes = list(await asyncio.gather(*(one(prompt) for prompt in prompts)))
        return outcomes, time.perf_counter() - start


def prefill(url: str, model: str, prompts: list[Prompt], concurrency: int,
            on_done: Callable[[Outcome], None] = lambda outcome: None) -> tuple[list[Outcome], float]:
    """Send every prompt as a prefill-only request (max_tokens 1), at most `concurrency` at a time;
    returns the outcomes and the seconds the requests took."""
    if concurrency < 1:
        raise UsageError("--concurrency must be at least 1", hint="e.g. --concurrency 4")
    return asyncio.run(_prefill_all(url, model, prompts, concurrency, on_done))


def prefetch(instance, vllm, model: str, prompts: list[Prompt],
             on_done: Callable[[Outcome], None] | None = None) -> tuple[list[Outcome], float]:
    """Copy chunks already stored on a lower tier into the CPU tier, prompt by prompt (tokenized by vLLM)."""
    from kvctl.core.instance.protocol import Unsupported

    outcomes = []
    start = time.perf_counter()
    for prompt in prompts:
        began = time.perf_counter()
        outcome = Outcome(prompt, token_ids=vllm.tokenize(model, **prompt.request()))
        outcome.prompt_tokens = len(outcome.token_ids)
        try:
            instance.prefetch(outcome.token_ids)
        except Unsupported:
            raise  # the instance cannot prefetch at all: one usage error, not one per prompt
        except KvctlError as error:
            outcome.error = error.message
        outcome.seconds = time.perf_counter() - began
        outcomes.append(outcome)
        if on_done:
            on_done(outcome)
    return outcomes, time.perf_counter() - start


def cached_now(instance, token_ids: list[int], model: str) -> dict[str, Any]:
    """What of a prompt is cached and where, from the same lookup `kvctl lookup` does, once the
    instance's asynchronous writes have landed: repeated (up to its `settle_s`) until every chunk is
    on every tier looked at."""
    deadline = time.monotonic() + instance.settle_s
    while True:
        result = instance.lookup(token_ids, model)
        everywhere = all(set(chunk.tiers) == set(result.tiers_checked) for chunk in result.chunks)
        if everywhere or time.monotonic() >= deadline:
            tiers = sorted({tier for chunk in result.chunks for tier in chunk.tiers},
                           key=("cpu", "disk", "redis").index)
            return {"chunks": len(result.chunks), "cached_chunks": sum(1 for chunk in result.chunks if chunk.tiers),
                    "hit_tokens": result.hit_tokens["total"], "tiers": tiers, "tier_errors": result.errors}
        time.sleep(0.5)


@dataclass
class PrewarmReport:
    """Per prompt: its tokens, time, error, and what of it is cached where afterwards."""

    prompts: list[dict[str, Any]]
    seconds: float

    @property
    def tokens(self) -> int:
        return sum(entry["prompt_tokens"] for entry in self.prompts if entry["error"] is None)

    @property
    def failed(self) -> int:
        return sum(1 for entry in self.prompts if entry["error"])

    @property
    def tier_errors(self) -> dict[str, str]:
        """Tiers that could not say what they hold (the report is silent about them)."""
        return {tier: message for entry in self.prompts for tier, message in entry.get("tier_errors", {}).items()}

    def as_dict(self) -> dict[str, Any]:
        return {"prompts": self.prompts, "tokens": self.tokens, "seconds": round(self.seconds, 3),
                "tokens_per_s": round(self.tokens / self.seconds, 1) if self.seconds else None, "failed": self.failed}


def prewarm(instance, prompts: list[Prompt], concurrency: int, from_lower_tier: bool,
            on_done: Callable[[Outcome], None] = lambda outcome: None) -> PrewarmReport:
    """Prefill the prompts through the instance's vLLM (or, `from_lower_tier`, prefetch what a lower
    tier holds into the CPU tier), then look each one up as `kvctl lookup` would."""
    from kvctl.clients.vllm import VLLMClient

    url = instance.vllm_url
    if not url:
        raise UsageError("which vLLM?", hint="pass --vllm-url, or start one with kvctl serve")
    with VLLMClient(url) as vllm:
        model = vllm.models()[0]
        if from_lower_tier:
            outcomes, elapsed = prefetch(instance, vllm, model, prompts, on_done)
        else:
            outcomes, elapsed = prefill(url, model, prompts, concurrency, on_done)
        for outcome in outcomes:
            if outcome.error is None and not outcome.token_ids:
                outcome.token_ids = vllm.tokenize(model, **outcome.prompt.request())
    report = []
    for outcome in outcomes:
        cached = cached_now(instance, outcome.token_ids, model) if outcome.error is None else None
        report.append({"name": outcome.prompt.name, "prompt_tokens": outcome.prompt_tokens or len(outcome.token_ids),
                       "seconds": round(outcome.seconds, 3), "error": outcome.error, **(cached or {})})
    return PrewarmReport(report, elapsed)
