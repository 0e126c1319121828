"""kvctl's /kvctl/v1 routes inside a real LMCache engine (standalone, CPU + disk + Redis tiers)."""

import contextlib
import time

import pytest

from kvctl.clients.internal_api import InternalAPIClient
from kvctl.core.errors import RejectedError
from kvctl.core.lmcache.keys import KeyRecipe, disk_file_name, inprocess_keys
from tests.helpers import free_port, http_json, init_engine, run_kvctl, tier_args, wait_until

CHUNK = 256
CHUNK_BYTES = 2 * 2 * CHUNK * 64 * 2  # kv, layers, tokens, heads x head size, float16
CPU_GB = 0.02  # about 160 chunks: small enough to put under pressure


def tokens(start, chunks):
    return list(range(start, start + chunks * CHUNK))


def keys_of(token_ids):
    return inprocess_keys(token_ids, KeyRecipe("tiny", CHUNK, "sha256_cbor", "0", kv_dtype="half"))


@contextlib.contextmanager
def running_engine(root, *tiers: str, redis=None, **config):
    """A ready Engine (tests/helpers) on the tiers `kvctl config init --tier` takes, with `config` written over
    its lmcache.yaml; yields what the tests use (client, url, root, redis client, log)."""
    with init_engine(root, *tier_args(*tiers), redis=redis, **config) as engine, \
            InternalAPIClient(engine.url) as client:
        yield {"client": client, "url": engine.url, "root": root, "redis": engine.redis, "log": engine.log}


@pytest.fixture(scope="module")
def engine(tmp_path_factory, module_redis):
    root = tmp_path_factory.mktemp("routes")
    with running_engine(root, f"cpu:{CPU_GB}", f"disk:{root}/disk:1", module_redis.url, redis=module_redis,
                        pin_timeout_sec=3, pin_check_interval_sec=1) as started:
        yield started


def store(engine, start, chunks):
    result = http_json("POST", f"{engine['url']}/cache/store",
                       params={"tokens_mock": f"{start},{start + chunks * CHUNK}"})
    assert result["num_tokens"] == chunks * CHUNK
    names = [key + "metadata" for key in keys_of(tokens(start, chunks))]
    wait_until(lambda: all(engine["redis"].exists(name) for name in names), 30, "chunks in Redis")
    files = [engine["root"] / "disk" / disk_file_name(key) for key in keys_of(tokens(start, chunks))]
    # LMCache writes a chunk file in place and holds the CPU copy until the write is done
    wait_until(lambda: all(path.exists() and path.stat().st_size == CHUNK_BYTES for path in files), 30,
               "chunks on disk")


def cpu_keys(engine):
    return [entry["key"] for entry in engine["client"].keys("cpu", limit=10000)["keys"]]


@pytest.mark.slow
def test_info_describes_the_engine(engine):
    info = engine["client"].info()
    assert info["model"] == "tiny" and info["chunk_size"] == CHUNK and info["hash_algorithm"] == "sha256_cbor"
    assert info["kv_dtype"] == "float16" and info["world_size"] == 1 and info["worker_id"] == 0
    assert [tier["tier"] for tier in info["tiers"]] == ["cpu", "disk", "redis"]
    assert info["tiers"][0]["capacity_bytes"] == int(CPU_GB * 1024**3)


@pytest.mark.slow
def test_lookup_reports_every_tier_without_pinning_or_touching_lru(engine):
    store(engine, 0, 3)
    store(engine, 10_000, 2)
    before = cpu_keys(engine)
    result = engine["client"].lookup(tokens(0, 3) + [1, 2, 3])
    assert [chunk["key"] for chunk in result["chunks"]] == keys_of(tokens(0, 3))
    assert [chunk["tiers"] for chunk in result["chunks"]] == [["cpu", "disk", "redis"]] * 3
    assert result["hit_tokens"] == {"cpu": 3 * CHUNK, "disk": 3 * CHUNK, "redis": 3 * CHUNK, "total": 3 * CHUNK}
    assert cpu_keys(engine) == before  # LRU order unchanged: the older prompt was not moved to the end
    listed = engine["client"].keys("cpu", limit=10000)["keys"]
    assert not any(entry["pinned"] for entry in listed)


@pytest.mark.slow
def test_keys_are_paginated_with_sizes(engine):
    store(engine, 20_000, 3)
    first = engine["client"].keys("disk", offset=0, limit=2)
    assert len(first["keys"]) == 2 and first["next_offset"] == 2 and first["total"] >= 3
    assert all(entry["size"] == CHUNK_BYTES for entry in first["keys"])
    rest = engine["client"].keys("disk", offset=2, limit=10000)
    assert rest["next_offset"] is None and len(first["keys"]) + len(rest["keys"]) == first["total"]


@pytest.mark.slow
def test_pinned_chunks_survive_cpu_pressure_and_plain_evict(engine):
    store(engine, 30_000, 2)
    store(engine, 40_000, 2)
    pin = engine["client"].pin(tokens(30_000, 2), ttl_s=600)
    assert pin["pinned"] == {"cpu": 2, "disk": 2} and pin["chunks"] == 2
    pinned_keys, unpinned_keys = keys_of(tokens(30_000, 2)), keys_of(tokens(40_000, 2))
    http_json("POST", f"{engine['url']}/cache/store", params={"tokens_mock": f"100000,{100000 + 200 * CHUNK}"})
    present = set(cpu_keys(engine))
    assert set(pinned_keys) <= present  # 200 new chunks did not push the pinned ones out
    assert not set(unpinned_keys) & present  # … but did push out the unpinned ones stored at the same time
    time.sleep(5)  # longer than the engine's pin_timeout_sec (3 s): LMCache's PinMonitor would unpin
    listed = {entry["key"]: entry for entry in engine["client"].keys("cpu", limit=10000)["keys"]}
    assert all(listed[key]["pinned"] and listed[key]["kvctl_pinned"] for key in pinned_keys)
    refused = engine["client"].evict(tokens=tokens(30_000, 2), tiers=["cpu", "disk"])
    assert refused["removed"] == {"cpu": 0, "disk": 0} and refused["skipped_pinned"] == {"cpu": 2, "disk": 2}
    assert [p["pin_id"] for p in engine["client"].pins()] == [pin["pin_id"]]
    forced = engine["client"].evict(tokens=tokens(30_000, 2), tiers=["cpu", "disk"], force=True)
    assert forced["removed"] == {"cpu": 2, "disk": 2}
    engine["client"].unpin(pin_id=pin["pin_id"])
    assert engine["client"].pins() == []


@pytest.mark.slow
def test_pins_expire_after_their_ttl(engine):
    store(engine, 50_000, 1)
    pin = engine["client"].pin(tokens(50_000, 1), ttl_s=1)
    assert engine["client"].pins()[0]["pin_id"] == pin["pin_id"]
    time.sleep(1.5)
    assert engine["client"].pins() == []
    key = keys_of(tokens(50_000, 1))[0]
    listed = {entry["key"]: entry for entry in engine["client"].keys("cpu", limit=10000)["keys"]}
    assert key in listed and not listed[key]["pinned"]


@pytest.mark.slow
def test_evict_by_tokens_removes_exactly_that_prompt_on_every_tier(engine):
    store(engine, 60_000, 2)
    store(engine, 70_000, 2)
    doomed, kept = keys_of(tokens(60_000, 2)), keys_of(tokens(70_000, 2))
    dry = engine["client"].evict(tokens=tokens(60_000, 2), dry_run=True)
    assert dry["removed"] == {"cpu": 2, "disk": 2, "redis": 2}
    assert sorted(chunk["key"] for chunk in dry["chunks"]) == sorted(doomed * 3)
    assert engine["client"].lookup(tokens(60_000, 2))["hit_tokens"]["total"] == 2 * CHUNK  # dry run removed nothing
    done = engine["client"].evict(tokens=tokens(60_000, 2))
    assert done["removed"] == {"cpu": 2, "disk": 2, "redis": 2}
    after = engine["client"].lookup(tokens(60_000, 2))
    assert after["hit_tokens"] == {"cpu": 0, "disk": 0, "redis": 0, "total": 0}
    assert not any((engine["root"] / "disk" / disk_file_name(key)).exists() for key in doomed)
    assert not any(engine["redis"].exists(key + "metadata") or engine["redis"].exists(key + "kv_bytes")
                   for key in doomed)
    assert engine["client"].lookup(tokens(70_000, 2))["hit_tokens"]["total"] == 2 * CHUNK
    assert all((engine["root"] / "disk" / disk_file_name(key)).exists() for key in kept)


@pytest.mark.slow
def test_evict_by_keys_and_a_whole_tier(engine):
    store(engine, 80_000, 2)
    first, second = keys_of(tokens(80_000, 2))
    result = engine["client"].evict(keys=[second], tiers=["disk"])
    assert result["removed"] == {"disk": 1}
    assert engine["client"].lookup(tokens(80_000, 2))["chunks"][1]["tiers"] == ["cpu", "redis"]
    everything = engine["client"].evict(everything=True, tiers=["cpu"])
    assert everything["removed"]["cpu"] >= 2 and cpu_keys(engine) == []


@pytest.mark.slow
def test_prefetch_brings_lower_tier_chunks_into_cpu(engine):
    store(engine, 90_000, 2)
    engine["client"].evict(tokens=tokens(90_000, 2), tiers=["cpu"])
    assert engine["client"].lookup(tokens(90_000, 2))["hit_tokens"]["cpu"] == 0
    result = engine["client"].prefetch(tokens(90_000, 2))
    assert result == {"loaded": 2, "already_in_cpu": 0, "missing": 0}
    wait_until(lambda: engine["client"].lookup(tokens(90_000, 2))["hit_tokens"]["cpu"] == 2 * CHUNK, 10, "prefetch")


@pytest.mark.slow
@pytest.mark.parametrize(("call", "status_words"), [
    (lambda c: c.request("POST", "/kvctl/v1/lookup", {"tokens": "abc"}), "non-empty list"),
    (lambda c: c.request("POST", "/kvctl/v1/lookup", None), "non-empty list"),
    (lambda c: c.keys("gpu"), "no such tier"),
    (lambda c: c.unpin(pin_id="nope"), "no pin"),
    (lambda c: c.pin([1, 2], ttl_s=-5), "ttl_s"),
    (lambda c: c.evict(keys=["not-a-key"]), "not an LMCache chunk key"),
    (lambda c: c.evict(tokens=[1], keys=["a@1@0@1@half"]), "exactly one"),
])
def test_bad_requests_are_4xx_with_a_message(engine, call, status_words):
    with pytest.raises(RejectedError) as raised:
        call(engine["client"])
    assert status_words in raised.value.message


@pytest.mark.slow
def test_routes_over_the_unix_socket_variant(tmp_path):
    prefix = tmp_path / "sockets" / "lmcache"
    engine = init_engine(tmp_path, "--tier", "cpu:0.1", internal_api_server_socket_path_prefix=str(prefix)).launch()
    try:
        with InternalAPIClient(f"unix:{prefix}_{engine.port_start + 1}") as client:
            wait_until(lambda: client.version() == "0.5.6", 120, "engine on a Unix socket", engine.proc, engine.log)
            assert client.info()["tiers"][0]["tier"] == "cpu"
            assert client.lookup(tokens(0, 1))["hit_tokens"]["total"] == 0
    finally:
        engine.stop()


@pytest.mark.slow
def test_kvctl_lookup_against_the_live_engine(engine, tmp_path):
    import json

    store(engine, 110_000, 2)
    prompt = tmp_path / "tokens.json"
    prompt.write_text(json.dumps(tokens(110_000, 2) + [7] * 10))
    result = run_kvctl("lookup", "--instance", engine["url"], "--tokens-file", prompt, "--format", "json")
    assert result.code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["tiers_checked"] == ["cpu", "disk", "redis"]
    assert [chunk["tiers"] for chunk in report["chunks"]] == [["cpu", "disk", "redis"]] * 2
    assert report["hit_tokens"] == {"cpu": 2 * CHUNK, "disk": 2 * CHUNK, "redis": 2 * CHUNK, "total": 2 * CHUNK}
    assert [chunk["key"] for chunk in report["chunks"]] == keys_of(tokens(110_000, 2))
    down = run_kvctl("lookup", "--instance", f"http://127.0.0.1:{free_port()}", "--tokens-file", prompt)
    assert down.code == 3 and down.stderr.startswith("error: cannot reach LMCache's internal API")


@pytest.mark.slow
def test_stock_endpoints_through_the_client(engine):
    client = engine["client"]
    assert client.version() == "0.5.6"
    assert client.conf(["chunk_size"]) == {"chunk_size": CHUNK}
    assert client.meta()["model_name"] == "tiny"
    assert client.env()["PYTHONHASHSEED"] == "0"
    assert set(client.backends()) == {"LocalCPUBackend", "LocalDiskBackend", "RemoteBackend"}
    assert "lmcache:" in client.metrics()
    assert client.freeze(True)["freeze"] is True and client.freeze()["freeze"] is True
    assert client.freeze(False)["freeze"] is False
    assert client.hot_cache()["hot_cache"] is True
    store(engine, 120_000, 1)
    assert client.clear(["LocalCPUBackend"])["num_removed"] >= CHUNK

    def only_below_cpu():  # a chunk whose Redis write is still finishing is kept by the clear; ask again
        client.clear(["LocalCPUBackend"])
        return client.lookup(tokens(120_000, 1))["chunks"][0]["tiers"] == ["disk", "redis"]

    wait_until(only_below_cpu, 10, "CPU tier cleared")
