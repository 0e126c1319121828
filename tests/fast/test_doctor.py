"""`kvctl doctor`'s pure logic: per-member facts, INFO sections, metrics and files in -> findings out."""

from __future__ import annotations

import os

import pytest

from kvctl.core.diagnose.doctor import (
    RouteGuard,
    compare_members,
    compare_with_config,
    disk_findings,
    env_overrides,
    exposure_findings,
    redis_info_findings,
    retrieve_findings,
    secret_file_findings,
)
from kvctl.core.diagnose.findings import Finding, Report
from kvctl.core.lmcache.key_facts import UNSET, KeyFacts
from kvctl.core.lmcache.keys import KeyRecipe, disk_file_name, inprocess_keys

FACTS = dict(chunk_size=256, hash_algorithm="sha256_cbor", hash_seed="0", model="tiny", kv_dtype="half",
             world_size=1, lmcache_version="0.5.6", vllm_version="0.32.0")


def levels(findings):
    return [(finding.level, finding.check) for finding in findings]


def test_identical_members_have_nothing_to_report():
    assert compare_members({"a": KeyFacts(**FACTS), "b": KeyFacts(**FACTS)}) == []


def test_a_differing_seed_is_an_error_naming_both_values_and_the_cost():
    findings = compare_members({"a": KeyFacts(**FACTS), "b": KeyFacts(**{**FACTS, "hash_seed": "1"})})
    assert levels(findings) == [("error", "key_compatibility")]
    assert "a=0" in findings[0].what and "b=1" in findings[0].what and "PYTHONHASHSEED" in findings[0].what
    assert findings[0].cost.startswith("a will never hit b's chunks")


def test_every_key_ingredient_is_compared():
    other = {"chunk_size": 512, "hash_algorithm": "builtin", "model": "/models/tiny", "kv_dtype": "bfloat16",
             "world_size": 2}
    findings = compare_members({"a": KeyFacts(**FACTS), "b": KeyFacts(**{**FACTS, **other})})
    assert len(findings) == len(other) and all(finding.level == "error" for finding in findings)
    for finding, label in zip(findings, ["chunk size", "hash algorithm", "model name", "KV dtype", "world size"]):
        assert finding.what.startswith(label)


def test_unknown_values_are_not_compared_and_seed_free_hashes_ignore_the_seed():
    assert compare_members({"a": KeyFacts(**FACTS), "b": KeyFacts(chunk_size=256)}) == []
    mp = {**FACTS, "hash_algorithm": "blake3"}
    assert compare_members({"a": KeyFacts(**mp), "b": KeyFacts(**{**mp, "hash_seed": "7"})}) == []


def test_versions_out_of_lockstep_are_warnings():
    findings = compare_members({"a": KeyFacts(**FACTS), "b": KeyFacts(**{**FACTS, "lmcache_version": "0.5.5"}),
                                "c": KeyFacts(**{**FACTS, "vllm_version": "0.31.0"})})
    assert levels(findings) == [("warning", "version_lockstep")] * 2


def test_three_members_name_the_groups():
    findings = compare_members({"a": KeyFacts(**FACTS), "b": KeyFacts(**FACTS),
                                "c": KeyFacts(**{**FACTS, "chunk_size": 512})})
    assert "(a, b | c)" in findings[0].cost


def test_an_unset_seed_in_a_running_process_is_an_error():
    findings = compare_members({"a": KeyFacts(**{**FACTS, "hash_seed": UNSET})})
    assert levels(findings) == [("error", "key_compatibility")] and "restart" in findings[0].cost


def test_running_values_against_the_files():
    running = KeyFacts(**{**FACTS, "chunk_size": 512})
    findings = compare_with_config(running, KeyFacts(**FACTS), "cfg", "a")
    assert levels(findings) == [("warning", "config_drift")]
    assert "512" in findings[0].what and "256" in findings[0].what and findings[0].instance == "a"
    assert compare_with_config(running, KeyFacts(**FACTS), "cfg", skip=frozenset({"chunk_size"})) == []


def test_an_env_override_names_variable_file_value_and_effective_value():
    findings = env_overrides({"LMCACHE_CHUNK_SIZE": "512", "PATH": "/bin", "LMCACHE_CONFIG_FILE": "x"},
                             {"chunk_size": 256}, {"chunk_size": 512})
    assert levels(findings) == [("warning", "env_override")]
    assert findings[0].what == "LMCACHE_CHUNK_SIZE=512 overrides chunk_size: 256 in lmcache.yaml, effective 512"


def test_an_env_value_equal_to_the_file_is_no_override_and_an_unset_key_is_info():
    assert env_overrides({"LMCACHE_CHUNK_SIZE": "256"}, {"chunk_size": 256}, None) == []
    findings = env_overrides({"LMCACHE_MIN_RETRIEVE_TOKENS": "64"}, {"chunk_size": 256}, None)
    assert levels(findings) == [("info", "env_override")]


def test_an_overridden_secret_is_redacted():
    findings = env_overrides({"LMCACHE_REMOTE_URL": "redis://u:hunter2@h:1"}, {"remote_url": "redis://h:1"}, None)
    assert findings and "hunter2" not in findings[0].what


@pytest.mark.parametrize("file_values", [{"extra_config": {"a": 1}}, {}], ids=["overrides", "sets"])
def test_secrets_inside_a_json_env_value_are_redacted(file_values):
    extra = ('{"password": "hunter1", "s3_secret_key": "hunter2", "store": {"api_token": "hunter3", '
             '"url": "redis://:hunter4@h:6379"}, "chunks": 4}')
    findings = env_overrides({"LMCACHE_EXTRA_CONFIG": extra, "LMCACHE_REMOTE_URL": "'redis://:hunter5@h:1'"},
                             file_values, None)
    assert len(findings) == 2 and not any(f"hunter{n}" in finding.what for finding in findings for n in range(6))
    assert '"chunks": 4' in findings[0].what and "redis://:***@h:6379" in findings[0].what
    unparsable = env_overrides({"LMCACHE_EXTRA_CONFIG": '{"password": "hunter1",'}, file_values, None)
    assert len(unparsable) == 1 and "hunter1" not in unparsable[0].what


def test_redis_policy_evictions_and_headroom():
    memory = {"maxmemory": 100 << 20, "maxmemory_policy": "allkeys-lru", "used_memory": 95 << 20}
    findings = redis_info_findings(memory, {"evicted_keys": 3}, "Redis r")
    assert levels(findings) == [("warning", "redis")] * 3
    assert "allkeys-lru" in findings[0].what and "3 key(s)" in findings[1].what
    assert redis_info_findings({"maxmemory": 0, "maxmemory_policy": "noeviction", "used_memory": 1}, {}, "r") == []


def test_lookups_that_hit_without_retrieves_are_an_error():
    stats = {"lookup": {"hit_tokens": 512.0}, "retrieve": {"requests": 4.0, "tokens": 512.0, "hit_tokens": 0.0}}
    assert levels(retrieve_findings(stats)) == [("error", "retrieve")]
    assert retrieve_findings({**stats, "retrieve": {"requests": 4.0, "hit_tokens": 256.0}}) == []
    assert retrieve_findings({"lookup": {"hit_tokens": 0.0}, "retrieve": {}}) == []
    assert levels(retrieve_findings(None)) == [("info", "retrieve")]


def test_exposure():
    values = {"internal_api_server_enabled": True, "internal_api_server_host": "0.0.0.0",
              "run_script_api_enabled": True}
    assert levels(exposure_findings(values, RouteGuard(), "cfg")) == [("error", "exposure")] * 2
    guarded = exposure_findings(values, RouteGuard(plugins=True, token=True), "cfg")
    assert levels(guarded)[0] == ("warning", "exposure") and "guarded" in guarded[0].what
    assert exposure_findings({"internal_api_server_enabled": True, "internal_api_server_host": "127.0.0.1"},
                             RouteGuard(), "cfg") == []
    # MP servers' own routes have no guard, token or not
    assert levels(exposure_findings({"http_host": "0.0.0.0"}, RouteGuard(True, True), "mp")) == [("error", "exposure")]


@pytest.mark.parametrize("guard, gap", [
    (RouteGuard(token=True), "plugins are not loaded"),  # a token alone leaves LMCache's /env, /conf ... open
    (RouteGuard(plugins=True), "no routes token"),
    (RouteGuard(plugins=True, token=True, token_in_env=True), "readable from GET /env"),
])
def test_an_exposed_internal_api_is_an_error_unless_the_whole_guard_holds(guard, gap):
    values = {"internal_api_server_enabled": True, "internal_api_server_host": "10.0.0.5"}
    (finding,) = exposure_findings(values, guard, "cfg")
    assert finding.level == "error" and gap in finding.what


def test_secrets_in_readable_files(tmp_path):
    secret = tmp_path / "env.sh"
    secret.write_text("export LMCACHE_REMOTE_URL=redis://:hunter2@127.0.0.1:6379\n")
    plain = tmp_path / "lmcache.yaml"
    plain.write_text("chunk_size: 256\n")
    os.chmod(secret, 0o644)
    os.chmod(plain, 0o644)
    assert levels(secret_file_findings([secret, plain])) == [("error", "secrets")]
    os.chmod(secret, 0o640)
    assert levels(secret_file_findings([secret])) == [("warning", "secrets")]
    os.chmod(secret, 0o600)
    assert secret_file_findings([secret]) == []


def test_disk_stray_torn_empty_and_budget(tmp_path):
    keys = inprocess_keys(list(range(1024)), KeyRecipe("tiny", 256, "sha256_cbor", "0", kv_dtype="half"))
    for key in keys:
        (tmp_path / disk_file_name(key)).write_bytes(b"x" * 1000)
    (tmp_path / disk_file_name(keys[1])).write_bytes(b"x" * 10)
    (tmp_path / disk_file_name(keys[2])).write_bytes(b"")
    (tmp_path / "notes.txt").write_text("hello")
    findings = disk_findings([str(tmp_path)], 1000)
    whats = [finding.what for finding in findings]
    assert levels(findings) == [("warning", "disk")] * 4
    assert "notes.txt" in whats[0] and "zero-length" in whats[1]
    assert "10 bytes where the others have 1000" in whats[2] and disk_file_name(keys[1]) in whats[2]
    assert "beyond its budget" in whats[3]


def test_a_clean_disk_tier_and_a_missing_one(tmp_path):
    keys = inprocess_keys(list(range(512)), KeyRecipe("tiny", 256, "sha256_cbor", "0", kv_dtype="half"))
    for key in keys:
        (tmp_path / disk_file_name(key)).write_bytes(b"x" * 100)
    assert disk_findings([str(tmp_path)], 1 << 20) == []
    assert levels(disk_findings([str(tmp_path / "none")], None)) == [("info", "disk")]


def test_report_shape_and_exit_code():
    report = Report([Finding("info", "x", "i", "c"), Finding("warning", "y", "w", "c", "h", "a"),
                     Finding("error", "z", "e", "c")])
    payload = report.as_dict()
    assert [f["level"] for f in payload["findings"]] == ["error", "warning", "info"]
    assert payload["errors"] == 1 and payload["warnings"] == 1 and report.exit_code == 1
    assert set(payload["findings"][1]) == {"level", "check", "what", "cost", "hint", "instance"}
    assert "instance" not in payload["findings"][0]
    assert Report([Finding("warning", "y", "w", "c")]).exit_code == 0


def test_mp_fs_files_are_chunks_not_strays(tmp_path):
    from kvctl.core.lmcache.keys import ObjectKey

    for index in range(3):
        key = ObjectKey(bytes([index]) * 32, "org/tiny", 0x1000100)
        (tmp_path / key.fs_file_name()).write_bytes(b"x" * 64)
    assert disk_findings([str(tmp_path)], None, ".data") == []
    (tmp_path / "tiny@1@0@-1a6e12a9bdb7fd70@half.pt").write_bytes(b"x")  # an in-process file in an MP store
    assert levels(disk_findings([str(tmp_path)], None, ".data")) == [("warning", "disk")]
