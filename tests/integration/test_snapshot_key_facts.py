"""#20 item 6 against a real engine and a real Redis: a Redis two deployments share (model tiny, and another
model's chunks beside them) is saved whole as tiny's alone, with LMCache's own metadata headers passing the
size check; a snapshot whose manifest says tiny but carries another model's chunk writes nothing offline."""

import io
import json
import tarfile

import pytest

from kvctl.core.lmcache.keys import KeyRecipe, inprocess_keys
from tests.helpers import http_json, run_cli, run_kvctl, standalone_engine, wait_until

CHUNK = 256
TOKENS = list(range(3000, 3000 + 3 * CHUNK))
KEYS = inprocess_keys(TOKENS, KeyRecipe("tiny", CHUNK, "sha256_cbor", "0", kv_dtype="half"))
OTHERS = [key.replace("tiny@", "other@", 1) for key in KEYS]  # the other deployment's, on the same Redis
HALF = ("--kv-dtype", "float16")  # what the standalone engine serves; no --model: the configuration's


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCTL_CACHE_DIR", str(tmp_path / "kvctl-cache"))


@pytest.fixture(scope="module")
def shared_redis(tmp_path_factory, module_redis):
    """An engine of tiny that stored TOKENS into Redis, where another model's chunks lie too; its config."""
    root = tmp_path_factory.mktemp("shared")
    redis = module_redis.client()
    with standalone_engine(root, "--tier", "cpu:0.1", "--tier", module_redis.url, "--model", "tiny") as url:
        http_json("POST", f"{url}/cache/store", params={"tokens_mock": f"{TOKENS[0]},{TOKENS[-1] + 1}"})
        wait_until(lambda: all(redis.exists(key + "metadata") for key in KEYS), 30, "chunks in Redis")
        for key, other in zip(KEYS, OTHERS):
            for suffix in ("kv_bytes", "metadata"):
                redis.copy(key + suffix, other + suffix)
        yield {"config": root / "cfg", "redis": redis, "server": module_redis}


def answer(*args, code: int = 0):
    result = run_cli(*args, "--format", "json")
    assert result.code == code, result.stdout + result.stderr
    return json.loads(result.stdout) if code == 0 else result


def manifest_of(path):
    with tarfile.open(path) as archive:
        return json.load(archive.extractfile("manifest.json"))


def with_manifest(source, manifest, path):
    """A copy of the snapshot `source` at `path` holding `manifest`."""
    body = json.dumps(manifest).encode()
    with tarfile.open(source) as original, tarfile.open(path, "w") as archive:
        for member in original.getmembers()[:-1]:
            archive.addfile(member, original.extractfile(member))
        info = tarfile.TarInfo("manifest.json")
        info.size = len(body)
        archive.addfile(info, io.BytesIO(body))
    return path


@pytest.mark.slow
def test_a_shared_redis_saved_whole_is_the_configurations_model_alone(shared_redis, tmp_path):
    snap = tmp_path / "tier.kvsnap"
    saved = answer("snapshot", "save", "--config", shared_redis["config"], *HALF, "--tier", "redis", "--all",
                   "-o", snap)
    assert saved["chunks"] == len(KEYS), saved
    manifest = manifest_of(snap)
    assert manifest["keys"]["model"] == "tiny"
    assert sorted(chunk["key"] for chunk in manifest["chunks"]) == sorted(KEYS)
    assert all(chunk["metadata"] for chunk in manifest["chunks"])  # LMCache's headers, checked on load

    target = tmp_path / "target"
    init = run_kvctl("config", "init", "--out", target, "--tier", "cpu:0.1", "--tier",
                     shared_redis["server"].url + "/4", "--model", "tiny")
    assert init.code == 0, init.stderr
    loaded = answer("snapshot", "load", snap, "--config", target, *HALF, "--tier", "redis")
    assert loaded["written"] == {"redis": len(KEYS)}
    server = shared_redis["server"]
    database = type(shared_redis["redis"])(host="127.0.0.1", port=server.port, password=server.password, db=4)
    database.flushdb()


@pytest.mark.slow
def test_a_snapshot_carrying_another_models_chunk_writes_nothing_into_redis(shared_redis, tmp_path):
    snap = tmp_path / "warm.kvsnap"
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    answer("snapshot", "save", "--config", shared_redis["config"], *HALF, "--tokens-file", tokens, "-o", snap)
    manifest = manifest_of(snap)
    manifest["chunks"][-1]["key"] = OTHERS[-1]  # its bytes are that chunk's: only the key is another model's
    mixed = with_manifest(snap, manifest, tmp_path / "mixed.kvsnap")

    target = tmp_path / "target"
    init = run_kvctl("config", "init", "--out", target, "--tier", "cpu:0.1", "--tier",
                     shared_redis["server"].url + "/5", "--model", "tiny")
    assert init.code == 0, init.stderr
    refused = answer("snapshot", "load", mixed, "--config", target, *HALF, "--tier", "redis", code=1)
    assert f"chunk {OTHERS[-1]} is keyed for model other, not tiny" in refused.stderr, refused.stderr
    assert "hint: " in refused.stderr and "Traceback" not in refused.stderr
    server = shared_redis["server"]
    database = type(shared_redis["redis"])(host="127.0.0.1", port=server.port, password=server.password, db=5)
    assert database.dbsize() == 0
