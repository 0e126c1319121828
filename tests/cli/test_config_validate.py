"""Every `kvctl config validate` finding, each from a real bad file."""

import json

import pytest

from kvctl.core.serve import platform
from tests.helpers import run_cli

GOOD = {
    "chunk_size": 256,
    "local_cpu": True,
    "max_local_cpu_size": 0.5,
    "pre_caching_hash_algorithm": "sha256_cbor",
    "lmcache_instance_id": "kvctl-test",
    "internal_api_server_enabled": True,
}


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in list(__import__("os").environ):
        if name.startswith(("LMCACHE_", "LM_CACHE_")):
            monkeypatch.delenv(name)


def validate(path, *extra):
    result = run_cli("config", "validate", path, "--no-lmcache", "--format", "json", *extra)
    return result, result.json()


def write_yaml(tmp_path, values, name="lmcache.yaml"):
    import yaml

    path = tmp_path / name
    path.write_text(yaml.safe_dump(values) if isinstance(values, dict) else values)
    return path


def findings(report, level=None):
    return [f for f in report["findings"] if level is None or f["level"] == level]


def test_a_good_file_is_valid(tmp_path):
    result, report = validate(write_yaml(tmp_path, GOOD))
    assert result.code == 0
    assert report == {"file": str(tmp_path / "lmcache.yaml"), "mode": "inprocess", "ok": True,
                      "lmcache_checked": False, "findings": []}


CASES = [
    # (extra YAML, level, key, words in the message, words in the hint)
    ({"chunck_size": 256}, "error", "chunck_size", "unknown key", "did you mean 'chunk_size'"),
    ({"max_local_cpu_sise": 1}, "error", "max_local_cpu_sise", "unknown key", "max_local_cpu_size"),
    ({"controller_url": "127.0.0.1:9000"}, "error", "controller_url", "silently dropped", "controller_pull_url"),
    ({"lmcache_worker_port": 8500}, "error", "lmcache_worker_port", "silently dropped", "lmcache_worker_ports"),
    ({"enable_xpyd": True}, "error", "enable_xpyd", "silently dropped", "enable_pd"),
    ({"nixl_peer_port": 1}, "error", "nixl_peer_port", "ignored", "remove"),
    ({"plugin_locations": ["/p"]}, "warning", "plugin_locations", "deprecated", "runtime_plugin_locations"),
    ({"remote_url": "redis://127.0.0.1:6379", "remote_storage_plugins": ["redis"]}, "error", "remote_url",
     "next to remote_storage_plugins", "only remote_storage_plugins"),
    ({"local_cpu": "yes"}, "error", "local_cpu", "reads it as false", "bool"),
    ({"chunk_size": "many"}, "error", "chunk_size", "not an integer", "int"),
    ({"chunk_size": 256.5}, "error", "chunk_size", "truncate", "int"),
    ({"max_local_cpu_size": [1]}, "error", "max_local_cpu_size", "not a number", "float"),
    ({"extra_config": "not json"}, "error", "extra_config", "not a JSON object", "dict"),
    ({"local_disk": "file:///tmp/kvctl-disk/", "max_local_disk_size": 0}, "error", "max_local_disk_size",
     "silently creates no disk tier", "max_local_disk_size"),
    ({"local_disk": "file:///tmp/kvctl-disk/"}, "error", "max_local_disk_size", "is 0", "budget"),
    ({"chunk_size": 100}, "error", "chunk_size", "multiple of vLLM's block size 128", "multiple of 128"),
    ({"max_local_cpu_size": 100000}, "error", "max_local_cpu_size", "free memory", "lower"),
    ({"local_disk": "/tmp/kvctl-disk/", "max_local_disk_size": 10**7}, "error", "max_local_disk_size", "GB free",
     "lower"),
    ({"remote_url": "redis://host:port"}, "error", "remote_url", "bad port", "1 to 65535"),
    ({"remote_url": "redis:///0"}, "error", "remote_url", "no host", "redis://host:port"),
    ({"remote_url": "redis://h:1/zero"}, "error", "remote_url", "database must be a number", "database index"),
    ({"run_script_api_enabled": True}, "warning", "run_script_api_enabled", "run Python code", "false"),
    ({"internal_api_server_host": "0.0.0.0"}, "warning", "internal_api_server_host", "beyond this machine",
     "127.0.0.1"),
    ({"internal_api_server_enabled": False}, "warning", "internal_api_server_enabled", "offline", "true"),
    ({"pre_caching_hash_algorithm": "md5"}, "error", "pre_caching_hash_algorithm", "falls back", "sha256_cbor"),
]


@pytest.mark.parametrize(("extra", "level", "key", "message", "hint"), CASES,
                         ids=[case[2] + "-" + case[3][:12] for case in CASES])
def test_each_finding(tmp_path, extra, level, key, message, hint):
    result, report = validate(write_yaml(tmp_path, {**GOOD, **extra}))
    matching = [f for f in report["findings"] if f["key"] == key and f["level"] == level]
    assert matching, report["findings"]
    assert message in matching[0]["message"] and hint in matching[0]["hint"]
    assert result.code == (1 if level == "error" else 0)
    assert report["ok"] is (level != "error")
    assert "Traceback" not in result.stderr


def test_missing_determinism_settings_are_warned(tmp_path):
    values = {key: value for key, value in GOOD.items()
              if key not in ("pre_caching_hash_algorithm", "lmcache_instance_id")}
    _, report = validate(write_yaml(tmp_path, values))
    assert {f["key"] for f in findings(report, "warning")} == {"pre_caching_hash_algorithm", "lmcache_instance_id"}


@pytest.mark.parametrize(("text", "message"), [
    ("chunk_size: [1,\n", "not valid YAML (line"),
    ("", "is empty"),
    ("- a\n- b\n", "must be a mapping"),
])
def test_unreadable_yaml(tmp_path, text, message):
    result, report = validate(write_yaml(tmp_path, text))
    assert result.code == 1 and message in report["findings"][0]["message"]


def test_binary_file_is_one_clear_error(tmp_path):
    path = tmp_path / "lmcache.yaml"
    path.write_bytes(b"\x00\x01\x02")
    result = run_cli("config", "validate", path)
    assert result.code == 1 and result.stderr.startswith("error:") and "binary" in result.stderr


@pytest.mark.parametrize(("variable", "value", "message", "hint"), [
    ("LM_CACHE_CHUNK_SIZE", "256", "is ignored", "LMCACHE_CHUNK_SIZE"),
    ("LMCACHE_CONTROLLER_URL", "h:1", "silently dropped", "LMCACHE_CONTROLLER_PULL_URL"),
    ("LMCACHE_CHUNK_SIZ", "256", "not a variable LMCache reads", "LMCACHE_CHUNK_SIZE"),
    ("LMCACHE_LOCAL_CPU", "on", "reads it as false", "bool"),
])
def test_environment_traps_in_env_sh(tmp_path, variable, value, message, hint):
    write_yaml(tmp_path, GOOD)
    (tmp_path / "env.sh").write_text(f"export PYTHONHASHSEED=0\nexport {variable}={value}\n")
    result, report = validate(tmp_path)
    matching = [f for f in report["findings"] if f["key"] == f"env.sh:{variable}"]
    assert matching and matching[0]["level"] == "error", report["findings"]
    assert message in matching[0]["message"] and hint in matching[0]["hint"]
    assert result.code == 1


def test_environment_of_the_shell_is_checked_too(tmp_path, monkeypatch):
    monkeypatch.setenv("LM_CACHE_LOCAL_DISK", "/x")
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", "512")
    _, report = validate(write_yaml(tmp_path, GOOD))
    by_key = {f["key"]: f for f in report["findings"]}
    assert by_key["env:LM_CACHE_LOCAL_DISK"]["level"] == "error"
    assert by_key["env:LMCACHE_CHUNK_SIZE"]["level"] == "warning"
    assert "overrides chunk_size" in by_key["env:LMCACHE_CHUNK_SIZE"]["message"]


def test_env_sh_without_hash_seed_is_warned(tmp_path):
    write_yaml(tmp_path, GOOD)
    (tmp_path / "env.sh").write_text("export LMCACHE_CHUNK_SIZE=256\n")
    _, report = validate(tmp_path)
    assert any(f["key"] == "PYTHONHASHSEED" and f["level"] == "warning" for f in report["findings"])


@pytest.mark.parametrize(("config", "key", "message"), [
    ({"kv_connector": "LMCacheConnector", "kv_role": "kv_both"}, "kv_connector", "not an LMCache connector"),
    ({"kv_connector": "LMCacheConnectorV1", "kv_role": "both"}, "kv_role", "is not one of"),
    ({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
      "kv_connector_extra_config": {"lmcache.chunk_siz": 256}}, "chunk_siz", "unknown key"),
    ({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
      "kv_connector_extra_config": {"lmcache.local_cpu": "sure"}}, "lmcache.local_cpu", "reads it as false"),
    ({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
      "kv_connector_extra_config": {"lmcache.mp.port": 1}}, "lmcache.mp.port", "only applies"),
    ({"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"lmcache.mp.prot": 1}}, "lmcache.mp.prot", "unknown MP connector key"),
])
def test_kv_transfer_config_findings(tmp_path, config, key, message):
    path = tmp_path / "kv-transfer-config.json"
    path.write_text(json.dumps(config))
    result, report = validate(path)
    matching = [f for f in report["findings"] if f["key"] == key]
    assert matching and message in matching[0]["message"], report["findings"]
    assert result.code == 1


def test_kv_transfer_config_that_is_not_json(tmp_path):
    path = tmp_path / "kv-transfer-config.json"
    path.write_text("{kv_connector: x}")
    result, report = validate(path)
    assert result.code == 1 and "not valid JSON (line 1" in report["findings"][0]["message"]


def test_mp_server_yaml_findings(tmp_path):
    result, _ = validate(write_yaml(tmp_path, {"port": 5555, "chunk_size": 256, "l1_size_gb": 1,
                                               "eviction_policy": "LRU"}))
    assert result.code == 0
    values = {"port": "5555", "chunk_size": 200, "l1_size_gb": 1, "eviction_policy": "LFU", "htpp_port": 1,
              "http_host": "0.0.0.0"}
    result, report = validate(write_yaml(tmp_path, values), "--mode", "mp")
    by_key = {f["key"]: f for f in report["findings"]}
    assert "not an integer" in by_key["port"]["message"]
    assert "multiple of vLLM's block size" in by_key["chunk_size"]["message"]
    assert "not one of LRU" in by_key["eviction_policy"]["message"]
    assert "did you mean 'http_port'" in by_key["htpp_port"]["hint"]
    assert by_key["http_host"]["level"] == "warning"
    _, report = validate(write_yaml(tmp_path, {"port": 5555, "l1_size_gb": 1}), "--mode", "mp")
    assert [f["key"] for f in report["findings"]] == ["eviction_policy"]
    result, report = validate(write_yaml(tmp_path, {"port": 5555, "hash_algorithm": "builtin"}), "--mode", "mp")
    assert result.code == 1 and "change with every server process" in report["findings"][0]["message"]


def test_mp_connector_and_server_must_agree(tmp_path):
    write_yaml(tmp_path, {"port": 5601, "hash_algorithm": "blake3", "chunk_size": 256})
    (tmp_path / "kv-transfer-config.json").write_text(json.dumps({
        "kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"lmcache.mp.port": 5555, "lmcache.mp.hash_algorithm": "sha256_cbor"}}))
    result, report = validate(tmp_path)
    assert report["mode"] == "mp" and result.code == 1
    assert {f["key"] for f in report["findings"]} == {"lmcache.mp.port", "lmcache.mp.hash_algorithm"}


def test_block_size_option_and_table_output(tmp_path):
    path = write_yaml(tmp_path, {**GOOD, "chunk_size": 48})
    assert validate(path, "--block-size", "16")[0].code == 0
    table = run_cli("config", "validate", path, "--no-lmcache", "--format", "table")
    assert table.code == 1
    assert table.stdout.strip().splitlines() == [
        f"{path}: error: chunk_size 48 is not a positive multiple of vLLM's block size {platform.vllm_block_size()} "
        f"(hint: use a multiple of {platform.vllm_block_size()} (vLLM rejects the connector otherwise), e.g. 256)"]


@pytest.mark.parametrize(("text", "message"), [
    ("max_local_cpu_size: .nan", "nan is not a number"),
    ("max_local_cpu_size: .inf", "inf is not a size"),
    ("max_local_cpu_size: -1", "-1 is not a size"),
    ("max_local_cpu_size: 0", "max_local_cpu_size is 0"),
    ("max_local_disk_size: -.inf\nlocal_disk: /tmp/kvctl-disk/", "-inf is not a size"),
    ("reserve_local_cpu_size: .nan", "nan is not a number"),
])
def test_sizes_that_are_no_real_amount_are_errors(tmp_path, text, message):
    import yaml

    key = text.split(":")[0]
    path = write_yaml(tmp_path, yaml.safe_dump({name: value for name, value in GOOD.items() if name != key}) + text)
    result, report = validate(path)
    matching = [f for f in findings(report, "error") if f["key"] == key]
    assert matching and message in matching[0]["message"], report["findings"]
    assert result.code == 1


@pytest.mark.parametrize(("size", "message"), [(".nan", "is not a number"), (".inf", "is not a size"),
                                               ("0", "is not a size"), ("-2", "is not a size")])
def test_mp_l1_size_must_be_a_real_amount(tmp_path, size, message):
    path = write_yaml(tmp_path, f"port: 5555\nl1_size_gb: {size}\neviction_policy: LRU\n")
    result, report = validate(path, "--mode", "mp")
    assert result.code == 1
    assert [f["key"] for f in report["findings"]] == ["l1_size_gb"] and message in report["findings"][0]["message"]


def test_mp_resp_adapters_must_share_credentials(tmp_path):
    adapters = '[{type: resp, host: a, port: 1, password: x}, {type: resp, host: b, port: 2}]'
    result, report = validate(write_yaml(tmp_path, f"port: 5555\nl2_adapter: {adapters}\n"), "--mode", "mp")
    assert result.code == 1
    assert [f["key"] for f in report["findings"]] == ["l2_adapter"]
    assert "different credentials" in report["findings"][0]["message"]


def test_chunk_statistics_need_kvctls_connector_module_unless_hashing_is_builtin(tmp_path):
    write_yaml(tmp_path, {**GOOD, "enable_chunk_statistics": True, "pre_caching_hash_algorithm": "builtin"})
    (tmp_path / "kv-transfer-config.json").write_text(json.dumps({"kv_connector": "LMCacheConnectorV1",
                                                                  "kv_role": "kv_both"}))
    _, report = validate(tmp_path)  # the recorder re-makes the builtin first hash: the same one
    assert not [f for f in report["findings"] if f["key"] == "enable_chunk_statistics"]
    write_yaml(tmp_path, {**GOOD, "enable_chunk_statistics": True})
    stock = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    (tmp_path / "kv-transfer-config.json").write_text(json.dumps(stock))
    result, report = validate(tmp_path)
    (finding,) = [f for f in report["findings"] if f["key"] == "enable_chunk_statistics"]
    assert result.code == 1 and "every lookup misses" in finding["message"]
    assert "kvctl_plugins.vllm_connector" in finding["hint"]
    with_plugins = {**stock, "kv_connector_module_path": "kvctl_plugins.vllm_connector"}
    (tmp_path / "kv-transfer-config.json").write_text(json.dumps(with_plugins))
    _, report = validate(tmp_path)
    assert not [f for f in report["findings"] if f["key"] == "enable_chunk_statistics"]
    on_the_connector = {**stock, "kv_connector_extra_config": {"lmcache.enable_chunk_statistics": True}}
    write_yaml(tmp_path, GOOD)
    (tmp_path / "kv-transfer-config.json").write_text(json.dumps(on_the_connector))
    _, report = validate(tmp_path)
    assert [f["key"] for f in report["findings"] if f["level"] == "error"] == ["enable_chunk_statistics"]
