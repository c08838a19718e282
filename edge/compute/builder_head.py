"""The split head as ONNX Runtime GenAI's model builder writes it (``common.model.builder_head``),
run as a ``HeadRunner``: what ``edge.compute.head.OnnxHead`` returns, from the builder's graph.

The graph is driven by ``edge.compute.decoder.DecoderGraph`` (its spec, slots and binding): each row
takes a slot (a KV buffer per layer of at least ``P + T`` tokens, bound as past and present at
once), its past KV is written into the slot, the new tokens run after it (``run_rows`` of the
graph's ``hidden`` output) and the slot's KV comes back whole; the slot then goes back to the
graph's free slots for the next row. No CUDA graph: a head call's length varies.

Rows run one after another, each in its own ONNX Runtime call: the builder's attention
(``GroupQueryAttention``) takes each row's length from the mask, but its CUDA kernel refuses a
batch of more than one row with past KV and more than one new token, which is what a batch of
turns is; one path on every provider. A batch of ``n`` rows is ``n`` calls; the head batcher's rows
still share one worker-thread hop.

Who calls it: ``edge.compute.batcher.HeadBatcher``, once per batch, from one worker thread (the
graph's slots are not shared between threads). Shapes as ``edge.compute.head``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from tandem.common.model.builder_head import HIDDEN, head_problem
from tandem.common.protocol.manifest import SplitManifest
from tandem.edge.compute.head import HeadInput, HeadOutput, HeadRunner, OnnxHead, check_row
from tandem.edge.compute.prefill import PrefillPlan

log = logging.getLogger(__name__)


class BuilderHead:
    """The builder's head of one split directory in a ``DecoderGraph``."""

    def __init__(
        self,
        split_dir: Path,
        providers: list[Any] | None = None,
        intra_op_threads: int = 0,
        prefill: PrefillPlan | None = None,
    ) -> None:
        """``prefill``: the graph's prefill shapes (``DecoderGraph``; None: its default).

        Raises:
        ValueError: the manifest names no builder head, the head failed its check
            (``builder_head.head_problem``), or its graph's shape is not the manifest's.
        What ``DecoderGraph`` raises for a bad folder or file."""
        from tandem.edge.compute.decoder import DecoderGraph

        self.manifest = SplitManifest.load(split_dir)
        m, s = self.manifest, self.manifest.shape
        self.k, self.hkv, self.d, self.h = m.split_layer, s.num_kv_heads, s.head_dim, s.hidden_size
        path = builder_head_path(split_dir, m)
        if path is None:
            raise ValueError(f"{split_dir}: no builder head ({m.builder_head_note or 'none was built'})")
        problem = head_problem(path, self.k)
        if problem:
            raise ValueError(problem)
        self.path = path
        self.graph = DecoderGraph(path, providers, intra_op_threads, cuda_graph=False, prefill=prefill)
        g = self.graph.spec
        got = (g.num_layers, g.num_kv_heads, g.head_dim, g.hidden_size)
        if got != (self.k, self.hkv, self.d, self.h):
            raise ValueError(
                f"{path}: a head of (layers, Hkv, D, H) {got}, the manifest says {(self.k, self.hkv, self.d, self.h)}"
            )

    @property
    def providers(self) -> list[str]:
        return self.graph.providers

    def warm_prefills(self) -> list[int]:
        """Run each of the graph's padded prefill lengths once (``DecoderGraph.warm_prefills``),
        then free the slots it left as spares (a head's graph has no memory bound, and an edge
        that rarely splits would otherwise keep one slot of every capacity); call it before the
        head serves, from the thread that runs it. Returns the capacities warmed."""
        caps = self.graph.warm_prefills()
        self.graph.trim()
        return caps

    def run(self, rows: list[HeadInput]) -> list[HeadOutput]:
        """Each row alone, in order (see the module: one ONNX Runtime call per row); every row is
        checked before any runs.

        Raises:
            InvalidRequest: a row's token ids or past KV have the wrong shape, dtype or values
                (``head.check_row``), or its ``P + T`` exceeds the graph's positions.
        """
        for r in rows:
            check_row(r, self.manifest)
        return [self._run_one(r) for r in rows]

    def _run_one(self, r: HeadInput) -> HeadOutput:
        """One row: past KV into a slot, the new tokens after it, hidden ``[T, H]`` and the slot's
        KV ``[k, 2, Hkv, P + T, D]`` back as float32."""
        g = self.graph
        p, t = r.past_tokens, int(r.token_ids.shape[0])
        slot = g.new_kv(p + t)
        try:
            if r.past_kv is not None and p:
                g.write_kv(slot, [r.past_kv[i, j][None] for i in range(self.k) for j in (0, 1)])
            hidden = g.run_rows(slot, [int(x) for x in r.token_ids], HIDDEN)  # [T, H]
            kv = g.read_kv(slot)  # 2k x [1, Hkv, P + T, D], key then value per layer
        finally:
            g.release(slot)
        kv_all = np.stack(kv).reshape(self.k, 2, self.hkv, p + t, self.d)
        return HeadOutput(hidden=np.ascontiguousarray(hidden), kv=kv_all)


def builder_head_path(split_dir: Path, manifest: SplitManifest) -> Path | None:
    """The builder head's folder the manifest names, resolved, or None when it names none."""
    return manifest.resolve(split_dir, manifest.builder_head) if manifest.builder_head else None


def open_head(
    split_dir: Path, builder: bool = True, intra_op_threads: int = 0, prefill: PrefillPlan | None = None
) -> HeadRunner:
    """The head of ``split_dir``: with ``builder``, the model builder's (``BuilderHead``, its
    ``prefill`` shapes) where the manifest names one that passed its check, else tandem's torch.onnx
    export (``OnnxHead``). Which one is logged, and why not the builder's: at info level where the
    manifest names none (the reason preparation recorded, or none tried), as a warning where the one
    it names cannot serve (missing, failed its check, another shape)."""
    why = "builder_head is off"
    if builder:
        manifest = SplitManifest.load(split_dir)
        why = manifest.builder_head_note or "no builder head was prepared (tandem-model builds one)"
        if manifest.builder_head:
            try:
                head = BuilderHead(split_dir, intra_op_threads=intra_op_threads, prefill=prefill)
            except (ValueError, FileNotFoundError) as e:
                log.warning("split %s: the torch.onnx head (head.onnx): %s", split_dir, e)
                return OnnxHead(split_dir, intra_op_threads=intra_op_threads)
            log.info("split %s: the model builder's head (%s)", split_dir, head.path)
            return head
    log.info("split %s: the torch.onnx head (head.onnx): %s", split_dir, why)
    return OnnxHead(split_dir, intra_op_threads=intra_op_threads)
