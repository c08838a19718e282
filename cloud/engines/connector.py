"""TandemConnector: vLLM's KV-connector API (``KVConnectorBase_V1``) over tandem's block store.

Loaded by vLLM through ``kv_connector_module_path="tandem.cloud.engines.connector"``,
``kv_connector="TandemConnector"``; the connector patches nothing in vLLM. One class
serves both cloud engines:

* tail-prefill engine (``kv_both``, ``layer_offset = k``): *loads* tail KV of a
  session's earlier turns, computes the rest from ``prompt_embeds`` and *saves*
  the tail KV (global layers ``[k, L)``) of every full prompt block;
* decode engine (``kv_both``, ``layer_offset = 0``): *loads* all layers of
  the block-aligned prompt prefix (head part from the edge, tail part from the
  tail engine) and lets vLLM compute the partial last block and decode; in remote
  prefill its one part covers every layer, loaded where the session's earlier turns
  stored it and *saved* for the prompt's other full blocks (which go down to the edge).

Per request the gateway passes a ``cloud.engines.kvparams.KVTransferSpec`` in
``SamplingParams.extra_args["kv_transfer_params"]`` (``spec.to_vllm()``): the parts
(layer range + one content key per block) that must all be stored for a block to
load, and the part this engine saves. Keys commit to the inputs the KV was computed
from, so a stored block is only ever loaded for the same inputs.
Requests without ``"tandem"`` params run as plain vLLM requests (no load, no save).

Who calls what (vLLM v1): the *scheduler-side* instance (EngineCore process)
gets ``get_num_new_matched_tokens`` / ``update_state_after_alloc`` /
``build_connector_meta`` / ``request_finished`` once per request or step; the
*worker-side* instance (model-runner process) gets ``start_load_kv`` before
each forward, ``save_kv_layer`` per attention layer during it and
``wait_for_save`` after it. Loads are synchronous: when ``start_load_kv``
returns the blocks are in vLLM's paged cache. A block that cannot be read is
reported through ``get_block_ids_with_load_errors`` and vLLM recomputes it
(``kv_load_failure_policy="recompute"``); a load never writes wrong data.

Saves are asynchronous past a copy. ``save_kv_layer`` copies each planned
block out of the paged cache in the backend's own layout (one gather per
layer: an ``index_select`` memcpy on CPU, a gather and a blocking host copy
on a GPU); ``wait_for_save`` hands the step's copies to one writer thread,
which turns them into canonical blocks (numpy) and puts them in the store, in
order, while vLLM samples and returns the first token. The copy is
taken inside the step, so a block freed or reused afterwards (a finished,
aborted or preempted request) cannot change what is saved, and vLLM frees
blocks at once (no ``delay_free_blocks``). Readers learn a block is there by
its key (``BlockStore.contains``); the gateway waits for a turn's tail keys
before the decode request (``Pins.await_tail_saves``). At most
``save_queue_bytes`` of copies wait for the writer; a step beyond that waits
in ``wait_for_save`` (backpressure). A put the store refuses leaves the block
missing and its readers recompute it.

Faults stay inside the request: the paged layout is chosen and checked when vLLM registers
the engine's caches (``register_kv_caches``; an unsupported backend or shape fails the
engine's start with ``KVLayoutError``), and any error while planning, loading or saving a
request's blocks is logged and turns into missing blocks that vLLM recomputes (loads are
reported through ``get_block_ids_with_load_errors``; a save that fails leaves the block out
of the store), never into an exception that would end the EngineCore.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from tandem.cloud.engines.kv_layout import KVLayoutError, Layout, canonical, layout_for
from tandem.cloud.engines.kvparams import ConnectorReport, KVTransferSpec
from tandem.cloud.store.blocks import open_store
from tandem.common.protocol.errors import EngineError
from tandem.common.wire.kvblocks import LayerRange, block_nbytes

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("tandem.connector")
_LAYER_RE = re.compile(r"\.layers\.(\d+)\.")
DEFAULT_SAVE_QUEUE_BYTES = 256 << 20


@dataclass(frozen=True)
class PartOp:
    """One block's entry of one layer range: ``key`` in the store."""

    part: LayerRange
    key: str


@dataclass
class TandemMetadata(KVConnectorMetadata):
    """One step's work for the worker side; built by the scheduler side.
    ``loads``: (vLLM block id, every part of it to write into the paged cache);
    ``saves``: (vLLM block id, the part to read out and store);
    ``failed_loads``: vLLM block ids to report as load errors (their plan failed)."""

    loads: list[tuple[int, tuple[PartOp, ...]]] = field(default_factory=list)
    saves: list[tuple[int, PartOp]] = field(default_factory=list)
    failed_loads: list[int] = field(default_factory=list)  # vLLM block ids whose load plan failed


@dataclass
class _ReqState:
    """Scheduler-side state of one request with tandem params."""

    spec: KVTransferSpec
    num_prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)
    external_tokens: int = 0
    local_hit_tokens: int = 0
    load_pending: bool = False
    saved_blocks: int = 0  # blocks [0, saved_blocks) are saved or known present


class TandemConnector(KVConnectorBase_V1):
    """KV connector between vLLM's paged cache and tandem's block store (see module doc)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.block_size = vllm_config.cache_config.block_size
        self.layer_offset = int(extra.get("layer_offset", 0))
        model_cfg = vllm_config.model_config
        self.num_kv_heads = model_cfg.get_total_num_kv_heads()
        self.head_dim = model_cfg.get_head_size()
        # scheduler side
        self._reqs: dict[str, _ReqState] = {}
        self._init_worker(
            open_store(extra.get("store_url", ""), extra["store_dir"], int(extra["store_bytes"])),
            int(extra.get("save_queue_bytes", DEFAULT_SAVE_QUEUE_BYTES)),
        )
        from tandem.cloud.engines import lifeline

        lifeline.watch_parent(extra.get("gateway_pid"))

    def _init_worker(self, store: Any, save_queue_bytes: int) -> None:
        """The block store and the worker side's state (``block_size``, ``layer_offset``,
        ``num_kv_heads`` and ``head_dim`` are set before)."""
        self.store = store
        self._load_errors: set[int] = set()
        # this step's copies: (global layer, the ops it serves, native blocks [n, ...] in op order)
        self._staged: list[tuple[int, list[PartOp], torch.Tensor]] = []
        self._save_queue_bytes = save_queue_bytes
        self._writer: ThreadPoolExecutor | None = None
        self._pending: deque[tuple[Future[None], int]] = deque()  # submitted jobs and their bytes
        self._pending_bytes = 0
        self._pending_lock = threading.Lock()
        self._layout: Layout | None = None  # chosen in register_kv_caches (or at the first cache seen)

    # ------------------------------------------------------------------ scheduler side

    def _state(self, request: Request) -> _ReqState | None:
        st = self._reqs.get(request.request_id)
        if st is None:
            try:
                spec = KVTransferSpec.from_vllm(request.kv_transfer_params)
            except ValueError as e:  # the request runs without the store: vLLM computes all of it
                log.error("tandem connector: malformed KV params of %s (%s); computing it", request.request_id, e)
                request.kv_transfer_params = None
                return None
            if spec is None:
                return None
            st = _ReqState(spec, request.num_prompt_tokens)
            self._reqs[request.request_id] = st
        return st

    def _present_blocks(self, st: _ReqState, start: int) -> int:
        """Number of consecutive blocks from ``start`` whose entries for all load parts are stored."""
        n, parts = start, st.spec.loads
        while n < st.spec.num_blocks and all(self.store.contains(p.store_key(n)) for p in parts):
            n += 1
        return n - start

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens loadable from the store past ``num_computed_tokens``: whole blocks, and never
        the last prompt token (vLLM must compute at least one token to sample)."""
        st = self._state(request)
        if st is None or not st.spec.loads or num_computed_tokens % self.block_size:
            return 0, False
        first = num_computed_tokens // self.block_size
        cap_blocks = (st.num_prompt_tokens - 1) // self.block_size
        try:
            present = self._present_blocks(st, first)
        except Exception:  # a store out of reach: nothing is loadable, vLLM computes the prompt
            log.exception("tandem connector: cannot look up blocks of request %s; computing them", request.request_id)
            return 0, False
        n = min(present, max(0, cap_blocks - first))
        return n * self.block_size, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        st = self._state(request)
        if st is None:
            return
        if num_external_tokens > 0:
            st.external_tokens = num_external_tokens
            st.local_hit_tokens = request.num_computed_tokens
            st.load_pending = True

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = TandemMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is not None:
                st.block_ids = list(new.block_ids[0])
                self._plan_guarded(new.req_id, st, new.num_computed_tokens, scheduler_output, meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    st.block_ids = list(new_ids[0])
                else:
                    st.block_ids.extend(new_ids[0])
            self._plan_guarded(req_id, st, cached.num_computed_tokens[i], scheduler_output, meta)
        return meta

    def _plan_guarded(self, req_id: str, st: _ReqState, num_computed: int, so: SchedulerOutput, meta: TandemMetadata):
        """``_plan``, never raising: a request whose plan fails saves nothing more, and if it had
        blocks to load this step, every block of it is reported failed so vLLM recomputes them."""
        n_loads, n_saves = len(meta.loads), len(meta.saves)
        try:
            self._plan(req_id, st, num_computed, so, meta)
        except Exception:
            log.exception("tandem connector: planning request %s failed; vLLM computes its blocks", req_id)
            del meta.saves[n_saves:]
            if st.load_pending or len(meta.loads) > n_loads:
                del meta.loads[n_loads:]
                meta.failed_loads.extend(st.block_ids)
            st.load_pending = False
            st.spec = replace(st.spec, save=None)

    def _plan(self, req_id: str, st: _ReqState, num_computed: int, so: SchedulerOutput, meta: TandemMetadata) -> None:
        """Add this step's loads (once, at first schedule) and saves (blocks completed by this step)."""
        bs = self.block_size
        if st.load_pending:
            first = st.local_hit_tokens // bs
            for j in range(first, first + st.external_tokens // bs):
                meta.loads.append((st.block_ids[j], tuple(PartOp(p.layers, p.store_key(j)) for p in st.spec.loads)))
            st.load_pending = False
            st.saved_blocks = max(st.saved_blocks, first + st.external_tokens // bs)  # loaded: already stored
        save = st.spec.save
        if save is None:
            return
        done = min(num_computed + so.num_scheduled_tokens.get(req_id, 0), st.num_prompt_tokens)
        full = min(done // bs, len(save.keys), len(st.block_ids))
        for j in range(st.saved_blocks, full):
            key = save.store_key(j)
            if not self.store.contains(key):  # keys commit to the inputs: a present entry is this KV
                meta.saves.append((st.block_ids[j], PartOp(save.layers, key)))
        st.saved_blocks = max(st.saved_blocks, full)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Report what the connector did for the request in ``RequestOutput.kv_transfer_params``."""
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        return False, ConnectorReport(st.external_tokens, st.saved_blocks).to_vllm()

    # ------------------------------------------------------------------ worker side

    def _global_layer(self, layer_name: str) -> int:
        m = _LAYER_RE.search(layer_name)
        if m is None:
            raise ValueError(f"cannot find a layer index in {layer_name!r}")
        return int(m.group(1)) + self.layer_offset

    def _read_part(self, op: PartOp) -> np.ndarray | None:
        """Canonical block ``[Lp, 2, Hkv, B, D]`` of ``op.part``, or None when missing or malformed."""
        part = op.part
        raw = self.store.get(op.key)
        want = block_nbytes(part, self.num_kv_heads, self.block_size, self.head_dim)
        if raw is None or len(raw) != want:
            return None
        return np.frombuffer(bytearray(raw), dtype=np.float32).reshape(
            part.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim
        )

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's model runner, once at engine start: choose the paged layout from the layers'
        attention backend and check every layer's cache against it.

        Raises:
            KVLayoutError: an unsupported backend, cache shape or dtype, different layouts across
                layers, or tensor-parallel KV shards; the engine does not start.
        """
        tp = self._vllm_config.parallel_config.tensor_parallel_size
        if tp > 1:
            raise KVLayoutError(f"tandem's KV connector does not support tensor_parallel_size={tp} (KV head shards)")
        forward = self._vllm_config.compilation_config.static_forward_context
        for name, cache in kv_caches.items():
            if not _LAYER_RE.search(name):
                continue
            layer: Any = forward.get(name)
            backend = layer.get_attn_backend().get_name() if hasattr(layer, "get_attn_backend") else None
            lay = layout_for(cache, self.num_kv_heads, self.block_size, self.head_dim, backend)
            if self._layout is not None and lay.name != self._layout.name:
                raise KVLayoutError(f"layer {name} uses KV layout {lay.name}, others {self._layout.name}")
            self._layout = self._layout or lay
        if self._layout is None:
            raise KVLayoutError(f"no decoder layer's KV cache among {sorted(kv_caches)[:4]}")
        log.info("tandem connector: paged KV layout %s (%d layers)", self._layout.name, len(kv_caches))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Copy this step's planned blocks from the store into vLLM's paged cache. Never raises:
        blocks that could not be written are reported as load errors and vLLM recomputes them."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, TandemMetadata):
            return
        self._load_errors.update(meta.failed_loads)
        if not meta.loads:
            return
        try:
            self._load(meta, forward_context)
        except Exception:
            log.exception("tandem connector: loading %d KV blocks failed; vLLM recomputes them", len(meta.loads))
            self._load_errors.update(block_id for block_id, _ in meta.loads)

    def _load(self, meta: TandemMetadata, forward_context: ForwardContext) -> None:
        """Every part of every block read first, then one scatter per layer over all the blocks loaded."""
        layers = {
            name: layer
            for name, layer in forward_context.no_compile_layers.items()
            if getattr(layer, "kv_cache", None) is not None and _LAYER_RE.search(name)
        }
        loaded: list[tuple[int, list[tuple[LayerRange, np.ndarray]]]] = []
        for block_id, ops in meta.loads:
            read = [self._read_part(op) for op in ops]
            if any(b is None for b in read):  # missing or malformed: vLLM recomputes this block
                self._load_errors.add(block_id)
                continue
            loaded.append((block_id, [(op.part, b) for op, b in zip(ops, read, strict=True) if b is not None]))
        for name, layer in layers.items():
            g = self._global_layer(name)
            ids: list[int] = []
            rows: list[np.ndarray] = []
            for block_id, parts in loaded:
                row = next((data[g - part.lo] for part, data in parts if part.lo <= g < part.hi), None)
                if row is None:  # no part covers this layer: the block cannot be complete
                    self._load_errors.add(block_id)
                    continue
                ids.append(block_id)
                rows.append(row)
            if ids:
                cache = layer.kv_cache
                self._layout_of(cache).write_blocks(cache, ids, torch.from_numpy(np.stack(rows)))

    def _layout_of(self, cache: torch.Tensor) -> Layout:
        """The registered layout (a worker that saw no ``register_kv_caches``: chosen from ``cache``)."""
        if self._layout is None:
            self._layout = layout_for(cache, self.num_kv_heads, self.block_size, self.head_dim)
        return self._layout

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Copy this layer's slice of every block planned for saving this step (one gather, in the
        backend's layout, complete on return); the writer thread makes them canonical and stores them."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, TandemMetadata) or not meta.saves:
            return
        try:
            g = self._global_layer(layer_name)
            ops = [(block_id, op) for block_id, op in meta.saves if op.part.lo <= g < op.part.hi]
            if ops:
                native = self._layout_of(kv_layer).snapshot(kv_layer, [block_id for block_id, _ in ops])
                self._staged.append((g, [op for _, op in ops], native))
        except Exception:  # this layer is not copied: its blocks are incomplete and not stored
            log.exception("tandem connector: copying %s of %d KV blocks failed; not saved", layer_name, len(meta.saves))

    def wait_for_save(self) -> None:
        """Hand this step's copies to the writer thread and return: the store puts run while vLLM
        samples. Waits only while more than ``save_queue_bytes`` of copies are queued."""
        if not self._staged:
            return
        staged, self._staged = self._staged, []
        nbytes = sum(t.numel() * t.element_size() for _, _, t in staged)
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-kv-save")
        self._drain(self._save_queue_bytes - nbytes)
        fut = self._writer.submit(self._write, staged)
        with self._pending_lock:
            self._pending.append((fut, nbytes))
            self._pending_bytes += nbytes
        fut.add_done_callback(self._done)

    def _done(self, fut: Future[None]) -> None:
        with self._pending_lock:
            while self._pending and self._pending[0][0].done():
                self._pending_bytes -= self._pending.popleft()[1]

    def _drain(self, limit_bytes: int) -> None:
        """Wait for queued writes until at most ``max(limit_bytes, 0)`` bytes of copies are queued."""
        while True:
            with self._pending_lock:
                if self._pending_bytes <= max(limit_bytes, 0) or not self._pending:
                    return
                fut = self._pending[0][0]
            fut.result()  # _write never raises
            self._done(fut)

    def flush_saves(self) -> None:
        """Block until every queued save is in the store (or refused)."""
        self._drain(0)

    def shutdown(self) -> None:
        """vLLM's engine shutdown: the queued saves are written (each put is bounded by the store's
        own timeouts), then the writer thread ends."""
        self.flush_saves()
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        super().shutdown()

    def _write(self, staged: list[tuple[int, list[PartOp], torch.Tensor]]) -> None:
        """Writer thread: canonical blocks ``[Lp, 2, Hkv, B, D]`` float32 per key, then one put each.
        A key whose step did not copy every layer of its part (a forward that failed midway) is not
        written: a block is stored whole or not at all. A write the store refuses (a shared store
        out of reach) leaves the block missing: its readers recompute it. Never raises."""
        try:
            bufs: dict[str, tuple[np.ndarray, set[int]]] = {}
            layout = self._layout
            for g, ops, native in staged:
                if layout is None:
                    raise KVLayoutError("no KV layout registered")
                data = layout.from_snapshot(canonical(native))
                for op, block in zip(ops, data, strict=True):
                    part = op.part
                    entry = bufs.get(op.key)
                    if entry is None:
                        shape = (part.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)
                        entry = bufs[op.key] = (np.empty(shape, np.float32), set())
                    entry[0][g - part.lo] = block
                    entry[1].add(g)
            for key, (buf, layers) in bufs.items():
                if len(layers) != buf.shape[0]:
                    log.warning(
                        "tandem connector: KV block %s has %d of %d layers; not saved", key, len(layers), buf.shape[0]
                    )
                    continue
                self.store.put(key, buf.tobytes())
        except EngineError as e:
            log.warning("tandem connector: saving KV blocks failed (%s); readers recompute them", e)
        except Exception:
            log.exception("tandem connector: saving KV blocks failed; readers recompute them")

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        if errors:
            log.warning("tandem connector: %d blocks missing from the store; vLLM recomputes them", len(errors))
        return errors
