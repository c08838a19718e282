"""Run the edge head (embedding + layers [0, k)) with ONNX Runtime, batched.

Who calls it: the edge daemon's head batcher, once per batch of requests, from
one worker thread (an ``InferenceSession`` is thread-safe for ``run``, but the
edge serialises calls so one batch uses all intra-op threads).

Buffers: ``HeadOutput`` arrays are owned by the caller once returned; the runner
keeps nothing between calls. Shapes use the notation of ``common.model.head_model``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tandem.common.model.head_io import io_names
from tandem.common.protocol.errors import InvalidRequest
from tandem.common.protocol.manifest import SplitManifest


@dataclass(frozen=True)
class HeadInput:
    """One row of a head batch.

    token_ids: the new tokens, int ``[T]``.
    past_kv: the session's head KV so far, float32 ``[k, 2, Hkv, P, D]`` (K then V), or None.
    """

    token_ids: np.ndarray
    past_kv: np.ndarray | None = None

    @property
    def past_tokens(self) -> int:
        return 0 if self.past_kv is None else int(self.past_kv.shape[3])


@dataclass(frozen=True)
class HeadOutput:
    """hidden: float32 ``[T, H]`` (HF ``hidden_states[k]`` of the new tokens);
    kv: float32 ``[k, 2, Hkv, P+T, D]``, the session's head KV including the new tokens."""

    hidden: np.ndarray
    kv: np.ndarray


def check_row(row: HeadInput, manifest: SplitManifest) -> None:
    """``row`` fits the head of ``manifest``: token ids a non-empty 1-D integer array of ids in
    ``[0, V)``, past KV None or float32 ``[k, 2, Hkv, P, D]``.

    Raises:
        InvalidRequest: otherwise (the message gives the actual shape, dtype or id).
    """
    k, s = manifest.split_layer, manifest.shape
    ids = row.token_ids
    if ids.ndim != 1 or ids.shape[0] == 0:
        raise InvalidRequest(f"token_ids must be a non-empty 1-D array, got shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise InvalidRequest(f"token_ids must be integers, got {ids.dtype}")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= s.vocab_size:
        raise InvalidRequest(f"token id {lo if lo < 0 else hi} is outside the vocabulary [0, {s.vocab_size})")
    if row.past_kv is not None:
        want = (k, 2, s.num_kv_heads, s.head_dim)
        got = row.past_kv.shape
        if row.past_kv.ndim != 5 or (got[0], got[1], got[2], got[4]) != want or row.past_kv.dtype != np.float32:
            raise InvalidRequest(
                f"past_kv must be float32 [{k}, 2, {s.num_kv_heads}, P, {s.head_dim}], got {row.past_kv.dtype} {got}"
            )


def session_options(intra_op_threads: int = 0):
    """ONNX Runtime session options of every edge model: full graph optimization, and intra-op
    threads that sleep when idle. ONNX Runtime's default lets them spin-wait after each run, which
    on a host it shares (the edge's other models, a co-located cloud) steals the cores of whatever
    runs next: with spinning threads, the benchmark's requests right after a local-mode request are 7-33%
    slower."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = intra_op_threads
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return opts


def default_providers() -> list[str]:
    """CUDA first where onnxruntime-gpu offers it, then CPU."""
    import onnxruntime as ort

    avail = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in avail]


def with_cuda_options(
    providers: Sequence[Any], set_options: dict[str, str] | None = None, defaults: dict[str, str] | None = None
) -> list[Any]:
    """``providers`` (names, or ``(name, options)`` pairs, as ONNX Runtime takes them) with the CUDA
    provider's options: ``defaults`` where the caller gave none of its own, ``set_options`` over
    everything. Other providers, and the caller's dicts, are left as given."""
    out: list[Any] = []
    for p in providers:
        name, given = (p[0], p[1]) if isinstance(p, tuple) else (p, {})
        if name != "CUDAExecutionProvider":
            out.append(p)
        else:
            out.append((name, {**(defaults or {}), **given, **(set_options or {})}))
    return out


def without_tf32(providers: list[Any]) -> list[Any]:
    """``providers`` with ONNX Runtime's CUDA provider told to run float32 MatMuls in float32
    (``use_tf32`` 0; its default rounds their inputs to TF32's 10-bit mantissa): a float32 graph
    on the GPU then computes what vLLM's float32 engines do. Other providers, and a CUDA entry that
    sets ``use_tf32`` itself, are left as given."""
    return with_cuda_options(providers, defaults={"use_tf32": "0"})


class OnnxHead:
    """The exported head in an ONNX Runtime ``InferenceSession``."""

    def __init__(self, split_dir: Path, providers: list[str] | None = None, intra_op_threads: int = 0):
        import onnxruntime as ort

        self.manifest = SplitManifest.load(split_dir)
        s = self.manifest.shape
        self.k, self.hkv, self.d, self.h = self.manifest.split_layer, s.num_kv_heads, s.head_dim, s.hidden_size
        opts = session_options(intra_op_threads)
        path = self.manifest.resolve(split_dir, self.manifest.head_onnx)
        self.session = ort.InferenceSession(str(path), opts, providers=without_tf32(providers or default_providers()))
        self._inputs, self._outputs = io_names(self.k)

    @property
    def providers(self) -> list[str]:
        return self.session.get_providers()

    def _check(self, row: HeadInput) -> None:
        check_row(row, self.manifest)

    def run(self, rows: list[HeadInput]) -> list[HeadOutput]:
        """Run one batch of rows of different new/past lengths in one ONNX Runtime call.

        Rows are packed as ``[past (padded to max P) | new (padded to max T)]`` per row; padded
        slots are masked out, so each row's result equals running it alone (up to fp32 rounding).

        Raises:
            InvalidRequest: a row's token ids or past KV have the wrong shape or dtype.
        """
        if not rows:
            return []
        for r in rows:
            self._check(r)
        if len(rows) == 1:
            return [self._run_one(rows[0])]
        bt = len(rows)
        t_max = max(r.token_ids.shape[0] for r in rows)
        p_max = max(r.past_tokens for r in rows)
        ids = np.zeros((bt, t_max), np.int64)
        pos = np.zeros((bt, t_max), np.int64)
        mask = np.zeros((bt, p_max + t_max), np.int64)
        past = np.zeros((self.k, 2, bt, self.hkv, p_max, self.d), np.float32)
        for b, r in enumerate(rows):
            t, p = r.token_ids.shape[0], r.past_tokens
            ids[b, :t] = r.token_ids
            pos[b, :t] = np.arange(p, p + t)
            pos[b, t:] = p + t - 1  # any in-range position; padded queries are discarded
            mask[b, :p] = 1
            mask[b, p_max : p_max + t] = 1
            if p:
                past[:, :, b, :, :p] = r.past_kv
        feeds = {"input_ids": ids, "position_ids": pos, "attention_mask": mask}
        for i in range(self.k):
            feeds[f"past_key_{i}"] = past[i, 0]
            feeds[f"past_value_{i}"] = past[i, 1]
        hidden, *presents = self.session.run(self._outputs, feeds)
        # presents: 2k arrays [Bt, Hkv, P_max + T_max, D]
        stacked = np.stack(presents).reshape(self.k, 2, bt, self.hkv, p_max + t_max, self.d)
        out = []
        for b, r in enumerate(rows):
            t, p = r.token_ids.shape[0], r.past_tokens
            kv = np.concatenate([stacked[:, :, b, :, :p], stacked[:, :, b, :, p_max : p_max + t]], axis=3)
            out.append(HeadOutput(hidden=np.ascontiguousarray(hidden[b, :t]), kv=np.ascontiguousarray(kv)))
        return out

    def _run_one(self, r: HeadInput) -> HeadOutput:
        """One row without the batch's padding: the past KV goes in as views of ``r.past_kv`` and
        the presents come out in one copy, so a pipelined head's pieces (each re-reading the KV
        before it) copy that KV once per piece rather than four times."""
        t, p = r.token_ids.shape[0], r.past_tokens
        feeds: dict[str, np.ndarray] = {
            "input_ids": r.token_ids.astype(np.int64, copy=False)[None],
            "position_ids": np.arange(p, p + t, dtype=np.int64)[None],
            "attention_mask": np.ones((1, p + t), np.int64),
        }
        empty = np.zeros((1, self.hkv, 0, self.d), np.float32)
        for i in range(self.k):
            feeds[f"past_key_{i}"] = r.past_kv[i, 0][None] if r.past_kv is not None else empty
            feeds[f"past_value_{i}"] = r.past_kv[i, 1][None] if r.past_kv is not None else empty
        hidden, *presents = self.session.run(self._outputs, feeds)
        kv = np.stack([x[0] for x in presents]).reshape(self.k, 2, self.hkv, p + t, self.d)
        return HeadOutput(hidden=np.ascontiguousarray(hidden[0]), kv=kv)


class HeadRunner(Protocol):
    """Seam between the edge service and the head (``OnnxHead``: tandem's torch.onnx export;
    ``edge.compute.builder_head.BuilderHead``: the model builder's graph; ``MemoryHead``: tests).

    Who calls: ``edge.compute.batcher.HeadBatcher``, once per batch, from one worker thread.
    ``run`` returns one ``HeadOutput`` per row, in order, owned by the caller;
    raises InvalidRequest for a malformed row. ``k`` is the split layer.
    """

    k: int

    def run(self, rows: list[HeadInput]) -> list[HeadOutput]: ...


class MemoryHead:
    """In-memory double of the head for unit tests: deterministic, causal, incremental.

    ``hidden[t]`` and the K/V of token ``t`` are pseudo-random functions of (token id,
    position), so a second turn fed the first turn's ``kv`` gives the same values as one
    call over the whole prompt, as the real head does. Shapes as ``OnnxHead``.
    """

    def __init__(self, k: int, hidden_size: int, num_kv_heads: int, head_dim: int) -> None:
        self.k, self.h, self.hkv, self.d = k, hidden_size, num_kv_heads, head_dim

    def _rows(self, ids: np.ndarray, start: int, width: int) -> np.ndarray:
        out = np.empty((len(ids), width), np.float32)
        for i, t in enumerate(ids):
            out[i] = np.random.default_rng([int(t), start + i, width]).standard_normal(width)
        return out

    def run(self, rows: list[HeadInput]) -> list[HeadOutput]:
        outs = []
        for r in rows:
            if r.token_ids.ndim != 1 or r.token_ids.shape[0] == 0:
                raise InvalidRequest(f"token_ids must be a non-empty 1-D array, got shape {r.token_ids.shape}")
            p, t = r.past_tokens, r.token_ids.shape[0]
            hidden = self._rows(r.token_ids, p, self.h)
            new = self._rows(r.token_ids, p, self.k * 2 * self.hkv * self.d)  # [T, k*2*Hkv*D]
            new_kv = new.reshape(t, self.k, 2, self.hkv, self.d).transpose(1, 2, 3, 0, 4)
            kv = new_kv if r.past_kv is None else np.concatenate([r.past_kv, new_kv], axis=3)
            outs.append(HeadOutput(hidden=hidden, kv=np.ascontiguousarray(kv)))
        return outs
