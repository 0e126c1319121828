"""The pure parts of kvctl.core.admin.manage: KEY=VALUE parsing, the refusal list, backend names, and how
per-process answers fold into one status."""

import pytest

from kvctl.core.admin import manage
from kvctl.core.errors import UsageError
from kvctl.core.lmcache.schema import inprocess_keys


def test_assignments_are_typed_with_lmcache_rules():
    assert manage.parse_assignments(["min_retrieve_tokens=512", "save_decode_cache=true"]) == \
        {"min_retrieve_tokens": 512, "save_decode_cache": True}
    assert manage.parse_assignments(["priority_limit=null"]) == {"priority_limit": None}
    assert manage.parse_assignments(["blocking_timeout_secs = 7"]) == {"blocking_timeout_secs": 7}


@pytest.mark.parametrize("words", [[], ["min_retrieve_tokens"], ["=5"], ["min_retrieve_tokens=abc"],
                                   ["save_decode_cache=maybe"], ["no_such_key=1"]])
def test_bad_assignments_are_usage_errors(words):
    with pytest.raises(UsageError):
        manage.parse_assignments(words)


@pytest.mark.parametrize("key", ["chunk_size", "pre_caching_hash_algorithm", "local_disk", "remote_url",
                                 "max_local_cpu_size", "max_local_disk_size", "enable_chunk_statistics",
                                 "store_location", "retrieve_locations", "save_unfull_chunk"])
def test_keys_read_only_at_construction_are_refused_with_a_reason(key):
    assert manage.refusal(key)
    with pytest.raises(UsageError, match=f"{key} cannot be changed on a running engine") as raised:
        manage.parse_assignments([f"{key}=1"])
    assert "restart" in raised.value.hint


def test_live_keys_exist_in_lmcache_and_aliases_resolve():
    assert set(manage.LIVE_KEYS) <= set(inprocess_keys())
    assert all(manage.refusal(key) is None for key in manage.LIVE_KEYS)
    assert manage.refusal("bogus") == "unknown"
    with pytest.raises(UsageError, match="controller_pull_url cannot"):  # the alias, resolved, then refused
        manage.parse_assignments(["controller_url=tcp://x:1"])


def test_backend_names_as_users_say_them_and_as_lmcache_does():
    assert [manage.backend_name(n) for n in ("cpu", "DISK", "redis", "remote")] == \
        ["LocalCPUBackend", "LocalDiskBackend", "RemoteBackend", "RemoteBackend"]
    assert manage.backend_name("localdiskbackend") == "LocalDiskBackend"
    assert manage.backend_name("RemoteBackend-s3") == "RemoteBackend-s3"  # a plugin's, as LMCache names it
    assert [manage.tier_of(n) for n in ("LocalCPUBackend", "LocalDiskBackend", "RemoteBackend", "X")] == \
        ["cpu", "disk", "redis", "X"]
    for bad in ("", "a/b"):
        with pytest.raises(UsageError):
            manage.backend_name(bad)


def test_a_status_that_differs_between_workers_is_partial():
    same = manage.PerProcess("freeze", [{"process": "worker 0", "freeze": True}, {"process": "worker 1",
                                                                                   "freeze": True}])
    assert same.consistent and not same.partial and same.as_dict()["freeze"] is True
    differs = manage.PerProcess("freeze", [{"process": "worker 0", "freeze": True}, {"process": "worker 1",
                                                                                      "freeze": False}])
    assert not differs.consistent and differs.partial and differs.as_dict()["freeze"] is None
    failed = manage.PerProcess("freeze", [{"process": "worker 0", "freeze": True}, {"process": "worker 1",
                                                                                     "error": "down"}])
    assert failed.consistent and failed.partial and failed.value() is True


def test_conf_marks_keys_that_differ_between_processes_and_redacts_secrets():
    folded = manage._conf([{"process": "scheduler", "values": {"a": 1, "b": 2}},
                           {"process": "worker 0", "values": {"a": 1, "b": 3}}])
    assert folded.differs == ["b"] and folded.partial and folded.values == {"a": 1, "b": 2}
    assert manage._redacted({"remote_url": "redis://u:secret@h:6379"}) == {"remote_url": "redis://u:***@h:6379"}


def test_backends_merge_workers_and_flag_differences():
    listing = manage.Backends([
        {"process": "worker 0", "backends": ["LocalCPUBackend", "LocalDiskBackend"],
         "classes": {"LocalCPUBackend": "LocalCPUBackend", "LocalDiskBackend": "LocalDiskBackend"},
         "bypassed": ["LocalDiskBackend"]},
        {"process": "worker 1", "backends": ["LocalCPUBackend"], "classes": {"LocalCPUBackend": "LocalCPUBackend"},
         "bypassed": []}])
    merged = {b["tier"]: b for b in listing.merged()}
    assert merged["cpu"]["workers"] == 2 and merged["disk"]["workers"] == 1 and merged["disk"]["bypassed"]
    assert not listing.consistent and listing.partial
    assert "classes" not in listing.as_dict()["processes"][0]
