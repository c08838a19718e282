"""Edge-only serving: the whole model in ONNX Runtime on the edge, no network.

``LocalEngine`` runs ``edge-full.onnx`` (see ``common.modelprep``: embedding, all ``L`` layers and
the LM head; inputs and outputs named by ``common.head_io.io_names(L)``, ``logits`` float32
``[1, V]`` of the last new token) token by token, batch 1, with the sampling and stop semantics
of vLLM so the local mode answers like the cloud. ``LocalGenerator`` is the synchronous,
benchmark-only driver of the same forward pass (the edge-only baseline of ``benchmarks.bench``).

Who calls: the edge's local mode (``LocalEngine.generate``, one call per turn, from the event
loop) and the benchmarks (``LocalGenerator``).

Concurrency: every ONNX Runtime call (one prefill or one decode step) runs in a worker thread
under one ``asyncio.Lock``, so the event loop stays free and concurrent turns interleave token by
token in FIFO order. A run that a cancelled turn started keeps the lock until it ends (ONNX
Runtime cannot be interrupted), so runs never overlap; the cancelled turn itself returns at once.

Sessions: with a ``session_id`` the full-model KV of the conversation is kept between turns
(``LocalSessions``, bounded by count and bytes, least recently used dropped first) and the
longest common token prefix with the next prompt is reused. The session is updated after every
model run, token ids and KV together, so a turn that fails or is cancelled leaves it consistent.
Remote prefill (``edge.remoteprefill``) puts the KV that came from the cloud into a session
(``adopt``), computes the tokens past it (``extend``) and decodes on from there (``generate``).

Shapes: ``L`` layers, ``Hkv`` KV heads, ``D`` head dim, ``T`` tokens whose KV is held, ``V``
vocabulary size; KV float32 ``[1, Hkv, T, D]`` per layer and key/value, in ``io_names`` order.

Where the KV lives: on ONNX Runtime's CUDA provider the runs use IO binding (``kv_device``), so a
session's KV stays in GPU memory (``onnxruntime.OrtValue``) between decode steps and between turns,
and only the logits of the last token come back to the host each run; on the CPU provider the KV
is numpy arrays. ``host_kv`` gives either as numpy (the remote-prefill download's delta, the tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncGenerator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tandem.common.errors import InvalidRequest
from tandem.common.ewma import Ewma
from tandem.common.head_io import io_names
from tandem.common.lru import BoundedLRU
from tandem.common.manifest import ModelShape
from tandem.common.params import Sampling
from tandem.common.requestlimits import RequestLimits
from tandem.edge.localkv import KV, blocks_from_past, host_kv, kv_nbytes, kv_prefix, kv_tokens, past_from_blocks

__all__ = ["KV", "LocalEngine", "LocalGenerator", "LocalSession", "LocalSessions", "LocalToken"]
__all__ += ["blocks_from_past", "past_from_blocks", "sample_token", "sampling_rng"]

SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it is greedy
WARMUP_DECODE_STEPS = 4


@dataclass
class LocalSession:
    """Full-model KV of one chat session, for prefix reuse across turns.

    token_ids: the tokens whose KV ``past`` holds (``len(token_ids) == T``).
    past: ``2L`` tensors float32 ``[1, Hkv, T, D]`` (key then value per layer, ``io_names`` order;
    numpy arrays, or ``OrtValue`` on the device where the engine binds its KV there), empty before
    the first turn. Tensors are replaced, never written in place.
    lock: held by the turn using the session, for the whole turn.
    """

    token_ids: list[int] = field(default_factory=list)
    past: list[KV] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def nbytes(self) -> int:
        """KV bytes held (host or device memory)."""
        return sum(kv_nbytes(a) for a in self.past)

    def common_prefix(self, ids: Sequence[int]) -> int:
        """Length of the longest common prefix of ``ids`` and ``token_ids``."""
        n = min(len(ids), len(self.token_ids))
        i = 0
        while i < n and ids[i] == self.token_ids[i]:
            i += 1
        return i


class LocalSessions(BoundedLRU[LocalSession]):
    """LRU of local sessions bounded by count and KV bytes; sessions in use are never dropped."""

    def get(self, session_id: str) -> LocalSession:
        """The session (created empty if unknown); an empty id gets a throwaway one (stateless)."""
        if not session_id:
            return LocalSession()
        s = self.peek(session_id)
        if s is None:
            s = LocalSession()
            self.put(session_id, s)
        return s

    def entry_bytes(self, key: str, s: LocalSession) -> int:
        return s.nbytes()


@dataclass(frozen=True)
class LocalToken:
    """One sampled token; ``finish_reason`` is ``"stop"`` or ``"length"`` on the turn's last one.
    ``wait_ms`` / ``run_ms``: the model run that produced it, its wait for the model (the runs queued
    ahead of it, FIFO) and its own run time (ms)."""

    token_id: int
    finish_reason: str | None = None
    wait_ms: float = 0.0
    run_ms: float = 0.0


def sample_token(logits: np.ndarray, s: Sampling, rng: np.random.Generator) -> int:
    """The next token from ``logits`` (float ``[V]``), as vLLM samples it.

    Greedy (argmax) when ``s.temperature < SAMPLING_EPS``; otherwise, in float64: divide by the
    temperature, keep the ``top_k`` largest logits (``0`` = off; ties with the k-th are kept),
    stable softmax, keep the smallest set of most probable tokens whose mass reaches ``top_p``
    (``1.0`` = off; the most probable token always stays), renormalise and draw with ``rng``.
    """
    if s.temperature < SAMPLING_EPS:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / s.temperature
    if 0 < s.top_k < z.shape[0]:
        kth = np.partition(z, -s.top_k)[-s.top_k]
        z[z < kth] = -np.inf
    p = np.exp(z - z.max())
    p /= p.sum()
    if s.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        sp = p[order]
        before = np.cumsum(sp) - sp  # mass of the more probable tokens
        p[order[before >= s.top_p]] = 0.0
        p /= p.sum()
    return int(rng.choice(p.shape[0], p=p))


def sampling_rng(seed: int | None) -> np.random.Generator:
    """The random generator of one turn, taking ``seed`` as vLLM's ``SamplingParams`` does: None or
    -1 is no seed (from the OS); any other 64-bit int seeds it (a negative one as its two's complement)."""
    return np.random.default_rng(None if seed is None or seed == -1 else seed % (1 << 64))


class LocalEngine:
    """``edge-full.onnx`` in one ONNX Runtime session, serving concurrent turns.

    Attributes (read them, don't set them):
        prefill_ms_per_token: EWMA of prefill run time per prompt token computed (ms); runs of more
            than one new token only. 0 until measured.
        decode_ms_per_token: EWMA of one-token run time (ms). 0 until measured.
        active: ``generate`` calls in flight.
        pending_prefill_tokens / pending_prefills: prompt tokens and number of the prefills waiting
            for the model or running now (``generate``'s first run, ``extend``): the queue a new
            turn's prefill joins.
        last_computed_tokens / last_reused_tokens: prompt tokens the latest prefill ran, and the
            session tokens it reused (of whichever turn prefilled last).
        sessions: the session table.
    """

    def __init__(
        self,
        onnx_path: Path,
        shape: ModelShape,
        eos_token_ids: Sequence[int],
        intra_op_threads: int = 0,
        max_sessions: int = 256,
        session_bytes: int = 512 << 20,
        session_idle_s: float = math.inf,
        providers: Sequence[str] | None = None,
        kv_device: str = "auto",
    ) -> None:
        """``intra_op_threads``: ONNX Runtime's (0 = its default); ``session_bytes``: bound on the
        KV bytes of all sessions; ``session_idle_s``: a session unused this long is dropped;
        ``providers``: ONNX Runtime's execution providers (default: CUDA where onnxruntime-gpu has a
        GPU, then CPU); ``kv_device``: where the KV is kept between runs, through IO binding:
        ``"auto"`` (the GPU when the CUDA provider is active, else host numpy arrays without
        binding), ``"cuda"``, ``"cpu"`` (bound host tensors: the same code path, no GPU) or ``"none"``.

        Raises:
            ValueError: an unknown ``kv_device``, or ``"cuda"`` without the CUDA provider active.
            What ``onnxruntime.InferenceSession`` raises for a bad file.
        """
        import onnxruntime as ort

        from tandem.edge.head_runner import default_providers, session_options

        self.session = ort.InferenceSession(
            str(onnx_path), session_options(intra_op_threads), providers=list(providers or default_providers())
        )
        active = self.session.get_providers()
        if kv_device == "auto":
            kv_device = "cuda" if "CUDAExecutionProvider" in active else "none"
        if kv_device not in ("cuda", "cpu", "none"):
            raise ValueError(f"kv_device {kv_device!r}: auto, cuda, cpu or none")
        if kv_device == "cuda" and "CUDAExecutionProvider" not in active:
            raise ValueError(f"kv_device 'cuda' needs ONNX Runtime's CUDA provider; active: {active}")
        self.kv_device = kv_device
        self._init_state(shape, eos_token_ids, LocalSessions(max_sessions, session_bytes, session_idle_s))

    def _init_state(self, shape: ModelShape, eos_token_ids: Sequence[int], sessions: LocalSessions) -> None:
        """Everything but the ONNX Runtime session: names, sessions, lock, rates and counters."""
        self.shape = shape
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        inputs, outputs = io_names(shape.num_layers)
        self._past_names = inputs[3:]
        self._out_names = ["logits", *outputs[1:]]
        self.sessions = sessions
        self._model_lock = asyncio.Lock()
        self.prefill_rate = Ewma()  # ms per prompt token computed, runs of more than one token
        self.decode_rate = Ewma()  # ms per one-token run
        self.active = 0
        self.pending_prefill_tokens = 0
        self.pending_prefills = 0
        self.last_computed_tokens = 0
        self.last_reused_tokens = 0

    async def end_session(self, session_id: str) -> bool:
        """Drop the session ``session_id`` once no turn uses it; True if it was held."""
        s = self.sessions.lookup(session_id) if session_id else None
        if s is None:
            return False
        async with s.lock:
            if self.sessions.lookup(session_id) is s:
                self.sessions.discard(session_id)
        return True

    def cached_tokens(self, session_id: str, prompt_ids: Sequence[int]) -> int:
        """Prompt tokens whose KV the session ``session_id`` holds (its common prefix); 0 if none."""
        s = self.sessions.peek(session_id) if session_id else None
        return s.common_prefix(prompt_ids) if s is not None else 0

    @property
    def prefill_ms_per_token(self) -> float:
        return self.prefill_rate.value

    @property
    def decode_ms_per_token(self) -> float:
        return self.decode_rate.value

    @property
    def providers(self) -> list[str]:
        return self.session.get_providers()

    def empty_past(self) -> list[KV]:
        """``2L`` float32 arrays ``[1, Hkv, 0, D]``."""
        s = self.shape
        return [np.zeros((1, s.num_kv_heads, 0, s.head_dim), np.float32) for _ in self._past_names]

    @property
    def limits(self) -> RequestLimits:
        """What this model takes: token ids in its vocabulary, prompt and output within its positions."""
        return RequestLimits(self.shape.vocab_size, max_model_len_tokens=self.shape.max_position_embeddings)

    def validate(self, prompt_ids: Sequence[int], s: Sampling) -> None:
        """Raises:
        InvalidRequest: prompt ids that are not a flat list of integers, or what
            ``RequestLimits.check`` refuses under ``limits`` (an empty prompt, a token id outside
            ``[0, V)``, ``max_new_tokens < 1``, prompt plus ``max_new_tokens`` beyond the model's
            positions, sampling values or stop token ids out of range).
        """
        ids = np.asarray(prompt_ids)
        if len(prompt_ids) and (ids.ndim != 1 or ids.dtype.kind not in "iu"):
            raise InvalidRequest("prompt_ids must be a flat list of integers")
        self.limits.check(prompt_ids, s)

    def forward(self, new_ids: Sequence[int], past: list[KV]) -> tuple[np.ndarray, list[KV], float]:
        """One model run over ``new_ids`` (``t >= 1`` tokens) after ``past`` (``2L`` x ``[1, Hkv, P, D]``).

        Blocking; thread-safe (ONNX Runtime's ``run`` is). Returns the logits of the last new token,
        float32 ``[V]`` on the host; the KV of all ``P + t`` tokens, ``2L`` x float32
        ``[1, Hkv, P + t, D]`` (new tensors owned by the caller: ``OrtValue`` on ``kv_device`` when it
        binds, else numpy); and the run time in ms.
        """
        p, t = kv_tokens(past[0]), len(new_ids)
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

    async def _run(self, new_ids: list[int], past: list[KV]) -> tuple[np.ndarray, list[KV], float, float]:
        """``forward`` in a worker thread under the model lock (FIFO: ``asyncio.Lock`` wakes its
        waiters in order); updates the measured rates. Returns the logits, the present KV, the wait
        for the lock and the run time (ms).

        The lock is released when the run ends, not when the caller leaves: a cancelled caller
        returns at once while its run (which cannot be interrupted) finishes alone, its result dropped.
        """
        t0 = time.perf_counter()
        await self._model_lock.acquire()
        wait_ms = (time.perf_counter() - t0) * 1e3
        fut = asyncio.ensure_future(asyncio.to_thread(self.forward, new_ids, past))
        fut.add_done_callback(self._run_done)
        logits, present, ms = await asyncio.shield(fut)
        if len(new_ids) > 1:
            self.prefill_rate.add(ms / len(new_ids))
        else:
            self.decode_rate.add(ms)
        return logits, present, wait_ms, ms

    def _run_done(self, fut: asyncio.Future) -> None:
        self._model_lock.release()
        if not fut.cancelled():
            fut.exception()  # retrieved here too, for a run whose caller was cancelled

    async def adopt(self, sess: LocalSession, token_ids: Sequence[int], past: list[np.ndarray]) -> None:
        """Make ``sess`` hold ``past`` (``2L`` float32 ``[1, Hkv, T, D]``) as the KV of ``token_ids``
        (``T`` of them), under its lock (a turn using it runs first).

        Raises:
            InvalidRequest: ``past`` is not ``2L`` arrays of the model's shape over ``T`` tokens.
        """
        sh, t = self.shape, len(token_ids)
        want = (1, sh.num_kv_heads, t, sh.head_dim)
        if len(past) != 2 * sh.num_layers or any(a.shape != want or a.dtype != np.float32 for a in past):
            got = [a.shape for a in past[:2]]
            raise InvalidRequest(f"past must be {2 * sh.num_layers} float32 arrays {want}, got {len(past)} like {got}")
        async with sess.lock:
            sess.token_ids, sess.past = [int(x) for x in token_ids], list(past)

    async def extend(self, sess: LocalSession, ids: list[int]) -> int:
        """Compute the KV of the tokens of ``ids`` past its common prefix with ``sess`` (one run) and
        make ``sess`` hold ``ids``; nothing is sampled. Returns the tokens computed (0: none to)."""
        async with sess.lock:
            c = sess.common_prefix(ids)
            if c == len(ids):
                return 0
            past = self.empty_past() if c == 0 else kv_prefix(sess.past, c)
            _, past, _, _ = await self._prefill(ids[c:], past)
            sess.token_ids, sess.past = list(ids), past
            return len(ids) - c

    async def _prefill(self, new_ids: list[int], past: list[KV]) -> tuple[np.ndarray, list[KV], float, float]:
        """``_run`` of a prefill, counted in ``pending_prefill_tokens`` while it waits and runs."""
        self.pending_prefill_tokens += len(new_ids)
        self.pending_prefills += 1
        try:
            return await self._run(new_ids, past)
        finally:
            self.pending_prefill_tokens -= len(new_ids)
            self.pending_prefills -= 1

    async def generate(
        self, prompt_ids: list[int], sampling: Sampling, session_id: str = "", *, session: LocalSession | None = None
    ) -> AsyncGenerator[LocalToken, None]:
        """Yield the turn's tokens; the last one carries ``finish_reason``.

        ``"stop"``: the token is in ``eos_token_ids`` (unless ``sampling.ignore_eos``) or in
        ``sampling.stop_token_ids``; it is yielded (vLLM counts it among the output token ids).
        ``"length"``: ``sampling.max_new_tokens`` tokens yielded.

        With a non-empty ``session_id`` (or a ``session`` of the caller's, e.g. one remote prefill
        filled) the session's KV of the longest common prefix with ``prompt_ids`` is reused (at least
        the last prompt token is recomputed, for its logits) and the session keeps the KV of the
        prompt and every generated token but the last. The session's lock is held for the whole turn;
        close the iterator (``contextlib.aclosing``) when stopping early, so the lock is released at once.

        Raises:
            InvalidRequest: see ``validate`` (raised on the first iteration).
        """
        self.validate(prompt_ids, sampling)
        prompt = [int(t) for t in prompt_ids]
        self.active += 1
        try:
            sess = session if session is not None else self.sessions.get(session_id)
            async with sess.lock:
                async for tok in self._turn(sess, prompt, sampling):
                    yield tok
        finally:
            self.active -= 1
            if session_id:
                self.sessions.evict()

    async def _turn(self, sess: LocalSession, prompt: list[int], s: Sampling) -> AsyncGenerator[LocalToken, None]:
        c = min(sess.common_prefix(prompt), len(prompt) - 1)
        past = self.empty_past() if c == 0 else kv_prefix(sess.past, c)
        stops = set(s.stop_token_ids) | (set() if s.ignore_eos else self.eos_token_ids)
        rng = sampling_rng(s.seed)
        new = prompt[c:]
        self.last_computed_tokens, self.last_reused_tokens = len(new), c
        for n in range(1, s.max_new_tokens + 1):
            logits, past, wait_ms, run_ms = await (self._prefill(new, past) if n == 1 else self._run(new, past))
            # Commit token ids and KV together (no await in between): the session stays consistent.
            if n == 1:
                sess.token_ids, sess.past = list(prompt), past
            else:
                sess.token_ids.append(new[0])
                sess.past = past
            tok = sample_token(logits, s, rng)
            finish = "stop" if tok in stops else "length" if n == s.max_new_tokens else None
            yield LocalToken(tok, finish, wait_ms, run_ms)
            if finish:
                return
            new = [tok]

    async def warmup(self, n_tokens: int = 32) -> None:
        """One untimed one-token run (ONNX Runtime's first run allocates), then a prefill of
        ``n_tokens`` (at least 2) and a few decode steps, which set the measured rates. Stateless."""
        await self._run([1], self.empty_past())
        n = max(2, min(n_tokens, self.shape.max_position_embeddings - WARMUP_DECODE_STEPS))
        ids = [(1 + 7919 * i) % self.shape.vocab_size for i in range(n)]
        sampling = Sampling(max_new_tokens=WARMUP_DECODE_STEPS, ignore_eos=True)
        async with contextlib.aclosing(self.generate(ids, sampling)) as it:
            async for _ in it:
                pass


@dataclass(frozen=True)
class LocalStep:
    token_id: int
    t_s: float  # perf_counter() when the token was sampled


class LocalGenerator:
    """Synchronous, stateless driver of ``LocalEngine``'s forward pass, for the edge-only baseline
    of the benchmarks (no event loop, no sessions)."""

    def __init__(self, onnx_path: Path, shape: ModelShape, intra_op_threads: int = 0) -> None:
        self.engine = LocalEngine(onnx_path, shape, (), intra_op_threads)
        self.shape = shape

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        eos_token_id: int | None = None,
        temperature: float = 0.0,
        seed: int = 0,
    ) -> Iterator[LocalStep]:
        """Yield sampled tokens; stops at ``eos_token_id`` (yielded) or ``max_new_tokens``.

        Raises:
            InvalidRequest: see ``LocalEngine.validate``.
        """
        stop = () if eos_token_id is None else (eos_token_id,)
        s = Sampling(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, stop_token_ids=stop)
        self.engine.validate(prompt_ids, s)
        rng = sampling_rng(seed)
        past, new = self.engine.empty_past(), list(prompt_ids)
        for _ in range(max_new_tokens):
            logits, past, _ms = self.engine.forward(new, past)
            tok = sample_token(logits, s, rng)
            yield LocalStep(tok, time.perf_counter())
            if tok in stop:
                return
            new = [tok]
