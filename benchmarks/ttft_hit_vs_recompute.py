"""Time to first token on vLLM CPU with the in-process LMCache connector: LMCache hit vs recompute.

vLLM CPU (the project's tiny model, vLLM's own prefix cache off) with LMCacheConnectorV1 and
kvctl's CPU connector; for each of 5 long prompts (~3,000 tokens), the first request computes
and stores the KV, the second gets it from LMCache's CPU tier. TTFT is the time to the first
streamed token. The last line is recompute / hit (ratio of medians).

With a 2-layer, 128-wide model, prefill costs little, so this ratio measures the connector's
overhead against very cheap compute; real models gain far more from a hit.
"""

from __future__ import annotations

import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.helpers import free_port, start_vllm, stop_process, wait_until  # noqa: E402

PROMPTS = 5


def ttft(url: str, model: str, prompt: str) -> float:
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    start = time.perf_counter()
    seen = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.perf_counter() - start
            seen.append(line)
    raise RuntimeError(f"no token streamed: {seen[:3]}")


def tiny_model_and_config(root: Path) -> str:
    """The project's tiny model and an LMCache configuration with a 1 GB CPU tier under `root`."""
    kvctl = str(Path(sys.executable).parent / "kvctl")
    model = str(root / "tiny")
    subprocess.run([kvctl, "-q", "model", "tiny", model], check=True, stdout=subprocess.DEVNULL)
    subprocess.run([kvctl, "-q", "config", "init", "--out", str(root / "cfg"), "--tier", "cpu:1",
                    "--internal-api-port-start", str(free_port())], check=True, stdout=subprocess.DEVNULL)
    return model


def main() -> None:
    import httpx

    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        model = tiny_model_and_config(root)
        port = free_port()
        log = root / "vllm.log"
        proc = start_vllm(model, log, port, ["--max-model-len", "4096", "--no-enable-prefix-caching",
                                             "--kv-transfer-config",
                                             (root / "cfg" / "kv-transfer-config.json").read_text()],
                          env={"LMCACHE_CONFIG_FILE": str(root / "cfg" / "lmcache.yaml")})
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200, 300, "vLLM", proc, log)
            words = Path(os.__file__).read_text().split()
            rng = random.Random(0)
            recompute, hit = [], []
            ttft(url, model, "warm up " * 50)
            for _ in range(PROMPTS):
                prompt = " ".join(rng.choices(words, k=900))
                recompute.append(ttft(url, model, prompt))
                time.sleep(0.5)  # let the store finish
                hit.append(ttft(url, model, prompt))
            hits = [int(n) for n in re.findall(r"LMCache hit tokens: (\d+)", log.read_text())]
        finally:
            stop_process(proc, grace=20)
    assert sum(1 for n in hits if n > 0) >= PROMPTS, f"expected LMCache hits, got {hits}"
    print(f"prompts: {PROMPTS}, LMCache hit tokens on the second requests: {[n for n in hits if n > 0]}")
    print(f"TTFT recompute: median {statistics.median(recompute) * 1000:.0f} ms; "
          f"LMCache hit: median {statistics.median(hit) * 1000:.0f} ms")
    print(f"ttft_recompute_over_hit={statistics.median(recompute) / statistics.median(hit):.2f}")


if __name__ == "__main__":
    main()
