"""`kvctl snapshot` against real LMCache engines and a real Redis: node A (a standalone engine with CPU, disk and
Redis tiers) caches a prompt; its snapshot, saved through the engine or from its configuration directory, loads
into configurations and engines that never saw the prompt, byte for byte, and those then hit it. What would make
other keys, a changed file, or a running engine's disk directory is refused with nothing written."""

import json
import os
import tarfile
from pathlib import Path

import pytest

from kvctl.core.lmcache.keys import KeyRecipe, disk_file_name, inprocess_keys
from tests.helpers import (
    Engine,
    edit_yaml,
    http_json,
    init_engine,
    run_cli,
    standalone_engine,
    tier_args,
    wait_until,
)

CHUNK = 256
CHUNK_BYTES = 2 * 2 * CHUNK * 64 * 2  # kv, layers, tokens, heads x head size, float16
TOKENS = list(range(1000, 1000 + 4 * CHUNK))
KEYS = inprocess_keys(TOKENS, KeyRecipe("tiny", CHUNK, "sha256_cbor", "0", kv_dtype="half"))
OFFLINE = ("--model", "tiny", "--kv-dtype", "float16")  # what the standalone engines serve


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path, monkeypatch):
    """No `kvctl serve` state of this machine's user is read (it could name a running engine)."""
    monkeypatch.setenv("KVCTL_CACHE_DIR", str(tmp_path / "kvctl-cache"))


@pytest.fixture(scope="module")
def node_a(tmp_path_factory, module_redis):
    """A running engine (CPU, disk, Redis) that has cached TOKENS on every tier; its tokens file."""
    root = tmp_path_factory.mktemp("node-a")
    redis = module_redis.client()
    with standalone_engine(root, "--tier", "cpu:0.1", "--tier", f"disk:{root}/disk:1", "--tier", module_redis.url,
                           "--model", "tiny") as url:
        http_json("POST", f"{url}/cache/store", params={"tokens_mock": f"{TOKENS[0]},{TOKENS[-1] + 1}"})
        files = [root / "disk" / disk_file_name(key) for key in KEYS]
        wait_until(lambda: all(path.exists() and path.stat().st_size == CHUNK_BYTES for path in files), 30, "disk")
        wait_until(lambda: all(redis.exists(key + "metadata") for key in KEYS), 30, "chunks in Redis")
        tokens = root / "tokens.json"
        tokens.write_text(json.dumps(TOKENS))
        yield {"url": url, "root": root, "config": root / "cfg", "tokens": tokens, "redis": redis,
               "redis_server": module_redis}


def configuration(root: Path, *tiers: str, **yaml_changes) -> tuple[Path, int]:
    """A fresh `kvctl config init` directory (no engine: Engine(root) runs one) with these tiers; its port_start."""
    engine = init_engine(root, *tier_args(*tiers), "--model", "tiny", **yaml_changes)
    return engine.config, engine.port_start


def answer(*args, code: int = 0):
    result = run_cli(*args, "--format", "json")
    assert result.code == code, result.stdout + result.stderr
    return json.loads(result.stdout) if code in (0, 6) else result


def disk_files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in directory.iterdir()} if directory.exists() else {}


@pytest.mark.slow
def test_saved_through_the_engine_and_loaded_into_a_configuration_an_engine_then_hits(node_a, tmp_path):
    snap = tmp_path / "warm.kvsnap"
    saved = answer("snapshot", "save", "--instance", node_a["url"], "--tokens-file", node_a["tokens"], "-o", snap)
    assert (saved["chunks"], saved["bytes"], saved["missing"]) == (4, 4 * CHUNK_BYTES, 0)
    listed = answer("snapshot", "ls", snap)
    assert listed["keys"] == {"model": "tiny", "kv_dtype": "half", "world_size": 1, "chunk_size": CHUNK,
                              "hash_algorithm": "sha256_cbor", "hash_seed": "0"}

    config, _ = configuration(tmp_path / "b", "cpu:0.1", f"disk:{tmp_path}/b/disk:1")
    loaded = answer("snapshot", "load", snap, "--config", config, *OFFLINE)
    assert loaded["written"] == {"disk": 4} and loaded["prompts"][0]["cached"] == 4
    assert loaded["prompts"][0]["hit_tokens"] == 4 * CHUNK
    a_files = disk_files(node_a["root"] / "disk")
    assert disk_files(tmp_path / "b" / "disk") == {disk_file_name(key): a_files[disk_file_name(key)] for key in KEYS}

    with Engine(tmp_path / "b") as engine_b:  # LMCache indexes the files at start (kvctl's disk index)
        found = answer("lookup", "--instance", engine_b.url, "--tokens-file", node_a["tokens"])
        assert found["hit_tokens"]["total"] == 4 * CHUNK
        assert all(chunk["tiers"] == ["disk"] for chunk in found["chunks"])


@pytest.mark.slow
def test_saved_from_a_configuration_and_loaded_into_another_redis(node_a, tmp_path):
    """Offline: disk bytes with Redis's metadata headers, written to another Redis database as LMCache would."""
    snap = tmp_path / "offline.kvsnap"
    saved = answer("snapshot", "save", "--config", node_a["config"], *OFFLINE, "--tokens-file", node_a["tokens"],
                   "-o", snap)
    assert saved["chunks"] == 4
    server = node_a["redis_server"]
    config, _ = configuration(tmp_path / "c", "cpu:0.1", server.url + "/3")
    loaded = answer("snapshot", "load", snap, "--config", config, *OFFLINE, "--tier", "redis")
    assert loaded["written"] == {"redis": 4} and loaded["prompts"][0]["hit_tokens"] == 4 * CHUNK
    redis = node_a["redis"]
    target = type(redis)(host="127.0.0.1", port=server.port, password=server.password, db=3)
    for key in KEYS:
        for suffix in ("kv_bytes", "metadata"):
            assert target.get(key + suffix) == redis.get(key + suffix)
    again = answer("snapshot", "load", snap, "--config", config, *OFFLINE, "--tier", "redis")
    assert again["written"] == {"redis": 0} and again["already"] == {"redis": 4}
    target.flushdb()


@pytest.mark.slow
def test_a_target_that_makes_other_keys_is_refused_with_nothing_written(node_a, tmp_path):
    snap = tmp_path / "warm.kvsnap"
    answer("snapshot", "save", "--instance", node_a["url"], "--tokens-file", node_a["tokens"], "-o", snap)
    config, _ = configuration(tmp_path / "d", "cpu:0.1", f"disk:{tmp_path}/d/disk:1", chunk_size=128)
    refused = answer("snapshot", "load", snap, "--config", config, *OFFLINE, code=2)
    assert "saved with chunk size 256" in refused.stderr and "makes keys with 128" in refused.stderr
    assert "hint: set the same chunk_size" in refused.stderr
    env = config / "env.sh"
    edit_yaml(config / "lmcache.yaml", chunk_size=CHUNK)
    env.write_text(env.read_text().replace("PYTHONHASHSEED=0", "PYTHONHASHSEED=7"))
    refused = answer("snapshot", "load", snap, "--config", config, *OFFLINE, code=2)
    assert "PYTHONHASHSEED 0" in refused.stderr and "makes keys with 7" in refused.stderr
    refused = answer("snapshot", "load", snap, "--config", config, "--model", "other", "--kv-dtype", "float16", code=2)
    assert "model name tiny" in refused.stderr
    assert disk_files(tmp_path / "d" / "disk") == {}


@pytest.mark.slow
def test_a_changed_snapshot_and_a_running_engines_disk_are_refused_with_nothing_written(node_a, tmp_path):
    snap = tmp_path / "warm.kvsnap"
    config, _ = configuration(tmp_path / "e", "cpu:0.1", f"disk:{tmp_path}/e/disk:1")
    for member in ("chunks/000000", "chunks/000003"):  # the last: the chunks before it are staged when it fails
        answer("snapshot", "save", "--instance", node_a["url"], "--tokens-file", node_a["tokens"], "-o", snap,
               "--force")
        with tarfile.open(snap) as archive:
            offset = archive.getmember(member).offset_data
        with open(snap, "r+b") as file:  # one bit of the chunk's data
            file.seek(offset + 1000)
            byte = file.read(1)
            file.seek(offset + 1000)
            file.write(bytes([byte[0] ^ 0x10]))
        refused = answer("snapshot", "load", snap, "--config", config, *OFFLINE, code=1)
        assert "checksum of chunk" in refused.stderr and disk_files(tmp_path / "e" / "disk") == {}, member

    answer("snapshot", "save", "--instance", node_a["url"], "--tokens-file", node_a["tokens"], "-o", snap, "--force")
    with standalone_engine(tmp_path / "f", "--tier", "cpu:0.1", "--tier", f"disk:{tmp_path}/f/disk:1",
                           "--model", "tiny") as url:
        refused = answer("snapshot", "load", snap, "--config", tmp_path / "f" / "cfg", *OFFLINE, code=2)
        assert f"running at {url}" in refused.stderr and f"--instance {url}" in refused.stderr
        assert not any(name.endswith(".pt") for name in os.listdir(tmp_path / "f" / "disk"))


@pytest.mark.slow
def test_a_partial_file_a_killed_load_left_does_not_block_the_next(node_a, tmp_path):
    snap = tmp_path / "warm.kvsnap"
    answer("snapshot", "save", "--instance", node_a["url"], "--tokens-file", node_a["tokens"], "-o", snap)
    config, _ = configuration(tmp_path / "g", "cpu:0.1", f"disk:{tmp_path}/g/disk:1")
    (tmp_path / "g" / "disk").mkdir(parents=True)
    for key in KEYS:  # what a load killed mid-write leaves, under any name it may have used
        (tmp_path / "g" / "disk" / f".{disk_file_name(key)}.kvctl-partial").write_bytes(b"half")
    loaded = answer("snapshot", "load", snap, "--config", config, *OFFLINE)
    assert loaded["written"] == {"disk": 4}
    a_files = disk_files(node_a["root"] / "disk")
    assert all(disk_files(tmp_path / "g" / "disk")[disk_file_name(key)] == a_files[disk_file_name(key)]
               for key in KEYS)


def test_a_save_from_a_disk_directory_takes_regular_chunk_files_only(tmp_path):
    """No engine: a link named like a chunk (to a private file elsewhere) and a FIFO named like one are not
    chunks, never read or waited on."""
    config, _ = configuration(tmp_path / "h", "cpu:0.1", f"disk:{tmp_path}/h/disk:1")
    disk = tmp_path / "h" / "disk"
    disk.mkdir()
    secret = tmp_path / "secret"
    secret.write_bytes(b"not yours " * 100)
    secret.chmod(0o600)
    (disk / disk_file_name(KEYS[0])).write_bytes(b"chunk " * 100)
    (disk / disk_file_name(KEYS[1])).symlink_to(secret)
    os.mkfifo(disk / disk_file_name(KEYS[2]))
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    snap = tmp_path / "warm.kvsnap"
    saved = answer("snapshot", "save", "--config", config, *OFFLINE, "--tokens-file", tokens, "-o", snap, code=6)
    assert (saved["chunks"], saved["missing"]) == (1, 3)
    assert b"not yours" not in snap.read_bytes()
