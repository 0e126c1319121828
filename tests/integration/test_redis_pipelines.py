"""kvctl's own RESP pipelines (issue #23: SCAN read while Redis scans on, several batches in flight)
against a real redis-server: the same answers as redis-py's, whatever the names hold."""

import pytest

from kvctl.clients.redis_tier import BATCH, SCAN_COUNT, RedisTier
from kvctl.core.lmcache.tiers import parse_redis_url


def test_scan_reads_every_name_exactly_over_many_pages(start_redis):
    server = start_redis()
    client = server.client()
    odd = [b"m@a\r\nb", b"m@\r\n", b"m@$3\r\nabc\r\n", "m@modèle".encode(), b"m@\xff\xfe", b"m@" + b"x" * 70_000]
    plain = [f"m@1@0@{index:x}@halfmetadata".encode() for index in range(2 * SCAN_COUNT + 5)]
    client.mset({name: b"1" for name in odd + plain + [b"other"]})
    expected = sorted(name.decode(errors="replace") for name in odd + plain)
    with RedisTier(parse_redis_url(server.url)) as tier:
        assert sorted(tier.scan("m@*", 10**9)) == expected
        first = tier.scan("m@*", 7)
        assert len(first) == 7 and set(first) <= set(expected)
        assert tier.exists(["other", "none"]) == [True, False]  # no reply of an unread page left on the socket
        assert sorted(tier.scan("m@*", 10**9)) == expected


def test_unlink_counts_each_chunk_across_batches(start_redis):
    server = start_redis()
    client = server.client()
    keys = [f"m@1@0@{index:x}@half" for index in range(3 * BATCH + 1)] + ["modèle@1@0@1@half"]
    held = {key: index % 3 for index, key in enumerate(keys)}  # names held: 0, 1 (metadata) or 2
    client.mset({key + suffix: b"1" for key, count in held.items()
                 for suffix in ("kv_bytes", "metadata")[2 - count:]})
    client.set("other", b"1")
    with RedisTier(parse_redis_url(server.url)) as tier:
        assert tier.unlink_each(keys, ("kv_bytes", "metadata")) == [held[key] for key in keys]
        assert tier.exists([key + "metadata" for key in keys]) == [False] * len(keys)
    assert client.keys("*") == [b"other"]


def test_an_exchange_that_fails_part_way_leaves_no_reply_for_the_next(start_redis):
    server = start_redis()
    client = server.client()
    client.mset({f"m@{index}": b"1" for index in range(3 * SCAN_COUNT)})

    def refuse(_names):
        raise RuntimeError("stop")

    with RedisTier(parse_redis_url(server.url)) as tier:
        with pytest.raises(RuntimeError):
            tier.scan("m@*", 10**9, refuse)  # the next page was already asked for
        assert tier.exists(["m@1", "none"]) == [True, False]
