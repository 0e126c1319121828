"""`kvctl lookup --offline` against chunks a real LMCache engine stored on disk and in a real Redis,
and its diagnosis on real mismatched setups."""

import json
import shutil
import sys

import pytest
import yaml

from kvctl.core.lmcache.keys import KeyRecipe, disk_file_name, inprocess_keys
from tests.helpers import free_port, http_json, run_kvctl, start_process, stop_process, wait_until

CHUNK = 256
STORED = 4 * CHUNK  # the engine stores tokens 0..1023


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, module_redis):
    """A standalone LMCache engine from a `kvctl config init` config, with tokens 0..1023 stored on every tier."""
    root = tmp_path_factory.mktemp("deployment")
    port_start = free_port()
    init = run_kvctl("config", "init", "--out", root / "cfg", "--tier", "cpu:0.2", "--tier", f"disk:{root}/disk:0.5",
                     "--tier", module_redis.url, "--internal-api-port-start", port_start, "--model", "tiny")
    assert init.code == 0, init.stderr
    log = root / "engine.log"
    proc = start_process([sys.executable, "-m", "lmcache.v1.standalone", "--config", str(root / "cfg" / "lmcache.yaml"),
                          "--model-name", "tiny", "--kv-shape", f"2,2,{CHUNK},2,32", "--kvcache-shape-spec",
                          "(2048,2,32):float16:2", "--kv-dtype", "float16"], log)
    api = f"http://127.0.0.1:{port_start + 1}"
    try:
        wait_until(lambda: http_json("GET", f"{api}/lmc_version"), 120, "standalone engine", proc, log)
        assert http_json("POST", f"{api}/cache/store", params={"tokens_mock": f"0,{STORED}"})["num_tokens"] == STORED
        client = module_redis.client()
        wait_until(lambda: len(list((root / "disk").glob("*.pt"))) == 4, 30, "disk files", proc, log)
        wait_until(lambda: len(list(client.scan_iter("*metadata"))) == 4, 30, "redis keys", proc, log)
    finally:
        stop_process(proc, grace=2)  # the data stays on disk and in Redis; the lookup is offline
    tokens = root / "tokens.json"
    tokens.write_text(json.dumps(list(range(STORED + 100))))
    yield {"root": root, "config": root / "cfg", "tokens": tokens, "redis": module_redis}


def lookup(deployment, *extra, config=None):
    result = run_kvctl("lookup", "--offline", "--config", config or deployment["config"], "--tokens-file",
                       deployment["tokens"], "--kv-dtype", "float16", "--format", "json", *extra)
    return result, (json.loads(result.stdout) if result.stdout else None)


def config_copy(deployment, tmp_path, **changes):
    """The deployment's configuration directory, copied, with lmcache.yaml changed; None removes a key."""
    config = tmp_path / "cfg"
    shutil.copytree(deployment["config"], config)
    values = yaml.safe_load((config / "lmcache.yaml").read_text())
    values.update(changes)
    (config / "lmcache.yaml").write_text(yaml.safe_dump({k: v for k, v in values.items() if v is not None}))
    return config


def causes(report):
    return [d["cause"] for d in report["diagnostics"]]


@pytest.mark.slow
def test_lookup_finds_every_stored_chunk_on_disk_and_redis(deployment):
    result, report = lookup(deployment)
    assert result.code == 0, result.stderr
    expected_keys = inprocess_keys(list(range(STORED + 100)),
                                   KeyRecipe("tiny", CHUNK, "sha256_cbor", "0", kv_dtype="half"))
    assert [chunk["key"] for chunk in report["chunks"]] == expected_keys
    assert [chunk["tiers"] for chunk in report["chunks"]] == [["disk", "redis"]] * 4
    assert report["hit_tokens"] == {"cpu": None, "disk": STORED, "redis": STORED, "total": STORED}
    assert report["tiers_checked"] == ["disk", "redis"]
    assert causes(report) == ["unfull_chunk_not_saved"]
    assert report["prompt_tokens"] == STORED + 100 and report["chunk_size"] == CHUNK


@pytest.mark.slow
def test_lookup_only_asks_exists_of_redis(deployment):
    client = deployment["redis"].client()
    size = client.dbsize()
    client.config_resetstat()
    lookup(deployment)
    commands = {name: stats["calls"] for name, stats in client.info("commandstats").items()
                if not name.startswith(("cmdstat_config", "cmdstat_info"))}  # this test's own commands
    assert commands == {"cmdstat_exists": 4}  # one EXISTS per stored chunk; no GET, no KEYS, no SCAN
    assert client.dbsize() == size


@pytest.mark.slow
@pytest.mark.parametrize(("extra", "cause", "hint_words"), [
    (["--model", "tinyy"], "model_name_mismatch", "--model tiny"),
    (["--hash-seed", "5"], "hash_seed_mismatch", "PYTHONHASHSEED"),
    (["--world-size", "2"], "world_size_mismatch", "--world-size 1"),
])
def test_diagnosis_names_the_cause(deployment, extra, cause, hint_words):
    args = list(extra)
    if "--model" not in args:
        args += ["--model", "tiny"]
    result, report = lookup(deployment, *args)
    assert result.code == 0
    assert report["hit_tokens"]["total"] == 0
    assert cause in causes(report)
    assert hint_words in report["diagnostics"][-1]["hint"]


@pytest.mark.slow
def test_diagnosis_dtype_mismatch(deployment):
    result = run_kvctl("lookup", "--config", deployment["config"], "--tokens-file", deployment["tokens"], "--model",
                       "tiny", "--kv-dtype", "bfloat16", "--format", "json")
    report = json.loads(result.stdout)
    assert report["hit_tokens"]["total"] == 0 and causes(report)[-1] == "dtype_mismatch"
    assert "--kv-dtype half" in report["diagnostics"][-1]["hint"]


@pytest.mark.slow
@pytest.mark.parametrize(("change", "cause"), [({"chunk_size": 512}, "chunk_size_mismatch"),
                                               ({"pre_caching_hash_algorithm": "builtin"}, "hash_algorithm_mismatch")])
def test_diagnosis_config_mismatch(deployment, tmp_path, change, cause):
    result, report = lookup(deployment, config=config_copy(deployment, tmp_path, **change))
    assert report["hit_tokens"]["total"] == 0
    assert causes(report)[-1] == cause, report["diagnostics"]


@pytest.mark.slow
def test_missing_middle_chunk_stops_the_hit(deployment, tmp_path):
    disk = tmp_path / "disk"
    shutil.copytree(deployment["root"] / "disk", disk)
    config = config_copy(deployment, tmp_path, local_disk=f"file://{disk}/", remote_url=None)
    keys = inprocess_keys(list(range(STORED)), KeyRecipe("tiny", CHUNK, "sha256_cbor", "0", kv_dtype="half"))
    (disk / disk_file_name(keys[2])).unlink()
    result, report = lookup(deployment, config=config)
    assert [chunk["tiers"] for chunk in report["chunks"]] == [["disk"], ["disk"], [], ["disk"]]
    assert report["hit_tokens"]["total"] == 2 * CHUNK
    assert causes(report)[-1] == "missing_chunk"


@pytest.mark.slow
def test_unreachable_redis_is_a_partial_result(deployment, tmp_path):
    config = config_copy(deployment, tmp_path, remote_url=f"redis://127.0.0.1:{free_port()}")
    result, report = lookup(deployment, config=config)
    assert result.code == 6
    assert report["hit_tokens"]["disk"] == STORED and report["tiers_checked"] == ["disk"]
    assert "cannot connect to Redis" in report["errors"]["redis"]
    assert "redis tier" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_redis_auth_failure_is_reported(deployment, tmp_path, start_redis):
    locked = start_redis(password="sesame")
    config = config_copy(deployment, tmp_path / "no-password", remote_url=f"redis://127.0.0.1:{locked.port}")
    result, report = lookup(deployment, config=config)
    assert result.code == 6 and "refused the credentials" in report["errors"]["redis"]
    config = config_copy(deployment, tmp_path / "password", remote_url=f"redis://:sesame@127.0.0.1:{locked.port}")
    result, report = lookup(deployment, config=config)
    assert result.code == 0 and report["tiers_checked"] == ["disk", "redis"]
    assert report["hit_tokens"]["redis"] == 0
