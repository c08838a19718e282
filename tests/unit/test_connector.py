"""The connector's paged layouts, their start-up check, its asynchronous saves, faults kept inside a request,
the conversion of any engine dtype (bf16 and fp16 under ``dtype = "auto"``) to the block store's
canonical float32, and its two sides: each process builds only its role's side, and the sides meet only
through the store and the per-step metadata."""

from __future__ import annotations

import os
import pickle
import re
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tandem.cloud.engines.connector import (
    ConnectorSettings,
    PartOp,
    TandemConnector,
    TandemConnectorScheduler,
    TandemConnectorWorker,
    TandemMetadata,
)
from tandem.cloud.engines.kv_layout import canonical, read_blocks
from tandem.cloud.store.blocks import MemoryBlockStore
from tandem.common.protocol.errors import EngineError
from tandem.common.wire.kvblocks import LayerRange


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
    """(cache, layout) for the packed layout (every CUDA backend) and CPU_ATTN's ISA packing."""
    from tandem.cloud.engines.kv_layout import layout_for

    packed = torch.randn(NUM_BLOCKS, HKV, B, 2 * D)
    cpu = torch.zeros(NUM_BLOCKS, HKV, B, 2 * D)
    return [(packed, layout_for(packed, HKV, B, D, "FLASH_ATTN")), (cpu, layout_for(cpu, HKV, B, D, "CPU_ATTN"))]


@pytest.mark.parametrize("which", [0, 1], ids=["packed", "cpu_attn"])
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


def test_the_packed_layout_reads_keys_and_values_where_flash_attention_keeps_them():
    """vLLM's FlashAttention: ``key_cache, value_cache = kv_cache.transpose(1, 2).split(D, dim=-1)``,
    each ``[num_blocks, B, Hkv, D]``; canonical is ``[2, Hkv, B, D]`` per block."""
    (packed, lay), _ = _layouts()
    key_cache, value_cache = packed.transpose(1, 2).split(D, dim=-1)
    got = read_blocks(lay, packed, [5])[0]
    np.testing.assert_array_equal(got[0], key_cache[5].permute(1, 0, 2))
    np.testing.assert_array_equal(got[1], value_cache[5].permute(1, 0, 2))


def test_the_packed_layout_honours_a_cache_whose_memory_is_in_another_order():
    """vLLM allocates the packed cache in NHD or HND stride order and hands the connector the logical
    ``[num_blocks, Hkv, B, 2*D]`` view; reads and writes go through the logical indices."""
    from tandem.cloud.engines.kv_layout import layout_for

    nhd = torch.zeros(NUM_BLOCKS, B, HKV, 2 * D).permute(0, 2, 1, 3)  # logical shape, NHD memory
    assert not nhd.is_contiguous()
    lay = layout_for(nhd, HKV, B, D, "TRITON_ATTN")
    blocks = _canonical_blocks(2, 3)
    lay.write_blocks(nhd, [1, 6], blocks)
    np.testing.assert_array_equal(read_blocks(lay, nhd, [1, 6]), blocks.numpy())
    key_cache = nhd.transpose(1, 2).split(D, dim=-1)[0]
    np.testing.assert_array_equal(key_cache[6].permute(1, 0, 2).numpy(), blocks[1, 0].numpy())


@pytest.mark.parametrize(
    ("shape", "dtype", "backend", "says"),
    [
        ((2, NUM_BLOCKS, B, HKV, D), torch.float16, "FLASH_ATTN", "unknown paged KV layout"),
        ((NUM_BLOCKS, HKV, B, 2 * D + 2), torch.bfloat16, "FLASH_ATTN", "expected [num_blocks, Hkv, B, 2*D]"),
        ((NUM_BLOCKS, HKV, B, 2 * D), torch.uint8, "FLASH_ATTN", "kv_cache_dtype must be 'auto'"),
        ((NUM_BLOCKS, HKV, B, 2 * D), torch.float16, "FLASHMLA", "does not support the FLASHMLA"),
    ],
    ids=["old-flash-shape", "padded-head", "fp8-cache", "unknown-backend"],
)
def test_a_cache_no_layout_fits_is_refused_by_name(shape, dtype, backend, says):
    from tandem.cloud.engines.kv_layout import KVLayoutError, layout_for

    with pytest.raises(KVLayoutError, match=re.escape(says)):
        layout_for(torch.zeros(shape, dtype=dtype), HKV, B, D, backend)


def test_the_cpu_layout_writes_many_blocks_as_vllm_writes_their_tokens():
    """One kernel call over many blocks lands every token where per-token writes of vLLM's own
    kernel (slot = block * B + position) put it."""
    from vllm import _custom_ops as ops

    _, (cache, lay) = _layouts()
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


def _settings(queue_bytes: int = 1 << 30) -> ConnectorSettings:
    return ConnectorSettings(
        block_size=B,
        layer_offset=0,
        num_kv_heads=HKV,
        head_dim=D,
        store_url="",
        store_dir="",
        store_bytes=0,
        save_queue_bytes=queue_bytes,
    )


def _worker(store, queue_bytes: int = 1 << 30, vllm_config=None) -> TandemConnectorWorker:
    """The worker side of a connector: what the model runner drives."""
    return TandemConnectorWorker(_settings(queue_bytes), store, vllm_config)


def _step(c: TandemConnectorWorker, caches: list[torch.Tensor], saves: list[tuple[int, str]]) -> None:
    """One model-runner step that saves blocks ``saves`` (block id, key) of every layer."""
    part = LayerRange(lo=0, hi=LAYERS)
    meta = TandemMetadata(saves=[(bid, PartOp(part, key)) for bid, key in saves])
    for layer, cache in enumerate(caches):
        c.save_kv_layer(meta, f"model.layers.{layer}.self_attn.attn", cache)
    c.wait_for_save()


def _stored(store, key: str) -> np.ndarray:
    return np.frombuffer(store.get(key), np.float32).reshape(LAYERS, 2, HKV, B, D)


@pytest.mark.parametrize("which", [0, 1], ids=["packed", "cpu_attn"])
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
    c._layout = lay  # as register_kv_caches chose it
    _step(c, caches, [(3, "a"), (8, "b")])  # returns with the writes still waiting on the gate
    assert not store.contains("a")
    for cache, lay in ((cache, _layouts()[which][1]) for cache in caches):
        lay.write_blocks(cache, [3, 8], _canonical_blocks(2, 99))  # the blocks are reused
    store.gate.set()
    c.flush_saves()
    for n, key in enumerate(("a", "b")):
        np.testing.assert_array_equal(_stored(store, key), np.stack([w[n].numpy() for w in want]))


def test_the_writer_puts_a_prompts_blocks_in_plan_order_across_steps():
    """Remote prefill's downlink takes the blocks in prompt order as they land
    (``Pins.await_prefix``): the writer puts each block on its own, in the order its step planned
    them, a later step's after an earlier one's (a prompt prefilled in chunks), whatever vLLM block
    ids hold them; the first is in the store while the others still wait."""
    order: list[str] = []

    class Recording(GatedStore):
        def put(self, key: str, value: bytes) -> None:
            order.append(key)
            super().put(key, value)

    store = Recording()
    cache, lay = _layouts()[1]
    caches = [cache.clone() for _ in range(LAYERS)]
    c = _worker(store)
    c._layout = lay
    # prompt blocks 0..4 under keys neither sorted nor in vLLM block id order
    _step(c, caches, [(7, "q"), (2, "c"), (5, "x")])  # the first chunk's full blocks
    _step(c, caches, [(1, "a"), (6, "m")])  # the second chunk's
    assert store.started.wait(5) and order == ["q"]  # one put at a time: the first waits at the gate alone
    store.gate.set()
    c.flush_saves()
    assert order == ["q", "c", "x", "a", "m"]
    assert all(store.contains(k) for k in order)


def test_a_step_waits_for_the_writer_only_past_the_queue_bound():
    store = GatedStore()
    cache, lay = _layouts()[1]
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
    cache, _ = _layouts()[1]
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
    cache, _ = _layouts()[1]
    c = _worker(store)
    meta = TandemMetadata(saves=[(1, PartOp(LayerRange(lo=0, hi=LAYERS), "a"))])
    for layer in range(LAYERS - 1):  # the last layer never ran
        c.save_kv_layer(meta, f"model.layers.{layer}.self_attn.attn", cache)
    c.wait_for_save()
    c.flush_saves()
    assert not store.contains("a")
    assert "has 2 of 3 layers; not saved" in caplog.text


def test_shutdown_writes_what_is_queued_and_ends_the_writer():
    store = GatedStore()
    cache, _ = _layouts()[1]
    c = _worker(store)
    _step(c, [cache] * LAYERS, [(1, "a")])
    threading.Timer(0.1, store.gate.set).start()
    c.shutdown()
    assert store.contains("a") and c._writer is None


# --- faults stay inside the request ------------------------------------------------------------------------


def _vllm_config(backends: dict[str, str], tp: int = 1) -> SimpleNamespace:
    """The parts of a VllmConfig ``register_kv_caches`` reads: each layer's attention backend name."""

    def layer(name: str) -> SimpleNamespace:
        backend = SimpleNamespace(get_name=lambda: name)
        return SimpleNamespace(get_attn_backend=lambda: backend)

    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        compilation_config=SimpleNamespace(static_forward_context={n: layer(b) for n, b in backends.items()}),
    )


def _names(n: int = LAYERS) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(n)]


def test_registering_the_caches_chooses_the_layout_of_their_backend():
    c = _worker(MemoryBlockStore(1 << 20), vllm_config=_vllm_config(dict.fromkeys(_names(), "FLASH_ATTN")))
    c.register_kv_caches({n: torch.zeros(NUM_BLOCKS, HKV, B, 2 * D, dtype=torch.bfloat16) for n in _names()})
    assert c._layout is not None and c._layout.name == "packed"


@pytest.mark.parametrize(
    ("backends", "tp", "says"),
    [
        ({n: "FLASHMLA" for n in _names()}, 1, "does not support the FLASHMLA attention backend"),
        ({n: "FLASH_ATTN" for n in _names()}, 2, "tensor_parallel_size=2"),
        ({**{n: "FLASH_ATTN" for n in _names()}, _names()[1]: "CPU_ATTN"}, 1, "uses KV layout"),
    ],
    ids=["unknown-backend", "tensor-parallel", "mixed-layouts"],
)
def test_an_engine_whose_caches_no_layout_fits_does_not_start(backends, tp, says):
    from tandem.cloud.engines.kv_layout import KVLayoutError

    c = _worker(MemoryBlockStore(1 << 20), vllm_config=_vllm_config(backends, tp))
    with pytest.raises(KVLayoutError, match=re.escape(says)):
        c.register_kv_caches({n: torch.zeros(NUM_BLOCKS, HKV, B, 2 * D) for n in _names()})


class _BrokenLayout:
    """A layout whose copies fail (a device fault, an unexpected tensor)."""

    name = "broken"

    def snapshot(self, cache, block_ids):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def write_blocks(self, cache, block_ids, blocks):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_save_that_fails_leaves_its_blocks_out_of_the_store_and_the_engine_running(caplog):
    store = GatedStore()
    store.gate.set()
    cache, lay = _layouts()[0]
    c = _worker(store)
    c._layout = _BrokenLayout()
    _step(c, [cache] * LAYERS, [(1, "a")])  # raises nothing
    c.flush_saves()
    assert not store.contains("a")
    assert "copying model.layers.0.self_attn.attn of 1 KV blocks failed; not saved" in caplog.text
    c._layout = lay
    _step(c, [cache] * LAYERS, [(2, "b")])
    c.flush_saves()
    assert store.contains("b")


class _LandingLater:
    """A copy's event (a GPU's ``HostCopy.ready``): the copy lands in ``host`` only when waited for,
    as a device-to-host copy queued on a stream lands some time after it was queued."""

    def __init__(self, host: torch.Tensor, data: torch.Tensor) -> None:
        self.host, self.data, self.waited = host, data, 0

    def synchronize(self) -> None:
        self.host.copy_(self.data)
        self.waited += 1


class _QueuedCopyLayout:
    """The packed layout whose copies land only when their event is waited for."""

    def __init__(self, layout) -> None:
        self.layout, self.events = layout, []
        self.name = layout.name

    def snapshot(self, cache, block_ids):
        from tandem.cloud.engines.kv_layout import HostCopy

        landed = self.layout.snapshot(cache, block_ids).result()
        host = torch.zeros_like(landed)  # what the host memory holds before the copy lands
        self.events.append(_LandingLater(host, landed))
        return HostCopy(host, self.events[-1])

    def from_snapshot(self, native):
        return self.layout.from_snapshot(native)


def test_the_writer_reads_a_layers_copy_only_after_it_landed():
    """On a GPU a layer's copy is queued on the step's stream and the forward goes on: the writer
    waits for each copy's event before it reads the copy, so the stored block is the cache's, not
    the host buffer's earlier contents; the step itself never waits."""
    store = MemoryBlockStore(1 << 20)
    cache, lay = _layouts()[0]
    c = _worker(store)
    c._layout = queued = _QueuedCopyLayout(lay)
    _step(c, [cache] * LAYERS, [(3, "a")])
    c.flush_saves()
    assert len(queued.events) == LAYERS and all(e.waited == 1 for e in queued.events)
    want = read_blocks(lay, cache, [3])[0]
    np.testing.assert_array_equal(_stored(store, "a"), np.stack([want] * LAYERS))


def _forward_context(caches: list[torch.Tensor]) -> SimpleNamespace:
    """The part of vLLM's ``ForwardContext`` a load reads: each attention layer and its paged cache."""
    names = _names(len(caches))
    return SimpleNamespace(
        no_compile_layers={n: SimpleNamespace(kv_cache=cache) for n, cache in zip(names, caches, strict=True)}
    )


def _load_step(c: TandemConnectorWorker, caches: list[torch.Tensor], loads: list[tuple[int, str]], failed=()):
    part = LayerRange(lo=0, hi=LAYERS)
    meta = TandemMetadata(loads=[(bid, (PartOp(part, key),)) for bid, key in loads], failed_loads=list(failed))
    c.start_load_kv(meta, _forward_context(caches))


def test_a_load_that_fails_is_reported_for_recompute_and_the_engine_keeps_running(caplog):
    store = MemoryBlockStore(1 << 26)
    blocks = np.stack([_canonical_blocks(1, 40 + i)[0].numpy() for i in range(LAYERS)])  # [L, 2, Hkv, B, D]
    store.put("a", blocks.tobytes())
    cache, lay = _layouts()[0]
    caches = [cache.clone() for _ in range(LAYERS)]
    c = _worker(store)
    c._layout = _BrokenLayout()
    _load_step(c, caches, [(4, "a")])  # raises nothing
    assert c.get_block_ids_with_load_errors() == {4}
    assert "loading 1 KV blocks failed; vLLM recomputes them" in caplog.text
    c._layout = lay
    _load_step(c, caches, [(4, "a"), (5, "missing")], failed=[9])
    assert c.get_block_ids_with_load_errors() == {5, 9}  # a missing block and a failed plan
    for layer, cache in enumerate(caches):
        np.testing.assert_array_equal(read_blocks(lay, cache, [4])[0], blocks[layer])


def test_malformed_kv_params_run_the_request_as_plain_vllm(caplog):
    c = TandemConnectorScheduler(_settings(), MemoryBlockStore(1 << 20))
    request = SimpleNamespace(request_id="r1", num_prompt_tokens=100, kv_transfer_params={"tandem": {"loads": 7}})
    assert c.get_num_new_matched_tokens(request, 0) == (0, False)
    assert request.kv_transfer_params is None and "malformed KV params of r1" in caplog.text


class _UnreachableStore(MemoryBlockStore):
    """A shared store that stopped answering."""

    def contains(self, key: str) -> bool:
        raise EngineError("store out of reach")


def test_a_plan_that_fails_saves_nothing_and_reports_its_loads_for_recompute(caplog):
    from tandem.cloud.engines.kvparams import KVTransferSpec, PartSpec

    c = TandemConnectorScheduler(_settings(), _UnreachableStore(1 << 20))
    part = PartSpec(LayerRange(lo=0, hi=LAYERS), tuple(bytes([i]) * 32 for i in range(4)))
    spec = KVTransferSpec(loads=(part,), save=part)
    request = SimpleNamespace(
        request_id="r1", num_prompt_tokens=4 * B, kv_transfer_params=spec.to_vllm(), num_computed_tokens=0
    )
    assert c.get_num_new_matched_tokens(request, 0) == (0, False)  # the lookup failed: nothing loadable
    c.update_state_after_alloc(request, None, 2 * B)  # as if vLLM had planned two external blocks
    new = SimpleNamespace(req_id="r1", block_ids=([11, 12, 13, 14],), num_computed_tokens=0)
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    so = SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=cached, num_scheduled_tokens={"r1": 4 * B})
    meta = c.build_connector_meta(so)
    assert meta.saves == [] and meta.loads == [] and meta.failed_loads == [11, 12, 13, 14]
    assert "planning request r1 failed" in caplog.text
    assert c._reqs["r1"].spec.save is None  # later steps of the request save nothing either


# --- the two sides: each process builds its own, they meet through the store and the step's metadata -----


def _engine_config(store_dir, **extra) -> SimpleNamespace:
    """The parts of a VllmConfig the connector reads in either role (``gateway_pid``: this process, so
    the lifeline stays off)."""
    entries = {"store_dir": str(store_dir), "store_bytes": 1 << 26, "gateway_pid": os.getpid(), **extra}
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=entries),
        cache_config=SimpleNamespace(block_size=B),
        model_config=SimpleNamespace(get_total_num_kv_heads=lambda: HKV, get_head_size=lambda: D),
        **vars(_vllm_config(dict.fromkeys(_names(), "CPU_ATTN"))),
    )


def test_each_role_builds_only_its_own_side(tmp_path):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    cfg = _engine_config(tmp_path, layer_offset=2, save_queue_bytes=1 << 20)
    sched = TandemConnector(cfg, KVConnectorRole.SCHEDULER, None)
    worker = TandemConnector(cfg, KVConnectorRole.WORKER, None)
    assert isinstance(sched.connector_scheduler, TandemConnectorScheduler) and sched.connector_worker is None
    assert isinstance(worker.connector_worker, TandemConnectorWorker) and worker.connector_scheduler is None
    assert worker.worker.layer_offset == 2 and worker.worker._save_queue_bytes == 1 << 20
    with pytest.raises(RuntimeError, match="worker-side call on tandem's SCHEDULER connector"):
        sched.register_kv_caches({})
    with pytest.raises(RuntimeError, match="scheduler-side call on tandem's WORKER connector"):
        worker.get_num_new_matched_tokens(SimpleNamespace(request_id="r1"), 0)
    sched.shutdown()
    worker.shutdown()


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"store_dir": None}, "'store_dir'"),
        ({"store_bytes": "lots"}, "bad kv_connector_extra_config"),
    ],
    ids=["no-store-dir", "bad-store-bytes"],
)
def test_an_engine_whose_connector_settings_are_malformed_does_not_start(tmp_path, extra, says):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    cfg = _engine_config(tmp_path)
    entries = cfg.kv_transfer_config.kv_connector_extra_config
    for k, v in extra.items():
        entries.pop(k) if v is None else entries.__setitem__(k, v)
    with pytest.raises(ValueError, match=re.escape(says)):
        TandemConnector(cfg, KVConnectorRole.WORKER, None)


def _schedule(c: TandemConnector, request: SimpleNamespace, block_ids: list[int]) -> TandemMetadata:
    """vLLM's scheduler for one new request scheduled whole in one step: the tokens the store supplies,
    the allocation, the step's metadata, sent to the workers in a pickle."""
    hit, _ = c.get_num_new_matched_tokens(request, 0)
    c.update_state_after_alloc(request, None, hit)
    new = SimpleNamespace(req_id=request.request_id, block_ids=(block_ids,), num_computed_tokens=0)
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    so = SimpleNamespace(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={request.request_id: request.num_prompt_tokens - hit},
    )
    meta = pickle.loads(pickle.dumps(c.build_connector_meta(so)))
    assert isinstance(meta, TandemMetadata)
    return meta


def _run_step(c: TandemConnector, meta: TandemMetadata, caches: list[torch.Tensor]) -> set[int]:
    """vLLM's model runner for one step: bind, load, forward (a save per layer), wait, unbind."""
    c.bind_connector_metadata(meta)
    c.start_load_kv(_forward_context(caches))
    for name, cache in zip(_names(), caches, strict=True):
        c.save_kv_layer(name, cache, None)
    c.wait_for_save()
    c.clear_connector_metadata()
    c.worker.flush_saves()
    return c.get_block_ids_with_load_errors()


def test_blocks_one_engine_saves_another_loads_through_the_two_sides(tmp_path):
    """A prefill engine's sides save a prompt's full blocks; a decode engine's sides, in other
    instances over the same store, load them into other block ids of another cache, bit for bit."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tandem.cloud.engines.kvparams import ConnectorReport, KVTransferSpec, PartSpec

    cfg = _engine_config(tmp_path)
    part = PartSpec(LayerRange(lo=0, hi=LAYERS), tuple(bytes([i]) * 32 for i in range(3)))
    prompt_tokens = 3 * B + 5  # three full blocks and a partial one
    caches = [torch.zeros(NUM_BLOCKS, HKV, B, 2 * D) for _ in range(LAYERS)]
    lay = _layouts()[1][1]
    want = [_canonical_blocks(3, 60 + layer) for layer in range(LAYERS)]
    for cache, blocks in zip(caches, want, strict=True):
        lay.write_blocks(cache, [5, 2, 7], blocks)

    prefill = [TandemConnector(cfg, role, None) for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER)]
    prefill[1].register_kv_caches(dict(zip(_names(), caches, strict=True)))
    saving = SimpleNamespace(
        request_id="p1", num_prompt_tokens=prompt_tokens, num_computed_tokens=0,
        kv_transfer_params=KVTransferSpec(save=part).to_vllm(),
    )  # fmt: skip
    meta = _schedule(prefill[0], saving, [5, 2, 7, 9])
    assert meta.loads == [] and [bid for bid, _ in meta.saves] == [5, 2, 7]
    assert _run_step(prefill[1], meta, caches) == set()
    assert ConnectorReport.from_vllm(prefill[0].request_finished(saving, [])[1]) == ConnectorReport(0, 3)

    decode = [TandemConnector(cfg, role, None) for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER)]
    other = [torch.zeros(NUM_BLOCKS, HKV, B, 2 * D) for _ in range(LAYERS)]
    decode[1].register_kv_caches(dict(zip(_names(), other, strict=True)))
    loading = SimpleNamespace(
        request_id="d1", num_prompt_tokens=prompt_tokens, num_computed_tokens=0,
        kv_transfer_params=KVTransferSpec(loads=(part,)).to_vllm(),
    )  # fmt: skip
    meta = _schedule(decode[0], loading, [1, 10, 3, 4])
    assert meta.saves == [] and [bid for bid, _ in meta.loads] == [1, 10, 3]
    assert _run_step(decode[1], meta, other) == set()
    assert ConnectorReport.from_vllm(decode[0].request_finished(loading, [])[1]) == ConnectorReport(3 * B, 3)
    for cache, blocks in zip(other, want, strict=True):
        np.testing.assert_array_equal(read_blocks(lay, cache, [1, 10, 3]), blocks.numpy())
    for c in (*prefill, *decode):
        c.shutdown()
