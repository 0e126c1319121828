"""A vLLM stand-in that stays connected to a running `lmcache server`: LMCache's own MP client (the CPU
worker of `lmcache bench server`, the KV layout of mp_store.py) registers its KV cache, so the server
knows the model's layout, and keeps it registered until stdin closes. Each stdin line is a command,
answered with one JSON line on stdout:

    {"op": "store", "tokens": [...]}     store the complete chunks; {"checksums": [...]} of the KV stored
    {"op": "retrieve", "tokens": [...]}  zero the KV blocks, look up and retrieve what hits, as vLLM does;
                                         {"hit_chunks", "checksums"} of the KV retrieved

usage: mp_hold.py RPC_URL HTTP_URL   (prints {"model": ..., "ready": true} once registered)
"""

import json
import sys

from lmcache.cli.commands.bench.server_bench.client import RequestContext, ServerBenchClient
from lmcache.cli.commands.bench.server_bench.config import BenchConfig
from lmcache.cli.commands.bench.server_bench.helpers import _MODEL_NAME

SHAPE = "(2,256,16,2,32):float16:2"  # as mp_store.py: 128 KiB per 256-token chunk


def answer(value: dict) -> None:
    print(json.dumps(value), flush=True)


def main() -> None:
    rpc_url, http_url = sys.argv[1:]
    config = BenchConfig(rpc_url=rpc_url, http_url=http_url, mode="cpu", transfer_mode="auto", tp_size=1,
                         use_mla=False, num_tokens=0, kvcache_shape_spec=SHAPE, num_blocks=256, block_size=16)
    client = ServerBenchClient(config, lambda line: print(line, file=sys.stderr))
    client.start()
    try:
        answer({"model": _MODEL_NAME, "ready": True})
        for number, line in enumerate(sys.stdin):
            command = json.loads(line)
            tokens = tuple(command["tokens"])
            chunk = client._chunk_size
            full = len(tokens) // chunk * chunk
            request = RequestContext(number, f"kvctl-hold-{number}", command["op"], tokens, full, full // chunk,
                                     chunk, 0, full // 16)
            if command["op"] == "store":
                result = client.store(request, 0, full)
                assert result is not None and result.succeeded, "store failed"
                answer({"checksums": client.compute_checksums(request, 0, full)})
            else:
                client.zero_destination(request, 0, full)
                hits = client.lookup(request).hit_chunks
                result = client.retrieve(request, 0, hits * chunk)
                assert hits == 0 or (result is not None and result.succeeded), "retrieve failed"
                answer({"hit_chunks": hits, "checksums": client.compute_checksums(request, 0, hits * chunk) or []})
            client.end_session(request)
    finally:
        client.close()


if __name__ == "__main__":
    main()
