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
an unknown backend fails loudly instead of scrambling KV.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedLayout:
    """How one backend stores a block; ``view`` returns the canonical ``[2, Hkv, B, D]`` view
    (a view, so writes land in the cache)."""

    name: str
    matches: Callable[[tuple[int, ...], int, int, int], bool]
    view: Callable[[torch.Tensor, int, int, int, int], torch.Tensor]

    def read_block(self, cache: torch.Tensor, block_id: int) -> torch.Tensor:
        hkv, b, d = self._dims
        return self.view(cache, block_id, hkv, b, d).to("cpu", copy=True).contiguous()

    def write_block(self, cache: torch.Tensor, block_id: int, block: torch.Tensor) -> None:
        hkv, b, d = self._dims
        dst = self.view(cache, block_id, hkv, b, d)
        if tuple(block.shape) != tuple(dst.shape):
            raise ValueError(f"block shape {tuple(block.shape)} != cache block {tuple(dst.shape)}")
        dst.copy_(block.to(dst.device, dst.dtype))

    _dims: tuple[int, int, int] = (0, 0, 0)


def _flash_view(c: torch.Tensor, i: int, hkv: int, b: int, d: int) -> torch.Tensor:
    return c[:, i].permute(0, 2, 1, 3)  # [2, B, Hkv, D] -> [2, Hkv, B, D]


def _flashinfer_view(c: torch.Tensor, i: int, hkv: int, b: int, d: int) -> torch.Tensor:
    return c[i].permute(0, 2, 1, 3)


LAYOUTS: tuple[PagedLayout, ...] = (
    PagedLayout("flash_attn", lambda s, hkv, b, d: len(s) == 5 and s[0] == 2 and s[2:] == (b, hkv, d), _flash_view),
    PagedLayout(
        "flashinfer", lambda s, hkv, b, d: len(s) == 5 and s[1] == 2 and s[2:] == (b, hkv, d), _flashinfer_view
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

    def _halves(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        v = cache.view(cache.shape[0], self.hkv, 2 * self.b, self.d)
        return v[:, :, : self.b], v[:, :, self.b :]

    def _kernel_write(self, cache: torch.Tensor, block_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        from vllm import _custom_ops as ops

        key_cache, value_cache = self._halves(cache)
        slots = torch.arange(block_id * self.b, (block_id + 1) * self.b, dtype=torch.int64)
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, self.isa)

    def _probe(self, dtype: torch.dtype) -> torch.Tensor:
        """Learn where the kernel puts each canonical element, in base-64 digits (exact in bf16)."""
        n = 2 * self.hkv * self.b * self.d
        idx = torch.arange(n, dtype=torch.int64)
        perm = torch.zeros(n, dtype=torch.int64)
        scale = 1
        while scale < n:
            digit = ((idx // scale) % 64).to(dtype).view(2, self.hkv, self.b, self.d)
            scratch = torch.zeros(1, self.hkv, self.b, 2 * self.d, dtype=dtype)
            # kernel input: [B, Hkv, D] per K and V
            self._kernel_write(scratch, 0, digit[0].transpose(0, 1).contiguous(), digit[1].transpose(0, 1).contiguous())
            perm += scratch.reshape(-1).to(torch.int64) * scale
            scale *= 64
        if not torch.equal(torch.sort(perm).values, idx):
            raise ValueError(f"CPU KV packing for isa={self.isa} is not a permutation; unsupported")
        return perm

    def read_block(self, cache: torch.Tensor, block_id: int) -> torch.Tensor:
        """Canonical ``[2, Hkv, B, D]`` copy of block ``block_id``."""
        native = cache[block_id].reshape(-1)
        out = torch.empty_like(native)
        out[self.perm] = native
        return out.view(2, self.hkv, self.b, self.d)

    def write_block(self, cache: torch.Tensor, block_id: int, block: torch.Tensor) -> None:
        """Write canonical ``[2, Hkv, B, D]`` into block ``block_id`` with vLLM's kernel."""
        if tuple(block.shape) != (2, self.hkv, self.b, self.d):
            raise ValueError(f"block shape {tuple(block.shape)} != (2, {self.hkv}, {self.b}, {self.d})")
        block = block.to(cache.dtype)
        self._kernel_write(
            cache, block_id, block[0].transpose(0, 1).contiguous(), block[1].transpose(0, 1).contiguous()
        )


def layout_for(cache: torch.Tensor, num_kv_heads: int, block_size: int, head_dim: int) -> PagedLayout:
    """The layout whose shape fits ``cache``.

    Raises:
        ValueError: no known layout fits (an unsupported attention backend).
    """
    shape = tuple(cache.shape)
    if cache.device.type == "cpu" and len(shape) == 4 and shape[1:] == (num_kv_heads, block_size, 2 * head_dim):
        return CpuPackedLayout(cache, num_kv_heads, block_size, head_dim)  # type: ignore[return-value]
    for lay in LAYOUTS:
        if lay.matches(shape, num_kv_heads, block_size, head_dim):
            return PagedLayout(lay.name, lay.matches, lay.view, (num_kv_heads, block_size, head_dim))
    raise ValueError(f"unknown paged KV layout {shape} for Hkv={num_kv_heads}, B={block_size}, D={head_dim}")
