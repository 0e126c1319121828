"""`kvctl serve --dry-run` and the refusals that come before anything starts."""

import json
import os
import socket
from importlib.metadata import version
from pathlib import Path

import pytest

from tests.helpers import run_cli


@pytest.fixture(autouse=True)
def kvctl_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCTL_CACHE_DIR", str(tmp_path / "cache"))
    for name in os.environ:
        if name.startswith("LMCACHE_"):
            monkeypatch.delenv(name)
    return tmp_path / "cache"


def plan(*args):
    result = run_cli("serve", "--dry-run", "--format", "json", *args)
    assert result.code == 0, result.stderr
    return result.json()


def test_inprocess_plan_on_the_embedded_default(kvctl_cache):
    payload = plan("--port", "18000", "--internal-api-port-start", "17000", "--", "--max-model-len", "1024")
    (vllm,) = payload["components"]
    assert payload["mode"] == "inprocess" and payload["model"] == str(kvctl_cache / "models" / "tiny")
    argv = vllm["argv"]
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--port") + 1] == "18000"
    assert argv[-2:] == ["--max-model-len", "1024"]
    assert json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_module_path"] == \
        "kvctl_plugins.vllm_connector"
    assert vllm["env"]["PYTHONHASHSEED"] == "0" and vllm["env"]["HF_HUB_OFFLINE"] == "1"
    assert vllm["env"]["LMCACHE_CONFIG_FILE"] == payload["config_dir"] + "/lmcache.yaml"
    # ready when vLLM lists the model and every LMCache API says it is this LMCache, not on a mere 200
    assert [(check["kind"], check["target"], check["expect"]) for check in vllm["ready"]] == [
        ("models", "http://127.0.0.1:18000/v1/models", payload["model"]),
        ("json", "http://127.0.0.1:17000/lmc_version", version("lmcache")),
        ("json", "http://127.0.0.1:17001/lmc_version", version("lmcache"))]
    assert payload["endpoints"]["internal_api"] == ["http://127.0.0.1:17000", "http://127.0.0.1:17001"]
    assert [(use["port"], use["owner"]) for use in payload["ports"]] == [
        (18000, "vLLM"), (17000, "LMCache's scheduler API"), (17001, "LMCache's worker 0 API")]
    assert payload["unset_env"] == []
    assert not (kvctl_cache / "serve").exists()  # a dry run writes nothing


def test_mp_plan_starts_a_coordinator_then_the_lmcache_server():
    payload = plan("--mode", "mp", "--mp-port", "15555", "--mp-http-port", "18080", "--coordinator-port", "19300")
    coordinator, server, vllm = payload["components"]
    pins_file = Path(vllm["log"]).parents[1] / "coordinator-metadata.json"  # beside the logs: kept across restarts
    assert coordinator["name"] == "lmcache-coordinator" and coordinator["argv"][1:] == [
        "-m", "lmcache.v1.mp_coordinator", "--host", "127.0.0.1", "--port", "19300", "--chunk-size", "256",
        "--hash-algorithm", "blake3", "--metadata-path", str(pins_file)]
    assert coordinator["ready"] == [{"kind": "json", "target": "http://127.0.0.1:19300/healthz",
                                     "label": "the LMCache coordinator", "expect": {"status": "healthy"}}]
    assert server["name"] == "lmcache-server" and "lmcache.v1.multiprocess.http_server" in server["argv"]
    assert server["argv"][server["argv"].index("--http-port") + 1] == "18080"
    assert server["argv"][server["argv"].index("--coordinator-url") + 1] == "http://127.0.0.1:19300"
    assert server["argv"][server["argv"].index("--coordinator-advertise-ip") + 1] == "127.0.0.1"
    assert [(check["target"], check["expect"]) for check in server["ready"]] == [
        ("http://127.0.0.1:18080/healthcheck", {"status": "healthy"})]
    kv_transfer = json.loads(vllm["argv"][vllm["argv"].index("--kv-transfer-config") + 1])
    assert kv_transfer["kv_connector"] == "LMCacheMPConnector" and kv_transfer["kv_connector_extra_config"][
        "lmcache.mp.port"] == 15555
    assert payload["endpoints"]["coordinator"] == "http://127.0.0.1:19300"
    assert {use["port"] for use in payload["ports"]} == {8000, 19300, 15555, 18080}


def test_mp_plan_with_a_given_coordinator_or_none():
    given = plan("--mode", "mp", "--coordinator", "http://127.0.0.1:9400")
    assert [component["name"] for component in given["components"]] == ["lmcache-server", "vllm"]
    server = given["components"][0]["argv"]
    assert server[server.index("--coordinator-url") + 1] == "http://127.0.0.1:9400"
    assert given["endpoints"]["coordinator"] == "http://127.0.0.1:9400" and 9300 not in [
        use["port"] for use in given["ports"]]
    none = plan("--mode", "mp", "--no-coordinator")
    assert [component["name"] for component in none["components"]] == ["lmcache-server", "vllm"]
    assert "--coordinator-url" not in none["components"][0]["argv"] and "coordinator" not in none["endpoints"]


@pytest.mark.parametrize("args, message", [
    (("--coordinator", "127.0.0.1:9300", "--mode", "mp"), "is not an http:// or https:// URL"),
    (("--coordinator", "http://127.0.0.1:9300", "--no-coordinator", "--mode", "mp"), "with --no-coordinator"),
    (("--coordinator", "http://127.0.0.1:9300"), "--coordinator is for MP mode"),
    (("--", "--tensor-parallel-size", "two"), "--tensor-parallel-size two is not a positive number"),
])
def test_bad_serve_options_are_refused(args, message):
    result = run_cli("serve", "--dry-run", *args)
    assert result.code == 2 and message in result.stderr.splitlines()[0]
    assert result.stderr.splitlines()[1].startswith("hint: ") and "Traceback" not in result.stderr


@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_ipv6_loopback_host(host):
    payload = plan("--host", host, "--port", "18000")
    vllm = payload["components"][-1]
    assert vllm["argv"][vllm["argv"].index("--host") + 1] == "::1"
    assert vllm["ready"][0]["target"] == "http://[::1]:18000/v1/models"
    assert payload["endpoints"]["vllm"] == "http://[::1]:18000" and payload["ports"][0]["host"] == host


def test_served_model_name_is_what_vllm_must_list():
    vllm = plan("--", "--served-model-name", "tiny-chat", "tiny-alias")["components"][-1]
    assert (vllm["ready"][0]["kind"], vllm["ready"][0]["expect"]) == ("models", "tiny-chat")


def test_every_tensor_parallel_worker_gets_its_api_port():
    payload = plan("--internal-api-port-start", "17000", "--", "--tensor-parallel-size=2")
    assert [use["port"] for use in payload["ports"][1:]] == [17000, 17001, 17002]
    assert [check["target"] for check in payload["components"][-1]["ready"][1:]] == [
        f"http://127.0.0.1:{port}/lmc_version" for port in (17000, 17001, 17002)]


def test_inherited_lmcache_variables_are_left_out_unless_kept(monkeypatch):
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", "16")
    monkeypatch.setenv("LMCACHE_DISABLE_BANNER", "1")  # kvctl sets it itself
    assert plan()["unset_env"] == ["LMCACHE_CHUNK_SIZE"]
    assert plan("--keep-lmcache-env")["unset_env"] == []
    shell = run_cli("serve", "--dry-run", "--format", "table")
    assert "env -u LMCACHE_CHUNK_SIZE " in shell.stdout


def test_plan_as_shell_commands():
    result = run_cli("serve", "--dry-run", "--format", "table")
    assert result.code == 0 and "# vllm (log:" in result.stdout and "PYTHONHASHSEED=0" in result.stdout


def test_port_in_use_is_refused(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_cli("serve", "--port", str(port), "--internal-api-port-start", "17500")
    assert result.code == 2
    assert result.stderr.splitlines()[0] == f"error: port {port} (vLLM) is already in use"


@pytest.mark.parametrize("args, clash", [
    (("--internal-api-port-start", "17999", "--port", "18000"), "18000 is taken by vLLM and by LMCache's worker 0 API"),
    (("--internal-api-port-start", "17000", "--port", "17002", "--", "-tp", "2"),
     "17002 is taken by vLLM and by LMCache's worker 1 API"),
    (("--mode", "mp", "--mp-http-port", "18100", "--coordinator-port", "18100"),
     "18100 is taken by the LMCache coordinator and by the MP server's HTTP port"),
])
def test_ports_that_collide_inside_the_plan_are_refused_before_anything_starts(kvctl_cache, args, clash):
    result = run_cli("serve", *args)
    assert result.code == 2, result.stderr
    assert result.stderr.splitlines()[0] == f"error: ports collide in this plan: {clash}"
    assert result.stderr.splitlines()[1].startswith("hint: choose other ports: --port, --internal-api-port-start")
    assert not (kvctl_cache / "serve" / "default" / "logs").exists()  # nothing was started


def test_ports_from_the_configuration_file_are_the_ones_checked(tmp_path):
    init = run_cli("config", "init", "--mode", "mp", "--out", tmp_path / "cfg", "--tier", "cpu:1", "--mp-port",
                   "18200", "--mp-http-port", "18201")
    assert init.code == 0, init.stderr
    result = run_cli("serve", "--config", tmp_path / "cfg", "--port", "18201", "--no-coordinator")
    assert result.code == 2
    assert result.stderr.splitlines()[0] == ("error: ports collide in this plan: 18201 is taken by vLLM and by the MP "
                                             "server's HTTP port")


def test_ports_beyond_the_range_are_refused():
    result = run_cli("serve", "--internal-api-port-start", "65535", "--port", "18300")
    assert result.code == 2
    assert result.stderr.splitlines()[0] == "error: port 65536 (LMCache's worker 0 API) is out of range"


def test_model_directory_without_a_model_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    result = run_cli("serve", str(tmp_path / "empty"), "--port", "17600", "--internal-api-port-start", "17700")
    assert result.code == 2 and "has no config.json" in result.stderr


def test_configuration_with_a_bad_chunk_size_is_refused(tmp_path):
    assert run_cli("config", "init", "--out", tmp_path / "cfg", "--tier", "cpu:1", "--chunk-size", "256").code == 0
    text = (tmp_path / "cfg" / "lmcache.yaml").read_text().replace("chunk_size: 256", "chunk_size: 100")
    (tmp_path / "cfg" / "lmcache.yaml").write_text(text)
    result = run_cli("serve", "--config", tmp_path / "cfg", "--dry-run")
    assert result.code == 2 and "chunk_size 100, not a multiple of vLLM's block size" in result.stderr
