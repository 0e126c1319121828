"""Time to first token of an LMCache CPU-tier hit against vLLM's own prefix-cache hit: the floor.

The same 5 long prompts (~3,000 tokens) go twice to each of two vLLM CPU servers (the project's
tiny model), one after the other on this machine: (a) vLLM's prefix cache on, no connector, and
(b) vLLM's prefix cache off, LMCacheConnectorV1 with kvctl's CPU connector and a CPU tier. The
second request of each prompt is the hit: from vLLM's own paged cache in (a), which no cache can
beat, and from LMCache in (b). LMCache's own retrieve times (its log) show how much of the gap
is the load. The last line is the LMCache hit's median TTFT over vLLM's (goal <= 1.3).
"""

from __future__ import annotations

import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.ttft_hit_vs_recompute import PROMPTS, tiny_model_and_config, ttft  # noqa: E402
from tests.helpers import free_port, start_vllm, stop_process, wait_until  # noqa: E402


def first_and_second(model: str, log: Path, extra: list[str], env: dict, prompts: list[str]):
    """One vLLM server: TTFT of the first (computed) and the second (hit) request of each prompt."""
    import httpx

    port = free_port()
    proc = start_vllm(model, log, port, ["--max-model-len", "4096", *extra], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200, 300, "vLLM", proc, log)
        ttft(url, model, "warm up " * 50)
        first, second = [], []
        for prompt in prompts:
            first.append(ttft(url, model, prompt))
            time.sleep(0.5)  # let a store finish
            second.append(ttft(url, model, prompt))
        return first, second
    finally:
        stop_process(proc, grace=20)


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.0f} ms"


def main() -> None:
    words = Path(os.__file__).read_text().split()
    rng = random.Random(1)
    prompts = [" ".join(rng.choices(words, k=900)) for _ in range(PROMPTS)]
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        model = tiny_model_and_config(root)
        vllm_computed, vllm_hit = first_and_second(model, root / "vllm.log", [], {}, prompts)
        log = root / "lmcache.log"
        lmcache_computed, lmcache_hit = first_and_second(
            model, log, ["--no-enable-prefix-caching", "--kv-transfer-config",
                         (root / "cfg" / "kv-transfer-config.json").read_text()],
            {"LMCACHE_CONFIG_FILE": str(root / "cfg" / "lmcache.yaml")}, prompts)
        text = log.read_text()
    hits = [int(n) for n in re.findall(r"LMCache hit tokens: (\d+)", text) if int(n) > 0]
    retrieves = [float(n) for n in re.findall(r"Retrieved \d+ out of .*?cost ([\d.]+) ms", text)]
    assert len(hits) >= PROMPTS and retrieves, f"expected LMCache hits, got {hits}"
    print(f"prompts: {PROMPTS}, LMCache hit tokens on the second requests: {hits}")
    print(f"vLLM prefix cache: computed {ms(vllm_computed)}, hit {ms(vllm_hit)} (median TTFT)")
    print(f"LMCache CPU tier:  computed {ms(lmcache_computed)}, hit {ms(lmcache_hit)} (median TTFT); "
          f"LMCache's retrieve (lookup, CPU tier, connector load): median {statistics.median(retrieves):.1f} ms")
    print(f"ttft_lmcache_hit_over_vllm_hit={statistics.median(lmcache_hit) / statistics.median(vllm_hit):.2f}")


if __name__ == "__main__":
    main()
