"""Configurations from `kvctl config init` run real LMCache servers, with every tier they name."""

import json
import sys

import psutil
import pytest
import yaml

from kvctl.core.config.init import mp_server_argv
from kvctl.core.lmcache.config import parse_env_file
from tests.helpers import free_port, http_client, http_json, run_kvctl, start_process, stop_process, wait_until

CHUNK = 256


def listening_addresses(pid):
    process = psutil.Process(pid)
    procs = [process, *process.children(recursive=True)]
    return {(conn.laddr.ip, conn.laddr.port) for proc in procs for conn in proc.net_connections("tcp")
            if conn.status == psutil.CONN_LISTEN}


@pytest.mark.slow
@pytest.mark.parametrize("source", ["yaml", "env.sh"])
def test_inprocess_config_runs_an_engine_with_cpu_disk_and_redis(tmp_path, redis_server, source):
    port_start = free_port()
    disk = tmp_path / "disk"
    init = run_kvctl("config", "init", "--out", tmp_path / "cfg", "--tier", "cpu:0.2", "--tier", f"disk:{disk}:0.5",
                     "--tier", redis_server.url, "--internal-api-port-start", port_start, "--format", "json")
    assert init.code == 0, init.stderr
    env_file = parse_env_file((tmp_path / "cfg" / "env.sh").read_text())
    argv = [sys.executable, "-m", "lmcache.v1.standalone", "--model-name", "tiny", "--kv-shape", f"2,2,{CHUNK},2,32",
            "--kvcache-shape-spec", "(1024,2,32):float16:2", "--kv-dtype", "float16"]
    env = {"PYTHONHASHSEED": env_file["PYTHONHASHSEED"]}
    if source == "yaml":
        argv += ["--config", str(tmp_path / "cfg" / "lmcache.yaml")]
    else:
        env.update(env_file)
    log = tmp_path / "engine.log"
    proc = start_process(argv, log, env)
    api = f"http://127.0.0.1:{port_start + 1}"  # worker 0 = port_start + 1
    try:
        assert wait_until(lambda: http_json("GET", f"{api}/lmc_version"), 120, "standalone engine",
                          proc, log) == "0.5.6"
        assert set(http_json("GET", f"{api}/backends")) == {"LocalCPUBackend", "LocalDiskBackend", "RemoteBackend"}
        conf = http_json("GET", f"{api}/conf")
        assert conf["chunk_size"] == CHUNK
        assert conf["pre_caching_hash_algorithm"] == "sha256_cbor"
        assert conf["lmcache_instance_id"] == "kvctl-cfg"
        assert conf["run_script_api_enabled"] is False
        assert ("127.0.0.1", port_start + 1) in listening_addresses(proc.pid)
        assert not any(port == port_start + 1 and ip != "127.0.0.1" for ip, port in listening_addresses(proc.pid))

        stored = http_json("POST", f"{api}/cache/store", params={"tokens_mock": f"0,{2 * CHUNK}"})
        assert stored == {"status": "success", "num_tokens": 2 * CHUNK}
        client = redis_server.client()
        wait_until(lambda: len(list(disk.glob("tiny@1@0@*.pt"))) == 2, 30, "disk tier files", proc, log)
        wait_until(lambda: len(list(client.scan_iter("tiny@1@0@*metadata"))) == 2, 30, "redis tier keys", proc, log)
        assert len(list(client.scan_iter("tiny@1@0@*kv_bytes"))) == 2
    finally:
        stop_process(proc, grace=2)  # LMCache 0.5.6 never exits on SIGTERM with a redis:// tier


@pytest.mark.slow
def test_mp_config_runs_the_lmcache_server_with_fs_and_redis(tmp_path, redis_server):
    port, http_port = free_port(), free_port()
    init = run_kvctl("config", "init", "--mode", "mp", "--out", tmp_path / "cfg", "--tier", "cpu:0.2",
                     "--tier", f"disk:{tmp_path}/l2", "--tier", redis_server.url, "--mp-port", port,
                     "--mp-http-port", http_port)
    assert init.code == 0, init.stderr
    values = yaml.safe_load((tmp_path / "cfg" / "lmcache.yaml").read_text())
    shown = json.loads(run_kvctl("config", "show", tmp_path / "cfg", "--format", "json").stdout)
    assert shown["command"] == mp_server_argv(values)
    log = tmp_path / "server.log"
    proc = start_process([sys.executable, "-m", "lmcache.v1.multiprocess.http_server", *mp_server_argv(values)], log)
    url = f"http://127.0.0.1:{http_port}"
    try:
        wait_until(lambda: http_json("GET", f"{url}/healthcheck")["status"] == "healthy", 120, "lmcache server",
                   proc, log)
        status = http_json("GET", f"{url}/status")
        assert status["chunk_size"] == 256 and status["hash_algorithm"] == "blake3"
        assert all(adapter["is_healthy"] for adapter in status["storage_manager"]["l2_adapters"])
        adapters = http_json("GET", f"{url}/config/adapters")["adapters"]
        assert [adapter["type_name"] for adapter in adapters] == ["fs", "resp"]
        eviction = status["storage_manager"]["l1_eviction_controller"]
        assert eviction["eviction_policy"] == "LRU"
        addresses = listening_addresses(proc.pid)
        assert ("127.0.0.1", http_port) in addresses and ("127.0.0.1", port) in addresses
        assert http_client().get(f"{url}/cache/objects", params={"tier": "l2"}, timeout=10).status_code == 503
    finally:
        stop_process(proc)
