"""`kvctl ls`, `pin`, `unpin`, `pins` and `evict` against a real LMCache engine with kvctl's routes
(CPU + disk + Redis tiers, a real redis-server)."""

import json
import os
import pty
import select
import subprocess
import time

import pytest

from kvctl.cli.cache import parse_duration
from kvctl.core.errors import UsageError
from kvctl.core.lmcache.keys import KeyRecipe, disk_file_name, inprocess_keys
from tests.helpers import KVCTL, http_json, init_engine, run_kvctl, tier_args, wait_until

CHUNK = 256
CHUNK_BYTES = 2 * 2 * CHUNK * 64 * 2  # kv, layers, tokens, heads x head size, float16
RECIPE = KeyRecipe("tiny", CHUNK, "sha256_cbor", "0", kv_dtype="half")


@pytest.fixture(scope="module")
def engine(tmp_path_factory, module_redis):
    root = tmp_path_factory.mktemp("cache-commands")
    tiers = tier_args("cpu:0.1", f"disk:{root}/disk:1", module_redis.url)
    with init_engine(root, *tiers, redis=module_redis) as started:
        yield started


def store(engine, start, chunks):
    http_json("POST", f"{engine.url}/cache/store", params={"tokens_mock": f"{start},{start + chunks * CHUNK}"})
    path = engine.root / f"tokens-{start}.json"
    path.write_text(json.dumps(list(range(start, start + chunks * CHUNK))))
    keys = inprocess_keys(list(range(start, start + chunks * CHUNK)), RECIPE)
    files = [engine.root / "disk" / disk_file_name(key) for key in keys]
    wait_until(lambda: all(path.exists() and path.stat().st_size == CHUNK_BYTES for path in files), 30, "disk files")
    wait_until(lambda: all(engine.redis.exists(key + "metadata") for key in keys), 30, "chunks in Redis")
    return path


def test_durations():
    assert [parse_duration(text) for text in ("600", "30s", "10m", "2h", "1.5d")] == [600, 30, 600, 7200, 129600]
    for bad in ("", "10x", "-5", "0"):
        with pytest.raises(UsageError):
            parse_duration(bad)


@pytest.mark.slow
def test_pin_pins_unpin(engine):
    tokens = store(engine, 0, 2)
    pinned = engine.kvctl("pin", "--tokens-file", tokens, "--ttl", "10m")
    assert pinned.code == 0, pinned.stderr
    pin = json.loads(pinned.stdout)
    assert pin["pinned"] == {"cpu": 2, "disk": 2} and 590 < pin["ttl_remaining_s"] <= 600
    listed = engine.answer("pins")["pins"]
    assert [entry["pin_id"] for entry in listed] == [pin["pin_id"]]
    kept = engine.answer("evict", "--tokens-file", tokens, "--yes")
    # a pinned chunk keeps its copies on every tier, Redis included, unless --force
    assert kept["removed"] == {"cpu": 0, "disk": 0, "redis": 0}
    assert kept["skipped_pinned"] == {"cpu": 2, "disk": 2, "redis": 2}
    released = engine.answer("unpin", "--tokens-file", tokens)["unpinned"]
    assert [entry["pin_id"] for entry in released] == [pin["pin_id"]]
    assert engine.answer("pins")["pins"] == []
    assert engine.kvctl("unpin", "--pin-id", "nope").code == 4


@pytest.mark.slow
def test_evict_asks_for_yes_lists_on_dry_run_and_removes(engine):
    tokens = store(engine, 10_000, 2)
    dry = engine.answer("evict", "--tokens-file", tokens, "--dry-run")
    assert dry["dry_run"] and dry["removed"] == {"cpu": 2, "disk": 2, "redis": 2} and len(dry["chunks"]) == 6
    refused = engine.kvctl("evict", "--tokens-file", tokens)
    assert refused.code == 2 and "without --yes" in refused.stderr
    lookup = json.loads(run_kvctl("lookup", "--instance", engine.url, "--tokens-file", tokens).stdout)
    assert lookup["hit_tokens"]["total"] == 2 * CHUNK  # neither the dry run nor the refusal removed anything
    done = engine.answer("evict", "--tokens-file", tokens, "--tier", "disk", "--yes")
    assert done["removed"] == {"disk": 2}
    after = json.loads(run_kvctl("lookup", "--instance", engine.url, "--tokens-file", tokens).stdout)
    assert [chunk["tiers"] for chunk in after["chunks"]] == [["cpu", "redis"], ["cpu", "redis"]]
    everything = engine.answer("evict", "--tier", "cpu", "--yes")
    assert everything["removed"]["cpu"] >= 2
    assert engine.kvctl("evict").code == 2


@pytest.mark.slow
def test_ls_lists_every_tier_with_sizes_pins_and_totals(engine):
    tokens = store(engine, 20_000, 3)
    keys = inprocess_keys(json.loads(tokens.read_text()), RECIPE)
    engine.redis.set("other@1@0@abc@halfmetadata", b"m")  # another model's chunk in a shared Redis
    pin = engine.answer("pin", "--tokens-file", tokens)
    try:
        listed = engine.kvctl("ls")
        assert listed.code == 0, listed.stderr
        tiers = {tier["tier"]: tier for tier in json.loads(listed.stdout)["tiers"]}
        assert set(tiers) == {"cpu", "disk", "redis"}
        for name, tier in tiers.items():
            chunks = {chunk["key"]: chunk for chunk in tier["chunks"]}
            assert set(keys) <= set(chunks) and tier["total"] == len(chunks), name
            assert all(chunks[key]["size"] == CHUNK_BYTES for key in keys), name
        assert all(tiers["cpu"]["chunks"][i]["kvctl_pinned"] for i, c in enumerate(tiers["cpu"]["chunks"])
                   if c["key"] in keys)
        assert "other@1@0@abc@half" in {chunk["key"] for chunk in tiers["redis"]["chunks"]}
        ours = engine.answer("ls", "--tier", "redis", "--model", "tiny", "--limit", "1")["tiers"]
        assert [(t["tier"], t["listed"], t["total"]) for t in ours] == [("redis", 1, tiers["redis"]["total"] - 1)]
        offline = run_kvctl("ls", "--config", engine.config, "--tier", "disk", "--format", "json")
        (disk,) = json.loads(offline.stdout)["tiers"]
        files = {chunk["key"]: chunk for chunk in disk["chunks"]}
        assert disk["source"] == "directory" and all(files[key]["age_s"] >= 0 for key in keys)
    finally:
        engine.kvctl("unpin", "--pin-id", pin["pin_id"])
        engine.redis.delete("other@1@0@abc@halfmetadata")


@pytest.mark.slow
def test_evict_whole_redis_tier_takes_only_this_models_unpinned_chunks(engine):
    tokens = store(engine, 30_000, 2)
    pinned_tokens = store(engine, 40_000, 1)
    pinned_key = inprocess_keys(json.loads(pinned_tokens.read_text()), RECIPE)[0]
    pin = engine.answer("pin", "--tokens-file", pinned_tokens)
    ours = set(engine.redis.scan_iter("tiny@*"))
    # another model's chunk, a plain key, and names of this model's shape whose fields LMCache never writes
    foreign = ["other@1@0@abc@halfmetadata", "other@1@0@abc@halfkv_bytes", "session:42",
               "tiny@1@0@session-token@bfloat16metadata", "tiny@1@0@session-token@bfloat16kv_bytes",
               "tiny@2024@12@report@halfmetadata", "tiny@1@0@00ab@halfmetadata", "tiny@v2@1@0@abc@halfmetadata"]
    engine.redis.mset({name: b"x" for name in foreign})
    dry = engine.answer("evict", "--tier", "redis", "--dry-run")
    assert dry["removed"] == {"redis": len(ours) // 2 - 1} and dry["skipped_pinned"] == {"redis": 1}
    assert {c["key"][:5] for c in dry["chunks"]} == {"tiny@"} and pinned_key not in {c["key"] for c in dry["chunks"]}
    assert set(engine.redis.scan_iter("tiny@*")) == ours | {name.encode() for name in foreign if name[:5] == "tiny@"}
    done = engine.answer("evict", "--tier", "redis", "--yes")
    assert done["removed"] == dry["removed"] and done["chunks"] == dry["chunks"]
    left = {name for name in engine.redis.scan_iter("tiny@*")} - {name.encode() for name in foreign}
    assert sorted(left) == sorted(f"{pinned_key}{s}".encode() for s in ("kv_bytes", "metadata"))
    assert all(engine.redis.exists(name) for name in foreign)  # nothing the user did not select
    after = engine.answer("lookup", "--tokens-file", tokens)
    assert [chunk["tiers"] for chunk in after["chunks"]] == [["cpu", "disk"]] * 2
    forced = engine.answer("evict", "--tier", "redis", "--yes", "--force")
    assert forced["removed"] == {"redis": 1} and not left & set(engine.redis.scan_iter("tiny@*"))
    assert all(engine.redis.exists(name) for name in foreign)
    engine.answer("unpin", "--pin-id", pin["pin_id"])
    engine.redis.delete(*foreign)


@pytest.mark.slow
def test_removed_counts_what_redis_removed(engine):
    tokens = store(engine, 50_000, 2)
    first, second = inprocess_keys(json.loads(tokens.read_text()), RECIPE)
    engine.redis.delete(second + "kv_bytes", second + "metadata")  # gone between the plan and the removal
    done = engine.answer("evict", "--key", first, "--key", second, "--tier", "redis", "--yes")
    assert done["removed"] == {"redis": 1} and done["chunks"] == [{"tier": "redis", "key": first}]
    assert not engine.redis.exists(first + "kv_bytes", first + "metadata")


@pytest.mark.slow
def test_disk_listing_by_model_takes_the_whole_model_field(engine, tmp_path):
    store(engine, 60_000, 1)
    disk = engine.root / "disk"
    lookalikes = ["tiny@v2@1@0@abc@half.pt", "tiny@1@0@report@half.pt", "tiny@1@0@\x1b[31mred@half.pt"]
    for name in lookalikes:
        (disk / name).write_bytes(b"x")
    try:
        listed = run_kvctl("ls", "--config", engine.config, "--tier", "disk", "--model", "tiny",
                           "--limit", "1000", "--format", "json")
        keys = {chunk["key"] for chunk in json.loads(listed.stdout)["tiers"][0]["chunks"]}
        assert keys and all(key.startswith("tiny@1@0@") for key in keys) and not {"tiny@v2@1@0@abc@half"} & keys
        other = run_kvctl("ls", "--config", engine.config, "--tier", "disk", "--model", "tiny@v2",
                          "--format", "json")
        assert [chunk["key"] for chunk in json.loads(other.stdout)["tiers"][0]["chunks"]] == ["tiny@v2@1@0@abc@half"]
    finally:
        for name in lookalikes:
            (disk / name).unlink()


@pytest.mark.slow
def test_control_characters_in_stored_keys_never_reach_the_terminal(engine):
    hostile = "evil\x1b]0;pwned\x07\x1b[2J@1@0@abc@half"
    engine.redis.set(hostile + "metadata", b"m")
    try:
        shown = run_kvctl("ls", "--instance", engine.url, "--tier", "redis", "--format", "table",
                          env={"COLUMNS": "200"})
        assert shown.code == 0, shown.stderr
        assert "\x1b" not in shown.stdout and "\x07" not in shown.stdout
        assert "evil\\x1b]0;pwned\\x07" in shown.stdout.replace("\n", "")
    finally:
        engine.redis.delete(hostile + "metadata")


def read_until(leader, text: bytes, timeout: float) -> bytes:
    """What the terminal shows until `text` appears, the program closes it, or `timeout` passes."""
    output, deadline = b"", time.monotonic() + timeout
    while text not in output and time.monotonic() < deadline:
        if select.select([leader], [], [], 0.5)[0]:
            try:
                output += os.read(leader, 65536)
            except OSError:  # the program exited and closed the terminal
                break
    return output


@pytest.mark.slow
def test_the_confirmed_plan_is_what_goes(engine):
    """Chunks written while kvctl waits for the answer are not taken: the run removes what was shown."""
    store(engine, 70_000, 2)
    planned = engine.answer("evict", "--tier", "disk", "--dry-run")["chunks"]
    leader, follower = pty.openpty()
    proc = subprocess.Popen([str(KVCTL), "evict", "--tier", "disk", "--instance", engine.url, "--format", "json"],
                            stdin=follower, stdout=follower, stderr=follower)
    os.close(follower)
    try:
        asked = read_until(leader, b"evict", 60)
        assert f"disk: {len(planned)}".encode() in asked, asked
        late = store(engine, 80_000, 1)  # written after the plan, before the answer
        os.write(leader, b"y\n")
        shown = read_until(leader, b"\n}", 60)
        assert proc.wait(60) == 0
    finally:
        proc.kill()
        os.close(leader)
    late_key = inprocess_keys(json.loads(late.read_text()), RECIPE)[0]
    assert (engine.root / "disk" / disk_file_name(late_key)).exists()
    assert b"Traceback" not in shown
    after = engine.answer("lookup", "--tokens-file", late)
    assert after["chunks"][0]["tiers"] == ["cpu", "disk", "redis"]
