import json
from pathlib import Path

import pytest
import yaml

from kvctl.core.config.init import ConfigRequest, build_config, mp_server_argv, write_files
from kvctl.core.errors import KvctlError, UsageError
from kvctl.core.lmcache.config import parse_env_file
from kvctl.core.lmcache.tiers import parse_tier
from kvctl.core.serve import platform


def tiers(*texts):
    return [parse_tier(text) for text in texts]


def test_inprocess_always_enables_what_kvctl_needs(tmp_path):
    generated = build_config(ConfigRequest(tiers=tiers("cpu:1", f"disk:{tmp_path}/d:2", "redis://:pw@127.0.0.1:6390/1"),
                                           internal_api_port_start=7100), tmp_path / "cfg")
    values = generated.lmcache
    assert values["internal_api_server_enabled"] is True
    assert values["internal_api_server_host"] == "127.0.0.1"
    assert values["internal_api_server_port_start"] == 7100
    assert values["pre_caching_hash_algorithm"] == "sha256_cbor"
    assert values["lmcache_instance_id"] == "kvctl-cfg"
    assert values["run_script_api_enabled"] is False
    assert values["local_disk"] == f"file://{tmp_path}/d/"
    assert values["max_local_disk_size"] == 2.0
    assert values["remote_url"] == "redis://:pw@127.0.0.1:6390/1"
    assert generated.env["PYTHONHASHSEED"] == "0"
    assert generated.kv_transfer == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
                                     "kv_connector_module_path": "kvctl_plugins.vllm_connector"}
    assert "kv_connector_module_path" not in build_config(ConfigRequest(plugins=False), tmp_path / "c").kv_transfer


def test_default_tiers_fit_the_machine(tmp_path):
    values = build_config(ConfigRequest(), tmp_path / "cfg").lmcache
    assert 0.5 <= values["max_local_cpu_size"] <= min(5.0, platform.available_memory_gb())
    assert values["local_disk"] == f"file://{tmp_path}/cfg/disk-cache/"
    assert 1.0 <= values["max_local_disk_size"] <= 50
    assert values["chunk_size"] % platform.vllm_block_size() == 0


@pytest.mark.parametrize(("free_gb", "cpu_tier_gb"), [(20.0, 4.0), (100.0, 5.0), (1.0, 0.5), (7.3, 1.5)])
def test_the_default_cpu_tier_is_a_fifth_of_the_free_ram_within_bounds(monkeypatch, free_gb, cpu_tier_gb):
    monkeypatch.setattr(platform, "available_memory_gb", lambda: free_gb)
    assert platform.default_cpu_tier_gb() == cpu_tier_gb


def test_files_render_and_env_sh_matches_the_yaml(tmp_path):
    generated = build_config(ConfigRequest(tiers=tiers("cpu:1"), model="tiny"), tmp_path)
    files = generated.render(tmp_path)
    assert yaml.safe_load(files["lmcache.yaml"]) == generated.lmcache
    assert json.loads(files["kv-transfer-config.json"]) == generated.kv_transfer
    env = parse_env_file(files["env.sh"])
    assert env["PYTHONHASHSEED"] == "0" and env["KVCTL_MODEL"] == "tiny"
    assert env["LMCACHE_CHUNK_SIZE"] == "256"
    assert env["LMCACHE_INTERNAL_API_SERVER_ENABLED"] == "true"


def test_mp_mode_writes_server_flags_and_connector_keys(tmp_path):
    generated = build_config(ConfigRequest(mode="mp", tiers=tiers("cpu:1", f"disk:{tmp_path}/l2", "redis://u:p@127.0.0.1:6391"),
                                           mp_port=5601, mp_http_port=8601), tmp_path)
    values = generated.lmcache
    assert values["l2_adapter"] == [{"type": "fs", "base_path": f"{tmp_path}/l2"},
                                    {"type": "resp", "host": "127.0.0.1", "port": 6391, "username": "u",
                                     "password": "p"}]
    assert values["supported_transfer_mode"] == "auto" and values["http_host"] == "127.0.0.1"
    extra = generated.kv_transfer["kv_connector_extra_config"]
    assert extra == {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 5601,
                     "lmcache.mp.hash_algorithm": "blake3"}
    argv = mp_server_argv(values)
    assert argv[argv.index("--http-port") + 1] == "8601"
    assert argv.count("--l2-adapter") == 2
    assert json.loads(argv[argv.index("--l2-adapter") + 1]) == {"type": "fs", "base_path": f"{tmp_path}/l2"}


@pytest.mark.parametrize("url", ["rediss://h:1", "redis-sentinel://a:1/m", "redis-cluster://a:1,b:2", "redis://h:1/2"])
def test_mp_mode_refuses_redis_urls_its_adapter_cannot_use(tmp_path, url):
    with pytest.raises(UsageError):
        build_config(ConfigRequest(mode="mp", tiers=tiers(url)), tmp_path)


@pytest.mark.parametrize(("mode", "algorithm"), [("inprocess", "blake3"), ("mp", "xxhash"), ("mp", "builtin")])
def test_hash_algorithm_must_suit_the_mode(tmp_path, mode, algorithm):
    with pytest.raises(UsageError):
        build_config(ConfigRequest(mode=mode, hash_algorithm=algorithm), tmp_path)


def test_chunk_size_must_be_a_multiple_of_the_block_size(tmp_path):
    with pytest.raises(UsageError, match="multiple of vLLM's block size 128"):
        build_config(ConfigRequest(chunk_size=200, platform="cpu"), tmp_path)
    assert build_config(ConfigRequest(chunk_size=48, platform="gpu"), tmp_path).lmcache["chunk_size"] == 48


def test_write_files_never_replaces_without_force(tmp_path):
    first = write_files({"a.txt": "one", "b.txt": "two"}, tmp_path, force=False)
    assert [path.read_text() for path in first] == ["one", "two"]
    with pytest.raises(KvctlError, match="already exist"):
        write_files({"a.txt": "new", "c.txt": "three"}, tmp_path, force=False)
    assert (tmp_path / "a.txt").read_text() == "one" and not (tmp_path / "c.txt").exists()
    write_files({"a.txt": "new"}, tmp_path, force=True)
    assert (tmp_path / "a.txt").read_text() == "new"
    assert sorted(path.name for path in Path(tmp_path).iterdir()) == ["a.txt", "b.txt"]  # no temp files left


def test_written_files_are_owner_only_whatever_the_umask(tmp_path):
    import os
    import stat

    previous = os.umask(0)  # the files may hold a Redis password: their mode must not depend on the umask
    try:
        written = write_files({"lmcache.yaml": "remote_url: redis://:pw@h:1\n", "env.sh": "", "a.json": "{}"},
                              tmp_path, force=False)
    finally:
        os.umask(previous)
    assert [stat.S_IMODE(path.stat().st_mode) for path in written] == [0o600, 0o600, 0o600]
