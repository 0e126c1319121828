"""LMCache's GPU-connector interface for vLLM's CPU backend, so LMCacheConnectorV1 works there.

LMCache 0.5.6's CreateGPUConnector only knows cuda/xpu/musa/hpu and fails on CPU ("No supported
cpu connector found"). vLLM's CPU attention keeps each layer's cache as
[num_blocks, num_kv_heads, block_size, 2 * head_size], K and V regions per block, with a K layout
that depends on the CPU's instruction set. Rather than hard-coding layouts, the connector asks
vLLM's own `cpu_attn_reshape_and_cache` where every (token, head, dim) of K and V lands inside a
block (writing index-encoded values into a scratch block once), then moves KV with torch
gather/scatter over those positions: no Python loop per token.

LMCache's side of the data is KV_2LTD: [2, num_layers, num_tokens, num_kv_heads * head_size].
"""

from __future__ import annotations

import math
from typing import Any

import torch

DIGIT_BASE = 128  # integers below 2**8 are exact in bfloat16, float16 and float32
UNWRITTEN, OTHER = -2.0, -1.0


def probe_block_layout(num_kv_heads: int, block_size: int, head_size: int, dtype: torch.dtype,
                       isa: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (token offset, head, dim) the flat position of K and of V inside one cache block."""
    from vllm import _custom_ops as ops

    count = block_size * num_kv_heads * head_size
    ids = torch.arange(count, dtype=torch.int64)
    digits = max(1, math.ceil(math.log(count, DIGIT_BASE)))
    positions = []
    for which in ("key", "value"):
        found = torch.zeros(2 * count, dtype=torch.int64)
        written = None
        for digit in range(digits):
            scratch = torch.full((2, num_kv_heads, block_size, 2 * head_size), UNWRITTEN, dtype=dtype)
            key_cache, value_cache = scratch.view(2, num_kv_heads, block_size * 2, head_size).chunk(2, dim=2)
            encoded = ((ids // DIGIT_BASE**digit) % DIGIT_BASE).to(dtype).view(block_size, num_kv_heads, head_size)
            other = torch.full_like(encoded, OTHER)
            key, value = (encoded, other) if which == "key" else (other, encoded)
            slots = torch.arange(block_size, 2 * block_size, dtype=torch.int64)  # block 1; block 0 stays untouched
            ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
            block = scratch[1].reshape(-1).to(torch.float32)
            mask = (block != UNWRITTEN) & (block != OTHER)
            written = mask if written is None else written & mask
            found += block.clamp(min=0).to(torch.int64) * DIGIT_BASE**digit
        where = torch.nonzero(written).flatten()
        if where.numel() != count:
            raise RuntimeError(f"cannot map vLLM's CPU KV layout: {where.numel()} of {count} {which} elements found")
        layout = torch.empty(count, dtype=torch.int64)
        layout[found[where]] = where
        positions.append(layout.view(block_size, num_kv_heads, head_size))
    return positions[0], positions[1]


class VLLMCPUPagedConnector:
    """GPUConnectorInterface for vLLM CPU's paged KV cache (registered as a subclass at install)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
                 kv_cache_dtype: str = "auto", isa: str | None = None) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.isa = isa  # vLLM's attention ISA (None: the one vLLM's CPU backend picks for the cache)
        self.kvcaches: list[torch.Tensor] | None = None
        self._layout: tuple[torch.Tensor, torch.Tensor] | None = None
        self._block_size = 0

    @classmethod
    def from_metadata(cls, metadata, kv_cache_dtype: str = "auto"):
        num_layers, _, _, num_kv_heads, head_size = metadata.kv_shape
        return cls(num_layers, num_kv_heads, head_size, metadata.kv_dtype, kv_cache_dtype)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.num_kv_heads * self.head_size])

    def initialize_kvcaches_ptr(self, **kwargs) -> None:
        if "kvcaches" in kwargs and kwargs["kvcaches"] is not None:
            caches = kwargs["kvcaches"]
            self.kvcaches = list(caches.values()) if isinstance(caches, dict) else list(caches)

    def _positions(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat indexes into a layer's storage of K and V for each slot: [tokens, heads, head_size]."""
        assert self.kvcaches is not None, "kvcaches must be passed before moving KV"
        layer = self.kvcaches[0]
        num_blocks, num_kv_heads, block_size, _ = layer.shape
        if self._layout is None or block_size != self._block_size:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            isa = self.isa or _get_attn_isa(layer.dtype, block_size, self.head_size, self.kv_cache_dtype)
            self._layout = probe_block_layout(num_kv_heads, block_size, self.head_size, layer.dtype, isa)
            self._block_size = block_size
        slots = slots.to(torch.int64)
        base = (slots // block_size * layer[0].numel()).view(-1, 1, 1)
        offsets = slots % block_size
        return base + self._layout[0][offsets], base + self._layout[1][offsets]

    def from_gpu(self, memory_obj, start: int, end: int, **kwargs: Any) -> None:
        """vLLM's KV for tokens [start, end) into the memory object (a store)."""
        self.initialize_kvcaches_ptr(**kwargs)
        key_index, value_index = self._positions(kwargs["slot_mapping"][start:end])
        tensor = memory_obj.tensor
        tokens = end - start
        for layer_id, layer in enumerate(self.kvcaches):
            flat = layer.view(-1)
            tensor[0, layer_id, :tokens] = flat[key_index].reshape(tokens, -1).to(tensor.dtype)
            tensor[1, layer_id, :tokens] = flat[value_index].reshape(tokens, -1).to(tensor.dtype)

    def to_gpu(self, memory_obj, start: int, end: int, **kwargs: Any) -> None:
        """The memory object's KV into vLLM's cache for tokens [start, end) (a retrieve); tokens vLLM
        already holds from its own prefix cache are left as they are."""
        self.initialize_kvcaches_ptr(**kwargs)
        skip = min(end - start, max(0, kwargs.get("vllm_cached_tokens", 0) - start))
        if skip == end - start:
            return
        key_index, value_index = self._positions(kwargs["slot_mapping"][start + skip:end])
        tensor = memory_obj.tensor
        tokens = end - start - skip
        for layer_id, layer in enumerate(self.kvcaches):
            flat = layer.view(-1)
            shape = (tokens, self.num_kv_heads, self.head_size)
            flat[key_index] = tensor[0, layer_id, skip:skip + tokens].reshape(shape).to(layer.dtype)
            flat[value_index] = tensor[1, layer_id, skip:skip + tokens].reshape(shape).to(layer.dtype)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs: Any) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends):
            self.from_gpu(memory_obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs: Any) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends):
            self.to_gpu(memory_obj, start, end, **kwargs)


def install() -> None:
    """Have LMCache's connector factory build VLLMCPUPagedConnector for vLLM on a CPU device."""
    import lmcache.v1.gpu_connector as gpu_connector
    from lmcache import torch_device_type
    from lmcache.utils import EngineType
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

    original = gpu_connector.CreateGPUConnector
    if getattr(original, "kvctl_wrapped", False):
        return
    GPUConnectorInterface.register(VLLMCPUPagedConnector)

    def CreateGPUConnector(config, metadata, engine, layout_hints=None):  # noqa: N802 - LMCache's name
        if engine == EngineType.VLLM and torch_device_type == "cpu" and not config.use_layerwise \
                and not metadata.use_mla:
            return VLLMCPUPagedConnector.from_metadata(metadata)
        return original(config, metadata, engine, layout_hints=layout_hints)

    CreateGPUConnector.kvctl_wrapped = True
    gpu_connector.CreateGPUConnector = CreateGPUConnector
