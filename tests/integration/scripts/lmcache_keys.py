"""Print the chunk keys real LMCache code makes, as JSON (run in a child process).

usage: lmcache_keys.py VLLM(0|1) < CASES_JSON (on stdin: a long list is past what one argument may hold)
Each case: {"mode": "inprocess", "algorithm", "chunk", "save_unfull", "model", "world_size", "dtype", "tokens"}
        or {"mode": "mp", "algorithm", "chunk", "tokens"}. An in-process case with "plugin": true gives, per
worker, the keys kvctl's plugin route makes inside the engine (engine_keys) and whether the compiled chain
made them.
The interpreter's PYTHONHASHSEED is the serving process's seed.
"""

import json
import sys

if sys.argv[1] == "0":
    sys.modules["vllm"] = None  # an engine process without vLLM: NONE_HASH = 0 and Python's hash()

import torch  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.token_database import ChunkedTokenDatabase  # noqa: E402


def inprocess(case):
    config = LMCacheEngineConfig.from_defaults(chunk_size=case["chunk"], pre_caching_hash_algorithm=case["algorithm"],
                                               save_unfull_chunk=case["save_unfull"])
    keys = []
    for worker in range(case["world_size"]):
        metadata = LMCacheMetadata(model_name=case["model"], world_size=case["world_size"],
                                   local_world_size=case["world_size"], worker_id=worker, local_worker_id=worker,
                                   kv_dtype=getattr(torch, case["dtype"]), kv_shape=(2, 2, case["chunk"], 2, 32),
                                   use_mla=False, role="worker", chunk_size=case["chunk"])
        database = ChunkedTokenDatabase(config, metadata)
        if case.get("plugin"):
            keys.append(through_plugin(database, case["tokens"]))
        else:
            keys.append([[start, end, key.to_string()] for start, end, key in database.process_tokens(case["tokens"])])
    return keys


def through_plugin(database, tokens):
    from types import SimpleNamespace

    from kvctl_plugins import engine_keys

    made = engine_keys.chunk_keys(SimpleNamespace(token_database=database), tokens)
    return {"keys": [[start, end, key.to_string()] for start, end, key in made],
            "compiled": engine_keys._compiled_hashes(database, tokens, made[-1][1] if made else 0) is not None}


def mp(case):
    from lmcache.v1.multiprocess.token_hasher import TokenHasher

    hasher = TokenHasher(chunk_size=case["chunk"], hash_algorithm=case["algorithm"])
    return [chunk_hash.hex() for chunk_hash in hasher.compute_chunk_hashes(case["tokens"])]


print(json.dumps([inprocess(case) if case["mode"] == "inprocess" else mp(case) for case in json.load(sys.stdin)]))
