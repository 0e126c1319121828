"""A configuration's disk directory written and evicted with no engine (#20 items 5, 7, 8): a load keeps to
max_local_disk_size, a load killed by SIGTERM leaves no partial file, stale partial files are found and removed,
and a live engine using the same disk directory (or Redis, for the same model) under another configuration
stops an eviction. The chunk files are kvctl's to read as bytes: random ones stand in where no engine reads them."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from kvctl.core.lmcache.keys import KeyRecipe, disk_file_name, inprocess_keys
from tests.helpers import (
    KVCTL,
    http_json,
    init_engine,
    run_cli,
    standalone_engine,
    stop_process,
    tier_args,
    wait_until,
)
from tests.integration.test_snapshot import CHUNK, CHUNK_BYTES, OFFLINE, answer, configuration

PARTIAL = ".kvctl-partial"


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path, monkeypatch):
    """No `kvctl serve` state of this machine's user is read (it could name a running engine)."""
    monkeypatch.setenv("KVCTL_CACHE_DIR", str(tmp_path / "kvctl-cache"))


def warm_snapshot(root: Path, chunks: int, size: int) -> tuple[Path, dict[str, bytes]]:
    """A snapshot of a prompt of `chunks` chunks of `size` random bytes each, saved from a configuration's disk
    directory; the chunk files by name."""
    tokens = list(range(5000, 5000 + chunks * CHUNK))
    keys = inprocess_keys(tokens, KeyRecipe("tiny", CHUNK, "sha256_cbor", "0", kv_dtype="half"))
    config, _ = configuration(root, "cpu:0.1", f"disk:{root}/disk:1")
    (root / "disk").mkdir()
    files = {disk_file_name(key): os.urandom(size) for key in keys}
    for name, data in files.items():
        (root / "disk" / name).write_bytes(data)
    (root / "tokens.json").write_text(json.dumps(tokens))
    snap = root / "warm.kvsnap"
    answer("snapshot", "save", "--config", config, *OFFLINE, "--tokens-file", root / "tokens.json", "-o", snap)
    return snap, files


def partials(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(PARTIAL)) if directory.exists() else []


def chunk_files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in directory.glob("*.pt")}


@pytest.mark.slow
def test_a_disk_directory_moved_through_a_snapshot_arrives_byte_for_byte(tmp_path):
    """More chunks than a save keeps in flight while hashing (16) and a load verifies ahead: a chunk put,
    hashed or written at the wrong place shows here as a refused load or a changed file."""
    snap, files = warm_snapshot(tmp_path / "source", 40, CHUNK_BYTES)
    config, _ = configuration(tmp_path / "target", "cpu:0.1", f"disk:{tmp_path}/target/disk:1")
    loaded = answer("snapshot", "load", snap, "--config", config, *OFFLINE)
    assert loaded["written"] == {"disk": 40}
    assert chunk_files(tmp_path / "target" / "disk") == files


@pytest.mark.slow
def test_a_load_keeps_to_the_disk_budget_whole_chunks_and_drops_the_rest(tmp_path):
    snap, files = warm_snapshot(tmp_path / "source", 4, CHUNK_BYTES)
    budget = 2.5 * CHUNK_BYTES  # two chunks fit, a third would not
    config, _ = configuration(tmp_path / "target", "cpu:0.1", f"disk:{tmp_path}/target/disk:1",
                              max_local_disk_size=budget / 1024**3)
    loaded = answer("snapshot", "load", snap, "--config", config, *OFFLINE, code=6)
    assert (loaded["written"], loaded["dropped"]) == ({"disk": 2}, {"disk": 2})
    kept = chunk_files(tmp_path / "target" / "disk")
    assert len(kept) == 2 and all(files[name] == data for name, data in kept.items())  # whole chunks, the first two
    assert partials(tmp_path / "target" / "disk") == []

    again = answer("snapshot", "load", snap, "--config", config, *OFFLINE, code=6)  # the two there count
    assert (again["written"], again["already"], again["dropped"]) == ({"disk": 0}, {"disk": 2}, {"disk": 2})
    assert chunk_files(tmp_path / "target" / "disk") == kept


@pytest.mark.slow
def test_a_load_stopped_by_sigterm_removes_its_partial_files_and_a_live_loads_are_not_stale(tmp_path):
    snap, files = warm_snapshot(tmp_path / "source", 192, 512 * 1024)  # 96 MiB: long enough to catch mid-write
    config, _ = configuration(tmp_path / "target", "cpu:0.1", f"disk:{tmp_path}/target/disk:4")
    disk = tmp_path / "target" / "disk"
    proc = subprocess.Popen([str(KVCTL), "snapshot", "load", str(snap), "--config", str(config), *OFFLINE],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not partials(disk) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)
        os.kill(proc.pid, signal.SIGSTOP)  # mid-write: its partial files are a live load's
        assert partials(disk) and not chunk_files(disk), "the load ended before it was caught writing"
        planned = run_cli("evict", "--config", config, "--tier", "disk", "--all", "--model", "tiny", "--dry-run",
                          "--format", "json")
        assert planned.code == 0 and "partial_files" not in json.loads(planned.stdout), planned.stdout
        assert "a kvctl load is writing into" in planned.stderr
        assert "partial file" not in run_cli("doctor", "--config", config, "--format", "json").stdout
        os.kill(proc.pid, signal.SIGTERM)
        os.kill(proc.pid, signal.SIGCONT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        stop_process(proc)
    assert proc.returncode == 130, stderr  # interrupted, as by Ctrl-C
    assert partials(disk) == []
    assert all(files[name] == data for name, data in chunk_files(disk).items())  # whatever was renamed is whole


def test_an_interrupt_just_after_a_partial_file_is_created_still_removes_it(tmp_path, monkeypatch):
    """A SIGTERM's KeyboardInterrupt lands between bytecodes: one landing right after the open() that created a
    partial file (before its write) must still find the file to remove. CI once left one behind this way."""
    from kvctl.core.instance import offline
    from kvctl.core.instance.protocol import StoredChunk
    from kvctl.core.lmcache.deployment import Store

    store = offline.DirectoryStore(Store("disk", "lmcache-disk", (str(tmp_path),)))
    real_open, created = os.open, []

    def open_then_interrupted(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        if str(path).endswith(PARTIAL):
            created.append(path)
            os.close(fd)
            raise KeyboardInterrupt  # as the SIGTERM handler raises it, at the next bytecode
        return fd

    monkeypatch.setattr(offline.os, "open", open_then_interrupted)
    keys = inprocess_keys(list(range(3 * CHUNK)), KeyRecipe("tiny", CHUNK, "sha256_cbor", "0", kv_dtype="half"))
    with pytest.raises(KeyboardInterrupt):
        store.write(StoredChunk(key, b"x" * 64) for key in keys)
    monkeypatch.undo()
    assert len(created) == 1 and os.listdir(tmp_path) == []


@pytest.mark.slow
def test_stale_partial_files_are_listed_by_doctor_and_a_dry_run_and_removed_by_the_eviction(tmp_path):
    snap, files = warm_snapshot(tmp_path / "source", 2, CHUNK_BYTES)
    config, _ = configuration(tmp_path / "target", "cpu:0.1", f"disk:{tmp_path}/target/disk:1")
    answer("snapshot", "load", snap, "--config", config, *OFFLINE)
    disk = tmp_path / "target" / "disk"
    first, second = sorted(files)
    stale = [f".{first}.{index:08x}{PARTIAL}" for index in range(3)]  # what a killed load (or an older kvctl) left
    for name in stale:
        (disk / name).write_bytes(b"half" * 1000)

    doctor = json.loads(run_cli("doctor", "--config", config, "--format", "json").stdout)
    found = [finding for finding in doctor["findings"] if "stale kvctl partial" in finding["what"]]
    assert len(found) == 1 and "3 stale" in found[0]["what"] and "kvctl evict" in found[0]["hint"], doctor
    assert not any("no LMCache chunk" in finding["what"] for finding in doctor["findings"])

    key = next(key for key in json.loads(run_cli("ls", "--config", config, "--format", "json").stdout)["tiers"][0]
               ["chunks"] if disk_file_name(key["key"]) == first)["key"]
    dry = run_cli("evict", "--config", config, "--key", key, "--dry-run", "--format", "json")
    assert dry.code == 0 and json.loads(dry.stdout)["partial_files"] == [str(disk / name) for name in sorted(stale)]
    assert "3 stale partial file(s)" in dry.stderr
    assert partials(disk) == sorted(stale) and set(chunk_files(disk)) == {first, second}  # a dry run removes nothing

    done = run_cli("evict", "--config", config, "--key", key, "--yes", "--format", "json")
    assert done.code == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["removed"] == {"disk": 1} and len(result["partial_files"]) == 3
    assert partials(disk) == [] and set(chunk_files(disk)) == {second}
    assert "partial file" not in run_cli("doctor", "--config", config, "--format", "json").stdout


@pytest.mark.slow
def test_another_configuration_naming_a_live_engines_disk_directory_is_refused(tmp_path):
    root = tmp_path / "engine"
    tokens = list(range(1000, 1000 + 2 * CHUNK))
    with standalone_engine(root, "--tier", "cpu:0.1", "--tier", f"disk:{root}/disk:1", "--model", "tiny") as url:
        http_json("POST", f"{url}/cache/store", params={"tokens_mock": f"{tokens[0]},{tokens[-1] + 1}"})
        wait_until(lambda: len(chunk_files(root / "disk")) == 2, 30, "chunks on disk")
        held = chunk_files(root / "disk")
        other, _ = configuration(tmp_path / "other", "cpu:0.1", f"disk:{root}/disk:1")  # its own API port
        for dry in ((), ("--dry-run",)):
            refused = run_cli("evict", "--config", other, "--tier", "disk", "--all", "--model", "tiny", "--yes", *dry)
            assert refused.code == 2, refused.stdout + refused.stderr
            assert f"an engine using the disk directory {root}/disk" in refused.stderr
            assert f"is running at {url} (pid " in refused.stderr
            assert f"kvctl evict --instance {url}" in refused.stderr and "--force" in refused.stderr
        snap, _ = warm_snapshot(tmp_path / "source", 2, CHUNK_BYTES)
        loading = run_cli("snapshot", "load", snap, "--config", other, *OFFLINE)
        assert loading.code == 2 and f"load through it: --instance {url}" in loading.stderr, loading.stderr
        assert chunk_files(root / "disk") == held and partials(root / "disk") == []


@pytest.mark.slow
def test_a_kvctl_serve_sharing_the_disk_directory_or_redis_for_the_model_refuses_an_eviction(tmp_path, redis_server):
    served, _ = configuration(tmp_path / "served", "cpu:0.1", f"disk:{tmp_path}/shared:1", redis_server.url)
    state = {"name": "demo", "mode": "inprocess", "config_dir": str(served), "kvctl_pid": os.getpid(),
             "model": "tiny", "endpoints": {"internal_api": ["http://127.0.0.1:1"]}, "processes": []}
    path = Path(os.environ["KVCTL_CACHE_DIR"]) / "serve" / "demo" / "state.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(state))

    same_disk, _ = configuration(tmp_path / "disk", "cpu:0.1", f"disk:{tmp_path}/shared:1")
    refused = run_cli("evict", "--config", same_disk, "--all", "--dry-run")
    assert refused.code == 2 and "using the disk directory" in refused.stderr and "127.0.0.1:1" in refused.stderr

    same_redis, _ = configuration(tmp_path / "redis", "cpu:0.1", redis_server.url)
    refused = run_cli("evict", "--config", same_redis, "--all", "--dry-run")
    assert refused.code == 2 and "using the same Redis" in refused.stderr, refused.stderr
    other_model = run_cli("evict", "--config", same_redis, "--all", "--model", "other", "--dry-run")
    assert other_model.code == 0, other_model.stderr  # another model's chunks are not in its way


@pytest.mark.slow
def test_a_stock_engine_still_plans_the_eviction_of_its_own_disk_tier(tmp_path):
    """A stock engine (no kvctl routes) is evicted through its stores directly: the engine that runs is itself."""
    with init_engine(tmp_path, *tier_args("cpu:0.05", f"disk:{tmp_path}/disk:1"), plugins=False) as engine:
        http_json("POST", f"{engine.url}/cache/store?tokens_mock=0,{2 * CHUNK}")
        wait_until(lambda: len(chunk_files(tmp_path / "disk")) == 2, 30, "chunks on disk")
        planned = run_cli("evict", "--instance", engine.url, "--tier", "disk", "--all", "--model", "tiny",
                          "--dry-run", "--format", "json")
        assert planned.code == 0 and json.loads(planned.stdout)["removed"] == {"disk": 2}, planned.stderr
