"""A warm cache moved between two `kvctl serve` nodes on vLLM CPU: node A prefills a prompt and saves a snapshot;
node B (its own configuration and disk directory, never asked the prompt; the same --model value, which is part
of every key) loads it through its engine. B's lookup
then shows every chunk, its greedy completion equals A's first (uncached) one token for token, and LMCache
counts retrieve hits for it."""

import json
from pathlib import Path

import pytest

from tests.e2e.test_serve import Serve, prompt_file
from tests.helpers import http_client, wait_until

MAX_TOKENS = 12


def greedy(serve: Serve, prompt: str) -> list[int]:
    body = {"model": serve.state["model"], "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "logprobs": 1}
    answer = http_client().post(f"{serve.state['endpoints']['vllm']}/v1/completions", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["logprobs"]["tokens"]


def answer(serve: Serve, *args) -> dict:
    result = serve.kvctl(*args, "--format", "json")
    assert result.code == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


def retrieve_hit_tokens(serve: Serve) -> int:
    return answer(serve, "stats")["instances"][0]["lmcache"]["retrieve"]["hit_tokens"] or 0


@pytest.mark.slow
def test_a_snapshot_moves_a_warm_prompt_to_a_node_that_never_saw_it(tmp_path, tiny_model, monkeypatch):
    prompt = prompt_file(tmp_path)
    snap = tmp_path / "warm.kvsnap"
    node_a = Serve(tmp_path / "node-a", model=tiny_model)
    try:
        model = node_a.state["model"]
        uncached = greedy(node_a, prompt.read_text())  # the first request: nothing was cached yet
        chunks = len(answer(node_a, "lookup", "--prompt-file", prompt)["chunks"])
        wait_until(lambda: answer(node_a, "lookup", "--prompt-file", prompt)["hit_tokens"]["total"] == chunks * 256,
                   60, "node A to cache the prompt")
        saved = answer(node_a, "snapshot", "save", "--prompt-file", prompt, "-o", snap)
        assert saved["chunks"] == chunks >= 2 and saved["missing"] == 0
        assert node_a.stop() == 0
    finally:
        if node_a.proc.poll() is None:
            node_a.stop()
    node_a.assert_nothing_left()

    node_b = Serve(tmp_path / "node-b", model)  # the same --model value: a model name is part of every key
    try:
        assert node_b.state["config_dir"] != node_a.state["config_dir"]
        assert answer(node_b, "lookup", "--prompt-file", prompt)["hit_tokens"]["total"] == 0
        loaded = answer(node_b, "snapshot", "load", snap)
        assert loaded["written"] == {"cpu": chunks}
        assert loaded["prompts"][0]["cached"] == chunks and loaded["prompts"][0]["hit_tokens"] == chunks * 256
        found = answer(node_b, "lookup", "--prompt-file", prompt)
        assert found["hit_tokens"]["total"] == chunks * 256
        hits_before = retrieve_hit_tokens(node_b)
        assert greedy(node_b, prompt.read_text()) == uncached
        wait_until(lambda: retrieve_hit_tokens(node_b) >= hits_before + chunks * 256, 60, "LMCache retrieve hits")
        assert node_b.stop() == 0
    finally:
        if node_b.proc.poll() is None:
            node_b.stop()
    node_b.assert_nothing_left()


@pytest.mark.slow
def test_an_mp_snapshot_moves_a_warm_prompt_between_two_mp_nodes(tmp_path, tiny_model, monkeypatch):
    """The same move between two `kvctl serve --mode mp` nodes: chunks read from A's L1 and written into B's
    through its server (whose vLLM registered the model's layout), then retrieved by B's vLLM from the server."""
    prompt = prompt_file(tmp_path, "json/__init__")
    snap = tmp_path / "warm-mp.kvsnap"
    node_a = Serve(tmp_path / "node-a", "--mode", "mp", model=tiny_model)
    try:
        model = node_a.state["model"]
        uncached = greedy(node_a, prompt.read_text())
        chunks = len(answer(node_a, "lookup", "--prompt-file", prompt)["chunks"])
        wait_until(lambda: answer(node_a, "lookup", "--prompt-file", prompt)["hit_tokens"]["cpu"] == chunks * 256,
                   60, "node A's L1 to hold the prompt")
        saved = answer(node_a, "snapshot", "save", "--prompt-file", prompt, "-o", snap)
        assert saved["chunks"] >= chunks >= 2 and saved["missing"] == 0
        assert answer(node_a, "snapshot", "ls", snap)["source"]["key_format"] == "mp-object"
        assert node_a.stop() == 0
    finally:
        if node_a.proc.poll() is None:
            node_a.stop()
    node_a.assert_nothing_left()

    node_b = Serve(tmp_path / "node-b", model, "--mode", "mp")
    try:
        assert answer(node_b, "lookup", "--prompt-file", prompt)["hit_tokens"]["total"] == 0
        loaded = answer(node_b, "snapshot", "load", snap)
        assert loaded["written"] == {"cpu": saved["chunks"]} and loaded["prompts"][0]["cached"] == chunks
        assert answer(node_b, "lookup", "--prompt-file", prompt)["hit_tokens"]["cpu"] == chunks * 256
        assert greedy(node_b, prompt.read_text()) == uncached
        server_log = {process["name"]: process["log"] for process in node_b.state["processes"]}["lmcache-server"]
        wait_until(lambda: f"Retrieved {chunks * 256} tokens" in Path(server_log).read_text(), 60,
                   "node B's vLLM to retrieve the loaded chunks")
        assert node_b.stop() == 0
    finally:
        if node_b.proc.poll() is None:
            node_b.stop()
    node_b.assert_nothing_left()
