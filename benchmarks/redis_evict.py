"""Evicting chunks from Redis: kvctl's whole-tier eviction against `redis-benchmark -P 16` on the same server.

A redis-server on 127.0.0.1 holds N LMCache chunks (two names each, as LMCache's RedisConnector writes
them) plus other keys that must stay. kvctl finds the model's chunks by SCAN and removes both names of
each by pipelined UNLINK, exactly as `kvctl evict --tier redis` does; its names-removed rate (SCAN
included) is compared with redis-benchmark's pipelined UNLINK (16 per round trip, its default 50 clients).
Goal (issue: performance): at least 80 %. The last line holds the figures.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._redis_server import redis_benchmark, redis_server  # noqa: E402
from kvctl.core.cache.listing import redis_tier_keys, unlink_chunks  # noqa: E402
from kvctl.core.lmcache.deployment import Store  # noqa: E402
from kvctl.core.lmcache.tiers import parse_redis_url  # noqa: E402

CHUNKS = 100_000
OTHERS = 10_000


def fill(client, names) -> None:
    for offset in range(0, len(names), 10_000):
        client.mset({name: b"x" * 64 for name in names[offset:offset + 10_000]})


def main() -> None:
    import redis

    with redis_server() as port:
        client = redis.Redis(port=port)
        keys = [f"model@1@0@{index + 2**60:x}@bfloat16" for index in range(CHUNKS)]  # {:x} of a 64-bit hash
        fill(client, [key + suffix for key in keys for suffix in ("kv_bytes", "metadata")])
        fill(client, [f"other@1@0@{index + 2**60:x}@bfloat16metadata" for index in range(OTHERS)])
        store = Store("redis", "lmcache-redis", redis=parse_redis_url(f"redis://127.0.0.1:{port}"))
        start = time.perf_counter()
        found = redis_tier_keys(store, "model")
        unlink_chunks(store, found)
        seconds = time.perf_counter() - start
        assert len(found) == CHUNKS and client.dbsize() == OTHERS, "kvctl removed the wrong keys"
        kvctl_rate = 2 * CHUNKS / seconds
        fill(client, [f"key:{index:012d}" for index in range(2 * CHUNKS)])
        benchmark_rate = redis_benchmark(port, 2 * CHUNKS, "UNLINK", "key:__rand_int__", extra=("-r", str(2 * CHUNKS)))
    print(f"kvctl evict --tier redis: {CHUNKS:,} chunks ({2 * CHUNKS:,} names) in {seconds:.2f} s, SCAN included: "
          f"{kvctl_rate:,.0f} names/s; {OTHERS:,} other keys untouched")
    print(f"redis-benchmark -P 16 UNLINK (50 clients): {benchmark_rate:,.0f} requests/s")
    print(f"kvctl_vs_redis_benchmark={kvctl_rate / benchmark_rate:.2f} (goal >= 0.80)")


if __name__ == "__main__":
    main()
