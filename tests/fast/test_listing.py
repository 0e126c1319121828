"""`kvctl ls`: tiers listed side by side, a failing tier named while the others list, and whose chunks are whose."""

import pytest

from kvctl.core.cache.listing import Chunk, TierListing, _of_model, collect, disk_chunks, redis_pattern
from kvctl.core.errors import KvctlError, UnreachableError
from kvctl.core.lmcache.deployment import Store
from kvctl.core.lmcache.keys import ObjectKey, kv_rank, parse_key


def listed(tier, *keys):
    return lambda: TierListing(tier, "directory", len(keys), [Chunk(key) for key in keys])


def failing(error):
    def lister():
        raise error
    return lister


def test_a_failing_tier_is_named_and_the_others_still_list():
    listing = collect({"cpu": listed("cpu", "m@1@0@a@half"),
                       "disk": failing(KvctlError("cannot read the disk tier directory /d: permission denied")),
                       "redis": failing(UnreachableError("cannot reach Redis at 127.0.0.1:6379")),
                       "remote": listed("remote")})
    assert [tier.tier for tier in listing.tiers] == ["cpu", "remote"]
    assert listing.errors == {"disk": "cannot read the disk tier directory /d: permission denied",
                              "redis": "cannot reach Redis at 127.0.0.1:6379"}
    assert listing.failure_code == UnreachableError.exit_code  # the last failure's code
    assert listing.as_dict()["errors"] == listing.errors and len(listing.as_dict()["tiers"]) == 2


def test_nothing_failed_means_no_errors_and_no_failure_code():
    listing = collect({"cpu": listed("cpu"), "disk": listed("disk", "m@1@0@a@half")})
    assert (listing.errors, listing.failure_code) == ({}, None)


def test_a_tier_listing_counts_what_it_shows():
    tier = TierListing("cpu", "engine", 10, [Chunk("a", 100, pinned=True), Chunk("b", 50, kvctl_pinned=True),
                                             Chunk("c", 25, pinned=False, kvctl_pinned=False)])
    shown = tier.as_dict()
    assert (shown["total"], shown["listed"], shown["listed_bytes"], shown["pinned"]) == (10, 3, 175, 2)
    assert shown["chunks"][0] == {"key": "a", "size": 100, "pinned": True, "kvctl_pinned": None, "age_s": None}


def test_sizes_unknown_are_not_zero_bytes():
    assert TierListing("redis", "redis", 1, [Chunk("a")]).as_dict()["listed_bytes"] is None
    assert TierListing("redis", "redis", 0).as_dict()["listed_bytes"] is None


@pytest.mark.parametrize(("name", "model", "mangled", "belongs"), [
    ("llama@1@0@ab@half", "llama", False, True),
    ("llama@v2@1@0@ab@half", "llama", False, False),  # the whole model field: 'llama@v2' is not 'llama'
    ("llama@v2@1@0@ab@half", "llama@v2", False, True),
    ("llama@1@0@ab@half", "llama@v2", False, False),
    ("llama@1@0@ab@half", None, False, True),  # no model: every chunk
    ("llama@2024@12@report@half", None, False, False),  # no chunk key at all
    ("org-m@1@0@ab@half", "org/m", True, True),  # a disk file name carries '/' as '-'
    ("org-m@1@0@ab@half", "org/m", False, False),  # elsewhere the name is as given
    ("org/m@1@0@ab@half", "org/m", False, True),
    ("org-mx@1@0@ab@half", "org/m", True, False),
])
def test_whose_chunk_it_is(name, model, mangled, belongs):
    assert _of_model(parse_key(name), model, mangled) is belongs


def test_disk_files_are_chunks_of_the_model_and_nothing_else(tmp_path):
    files = ["org-m@1@0@ab@half.pt", "org-m@1@1@ab@half.pt", "org-m@v2@1@0@ab@half.pt", "other@1@0@ab@half.pt",
             "README.pt", "org-m@1@0@AB@half.pt", "org-m@1@0@cd@half.pt.tmp", "notes.txt"]
    for name in files:
        (tmp_path / name).write_bytes(b"x")
    store = Store("disk", "lmcache-disk", (str(tmp_path),))
    assert disk_chunks(store, "org/m") == {"org-m@1@0@ab@half": "org-m@1@0@ab@half.pt",
                                           "org-m@1@1@ab@half": "org-m@1@1@ab@half.pt"}
    assert set(disk_chunks(store)) == {"org-m@1@0@ab@half", "org-m@1@1@ab@half", "org-m@v2@1@0@ab@half",
                                       "other@1@0@ab@half"}


@pytest.mark.parametrize("model", ["org/m", "llama@v2"])
def test_mp_fs_files_are_listed_by_their_native_key(tmp_path, model):
    key = ObjectKey(bytes(range(32)), model, kv_rank(1, 0))
    (tmp_path / key.fs_file_name()).write_bytes(b"x")
    (tmp_path / ObjectKey(bytes(range(32)), "other", kv_rank(1, 0)).fs_file_name()).write_bytes(b"x")
    (tmp_path / "stray.data").write_bytes(b"x")
    assert disk_chunks(Store("disk", "mp-fs", (str(tmp_path),)), model) == {key.native_key(): key.fs_file_name()}


@pytest.mark.parametrize(("layout", "model", "pattern"), [
    ("lmcache-redis", None, "*@*@*@*@*metadata"),
    ("lmcache-redis", "org/llama", "org/llama@*@*@*@*metadata"),
    ("lmcache-redis", "llama*[v2]?", r"llama\*\[v2\]\?@*@*@*@*metadata"),  # glob characters match themselves
    ("lmcache-redis", "back\\slash", r"back\\slash@*@*@*@*metadata"),
    ("mp-resp", None, "*@*@*@*"),
    ("mp-resp", "m?", r"m\?@*@*@*"),
])
def test_redis_scan_patterns_match_the_model_literally(layout, model, pattern):
    assert redis_pattern(layout, model) == pattern
