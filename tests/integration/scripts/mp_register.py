"""Register a KV cache with a running `lmcache server` the way a vLLM worker does (LMCache's own MP client,
the CPU worker of `lmcache bench server`, LMCache-driven: the tensors live in POSIX shared memory the server
maps), fill it with seeded random values, save the tensors to TENSORS_FILE, print one JSON line, and keep
the registration until stdin closes.

usage: mp_register.py RPC_URL HTTP_URL TENSORS_FILE
"""

import json
import sys

import torch
from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
from lmcache.cli.commands.bench.server_bench.config import BenchConfig

SHAPE = "(2,256,16,2,32):float16:2"  # per layer [2, 256 blocks, 16 tokens, 2 heads, 32]; 2 layers


def main() -> None:
    rpc_url, http_url, tensors_file = sys.argv[1:]
    config = BenchConfig(rpc_url=rpc_url, http_url=http_url, mode="cpu", transfer_mode="lmcache_driven", tp_size=1,
                         use_mla=False, num_tokens=0, kvcache_shape_spec=SHAPE, num_blocks=256, block_size=16)
    client = ServerBenchClient(config, lambda line: print(line, file=sys.stderr))
    client.start()
    try:
        worker = client._workers[0]
        for layer, tensor in enumerate(worker.kv_caches.values()):
            values = torch.randn(tensor.shape, generator=torch.Generator().manual_seed(layer))
            tensor.copy_(values.to(tensor.dtype))  # in place: the server reads this memory
        torch.save([tensor.clone() for tensor in worker.kv_caches.values()], tensors_file)
        print(json.dumps({"instance_id": worker.spec.instance_id, "block_size": 16, "num_blocks": 256}), flush=True)
        sys.stdin.read()
    finally:
        client.close()


if __name__ == "__main__":
    main()
