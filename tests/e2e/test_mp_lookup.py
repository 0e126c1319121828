"""MP mode: vLLM CPU + LMCacheMPConnector + `lmcache server` (L2 on fs and Redis, kvctl's routes
loaded) from `kvctl config init --mode mp`; kvctl's live lookup sees the chunks in L1 too, and the
offline lookup finds exactly the chunks the server stored."""

import json
import re
import sys
import sysconfig

import pytest
import yaml

from kvctl.core.config.init import mp_server_argv
from kvctl.core.lmcache.keys import MPKeyRecipe, mp_object_keys
from kvctl.core.serve.launch import MP_ROUTES_ARGV
from tests.helpers import (
    free_port,
    http_client,
    http_json,
    run_kvctl,
    start_process,
    start_vllm,
    stop_process,
    wait_until,
)


@pytest.mark.slow
def test_offline_lookup_finds_what_the_mp_server_stored(tiny_model, tmp_path, start_redis):
    redis = start_redis()
    port, http_port = free_port(), free_port()
    init = run_kvctl("config", "init", "--mode", "mp", "--out", tmp_path / "cfg", "--tier", "cpu:0.2", "--tier",
                     f"disk:{tmp_path}/l2", "--tier", redis.url, "--mp-port", port, "--mp-http-port", http_port,
                     "--model", tiny_model)
    assert init.code == 0, init.stderr
    values = yaml.safe_load((tmp_path / "cfg" / "lmcache.yaml").read_text())
    server_log = tmp_path / "server.log"
    server = start_process([sys.executable, "-m", "lmcache.v1.multiprocess.http_server", *mp_server_argv(values),
                            *MP_ROUTES_ARGV], server_log)
    vllm = None
    try:
        wait_until(lambda: http_json("GET", f"http://127.0.0.1:{http_port}/healthcheck")["status"] == "healthy", 120,
                   "lmcache server", server, server_log)
        vllm_port = free_port()
        vllm_log = tmp_path / "vllm.log"
        vllm = start_vllm(tiny_model, vllm_log, vllm_port,
                          ["--kv-transfer-config", (tmp_path / "cfg" / "kv-transfer-config.json").read_text()])
        url = f"http://127.0.0.1:{vllm_port}"
        wait_until(lambda: http_client().get(f"{url}/health", timeout=5).status_code == 200, 300, "vLLM", vllm,
                   vllm_log)
        prompt = open(sysconfig.get_paths()["stdlib"] + "/csv.py").read()[:2500]
        body = {"model": str(tiny_model), "prompt": prompt, "max_tokens": 4, "temperature": 0}
        assert http_client().post(f"{url}/v1/completions", json=body, timeout=120).status_code == 200
        tokenized = http_client().post(f"{url}/tokenize", json={"model": str(tiny_model), "prompt": prompt})
        tokens = tokenized.json()["tokens"]
        stored = len(tokens) // 256 * 256
        expected = mp_object_keys(tokens, MPKeyRecipe(str(tiny_model), 256, "blake3"))
        wait_until(lambda: all((tmp_path / "l2" / ranks[0].fs_file_name()).exists() for ranks in expected), 60,
                   "fs L2 files", server, server_log)
        wait_until(lambda: all(redis.client().exists(ranks[0].native_key()) for ranks in expected), 60,
                   "Redis L2 keys", server, server_log)
        prompt_file = tmp_path / "prompt.txt"
        prompt_file.write_text(prompt)
        live = run_kvctl("lookup", "--config", tmp_path / "cfg", "--instance", f"http://127.0.0.1:{http_port}",
                         "--prompt-file", prompt_file, "--format", "json")
        assert live.code == 0, live.stderr
        assert json.loads(live.stdout)["hit_tokens"] == {"cpu": stored, "disk": stored, "redis": stored,
                                                         "total": stored}
    finally:
        if vllm is not None:
            stop_process(vllm, grace=20)
        stop_process(server)
    result = run_kvctl("lookup", "--offline", "--config", tmp_path / "cfg", "--prompt-file", prompt_file,
                       "--format", "json")
    assert result.code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["mode"] == "mp" and report["tiers_checked"] == ["disk", "redis"]
    assert report["hit_tokens"] == {"cpu": None, "disk": stored, "redis": stored, "total": stored} and stored >= 512
    assert [chunk["key"] for chunk in report["chunks"]] == [ranks[0].native_key() for ranks in expected]
    tokens_file = tmp_path / "tokens.json"
    tokens_file.write_text(json.dumps(tokens))
    other = run_kvctl("lookup", "--offline", "--config", tmp_path / "cfg", "--tokens-file", tokens_file,
                      "--model", "not/the/model", "--kv-dtype", "bfloat16", "--format", "json")
    assert json.loads(other.stdout)["diagnostics"][-1]["cause"] == "model_name_mismatch"
    assert re.search(r"L1 \(cpu\) tier", result.stderr)
