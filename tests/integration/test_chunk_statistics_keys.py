"""LMCache 0.5.6's chunk statistics change the first hash of every key in the process that builds them
(the vLLM scheduler), so its lookups stop matching what the worker stored; kvctl's plugins keep the
keys as they were. Each case runs in its own process: the trap changes process-wide state."""

import json
import subprocess
import sys

import pytest

from tests.helpers import STACK_ENV

SCRIPT = """
import json, sys
if sys.argv[1] == "with-plugins":
    import kvctl_plugins
    kvctl_plugins.install()
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.lookup_client.chunk_statistics_lookup_client import ChunkStatisticsLookupClient
from lmcache.v1.token_database import ChunkedTokenDatabase

config = LMCacheEngineConfig.from_defaults(chunk_size=256, pre_caching_hash_algorithm="sha256_cbor",
                                           enable_chunk_statistics=True, chunk_statistics_strategy="file_hash",
                                           extra_config={"chunk_statistics_file_output_dir": sys.argv[2]})
keys = ChunkedTokenDatabase(config)
tokens = list(range(1000))
def hashes():
    return [str(chunk_hash) for _, _, chunk_hash in keys.process_tokens(tokens=tokens, make_key=False)]
stored = hashes()
from vllm.v1.core import kv_cache_utils
vllm_before = (kv_cache_utils.NONE_HASH, kv_cache_utils._NONE_HASH_SEED)
statistics = ChunkStatisticsLookupClient(None, config)
looked_up = hashes()
statistics.recorder.close()
vllm_same = (kv_cache_utils.NONE_HASH, kv_cache_utils._NONE_HASH_SEED) == vllm_before
print(json.dumps({"same": stored == looked_up and vllm_same, "chunks": len(stored)}))
"""


def keys_after_statistics(mode: str, directory) -> dict:
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode, str(directory)], capture_output=True, text=True,
                          timeout=300, env=STACK_ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_chunk_statistics_keep_the_keys_only_with_kvctl_plugins(tmp_path):
    assert keys_after_statistics("stock", tmp_path / "stock") == {"same": False, "chunks": 3}  # the trap is real
    assert keys_after_statistics("with-plugins", tmp_path / "plugins") == {"same": True, "chunks": 3}
