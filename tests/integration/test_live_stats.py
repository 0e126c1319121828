"""`kvctl stats` right after traffic: LMCache exports its counters to /metrics only every 10 s, so stats read
them live through kvctl's route (#20 item 16). A real standalone engine stores and retrieves through
LMCache's own debug routes; stats, run at once, must count each request, and /metrics must agree once
exported."""

import json

import pytest

from tests.helpers import http_client, http_json, run_kvctl, standalone_engine, wait_until

CHUNK = 256
COUNTERS = ("lookup", "retrieve", "store", "evictions", "remote")


def lmcache(url):
    result = run_kvctl("stats", "--instance", url, "--format", "json")
    assert result.code == 0, result.stderr
    return json.loads(result.stdout)["instances"][0]["lmcache"]


@pytest.mark.slow
def test_stats_count_a_store_and_a_retrieve_at_once(tmp_path):
    with standalone_engine(tmp_path, "--tier", "cpu:0.05") as url:
        before = lmcache(url)
        assert all(before[group]["source"] == "live" and before[group]["max_age_s"] == 0 for group in COUNTERS)
        store, retrieve = before["store"], before["retrieve"]
        for round_ in range(1, 3):  # twice: each figure must move with its request, not with an export
            http_json("POST", f"{url}/cache/store", params={"tokens_mock": f"0,{2 * CHUNK}"})
            now = lmcache(url)
            assert (now["store"]["requests"], now["store"]["tokens"]) == (
                store["requests"] + round_, store["tokens"] + round_ * 2 * CHUNK)
            http_json("POST", f"{url}/cache/retrieve", params={"tokens_mock": f"0,{2 * CHUNK}"})
            now = lmcache(url)
            assert (now["retrieve"]["requests"], now["retrieve"]["hit_tokens"]) == (
                retrieve["requests"] + round_, retrieve["hit_tokens"] + round_ * 2 * CHUNK)

        def exported():
            samples = {line.split("{")[0]: float(line.rsplit(" ", 1)[1])
                       for line in http_client().get(f"{url}/metrics", timeout=10).text.splitlines()
                       if line.startswith(("lmcache:num_stored_tokens_total", "lmcache:num_hit_tokens_total"))}
            return samples == {"lmcache:num_stored_tokens_total": now["store"]["tokens"],
                               "lmcache:num_hit_tokens_total": now["retrieve"]["hit_tokens"]}

        wait_until(exported, 30, "LMCache's /metrics to export what stats counted")

