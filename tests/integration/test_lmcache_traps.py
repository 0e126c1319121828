"""What `config validate` calls silent drops really are silent in LMCache 0.5.6, and LMCache's
own loader runs behind `config validate`."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import STACK_ENV, run_kvctl


def load_with_lmcache(path, env=None):
    code = (
        "import json, sys\n"
        "from lmcache.v1.config import LMCacheEngineConfig\n"
        "config = LMCacheEngineConfig.from_file(sys.argv[1]); config.update_config_from_env()\n"
        "print(json.dumps({k: getattr(config, k) for k in ('controller_pull_url', 'lmcache_worker_ports', "
        "'enable_pd', 'local_cpu', 'chunk_size')}))\n"
    )
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "LM_CACHE_"))}
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300,
                          env={**environment, **STACK_ENV, **(env or {})})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_traps_that_validate_reports_are_real_in_lmcache(tmp_path):
    path = tmp_path / "traps.yaml"
    path.write_text("controller_url: 127.0.0.1:9000\nlmcache_worker_port: 8500\nenable_xpyd: true\n"
                    "local_cpu: 'yes'\nchunk_size: 256\n")
    loaded = load_with_lmcache(path, env={"LM_CACHE_CHUNK_SIZE": "512"})
    assert loaded == {"controller_pull_url": None, "lmcache_worker_ports": None, "enable_pd": False,
                      "local_cpu": False, "chunk_size": 256}
    report = json.loads(run_kvctl("config", "validate", path, "--no-lmcache",
                                  env={"LM_CACHE_CHUNK_SIZE": "512"}).stdout)
    assert {f["key"] for f in report["findings"] if f["level"] == "error"} >= {
        "controller_url", "lmcache_worker_port", "enable_xpyd", "local_cpu", "env:LM_CACHE_CHUNK_SIZE"}


@pytest.mark.slow
def test_validate_runs_lmcache_own_loader(tmp_path):
    assert run_kvctl("config", "init", "--out", tmp_path / "good", "--tier", "cpu:0.5", "--tier",
                     f"disk:{tmp_path}/disk:1").code == 0
    good = run_kvctl("config", "validate", tmp_path / "good", "--format", "json")
    assert good.code == 0, good.stderr
    assert json.loads(good.stdout) | {"findings": None} == {
        "file": str(tmp_path / "good"), "mode": "inprocess", "ok": True, "lmcache_checked": True, "findings": None}
    assert json.loads(good.stdout)["findings"] == []

    rejected = tmp_path / "rejected.yaml"
    rejected.write_text("chunk_size: 256\nenable_controller: true\nlmcache_instance_id: x\n"
                        "pre_caching_hash_algorithm: sha256_cbor\ninternal_api_server_enabled: true\n")
    result = run_kvctl("config", "validate", rejected, "--format", "json")
    assert result.code == 1
    errors = [f for f in json.loads(result.stdout)["findings"] if f["level"] == "error"]
    assert len(errors) == 1 and "LMCache rejects the configuration" in errors[0]["message"]
    assert "controller_pull_url is required" in errors[0]["message"]
