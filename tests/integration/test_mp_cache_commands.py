"""`kvctl ls`, `evict`, `pin`/`unpin`/`pins` on an MP instance: a real `lmcache server` (L1, fs L2 and
resp L2 on a real redis-server) with kvctl's routes, chunks stored by LMCache's own MP client, and a
real `lmcache coordinator` for pins."""

import json
import os
import shutil
import sys

import pytest
import yaml

from kvctl.clients.mp_server import MPServerClient
from kvctl.core.config.init import mp_server_argv
from kvctl.core.lmcache.keys import MPKeyRecipe, mp_object_keys
from kvctl.core.serve.launch import MP_ROUTES_ARGV
from tests.helpers import STACK_ENV, free_port, http_json, run_cli, start_process, stop_process, wait_until
from tests.integration.test_mp_l1_lookup import CHUNK, CHUNK_BYTES, MODEL, Server, tokens, write_tokens

STRAY_FILES = ("README.data", "notes@a@b@c.data", "scratch.txt")
FOREIGN_KEYS = ("test-model@not@a@chunk", "session:42", "other@00000000@0@zz")


class Stack(Server):
    def __init__(self, server: Server, redis, coordinator: str) -> None:
        super().__init__(server.config, server.rpc, server.http, server.l2)
        self.redis, self.coordinator = redis.client(), coordinator

    def fresh(self) -> None:
        """Empty every tier (through LMCache and the stores, not kvctl), then put the decoys back."""
        with MPServerClient(self.http) as client:
            client.clear(force=True)
        for name in os.listdir(self.l2):
            os.unlink(self.l2 / name)
        self.redis.flushdb()
        for name in STRAY_FILES:
            (self.l2 / name).write_text("not a chunk")
        for name in FOREIGN_KEYS:
            self.redis.set(name, b"keep me")

    def store_all(self, *sequences: list[int]) -> None:
        """Store and wait until both L2 adapters hold every chunk (they write after the store returns)."""
        self.store(*sequences)
        keys = [ranks[0] for ids in sequences for ranks in mp_object_keys(ids, MPKeyRecipe(MODEL, CHUNK))]
        wait_until(lambda: all((self.l2 / key.fs_file_name()).exists() and self.redis.exists(key.native_key())
                               for key in keys), 30, "fs and resp L2 writes")

    def kvctl(self, *args: str):
        config = ("--config", self.config) if args[0] in ("ls", "evict") else ()
        result = run_cli(*args, *config, "--instance", self.http, "--format", "json")
        return result, (json.loads(result.stdout) if result.stdout else None)

    def hits(self, tmp_path, ids: list[int]) -> dict[str, int]:
        result, report = self.lookup(write_tokens(tmp_path / "lookup.json", ids), "--instance", self.http)
        assert result.code == 0, result.stderr
        return report["hit_tokens"]

    def decoys_intact(self) -> bool:
        return all((self.l2 / name).exists() for name in STRAY_FILES) and all(self.redis.get(name) == b"keep me"
                                                                              for name in FOREIGN_KEYS)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, module_redis):
    base = tmp_path_factory.mktemp("mp-cache")
    port, http_port, coordinator_port = free_port(), free_port(), free_port()
    init = run_cli("config", "init", "--mode", "mp", "--out", base / "cfg", "--tier", "cpu:0.05", "--tier",
                   f"disk:{base}/l2", "--tier", module_redis.url, "--mp-port", port, "--mp-http-port", http_port,
                   "--model", MODEL)
    assert init.code == 0, init.stderr
    values = yaml.safe_load((base / "cfg" / "lmcache.yaml").read_text())
    env = {**os.environ, **STACK_ENV}
    server_log, coordinator_log = base / "server.log", base / "coordinator.log"
    server = start_process([sys.executable, "-m", "lmcache.v1.multiprocess.http_server", *mp_server_argv(values),
                            *MP_ROUTES_ARGV], server_log, env=env)
    coordinator = start_process([sys.executable, "-m", "lmcache.v1.mp_coordinator", "--host", "127.0.0.1", "--port",
                                 str(coordinator_port), "--chunk-size", str(CHUNK)], coordinator_log, env=env)
    http, coordinator_url = f"http://127.0.0.1:{http_port}", f"http://127.0.0.1:{coordinator_port}"
    try:
        wait_until(lambda: MPServerClient(http).info()["chunk_size"] == CHUNK, 120, "lmcache server", server,
                   server_log)
        wait_until(lambda: http_json("GET", f"{coordinator_url}/healthz"), 60, "lmcache coordinator", coordinator,
                   coordinator_log)
        (base / "l2").mkdir(exist_ok=True)
        yield Stack(Server(base / "cfg", f"tcp://127.0.0.1:{port}", http, base / "l2"), module_redis, coordinator_url)
    finally:
        stop_process(coordinator)
        stop_process(server)


def native_keys(ids: list[int]) -> list[str]:
    return [ranks[0].native_key() for ranks in mp_object_keys(ids, MPKeyRecipe(MODEL, CHUNK))]


def by_tier(listing: dict) -> dict[str, dict]:
    return {tier["tier"]: tier for tier in listing["tiers"]}


@pytest.mark.slow
def test_ls_lists_every_tier_with_exact_totals_and_skips_what_is_no_chunk(stack):
    stack.fresh()
    first, second = tokens(40, 2 * CHUNK), tokens(41, 3 * CHUNK + 7)
    stack.store_all(first, second)
    result, listing = stack.kvctl("ls")
    assert result.code == 0, result.stderr
    tiers = by_tier(listing)
    assert set(tiers) == {"cpu", "disk", "redis"} and listing["errors"] == {}
    expected = set(native_keys(first) + native_keys(second[:3 * CHUNK]))
    for tier in tiers.values():
        assert tier["total"] == 5 and {chunk["key"] for chunk in tier["chunks"]} == expected, tier["tier"]
    assert tiers["cpu"]["source"] == "server" and tiers["cpu"]["listed_bytes"] == 5 * CHUNK_BYTES
    assert not any(chunk["pinned"] for chunk in tiers["cpu"]["chunks"])  # nobody reads them

    _, limited = stack.kvctl("ls", "--tier", "cpu", "--limit", "2")
    assert [(t["tier"], t["total"], t["listed"]) for t in limited["tiers"]] == [("cpu", 5, 2)]
    _, other = stack.kvctl("ls", "--model", "another-model")
    assert [tier["total"] for tier in other["tiers"]] == [0, 0, 0]
    by_url = run_cli("ls", "--instance", stack.http, "--format", "json")  # no configuration: L1 only, and said so
    assert by_url.code == 0 and [tier["tier"] for tier in json.loads(by_url.stdout)["tiers"]] == ["cpu"]
    assert "L2 tiers were not listed" in by_url.stderr


@pytest.mark.slow
def test_evict_a_prompt_removes_exactly_its_chunks_from_every_tier(stack, tmp_path):
    stack.fresh()
    gone, kept = tokens(50, 2 * CHUNK), tokens(51, 2 * CHUNK)
    stack.store_all(gone, kept)
    prompt = write_tokens(tmp_path / "gone.json", gone)
    args = ("evict", "--tokens-file", prompt, "--model", MODEL)
    result, plan = stack.kvctl(*args, "--dry-run")
    assert result.code == 0, result.stderr
    assert plan["dry_run"] and plan["removed"] == {"cpu": 2, "disk": 2, "redis": 2}
    assert sorted((c["tier"], c["key"]) for c in plan["chunks"]) == sorted(
        (tier, key) for tier in ("cpu", "disk", "redis") for key in native_keys(gone))
    assert stack.hits(tmp_path, gone)["total"] == 2 * CHUNK  # a dry run removes nothing

    refused, _ = stack.kvctl(*args)
    assert refused.code == 2 and "without --yes" in refused.stderr
    assert stack.hits(tmp_path, gone)["total"] == 2 * CHUNK

    result, done = stack.kvctl(*args, "--yes")
    assert result.code == 0, result.stderr
    assert not done["dry_run"] and done["removed"] == {"cpu": 2, "disk": 2, "redis": 2}
    assert done["skipped_pinned"] == {"cpu": 0, "disk": 0, "redis": 0}
    assert stack.hits(tmp_path, gone) == {"cpu": 0, "disk": 0, "redis": 0, "total": 0}
    assert stack.hits(tmp_path, kept) == {"cpu": 2 * CHUNK, "disk": 2 * CHUNK, "redis": 2 * CHUNK, "total": 2 * CHUNK}
    assert stack.decoys_intact()


@pytest.mark.slow
def test_evict_by_key_and_whole_tiers(stack, tmp_path):
    stack.fresh()
    first, second = tokens(60, 2 * CHUNK), tokens(61, 2 * CHUNK)
    stack.store_all(first, second)
    key = native_keys(second)[1]
    result, done = stack.kvctl("evict", "--key", key, "--tier", "disk", "--yes")
    assert result.code == 0, result.stderr
    assert done["removed"] == {"disk": 1} and done["chunks"] == [{"tier": "disk", "key": key}]
    files = [ranks[0].fs_file_name() for ids in (first, second)
             for ranks in mp_object_keys(ids, MPKeyRecipe(MODEL, CHUNK))]
    assert sorted(os.listdir(stack.l2)) == sorted([*STRAY_FILES, *files[:3]])  # the key's file, and only it, went
    assert stack.hits(tmp_path, second)["redis"] == 2 * CHUNK and stack.l1_status()["total_object_count"] == 4
    bad, _ = stack.kvctl("evict", "--key", "no-such-key", "--yes")
    assert bad.code == 2 and "not an MP chunk key" in bad.stderr

    result, done = stack.kvctl("evict", "--tier", "cpu", "--model", MODEL, "--yes")
    assert result.code == 0, result.stderr
    assert done["removed"] == {"cpu": 4} and stack.l1_status()["total_object_count"] == 0
    assert stack.hits(tmp_path, first) == {"cpu": 0, "disk": 2 * CHUNK, "redis": 2 * CHUNK, "total": 2 * CHUNK}

    result, plan = stack.kvctl("evict", "--all", "--model", MODEL, "--dry-run")
    assert result.code == 0, result.stderr
    assert plan["removed"] == {"cpu": 0, "disk": 3, "redis": 4}
    result, _ = stack.kvctl("evict", "--all", "--model", MODEL, "--yes")
    assert result.code == 0, result.stderr
    _, listing = stack.kvctl("ls")
    assert [tier["total"] for tier in listing["tiers"]] == [0, 0, 0]
    assert stack.decoys_intact()


@pytest.mark.slow
def test_pins_go_through_the_coordinator_and_hold_l2_chunks(stack, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    stack.fresh()
    pinned, loose = tokens(70, 2 * CHUNK), tokens(71, 2 * CHUNK)
    stack.store_all(pinned, loose)
    prompt = write_tokens(tmp_path / "pinned.json", pinned)

    refused, _ = stack.kvctl("pin", "--tokens-file", prompt, "--model", MODEL)
    assert refused.code == 2 and "pins are not supported in MP mode without an LMCache coordinator" in refused.stderr
    assert "lmcache coordinator" in refused.stderr.split("hint:")[1]

    result, answer = stack.kvctl("pin", "--tokens-file", prompt, "--model", MODEL, "--coordinator", stack.coordinator)
    assert result.code == 0, result.stderr
    assert answer == {"model": MODEL, "requested": 2, "affected": 2, "status": "pinned"}
    inventory = tmp_path / "kvctl.yaml"  # the coordinator may also come from the inventory
    inventory.write_text(yaml.safe_dump({"instances": {"mp": {"mp_http": stack.http, "config_dir": str(stack.config),
                                                              "model": MODEL}}, "coordinator": stack.coordinator}))

    def named(*args: str, code: int = 0):  # the inventory's instance: its model, config and coordinator
        result = run_cli(*args, "--instance", "mp", "--format", "json")
        assert result.code == code, result.stderr
        return result, (json.loads(result.stdout) if result.stdout else None)

    _, listed = named("pins")
    assert listed["pins"] == [{"key": key, "pin_count": 1} for key in native_keys(pinned)]
    _, health = named("health")
    checks = {check["component"]: (check["target"], check["ok"]) for check in health["instances"][0]["checks"]}
    assert checks["coordinator"] == (stack.coordinator, True) and checks["mp_server"] == (stack.http, True)

    _, plan = named("evict", "--all", "--tier", "disk", "--tier", "redis", "--dry-run")
    assert plan["removed"] == {"disk": 2, "redis": 2} and plan["skipped_pinned"] == {"disk": 2, "redis": 2}
    assert {c["key"] for c in plan["chunks"]} == set(native_keys(loose))
    _, forced = named("evict", "--all", "--tier", "disk", "--force", "--dry-run")
    assert forced["removed"] == {"disk": 4} and forced["skipped_pinned"] == {"disk": 0}
    _, done = named("evict", "--all", "--tier", "redis", "--yes")
    assert done["removed"] == {"redis": 2} and stack.hits(tmp_path, pinned)["redis"] == 2 * CHUNK
    assert stack.hits(tmp_path, loose)["redis"] == 0

    by_id, _ = named("unpin", "--all", code=2)
    assert by_id.code == 2 and "by prompt only" in by_id.stderr
    _, answer = named("unpin", "--tokens-file", prompt)
    assert answer["status"] == "unpinned" and answer["affected"] == 2
    _, listed = named("pins")
    assert listed == {"pins": []}


@pytest.mark.slow
def test_a_pin_set_goes_through_the_coordinator_and_releases_only_its_own_pins(stack, tmp_path, monkeypatch):
    """The coordinator counts pins and gives them no ids: the set's are found in kvctl's ledger."""
    monkeypatch.setenv("KVCTL_CACHE_DIR", str(tmp_path / "cache"))
    stack.fresh()
    kept, dropped = tokens(80, 2 * CHUNK), tokens(81, 2 * CHUNK)
    stack.store_all(kept, dropped)
    write_tokens(tmp_path / "kept.json", kept)
    other = write_tokens(tmp_path / "dropped.json", dropped)
    pin_set = tmp_path / "pins.yaml"
    pin_set.write_text("name: mp-set\npins:\n  - tokens_file: kept.json\n  - tokens_file: dropped.json\n")
    flags = ("--model", MODEL, "--coordinator", stack.coordinator)
    apply = ("pin", "apply", pin_set, *flags, "--config", stack.config)  # the server's lookup joins its L2 stores

    result, plain = stack.kvctl("pin", "--tokens-file", other, *flags)  # someone's own pin of the same prompt
    assert result.code == 0 and plain["affected"] == 2, result.stderr
    result, applied = stack.kvctl(*apply)
    assert result.code == 0, result.stderr
    assert applied["counts"] == {"pin": 2, "refresh": 0, "release": 0, "unchanged": 0}
    assert [(step["chunks"], step["cached_chunks"]) for step in applied["steps"]] == [(2, 2), (2, 2)]
    counts = {pin["key"]: pin["pin_count"] for pin in stack.kvctl("pins", *flags)[1]["pins"]}
    assert counts == {**dict.fromkeys(native_keys(kept), 1), **dict.fromkeys(native_keys(dropped), 2)}

    result, again = stack.kvctl(*apply)
    assert again["counts"] == {"pin": 0, "refresh": 0, "release": 0, "unchanged": 2}, result.stderr

    pin_set.write_text("name: mp-set\npins:\n  - tokens_file: kept.json\n")
    result, released = stack.kvctl(*apply)
    assert released["counts"] == {"pin": 0, "refresh": 0, "release": 1, "unchanged": 1}, result.stderr
    counts = {pin["key"]: pin["pin_count"] for pin in stack.kvctl("pins", *flags)[1]["pins"]}
    assert counts == {**dict.fromkeys(native_keys(kept), 1), **dict.fromkeys(native_keys(dropped), 1)}  # theirs stays

    pin_set.write_text("name: mp-set\npins:\n  - tokens_file: kept.json\n    ttl: 1h\n")
    result, _ = stack.kvctl(*apply)
    assert result.code == 2 and "has a ttl or tiers" in result.stderr
    for prompt in (tmp_path / "kept.json", other):
        assert stack.kvctl("unpin", "--tokens-file", prompt, *flags)[0].code == 0


@pytest.mark.slow
def test_doctor_reads_a_real_mp_server_and_names_a_configuration_that_would_split_keys(stack, tmp_path):
    stack.fresh()  # the L2 directory holds the decoys beside LMCache's files
    result = run_cli("doctor", "--instance", stack.http, "--config", stack.config, "--format", "json")
    report = json.loads(result.stdout)
    (strays,) = [f for f in report["findings"] if f["level"] != "info"]
    assert result.code == 0 and strays["check"] == "disk", report
    assert all(name in strays["what"] for name in STRAY_FILES)

    other = tmp_path / "cfg"  # the same deployment's files, but another chunk size
    shutil.copytree(stack.config, other)
    values = yaml.safe_load((other / "lmcache.yaml").read_text())
    (other / "lmcache.yaml").write_text(yaml.safe_dump({**values, "chunk_size": CHUNK // 2}))
    result = run_cli("doctor", "--instance", stack.http, "--config", other, "--format", "json")
    (drift,) = [f for f in json.loads(result.stdout)["findings"] if f["check"] != "disk"]
    assert (drift["level"], drift["check"]) == ("warning", "config_drift")
    assert f"running process has {CHUNK}" in drift["what"] and f"says {CHUNK // 2}" in drift["what"] and drift["hint"]


@pytest.mark.slow
def test_pins_outlive_a_restart_of_the_coordinator_serve_starts(stack, tmp_path):
    """The coordinator exactly as `kvctl serve` starts it (its --metadata-path beside the logs)."""
    from kvctl.core.serve.launch import _coordinator

    stack.fresh()
    pinned = tokens(90, 2 * CHUNK)
    stack.store_all(pinned)
    prompt = write_tokens(tmp_path / "pinned.json", pinned)
    port = free_port()
    component = _coordinator({"chunk_size": CHUNK}, port, {**os.environ, **STACK_ENV}, tmp_path / "logs")
    flags = ("--model", MODEL, "--coordinator", f"http://127.0.0.1:{port}")
    for run in ("first", "restarted"):
        log = tmp_path / f"coordinator-{run}.log"
        proc = start_process(component.argv, log, env=component.env)
        try:
            wait_until(lambda: http_json("GET", f"http://127.0.0.1:{port}/healthz"), 60, "coordinator", proc, log)
            if run == "first":
                result, answer = stack.kvctl("pin", "--tokens-file", prompt, *flags)
                assert result.code == 0 and answer["affected"] == 2, result.stderr
            _, listed = stack.kvctl("pins", *flags)
            assert listed["pins"] == [{"key": key, "pin_count": 1} for key in native_keys(pinned)], run
        finally:
            stop_process(proc)
    assert (tmp_path / "coordinator-metadata.json").exists()
