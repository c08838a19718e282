"""The worker side of tandem's KV connector (vLLM's model-runner process): moves the blocks the
scheduler side planned (``TandemMetadata``) between vLLM's paged cache and the block store, in the
engine's paged layout (``cloud.engines.kv_layout``) on the cache side and the canonical float32
``[Lp, 2, Hkv, B, D]`` on the store side.

Who calls what (vLLM v1 model runner): ``register_kv_caches`` once at engine start;
``start_load_kv`` before each forward, ``save_kv_layer`` per attention layer during it and
``wait_for_save`` after it (each with the step's metadata, bound by the connector);
``get_block_ids_with_load_errors`` after the step; ``shutdown`` once.

Loads are synchronous: when ``start_load_kv`` returns the blocks are in vLLM's paged cache. A block
that cannot be read is reported through ``get_block_ids_with_load_errors`` and vLLM recomputes it
(``kv_load_failure_policy="recompute"``); a load never writes wrong data.

Saves are asynchronous past a copy. ``save_kv_layer`` copies each planned block out of the paged
cache in the backend's own layout (one gather per layer: an ``index_select`` memcpy on CPU; on a
GPU the blocks' index uploaded from pinned memory, a gather and a device-to-host copy into pinned
memory, all queued on the forward's stream with an event after them, so the forward never waits
for a layer's copy: a sync per layer would stall the GPU's queue L or 2L times a step);
``wait_for_save`` hands the step's copies to one writer thread, which waits for each copy's event,
turns the copies into canonical blocks (numpy) and puts them in the store, in order, while vLLM
samples and returns the first token. The copy is ordered inside the step (stream order puts it
before any later write to the cache), so a block freed or reused afterwards (a finished, aborted or
preempted request) cannot change what is saved, and vLLM frees blocks at once. Readers learn a
block is there by its key (``BlockStore.contains``); the gateway waits for a turn's tail keys
before the decode request (``Pins.await_tail_saves``). At most ``save_queue_bytes`` of copies wait
for the writer; a step beyond that waits in ``wait_for_save`` (backpressure). A put the store
refuses leaves the block missing and its readers recompute it.

The paged layout is chosen and checked in ``register_kv_caches`` (an unsupported backend or shape
fails the engine's start with ``KVLayoutError``); any error while loading or saving a step's blocks
is logged and turns into missing blocks, never into an exception that would end the engine.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tandem.cloud.engines.connector.metadata import ConnectorSettings, PartOp, TandemMetadata
from tandem.cloud.engines.kv_layout import HostCopy, KVLayoutError, Layout, canonical, layout_for
from tandem.common.protocol.errors import EngineError
from tandem.common.wire.kvblocks import LayerRange, block_nbytes

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext

    from tandem.cloud.store.blocks import BlockStore

log = logging.getLogger("tandem.connector")
_LAYER_RE = re.compile(r"\.layers\.(\d+)\.")


class TandemConnectorWorker:
    """Loads and saves the planned blocks of each step; owns the writer thread and its queue."""

    def __init__(self, settings: ConnectorSettings, store: BlockStore, vllm_config: VllmConfig) -> None:
        self.block_size = settings.block_size
        self.layer_offset = settings.layer_offset
        self.num_kv_heads = settings.num_kv_heads
        self.head_dim = settings.head_dim
        self.store = store
        self._vllm_config = vllm_config
        self._load_errors: set[int] = set()
        # this step's copies: (global layer, the ops it serves, native blocks [n, ...] in op order)
        self._staged: list[tuple[int, list[PartOp], HostCopy]] = []
        self._save_queue_bytes = settings.save_queue_bytes
        self._writer: ThreadPoolExecutor | None = None
        self._pending: deque[tuple[Future[None], int]] = deque()  # submitted jobs and their bytes
        self._pending_bytes = 0
        self._pending_lock = threading.Lock()
        self._layout: Layout | None = None  # chosen in register_kv_caches (or at the first cache seen)

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

    def start_load_kv(self, meta: TandemMetadata, forward_context: ForwardContext) -> None:
        """Copy this step's planned blocks from the store into vLLM's paged cache. Never raises:
        blocks that could not be written are reported as load errors and vLLM recomputes them."""
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

    def save_kv_layer(self, meta: TandemMetadata, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Copy this layer's slice of every block planned for saving this step (one gather, in the
        backend's layout, queued on the step's stream: ``kv_layout.HostCopy``); the writer thread
        waits for it, makes the blocks canonical and stores them. ``kv_layer``: the layer's paged
        cache, ``[num_blocks, Hkv, B, 2*D]``."""
        if not meta.saves:
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
        nbytes = sum(copy.nbytes for _, _, copy in staged)
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

    def _write(self, staged: list[tuple[int, list[PartOp], HostCopy]]) -> None:
        """Writer thread: each layer's copy waited for (``HostCopy.result``), then per key, in the
        order the step planned them, its layers' rows made one canonical block
        ``[Lp, 2, Hkv, B, D]`` float32, then its put: a prompt's first block is in the store while
        the later ones are still converted, so a reader that waits for them in order (remote
        prefill's downlink) starts at once. A key whose step did not copy every layer
        of its part (a forward that failed midway) is not written: a block is stored whole or not
        at all. A write the store refuses (a shared store out of reach) leaves the block missing:
        its readers recompute it. Never raises."""
        try:
            layout = self._layout
            if layout is None:
                raise KVLayoutError("no KV layout registered")
            rows: dict[str, tuple[PartOp, dict[int, torch.Tensor]]] = {}  # key -> (op, {layer in part: row})
            for g, ops, copy in staged:
                for op, row in zip(ops, copy.result(), strict=True):
                    rows.setdefault(op.key, (op, {}))[1][g - op.part.lo] = row
            for key, (op, layers) in rows.items():
                n = op.part.num_layers
                if len(layers) != n:
                    log.warning("tandem connector: KV block %s has %d of %d layers; not saved", key, len(layers), n)
                    continue
                block = layout.from_snapshot(canonical(torch.stack([layers[i] for i in range(n)])))
                self.store.put(key, block.tobytes())
        except EngineError as e:
            log.warning("tandem connector: saving KV blocks failed (%s); readers recompute them", e)
        except Exception:
            log.exception("tandem connector: saving KV blocks failed; readers recompute them")

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        if errors:
            log.warning("tandem connector: %d blocks missing from the store; vLLM recomputes them", len(errors))
        return errors
