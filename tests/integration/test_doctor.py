"""`kvctl doctor` on real misconfigured deployments: two standalone LMCache engines sharing one real Redis
(different PYTHONHASHSEED, and a chunk size overridden by LMCACHE_CHUNK_SIZE), a disk tier with a stray and
a torn chunk file, a Redis whose eviction policy can split a chunk, and a healthy configuration."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.helpers import free_port, http_json, run_kvctl, start_standalone_engine, stop_process, wait_until

CHUNK = 256


def init_config(out, *tiers, port_start=None):
    args = ["config", "init", "--out", out, "--model", "tiny"]
    for tier in tiers:
        args += ["--tier", tier]
    if port_start is not None:
        args += ["--internal-api-port-start", port_start]
    result = run_kvctl(*args)
    assert result.code == 0, result.stderr
    return out


def doctor(*args):
    result = run_kvctl("doctor", *args, "--format", "json")
    assert result.stdout, result.stderr
    return result, json.loads(result.stdout)


def found(report, check, level=None):
    return [finding for finding in report["findings"]
            if finding["check"] == check and (level is None or finding["level"] == level)]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, module_redis):
    """Engine a: chunk 256, PYTHONHASHSEED 0. Engine b: the same kind of file (chunk 256) but started with
    LMCACHE_CHUNK_SIZE=512 and PYTHONHASHSEED=1. Both on one Redis; a has stored 4 chunks on disk."""
    root = tmp_path_factory.mktemp("doctor")
    procs, urls, configs = [], {}, {}
    try:
        for name, chunk, env in (("a", CHUNK, {"PYTHONHASHSEED": "0"}),
                                 ("b", 2 * CHUNK, {"PYTHONHASHSEED": "1", "LMCACHE_CHUNK_SIZE": str(2 * CHUNK)})):
            port_start = free_port()
            configs[name] = init_config(root / name / "cfg", "cpu:0.05", f"disk:{root / name}/disk:0.5",
                                        module_redis.url, port_start=port_start)
            log = root / name / "engine.log"
            procs.append(start_standalone_engine(configs[name], log, chunk=chunk, env=env))
            urls[name] = f"http://127.0.0.1:{port_start + 1}"
            wait_until(lambda url=urls[name]: http_json("GET", f"{url}/lmc_version"), 120, f"engine {name}",
                       procs[-1], log)
        stored = http_json("POST", f"{urls['a']}/cache/store", params={"tokens_mock": f"0,{4 * CHUNK}"})
        assert stored["num_tokens"] == 4 * CHUNK
        wait_until(lambda: len(list((root / "a" / "disk").glob("*.pt"))) == 4, 30, "disk files of a")
        inventory = root / "kvctl.yaml"
        inventory.write_text("instances:\n" + "".join(
            f"  {name}: {{internal_api: [{urls[name]}], config_dir: {configs[name]}}}\n" for name in urls)
            + f"redis: {module_redis.url}\n")
        yield {"root": root, "urls": urls, "configs": configs, "inventory": inventory, "redis": module_redis}
    finally:
        for proc in procs:
            stop_process(proc, grace=2)


@pytest.mark.slow
def test_fleet_with_different_seeds_and_chunk_sizes_is_an_error(fleet):
    result, report = doctor("--instance", "all", "--inventory", fleet["inventory"])
    assert result.code == 1, result.stderr
    errors = found(report, "key_compatibility", "error")
    seed = [finding for finding in errors if "PYTHONHASHSEED" in finding["what"]]
    chunk = [finding for finding in errors if finding["what"].startswith("chunk size")]
    assert seed and "a=0" in seed[0]["what"] and "b=1" in seed[0]["what"]
    assert chunk and "a=256" in chunk[0]["what"] and "b=512" in chunk[0]["what"]
    assert "a will never hit b's chunks" in chunk[0]["cost"]
    assert report["errors"] == sum(finding["level"] == "error" for finding in report["findings"]) >= 2
    assert set(report) == {"findings", "errors", "warnings"}


@pytest.mark.slow
def test_an_lmcache_variable_overriding_the_file_is_named(fleet):
    result, report = doctor("--instance", fleet["urls"]["b"], "--config", fleet["configs"]["b"])
    overrides = found(report, "env_override", "warning")
    assert overrides, report
    assert overrides[0]["what"].startswith("LMCACHE_CHUNK_SIZE=512 overrides chunk_size: 256 in lmcache.yaml")
    assert overrides[0]["what"].endswith("effective 512") and overrides[0]["instance"] == fleet["urls"]["b"]
    drift = [finding["what"] for finding in found(report, "config_drift", "warning")]
    assert not [what for what in drift if what.startswith("chunk size")]  # the override explains it
    assert [what for what in drift if what.startswith("PYTHONHASHSEED: the running process has 1")]  # env.sh says 0


@pytest.mark.slow
def test_a_healthy_instance_against_its_files_has_no_errors(fleet):
    result, report = doctor("--instance", fleet["urls"]["a"], "--config", fleet["configs"]["a"])
    assert result.code == 0, report
    assert report["errors"] == 0 and not found(report, "config_drift") and not found(report, "env_override")


@pytest.mark.slow
def test_disk_tier_with_a_stray_and_a_torn_chunk_file(fleet, tmp_path):
    config = init_config(tmp_path / "cfg", "cpu:0.05", f"disk:{tmp_path}/disk:0.5")
    disk = tmp_path / "disk"
    disk.mkdir()
    chunks = sorted((fleet["root"] / "a" / "disk").glob("*.pt"))
    for chunk in chunks:
        shutil.copy(chunk, disk / chunk.name)
    (disk / "core.12345").write_bytes(b"\0" * 100)  # a stray file LMCache never reads
    torn = disk / chunks[1].name
    torn.write_bytes(torn.read_bytes()[:1000])  # a chunk cut short, as by a crash mid-write
    result, report = doctor("--config", config)
    assert result.code == 0, report
    disk_findings = [finding["what"] for finding in found(report, "disk", "warning")]
    assert any("core.12345" in what for what in disk_findings), disk_findings
    assert any(chunks[1].name in what and "1000 bytes" in what for what in disk_findings), disk_findings


@pytest.mark.slow
def test_redis_with_maxmemory_and_allkeys_lru_is_a_warning(start_redis, tmp_path):
    server = start_redis()
    server.client().config_set("maxmemory", 64 * 1024 * 1024)
    server.client().config_set("maxmemory-policy", "allkeys-lru")
    config = init_config(tmp_path / "cfg", "cpu:0.05", server.url)
    result, report = doctor("--config", config)
    assert result.code == 0, report
    warnings = found(report, "redis", "warning")
    assert warnings and "allkeys-lru" in warnings[0]["what"]


@pytest.mark.slow
def test_redis_that_does_not_answer_is_an_error(tmp_path):
    config = init_config(tmp_path / "cfg", "cpu:0.05", f"redis://127.0.0.1:{free_port(1)}")
    result, report = doctor("--config", config)
    assert result.code == 1 and found(report, "redis", "error"), report


@pytest.mark.slow
def test_a_healthy_configuration_exits_0(fleet, tmp_path):
    config = init_config(tmp_path / "cfg", "cpu:0.05", f"disk:{tmp_path}/disk:0.5", fleet["redis"].url)
    result, report = doctor("--config", config)
    assert result.code == 0, report
    assert report["errors"] == 0 and report["warnings"] == 0, report
