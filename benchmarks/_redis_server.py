"""A throwaway redis-server on 127.0.0.1 for the Redis benchmarks, and redis-benchmark's figure."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def redis_server() -> Iterator[int]:
    """Start redis-server (no persistence) on a free port; yields the port once it answers."""
    import redis

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
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
            yield port
        finally:
            server.terminate()
            server.wait(10)


def redis_benchmark(port: int, requests: int, *command: str, extra: tuple[str, ...] = ()) -> float:
    """Requests per second of `redis-benchmark -P 16` (its default 50 clients) for one command."""
    done = subprocess.run([shutil.which("redis-benchmark"), "-p", str(port), "-P", "16", "-n", str(requests), *extra,
                           "-q", *command], capture_output=True, text=True, check=True)
    return float(re.findall(r"([\d.]+) requests per second", done.stdout.replace(",", ""))[-1])
