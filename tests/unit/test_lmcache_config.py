import pytest

from kvctl.core.lmcache.config import (
    ConversionError,
    convert_value,
    effective_config,
    parse_env_file,
    redact,
)


@pytest.mark.parametrize(("key", "raw", "value"), [
    ("chunk_size", "256", 256),
    ("chunk_size", 512, 512),
    ("local_cpu", "TRUE", True),
    ("local_cpu", "0", False),
    ("max_local_cpu_size", "1.5", 1.5),
    ("lmcache_worker_ports", "8500,8501", [8500, 8501]),
    ("internal_api_server_include_index_list", 1, [1]),
    ("extra_config", '{"a": 1}', {"a": 1}),
    ("local_disk", "file:///a/,file:///b/", "/a/,/b/"),
    ("remote_url", None, None),
])
def test_values_convert_like_lmcache(key, raw, value):
    assert convert_value(key, raw) == value


@pytest.mark.parametrize(("key", "raw"), [
    ("local_cpu", "yes"),  # LMCache reads anything but true/1 as False
    ("chunk_size", "big"),
    ("chunk_size", 3.5),  # LMCache would truncate
    ("chunk_size", True),
    ("chunk_size", None),  # not optional: LMCache keeps the default
    ("extra_config", "[1, 2]"),
    ("remote_url", {"host": "h"}),
])
def test_values_lmcache_would_misread_are_rejected(key, raw):
    with pytest.raises(ConversionError):
        convert_value(key, raw)


def test_layers_defaults_file_env_extra_config():
    effective = effective_config(
        {"chunk_size": 512, "local_cpu": False},
        "file:lmcache.yaml",
        {"LMCACHE_CHUNK_SIZE": "'1024'", "LMCACHE_MAX_LOCAL_CPU_SIZE": "nope", "HOME": "/root"},
        {"lmcache.local_cpu": True, "lmcache.mp.port": 1, "lmcache_rpc_port": 3},
        "vllm:kv-transfer-config.json",
    )
    assert effective.values["chunk_size"] == 1024
    assert effective.sources["chunk_size"] == "env:LMCACHE_CHUNK_SIZE"
    assert effective.values["local_cpu"] is True
    assert effective.sources["local_cpu"] == "vllm:kv-transfer-config.json"
    assert effective.values["max_local_cpu_size"] == 5.0
    assert effective.sources["max_local_cpu_size"] == "default"
    assert effective.problems == [("max_local_cpu_size", "env", "'nope' is not a number")]


def test_env_file_parsing_follows_shell_quoting():
    text = "# comment\nexport A='x y'\nB=\"2\"  # trailing\nnot a line\nexport C=redis://:p%40@h:1\n"
    assert parse_env_file(text) == {"A": "x y", "B": "2", "C": "redis://:p%40@h:1"}


def test_secrets_are_redacted_in_nested_values():
    shown = redact("extra_config", {"password": "p", "nested": {"redis_url": "redis://:p@h:1"}, "n": 1})
    assert shown == {"password": "***", "nested": {"redis_url": "redis://:***@h:1"}, "n": 1}
