"""`kvctl freeze`, `hot-cache`, `backends`, `conf`, `chunk-stats` against a real LMCache standalone
engine (CPU + disk tiers, kvctl's plugins), and `kvctl quota` against a real `lmcache server`."""

import json
import sys

import pytest
import yaml

from kvctl.clients.mp_server import MPServerClient
from kvctl.core.config.init import mp_server_argv
from kvctl.core.serve.launch import MP_ROUTES_ARGV
from tests.helpers import (
    free_port,
    http_json,
    run_kvctl,
    standalone_engine,
    start_process,
    stop_process,
    wait_until,
)

CHUNK = 256


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("manage")
    with standalone_engine(root, "--tier", "cpu:0.1", "--tier", f"disk:{root}/disk:1") as url:
        yield {"url": url, "root": root}


def kvctl(engine, *args):
    return run_kvctl(*args, "--instance", engine["url"], "--format", "json")


def answer(engine, *args):
    result = kvctl(engine, *args)
    assert result.code == 0, result.stderr
    return json.loads(result.stdout)


def store(engine, start: int, chunks: int):
    http_json("POST", f"{engine['url']}/cache/store", params={"tokens_mock": f"{start},{start + chunks * CHUNK}"})
    path = engine["root"] / f"tokens-{start}.json"
    path.write_text(json.dumps(list(range(start, start + chunks * CHUNK))))
    return path


def hit_tokens(engine, tokens) -> int:
    return answer(engine, "lookup", "--tokens-file", tokens)["hit_tokens"]["total"]


def conf(engine, key):
    return http_json("GET", f"{engine['url']}/conf", params={"names": key})[key]


@pytest.mark.slow
def test_freeze_stops_stores_and_unfreeze_resumes(engine):
    frozen = answer(engine, "freeze", "on")
    assert frozen["freeze"] is True and frozen["consistent"] is True
    assert [p["process"] for p in frozen["processes"]] == ["worker 0"]
    assert answer(engine, "freeze", "status")["freeze"] is True
    tokens = store(engine, 0, 2)
    assert hit_tokens(engine, tokens) == 0  # frozen: nothing new stored
    thawed = answer(engine, "freeze", "off")
    assert thawed["freeze"] is False
    store(engine, 0, 2)
    wait_until(lambda: hit_tokens(engine, tokens) == 2 * CHUNK, 30, "the chunks stored once unfrozen")
    assert answer(engine, "freeze")["freeze"] is False


@pytest.mark.slow
def test_hot_cache_status_and_switch(engine):
    status = answer(engine, "hot-cache", "status")
    assert isinstance(status["hot_cache"], bool) and status["consistent"] is True
    before = status["hot_cache"]
    try:
        assert answer(engine, "hot-cache", "off" if before else "on")["hot_cache"] is (not before)
    finally:
        answer(engine, "hot-cache", "on" if before else "off")
    assert answer(engine, "hot-cache")["hot_cache"] is before


@pytest.mark.slow
def test_conf_get_and_set_a_live_key_and_refuse_the_others(engine):
    got = answer(engine, "conf", "get", "min_retrieve_tokens", "chunk_size")
    assert got["values"]["chunk_size"] == CHUNK and got["differs"] == []
    changed = answer(engine, "conf", "set", "min_retrieve_tokens=512")
    assert changed["updated"] == {"min_retrieve_tokens": 512} and changed["values"]["min_retrieve_tokens"] == 512
    assert conf(engine, "min_retrieve_tokens") == 512
    refused = kvctl(engine, "conf", "set", "min_retrieve_tokens=1", "chunk_size=128")
    assert refused.code == 2 and "chunk_size cannot be changed" in refused.stderr and "hint:" in refused.stderr
    assert conf(engine, "chunk_size") == CHUNK and conf(engine, "min_retrieve_tokens") == 512  # nothing changed
    assert kvctl(engine, "conf", "set", "no_such_key=1").code == 2
    assert kvctl(engine, "conf", "get", "no_such_key").code == 2
    everything = answer(engine, "conf", "get")["values"]
    assert len(everything) > 100 and "remote_url" in everything


@pytest.mark.slow
def test_backends_ls_detach_attach_recreate(engine):
    def tiers():
        return sorted(b["tier"] for b in answer(engine, "backends", "ls")["backends"])

    assert tiers() == ["cpu", "disk"]
    refused = kvctl(engine, "backends", "detach", "disk")  # not on a terminal, no --yes
    assert refused.code == 2 and "--yes" in refused.stderr
    dry = answer(engine, "backends", "detach", "LocalDiskBackend", "--dry-run")
    assert dry["dry_run"] is True and dry["processes"][0]["present"] is True
    assert tiers() == ["cpu", "disk"]  # neither the refusal nor the dry run changed anything
    assert kvctl(engine, "backends", "detach", "cpu", "--yes").code == 2  # the allocator stays
    gone = answer(engine, "backends", "detach", "disk", "--yes")
    assert [b["tier"] for b in gone["backends"]] == ["cpu"]
    assert tiers() == ["cpu"]
    assert kvctl(engine, "backends", "detach", "disk", "--yes").code == 4  # no such backend now
    back = answer(engine, "backends", "attach")
    assert back["processes"][0]["created"] == ["LocalDiskBackend"] and tiers() == ["cpu", "disk"]
    again = answer(engine, "backends", "recreate", "disk")
    assert again["processes"][0]["created"] == ["LocalDiskBackend"] and tiers() == ["cpu", "disk"]
    bypassed = answer(engine, "backends", "bypass", "disk")
    assert {b["tier"]: b["bypassed"] for b in bypassed["backends"]} == {"cpu": False, "disk": True}
    restored = answer(engine, "backends", "unbypass", "disk")
    assert not any(b["bypassed"] for b in restored["backends"])


@pytest.mark.slow
def test_chunk_stats_without_enable_chunk_statistics_is_a_usage_error(engine):
    result = kvctl(engine, "chunk-stats", "status")
    assert result.code == 2 and "enable_chunk_statistics" in result.stderr and "hint:" in result.stderr


@pytest.fixture(scope="module")
def mp_server(tmp_path_factory):
    base = tmp_path_factory.mktemp("manage-mp")
    port, http_port = free_port(), free_port()
    assert run_kvctl("config", "init", "--mode", "mp", "--out", base / "cfg", "--tier", "cpu:0.01", "--tier",
                     f"disk:{base}/l2", "--mp-port", port, "--mp-http-port", http_port).code == 0
    values = yaml.safe_load((base / "cfg" / "lmcache.yaml").read_text())
    log = base / "server.log"
    proc = start_process([sys.executable, "-m", "lmcache.v1.multiprocess.http_server", *mp_server_argv(values),
                          *MP_ROUTES_ARGV], log)
    http = f"http://127.0.0.1:{http_port}"
    try:
        wait_until(lambda: MPServerClient(http).info(), 120, "lmcache server", proc, log)
        yield {"url": http}
    finally:
        stop_process(proc)


@pytest.mark.slow
def test_quota_set_get_ls_rm_on_an_mp_server(mp_server):
    set_ = answer(mp_server, "quota", "set", "tenant-a", "2.5")
    assert set_["status"] == "ok" and set_["quotas"][0]["limit_gb"] == 2.5
    assert answer(mp_server, "quota", "get", "tenant-a")["quotas"][0]["exists"] is True
    assert {q["cache_salt"]: q["limit_gb"] for q in answer(mp_server, "quota", "ls")["quotas"]} == {"tenant-a": 2.5}
    refused = kvctl(mp_server, "quota", "rm", "tenant-a")
    assert refused.code == 2 and "--yes" in refused.stderr
    assert answer(mp_server, "quota", "rm", "tenant-a", "--yes")["status"] == "removed"
    assert answer(mp_server, "quota", "ls")["quotas"] == []
    assert kvctl(mp_server, "quota", "rm", "tenant-a", "--yes").code == 4


@pytest.mark.slow
def test_in_process_features_are_refused_on_an_mp_server_and_quotas_in_process(mp_server, engine):
    for args in (("freeze", "on"), ("hot-cache",), ("backends", "ls"), ("conf", "get"), ("chunk-stats",)):
        result = kvctl(mp_server, *args)
        assert result.code == 2 and "in-process" in result.stderr, args
    result = kvctl(engine, "quota", "ls")
    assert result.code == 2 and "MP server" in result.stderr


@pytest.mark.slow
def test_status_reads_over_a_fleet_name_each_member_and_the_missing_one(engine, tmp_path):
    inventory = tmp_path / "kvctl.yaml"
    inventory.write_text(f"instances:\n  a: {{internal_api: {engine['url']}}}\n"
                         f"  down: {{internal_api: http://127.0.0.1:{free_port(1)}}}\n")
    every = ("--instance", "all", "--inventory", inventory, "--format", "json", "--timeout", "10")
    for args, field in ((("freeze", "status"), "freeze"), (("backends", "ls"), "backends"),
                        (("conf", "get", "chunk_size"), "values")):
        result = run_kvctl(*args, *every)
        assert result.code == 6, (args, result.stderr)
        reports = {report["instance"]: report for report in json.loads(result.stdout)["instances"]}
        assert field in json.dumps(reports["a"]) and "errors" in reports["down"], args
    switched = run_kvctl("freeze", "on", *every)
    assert switched.code == 2 and "one instance" in switched.stderr  # switches address one instance


@pytest.fixture(scope="module")
def stats_engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("manage-stats")
    with standalone_engine(root, "--tier", "cpu:0.05", enable_chunk_statistics=True) as url:
        yield {"url": url, "root": root}


@pytest.mark.slow
def test_chunk_stats_enabled_go_to_the_scheduler_which_a_standalone_engine_lacks(stats_engine):
    result = kvctl(stats_engine, "chunk-stats", "status")
    assert result.code == 3 and "scheduler" in result.stderr and "standalone engine has none" in result.stderr
    assert kvctl(stats_engine, "conf", "set", "enable_chunk_statistics=false").code == 2


@pytest.mark.slow
def test_a_known_scheduler_gets_the_settings_and_one_that_fails_is_partial(engine, tmp_path):
    scheduler = f"http://127.0.0.1:{free_port(1)}"  # named by the state file, not answering
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"name": "s", "mode": "inprocess",
                                 "endpoints": {"internal_api": [scheduler, engine["url"]]}}))
    using = ("--state", state, "--format", "json")
    frozen = run_kvctl("freeze", *using)  # a scheduler without an engine has no freeze: left out
    assert frozen.code == 0 and [p["process"] for p in frozen.json()["processes"]] == ["worker 0"]
    got = run_kvctl("conf", "get", "chunk_size", *using)
    assert got.code == 6 and "scheduler" in got.stderr
    report = got.json()
    assert report["values"] == {"chunk_size": CHUNK}
    assert [p["process"] for p in report["processes"]] == ["scheduler", "worker 0"]
    assert "error" in report["processes"][0]
