"""vLLM CPU + LMCacheConnectorV1 + kvctl's plugins: a restarted vLLM gets LMCache hits from the disk
and Redis tiers at once, produces the same greedy output, and never waits on lookup timeouts.

The proof that the loaded KV is the right KV compares like with like, so it holds on every CPU: the
restarted run (prefix from LMCache, the rest computed) is compared bit for bit with the first server
answering the same prompt again from vLLM's own prefix cache (prefix from the bf16 paged cache, the
rest computed). The prompt is cut so that both prefixes are the same tokens: LMCache stores whole
chunks (a multiple of 256), vLLM reuses whole blocks of 128 but never the last prompt token, so a
prompt of 1024 + t tokens with 0 < t < 128 makes both 1024. A full recompute (the first request)
reads K/V before they are rounded into the cache, and whether that agrees to the last bit depends
on the CPU's kernels: it is held to the same greedy text and a bf16-sized logprob tolerance.
"""

import json
import re
import sysconfig

import pytest

from kvctl.clients.internal_api import InternalAPIClient
from kvctl.clients.offload import OffloadClient, offload_socket_path
from kvctl.core.lmcache.keys import disk_file_name
from tests.helpers import free_port, http_client, run_kvctl, start_vllm, stop_process, wait_until

PROMPT = (sysconfig.get_paths()["stdlib"] + "/json/__init__.py")
CHUNK, VLLM_BLOCK = 256, 128  # LMCache's default chunk size; vLLM CPU's block size
# bf16 keeps 8 significant bits (relative rounding 2**-9): rounding the prefix K/V moves a logprob of
# magnitude ~10 by a few 1e-3 at most; 2**-6 leaves room for that and still catches wrong KV, which
# changes logprobs by whole units (zeroing K on load does).
RECOMPUTE_LOGPROB_TOLERANCE = 2**-6


def prompt_with_short_tail(model_dir) -> tuple[str, int]:
    """A prompt of k*CHUNK + t tokens (k >= 4, 0 < t < VLLM_BLOCK), and that token count."""
    from kvctl.core.lmcache.tokens import LocalTokenizer

    tokenizer, text = LocalTokenizer(model_dir), open(PROMPT).read()
    for end in range(2500, len(text), 7):
        count = len(tokenizer.encode_prompt(text[:end]))
        if count >= 4 * CHUNK and 0 < count % CHUNK < VLLM_BLOCK:
            return text[:end], count
    raise AssertionError("no cut of the prompt file has a short tail")


def serve(model, config_dir, log):
    port = free_port()
    kv_transfer = (config_dir / "kv-transfer-config.json").read_text()
    proc = start_vllm(model, log, port, ["--kv-transfer-config", kv_transfer],
                      env={"LMCACHE_CONFIG_FILE": str(config_dir / "lmcache.yaml")})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: http_client().get(f"{url}/health", timeout=5).status_code == 200, 300, "vLLM", proc, log)
    except BaseException:
        stop_process(proc, grace=20)  # a vLLM that never became ready is stopped too
        raise
    return proc, url


def complete(url, model, prompt):
    body = {"model": str(model), "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1}
    choice = http_client().post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


def hit_tokens(log):
    return [int(n) for n in re.findall(r"LMCache hit tokens: (\d+)", log.read_text())]


def prefix_cache_hits(url) -> float:
    metrics = http_client().get(f"{url}/metrics", timeout=10).text
    return sum(float(value) for value in re.findall(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$", metrics, re.M))


@pytest.mark.slow
def test_restarted_vllm_hits_lmcache_from_disk_and_redis(tiny_model, tmp_path, start_redis):
    """One vLLM stores on every tier; a restart loads the prefix from disk and Redis together, each holding a
    part of it (one restart proves both tiers serve one)."""
    prompt, prompt_tokens = prompt_with_short_tail(tiny_model)
    stored = prompt_tokens // CHUNK * CHUNK
    port_start = free_port()
    redis = start_redis()
    tiers = ["--tier", "cpu:0.1", "--tier", f"disk:{tmp_path}/disk:1", "--tier", redis.url]
    assert run_kvctl("config", "init", "--out", tmp_path / "cfg", *tiers, "--internal-api-port-start", port_start,
                     "--model", tiny_model).code == 0

    first_log = tmp_path / "first.log"
    proc, url = serve(tiny_model, tmp_path / "cfg", first_log)
    try:
        recomputed = complete(url, tiny_model, prompt)
        wait_until(lambda: "Stored" in first_log.read_text(), 30, "LMCache store")
        tokenized = http_client().post(f"{url}/tokenize", json={"model": str(tiny_model), "prompt": prompt})
        tokens = tokenized.json()["tokens"]
        assert len(tokens) == prompt_tokens  # kvctl's offline tokenizer counts as vLLM does
        hits_before = prefix_cache_hits(url)
        from_vllm_cache = complete(url, tiny_model, prompt)  # the prefix from vLLM's own bf16 cache
        assert prefix_cache_hits(url) - hits_before == stored
        with InternalAPIClient(f"http://127.0.0.1:{port_start + 1}") as worker:  # the plugin routes inside vLLM
            expected_tiers = ["cpu", "disk", "redis"]
            wait_until(lambda: worker.lookup(tokens)["hit_tokens"]["total"] == stored, 30, "chunks on every tier")
            assert all(chunk["tiers"] == expected_tiers for chunk in worker.lookup(tokens)["chunks"])
            prompt_file = tmp_path / "prompt.txt"
            prompt_file.write_text(prompt)
            live = run_kvctl("lookup", "--instance", f"http://127.0.0.1:{port_start + 1}", "--vllm-url", url,
                             "--prompt-file", prompt_file, "--format", "json")
            assert live.code == 0, live.stderr
            assert json.loads(live.stdout)["hit_tokens"]["total"] == stored
            assert json.loads(live.stdout)["chunks"][0]["tiers"] == expected_tiers
            offload = OffloadClient(offload_socket_path(worker.meta()["engine_id"], rank=0))
            assert 0 < offload.health() < 5  # the worker's ZMQ offload server answers, and again after that
            assert offload.health() < 5
    finally:
        stop_process(proc, grace=20)
    assert hit_tokens(first_log) == [0, stored]  # the second request found it in vLLM's cache: nothing loaded
    offline = run_kvctl("lookup", "--offline", "--config", tmp_path / "cfg", "--prompt-file", tmp_path / "prompt.txt",
                        "--format", "json")  # the model comes from env.sh, the tokenizer from its directory
    assert offline.code == 0, offline.stderr
    report = json.loads(offline.stdout)
    assert report["hit_tokens"]["disk"] == stored and report["prompt_tokens"] == len(tokens)
    assert report["hit_tokens"]["redis"] == stored

    # Neither tier alone holds the prefix for the restart: the first two chunks only on disk, the rest only in
    # Redis. LMCache matches a prefix tier by tier in its order (CPU, disk, Redis), so a full hit takes both.
    keys = [chunk["key"] for chunk in report["chunks"]]
    head = tmp_path / "head.json"
    head.write_text(json.dumps(tokens[:2 * CHUNK]))
    evicted = run_kvctl("evict", "--config", tmp_path / "cfg", "--tokens-file", head, "--tier", "redis",
                        "--yes", "--format", "json")
    assert evicted.code == 0 and json.loads(evicted.stdout)["removed"]["redis"] == 2, evicted.stdout + evicted.stderr
    for key in keys[2:]:
        (tmp_path / "disk" / disk_file_name(key)).unlink()
    split = run_kvctl("lookup", "--offline", "--config", tmp_path / "cfg", "--prompt-file", tmp_path / "prompt.txt",
                      "--format", "json")
    assert [chunk["tiers"] for chunk in json.loads(split.stdout)["chunks"]] == [["disk"]] * 2 + [["redis"]] * (
        len(keys) - 2), split.stdout

    redis_reads = redis.client()
    log = tmp_path / "restart.log"
    hits_before = redis_reads.info("stats")["keyspace_hits"]
    proc, url = serve(tiny_model, tmp_path / "cfg", log)
    try:
        from_lmcache = complete(url, tiny_model, prompt)
    finally:
        stop_process(proc, grace=20)
    assert redis_reads.info("stats")["keyspace_hits"] > hits_before
    assert hit_tokens(log) == [stored] and stored >= 1024
    assert re.search(rf"Retrieved {stored} out of {stored}", log.read_text())
    assert from_lmcache == from_vllm_cache  # the same prefix KV, bit for bit: same text, same logprobs
    assert from_lmcache[0] == recomputed[0]  # and the same greedy text as a full recompute,
    assert max(abs(a - b) for a, b in zip(from_lmcache[1], recomputed[1])) < RECOMPUTE_LOGPROB_TOLERANCE
    for text in (first_log.read_text(), log.read_text()):
        assert "Timeout occurred" not in text and "No supported cpu connector" not in text
