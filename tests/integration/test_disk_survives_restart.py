"""The local disk tier survives an engine restart (kvctl_plugins.disk_index), without deleting anything."""

import os

import pytest

from kvctl.clients.internal_api import InternalAPIClient
from kvctl.core.lmcache.keys import KeyRecipe, disk_file_name, inprocess_keys
from tests.helpers import edit_yaml, http_json, init_engine, wait_until

CHUNK = 256
CHUNK_BYTES = 2 * 2 * CHUNK * 64 * 2


def first_run(tmp_path):
    """A CPU + disk engine that stores 4 chunks and stops: (the stopped Engine, its disk dir)."""
    disk = tmp_path / "disk"
    with init_engine(tmp_path, "--tier", "cpu:0.1", "--tier", f"disk:{disk}:1") as engine:
        http_json("POST", f"{engine.url}/cache/store", params={"tokens_mock": f"0,{4 * CHUNK}"})
        # LMCache writes a chunk file in place: wait until all four are complete before stopping the engine
        wait_until(lambda: [p.stat().st_size for p in disk.glob("*.pt")] == [CHUNK_BYTES] * 4, 30, "disk files")
    return engine, disk


@pytest.mark.slow
def test_restarted_engine_gets_disk_hits_and_reports_what_it_skipped(tmp_path):
    engine, disk = first_run(tmp_path)
    keys = inprocess_keys(list(range(4 * CHUNK)), KeyRecipe("tiny", CHUNK, "sha256_cbor", "0", kv_dtype="half"))
    (disk / "garbage.pt").write_bytes(b"x" * 100)  # not a key: skipped and reported
    (disk / disk_file_name(keys[0].replace("@half", "@bfloat16"))).write_bytes(b"\0" * CHUNK_BYTES)  # another engine
    truncated = disk / "tiny@1@0@abcdef0123456789@half.pt"
    truncated.write_bytes(b"\0" * 1000)  # a key name, but not a chunk of this engine's size
    os.utime(disk / disk_file_name(keys[3]), (1, 1))  # the oldest file: indexed first, evicted first
    before = sorted(path.name for path in disk.iterdir())

    with engine:
        with InternalAPIClient(engine.url) as client:
            report = client.info()["disk_index"][0]
            assert (report["indexed"], report["indexed_bytes"]) == (4, 4 * CHUNK_BYTES)
            assert (report["untrusted"], report["other_engines"], report["over_budget"]) == (2, 1, 0)
            assert {entry["file"] for entry in report["untrusted_files"]} == {"garbage.pt", truncated.name}
            result = client.lookup(list(range(4 * CHUNK)))
            assert result["hit_tokens"] == {"cpu": 0, "disk": 4 * CHUNK, "total": 4 * CHUNK}
            assert client.keys("disk", limit=10)["keys"][0]["key"] == keys[3]  # LRU order follows file age
            disk_tier = next(tier for tier in client.info()["tiers"] if tier["tier"] == "disk")
            assert disk_tier["used_bytes"] == 4 * CHUNK_BYTES
        retrieved = http_json("POST", f"{engine.url}/cache/retrieve", params={"tokens_mock": f"0,{4 * CHUNK}"})
        assert retrieved["num_retrieved"] == 4 * CHUNK
    assert sorted(path.name for path in disk.iterdir()) == before  # nothing was deleted


@pytest.mark.slow
def test_files_beyond_the_budget_are_left_alone(tmp_path):
    engine, disk = first_run(tmp_path)
    edit_yaml(engine.config / "lmcache.yaml", max_local_disk_size=2.5 * CHUNK_BYTES / 1024**3)
    with engine, InternalAPIClient(engine.url) as client:
        report = client.info()["disk_index"][0]
        assert (report["indexed"], report["over_budget"]) == (2, 2)
    assert len(list(disk.glob("*.pt"))) == 4
