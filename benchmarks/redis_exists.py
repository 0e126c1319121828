"""Presence checks in Redis: kvctl's batched EXISTS against `redis-benchmark -P 16` on the same server.

A redis-server on 127.0.0.1 holds N LMCache-style chunk entries; kvctl checks 2N names (half of
them present) and the rate is compared with redis-benchmark's pipelined EXISTS (16 per round trip, its
default 50 clients). Goal (issue: performance): at least 90 %. The last line holds the figures.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._redis_server import redis_benchmark, redis_server  # noqa: E402
from kvctl.clients.redis_tier import RedisTier  # noqa: E402
from kvctl.core.lmcache.tiers import parse_redis_url  # noqa: E402

CHUNKS = 100_000
ROUNDS = 5


def main() -> None:
    import redis

    with redis_server() as port:
        client = redis.Redis(port=port)
        names = [f"model@1@0@{index:016x}@bfloat16metadata" for index in range(2 * CHUNKS)]
        pipe = client.pipeline(transaction=False)
        for name in names[::2]:
            pipe.set(name, b"x")
        pipe.execute()
        with RedisTier(parse_redis_url(f"redis://127.0.0.1:{port}")) as tier:
            assert sum(tier.exists(names)) == CHUNKS
            best = min(_timed(lambda: tier.exists(names)) for _ in range(ROUNDS))
        kvctl_rate = len(names) / best
        benchmark_rate = redis_benchmark(port, len(names), "EXISTS", names[0])
    print(f"kvctl batched EXISTS: {kvctl_rate:,.0f} keys/s over {len(names):,} names")
    print(f"redis-benchmark -P 16 EXISTS (50 clients): {benchmark_rate:,.0f} requests/s")
    print(f"kvctl_vs_redis_benchmark={kvctl_rate / benchmark_rate:.2f} (goal >= 0.90)")


def _timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
