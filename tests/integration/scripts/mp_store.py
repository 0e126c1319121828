"""Store token sequences into a running `lmcache server` through LMCache's own MP client (the
CPU worker of `lmcache bench server`: registers a KV cache, engine-driven STORE over the request
plane). The model name is the bench client's, printed as JSON with what was stored.

usage: mp_store.py RPC_URL HTTP_URL TOKENS_JSON_LIST…   (each argument: one JSON list of token ids)
"""

import json
import sys

from lmcache.cli.commands.bench.server_bench.client import RequestContext, ServerBenchClient
from lmcache.cli.commands.bench.server_bench.config import BenchConfig
from lmcache.cli.commands.bench.server_bench.helpers import _MODEL_NAME

SHAPE = "(2,256,16,2,32):float16:2"  # 256 blocks of 16 tokens, 2 KV heads of 32, 2 layers: 128 KiB per 256-token chunk


def main() -> None:
    rpc_url, http_url, *sequences = sys.argv[1:]
    config = BenchConfig(rpc_url=rpc_url, http_url=http_url, mode="cpu", transfer_mode="auto", tp_size=1,
                         use_mla=False, num_tokens=0, kvcache_shape_spec=SHAPE, num_blocks=256, block_size=16)
    client = ServerBenchClient(config, lambda line: print(line, file=sys.stderr))
    client.start()
    stored = []
    try:
        for number, text in enumerate(sequences):
            tokens = tuple(json.loads(text))
            chunk = client._chunk_size
            full = len(tokens) // chunk * chunk
            request = RequestContext(number, f"kvctl-test-{number}", "store", tokens, full, full // chunk, chunk,
                                     0, full // 16)
            result = client.store(request, 0, full)
            client.end_session(request)
            assert result is not None and result.succeeded, f"store of sequence {number} failed"
            stored.append(full)
    finally:
        client.close()
    print(json.dumps({"model": _MODEL_NAME, "stored_tokens": stored}))


if __name__ == "__main__":
    main()
