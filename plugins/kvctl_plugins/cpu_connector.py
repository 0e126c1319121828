"""LMCache's GPU-connector interface for vLLM's CPU backend, so LMCacheConnectorV1 works there.

LMCache 0.5.6's CreateGPUConnector only knows cuda/xpu/musa/hpu and fails on CPU ("No supported
cpu connector found"). vLLM's CPU attention keeps each layer's cache as
[num_blocks, num_kv_heads, block_size, 2 * head_size], K and V regions per block, with a K layout
that depends on the CPU's instruction set. Rather than hard-coding layouts, the connector asks
vLLM's own `cpu_attn_reshape_and_cache` where every (token, head, dim) of K and V lands inside a
block (writing index-encoded values into a scratch block once). A load writes with that same op,
vLLM's C++ kernel (about twice torch's strided copy on K, which vec/vec16 keep transposed), except where
the layout is a strided view and the values are 16-bit (bf16/fp16 on vec/vec16): there _strided_layout.c
writes K in 8x8 tiles transposed in registers and V 16 bytes at a time, all with streaming stores
(0.22x -> 0.72x a plain copy of the bytes, benchmarks/connector_load_rate.py); a store
reads each run of slots in a block with one strided copy per layer, K and V, or, for a layout that
is no strided view (AMX), gathers element by element over the probed positions. Where vLLM attends
with AMX, the connector first asks Linux for AMX tile state (request_amx_tiles), and where the probed
layout is the AMX tile layout written in amx_layout, a load goes through _amx_layout.c instead: one
32-bit store per pair of K dims or V tokens (vLLM's kernel writes the tiles element by element).

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


def strided_layout(layout: torch.Tensor) -> tuple[int, tuple[int, int, int]] | None:
    """The offset and (token, head, dim) strides of a block layout that is a strided view of the block
    (K and V on vec/vec16: V row-major, K transposed), so that a store reads it by strided copies; else None."""
    offset = int(layout[0, 0, 0])
    strides = tuple(int(layout[tuple(int(i == axis) for i in range(3))]) - offset if size > 1 else 0
                    for axis, size in enumerate(layout.shape))
    if min(strides) < 0:
        return None
    ranges = [torch.arange(size).view([-1 if i == axis else 1 for i in range(3)]) * stride
              for axis, (size, stride) in enumerate(zip(layout.shape, strides))]
    return (offset, strides) if torch.equal(offset + ranges[0] + ranges[1] + ranges[2], layout) else None


def amx_layout(num_kv_heads: int, block_size: int, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat positions of K and V in one block as vLLM's AMX attention keeps them (what _amx_layout.c
    writes): per head K then V; K in tiles of 16 tokens holding pairs of dims, V in tiles of 16 dims
    holding pairs of tokens. Used only when it equals the probed layout."""
    token = torch.arange(block_size).view(-1, 1, 1)
    head = torch.arange(num_kv_heads).view(1, -1, 1) * 2 * block_size * head_size
    dim = torch.arange(head_size).view(1, 1, -1)
    key = head + token // 16 * 16 * head_size + dim // 2 * 32 + token % 16 * 2 + dim % 2
    value = head + block_size * head_size + dim // 16 * 16 * block_size + token // 2 * 32 + dim % 16 * 2 + token % 2
    return key, value


def amx_loader(layout: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype):
    """_amx_layout.load where the probed layout is amx_layout's and the cache holds bf16; else None (no
    compiled module, or another layout: vLLM's own kernel loads)."""
    block_size, num_kv_heads, head_size = layout[0].shape
    formulas = amx_layout(num_kv_heads, block_size, head_size)
    if dtype != torch.bfloat16 or not all(map(torch.equal, layout, formulas)):
        return None
    try:
        from kvctl_plugins import _amx_layout
    except ImportError:
        return None
    return _amx_layout.load


def strided_loader(strided: list | None, dtype: torch.dtype):
    """_strided_layout.load where the probed layout is a strided view and the cache holds 16-bit values;
    else None (no compiled module, or another layout: vLLM's own kernel loads)."""
    if strided is None or dtype.itemsize != 2:
        return None
    try:
        from kvctl_plugins import _strided_layout
    except ImportError:
        return None
    return _strided_layout.load


def request_amx_tiles() -> None:
    """Ask Linux for AMX tile state (arch_prctl XTILEDATA), which a process must do before its first tile
    instruction. vLLM's AMX attention never asks; oneDNN asks on its first large bf16 GEMM. A restarted
    vLLM whose first request is an LMCache hit attends over loaded KV before any such GEMM, and without
    this its worker dies of SIGILL."""
    if not torch._C._cpu._init_amx():
        raise RuntimeError("Linux refused this process AMX tile state, which vLLM's amx attention needs")


def slot_runs(slots: torch.Tensor, block_size: int) -> list[tuple[int, int, int]]:
    """(first token, first slot, tokens) of each run of consecutive slots inside one block."""
    breaks = ((slots[1:] != slots[:-1] + 1) | (slots[1:] % block_size == 0)).nonzero().flatten() + 1
    starts = [0, *breaks.tolist()]
    ends = [*starts[1:], len(slots)]
    return list(zip(starts, slots[starts].tolist(), (end - start for start, end in zip(starts, ends))))


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
        self._strided: list | None = None
        self._amx_load = None
        self._strided_load = None
        self._isa = ""
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

    def _probe(self) -> None:
        """vLLM's attention ISA and block layout, probed once per block size."""
        assert self.kvcaches is not None, "kvcaches must be passed before moving KV"
        layer = self.kvcaches[0]
        block_size = layer.shape[2]
        if self._layout is None or block_size != self._block_size:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            self._isa = self.isa or _get_attn_isa(layer.dtype, block_size, self.head_size, self.kv_cache_dtype)
            if self._isa == "amx":
                request_amx_tiles()
            self._layout = probe_block_layout(self.num_kv_heads, block_size, self.head_size, layer.dtype, self._isa)
            strided = [strided_layout(layout) for layout in self._layout]
            self._strided = strided if all(strided) else None
            self._amx_load = amx_loader(self._layout, layer.dtype) if self._isa == "amx" else None
            self._strided_load = strided_loader(self._strided, layer.dtype)
            self._block_size = block_size

    def from_gpu(self, memory_obj, start: int, end: int, **kwargs: Any) -> None:
        """vLLM's KV for tokens [start, end) into the memory object (a store)."""
        self.initialize_kvcaches_ptr(**kwargs)
        self._probe()
        slots = kwargs["slot_mapping"][start:end].to(torch.int64)
        shape = (end - start, self.num_kv_heads, self.head_size)
        block_size, block_numel = self._block_size, self.kvcaches[0][0].numel()
        if self._strided is None:
            base = (slots // block_size * block_numel).view(-1, 1, 1)
            indexes = [base + layout[slots % block_size] for layout in self._layout]
        else:
            runs = slot_runs(slots, block_size)
        for layer_id, layer in enumerate(self.kvcaches):
            flat = layer.view(-1)
            for which in (0, 1):
                memory = memory_obj.tensor[which, layer_id, :end - start].view(shape)
                if self._strided is None:
                    memory.copy_(flat[indexes[which]])
                    continue
                offset, strides = self._strided[which]
                for first, slot, count in runs:
                    memory[first:first + count].copy_(flat.as_strided(
                        (count, *shape[1:]), strides,
                        flat.storage_offset() + offset + slot // block_size * block_numel
                        + slot % block_size * strides[0]))

    def to_gpu(self, memory_obj, start: int, end: int, **kwargs: Any) -> None:
        """The memory object's KV into vLLM's cache for tokens [start, end) (a retrieve); tokens vLLM
        already holds from its own prefix cache are left as they are."""
        from vllm import _custom_ops as ops

        self.initialize_kvcaches_ptr(**kwargs)
        self._probe()
        skip = min(end - start, max(0, kwargs.get("vllm_cached_tokens", 0) - start))
        if skip == end - start:
            return
        slots = kwargs["slot_mapping"][start + skip:end].to(torch.int64)
        if self._amx_load is not None:
            self._load_compiled(self._amx_load, memory_obj, skip, end - start, slots.contiguous(),
                                self.num_kv_heads, self._block_size, self.head_size)
            return
        if self._strided_load is not None:
            (k_offset, k_strides), (v_offset, v_strides) = self._strided
            self._load_compiled(self._strided_load, memory_obj, skip, end - start, slots.contiguous(),
                                self.kvcaches[0][0].numel(), self._block_size, self.num_kv_heads, self.head_size,
                                k_offset, *k_strides, v_offset, *v_strides)
            return
        shape = (end - start - skip, self.num_kv_heads, self.head_size)
        for layer_id, layer in enumerate(self.kvcaches):
            key, value = (memory_obj.tensor[which, layer_id, skip:end - start].reshape(shape).to(layer.dtype)
                          for which in (0, 1))
            key_cache, value_cache = layer.view(layer.shape[0], self.num_kv_heads, -1,
                                                self.head_size).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, self._isa)

    def _load_compiled(self, load, memory_obj, first: int, stop: int, slots: torch.Tensor, *layout) -> None:
        """Tokens [first, stop) of the memory object into every layer by a compiled loader (_amx_layout.c
        or _strided_layout.c; `layout`: the rest of its arguments): addresses of tensors held here, of the
        dtype and shapes it needs."""
        for layer_id, layer in enumerate(self.kvcaches):
            key, value = (memory_obj.tensor[which, layer_id, first:stop].to(layer.dtype).contiguous()
                          for which in (0, 1))
            assert layer.is_contiguous() and key.shape[1] == self.num_kv_heads * self.head_size
            load(key.data_ptr(), value.data_ptr(), stop - first, key.shape[1], slots.data_ptr(), layer.data_ptr(),
                 layer.shape[0], *layout)

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
