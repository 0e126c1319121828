"""`kvctl snapshot save` and `load` throughput for 1 GiB of chunks, against copying the same bytes.

Disk: a configuration's disk directory holds 1 GiB of chunk files (LocalDiskBackend's names and sizes);
kvctl saves them into one snapshot (BLAKE3 per chunk) and loads that into another configuration's empty
disk directory (each chunk written under a hidden name as its checksum is verified, all renamed once
every one matched), each against `cp -r` of the chunk directory. Redis: the same chunks in a
redis-server on 127.0.0.1 (both of LMCache's names per chunk), saved from and loaded into it (an emptied
database): the load against `redis-benchmark -P 16 -t set` with values of the chunk size, the save
against pipelined GETs of the same names (redis-benchmark's GET would read keys its own SET run wrote,
mostly missing ones). The page cache is warm and no writeback pending at the start of every run; each
figure is the best of five, the disk runs taken in turn (cp, save, load) in each of five rounds after an
untimed one: this machine's disk throughput and file creation vary several-fold from minute to minute.
Goal (issue: performance): every ratio >= 0.95. The last line holds the figures.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._redis_server import redis_server  # noqa: E402
from kvctl.core.cache import snapshot  # noqa: E402
from kvctl.core.instance.offline import OfflineInstance  # noqa: E402
from kvctl.core.lmcache.keys import KeyRecipe, disk_file_name, key_string  # noqa: E402

RUNS = 5


def timed(run, prepare=lambda: None) -> float:
    """Seconds of one run, started with no dirty pages pending (os.sync): otherwise a run pays for the
    writeback of the one before it, and whichever runs later looks slower."""
    prepare()
    os.sync()
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def best(run, prepare=lambda: None) -> float:
    """The shortest of RUNS runs."""
    return min(timed(run, prepare) for _ in range(RUNS))


def best_side_by_side(runs: dict[str, tuple]) -> dict[str, float]:
    """The shortest of RUNS rounds of each (run, prepare), taken in turn within every round, after one
    untimed round. File creation on this machine slows several-fold for minutes at a time (1024 creates:
    0.02 s to 0.9 s, most often after many deletions): every timed run follows the same deletion of its
    last output, and a figure measured minutes apart from the copy it is compared with would measure the
    file system's state instead. (The untimed round also keeps a first run's imports out of the figures.)"""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(RUNS + 1):
        for name, (run, prepare) in runs.items():
            took = timed(run, prepare)
            if round_:
                times[name].append(took)
    print("  rounds (s): " + "; ".join(f"{name} " + " ".join(f"{took:.2f}" for took in found)
                                       for name, found in times.items()))
    return {name: min(found) for name, found in times.items()}


def configuration(root: Path, tier: str) -> Path:
    """A `kvctl config init` directory with one tier besides CPU, on ports nothing listens on."""
    done = subprocess.run([sys.executable, "-m", "kvctl", "config", "init", "--out", str(root / "cfg"), "--tier",
                           "cpu:0.1", "--tier", tier, "--model", "bench", "--internal-api-port-start", "1"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return root / "cfg"


def remote_metadata(size: int) -> bytes:
    """LMCache's RemoteMetadata header for `size` bytes of bfloat16 as one flat KV group (length, format
    KV_2LTD, dtype, shape): a save checks each Redis chunk's header against its bytes and its key."""
    return struct.pack("=7i", size, 1, 3, size // 2, 0, 0, 0)


def pipelined_get(client, keys: list[str]) -> None:
    for offset in range(0, len(keys), 64):
        pipe = client.pipeline(transaction=False)
        for key in keys[offset:offset + 64]:
            pipe.get(key + "kv_bytes")
            pipe.get(key + "metadata")
        pipe.execute()


def redis_benchmark_bytes_per_s(port: int, test: str, size: int, count: int) -> float:
    done = subprocess.run([shutil.which("redis-benchmark"), "-p", str(port), "-P", "16", "-t", test, "-d", str(size),
                           "-n", str(count), "-r", str(count), "-q"], capture_output=True, text=True, check=True)
    return float(re.findall(r"([\d.]+) requests per second", done.stdout.replace(",", ""))[-1]) * size


def main() -> None:
    import redis

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="Total chunk bytes, in GiB.")
    parser.add_argument("--chunk-mib", type=float, default=1.0, help="Bytes per chunk, in MiB (a 1B model's "
                        "256-token chunk is about 8 MiB, the test model's 0.125).")
    options = parser.parse_args()
    size = int(options.chunk_mib * 2**20)
    count = int(options.gib * 2**30) // size
    total = count * size
    recipe = KeyRecipe("bench", kv_dtype="bfloat16")
    keys = [key_string(recipe, 2**60 + index) for index in range(count)]
    data = os.urandom(size)
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVCTL_BENCH_DIR")) as folder:
        root = Path(folder)
        source = OfflineInstance(configuration(root / "a", f"disk:{root}/a/disk:64"), "bench", "bfloat16")
        (root / "a" / "disk").mkdir()
        for key in keys:
            (root / "a" / "disk" / disk_file_name(key)).write_bytes(data)
        snap = root / "disk.kvsnap"

        target = OfflineInstance(configuration(root / "b", f"disk:{root}/b/disk:64"), "bench", "bfloat16")
        disk = best_side_by_side({
            "cp": (lambda: subprocess.run(["cp", "-r", str(root / "a" / "disk"), str(root / "copy")], check=True),
                   lambda: shutil.rmtree(root / "copy", ignore_errors=True)),
            "save": (lambda: snapshot.save(source, snap, [], keys), lambda: snap.unlink(missing_ok=True)),
            "load": (lambda: snapshot.load(snap, target, "disk"),
                     lambda: shutil.rmtree(root / "b" / "disk", ignore_errors=True))})
        cp_s, save_s, load_s = disk["cp"], disk["save"], disk["load"]
        assert len(os.listdir(root / "b" / "disk")) == count, "the load did not write every chunk"
        snap.unlink()
        shutil.rmtree(root / "copy")

        with redis_server() as port:
            client = redis.Redis(port=port)
            pipe, header = client.pipeline(transaction=False), remote_metadata(size)
            for key in keys:
                pipe.set(key + "kv_bytes", data)
                pipe.set(key + "metadata", header)
            pipe.execute()
            source = OfflineInstance(configuration(root / "c", f"redis://127.0.0.1:{port}"), "bench", "bfloat16")
            save_redis_s = best(lambda: snapshot.save(source, snap, [], keys), lambda: snap.unlink(missing_ok=True))
            get_s = best(lambda: pipelined_get(client, keys))
            client.flushall()
            set_rate = redis_benchmark_bytes_per_s(port, "set", size, count)
            client.flushall()
            load_redis_s = best(lambda: snapshot.load(snap, source, "redis"), client.flushall)
            assert client.dbsize() == 2 * count, "the load did not write every chunk"

    gib = total / 2**30
    figures = {"disk_save_vs_cp": cp_s / save_s, "disk_load_vs_cp": cp_s / load_s,
               "redis_save_vs_pipelined_get": get_s / save_redis_s,
               "redis_load_vs_pipelined_set": total / load_redis_s / set_rate}
    print(f"{count} chunks of {size / 2**20:g} MiB ({gib:.2f} GiB), best of {RUNS}:")
    print(f"  cp -r                      {gib / cp_s:6.2f} GiB/s")
    print(f"  kvctl snapshot save (disk) {gib / save_s:6.2f} GiB/s")
    print(f"  kvctl snapshot load (disk) {gib / load_s:6.2f} GiB/s")
    print(f"  pipelined GET (redis-py)   {gib / get_s:6.2f} GiB/s")
    print(f"  kvctl snapshot save (redis){gib / save_redis_s:6.2f} GiB/s")
    print(f"  redis-benchmark -P 16 SET  {set_rate / 2**30:6.2f} GiB/s")
    print(f"  kvctl snapshot load (redis){gib / load_redis_s:6.2f} GiB/s")
    print(" ".join(f"{name}={value:.2f}" for name, value in figures.items()) + " (goal >= 0.95 each)")


if __name__ == "__main__":
    main()
