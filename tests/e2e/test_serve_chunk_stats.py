"""LMCache's chunk statistics and doctor's retrieve check through a real vLLM scheduler: `kvctl serve
--config` on a configuration that records chunk hashes (file_hash), vLLM's own prefix cache off so a
repeated prompt goes to LMCache; `chunk-stats top` counts both requests of the prompt, and doctor finds
the connector retrieving what the lookups found."""

import json

import httpx
import pytest
import yaml

from tests.e2e.test_serve import Serve, prompt_file
from tests.helpers import run_kvctl, wait_until


@pytest.mark.slow
def test_a_repeated_prompt_is_the_hottest_and_doctor_sees_it_retrieved(tmp_path, tiny_model):
    config = tmp_path / "cfg"
    made = run_kvctl("config", "init", "--out", config, "--tier", "cpu:1", "--tier", f"disk:{tmp_path / 'disk'}:1")
    assert made.code == 0, made.stderr
    hashes = tmp_path / "chunk-hashes"
    settings = yaml.safe_load((config / "lmcache.yaml").read_text())
    settings.update(enable_chunk_statistics=True, chunk_statistics_auto_start_statistics=True,
                    chunk_statistics_strategy="file_hash")
    settings.setdefault("extra_config", {})["chunk_statistics_file_output_dir"] = str(hashes)
    (config / "lmcache.yaml").write_text(yaml.safe_dump(settings))
    prompt = prompt_file(tmp_path)
    serve = Serve(tmp_path / "kvctl-cache", "--config", config, "--", "--no-enable-prefix-caching", model=tiny_model)
    try:
        body = {"model": serve.state["model"], "prompt": prompt.read_text(), "max_tokens": 1}
        for _ in range(2):
            answer = httpx.post(f"{serve.state['endpoints']['vllm']}/v1/completions", json=body, timeout=120)
            assert answer.status_code == 200, answer.text

        def stats():
            result = serve.kvctl("stats", "--format", "json")
            assert result.code == 0, result.stderr
            return json.loads(result.stdout)["instances"][0]["lmcache"]

        wait_until(lambda: stats()["retrieve"]["hit_tokens"], 60, "LMCache's retrieve metrics")
        lmcache = stats()
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
        assert serve.stop() == 0
    finally:
        if serve.proc.poll() is None:
            serve.stop()
    serve.assert_nothing_left()
