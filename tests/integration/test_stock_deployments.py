"""kvctl against LMCache deployments it did not launch: a stock in-process engine (LMCache's own
`python -m lmcache.v1.standalone`, no kvctl plugins) and a stock `lmcache server` (no --server-module).
Every command either answers through LMCache's own routes and stores, or refuses naming the route
that is missing and the one line that adds it; the CPU tier is never reported as 0 where it is not seen.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from kvctl.core.config.init import mp_server_argv
from tests.helpers import (
    free_port,
    http_client,
    http_json,
    init_engine,
    run_kvctl,
    standalone_argv,
    start_process,
    stop_process,
    tier_args,
    wait_until,
)

pytestmark = pytest.mark.slow
CHUNK = 256
STORED = 4 * CHUNK  # tokens 0..1023, stored through LMCache's own debug route
ROUTES_FIX = "kvctl_plugins.vllm_connector"  # the one line an in-process refusal names
MP_ROUTES_FIX = "kvctl_plugins.mp_routes"


@pytest.fixture(scope="module")
def stock_engine(tmp_path_factory, module_redis):
    """A stock standalone engine with CPU, disk and Redis tiers, holding 4 chunks on each."""
    root = tmp_path_factory.mktemp("stock-engine")
    tiers = tier_args("cpu:0.05", f"disk:{root}/disk:1", module_redis.url)
    with init_engine(root, *tiers, plugins=False) as engine:
        assert http_json("POST", f"{engine.url}/cache/store?tokens_mock=0,{STORED}")["num_tokens"] == STORED
        tokens = root / "tokens.json"
        tokens.write_text(json.dumps(list(range(STORED))))
        wait_until(lambda: len(list((root / "disk").glob("*.pt"))) == 4, 30, "the disk tier's writes")
        yield {"url": engine.url, "root": root, "tokens": tokens, "redis": module_redis}


def kvctl(target, *args, **options):
    return run_kvctl(*args, "--instance", target["url"], "--format", "json", **options)


def test_the_stock_engine_really_has_no_kvctl_routes(stock_engine):
    assert http_client().get(f"{stock_engine['url']}/kvctl/v1/info").status_code == 404


def test_stats_come_from_lmcache_s_own_metrics_and_conf(stock_engine):
    result = kvctl(stock_engine, "stats")
    assert result.code == 0, result.stderr
    (report,) = result.json()["instances"]
    tiers = {tier["tier"]: tier for tier in report["lmcache"]["tiers"]}
    assert set(tiers) == {"cpu", "disk", "redis"} and tiers["disk"]["capacity_bytes"] == 1024**3
    assert tiers["redis"]["chunks"] == 4  # read from Redis itself
    assert any("kvctl's routes are absent" in note for note in report["notes"])
    counts = report["lmcache"]["store"]  # LMCache's counters can only come from its lagging /metrics: said so
    assert (counts["source"], counts["max_age_s"]) == ("metrics", 10)


@pytest.mark.parametrize("args, key, value", [
    (("freeze", "status"), "freeze", False),
    (("hot-cache", "status"), "hot_cache", True),
    (("conf", "get", "chunk_size"), "values", {"chunk_size": CHUNK}),
])
def test_lmcache_s_own_switches_answer(stock_engine, args, key, value):
    result = kvctl(stock_engine, *args)
    assert result.code == 0, result.stderr
    assert result.json()[key] == value


def test_backends_and_health_see_every_tier(stock_engine):
    backends = kvctl(stock_engine, "backends", "ls")
    assert backends.code == 0, backends.stderr
    assert [b["tier"] for b in backends.json()["backends"]] == ["cpu", "disk", "redis"]
    health = kvctl(stock_engine, "health")
    assert health.code == 0, health.stderr
    components = {check["component"].split(" ")[0] for check in health.json()["instances"][0]["checks"]}
    assert {"internal_api", "disk", "redis"} <= components


def test_chunk_stats_refuses_for_what_the_engine_was_started_without(stock_engine):
    result = kvctl(stock_engine, "chunk-stats", "status")
    assert result.code == 2 and "enable_chunk_statistics" in result.stderr


def test_ls_lists_disk_and_redis_and_says_the_cpu_tier_is_not_visible(stock_engine):
    result = kvctl(stock_engine, "ls")
    listing = result.json()
    assert result.code == 6
    assert {tier["tier"]: tier["total"] for tier in listing["tiers"]} == {"disk": 4, "redis": 4}
    assert "not visible without kvctl's routes" in listing["errors"]["cpu"] and "GET /kvctl/v1/keys" in \
        listing["errors"]["cpu"] and ROUTES_FIX in listing["errors"]["cpu"]
    only_cpu = kvctl(stock_engine, "ls", "--tier", "cpu")
    assert only_cpu.code == 4 and only_cpu.json()["tiers"] == []


def test_lookup_counts_disk_and_redis_and_never_a_cpu_zero(stock_engine):
    result = kvctl(stock_engine, "lookup", "--tokens-file", stock_engine["tokens"])
    report = result.json()
    assert result.code == 6
    assert report["hit_tokens"] == {"cpu": None, "disk": STORED, "redis": STORED, "total": STORED}
    assert report["tiers_checked"] == ["disk", "redis"] and "POST /kvctl/v1/lookup" in report["errors"]["cpu"]


def test_pins_and_a_prompts_cpu_eviction_refuse_naming_the_route(stock_engine):
    for args, route in ((("pin", "--tokens-file", stock_engine["tokens"]), "POST /kvctl/v1/pin"),
                        (("pins",), "GET /kvctl/v1/pins"),
                        (("evict", "--tier", "cpu", "--tokens-file", stock_engine["tokens"], "--yes"),
                         "POST /kvctl/v1/evict")):
        result = kvctl(stock_engine, *args)
        assert result.code == 2 and route in result.stderr and ROUTES_FIX in result.stderr.split("hint:")[1], args


def test_the_whole_cpu_tier_is_cleared_through_lmcaches_own_route(stock_engine):
    """LMCache's DELETE /cache/clear empties the CPU tier whole; kvctl says so before and counts after."""
    dry = kvctl(stock_engine, "evict", "--tier", "cpu", "--all", "--dry-run")
    assert dry.code == 0, dry.stderr
    assert dry.json()["cleared_whole"] == ["cpu"] and dry.json()["removed"] == {}
    assert "cleared whole through LMCache's DELETE /cache/clear" in dry.stderr
    refused = kvctl(stock_engine, "evict", "--tier", "cpu", "--all")  # not a terminal: --yes is needed
    assert refused.code == 2 and "the whole cpu tier" in refused.stderr
    cleared = kvctl(stock_engine, "evict", "--tier", "cpu", "--all", "--yes")
    assert cleared.code == 0, cleared.stderr
    assert cleared.json()["removed"] == {"cpu": 4} and cleared.json()["dry_run"] is False
    assert kvctl(stock_engine, "evict", "--tier", "cpu", "--all", "--yes").json()["removed"] == {"cpu": 0}
    report = kvctl(stock_engine, "lookup", "--tokens-file", stock_engine["tokens"]).json()
    assert report["hit_tokens"]["disk"] == STORED  # the other tiers were not selected, and kept every chunk


def test_snapshot_save_reads_the_stores(stock_engine, tmp_path):
    result = kvctl(stock_engine, "snapshot", "save", "--tokens-file", stock_engine["tokens"], "-o",
                   tmp_path / "s.kvsnap")
    assert result.code == 0, result.stderr
    assert result.json()["chunks"] == 4 and result.json()["missing"] == 0


def test_doctor_says_the_routes_are_absent_and_what_that_costs(stock_engine):
    result = kvctl(stock_engine, "doctor")
    (finding,) = [f for f in result.json()["findings"] if f["check"] == "routes"]
    assert finding["level"] == "warning" and "CPU tier is not visible" in finding["cost"]
    assert ROUTES_FIX in finding["hint"]


def test_evicting_a_prompt_from_redis_goes_directly(stock_engine):
    """Last in this module: it changes what the engine's Redis holds."""
    result = kvctl(stock_engine, "evict", "--tokens-file", stock_engine["tokens"], "--tier", "redis", "--yes")
    assert result.code == 0, result.stderr
    assert result.json()["removed"] == {"redis": 4}
    report = kvctl(stock_engine, "lookup", "--tokens-file", stock_engine["tokens"]).json()
    assert report["hit_tokens"]["redis"] == 0 and report["hit_tokens"]["disk"] == STORED


# -- a stock lmcache server (MP) ------------------------------------------------------------------


@pytest.fixture(scope="module")
def stock_mp_server(tmp_path_factory):
    base = tmp_path_factory.mktemp("stock-mp")
    port, http_port = free_port(), free_port()
    assert run_kvctl("config", "init", "--mode", "mp", "--out", base / "cfg", "--tier", "cpu:0.01", "--tier",
                     f"disk:{base}/l2", "--mp-port", port, "--mp-http-port", http_port).code == 0
    values = yaml.safe_load((base / "cfg" / "lmcache.yaml").read_text())
    log = base / "server.log"
    proc = start_process([sys.executable, "-m", "lmcache.v1.multiprocess.http_server", *mp_server_argv(values)], log)
    url = f"http://127.0.0.1:{http_port}"
    try:
        wait_until(lambda: http_json("GET", f"{url}/status"), 120, "lmcache server", proc, log)
        yield {"url": url, "config": base / "cfg"}
    finally:
        stop_process(proc)


def test_a_stock_mp_server_is_told_apart_by_lmcache_s_own_status(stock_mp_server):
    assert http_client().get(f"{stock_mp_server['url']}/kvctl/v1/info").status_code == 404
    for args, key in ((("quota", "ls"), "quotas"), (("reconfigure", "status"), "adapters")):
        result = kvctl(stock_mp_server, *args)
        assert result.code == 0, (args, result.stderr)
        assert key in result.json()


def test_stats_and_health_of_a_stock_mp_server(stock_mp_server):
    stats = kvctl(stock_mp_server, "stats")
    assert stats.code == 0, stats.stderr
    (report,) = stats.json()["instances"]
    cpu = next(tier for tier in report["lmcache"]["tiers"] if tier["tier"] == "cpu")
    assert cpu["capacity_bytes"] > 0 and cpu["chunks"] == 0
    assert kvctl(stock_mp_server, "health").code == 0


def test_ls_of_a_stock_mp_server_lists_l2_and_names_the_missing_l1_route(stock_mp_server):
    result = kvctl(stock_mp_server, "ls", "--config", stock_mp_server["config"])
    listing = result.json()
    assert result.code == 6 and [tier["tier"] for tier in listing["tiers"]] == ["disk"]
    assert "GET /kvctl/v1/keys" in listing["errors"]["cpu"] and MP_ROUTES_FIX in listing["errors"]["cpu"]


def test_doctor_on_a_stock_mp_server(stock_mp_server):
    result = kvctl(stock_mp_server, "doctor")
    (finding,) = [f for f in result.json()["findings"] if f["check"] == "routes"]
    assert finding["level"] == "warning" and MP_ROUTES_FIX in finding["hint"]


# -- the plugins on their own ---------------------------------------------------------------------


def test_the_plugins_install_alone_and_load_into_a_stock_engine(tmp_path):
    """`pip wheel ./plugins` builds a package of kvctl_plugins alone; installed apart from kvctl into a
    stock LMCache environment (no kvctl, Typer or Rich on its path), an engine started with it serves
    kvctl's routes."""
    from tests.helpers import REPO

    wheels, target = tmp_path / "wheels", tmp_path / "site"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(wheels), str(REPO / "plugins")], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    (wheel,) = wheels.glob("kvctl_plugins-*.whl")
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                                str(wheel)], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr
    site_packages = next(path for path in sys.path if path.endswith("site-packages"))
    port_start = free_port()
    assert run_kvctl("config", "init", "--out", tmp_path / "cfg", "--tier", "cpu:0.05",
                     "--internal-api-port-start", port_start).code == 0
    probe = ("import sys, kvctl_plugins, kvctl_plugins.routes; "
             "print(kvctl_plugins.__file__, [m for m in ('kvctl', 'typer', 'rich') if m in sys.modules])")
    env = {"PYTHONPATH": f"{target}:{site_packages}"}
    alone = subprocess.run([sys.executable, "-S", "-c", probe], capture_output=True, text=True, timeout=120,
                           env={**env, "PATH": "/usr/bin:/bin"})
    assert alone.returncode == 0, alone.stderr
    assert alone.stdout.split()[0].startswith(str(target)) and alone.stdout.strip().endswith("[]")
    log = tmp_path / "engine.log"
    argv = standalone_argv(tmp_path / "cfg")
    proc = start_process([argv[0], "-S", *argv[1:]], log, env)
    url = f"http://127.0.0.1:{port_start + 1}"
    try:
        wait_until(lambda: http_json("GET", f"{url}/kvctl/v1/info"), 120, "engine with the installed plugins",
                   proc, log)
    finally:
        stop_process(proc, grace=5)


def test_plugins_enable_changes_a_deployment_s_kv_transfer_config(tmp_path):
    config = tmp_path / "kv-transfer-config.json"
    config.write_text('{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}\n')
    config.chmod(0o640)
    shown = run_kvctl("plugins", "enable", "--kv-transfer-config", config, "--dry-run")
    assert shown.code == 0 and '+  "kv_connector_module_path": "kvctl_plugins.vllm_connector"' in shown.stderr
    assert "kv_connector_module_path" not in config.read_text()  # a dry run writes nothing
    refused = run_kvctl("plugins", "enable", "--kv-transfer-config", config)  # no terminal, no --yes
    assert refused.code == 2 and "--yes" in refused.stderr and "kv_connector_module_path" not in config.read_text()
    written = run_kvctl("plugins", "enable", "--kv-transfer-config", config, "--yes")
    assert written.code == 0, written.stderr
    assert json.loads(config.read_text()) == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
                                              "kv_connector_module_path": "kvctl_plugins.vllm_connector"}
    assert config.stat().st_mode & 0o777 == 0o640
    inline = run_kvctl("plugins", "enable", "--kv-transfer-config", '{"kv_connector":"LMCacheConnectorV1"}',
                       "--format", "json")
    assert json.loads(inline.json()["kv_transfer_config"])["kv_connector_module_path"] == ROUTES_FIX
    mp = run_kvctl("plugins", "enable", "--kv-transfer-config", '{"kv_connector":"LMCacheMPConnector"}')
    assert mp.code == 2 and MP_ROUTES_FIX in mp.stderr
    foreign = run_kvctl("plugins", "enable", "--kv-transfer-config",
                        '{"kv_connector":"LMCacheConnectorV1","kv_connector_module_path":"my.module"}')
    assert foreign.code == 2 and "my.module" in foreign.stderr

