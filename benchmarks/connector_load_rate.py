"""Load rate of kvctl's CPU connector (LMCache's KV_2LTD chunks into vLLM CPU's paged cache) against a
plain torch copy of the same bytes.

In process, no server: VLLMCPUPagedConnector.batched_to_gpu loads N tokens, in LMCache's 256-token
chunks, into a paged cache whose blocks are handed out in shuffled order (as a busy vLLM's are),
for the project's tiny model (2 layers x 2 KV heads x 32, bf16) and a realistic shape (32 layers x
8 KV heads x 128, bf16) with a block of 16 and with vLLM CPU's default of 128. The floor is
`dst.copy_(src)` of one contiguous tensor of the same size: memory bandwidth. The last line is the
connector's rate over the copy's for the realistic shape at block 128 (goal >= 0.5).

vLLM CPU's layouts keep K transposed in each block, so every load transposes K. With vec/vec16 (block 16
here, or any block without AMX) vLLM's own kernel does it element by element; with AMX tiles (bf16,
block 128, on CPUs that have them) the connector's _amx_layout.c streams whole tile lines. Both sides run on one
thread: on a shared machine, an OpenMP barrier waiting on a descheduled thread stalls each of the
connector's many calls, not the copy's one, and would measure the machine instead of the code.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "plugins"))

from kvctl_plugins.cpu_connector import VLLMCPUPagedConnector  # noqa: E402

CHUNK, REPEATS, SECONDS = 256, 5, 2.0
# name, layers, kv heads, head size, block size, tokens
SHAPES = [("tiny", 2, 2, 32, 128, 65536), ("32x8x128", 32, 8, 128, 16, 2048),
          ("32x8x128", 32, 8, 128, 128, 2048)]


class MemoryObj:
    """What to_gpu reads of LMCache's memory object: its KV_2LTD tensor."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def best(run) -> tuple[float, float]:
    """Fastest and median seconds of `run`, over at least REPEATS runs and SECONDS: the machine is
    shared, and a run that another process interrupts says nothing of the copy itself."""
    run()  # warm: the connector probes vLLM's block layout on its first call
    times: list[float] = []
    deadline = time.perf_counter() + SECONDS
    while len(times) < REPEATS or time.perf_counter() < deadline:
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def measure(layers: int, heads: int, head_size: int, block_size: int, tokens: int) -> tuple[float, float, int]:
    """GB/s (fastest run) of the connector's load and of a plain copy, and the bytes moved."""
    dtype = torch.bfloat16
    blocks = tokens // block_size + 1  # block 0: vLLM's null block
    caches = [torch.zeros(blocks, heads, block_size, 2 * head_size, dtype=dtype) for _ in range(layers)]
    order = torch.randperm(blocks - 1, generator=torch.Generator().manual_seed(0)) + 1
    slots = (order.view(-1, 1) * block_size + torch.arange(block_size)).flatten()
    connector = VLLMCPUPagedConnector(layers, heads, head_size, dtype)
    starts = list(range(0, tokens, CHUNK))
    ends = [min(start + CHUNK, tokens) for start in starts]
    chunks = [MemoryObj(torch.randn(tuple(connector.get_shape(end - start))).to(dtype))
              for start, end in zip(starts, ends)]
    nbytes = sum(chunk.tensor.numel() * chunk.tensor.element_size() for chunk in chunks)
    load, load_median = best(lambda: connector.batched_to_gpu(chunks, starts, ends, kvcaches=caches,
                                                              slot_mapping=slots))
    src = torch.randn(nbytes // 2).to(dtype)
    dst = torch.empty_like(src)
    copy, copy_median = best(lambda: dst.copy_(src))
    print(f"  connector load: {nbytes / load / 1e9:.2f} GB/s (median {nbytes / load_median / 1e9:.2f}); "
          f"torch copy: {nbytes / copy / 1e9:.2f} GB/s (median {nbytes / copy_median / 1e9:.2f})")
    return nbytes / load / 1e9, nbytes / copy / 1e9, nbytes


def main() -> None:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    ratio = 0.0
    for name, layers, heads, head_size, block_size, tokens in SHAPES:
        print(f"{name}: {layers} layers x {heads} KV heads x {head_size}, block {block_size}, {tokens} tokens")
        load, copy, nbytes = measure(layers, heads, head_size, block_size, tokens)
        print(f"  {nbytes / 2**20:.0f} MiB; load / copy = {load / copy:.2f}")
        ratio = load / copy
    print(f"connector_load_over_torch_copy={ratio:.2f}")


if __name__ == "__main__":
    main()
