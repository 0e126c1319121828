"""Evicting chunks from Redis: kvctl's whole-tier eviction against `redis-benchmark -P 16` on the same server.

A redis-server on 127.0.0.1 holds N LMCache chunks (two names each, as LMCache's RedisConnector writes
them) plus other keys that must stay. kvctl finds the model's chunks by SCAN and removes both names of
each by batched UNLINK, exactly as `kvctl evict --tier redis` does; its names-removed rate (SCAN
included) is compared with redis-benchmark's pipelined UNLINK (16 per round trip, its default 50 clients).
Goal (issue: cache operations): at least 50 %. The last line holds the figures.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvctl.core.listing import redis_tier_keys, unlink_chunks  # noqa: E402
from kvctl.core.target import Store  # noqa: E402
from kvctl.core.tiers import parse_redis_url  # noqa: E402

CHUNKS = 100_000
OTHERS = 10_000


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fill(client, names) -> None:
    for offset in range(0, len(names), 10_000):
        client.mset({name: b"x" * 64 for name in names[offset:offset + 10_000]})


def main() -> None:
    import redis

    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        server = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save",
                                   "", "--appendonly", "no", "--dir", folder], stdout=subprocess.DEVNULL)
        try:
            client = redis.Redis(port=port)
            for _ in range(100):
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.05)
            keys = [f"model@1@0@{index:016x}@bfloat16" for index in range(CHUNKS)]
            fill(client, [key + suffix for key in keys for suffix in ("kv_bytes", "metadata")])
            fill(client, [f"other@1@0@{index:016x}@bfloat16metadata" for index in range(OTHERS)])
            store = Store("redis", "lmcache-redis", redis=parse_redis_url(f"redis://127.0.0.1:{port}"))
            start = time.perf_counter()
            found = redis_tier_keys(store, "model")
            unlink_chunks(store, found)
            seconds = time.perf_counter() - start
            assert len(found) == CHUNKS and client.dbsize() == OTHERS, "kvctl removed the wrong keys"
            kvctl_rate = 2 * CHUNKS / seconds
            fill(client, [f"key:{index:012d}" for index in range(2 * CHUNKS)])
            done = subprocess.run([shutil.which("redis-benchmark"), "-p", str(port), "-P", "16", "-n",
                                   str(2 * CHUNKS), "-r", str(2 * CHUNKS), "-q", "UNLINK", "key:__rand_int__"],
                                  capture_output=True, text=True, check=True)
            benchmark_rate = float(re.findall(r"([\d.]+) requests per second", done.stdout.replace(",", ""))[-1])
        finally:
            server.terminate()
            server.wait(10)
    print(f"kvctl evict --tier redis: {CHUNKS:,} chunks ({2 * CHUNKS:,} names) in {seconds:.2f} s, SCAN included: "
          f"{kvctl_rate:,.0f} names/s; {OTHERS:,} other keys untouched")
    print(f"redis-benchmark -P 16 UNLINK (50 clients): {benchmark_rate:,.0f} requests/s")
    print(f"kvctl_vs_redis_benchmark={kvctl_rate / benchmark_rate:.2f} (goal >= 0.50)")


if __name__ == "__main__":
    main()
