"""The whole model under the edge's local engine (``edge.compute.local.LocalEngine``): one interface, two
runtimes.

``LocalModel`` is the seam: a session's KV is an opaque ``SessionKV`` the model allocates, runs new
tokens into in place, truncates, reads out and writes into. Its implementations:

* ``edge.compute.decoder.DecoderGraph``: ONNX Runtime GenAI's builder graph (``edge-decoder/`` of
  ``tandem-model``), KV preallocated per session and bound as past and present, the decode step a
  CUDA graph on a GPU: the runtime local mode and remote prefill use where the model was built so.
* ``OnnxForward``: tandem's torch.onnx export ``edge-full.onnx`` (``common.model.prepare``), one run per
  call over growing KV tensors; kept for models prepared without the builder. ``ForwardModel`` is
  its KV bookkeeping over any ``forward(new_ids, past)`` (the tests' toy model uses it too).
* ``MemoryModel``: the in-memory implementation (tokens a hash of the history, a set run time),
  for the engine's unit tests and the benchmark of the engine's own cost per step.

Calling contract: the engine calls every method from its one worker thread
(``edge.compute.stepper``), so runs never overlap; a ``SessionKV`` belongs to one session and is
released once. Where ``batched_decode`` is set, the engine computes concurrent turns' decode steps
with one ``run_batch`` per step; otherwise with one ``run`` each.

Shapes: ``L`` layers, ``Hkv`` KV heads, ``D`` head dim, ``T`` tokens held, ``V`` vocabulary; KV
read and written as ``2L`` float32 host arrays ``[1, Hkv, T, D]``, key then value per layer.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from tandem.common.model.head_io import io_names
from tandem.common.protocol.errors import InvalidRequest
from tandem.common.protocol.manifest import ModelShape
from tandem.edge.compute.localkv import KV, host_kv, kv_nbytes, kv_prefix


@dataclass(frozen=True)
class Draw:
    """One sampled token's parameters and its draw, for a model that samples on its device: vLLM's
    ``temperature`` (``> 0``), ``top_k`` (0: all), ``top_p`` (1: all) and ``uniform``, float32 in
    ``[0, 1)`` drawn from the turn's generator (``edge.compute.local.draw_uniform``)."""

    temperature: float
    top_k: int
    top_p: float
    uniform: float


class SessionKV(Protocol):
    """One session's KV as its model holds it; ``tokens``: how many tokens' KV it holds (the engine
    reads it; the model alone changes it)."""

    @property
    def tokens(self) -> int: ...

    def nbytes(self) -> int:
        """Bytes this session's KV holds now (what the session table's byte bound counts)."""
        ...


class LocalModel(Protocol):
    """The whole model a ``LocalEngine`` drives (module doc: who calls, how often).

    ``batched_decode``: ``run_batch`` computes several sessions' decode steps in one run (the
    engine then gathers concurrent turns' steps); False: it runs them one after the other and the
    engine runs each step as a job of its own. A model with ``thread_bound`` True (read with a
    False default) must be run from one thread for its whole life (``DecoderGraph``'s CUDA graphs);
    the engine's thread then never ends while the engine lives."""

    providers: list[str]
    batched_decode: bool

    def new_kv(self, tokens_hint: int) -> SessionKV:
        """An empty session KV, sized for about ``tokens_hint`` tokens (it grows as needed)."""
        ...

    def run(
        self, kv: Any, new_ids: list[int], greedy: bool, draw: Draw | None = None
    ) -> tuple[int | None, np.ndarray | None, float]:
        """Compute ``new_ids`` after the ``kv.tokens`` held, in place (``kv.tokens`` grows by
        ``len(new_ids)``). Returns the token of the last row the model computes itself (else None):
        the argmax when ``greedy``, the sample at ``draw`` otherwise (where it samples on its
        device); the last row's logits float32 ``[V]`` when no token is returned (else None); and
        the run's time in ms. A run that raises leaves ``kv.tokens`` as it was.

        Raises:
            InvalidRequest: the KV cannot grow to ``kv.tokens + len(new_ids)`` tokens.
        """
        ...

    def run_batch(
        self,
        kvs: Sequence[Any],
        token_ids: Sequence[int],
        greedy: Sequence[bool],
        draws: Sequence[Draw | None] | None = None,
    ) -> tuple[list[int | None], list[np.ndarray | None], float]:
        """One decode step per session KV: ``token_ids[i]`` after ``kvs[i].tokens`` (each grows by
        one), ``draws[i]`` its draw where not greedy. Returns per KV what ``run`` returns for it
        (token or None, logits or None) and the whole run's time in ms.

        Raises:
            InvalidRequest: lengths that differ, a KV twice, or a KV that cannot grow by one token;
                nothing changes then.
        """
        ...

    def truncate(self, kv: Any, tokens: int) -> None:
        """Keep the KV of the first ``tokens`` tokens held."""
        ...

    def read_kv(self, kv: Any, tokens: int | None = None) -> list[np.ndarray]:
        """The KV of the first ``tokens`` (default: all) as ``2L`` float32 host arrays (copies)."""
        ...

    def write_kv(self, kv: Any, past: Sequence[np.ndarray], start: int = 0) -> None:
        """Hold ``past`` (``2L`` float32 ``[1, Hkv, T, D]``) after the first ``start`` tokens held:
        afterwards ``kv.tokens == start + T``.

        Raises:
            InvalidRequest: ``past`` is not ``2L`` arrays of the model's shape, ``start`` exceeds
                the tokens held, or the KV cannot hold ``start + T`` tokens.
        """
        ...

    def release(self, kv: Any) -> None:
        """The session is gone: its buffers may serve another session."""
        ...


@runtime_checkable
class BoundedKVModel(Protocol):
    """A ``LocalModel`` whose KV memory has a bound (``edge.compute.decoder.DecoderGraph``): what
    ``LocalEngine.check_fits`` asks before a turn runs."""

    @property
    def max_kv_bytes(self) -> int | None:
        """The bound on every KV buffer held, in bytes; None: unbounded."""
        ...

    def turn_kv_bytes(self, tokens: int) -> int:
        """Bytes one session of ``tokens`` tokens needs alone: those of its slot of
        ``turn_capacity_tokens(tokens)`` tokens, what it really holds."""
        ...

    def turn_capacity_tokens(self, tokens: int) -> int:
        """The capacity (tokens) of the KV slot a session of ``tokens`` tokens holds: ``tokens``
        rounded up to a slot size."""
        ...

    def max_turn_tokens(self) -> int:
        """The most tokens one session can hold within ``max_kv_bytes`` with nothing else held."""
        ...


@dataclass
class GrowingKV:
    """``ForwardModel``'s session KV: ``2L`` tensors ``[1, Hkv, T, D]`` (numpy, or ``OrtValue`` on
    the device), replaced by each run, never written in place."""

    past: list[KV] = field(default_factory=list)
    tokens: int = 0

    def nbytes(self) -> int:
        return sum(kv_nbytes(a) for a in self.past)


class ForwardModel(ABC):
    """``LocalModel`` over a ``forward(new_ids, past) -> (logits [V], present, ms)`` whose present KV
    is new tensors over every token (past and new). Subclasses set ``shape`` and ``providers`` and
    implement ``forward``."""

    shape: ModelShape
    providers: list[str]
    batched_decode = False  # one forward pass per session

    @abstractmethod
    def forward(self, new_ids: Sequence[int], past: list[KV]) -> tuple[np.ndarray, list[KV], float]:
        """One run over ``new_ids`` after ``past``: the last row's logits float32 ``[V]``, the KV of
        every token (new tensors) and the run's time in ms."""

    def empty_past(self) -> list[KV]:
        """``2L`` float32 arrays ``[1, Hkv, 0, D]``."""
        s = self.shape
        return [np.zeros((1, s.num_kv_heads, 0, s.head_dim), np.float32) for _ in range(2 * s.num_layers)]

    def new_kv(self, tokens_hint: int) -> GrowingKV:
        return GrowingKV()

    def run(
        self, kv: GrowingKV, new_ids: list[int], greedy: bool, draw: Draw | None = None
    ) -> tuple[int | None, np.ndarray | None, float]:
        logits, present, ms = self.forward(new_ids, kv.past if kv.tokens else self.empty_past())
        kv.past, kv.tokens = present, kv.tokens + len(new_ids)
        return None, logits, ms

    def run_batch(
        self,
        kvs: Sequence[GrowingKV],
        token_ids: Sequence[int],
        greedy: Sequence[bool],
        draws: Sequence[Draw | None] | None = None,
    ) -> tuple[list[int | None], list[np.ndarray | None], float]:
        """``run`` of each KV in turn (no batched forward pass)."""
        if len(token_ids) != len(kvs) or len(greedy) != len(kvs) or len({id(k) for k in kvs}) != len(kvs):
            raise InvalidRequest(f"a batched step takes each KV once with one token: {len(kvs)}, {len(token_ids)}")
        out = [self.run(kv, [int(t)], g) for kv, t, g in zip(kvs, token_ids, greedy, strict=True)]
        return [o[0] for o in out], [o[1] for o in out], sum(o[2] for o in out)

    def truncate(self, kv: GrowingKV, tokens: int) -> None:
        tokens = max(0, min(tokens, kv.tokens))
        if tokens < kv.tokens:
            kv.past = kv_prefix(kv.past, tokens) if tokens else []
            kv.tokens = tokens

    def read_kv(self, kv: GrowingKV, tokens: int | None = None) -> list[np.ndarray]:
        n = kv.tokens if tokens is None else tokens
        if not kv.tokens:
            return [a[:, :, :0] for a in self.empty_past()]
        return [np.ascontiguousarray(host_kv(a)[:, :, :n]) for a in kv.past]

    def write_kv(self, kv: GrowingKV, past: Sequence[np.ndarray], start: int = 0) -> None:
        check_past(self.shape, past, start, kv.tokens)
        held = self.read_kv(kv, start) if start else None
        new = [np.ascontiguousarray(a, np.float32) for a in past]
        kv.past = [np.concatenate([h, a], axis=2) for h, a in zip(held, new, strict=True)] if held else new
        kv.tokens = start + int(past[0].shape[2])

    def release(self, kv: GrowingKV) -> None:
        kv.past, kv.tokens = [], 0


def check_past(
    shape: ModelShape, past: Sequence[np.ndarray], start: int = 0, held: int = 0, tokens: int | None = None
) -> None:
    """Raises: InvalidRequest: ``past`` is not ``2L`` float32 arrays ``[1, Hkv, T, D]`` of one ``T``
    (``tokens`` when given), or ``start`` exceeds ``held``."""
    t = (int(past[0].shape[2]) if len(past) else -1) if tokens is None else tokens
    want = (1, shape.num_kv_heads, t, shape.head_dim)
    if len(past) != 2 * shape.num_layers or any(a.shape != want or a.dtype != np.float32 for a in past):
        got = [getattr(a, "shape", None) for a in list(past)[:2]]
        raise InvalidRequest(f"past must be {2 * shape.num_layers} float32 arrays {want}, got {len(past)} like {got}")
    if not 0 <= start <= held:
        raise InvalidRequest(f"KV written after token {start}: the session holds {held}")


class OnnxForward(ForwardModel):
    """``edge-full.onnx`` (tandem's torch.onnx export: inputs and outputs named by
    ``common.model.head_io.io_names(L)``, ``logits`` float32 ``[1, V]`` of the last new token) in one ONNX
    Runtime session.

    Where the KV lives: on ONNX Runtime's CUDA provider the runs use IO binding (``kv_device``), so a
    session's KV stays in GPU memory (``OrtValue``) between runs, and only the logits of the last
    token come back to the host; on the CPU provider the KV is numpy arrays.
    """

    def __init__(
        self,
        onnx_path: Path,
        shape: ModelShape,
        intra_op_threads: int = 0,
        providers: Sequence[str] | None = None,
        kv_device: str = "auto",
    ) -> None:
        """``kv_device``: where the KV is kept between runs, through IO binding: ``"auto"`` (the GPU
        when the CUDA provider is active, else host numpy arrays without binding), ``"cuda"``,
        ``"cpu"`` (bound host tensors: the same code path, no GPU) or ``"none"``.

        Raises:
            ValueError: an unknown ``kv_device``, or ``"cuda"`` without the CUDA provider active.
            What ``onnxruntime.InferenceSession`` raises for a bad file.
        """
        import onnxruntime as ort

        from tandem.edge.compute.head import default_providers, session_options, without_tf32

        self.shape = shape
        names = without_tf32(list(providers or default_providers()))
        self.session = ort.InferenceSession(str(onnx_path), session_options(intra_op_threads), providers=names)
        self.providers = self.session.get_providers()
        if kv_device == "auto":
            kv_device = "cuda" if "CUDAExecutionProvider" in self.providers else "none"
        if kv_device not in ("cuda", "cpu", "none"):
            raise ValueError(f"kv_device {kv_device!r}: auto, cuda, cpu or none")
        if kv_device == "cuda" and "CUDAExecutionProvider" not in self.providers:
            raise ValueError(f"kv_device 'cuda' needs ONNX Runtime's CUDA provider; active: {self.providers}")
        self.kv_device = kv_device
        inputs, outputs = io_names(shape.num_layers)
        self._past_names = inputs[3:]
        self._out_names = ["logits", *outputs[1:]]

    def forward(self, new_ids: Sequence[int], past: list[KV]) -> tuple[np.ndarray, list[KV], float]:
        """One model run over ``new_ids`` (``t >= 1`` tokens) after ``past`` (``2L`` x ``[1, Hkv, P, D]``).

        Blocking; thread-safe (ONNX Runtime's ``run`` is). Returns the logits of the last new token,
        float32 ``[V]`` on the host; the KV of all ``P + t`` tokens, ``2L`` x float32
        ``[1, Hkv, P + t, D]`` (new tensors owned by the caller: ``OrtValue`` on ``kv_device`` when it
        binds, else numpy); and the run time in ms.
        """
        p, t = (int(past[0].shape[2]) if isinstance(past[0], np.ndarray) else int(past[0].shape()[2])), len(new_ids)
        feeds: dict[str, Any] = {
            "input_ids": np.asarray([new_ids], np.int64),
            "position_ids": np.arange(p, p + t, dtype=np.int64)[None],
            "attention_mask": np.ones((1, p + t), np.int64),
        }
        if self.kv_device != "none":
            return self._forward_bound(feeds, past)
        feeds.update(zip(self._past_names, (host_kv(a) for a in past), strict=True))
        t0 = time.perf_counter()
        logits, *present = self.session.run(self._out_names, feeds)
        return logits[0], present, (time.perf_counter() - t0) * 1e3

    def _forward_bound(self, feeds: dict[str, Any], past: list[KV]) -> tuple[np.ndarray, list[KV], float]:
        """``forward`` through IO binding: the past KV bound where it lives (a host array is copied
        to ``kv_device`` first), the present KV left by ONNX Runtime on ``kv_device``, the logits
        bound to the host."""
        import onnxruntime as ort

        b = self.session.io_binding()
        for name, arr in feeds.items():
            b.bind_cpu_input(name, arr)
        held: list[Any] = []  # the bound values (and the host arrays they wrap) stay alive until the run ends
        for name, a in zip(self._past_names, past, strict=True):
            v = (
                ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a), self.kv_device, 0)
                if isinstance(a, np.ndarray)
                else a
            )
            held.append(v)
            b.bind_ortvalue_input(name, v)
        b.bind_output("logits", "cpu")
        for name in self._out_names[1:]:
            b.bind_output(name, self.kv_device, 0)
        t0 = time.perf_counter()
        self.session.run_with_iobinding(b)
        logits, *present = b.get_outputs()
        return logits.numpy()[0], present, (time.perf_counter() - t0) * 1e3


HASH_MODULUS = 1 << 24  # a MemoryModel token's state: an integer exact in float32 (what its KV arrays hold)


@dataclass
class MemoryKV:
    """``MemoryModel``'s session KV: per token held, the state of the sequence up to it (a hash of
    its token ids, ``< HASH_MODULUS``); ``poisoned``: every run over it raises (a session whose
    state went bad)."""

    states: list[int] = field(default_factory=list)
    poisoned: bool = False

    @property
    def tokens(self) -> int:
        return len(self.states)

    def nbytes(self) -> int:
        return 8 * len(self.states)


class MemoryModel:
    """The in-memory ``LocalModel``: the next token is a hash of every token id held (so it depends
    on the whole history, as a real model's does), sampled ones shifted by their draw; a run takes
    ``step_ms`` (one new token) or ``prefill_ms_per_token`` per new token, slept (the GIL released,
    as ONNX Runtime's runs release it). For the engine's unit tests and ``tandem-bench
    edge-engine`` (the engine's own cost per step over a model that costs next to nothing).

    ``log``: per run, ``("run", new tokens)`` or ``("batch", sessions)``, in order. ``logits``: runs
    return logits float32 ``[V]`` (their argmax the token; a sampled token is then drawn on the
    host) instead of the token. KV read and written as ``2L`` float32 ``[1, Hkv, T, D]`` arrays whose
    every value at token ``t`` is ``t``'s state.
    """

    providers = ["MemoryExecutionProvider"]

    def __init__(
        self,
        shape: ModelShape,
        batched_decode: bool = True,
        step_ms: float = 0.0,
        prefill_ms_per_token: float = 0.0,
        logits: bool = False,
    ) -> None:
        self.shape = shape
        self.batched_decode = batched_decode
        self.step_ms, self.prefill_ms_per_token, self.logits = step_ms, prefill_ms_per_token, logits
        self.log: list[tuple[str, int]] = []
        self.released = 0

    def token(self, state: int, draw: Draw | None) -> int:
        """The token after a sequence of state ``state``: sampled ones shifted by their draw."""
        shift = 0 if draw is None else 1 + int(draw.uniform * 997)
        return (state + shift) % self.shape.vocab_size

    def new_kv(self, tokens_hint: int) -> MemoryKV:
        return MemoryKV()

    def _check(self, kv: MemoryKV, new: int) -> None:
        if kv.poisoned:
            raise InvalidRequest("the memory model's session KV is poisoned")
        if kv.tokens + new > self.shape.max_position_embeddings:
            raise InvalidRequest(f"{kv.tokens} + {new} tokens exceed {self.shape.max_position_embeddings} positions")

    def _append(self, kv: MemoryKV, ids: Sequence[int]) -> int:
        state = kv.states[-1] if kv.states else 0
        for t in ids:
            state = (state * 1000003 + int(t) + 1) % HASH_MODULUS
            kv.states.append(state)
        return state

    def _out(self, state: int, greedy: bool, draw: Draw | None) -> tuple[int | None, np.ndarray | None]:
        tok = self.token(state, None if greedy else draw)
        if not self.logits:
            return tok, None
        logits = np.zeros(self.shape.vocab_size, np.float32)
        logits[self.token(state, None)] = 100.0  # the argmax; a host draw at any uniform takes it too
        return None, logits

    def run(
        self, kv: MemoryKV, new_ids: list[int], greedy: bool, draw: Draw | None = None
    ) -> tuple[int | None, np.ndarray | None, float]:
        t0 = time.perf_counter()
        self._check(kv, len(new_ids))
        self.log.append(("run", len(new_ids)))
        _sleep_ms(self.step_ms if len(new_ids) == 1 else self.prefill_ms_per_token * len(new_ids))
        tok, logits = self._out(self._append(kv, new_ids), greedy, draw)
        return tok, logits, (time.perf_counter() - t0) * 1e3

    def run_batch(
        self,
        kvs: Sequence[MemoryKV],
        token_ids: Sequence[int],
        greedy: Sequence[bool],
        draws: Sequence[Draw | None] | None = None,
    ) -> tuple[list[int | None], list[np.ndarray | None], float]:
        t0 = time.perf_counter()
        if len(token_ids) != len(kvs) or len(greedy) != len(kvs) or len({id(k) for k in kvs}) != len(kvs):
            raise InvalidRequest(f"a batched step takes each KV once with one token: {len(kvs)}, {len(token_ids)}")
        for kv in kvs:
            self._check(kv, 1)
        self.log.append(("batch", len(kvs)))
        _sleep_ms(self.step_ms)
        draws = draws if draws is not None else [None] * len(kvs)
        rows = zip(kvs, token_ids, greedy, draws, strict=True)
        out = [self._out(self._append(kv, [t]), g, d) for kv, t, g, d in rows]
        return [o[0] for o in out], [o[1] for o in out], (time.perf_counter() - t0) * 1e3

    def truncate(self, kv: MemoryKV, tokens: int) -> None:
        del kv.states[max(0, tokens) :]

    def read_kv(self, kv: MemoryKV, tokens: int | None = None) -> list[np.ndarray]:
        s = self.shape
        states = np.asarray(kv.states[: kv.tokens if tokens is None else tokens], np.float32)
        one = np.broadcast_to(states[None, None, :, None], (1, s.num_kv_heads, len(states), s.head_dim))
        return [np.array(one) for _ in range(2 * s.num_layers)]

    def write_kv(self, kv: MemoryKV, past: Sequence[np.ndarray], start: int = 0) -> None:
        check_past(self.shape, past, start, kv.tokens)
        del kv.states[start:]
        kv.states.extend(int(x) for x in past[0][0, 0, :, 0])

    def release(self, kv: MemoryKV) -> None:
        kv.states.clear()
        self.released += 1


def _sleep_ms(ms: float) -> None:
    if ms > 0:
        time.sleep(ms / 1e3)
