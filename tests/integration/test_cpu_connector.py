"""The CPU connector moves exactly the KV that vLLM's own CPU attention op wrote, both ways.

vLLM CPU lays K out by attention ISA: "vec" and "vec16" (every x86 machine vLLM runs on, AVX2
or AVX-512) and "amx" (bf16 on CPUs with AMX tiles). Each ISA this machine can run is tested.
"""

import pytest
import torch

CPU_ATTENTION_ISAS = ["vec", "vec16"] + (["amx"] if torch.cpu._is_amx_tile_supported() else [])


class MemoryObj:
    def __init__(self, shape, dtype):
        self.tensor = torch.zeros(shape, dtype=dtype)


def test_the_isa_vllm_picks_is_tested_here():
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    for dtype in (torch.bfloat16, torch.float32):
        assert _get_attn_isa(dtype, 128, 32, "auto") in CPU_ATTENTION_ISAS


@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "isa"), [(dtype, isa) for isa in CPU_ATTENTION_ISAS
                                            for dtype in (torch.bfloat16, torch.float32)
                                            if isa != "amx" or dtype == torch.bfloat16])  # AMX: bf16 caches only
def test_store_and_retrieve_round_trip_through_vllms_cpu_layout(dtype, isa):
    from kvctl_plugins.cpu_connector import VLLMCPUPagedConnector
    from vllm import _custom_ops as ops

    layers, heads, head_size, block_size, blocks, tokens = 2, 2, 32, 128, 6, 300
    generator = torch.Generator().manual_seed(0)
    caches = [torch.zeros(blocks, heads, block_size, 2 * head_size, dtype=dtype) for _ in range(layers)]
    slots = torch.randperm((blocks - 1) * block_size, generator=generator)[:tokens] + block_size  # block 0 = null
    written = []
    for cache in caches:
        key = torch.randn(tokens, heads, head_size, generator=generator).to(dtype)
        value = torch.randn(tokens, heads, head_size, generator=generator).to(dtype)
        key_cache, value_cache = cache.view(blocks, heads, block_size * 2, head_size).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
        written.append((key, value))

    connector = VLLMCPUPagedConnector(layers, heads, head_size, dtype, isa=isa)
    assert connector.get_shape(256) == torch.Size([2, layers, 256, heads * head_size])
    first, second = MemoryObj(connector.get_shape(256), dtype), MemoryObj(connector.get_shape(44), dtype)
    connector.batched_from_gpu([first, second], [0, 256], [256, 300], kvcaches=caches, slot_mapping=slots)
    for layer, (key, value) in enumerate(written):
        stored = torch.cat([first.tensor[:, layer], second.tensor[:, layer]], dim=1)
        assert torch.equal(stored[0], key.reshape(tokens, -1)) and torch.equal(stored[1], value.reshape(tokens, -1))

    originals = [cache.clone() for cache in caches]
    for cache in caches:
        cache.zero_()
    connector.to_gpu(first, 0, 256, kvcaches=caches, slot_mapping=slots, vllm_cached_tokens=128)
    connector.to_gpu(second, 256, 300, kvcaches=caches, slot_mapping=slots)
    check = MemoryObj(connector.get_shape(tokens), dtype)
    connector.from_gpu(check, 0, tokens, kvcaches=caches, slot_mapping=slots)
    for layer, (key, value) in enumerate(written):
        assert torch.all(check.tensor[:, layer, :128] == 0)  # vLLM already had these: left untouched
        assert torch.equal(check.tensor[0, layer, 128:], key.reshape(tokens, -1)[128:])
        assert torch.equal(check.tensor[1, layer, 128:], value.reshape(tokens, -1)[128:])
    untouched = [slot for slot in range(blocks * block_size) if slot not in set(slots.tolist())]
    assert untouched and all(torch.count_nonzero(cache[0]) == 0 for cache in caches)
    assert any(torch.count_nonzero(original) for original in originals)


@pytest.mark.slow
@pytest.mark.parametrize(("isa", "dtype"), [(isa, torch.bfloat16) for isa in CPU_ATTENTION_ISAS]
                         + [(isa, torch.float32) for isa in CPU_ATTENTION_ISAS if isa != "amx"])
@pytest.mark.parametrize("slots_kind", ["shuffled", "in runs"])
def test_a_load_writes_the_cache_byte_for_byte_as_vllms_own_kernel(isa, dtype, slots_kind):
    """Whatever writes the blocks (vLLM's kernel; _amx_layout.c where the layout is AMX's; _strided_layout.c
    where it is a strided view and the values are 16-bit), a load leaves the cache exactly as vLLM's own
    cpu_attn_reshape_and_cache leaves it: scattered slots, and runs that start on an odd token (V's token
    pairs split) and cross blocks."""
    from kvctl_plugins.cpu_connector import VLLMCPUPagedConnector
    from vllm import _custom_ops as ops

    layers, heads, head_size, block_size, blocks, tokens = 2, 2, 64, 128, 6, 300
    generator = torch.Generator().manual_seed(1)
    if slots_kind == "shuffled":
        slots = torch.randperm((blocks - 1) * block_size, generator=generator)[:tokens] + block_size
    else:
        order = torch.randperm(blocks - 1, generator=generator) + 1
        slots = (order.view(-1, 1) * block_size + torch.arange(block_size)).flatten()[1:tokens + 1]
    loaded = MemoryObj(torch.Size([2, layers, tokens, heads * head_size]), dtype)
    expected = []
    for layer in range(layers):
        loaded.tensor[:, layer] = torch.randn(2, tokens, heads * head_size, generator=generator).to(dtype)
        cache = torch.zeros(blocks, heads, block_size, 2 * head_size, dtype=dtype)
        key_cache, value_cache = cache.view(blocks, heads, block_size * 2, head_size).chunk(2, dim=2)
        key, value = (loaded.tensor[which, layer].reshape(tokens, heads, head_size) for which in (0, 1))
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
        expected.append(cache)
    caches = [torch.zeros_like(cache) for cache in expected]
    connector = VLLMCPUPagedConnector(layers, heads, head_size, dtype, isa=isa)
    connector.batched_to_gpu([loaded], [0], [tokens], kvcaches=caches, slot_mapping=slots)
    assert all(torch.equal(cache, wanted) for cache, wanted in zip(caches, expected))
    assert (connector._amx_load is not None) == (isa == "amx")  # AMX's tiles: the compiled loader wrote them
    assert (connector._strided_load is not None) == (isa != "amx" and dtype == torch.bfloat16)


ATTEND_OVER_LOADED_KV = """
import torch
from kvctl_plugins.cpu_connector import VLLMCPUPagedConnector
from vllm import _custom_ops as ops

heads, kv_heads, head_size, block_size, blocks, context = 4, 2, 32, 128, 12, 1280
cache = torch.zeros(blocks, kv_heads, block_size, 2 * head_size, dtype=torch.bfloat16)
loaded = type("MemoryObj", (), {})()
loaded.tensor = torch.randn(2, 1, context, kv_heads * head_size).to(torch.bfloat16)
slots = torch.arange(block_size, block_size + context)
VLLMCPUPagedConnector(1, kv_heads, head_size, torch.bfloat16).to_gpu(loaded, 0, context, kvcaches=[cache],
                                                                     slot_mapping=slots)
key_cache, value_cache = cache.view(blocks, kv_heads, block_size * 2, head_size).chunk(2, dim=2)
query = torch.randn(3, heads, head_size).to(torch.bfloat16)
output = torch.empty_like(query)
starts, lengths = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([context + 3], dtype=torch.int32)
table = torch.arange(1, blocks, dtype=torch.int32).view(1, -1)
plan = ops.cpu_attn_get_scheduler_metadata(1, heads, kv_heads, head_size, lengths, torch.bfloat16, starts, True, -1,
                                           "amx", False)
ops.cpu_attention_with_kv_cache(query, key_cache, value_cache, output, starts, lengths, head_size ** -0.5, True, None,
                                -1, table, 0.0, plan, None)
print("attended", bool(torch.isfinite(output).all()))
"""


@pytest.mark.skipif("amx" not in CPU_ATTENTION_ISAS, reason="this CPU has no AMX tiles: vLLM never picks amx here")
def test_amx_attention_over_kv_the_connector_loaded_runs_in_a_fresh_process():
    """A restarted vLLM whose first request is an LMCache hit runs AMX attention over loaded KV before any
    large bf16 GEMM (which is where oneDNN would ask Linux for AMX tiles): without the connector asking,
    the worker dies of SIGILL (seen on a Sapphire Rapids-class machine)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", ATTEND_OVER_LOADED_KV], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert done.stdout.split() == ["attended", "True"]
