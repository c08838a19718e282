"""The connector's conversion to the block store's canonical format (found by an operator trial: a cloud with
``dtype = "auto"`` runs its engines in bf16 on CPU, and saving a block crashed the tail engine on ``.numpy()``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.cloud.connector import canonical


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_blocks_of_any_engine_dtype_are_stored_as_float32(dtype):
    block = torch.randn(2, 3, 32, 8).to(dtype)
    out = canonical(block)
    assert out.dtype == np.float32 and out.shape == (2, 3, 32, 8)
    np.testing.assert_array_equal(out, block.to(torch.float32).numpy())  # bf16/fp16 -> fp32 is exact


# --- paged layouts: many blocks of a layer in one gather / scatter ------------------------------------

HKV, B, D, NUM_BLOCKS = 3, 16, 64, 12


def _canonical_blocks(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 2, HKV, B, D, generator=torch.Generator().manual_seed(seed))


def _layouts():
    from tandem.cloud.kv_layout import layout_for

    flash = torch.randn(2, NUM_BLOCKS, B, HKV, D)
    flashinfer = torch.randn(NUM_BLOCKS, 2, B, HKV, D)
    cpu = torch.zeros(NUM_BLOCKS, HKV, B, 2 * D)
    return [(c, layout_for(c, HKV, B, D)) for c in (flash, flashinfer, cpu)]


@pytest.mark.parametrize("which", [0, 1, 2], ids=["flash_attn", "flashinfer", "cpu_attn"])
def test_a_layout_writes_many_blocks_and_reads_them_back(which):
    cache, lay = _layouts()[which]
    before = cache.clone()
    ids = [7, 2, 9]
    blocks = _canonical_blocks(len(ids), which)
    lay.write_blocks(cache, ids, blocks)
    torch.testing.assert_close(lay.read_blocks(cache, ids), blocks, rtol=0, atol=0)
    torch.testing.assert_close(lay.read_blocks(cache, [9, 7]), blocks[[2, 0]], rtol=0, atol=0)
    others = [i for i in range(NUM_BLOCKS) if i not in ids]
    torch.testing.assert_close(lay.read_blocks(cache, others), lay.read_blocks(before, others), rtol=0, atol=0)
    with pytest.raises(ValueError):
        lay.write_blocks(cache, ids, blocks[:2])


def test_the_flash_layouts_read_keys_and_values_where_their_backends_keep_them():
    (flash, lay_f), (flashinfer, lay_fi), _ = _layouts()
    # flash_attn: [2, num_blocks, B, Hkv, D]; canonical [2, Hkv, B, D] per block
    np.testing.assert_array_equal(lay_f.read_blocks(flash, [5])[0], flash[:, 5].permute(0, 2, 1, 3))
    # flashinfer: [num_blocks, 2, B, Hkv, D]
    np.testing.assert_array_equal(lay_fi.read_blocks(flashinfer, [5])[0], flashinfer[5].permute(0, 2, 1, 3))


def test_the_cpu_layout_writes_many_blocks_as_vllm_writes_their_tokens():
    """One kernel call over many blocks lands every token where per-token writes of vLLM's own
    kernel (slot = block * B + position) put it."""
    from vllm import _custom_ops as ops

    _, _, (cache, lay) = _layouts()
    ids = [4, 1]
    blocks = _canonical_blocks(len(ids), 5)
    lay.write_blocks(cache, ids, blocks)
    ref = torch.zeros_like(cache)
    key_cache, value_cache = lay._halves(ref)
    for n, block in enumerate(ids):
        for pos in range(B):
            k = blocks[n, 0, :, pos].unsqueeze(0).contiguous()  # [1, Hkv, D]
            v = blocks[n, 1, :, pos].unsqueeze(0).contiguous()
            slot = torch.tensor([block * B + pos], dtype=torch.int64)
            ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slot, lay.isa)
    torch.testing.assert_close(cache, ref, rtol=0, atol=0)
