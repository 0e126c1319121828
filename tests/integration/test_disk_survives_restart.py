"""The local disk tier survives an engine restart (kvctl_plugins.disk_index), without deleting anything."""

import os

import pytest

from kvctl.clients.internal_api import InternalAPIClient
from kvctl.core.lmcache.keys import KeyRecipe, disk_file_name, inprocess_keys
from tests.helpers import edit_yaml, free_port, http_json, run_kvctl, start_standalone_engine, stop_process, wait_until

CHUNK = 256
CHUNK_BYTES = 2 * 2 * CHUNK * 64 * 2


def run_engine(config_dir, log, url):
    proc = start_standalone_engine(config_dir, log)
    try:
        wait_until(lambda: http_json("GET", f"{url}/lmc_version"), 120, "standalone engine", proc, log)
    except BaseException:
        stop_process(proc)  # an engine that never became ready is stopped too
        raise
    return proc


def first_run(tmp_path):
    """A CPU + disk engine that stores 4 chunks and stops: (config dir, disk dir, worker URL)."""
    port_start = free_port()
    disk = tmp_path / "disk"
    assert run_kvctl("config", "init", "--out", tmp_path / "cfg", "--tier", "cpu:0.1", "--tier", f"disk:{disk}:1",
                     "--internal-api-port-start", port_start).code == 0
    url = f"http://127.0.0.1:{port_start + 1}"
    proc = run_engine(tmp_path / "cfg", tmp_path / "first.log", url)
    try:
        http_json("POST", f"{url}/cache/store", params={"tokens_mock": f"0,{4 * CHUNK}"})
        # LMCache writes a chunk file in place: wait until all four are complete before stopping the engine
        wait_until(lambda: [p.stat().st_size for p in disk.glob("*.pt")] == [CHUNK_BYTES] * 4, 30, "disk files")
    finally:
        stop_process(proc)
    return tmp_path / "cfg", disk, url


@pytest.mark.slow
def test_restarted_engine_gets_disk_hits_and_reports_what_it_skipped(tmp_path):
    config, disk, url = first_run(tmp_path)
    keys = inprocess_keys(list(range(4 * CHUNK)), KeyRecipe("tiny", CHUNK, "sha256_cbor", "0", kv_dtype="half"))
    (disk / "garbage.pt").write_bytes(b"x" * 100)  # not a key: skipped and reported
    (disk / disk_file_name(keys[0].replace("@half", "@bfloat16"))).write_bytes(b"\0" * CHUNK_BYTES)  # another engine
    truncated = disk / "tiny@1@0@abcdef0123456789@half.pt"
    truncated.write_bytes(b"\0" * 1000)  # a key name, but not a chunk of this engine's size
    os.utime(disk / disk_file_name(keys[3]), (1, 1))  # the oldest file: indexed first, evicted first
    before = sorted(path.name for path in disk.iterdir())

    proc = run_engine(config, tmp_path / "second.log", url)
    try:
        with InternalAPIClient(url) as client:
            report = client.info()["disk_index"][0]
            assert (report["indexed"], report["indexed_bytes"]) == (4, 4 * CHUNK_BYTES)
            assert (report["untrusted"], report["other_engines"], report["over_budget"]) == (2, 1, 0)
            assert {entry["file"] for entry in report["untrusted_files"]} == {"garbage.pt", truncated.name}
            result = client.lookup(list(range(4 * CHUNK)))
            assert result["hit_tokens"] == {"cpu": 0, "disk": 4 * CHUNK, "total": 4 * CHUNK}
            assert client.keys("disk", limit=10)["keys"][0]["key"] == keys[3]  # LRU order follows file age
            disk_tier = next(tier for tier in client.info()["tiers"] if tier["tier"] == "disk")
            assert disk_tier["used_bytes"] == 4 * CHUNK_BYTES
        retrieved = http_json("POST", f"{url}/cache/retrieve", params={"tokens_mock": f"0,{4 * CHUNK}"})
        assert retrieved["num_retrieved"] == 4 * CHUNK
    finally:
        stop_process(proc)
    assert sorted(path.name for path in disk.iterdir()) == before  # nothing was deleted


@pytest.mark.slow
def test_files_beyond_the_budget_are_left_alone(tmp_path):
    config, disk, url = first_run(tmp_path)
    edit_yaml(config / "lmcache.yaml", max_local_disk_size=2.5 * CHUNK_BYTES / 1024**3)
    proc = run_engine(config, tmp_path / "second.log", url)
    try:
        with InternalAPIClient(url) as client:
            report = client.info()["disk_index"][0]
            assert (report["indexed"], report["over_budget"]) == (2, 2)
    finally:
        stop_process(proc)
    assert len(list(disk.glob("*.pt"))) == 4
