"""The pure parts of `kvctl reconfigure` and `kvctl checksums`: sizes, block ranges, request bodies, and
which changes ask for a yes."""

import pytest

from kvctl.core.admin.mp_admin import MAX_BLOCKS, format_blocks, parse_blocks, parse_size, request_body, risk
from kvctl.core.errors import UsageError

MIB = 1 << 20


@pytest.mark.parametrize(("text", "size"), [("4GiB", 4 << 30), ("512mb", 512 * MIB), ("1048576", MIB),
                                            ("1.5g", 3 << 29), (" 2 MiB ", 2 * MIB), ("8k", 8192), ("1T", 1 << 40)])
def test_sizes_parse_as_lmcache_reads_them(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "0", "0.0001b", "-1GiB", "4XB", "GiB", "1e9", "nan", "4 Gi B", "9" * 400,
                                  "1" + "0" * 400 + "GiB"])
def test_bad_sizes_are_usage_errors(text):
    with pytest.raises(UsageError, match="bad size"):
        parse_size(text)


def test_block_ranges_parse_inclusive_in_order_and_format_back():
    ids = parse_blocks("0-3, 32,40-42,7")
    assert ids == [0, 1, 2, 3, 32, 40, 41, 42, 7]
    assert format_blocks(ids) == "0-3,32,40-42,7"
    assert format_blocks([5]) == "5" and format_blocks([]) == ""


@pytest.mark.parametrize(("text", "said"), [("5-3", "backwards"), ("1,,2", "bad block range"), ("a", "bad block"),
                                            ("-1", "bad block"), ("1-", "bad block"), ("1-2-3", "bad block"),
                                            ("", "bad block"), (f"0-{MAX_BLOCKS}", "more than")])
def test_bad_block_ranges_are_usage_errors(text, said):
    with pytest.raises(UsageError, match=said) as raised:
        parse_blocks(text)
    assert raised.value.hint


def test_request_bodies_are_what_lmcache_takes():
    assert request_body("add", "l2", "/dev/dax0.0", 4 * MIB) == {"device_path": "/dev/dax0.0", "adapter_index": 0,
                                                                 "size": 4 * MIB}
    assert request_body("remove", "l2", "/f", mode="evict", force=True, adapter=1) == {
        "device_path": "/f", "adapter_index": 1, "mode": "evict", "force": True}
    assert request_body("remove", "l1", "/f") == {"device_path": "/f"}


@pytest.mark.parametrize(("args", "said"), [
    (("resize", "l1", "/f", MIB), "cannot be resized"), (("add", "l2", "/f"), "needs --size"),
    (("remove", "l2", "/f", MIB), "takes no --size"), (("resize", "l2", "/f", MIB, "drain"), "does not apply"),
    (("remove", "l1", "/f", None, "migrate"), "does not apply"), (("add", "l2", "/f", MIB, None, True), "--force"),
    (("remove", "l1", "/f", None, None, False, 0), "--adapter"), (("add", "l2", " ", MIB), "empty"),
])
def test_requests_lmcache_would_refuse_are_usage_errors(args, said):
    with pytest.raises(UsageError, match=said):
        request_body(*args)


def test_only_changes_that_can_drop_chunks_ask():
    device = {"capacity_bytes": 8 * MIB}
    assert risk("add", "l2", {"size": MIB}, None) is None
    assert risk("remove", "l2", {"mode": "drain"}, device) is None
    assert risk("remove", "l1", {}, device) is None  # L1's only mode is drain
    assert "moves" in risk("remove", "l2", {}, device) and "deletes" in risk("remove", "l2", {"mode": "evict"}, device)
    assert risk("resize", "l2", {"size": 16 * MIB}, device) is None
    assert "shrinks" in risk("resize", "l2", {"size": 2 * MIB}, device)
    assert risk("resize", "l2", {"size": 16 * MIB, "force": True}, device)
    assert "unknown" in risk("resize", "l2", {"size": 16 * MIB}, None)
