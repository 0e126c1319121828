"""kvctl's routes against LMCache's own state and against hostile requests: a real standalone engine
(CPU, a disk tier of a few chunks, Redis), a CPU-only engine, and a real `lmcache server`."""

import socket
import threading
import time

import pytest

from kvctl.clients.mp_server import MPServerClient
from kvctl.core.errors import RejectedError
from kvctl.core.lmcache.keys import disk_file_name
from tests.helpers import http_client, http_json, wait_until
from tests.integration.test_mp_l1_lookup import server  # noqa: F401 - the MP server fixture
from tests.integration.test_plugin_routes import CHUNK, CHUNK_BYTES, CPU_GB, keys_of, running_engine, store, tokens

DISK_CHUNKS = 4  # the disk budget holds 4 chunks and a half
MAX_BODY = 16 * 1024 * 1024


@pytest.fixture(scope="module")
def engine(tmp_path_factory, module_redis):
    root = tmp_path_factory.mktemp("route-safety")
    budget_gb = (DISK_CHUNKS + 0.5) * CHUNK_BYTES / 1024**3
    # /run_script (off in every generated config) lets the tests make LMCache itself pin and read chunks
    with running_engine(root, f"cpu:{CPU_GB}", f"disk:{root}/disk:1", module_redis.url, redis=module_redis,
                        max_local_disk_size=budget_gb, run_script_api_enabled=True) as started:
        yield started


def settled(engine, start, chunks):
    """Store, then wait until LMCache no longer holds the chunks (its disk write keeps the CPU copy)."""
    store(engine, start, chunks)
    wait_until(lambda: not any(engine["client"].evict(tokens=tokens(start, chunks), dry_run=True)
                               ["skipped_pinned"].values()), 10, "chunks at rest")


def in_engine(engine, script: str) -> str:
    """Run Python inside the engine through LMCache's stock /run_script route."""
    prelude = ("e = app.state.lmcache_adapter.lmcache_engine\n"
               "cpu = e.storage_manager.storage_backends['LocalCPUBackend']\n")
    response = http_client().post(f"{engine['url']}/run_script", files={"script": ("s.py", prelude + script)},
                                  timeout=30)
    assert response.status_code == 200, response.text
    return response.text


def disk_files(engine):
    return {path.name: path.stat().st_size for path in (engine["root"] / "disk").glob("*.pt")}


def disk_used(engine):
    return next(tier for tier in engine["client"].info()["tiers"] if tier["tier"] == "disk")["used_bytes"]


# -- 1. disk accounting --------------------------------------------------------------------------


@pytest.mark.slow
def test_evicting_from_disk_gives_its_budget_back(engine):
    """LMCache's remove() leaves current_cache_size alone: the tier stayed "full" and refused new chunks."""
    settled(engine, 200_000, DISK_CHUNKS)  # fills the disk budget (older chunks go by LMCache's own eviction)
    assert disk_used(engine) == DISK_CHUNKS * CHUNK_BYTES
    assert engine["client"].evict(tokens=tokens(200_000, DISK_CHUNKS),
                                  tiers=["disk"])["removed"] == {"disk": DISK_CHUNKS}
    assert disk_files(engine) == {} and disk_used(engine) == 0
    settled(engine, 210_000, 2)  # waits for both chunk files on disk
    assert set(disk_files(engine)) == {disk_file_name(key) for key in keys_of(tokens(210_000, 2))}
    assert disk_used(engine) == sum(disk_files(engine).values()) == 2 * CHUNK_BYTES


# -- 2. chunks LMCache holds ---------------------------------------------------------------------

HOLDERS = {  # tier, how LMCache takes hold of the prompt's chunks T, how it lets go
    "lookup-pin-cpu": ("cpu", "e.lookup(tokens=T, lookup_id='kvctl-test', pin=True)", "e.lookup_unpin('kvctl-test')"),
    "lookup-pin-disk": ("disk", "e.lookup(tokens=T, lookup_id='kvctl-test', pin=True)", "e.lookup_unpin('kvctl-test')"),
    "reader-cpu": ("cpu", "app.state.kvctl_reads = []\nfor _, _, k in e.token_database.process_tokens(tokens=T):\n"
                          "    app.state.kvctl_reads.append(cpu.get_blocking(k))",
                   "for m in app.state.kvctl_reads:\n    m.ref_count_down()"),
}


@pytest.mark.slow
@pytest.mark.parametrize("holder", HOLDERS)
@pytest.mark.parametrize("selector", ["tokens", "all"])
def test_chunks_lmcache_holds_stay_unless_forced(engine, holder, selector):
    tier, hold, release = HOLDERS[holder]
    start = {"tokens": 300_000, "all": 310_000}[selector] + 1000 * list(HOLDERS).index(holder)
    prompt, keys = tokens(start, 2), keys_of(tokens(start, 2))
    settled(engine, start, 2)
    if tier == "disk":  # a lookup pins where it finds a chunk first
        engine["client"].evict(tokens=prompt, tiers=["cpu"])
    selection = {"tokens": prompt} if selector == "tokens" else {"everything": True}
    in_engine(engine, f"T = {prompt}\n{hold}")
    try:
        planned = engine["client"].evict(**selection, tiers=[tier], dry_run=True)
        kept = engine["client"].evict(**selection, tiers=[tier])
        for result in (planned, kept):
            assert not {chunk["key"] for chunk in result["chunks"]} & set(keys)
            assert result["skipped_pinned"][tier] >= 2 and result["held_by_lmcache"][tier] >= 2
        assert engine["client"].lookup(prompt)["hit_tokens"][tier] == 2 * CHUNK
        forced = engine["client"].evict(tokens=prompt, tiers=[tier], force=True)
        assert forced["removed"] == {tier: 2}
        assert engine["client"].lookup(prompt)["hit_tokens"][tier] == 0
    finally:
        in_engine(engine, f"T = {prompt}\n{release}")


@pytest.mark.slow
def test_a_forced_eviction_ends_the_kvctl_pins_on_it(engine):
    """The pins went with the removed chunk: unpinning later must not unpin the chunk stored again."""
    prompt = tokens(400_000, 1)
    settled(engine, 400_000, 1)
    first = engine["client"].pin(prompt, ttl_s=600)
    forced = engine["client"].evict(tokens=prompt, tiers=["cpu", "disk"], force=True)
    assert forced["removed"] == {"cpu": 1, "disk": 1}
    assert [pin["pinned"] for pin in engine["client"].pins() if pin["pin_id"] == first["pin_id"]] == [{}]
    settled(engine, 400_000, 1)
    second = engine["client"].pin(prompt, ttl_s=600)
    engine["client"].unpin(pin_id=first["pin_id"])
    try:
        for tier in ("cpu", "disk"):
            listed = {entry["key"]: entry for entry in engine["client"].keys(tier, limit=10000)["keys"]}
            assert listed[keys_of(prompt)[0]]["pinned"] and listed[keys_of(prompt)[0]]["kvctl_pinned"]
        kept = engine["client"].evict(tokens=prompt, tiers=["cpu", "disk"])
        assert kept["removed"] == {"cpu": 0, "disk": 0} and kept["skipped_pinned"] == {"cpu": 1, "disk": 1}
    finally:
        engine["client"].unpin(pin_id=second["pin_id"])


# -- 3. pins on an engine without a disk tier ----------------------------------------------------


@pytest.mark.slow
def test_pin_without_tiers_on_a_cpu_only_engine(tmp_path):
    with running_engine(tmp_path, "cpu:0.05") as cpu_only:
        http_json("POST", f"{cpu_only['url']}/cache/store", params={"tokens_mock": f"0,{2 * CHUNK}"})
        pin = cpu_only["client"].pin(tokens(0, 2))
        assert pin["pinned"] == {"cpu": 2}
        assert [entry["kvctl_pinned"] for entry in cpu_only["client"].keys("cpu")["keys"]] == [True, True]
        with pytest.raises(RejectedError, match="no such tier here: disk"):
            cpu_only["client"].pin(tokens(0, 2), tiers=["disk"])


# -- 4. Redis removals counted from what Redis deleted -------------------------------------------


@pytest.mark.slow
def test_redis_removals_count_what_unlink_deleted(engine):
    settled(engine, 500_000, 2)
    first, second = keys_of(tokens(500_000, 2))
    engine["redis"].unlink(first + "kv_bytes")  # as a maxmemory policy may: one name left of the chunk
    result = engine["client"].evict(keys=[first, first, second], tiers=["redis"])
    assert result["removed"] == {"redis": 2}
    assert sorted(chunk["key"] for chunk in result["chunks"]) == sorted([first, second])
    assert not any(engine["redis"].exists(key + suffix)
                   for key in (first, second) for suffix in ("kv_bytes", "metadata"))


# -- 5. hostile requests -------------------------------------------------------------------------

LOOKUP = "/kvctl/v1/lookup"
JSON = {"Content-Type": "application/json"}
NESTED = b"[" * 100_000 + b"]" * 100_000
HOSTILE = {  # name: (method, path, request arguments, status)
    "foreign-host": ("GET", "/kvctl/v1/info", {"headers": {"Host": "attacker.example"}}, 403),
    "foreign-host-with-port": ("POST", LOOKUP, {"json": {"tokens": [1]}, "headers": {"Host": "evil.test:8000"}}, 403),
    "text-plain": ("POST", LOOKUP, {"content": b'{"tokens": [1]}', "headers": {"Content-Type": "text/plain"}}, 415),
    "form-post": ("POST", LOOKUP, {"data": {"tokens": "1"}}, 415),
    "untyped-body": ("POST", LOOKUP, {"content": b'{"tokens": [1]}'}, 415),
    "too-large": ("POST", LOOKUP, {"content": b" " * (MAX_BODY + 1), "headers": JSON}, 413),
    "nested-lists": ("POST", LOOKUP, {"content": NESTED, "headers": JSON}, 400),
    "nested-in-object": ("POST", LOOKUP, {"content": b'{"tokens": ' + NESTED + b"}", "headers": JSON}, 400),
    "not-utf8": ("POST", LOOKUP, {"content": b'{"tokens": [\xff]}', "headers": JSON}, 400),
    "huge-integer": ("POST", LOOKUP, {"content": b'{"tokens": [' + b"9" * 5000 + b"]}", "headers": JSON}, 400),
    "token-id-too-large": ("POST", LOOKUP, {"json": {"tokens": [2**40]}}, 400),
    "too-many-tokens": ("POST", LOOKUP, {"content": b'{"tokens": [' + b"1," * 2**20 + b'1]}', "headers": JSON}, 400),
    "boolean-tokens": ("POST", LOOKUP, {"json": {"tokens": [True, False]}}, 400),
    "not-an-object": ("POST", LOOKUP, {"json": [1, 2]}, 400),
    "limit-not-a-number": ("GET", "/kvctl/v1/keys?limit=abc", {}, 400),
    "negative-offset": ("GET", "/kvctl/v1/keys?offset=-1", {}, 400),
    "limit-too-large": ("GET", "/kvctl/v1/keys?limit=1000000", {}, 400),
}
INPROCESS_HOSTILE = {
    "ttl-nan": ("POST", "/kvctl/v1/pin", {"content": b'{"tokens": [1], "ttl_s": NaN}', "headers": JSON}, 400),
    "ttl-infinite": ("POST", "/kvctl/v1/pin", {"content": b'{"tokens": [1], "ttl_s": 1e999}', "headers": JSON}, 400),
    "ttl-over-30-days": ("POST", "/kvctl/v1/pin", {"json": {"tokens": [1], "ttl_s": 31 * 86400}}, 400),
    "ttl-boolean": ("POST", "/kvctl/v1/pin", {"json": {"tokens": [1], "ttl_s": True}}, 400),
    "many-tiers": ("POST", "/kvctl/v1/evict", {"json": {"all": True, "tiers": ["cpu"] * 1000}}, 400),
    "long-key": ("POST", "/kvctl/v1/evict", {"json": {"keys": ["k" * 100_000]}}, 400),
    "long-pin-id": ("POST", "/kvctl/v1/unpin", {"json": {"pin_id": "p" * 100_000}}, 400),
    "tier-not-listable": ("GET", "/kvctl/v1/keys?tier=" + "x" * 5000, {}, 400),
}
ENGINE_HOSTILE = {**HOSTILE, **INPROCESS_HOSTILE}


def assert_rejected(url, method, path, arguments, status):
    response = http_client().request(method, url + path, timeout=60, **arguments)
    assert response.status_code == status, response.text[:500]
    assert set(response.json()) == {"error", "message"}


@pytest.mark.slow
@pytest.mark.parametrize("case", ENGINE_HOSTILE)
def test_hostile_requests_to_the_engine_are_refused(engine, case):
    assert_rejected(engine["url"], *ENGINE_HOSTILE[case])
    assert engine["client"].version() == "0.5.6" and engine["client"].info()["model"] == "tiny"


@pytest.mark.slow
@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_requests_to_the_mp_server_are_refused(server, case):  # noqa: F811 - the imported fixture
    assert_rejected(server.http, *HOSTILE[case])
    with MPServerClient(server.http) as client:
        assert client.healthcheck() and client.info()["chunk_size"] == CHUNK


@pytest.mark.slow
def test_a_declared_oversized_body_is_refused_before_it_is_read(engine):
    port = int(engine["url"].rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        connection.sendall(f"POST {LOOKUP} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                           f"Content-Length: {10**12}\r\n\r\n".encode())
        assert connection.recv(4096).startswith(b"HTTP/1.1 413")


@pytest.mark.slow
def test_loopback_names_and_a_long_prompt_are_accepted(engine):
    for host in ("localhost", "localhost:1234", "127.0.0.1:80", "[::1]:7000", "[::1]"):
        assert http_client().get(f"{engine['url']}/kvctl/v1/info", headers={"Host": host}).status_code == 200
    prompt = list(range(128 * 1024))
    response = http_client().post(f"{engine['url']}{LOOKUP}", json={"tokens": prompt}, timeout=60)
    assert response.status_code == 200 and len(response.json()["chunks"]) == len(prompt) // CHUNK


@pytest.mark.slow
def test_mp_lookup_world_size_is_capped_by_what_the_server_registered(server):  # noqa: F811
    with MPServerClient(server.http) as client:
        registered = max([model["world_size"] for model in client.info()["models"]], default=1)
        with pytest.raises(RejectedError, match="world_size must be an integer from 1 to"):
            client.lookup([1] * CHUNK, model="test-model", world_size=registered + 1)
        assert client.lookup([1] * CHUNK, model="test-model", world_size=registered)["world_size"] == registered


@pytest.mark.slow
def test_engine_work_leaves_the_event_loop_free(engine):
    """A lookup that waits on Redis (paused here) must not stall LMCache's own routes on the same server."""
    answers = {}

    def slow_lookup():
        answers["lookup"] = http_client().post(f"{engine['url']}{LOOKUP}", json={"tokens": tokens(600_000, 1)},
                                               timeout=30)

    engine["redis"].client_pause(3000)
    worker = threading.Thread(target=slow_lookup)
    worker.start()
    time.sleep(0.5)
    started = time.monotonic()
    assert engine["client"].version() == "0.5.6"
    assert engine["client"].pins() == []
    assert time.monotonic() - started < 1.5 and worker.is_alive()
    worker.join(30)
    assert answers["lookup"].status_code == 200 and answers["lookup"].json()["hit_tokens"]["redis"] == 0
