"""`kvctl stats` at once after a real client's traffic agrees with vLLM (#20 item 16): LMCache exports its
counters to /metrics every 10 s, vLLM's counters move with each request, so stats that read /metrics showed
no LMCache lookups, retrieves or stores while vLLM counted LMCache's hits. `kvctl serve`, vLLM's prefix cache
off so every repeat of a prefix goes to LMCache; prompts as token ids, so the prefix is exactly two chunks."""

import json

import httpx
import pytest

from tests.e2e.test_serve import Serve

CHUNK = 256
PREFIX = [100 + i % 900 for i in range(2 * CHUNK)]


def complete(serve, suffix):
    body = {"model": serve.state["model"], "prompt": PREFIX + suffix, "max_tokens": 1}
    answer = httpx.post(f"{serve.state['endpoints']['vllm']}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text


def stats(serve):
    result = serve.kvctl("stats", "--format", "json")
    assert result.code == 0, result.stderr
    return json.loads(result.stdout)["instances"][0]


@pytest.mark.slow
def test_stats_right_after_traffic_count_what_vllm_counts(tmp_path, tiny_model):
    serve = Serve(tmp_path / "kvctl-cache", "--", "--no-enable-prefix-caching", model=tiny_model)
    try:
        requests = 0
        for _round in range(2):  # twice: LMCache's figures must move with the traffic, not with an export
            for _ in range(2):
                requests += 1
                complete(serve, [1000 + requests] * 8)
            report = stats(serve)
            lmcache, external = report["lmcache"], report["vllm"]["external_cache"]
            assert external["hits"] == (requests - 1) * 2 * CHUNK  # every request but the first: the prefix
            assert lmcache["retrieve"]["source"] == lmcache["store"]["source"] == "live"
            assert lmcache["retrieve"]["hit_tokens"] == external["hits"], report
            assert lmcache["lookup"]["requests"] >= requests and lmcache["lookup"]["hit_tokens"] >= external["hits"]
            assert lmcache["store"]["requests"] >= 1 and lmcache["store"]["tokens"] >= 2 * CHUNK
        assert serve.stop() == 0
    finally:
        if serve.proc.poll() is None:
            serve.stop()
    serve.assert_nothing_left()
