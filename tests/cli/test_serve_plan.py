"""`kvctl serve --dry-run` and the refusals that come before anything starts."""

import json
import socket

import pytest

from tests.helpers import run_cli


@pytest.fixture(autouse=True)
def kvctl_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCTL_CACHE_DIR", str(tmp_path / "cache"))
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
    assert [check["target"] for check in vllm["ready"]] == ["http://127.0.0.1:18000/health",
                                                          "http://127.0.0.1:17001/lmc_version"]
    assert payload["endpoints"]["internal_api"] == ["http://127.0.0.1:17000", "http://127.0.0.1:17001"]
    assert not (kvctl_cache / "serve").exists()  # a dry run writes nothing


def test_mp_plan_starts_the_lmcache_server_first():
    payload = plan("--mode", "mp", "--mp-port", "15555", "--mp-http-port", "18080")
    server, vllm = payload["components"]
    assert server["name"] == "lmcache-server" and "lmcache.v1.multiprocess.http_server" in server["argv"]
    assert server["argv"][server["argv"].index("--http-port") + 1] == "18080"
    assert server["ready"][0]["target"] == "http://127.0.0.1:18080/healthcheck"
    kv_transfer = json.loads(vllm["argv"][vllm["argv"].index("--kv-transfer-config") + 1])
    assert kv_transfer["kv_connector"] == "LMCacheMPConnector" and kv_transfer["kv_connector_extra_config"][
        "lmcache.mp.port"] == 15555


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
    assert result.stderr.splitlines()[0] == f"error: port {port} is already in use"


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
