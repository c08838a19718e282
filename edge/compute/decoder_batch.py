"""The bookkeeping of batched decode steps over ``edge.compute.decoder.DecoderGraph``: which session occupies
which row of a batch pool, which batch size a step runs at, and the device copies that move KV
between a session's own buffers and a pool row.

A batch pool (``edge.compute.decoder.BatchPool``) holds, per layer, one buffer ``[R, Hkv, C, D]`` for the
sessions of one capacity ``C`` that decode together; its occupied rows are ``[0, n)`` (a row that is
freed takes the last row's session, ``RowTable.remove``), and a step runs over the first
``bucket_rows(n)`` rows, a power of two, so that a CUDA graph captured per bucket replays on fixed
buffers. ``RowTable`` is pure bookkeeping (no ONNX Runtime); ``KVCopier`` runs the copies.

Memory: ``KVMemory`` counts the bytes a ``DecoderGraph`` holds against its bound and words the
refusal; ``shrink_rows`` is the rule by which an idle pool gives rows back (freed when empty).

Not here: the runs themselves, masks, CUDA graphs (``edge.compute.decoder``); scheduling (``edge.compute.local``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

from tandem.common.protocol.errors import QuotaExceeded

M = TypeVar("M")

IDLE_STEPS = 2  # a session in a pool row that misses this many batched steps in a row goes back to its own buffers
MIN_POOL_ROWS = 1  # a batch pool starts with the rows of its first step (at least these); it doubles when full
IDLE_S = 60.0  # seconds a pool goes without a step that needs all its rows before it shrinks (freed when empty),
# and a spare waits unused before it is freed: a lull between bursts keeps both (and their CUDA graphs)


def bucket_rows(n: int) -> int:
    """The rows a step over ``n`` occupied rows runs at: the power of two ``>= n`` (1, 2, 4, 8 ...).

    Raises:
        ValueError: ``n < 1``."""
    if n < 1:
        raise ValueError(f"a batched step needs at least one row, got {n}")
    return 1 << (n - 1).bit_length()


def shrink_rows(members: int, rows: int) -> int | None:
    """The rows a pool of ``rows`` rows holding ``members`` sessions shrinks to: 0 (freed) with no
    member, else the rows a step over them runs at (at least ``MIN_POOL_ROWS``) where that is
    fewer; None where it cannot shrink.

    Raises:
        ValueError: ``members`` beyond ``rows``, or negative."""
    if not 0 <= members <= rows:
        raise ValueError(f"a pool of {rows} rows cannot hold {members} members")
    if members == 0:
        return 0
    need = max(MIN_POOL_ROWS, bucket_rows(members))
    return need if need < rows else None


class KVMemory:
    """The bytes of KV buffers (and their step buffers) one ``DecoderGraph`` holds, against
    ``max_bytes`` (None: no bound). The graph reports every allocation (``took``) and every free
    (``freed``); it asks ``fits`` before allocating and raises ``refusal`` when, even after freeing
    what it may, a buffer does not fit. Pure bookkeeping: it frees nothing itself."""

    def __init__(self, max_bytes: int | None = None) -> None:
        """Raises:
        ValueError: ``max_bytes`` < 1."""
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"a KV memory bound must be at least 1 byte, got {max_bytes}")
        self.max_bytes = max_bytes
        self.held_bytes = 0

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more stay within the bound."""
        return self.max_bytes is None or self.held_bytes + nbytes <= self.max_bytes

    def took(self, nbytes: int) -> None:
        self.held_bytes += nbytes

    def freed(self, nbytes: int) -> None:
        """Raises:
        ValueError: more freed than held (a buffer counted twice)."""
        if nbytes > self.held_bytes:
            raise ValueError(f"{nbytes} bytes freed, {self.held_bytes} held")
        self.held_bytes -= nbytes

    def refusal(self, nbytes: int) -> QuotaExceeded:
        """The error for ``nbytes`` that do not fit (maps to RESOURCE_EXHAUSTED / HTTP 429)."""
        return QuotaExceeded(
            f"the local model's KV memory is used up: {self.held_bytes} of {self.max_bytes} bytes held "
            f"(local_kv_bytes), {nbytes} more needed"
        )


class RowTable(Generic[M]):
    """Which member (a session's KV) occupies which row of one pool; rows ``[0, n)`` are occupied.

    Who calls: ``DecoderGraph`` (from the engine's one worker thread). Members are compared by
    identity. ``missed`` counts, per row, the batched steps its member sat out in a row.
    """

    def __init__(self) -> None:
        self._members: list[M] = []
        self._rows: dict[int, int] = {}  # id(member) -> row
        self.missed: list[int] = []

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, m: object) -> bool:
        return id(m) in self._rows

    def members(self) -> list[M]:
        """The members in row order."""
        return list(self._members)

    def row(self, m: M) -> int:
        """The row ``m`` occupies.

        Raises:
            KeyError: ``m`` occupies no row."""
        return self._rows[id(m)]

    def add(self, m: M) -> int:
        """Put ``m`` in the first free row (``len(self)`` before the call) and return it.

        Raises:
            ValueError: ``m`` already occupies a row."""
        if id(m) in self._rows:
            raise ValueError("a member occupies one row at most")
        self._rows[id(m)] = len(self._members)
        self._members.append(m)
        self.missed.append(0)
        return self._rows[id(m)]

    def remove(self, m: M) -> tuple[int, int] | None:
        """Free ``m``'s row; the last row's member moves into it. Returns ``(from_row, to_row)`` of
        that move (the caller copies the KV), or None when ``m`` was in the last row.

        Raises:
            KeyError: ``m`` occupies no row."""
        row = self._rows.pop(id(m))
        last = len(self._members) - 1
        moved = self._members.pop()
        missed = self.missed.pop()
        if row == last:
            return None
        self._members[row] = moved
        self.missed[row] = missed
        self._rows[id(moved)] = row
        return last, row

    def step(self, stepping: Sequence[M]) -> list[M]:
        """Count one batched step in which ``stepping`` (members all) ran: their counts reset, the
        others' grow. Returns the members that have now sat out ``IDLE_STEPS`` steps in a row."""
        ids = {id(m) for m in stepping}
        for i, m in enumerate(self._members):
            self.missed[i] = 0 if id(m) in ids else self.missed[i] + 1
        return [m for i, m in enumerate(self._members) if self.missed[i] >= IDLE_STEPS]


class KVCopier:
    """Device copies of KV byte ranges, all of one call in one ONNX Runtime run: a graph of as many
    ``Identity`` nodes over uint8 ``[N]`` tensors as ranges (one graph per count, built once), each
    input and output bound by address, so the bytes stay on the device (CUDA: a device-to-device
    copy each; the CPU: a memcpy each).

    Who calls: ``DecoderGraph`` (growth, a session joining or leaving a pool, a pool growing).
    """

    def __init__(self, providers: list[Any], device: str) -> None:
        self.providers = [(p if isinstance(p, str) else p[0]) for p in providers]  # no CUDA graph for copies
        self.device = device
        self._sessions: dict[int, Any] = {}

    def _session(self, pairs: int) -> Any:
        if pairs not in self._sessions:
            import onnxruntime as ort
            from onnx import TensorProto, helper

            nodes = [helper.make_node("Identity", [f"x{i}"], [f"y{i}"]) for i in range(pairs)]
            ins = [helper.make_tensor_value_info(f"x{i}", TensorProto.UINT8, [f"n{i}"]) for i in range(pairs)]
            outs = [helper.make_tensor_value_info(f"y{i}", TensorProto.UINT8, [f"n{i}"]) for i in range(pairs)]
            graph = helper.make_graph(nodes, "kv_copy", ins, outs)
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
            model.ir_version = 8
            opts = ort.SessionOptions()
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            self._sessions[pairs] = ort.InferenceSession(model.SerializeToString(), opts, providers=self.providers)
        return self._sessions[pairs]

    def copy(self, ranges: Sequence[tuple[int, int, int]]) -> None:
        """Copy each ``(src_address, dst_address, nbytes)`` on the device; ranges of 0 bytes are
        skipped. Sources and destinations must not overlap."""
        import numpy as np

        todo = [r for r in ranges if r[2] > 0]
        if not todo:
            return
        b = self._session(len(todo)).io_binding()
        for i, (src, dst, n) in enumerate(todo):
            b.bind_input(f"x{i}", self.device, 0, np.uint8, [n], src)
            b.bind_output(f"y{i}", self.device, 0, np.uint8, [n], dst)
        self._session(len(todo)).run_with_iobinding(b)
