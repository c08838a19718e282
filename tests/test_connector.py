"""The connector's paged layouts, its asynchronous saves, and its conversion to the block store's canonical
format, also from a bf16 cache (a cloud with ``dtype = "auto"`` runs its engines in bf16 on CPU, where
``.numpy()`` of the cache would fail)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from tandem.cloud.connector import PartOp, TandemConnector, TandemMetadata, canonical
from tandem.cloud.kv_layout import read_blocks
from tandem.common.errors import EngineError
from tandem.common.kvblocks import LayerRange
from tandem.common.kvstore import MemoryBlockStore


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
    np.testing.assert_array_equal(read_blocks(lay, cache, ids), blocks.numpy())
    np.testing.assert_array_equal(read_blocks(lay, cache, [9, 7]), blocks[[2, 0]].numpy())
    others = [i for i in range(NUM_BLOCKS) if i not in ids]
    np.testing.assert_array_equal(read_blocks(lay, cache, others), read_blocks(lay, before, others))
    with pytest.raises(ValueError):
        lay.write_blocks(cache, ids, blocks[:2])


def test_the_flash_layouts_read_keys_and_values_where_their_backends_keep_them():
    (flash, lay_f), (flashinfer, lay_fi), _ = _layouts()
    # flash_attn: [2, num_blocks, B, Hkv, D]; canonical [2, Hkv, B, D] per block
    np.testing.assert_array_equal(read_blocks(lay_f, flash, [5])[0], flash[:, 5].permute(0, 2, 1, 3))
    # flashinfer: [num_blocks, 2, B, Hkv, D]
    np.testing.assert_array_equal(read_blocks(lay_fi, flashinfer, [5])[0], flashinfer[5].permute(0, 2, 1, 3))


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


# --- saves: a copy inside the step, the store writes on the writer thread ---------------------------------

LAYERS = 3


class GatedStore(MemoryBlockStore):
    """A store whose puts wait for ``gate`` (a slow disk) or raise (a store out of reach)."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__(1 << 30)
        self.gate, self.fail, self.started = threading.Event(), fail, threading.Event()

    def put(self, key: str, value: bytes) -> None:
        self.started.set()
        self.gate.wait(10)
        if self.fail:
            raise EngineError("store out of reach")
        super().put(key, value)


def _worker(store, queue_bytes: int = 1 << 30) -> TandemConnector:
    """The worker-side half of a connector (no vLLM config): what the model runner drives."""
    c = object.__new__(TandemConnector)
    c.block_size, c.layer_offset, c.num_kv_heads, c.head_dim = B, 0, HKV, D
    c._init_worker(store, queue_bytes)
    return c


def _step(c: TandemConnector, caches: list[torch.Tensor], saves: list[tuple[int, str]]) -> None:
    """One model-runner step that saves blocks ``saves`` (block id, key) of every layer."""
    part = LayerRange(0, LAYERS)
    c.bind_connector_metadata(TandemMetadata(saves=[(bid, PartOp(part, key)) for bid, key in saves]))
    for layer, cache in enumerate(caches):
        c.save_kv_layer(f"model.layers.{layer}.self_attn.attn", cache, None)
    c.wait_for_save()
    c.clear_connector_metadata()


def _stored(store, key: str) -> np.ndarray:
    return np.frombuffer(store.get(key), np.float32).reshape(LAYERS, 2, HKV, B, D)


@pytest.mark.parametrize("which", [0, 2], ids=["flash_attn", "cpu_attn"])
def test_a_save_stores_what_the_cache_held_during_the_step_though_the_write_comes_later(which):
    """The block is copied inside the step: a cache block reused right after (a finished or
    preempted request's block given to another) cannot change what the writer stores."""
    store = GatedStore()
    caches = []
    want = []
    for layer in range(LAYERS):
        cache, lay = _layouts()[which]
        blocks = _canonical_blocks(2, 10 + layer)
        lay.write_blocks(cache, [3, 8], blocks)
        caches.append(cache)
        want.append(blocks)
    c = _worker(store)
    _step(c, caches, [(3, "a"), (8, "b")])  # returns with the writes still waiting on the gate
    assert not store.contains("a")
    for cache, lay in ((cache, _layouts()[which][1]) for cache in caches):
        lay.write_blocks(cache, [3, 8], _canonical_blocks(2, 99))  # the blocks are reused
    store.gate.set()
    c.flush_saves()
    for n, key in enumerate(("a", "b")):
        np.testing.assert_array_equal(_stored(store, key), np.stack([w[n].numpy() for w in want]))


def test_a_step_waits_for_the_writer_only_past_the_queue_bound():
    store = GatedStore()
    cache, lay = _layouts()[2]
    caches = [cache.clone() for _ in range(LAYERS)]
    block_bytes = HKV * B * 2 * D * 4
    c = _worker(store, queue_bytes=LAYERS * block_bytes)  # room for one block of every layer
    _step(c, caches, [(1, "a")])
    assert store.started.wait(5)  # the writer holds "a" at the gate; the step returned
    second = threading.Thread(target=_step, args=(c, caches, [(2, "b")]))
    second.start()
    second.join(0.3)
    assert second.is_alive()  # "b" would exceed the bound: the step waits for the writer
    store.gate.set()
    second.join(5)
    assert not second.is_alive()
    c.flush_saves()
    assert store.contains("a") and store.contains("b") and c._pending_bytes == 0


def test_a_store_refusing_the_writes_leaves_the_blocks_missing_and_the_engine_running(caplog):
    store = GatedStore(fail=True)
    store.gate.set()
    cache, _ = _layouts()[2]
    c = _worker(store)
    _step(c, [cache] * LAYERS, [(1, "a"), (2, "b")])
    c.flush_saves()
    assert not store.contains("a") and not store.contains("b")
    assert "readers recompute them" in caplog.text
    store.fail = False
    _step(c, [cache] * LAYERS, [(3, "c")])  # the next step saves as before
    c.flush_saves()
    assert store.contains("c")


def test_a_block_missing_a_layer_in_its_step_is_not_stored(caplog):
    """A forward that failed midway still reaches ``wait_for_save`` (vLLM calls it in a finally):
    a block is stored whole or not at all, never with rows nobody wrote."""
    store = GatedStore()
    store.gate.set()
    cache, _ = _layouts()[2]
    c = _worker(store)
    part = LayerRange(0, LAYERS)
    c.bind_connector_metadata(TandemMetadata(saves=[(1, PartOp(part, "a"))]))
    for layer in range(LAYERS - 1):  # the last layer never ran
        c.save_kv_layer(f"model.layers.{layer}.self_attn.attn", cache, None)
    c.wait_for_save()
    c.clear_connector_metadata()
    c.flush_saves()
    assert not store.contains("a")
    assert "has 2 of 3 layers; not saved" in caplog.text


def test_shutdown_writes_what_is_queued_and_ends_the_writer():
    store = GatedStore()
    cache, _ = _layouts()[2]
    c = _worker(store)
    _step(c, [cache] * LAYERS, [(1, "a")])
    threading.Timer(0.1, store.gate.set).start()
    c.shutdown()
    assert store.contains("a") and c._writer is None
