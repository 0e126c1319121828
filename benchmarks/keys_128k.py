"""Chunk keys for a 128K-token prompt: kvctl against LMCache's own ChunkedTokenDatabase.

Same tokens (a Python list), same chunk size (256), same seed, keys as strings; medians of 30 runs
for LMCache's default hash (builtin) and for sha256_cbor, which kvctl's configs use. Goal (issue:
performance): at least twice as fast as LMCache, and under 10 ms. The last line holds the figures.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time

os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

TOKENS = random.Random(0).choices(range(128000), k=128 * 1024)
RUNS = 30


def median_ms(*functions) -> list[float]:
    """Median of each function's runs, taken in turns so that a busy machine slows them alike."""
    times: list[list[float]] = [[] for _ in functions]
    for function in functions:
        function()
    for _ in range(RUNS):
        for function, runs in zip(functions, times):
            start = time.perf_counter()
            function()
            runs.append(time.perf_counter() - start)
    return [statistics.median(runs) * 1000 for runs in times]


def main() -> None:
    if os.environ.get("PYTHONHASHSEED") != "0":  # the seed the serving processes use; hash() depends on it
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONHASHSEED": "0"})
    import torch
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.token_database import ChunkedTokenDatabase

    from kvctl.core.lmcache.keys import KeyRecipe, inprocess_keys

    figures = []
    for algorithm in ("builtin", "sha256_cbor"):
        config = LMCacheEngineConfig.from_defaults(chunk_size=256, pre_caching_hash_algorithm=algorithm)
        metadata = LMCacheMetadata(model_name="m", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                                   kv_dtype=torch.bfloat16, kv_shape=(2, 2, 256, 2, 32), use_mla=False, role="worker",
                                   chunk_size=256)
        database = ChunkedTokenDatabase(config, metadata)
        recipe = KeyRecipe("m", 256, algorithm, "0", kv_dtype="bfloat16")
        lmcache_keys = [key.to_string() for _, _, key in database.process_tokens(TOKENS)]
        assert inprocess_keys(TOKENS, recipe) == lmcache_keys, "kvctl and LMCache disagree"
        kvctl_ms, lmcache_ms = median_ms(
            lambda recipe=recipe: inprocess_keys(TOKENS, recipe),
            lambda db=database: [key.to_string() for _, _, key in db.process_tokens(TOKENS)])
        print(f"{algorithm}: kvctl {kvctl_ms:.2f} ms, LMCache {lmcache_ms:.2f} ms "
              f"({lmcache_ms / kvctl_ms:.2f}x; goal >= 2x and < 10 ms)")
        figures.append(f"{algorithm}_ms={kvctl_ms:.2f} {algorithm}_vs_lmcache={lmcache_ms / kvctl_ms:.2f}x")
    print(" ".join(figures))


if __name__ == "__main__":
    main()
