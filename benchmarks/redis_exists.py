"""Presence checks in Redis: kvctl's batched EXISTS against `redis-benchmark -P 16` on the same server.

A redis-server on 127.0.0.1 holds N LMCache-style chunk entries; kvctl checks 2N names (half of
them present) and the rate is compared with redis-benchmark's pipelined EXISTS (16 per round trip, its
default 50 clients). Goal (issue: lookup): at least 50 %. The last line holds the figures.
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

from kvctl.clients.redis_tier import RedisTier  # noqa: E402
from kvctl.core.tiers import parse_redis_url  # noqa: E402

CHUNKS = 100_000
ROUNDS = 5


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
            names = [f"model@1@0@{index:016x}@bfloat16metadata" for index in range(2 * CHUNKS)]
            pipe = client.pipeline(transaction=False)
            for name in names[::2]:
                pipe.set(name, b"x")
            pipe.execute()
            with RedisTier(parse_redis_url(f"redis://127.0.0.1:{port}")) as tier:
                assert sum(tier.exists(names)) == CHUNKS
                best = min(_timed(lambda: tier.exists(names)) for _ in range(ROUNDS))
            kvctl_rate = len(names) / best
            done = subprocess.run([shutil.which("redis-benchmark"), "-p", str(port), "-P", "16", "-n",
                                   str(len(names)), "-q", "EXISTS", names[0]], capture_output=True, text=True, check=True)
            benchmark_rate = float(re.findall(r"([\d.]+) requests per second", done.stdout.replace(",", ""))[-1])
        finally:
            server.terminate()
            server.wait(10)
    print(f"kvctl batched EXISTS: {kvctl_rate:,.0f} keys/s over {len(names):,} names")
    print(f"redis-benchmark -P 16 EXISTS (50 clients): {benchmark_rate:,.0f} requests/s")
    print(f"kvctl_vs_redis_benchmark={kvctl_rate / benchmark_rate:.2f} (goal >= 0.50)")


def _timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
