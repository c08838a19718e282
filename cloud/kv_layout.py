"""Adapters between vLLM's per-layer paged KV tensors and tandem's canonical block
``[2, Hkv, B, D]`` (K then V, keys after RoPE).

vLLM's attention backends lay out a layer's cache differently
(``get_kv_cache_shape`` of each backend):

* CPU_ATTN (``vllm/v1/attention/backends/cpu_attn.py``): ``[num_blocks, Hkv, B, 2*D]``,
  whose interior is *packed per instruction set* (``_get_attn_isa``: vec, vec16, amx, neon...;
  on ``vec`` keys are stored transposed, ``[D, B]`` per head). tandem writes with vLLM's own
  ``cpu_attn_reshape_and_cache`` kernel and reads through a permutation learned once by
  writing index values with that same kernel, so every ISA's packing is honoured exactly;
* FLASH_ATTN / TRITON_ATTN (``flash_attn.py``): ``[2, num_blocks, B, Hkv, D]``;
* FLASHINFER (``flashinfer.py``): ``[num_blocks, 2, B, Hkv, D]``.

A layout is chosen from the tensor's shape; a shape that fits none raises, so
an unknown backend fails loudly instead of scrambling KV. Every layout reads and
writes many blocks of a layer in one call (``read_blocks`` / ``write_blocks``,
canonical ``[n, 2, Hkv, B, D]``): the connector moves a step's blocks with one
gather or scatter per layer, not one per block and layer. A read splits in two
(``read_blocks``): ``snapshot`` is the copy out of the cache, in the cache's
own layout, that must happen inside the step; ``from_snapshot`` (the
reordering, float32, in numpy: one thread, no OpenMP team beside the
engine's forward) can run later on the connector's writer thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch


def canonical(blocks: torch.Tensor) -> np.ndarray:
    """KV values as the store keeps them: float32 on the host, whatever the engine's KV dtype (bf16 or
    fp16 under ``dtype = "auto"``) and device (any shape in, same shape out)."""
    return blocks.detach().to(device="cpu", dtype=torch.float32).numpy()


def read_blocks(layout: PagedLayout | CpuPackedLayout, cache: torch.Tensor, block_ids: Sequence[int]) -> np.ndarray:
    """Canonical float32 ``[n, 2, Hkv, B, D]`` copy of blocks ``block_ids`` of ``cache`` (any
    float dtype; bf16 and fp16 widen exactly): what the connector's writer stores, in one call."""
    return layout.from_snapshot(canonical(layout.snapshot(cache, block_ids)))


@dataclass(frozen=True)
class PagedLayout:
    """How one backend stores blocks: ``block_axis`` is the cache's block axis, and indexing the
    cache with ``n`` block ids on that axis gives a tensor whose axes ``perm`` reorders into the
    canonical ``[n, 2, Hkv, B, D]`` (``perm`` is its own inverse for every layout here)."""

    name: str
    matches: Callable[[tuple[int, ...], int, int, int], bool]
    block_axis: int
    perm: tuple[int, ...]

    def _index(self, block_ids: Sequence[int]) -> tuple[slice | torch.Tensor, ...]:
        ids = torch.as_tensor(list(block_ids), dtype=torch.int64)
        return (slice(None),) * self.block_axis + (ids,)

    def snapshot(self, cache: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
        """Host copy of blocks ``block_ids`` in the cache's layout and dtype (blocks on
        ``block_axis``): an advanced-index gather, then a blocking device-to-host copy on a GPU,
        so the copy is complete when this returns, whatever stream runs next."""
        return cache[self._index(block_ids)].to("cpu")

    def from_snapshot(self, native: np.ndarray) -> np.ndarray:
        """Canonical ``[n, 2, Hkv, B, D]`` of a float32 ``snapshot``."""
        return np.ascontiguousarray(native.transpose(self.perm))

    def write_blocks(self, cache: torch.Tensor, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        """Write canonical ``[n, 2, Hkv, B, D]`` into blocks ``block_ids``, one scatter.

        Raises:
            ValueError: ``blocks`` is not ``[len(block_ids), 2, Hkv, B, D]``.
        """
        idx = self._index(block_ids)
        native = blocks.permute(self.perm)
        a = self.block_axis
        want = (*cache.shape[:a], len(block_ids), *cache.shape[a + 1 :])
        if tuple(native.shape) != want:
            raise ValueError(f"blocks shape {tuple(blocks.shape)} does not fit {len(block_ids)} cache blocks")
        cache[idx] = native.to(cache.device, cache.dtype)


LAYOUTS: tuple[PagedLayout, ...] = (
    # [2, num_blocks, B, Hkv, D]: cache[:, ids] is [2, n, B, Hkv, D]
    PagedLayout(
        "flash_attn", lambda s, hkv, b, d: len(s) == 5 and s[0] == 2 and s[2:] == (b, hkv, d), 1, (1, 0, 3, 2, 4)
    ),
    # [num_blocks, 2, B, Hkv, D]: cache[ids] is [n, 2, B, Hkv, D]
    PagedLayout(
        "flashinfer", lambda s, hkv, b, d: len(s) == 5 and s[1] == 2 and s[2:] == (b, hkv, d), 0, (0, 1, 3, 2, 4)
    ),
)


class CpuPackedLayout:
    """CPU_ATTN blocks: write with vLLM's kernel, read through a probed permutation."""

    name = "cpu_attn"

    def __init__(self, cache: torch.Tensor, num_kv_heads: int, block_size: int, head_dim: int) -> None:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        self.hkv, self.b, self.d = num_kv_heads, block_size, head_dim
        self.isa = _get_attn_isa(cache.dtype, block_size, head_dim)
        self.perm = self._probe(cache.dtype)  # native flat position -> canonical flat index
        self.inverse = torch.argsort(self.perm).numpy()  # canonical flat index -> native flat position

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

    def snapshot(self, cache: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
        """Copy of blocks ``block_ids`` as packed in the cache, ``[n, Hkv, B, 2*D]`` (one memcpy per block)."""
        return cache.index_select(0, torch.as_tensor(list(block_ids), dtype=torch.int64))

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


def layout_for(cache: torch.Tensor, num_kv_heads: int, block_size: int, head_dim: int) -> PagedLayout | CpuPackedLayout:
    """The layout whose shape fits ``cache``.

    Raises:
        ValueError: no known layout fits (an unsupported attention backend).
    """
    shape = tuple(cache.shape)
    if cache.device.type == "cpu" and len(shape) == 4 and shape[1:] == (num_kv_heads, block_size, 2 * head_dim):
        return CpuPackedLayout(cache, num_kv_heads, block_size, head_dim)
    for lay in LAYOUTS:
        if lay.matches(shape, num_kv_heads, block_size, head_dim):
            return lay
    raise ValueError(f"unknown paged KV layout {shape} for Hkv={num_kv_heads}, B={block_size}, D={head_dim}")
