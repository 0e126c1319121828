"""Statistics through a real vLLM scheduler, on one `kvctl serve --config` that records chunk hashes
(file_hash) with vLLM's own prefix cache off, so every repeat of a prefix goes to LMCache (a class: one
vLLM start, ~45 CPU-s, for both):
- LMCache's chunk statistics and doctor's retrieve check: `chunk-stats top` counts both requests of a
  repeated prompt, and doctor finds the connector retrieving what the lookups found;
- `kvctl stats` at once after a real client's traffic agrees with vLLM (#20 item 16): LMCache exports its
  counters to /metrics every 10 s while vLLM's move with each request, so stats that read /metrics showed
  no LMCache lookups, retrieves or stores while vLLM counted LMCache's hits. Prompts as token ids, so the
  prefix is exactly two chunks."""

import json

import pytest
import yaml

from tests.e2e.test_serve import Serve, prompt_file
from tests.helpers import http_client, run_kvctl, wait_until

CHUNK = 256
PREFIX = [100 + i % 900 for i in range(2 * CHUNK)]


@pytest.fixture(scope="class")
def served(tmp_path_factory, tiny_model):
    """The serve, and the directory its chunk statistics are written to."""
    root = tmp_path_factory.mktemp("stats")
    config = root / "cfg"
    made = run_kvctl("config", "init", "--out", config, "--tier", "cpu:0.1", "--tier", f"disk:{root / 'disk'}:1")
    assert made.code == 0, made.stderr
    hashes = root / "chunk-hashes"
    settings = yaml.safe_load((config / "lmcache.yaml").read_text())
    settings.update(enable_chunk_statistics=True, chunk_statistics_auto_start_statistics=True,
                    chunk_statistics_strategy="file_hash")
    settings.setdefault("extra_config", {})["chunk_statistics_file_output_dir"] = str(hashes)
    (config / "lmcache.yaml").write_text(yaml.safe_dump(settings))
    serve = Serve(root / "kvctl-cache", "--config", config, "--", "--no-enable-prefix-caching", model=tiny_model)
    try:
        yield serve, hashes
        assert serve.stop() == 0
    finally:
        if serve.proc.poll() is None:
            serve.stop()
    serve.assert_nothing_left()


def complete(serve, prompt):
    body = {"model": serve.state["model"], "prompt": prompt, "max_tokens": 1}
    answer = http_client().post(f"{serve.state['endpoints']['vllm']}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text


def stats(serve):
    result = serve.kvctl("stats", "--format", "json")
    assert result.code == 0, result.stderr
    return json.loads(result.stdout)["instances"][0]


@pytest.mark.slow
class TestOneServeWithoutPrefixCaching:
    def test_a_repeated_prompt_is_the_hottest_and_doctor_sees_it_retrieved(self, served, tmp_path):
        serve, hashes = served
        prompt = prompt_file(tmp_path)
        for _ in range(2):
            complete(serve, prompt.read_text())
        wait_until(lambda: stats(serve)["lmcache"]["retrieve"]["hit_tokens"], 60, "LMCache's retrieve metrics")
        lmcache = stats(serve)["lmcache"]
        assert lmcache["lookup"]["hit_tokens"] >= 256 and lmcache["retrieve"]["hit_tokens"] >= 256

        top = serve.kvctl("chunk-stats", "top", "--format", "json")  # the directory is read from the engine
        assert top.code == 0, top.stderr
        hot = json.loads(top.stdout)
        assert hot["directory"] == str(hashes) and hot["requests"] >= 2 and hot["skipped_lines"] == 0
        found = json.loads(serve.kvctl("lookup", "--prompt-file", prompt, "--format", "json").stdout)
        assert hot["prompts"][0]["requests"] == 2 and hot["prompts"][0]["chunks"] >= len(found["chunks"]) >= 2
        assert hot["chunks"][0]["requests"] == 2

        doctor = serve.kvctl("doctor", "--format", "json")
        findings = json.loads(doctor.stdout)["findings"]
        assert not [finding for finding in findings if finding["check"] == "retrieve"], findings
        assert doctor.code == 0, findings

    def test_stats_right_after_traffic_count_what_vllm_counts(self, served):
        """What this test's requests added, read at once: the counters before it are its baseline."""
        serve, _ = served
        start = stats(serve)

        def added(report, *path):
            now, before = report, start
            for key in path:
                now, before = now[key], before[key]
            return now - (before or 0)

        requests = 0
        for _round in range(2):  # twice: LMCache's figures must move with the traffic, not with an export
            for _ in range(2):
                requests += 1
                complete(serve, PREFIX + [1000 + requests] * 8)
            report = stats(serve)
            lmcache, hits = report["lmcache"], added(report, "vllm", "external_cache", "hits")
            assert hits == (requests - 1) * 2 * CHUNK  # every request but the first: the prefix
            assert lmcache["retrieve"]["source"] == lmcache["store"]["source"] == "live"
            assert added(report, "lmcache", "retrieve", "hit_tokens") == hits, report
            assert added(report, "lmcache", "lookup", "requests") >= requests
            assert added(report, "lmcache", "lookup", "hit_tokens") >= hits
            assert added(report, "lmcache", "store", "requests") >= 1
            assert added(report, "lmcache", "store", "tokens") >= 2 * CHUNK
