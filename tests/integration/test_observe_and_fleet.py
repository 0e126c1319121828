"""`kvctl health`, `stats`, `top`, `ls` on one instance and on a fleet (two real LMCache engines sharing one
real redis-server, plus members that are down or hang), and the fault matrix's exit codes."""

import json
import socket
import time

import pytest

from tests.conftest import RedisStarter
from tests.helpers import free_port, http_json, init_engine, run_kvctl, tier_args, wait_until

CHUNK = 256


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet")
    redis = RedisStarter(root)
    server = redis()
    engines = []
    hung = socket.socket()  # accepts connections and never answers: a member that times out
    try:
        urls = {}
        for name in ("a", "b"):
            engines.append(init_engine(root / name, *tier_args("cpu:0.05", f"disk:{root / name}/disk:1", server.url)))
            urls[name] = engines[-1].start().url
        hung.bind(("127.0.0.1", free_port(1)))
        hung.listen(8)
        inventory = root / "kvctl.yaml"
        inventory.write_text(
            "instances:\n"
            f"  a: {{internal_api: {urls['a']}}}\n"
            f"  b: {{internal_api: {urls['b']}}}\n"
            f"  down: {{internal_api: http://127.0.0.1:{free_port(1)}}}\n"
            f"redis: {server.url}\n")
        healthy = root / "healthy.yaml"
        healthy.write_text("\n".join(inventory.read_text().splitlines()[:3]) + "\n")
        hung_url = f"http://127.0.0.1:{hung.getsockname()[1]}"
        troubled = root / "troubled.yaml"  # a member that hangs, and one whose kvctl serve has stopped
        troubled.write_text(f"instances:\n  a: {{internal_api: {urls['a']}}}\n  hung: {{internal_api: {hung_url}}}\n"
                            f"  gone: {{state: {root / 'stopped' / 'state.json'}}}\n")
        yield {"urls": urls, "inventory": inventory, "healthy": healthy, "troubled": troubled, "redis": server,
               "root": root, "hung": hung_url}
    finally:
        hung.close()
        for engine in engines:
            engine.stop()
        redis.stop_all()


def kvctl(*args):
    result = run_kvctl(*args, "--format", "json")
    assert "Traceback" not in result.stderr
    return result, (json.loads(result.stdout) if result.stdout.strip() else None)


@pytest.mark.slow
def test_health_checks_every_component_of_an_instance(fleet):
    result, report = kvctl("health", "--instance", fleet["urls"]["a"])
    assert result.code == 0, result.stderr
    (instance,) = report["instances"]
    checks = {check["component"]: check for check in instance["checks"]}
    assert set(checks) == {"internal_api (worker 0)", "disk", "redis"}
    assert all(check["ok"] and check["latency_ms"] > 0 for check in checks.values())
    assert checks["internal_api (worker 0)"]["detail"] == "LMCache 0.5.6"
    assert checks["disk"]["target"].endswith("a/disk/") and "writable" in checks["disk"]["detail"]
    assert not list((fleet["root"] / "a" / "disk").glob(".kvctl-health-*"))  # its probe file is gone


@pytest.mark.slow
def test_stats_count_stores_and_retrieves_from_metrics(fleet):
    url = fleet["urls"]["a"]
    http_json("POST", f"{url}/cache/store", params={"tokens_mock": f"0,{2 * CHUNK}"})
    http_json("POST", f"{url}/cache/retrieve", params={"tokens_mock": f"0,{2 * CHUNK}"})

    def stats():
        result, report = kvctl("stats", "--instance", url)
        assert result.code == 0, result.stderr
        return report["instances"][0]["lmcache"]

    wait_until(lambda: (stats()["store"]["tokens"] or 0) >= 2 * CHUNK and (stats()["retrieve"]["tokens"] or 0) > 0,
               60, "store and retrieve counted in /metrics")
    lmcache = stats()
    assert lmcache["retrieve"]["hit_rate"] == 1.0
    tiers = {tier["tier"]: tier for tier in lmcache["tiers"]}
    assert tiers["cpu"]["chunks"] >= 2 and 0 < tiers["cpu"]["usage"] < 1
    assert tiers["cpu"]["capacity_bytes"] == int(0.05 * 1024**3)
    redis = fleet["redis"].client()

    def redis_tier_matches_redis():
        names = [name for name in redis.scan_iter("tiny@*") if not name.startswith(b"tiny@v")]
        tier = {tier["tier"]: tier for tier in stats()["tiers"]}["redis"]
        return tier["chunks"] == len(names) // 2 >= 2 and tier["used_bytes"] == sum(map(redis.strlen, names))

    wait_until(redis_tier_matches_redis, 30, "the Redis tier's chunks and bytes in stats")
    redis_tier = {tier["tier"]: tier for tier in stats()["tiers"]}["redis"]
    assert redis_tier["maxmemory_policy"] == redis.config_get("maxmemory-policy")["maxmemory-policy"]
    top, frame = kvctl("top", "--once", "--instance", url)
    assert top.code == 0 and frame["health"]["healthy"] and frame["stats"]["instances"][0]["lmcache"]


@pytest.mark.slow
def test_fleet_fan_out_names_the_members_that_fail(fleet):
    result, report = kvctl("health", "--instance", "all", "--inventory", fleet["inventory"])
    assert result.code == 6
    healthy = {instance["instance"]: instance["healthy"] for instance in report["instances"]}
    assert healthy == {"a": True, "b": True, "down": False}
    result, report = kvctl("stats", "--instance", "all", "--inventory", fleet["inventory"])
    assert result.code == 6 and "down:" in result.stderr
    assert {r["instance"] for r in report["instances"] if "lmcache" in r} == {"a", "b"}
    result, report = kvctl("health", "--instance", "all", "--inventory", fleet["healthy"])
    assert result.code == 0 and len(report["instances"]) == 2
    result, report = kvctl("ls", "--instance", "all", "--inventory", fleet["healthy"], "--tier", "cpu")
    assert result.code == 0 and [r["instance"] for r in report["instances"]] == ["a", "b"]
    started = time.monotonic()
    result, report = kvctl("health", "--instance", "all", "--inventory", fleet["troubled"], "--timeout", "3")
    assert time.monotonic() - started < 10  # the hung member is left behind after its 3 s, not waited for
    assert result.code == 6
    failed = {i["instance"]: i["checks"][0]["detail"] for i in report["instances"] if not i["healthy"]}
    assert set(failed) == {"hung", "gone"} and "no answer in 3 s" in failed["hung"]
    assert "no kvctl serve state" in failed["gone"]
    nowhere = run_kvctl("health", "--instance", "all",
                        env={"KVCTL_INVENTORY": "", "XDG_CONFIG_HOME": str(fleet["root"])},
                        cwd=fleet["root"] / "a")
    assert nowhere.code == 2 and "needs an inventory" in nowhere.stderr
    tokens = fleet["root"] / "tokens.json"
    tokens.write_text(json.dumps(list(range(2 * CHUNK))))
    http_json("POST", f"{fleet['urls']['b']}/cache/store", params={"tokens_mock": f"0,{2 * CHUNK}"})
    found = run_kvctl("lookup", "--instance", "b", "--tokens-file", tokens, "--format", "json",
                      env={"KVCTL_INVENTORY": str(fleet["inventory"])})  # an inventory name works everywhere
    assert found.code == 0 and json.loads(found.stdout)["hit_tokens"]["cpu"] == 2 * CHUNK


@pytest.mark.slow
def test_fleet_pin_and_evict_plan_everywhere_ask_once_and_name_failures(fleet):
    tokens = fleet["root"] / "fleet-prompt.json"
    tokens.write_text(json.dumps(list(range(50_000, 50_000 + 2 * CHUNK))))
    for url in fleet["urls"].values():
        http_json("POST", f"{url}/cache/store", params={"tokens_mock": f"50000,{50_000 + 2 * CHUNK}"})
    every = ("--instance", "all", "--inventory", fleet["healthy"])
    result, pinned = kvctl("pin", "--tokens-file", tokens, *every)
    assert result.code == 0, result.stderr
    assert [(r["instance"], r["pinned"]["cpu"]) for r in pinned["instances"]] == [("a", 2), ("b", 2)]
    _, listed = kvctl("pins", *every)
    assert [len(r["pins"]) for r in listed["instances"]] == [1, 1]
    _, kept = kvctl("evict", "--tokens-file", tokens, "--tier", "cpu", "--dry-run", *every)
    assert [(r["removed"], r["skipped_pinned"]) for r in kept["instances"]] == [({"cpu": 0}, {"cpu": 2})] * 2
    result, _ = kvctl("unpin", "--all", *every)
    assert result.code == 0, result.stderr

    refused, _ = kvctl("evict", "--tokens-file", tokens, "--tier", "cpu", *every)
    # one question for all
    assert refused.code == 2 and "refusing to evict 4 chunks (cpu: 4) without --yes" in refused.stderr
    result, done = kvctl("evict", "--tokens-file", tokens, "--tier", "cpu", "--yes", *every)
    assert result.code == 0 and not done["dry_run"]
    assert [(r["instance"], r["removed"]) for r in done["instances"]] == [("a", {"cpu": 2}), ("b", {"cpu": 2})]
    result, found = kvctl("lookup", "--tokens-file", tokens, *every)  # the prompt on every instance at once
    assert result.code == 0, result.stderr
    assert [(r["instance"], r["hit_tokens"]["cpu"], r["hit_tokens"]["disk"]) for r in found["instances"]] == [
        ("a", 0, 2 * CHUNK), ("b", 0, 2 * CHUNK)]

    result, report = kvctl("evict", "--tokens-file", tokens, "--tier", "disk", "--yes", "--instance", "all",
                           "--inventory", fleet["troubled"], "--timeout", "3")
    assert result.code == 6 and {"hung:", "gone:"} <= set(result.stderr.split())
    assert [r["removed"] for r in report["instances"] if "removed" in r] == [{"disk": 2}]  # a still evicted


@pytest.mark.slow
def test_faults_give_documented_exit_codes(fleet, tmp_path, start_redis):
    result, report = kvctl("health", "--instance", fleet["hung"], "--timeout", "20")
    assert result.code == 3 and "in time" in report["instances"][0]["checks"][0]["detail"]
    result, _ = kvctl("stats", "--instance", "http://127.0.0.1:1")
    assert result.code == 3 and "hint:" in result.stderr

    locked = start_redis(password="secret")
    config = tmp_path / "cfg"
    run_kvctl("config", "init", "--out", config, "--tier", "cpu:0.05", "--tier", f"redis://127.0.0.1:{locked.port}")
    result, _ = kvctl("ls", "--config", config)
    assert result.code == 4 and "credentials" in result.stderr  # Redis auth failure: rejected

    fleet["redis"].client().shutdown(nosave=True)  # the shared Redis goes down (last: the fleet's other tests use it)
    result, report = kvctl("health", "--instance", fleet["urls"]["b"])
    assert result.code == 6
    down = [check for check in report["instances"][0]["checks"] if not check["ok"]]
    assert [check["component"] for check in down] == ["redis"]
    result, report = kvctl("ls", "--instance", fleet["urls"]["b"])
    assert result.code == 6 and "redis tier:" in result.stderr
    assert {tier["tier"] for tier in report["tiers"]} == {"cpu", "disk"}
    # LMCache's remote backend answers "not contained" while Redis is down: kvctl says the tier is unknown
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(list(range(2 * CHUNK))))
    result, report = kvctl("lookup", "--instance", fleet["urls"]["b"], "--tokens-file", tokens)
    assert result.code == 6 and "redis tier:" in result.stderr
    assert "redis" not in report["tiers_checked"] and "redis" in report["errors"]
    result, report = kvctl("stats", "--instance", fleet["urls"]["b"])
    assert result.code == 6 and "redis:" in result.stderr and "redis" in report["instances"][0]["errors"]
