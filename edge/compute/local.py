"""Edge-only serving: the whole model on the edge, no network.

``LocalEngine`` runs a ``LocalModel`` (``edge.compute.localmodel``: ONNX Runtime GenAI's builder graph
through ``edge.compute.decoder.DecoderGraph``, or tandem's ``edge-full.onnx``) token by token, with the
sampling and stop semantics of vLLM so the local mode answers like the cloud.
``LocalGenerator`` is the synchronous, benchmark-only driver of the same runs.

Who calls: the edge's local mode (``LocalEngine.generate``, one call per turn, from the event
loop), remote prefill (``adopt``, ``extend``, ``generate``) and the benchmarks (``LocalGenerator``).

Concurrency: every model run (a prefill, a decode step, a KV read or write) runs in one long-lived
worker thread (``edge.compute.stepper.Stepper``), so the event loop stays free and runs never
overlap. A turn queues its prefill as a job; the job computes the first token, and from then on
the thread decodes the turn on its own, one token per step, sampling it (the turn's seeded draws,
in order) and checking its stops there: each step computes every decoding turn's next token, in
one ``run_batch`` where the model batches decode steps (``LocalModel.batched_decode``: the builder
graph; continuous batching, as vLLM's engine core does) and one ``run`` each otherwise, and hands
all of them back to the event loop with one ``call_soon_threadsafe``. The event loop's side of a
decode step is taking a token from the turn's queue; nothing waits for it, so it overlaps the next
run. Jobs (prefills, ``adopt``, ``extend``, ``read_kv``) run first come, first served, one between
two decode steps: a new turn joins the batch at the step after its prefill, and however many
prefills are queued, the decoding turns step after each one. A turn that is closed or cancelled
stops at the next step (a run it is part of finishes first: ONNX Runtime cannot be interrupted),
and a job it queued that has not started is dropped.

Sessions: with a ``session_id`` the whole model's KV of the conversation is kept between turns
(``LocalSessions``, bounded by count and bytes, least recently used dropped first) and the longest
common token prefix with the next prompt is reused. A session's token ids and its KV change only
together, in the worker thread (the prefix kept, the new tokens run, the ids appended), so a
turn that fails or is cancelled leaves the session consistent. A turn's decode may run ahead of
the tokens its caller took: a turn closed early leaves its session holding a few more tokens than
it yielded, and the next turn's prompt reuses the prefix they share. Remote prefill
(``edge.modes.remote_prefill``) puts the KV that came from the cloud into a session (``adopt``),
computes the tokens past it (``extend``) and decodes on from there (``generate``).

Shapes: ``L`` layers, ``Hkv`` KV heads, ``D`` head dim, ``T`` tokens whose KV is held, ``V``
vocabulary size; KV crosses this module as ``2L`` float32 ``[1, Hkv, T, D]`` host arrays.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from tandem.common.model.builder_export import blocked_prefix_sum
from tandem.common.protocol.errors import EngineError, InvalidRequest, QuotaExceeded, TurnTooLarge
from tandem.common.protocol.limits import RequestLimits
from tandem.common.protocol.manifest import ModelShape
from tandem.common.protocol.params import Sampling
from tandem.common.runtime.ewma import Ewma
from tandem.common.runtime.lru import RememberingLRU
from tandem.edge.compute.localkv import KV, blocks_from_past, past_from_blocks
from tandem.edge.compute.localmodel import BoundedKVModel, Draw, LocalModel, OnnxForward, check_past
from tandem.edge.compute.prefill import PrefillPlan
from tandem.edge.compute.stepper import LINGER_S, Mailbox, Stepper

__all__ = ["KV", "LocalEngine", "LocalGenerator", "LocalSession", "LocalSessions", "LocalToken", "load_local_model"]
__all__ += ["blocks_from_past", "draw_uniform", "past_from_blocks", "sample_token", "sampling_rng"]

R = TypeVar("R")
log = logging.getLogger(__name__)

SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it is greedy
WARMUP_DECODE_STEPS = 4


@dataclass
class LocalSession:
    """The whole model's KV of one chat session, for prefix reuse across turns.

    token_ids: the tokens whose KV ``kv`` holds (``len(token_ids) == kv.tokens``).
    kv: the model's ``SessionKV`` (``edge.compute.localmodel``), None before the session's first run.
    lock: held by the turn using the session, for the whole turn.
    release: gives ``kv``'s buffers back to its model once the session is dropped.
    """

    token_ids: list[int] = field(default_factory=list)
    kv: Any = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    release: Callable[[Any], None] | None = field(default=None, repr=False)
    dropped: bool = False

    def nbytes(self) -> int:
        """Bytes the session's KV holds (host or device memory; ``SessionKV.nbytes``: for the builder
        graph its own buffers or its batch pool row, whichever holds it)."""
        return self.kv.nbytes() if self.kv is not None else 0

    def common_prefix(self, ids: Sequence[int]) -> int:
        """Length of the longest common prefix of ``ids`` and ``token_ids``."""
        n = min(len(ids), len(self.token_ids))
        i = 0
        while i < n and ids[i] == self.token_ids[i]:
            i += 1
        return i

    def drop(self, final: bool = True) -> None:
        """Give the KV back to the model. ``final`` (a stateless turn's session, at its end): a run
        still queued for it allocates nothing (``LocalEngine`` refuses it); otherwise (the session
        table let it go) a turn that still holds it computes anew."""
        if self.kv is not None and self.release is not None:
            self.release(self.kv)
        self.kv, self.token_ids, self.dropped = None, [], final


class LocalSessions(RememberingLRU[LocalSession]):
    """LRU of local sessions bounded by count and KV bytes (and idle time); sessions in use are never
    dropped. Remembers the ids of the sessions it dropped (evicted by a bound, the KV memory's
    among them, or expired), so the next turn of one is told its session expired (``expired``)."""

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

    def _drop(self, key: str, reason: str) -> None:
        s = self.lookup(key)
        super()._drop(key, reason)
        if s is not None:
            s.drop(final=False)

    def discard(self, key: str) -> LocalSession | None:
        s = super().discard(key)
        if s is not None:
            s.drop(final=False)
        return s


@dataclass(slots=True)
class DecodeStep:
    """One turn's next decode step: ``token_id`` computed after the session's first ``keep``
    tokens, greedy or at ``draw``. A decoding turn holds one and the stepper updates it in place."""

    sess: LocalSession
    token_id: int
    keep: int
    greedy: bool
    tokens_hint: int
    draw: Draw | None = None  # a sampled step's draw (None: greedy)


class TurnRun(Mailbox):
    """One ``generate`` turn as the stepper runs it. The thread's: ``step`` (the next decode step,
    updated in place), ``prompt``, ``sampling``, ``stops``, ``rng`` (the turn's draws, taken in
    order: the prefill's, then one per step), ``sampled`` (tokens handed back so far) and
    ``ready_s`` (``perf_counter()`` when its next run could start: queued, or its last step's end).
    The event loop's: ``out`` (tokens or the exception handed back, not yet taken) and ``waiter``."""

    __slots__ = ("out", "prompt", "ready_s", "rng", "sampled", "sampling", "step", "stops", "waiter")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        step: DecodeStep,
        prompt: list[int],
        sampling: Sampling,
        stops: frozenset[int],
        rng: np.random.Generator,
    ) -> None:
        super().__init__(loop)
        self.step, self.prompt, self.sampling, self.stops, self.rng = step, prompt, sampling, stops, rng
        self.sampled = 0
        self.ready_s = time.perf_counter()
        self.out: deque[LocalToken | BaseException] = deque()
        self.waiter: asyncio.Future | None = None

    def push(self, item: LocalToken | BaseException) -> None:
        self.out.append(item)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def next(self) -> LocalToken:
        """The turn's next token, waiting for it if none was handed back yet.

        Raises:
            What the turn's run raised."""
        while not self.out:
            self.waiter = self.loop.create_future()
            await self.waiter
        item = self.out.popleft()
        if isinstance(item, BaseException):
            raise item
        return item


class JobBox(Mailbox):
    """One ``LocalEngine._run_job`` job's result (or exception), in ``done``."""

    __slots__ = ("done",)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.done: asyncio.Future = loop.create_future()

    def push(self, item: Any) -> None:
        if not self.done.done():
            (self.done.set_exception if isinstance(item, BaseException) else self.done.set_result)(item)


@dataclass(frozen=True)
class LocalToken:
    """One sampled token; ``finish_reason`` is ``"stop"`` or ``"length"`` on the turn's last one.
    ``wait_ms`` / ``run_ms``: the model run that produced it, its wait for the model (the runs queued
    ahead of it, FIFO) and its own run time (ms)."""

    token_id: int
    finish_reason: str | None = None
    wait_ms: float = 0.0
    run_ms: float = 0.0


def sample_token(logits: np.ndarray, s: Sampling, uniform: float) -> int:
    """The next token from ``logits`` (float ``[V]``), as vLLM samples it, at the draw ``uniform``
    (float32 in ``[0, 1)``, ``draw_uniform``).

    Greedy (argmax) when ``s.temperature < SAMPLING_EPS``; otherwise, in float32, the rule of the
    builder graph's sampler (``common.model.builder_export.sampling_nodes``): divide by the
    temperature, sort descending (equal values in index order), keep the logits ``>=`` the
    ``top_k``-th (``0`` = off; ties with the k-th stay), softmax, keep the tokens whose mass before
    them is ``< top_p`` (``1.0`` = off; the most probable token always stays), and take the inverse
    CDF of the kept mass at ``uniform``: the first token whose cumulative mass exceeds
    ``uniform * total``. The cumulative sums run in the graph's order
    (``common.model.builder_export.blocked_prefix_sum``), so the two compute the same float32 values
    up to the last bit of the ``exp`` and the softmax's sum, and pick one token but where
    ``uniform`` falls within a few ulps of a boundary.
    """
    if s.temperature < SAMPLING_EPS:
        return int(np.argmax(logits))
    z = np.asarray(logits, np.float32) / np.float32(max(s.temperature, SAMPLING_EPS))
    order = np.argsort(-z, kind="stable")
    vals = z[order]
    if 0 < s.top_k:
        vals = np.where(vals >= vals[min(s.top_k, vals.shape[0]) - 1], vals, np.float32(-np.inf))
    e = np.exp(vals - vals[0])
    p = e / e.sum(dtype=np.float32)
    if s.top_p < 1.0:
        before = blocked_prefix_sum(p, exclusive=True)  # the mass ahead
        p = np.where(before < np.float32(s.top_p), p, np.float32(0))
    cdf = blocked_prefix_sum(p)
    at = int(np.count_nonzero(cdf <= np.float32(uniform) * cdf[-1]))
    return int(order[max(0, min(at, int(np.count_nonzero(p > 0)) - 1))])


def draw_uniform(rng: np.random.Generator) -> float:
    """One draw of a sampled token, float32 in ``[0, 1)`` (exact in the graph's float32 input)."""
    return float(rng.random(dtype=np.float32))


def next_token(token: int | None, logits: np.ndarray | None, s: Sampling, uniform: float) -> int:
    """The token a run gave (its own argmax or sample) or the one sampled from the logits it gave
    at ``uniform``.

    Raises:
        EngineError: the run gave neither."""
    if token is not None:
        return token
    if logits is None:
        raise EngineError("the local model's run returned neither a token nor logits")
    return sample_token(logits, s, uniform)


def _draw(s: Sampling, rng: np.random.Generator) -> Draw | None:
    """The next sampled token's draw (one ``draw_uniform`` from ``rng``), or None for a greedy turn
    (which draws nothing)."""
    if s.temperature < SAMPLING_EPS:
        return None
    return Draw(s.temperature, s.top_k, s.top_p, draw_uniform(rng))


def sampling_rng(seed: int | None) -> np.random.Generator:
    """The random generator of one turn, taking ``seed`` as vLLM's ``SamplingParams`` does: None or
    -1 is no seed (from the OS); any other 64-bit int seeds it (a negative one as its two's complement)."""
    return np.random.default_rng(None if seed is None or seed == -1 else seed % (1 << 64))


def load_local_model(
    path: Path,
    shape: ModelShape,
    intra_op_threads: int = 0,
    providers: Sequence[str] | None = None,
    kv_device: str = "auto",
    kv_bytes: int | None = None,
    prefill: PrefillPlan | None = None,
) -> LocalModel:
    """The whole model at ``path``: a folder built by ONNX Runtime GenAI's model builder
    (``genai_config.json``: ``edge.compute.decoder.DecoderGraph``; a CPU build runs on the CPU provider
    unless ``providers`` says otherwise; ``kv_bytes`` bounds the memory of its KV buffers, None: no
    bound; ``prefill``: its ``PrefillPlan``, None: the decoder's default) or tandem's
    ``edge-full.onnx`` (``edge.compute.localmodel.OnnxForward``; ``kv_device`` applies to it alone).

    Raises:
        ValueError: see ``OnnxForward`` and ``DecoderGraph``; a builder folder whose shape is not
            ``shape``'s.
        What ``onnxruntime.InferenceSession`` raises for a bad file.
    """
    from tandem.edge.compute.decoder import GENAI_CONFIG, DecoderGraph

    if Path(path).is_dir() and (Path(path) / GENAI_CONFIG).is_file():
        from tandem.common.model.builder_export import load_build

        if providers is None and load_build(Path(path)).execution_provider == "cpu":
            providers = ["CPUExecutionProvider"]  # a CPU build (fp32 GroupQueryAttention) runs where it was built for
        listed = list(providers) if providers else None
        graph = DecoderGraph(Path(path), listed, intra_op_threads, max_kv_bytes=kv_bytes, prefill=prefill)
        sp = graph.spec
        got = (sp.num_layers, sp.num_kv_heads, sp.head_dim, sp.vocab_size)
        want = (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.vocab_size)
        if got != want:
            raise ValueError(f"{path}: (layers, KV heads, head dim, vocabulary) {got}, the manifest says {want}")
        return graph
    return OnnxForward(Path(path), shape, intra_op_threads, providers, kv_device)


class LocalEngine:
    """The whole model (``LocalModel``) serving concurrent turns.

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
        last_batch_size: decode steps in the latest batched run (models with ``batched_decode``).
        sessions: the session table.
    """

    def __init__(
        self,
        model: LocalModel | Path,
        shape: ModelShape,
        eos_token_ids: Sequence[int],
        intra_op_threads: int = 0,
        max_sessions: int = 256,
        session_bytes: int = 512 << 20,
        session_idle_s: float = math.inf,
        providers: Sequence[str] | None = None,
        kv_device: str = "auto",
        kv_bytes: int | None = None,
        prefill: PrefillPlan | None = None,
    ) -> None:
        """``model``: a ``LocalModel``, or a path ``load_local_model`` loads (with
        ``intra_op_threads``, ONNX Runtime's (0 = its default); ``providers``, its execution providers
        (default: CUDA where onnxruntime-gpu has a GPU, then CPU); ``kv_device``, see
        ``OnnxForward``; ``kv_bytes``, the builder graph's bound on its KV buffers, and ``prefill``,
        its prefill shapes, see ``DecoderGraph``); ``session_bytes``: bound on the KV bytes of all
        sessions (what each holds: ``LocalSession.nbytes``); ``session_idle_s``: a session unused
        this long is dropped.

        Raises:
            What ``load_local_model`` raises.
        """
        if isinstance(model, Path | str):
            model = load_local_model(Path(model), shape, intra_op_threads, providers, kv_device, kv_bytes, prefill)
        self.model = model
        self._init_state(shape, eos_token_ids, LocalSessions(max_sessions, session_bytes, session_idle_s))

    def _init_state(self, shape: ModelShape, eos_token_ids: Sequence[int], sessions: LocalSessions) -> None:
        """Everything but the model: sessions, the stepper, rates and counters."""
        self.shape = shape
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.sessions = sessions
        self._released: list[Any] = []  # KV of dropped sessions, given back to the model by the next run
        self.prefill_rate = Ewma()  # ms per prompt token computed, runs of more than one token
        self.decode_rate = Ewma()  # ms per one-token run
        self.active = 0
        self.pending_prefill_tokens = 0
        self.pending_prefills = 0
        self.last_computed_tokens = 0
        self.last_reused_tokens = 0
        self.last_batch_size = 0  # decode steps of the latest batched run
        self._setups_seen = getattr(self.model, "setup_runs", 0)  # the model's graph set-up runs, measured past
        self._measuring = True  # False while the warm-up sets up what it does not time
        self._batched = bool(getattr(self.model, "batched_decode", False))
        # a model replaying CUDA graphs runs on one thread for its whole life (``GraphThread``)
        linger = None if getattr(self.model, "thread_bound", False) else LINGER_S
        self._stepper: Stepper[TurnRun] = Stepper(self._step_all, self._give_back, linger)

    @property
    def kv_device(self) -> str:
        """Where the KV lives between runs: ``"cuda"`` or ``"cpu"`` (``OnnxForward``: its setting)."""
        return getattr(self.model, "kv_device", None) or (
            "cuda" if "CUDAExecutionProvider" in self.providers else "cpu"
        )

    def new_session(self) -> LocalSession:
        """An empty session whose KV goes back to this engine's model when it is dropped."""
        return LocalSession(release=self._released.append)

    async def close(self, timeout_s: float = 10.0) -> None:
        """Stop taking turns (``EngineError`` after this) and end the model's thread once the turns
        in flight are done (at the edge's shutdown, after its drain), waiting up to ``timeout_s``
        for it (a run in flight cannot be interrupted)."""
        await asyncio.to_thread(self._stepper.close, timeout_s)

    async def tidy(self) -> None:
        """Give back what idle state holds: the KV of dropped sessions goes back to the model, and
        a model that frees idle buffers itself (``DecoderGraph.tidy``) does so, in one job of the
        stepper's thread (after the jobs queued before it). The edge's session sweeper calls it, so an
        edge without turns gives its memory back too."""
        tidy = getattr(self.model, "tidy", None)
        if self._released or tidy is not None:
            await self._run_job(tidy or (lambda: None))

    async def end_session(self, session_id: str) -> bool:
        """Drop the session ``session_id`` once no turn uses it; True if it was held."""
        s = self.sessions.lookup(session_id) if session_id else None
        if s is None:
            return False
        async with s.lock:
            if self.sessions.lookup(session_id) is s:
                self.sessions.discard(session_id)
        return True

    def session_expired(self, session_id: str) -> bool:
        """True once for a session the session table dropped by itself (evicted by a bound, the KV
        memory's among them, or idle): the turn asking starts it again, and its client is told
        (``TurnDone.session_expired``). Call it before the turn's ``generate`` (which holds the id again)."""
        return self.sessions.expired(session_id)

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
        return list(self.model.providers)

    @property
    def limits(self) -> RequestLimits:
        """What this model takes: token ids in its vocabulary, prompt and output within its positions."""
        return RequestLimits(vocab_size=self.shape.vocab_size, max_model_len_tokens=self.shape.max_position_embeddings)

    def validate(self, prompt_ids: Sequence[int], s: Sampling, prompt_param: str = "prompt") -> None:
        """``prompt_param``: the prompt's field (``messages`` for a chat).

        Raises:
        InvalidRequest: prompt ids that are not a flat list of integers, or what
            ``RequestLimits.check`` refuses under ``limits`` (an empty prompt, a token id outside
            ``[0, V)``, ``max_new_tokens < 1``, prompt plus ``max_new_tokens`` beyond the model's
            positions, sampling values or stop token ids out of range).
        TurnTooLarge: see ``check_fits``.
        """
        ids = np.asarray(prompt_ids)
        if len(prompt_ids) and (ids.ndim != 1 or ids.dtype.kind not in "iu"):
            raise InvalidRequest("prompt_ids must be a flat list of integers")
        self.limits.check(prompt_ids, s, prompt_param)
        self.check_fits(len(prompt_ids), s.max_new_tokens, prompt_param)

    def check_fits(self, prompt_tokens: int, max_new_tokens: int, prompt_param: str = "prompt") -> None:
        """Whether a turn's own KV fits the model's whole KV memory bound (``local_kv_bytes``; a model
        without a bound takes any turn its positions hold): the bytes of the slot it would hold, whose
        capacity is ``prompt_tokens + max_new_tokens`` rounded up to a slot size (powers of two from
        256 tokens, ``turn_capacity_tokens``), what it really holds. Checked before anything runs: a
        turn refused here could never run, however much is freed.

        Raises:
            TurnTooLarge: it does not; ``param`` ``max_new_tokens``, or ``prompt_param`` when the
                prompt with one new token does not fit either.
        """
        model = self.model
        if not isinstance(model, BoundedKVModel) or model.max_kv_bytes is None:
            return
        bound = model.max_kv_bytes
        tokens = prompt_tokens + max_new_tokens
        need = model.turn_kv_bytes(tokens)
        if need <= bound:
            return
        most = model.max_turn_tokens()
        prompt_too_long = prompt_tokens + 1 > most
        raise TurnTooLarge(
            f"this turn's KV needs {need} bytes: a KV slot of {model.turn_capacity_tokens(tokens)} tokens, its "
            f"prompt {prompt_tokens} + max_new_tokens {max_new_tokens} = {tokens} tokens rounded up to a slot size, "
            f"more than the edge's whole bound on local KV memory, local_kv_bytes = "
            f"{bound} bytes, which holds at most {most} tokens of one turn: it can never run in local mode on this "
            "edge; ask for fewer tokens "
            "(a shorter prompt or a smaller max_new_tokens), use another mode, or raise the edge's local_kv_bytes",
            param=prompt_param if prompt_too_long else "max_new_tokens",
        )

    # ---- runs: every one in the stepper's thread (``edge.compute.stepper``) ------------------------

    async def _run_job(self, job: Callable[[], R]) -> tuple[R, float]:
        """``job`` in the stepper's thread, after the jobs queued before it and between two decode
        steps, the KV of dropped sessions given back to the model first. Returns its result and its
        wait in the queue (ms).

        A caller cancelled before the job starts drops it; one cancelled later returns at once while
        the job (which cannot be interrupted) finishes alone, its result dropped."""
        box = JobBox(asyncio.get_running_loop())
        queued_s = time.perf_counter()

        def run() -> None:
            if box.cancelled:
                return
            wait_ms = (time.perf_counter() - queued_s) * 1e3
            try:
                out: Any = (job(), wait_ms)
            except BaseException as e:
                out = e
            self._stepper.deliver(box, out)

        self._stepper.submit(run)
        try:
            return await box.done
        except asyncio.CancelledError:
            box.cancelled = True
            raise

    def _give_back(self) -> None:
        """In the thread, before each run: the KV of dropped sessions back to the model."""
        while self._released:
            self.model.release(self._released.pop())

    def _kv(self, sess: LocalSession, tokens_hint: int) -> Any:
        """The session's KV, allocated on its first run for ``tokens_hint`` tokens, or made to hold
        them where the model reserves room ahead (``DecoderGraph.reserve_kv``: a turn's growth fails
        at its prefill, not mid-decode); in the thread.

        Raises:
            EngineError: the session was dropped meanwhile (its turn was cancelled or ended).
            QuotaExceeded: no room for the KV within the model's bound."""
        if sess.dropped:
            raise EngineError("the local session was dropped")
        if sess.kv is None:
            sess.kv, sess.token_ids = self.model.new_kv(tokens_hint), []
            if sess.release is None:
                sess.release = self._released.append
        else:
            reserve = getattr(self.model, "reserve_kv", None)
            if reserve is not None:
                reserve(sess.kv, tokens_hint)
        return sess.kv

    def _advance(
        self, sess: LocalSession, ids: list[int], keep: int, greedy: bool, tokens_hint: int, draw: Draw | None = None
    ) -> tuple[int | None, np.ndarray | None, float]:
        """In the thread: keep the session's first ``keep`` tokens, run ``ids`` after them, and hold
        the token ids with the KV (both change together, here)."""
        kv = self._kv(sess, tokens_hint)
        if kv.tokens != keep:
            self.model.truncate(kv, keep)
        del sess.token_ids[keep:]
        tok, logits, ms = self.model.run(kv, ids, greedy, draw)
        sess.token_ids.extend(ids)
        return tok, logits, ms

    # ---- a turn in the thread: its prefill (a job), then one decode step per stepper step ----------

    def _start_turn(self, run: TurnRun) -> None:
        """The turn's prefill job: the prompt past the reused prefix, its first token handed back,
        and the turn decoding from the next step on (unless that token ends it)."""
        if run.cancelled:
            return
        t0 = time.perf_counter()
        st, ids = run.step, run.prompt[run.step.keep :]
        try:
            tok_, logits, ms = self._advance(st.sess, ids, st.keep, st.greedy, st.tokens_hint, st.draw)
            self._measured(len(ids), ms, prefill=True)
            tok = next_token(tok_, logits, run.sampling, st.draw.uniform if st.draw else 0.0)
        except BaseException as e:  # the turn hears whatever its prefill raised
            self._stepper.deliver(run, e)
            return
        if self._emit(run, tok, (t0 - run.ready_s) * 1e3, ms, time.perf_counter()):
            self._stepper.decoding.append(run)

    def _emit(self, run: TurnRun, tok: int, wait_ms: float, run_ms: float, now_s: float) -> bool:
        """Hand the turn's next token back; True if the turn goes on (its next step set up: the
        token to run, the next draw, ready from ``now_s``)."""
        run.sampled += 1
        s = run.sampling
        finish = "stop" if tok in run.stops else "length" if run.sampled == s.max_new_tokens else None
        self._stepper.deliver(run, LocalToken(tok, finish, wait_ms, run_ms))
        if finish is not None:
            return False
        st = run.step
        st.token_id, st.keep, st.draw = tok, len(st.sess.token_ids), _draw(s, run.rng)
        run.ready_s = now_s
        return True

    def _step_all(self, decoding: list[TurnRun]) -> None:
        """One decode step of every decoding turn that is still wanted: one ``run_batch`` where the
        model batches (a failed one run again step by step, so a bad session fails alone), else one
        ``run`` each. Turns that finished, failed or were cancelled leave ``decoding``."""
        live = [r for r in decoding if not r.cancelled]
        if not live:
            decoding.clear()
            return
        if self._batched:
            start = time.perf_counter()
            results, ms = self._advance_batch([r.step for r in live])
            starts = [start] * len(live)
            self.last_batch_size = len(live)
            if ms:
                self._measured(1, ms)
        else:
            results, starts = [], []
            for r in live:
                starts.append(time.perf_counter())
                results.append(self._advance_one(r.step))
        now = time.perf_counter()
        going = []
        for r, res, start in zip(live, results, starts, strict=True):
            if isinstance(res, BaseException):
                self._stepper.deliver(r, res)
                continue
            tok, logits, ms = res
            if tok is None:
                try:
                    tok = next_token(tok, logits, r.sampling, r.step.draw.uniform if r.step.draw else 0.0)
                except Exception as e:
                    self._stepper.deliver(r, e)
                    continue
            if self._emit(r, tok, (start - r.ready_s) * 1e3, ms, now):
                going.append(r)
        decoding[:] = going

    def _advance_one(self, st: DecodeStep) -> tuple[int | None, np.ndarray | None, float] | Exception:
        try:
            out = self._advance(st.sess, [st.token_id], st.keep, st.greedy, st.tokens_hint, st.draw)
        except Exception as e:
            return e
        self._measured(1, out[2])
        return out

    def _advance_batch(self, batch: Sequence[DecodeStep]) -> tuple[list[Any], float]:
        """In the thread: each step's token run after its session's first ``keep`` tokens, all in one
        ``run_batch``, the ids held with the KV (both change together, here). Returns per step
        ``(token, logits, run_ms)`` or the exception that step raised, and the run's ms. A batched
        run that raises (one session's bad state) is run again step by step, so only that session's
        step fails."""
        results: list[Any] = [None] * len(batch)
        live: list[tuple[int, Any]] = []
        for i, st in enumerate(batch):
            try:
                kv = self._kv(st.sess, st.tokens_hint)
                if kv.tokens != st.keep:
                    self.model.truncate(kv, st.keep)
                del st.sess.token_ids[st.keep :]
                live.append((i, kv))
            except Exception as e:
                results[i] = e
        if not live:
            return results, 0.0
        try:
            toks, logits, ms = self.model.run_batch(
                [kv for _, kv in live],
                [batch[i].token_id for i, _ in live],
                [batch[i].greedy for i, _ in live],
                [batch[i].draw for i, _ in live],
            )
        except Exception:
            for i, kv in live:
                st = batch[i]
                try:
                    self.model.truncate(kv, st.keep)  # a step the failed run did complete runs again
                    tok, lg, one_ms = self.model.run(kv, [st.token_id], st.greedy, st.draw)
                    st.sess.token_ids.append(st.token_id)
                    results[i] = (tok, lg, one_ms)
                except Exception as e:
                    results[i] = e
            return results, 0.0
        for j, (i, _) in enumerate(live):
            batch[i].sess.token_ids.append(batch[i].token_id)
            results[i] = (toks[j], logits[j], ms)
        return results, ms

    def _measured(self, tokens: int, ms: float, prefill: bool = False) -> None:
        """Add a run of ``tokens`` new tokens that took ``ms`` to the rates: a prefill of several
        tokens to the prefill rate, a decode step to the decode rate. Left out: a run after which
        the model had set a CUDA graph up (``setup_runs`` grew: that run paid a graph's first
        allocations or its capture once, tens of ms, and says nothing of the next), a prefill of one
        token (the prompt held but its last token: the prefill graph, uncaptured, not a decode
        step), and every run while the warm-up sets up shapes and capacities it does not time."""
        setups = getattr(self.model, "setup_runs", 0)
        if setups != self._setups_seen:
            self._setups_seen = setups
            return
        if not self._measuring:
            return
        if tokens > 1:
            self.prefill_rate.add(ms / tokens)
        elif not prefill:
            self.decode_rate.add(ms)

    async def adopt(
        self, sess: LocalSession, token_ids: Sequence[int], past: Sequence[np.ndarray], keep_tokens: int = 0
    ) -> None:
        """Make ``sess`` hold ``past`` (``2L`` float32 ``[1, Hkv, T, D]``) as the KV of
        ``token_ids[keep_tokens:]`` after its own first ``keep_tokens`` tokens (which must be
        ``token_ids[:keep_tokens]``), under its lock (a turn using it runs first).

        Raises:
            InvalidRequest: ``past`` is not ``2L`` arrays of the model's shape over
                ``len(token_ids) - keep_tokens`` tokens, or the session no longer holds
                ``token_ids[:keep_tokens]``.
        """
        ids = [int(x) for x in token_ids]
        t = len(ids) - keep_tokens
        check_past(self.shape, past, tokens=t)

        def job() -> None:
            if keep_tokens and sess.token_ids[:keep_tokens] != ids[:keep_tokens]:
                raise InvalidRequest(f"the session no longer holds the {keep_tokens} tokens the KV follows")
            kv = self._kv(sess, len(ids))
            self.model.write_kv(kv, past, keep_tokens)
            sess.token_ids = ids

        async with sess.lock:
            await self._run_job(job)

    async def extend(self, sess: LocalSession, ids: list[int], room_tokens: int = 0) -> int:
        """Compute the KV of the tokens of ``ids`` past its common prefix with ``sess`` (one run) and
        make ``sess`` hold ``ids``; nothing is sampled. ``room_tokens``: the tokens the session's KV
        is made to hold from this run on (at least ``len(ids)``; capped at the model's positions
        under ``limits``), as ``generate`` reserves a turn's prompt and output before its prefill,
        so that the decode after it does not grow the KV first. Where the model's KV memory bound
        refuses that room beside what is held (``QuotaExceeded``), the run reserves ``ids`` alone
        (nothing changed by the refusal): the decode after it grows the KV then, with
        ``generate``'s room-making. Returns the tokens computed (0: none to).

        Raises:
            QuotaExceeded: not even the KV of ``ids`` fits the model's KV memory bound."""
        async with sess.lock:
            c = sess.common_prefix(ids)
            if c == len(ids):
                return 0
            room = max(len(ids), min(room_tokens, self.limits.max_model_len_tokens or room_tokens))
            try:
                await self._prefill(sess, list(ids), c, greedy=True, tokens_hint=room)
            except QuotaExceeded:
                if room <= len(ids):
                    raise
                await self._prefill(sess, list(ids), c, greedy=True, tokens_hint=len(ids))
            return len(ids) - c

    async def read_kv(self, sess: LocalSession, tokens: int) -> list[np.ndarray]:
        """The session's KV of its first ``tokens`` tokens, ``2L`` float32 host arrays (a copy)."""

        def job() -> list[np.ndarray]:
            if sess.kv is None or sess.kv.tokens < tokens:
                raise InvalidRequest(
                    f"the session holds {0 if sess.kv is None else sess.kv.tokens} tokens, not {tokens}"
                )
            return self.model.read_kv(sess.kv, tokens)

        return (await self._run_job(job))[0]

    async def _prefill(
        self, sess: LocalSession, ids: list[int], keep: int, greedy: bool, tokens_hint: int, draw: Draw | None = None
    ) -> tuple[int | None, np.ndarray | None, float, float]:
        """The prefill job (``ids[keep:]`` after the session's first ``keep`` tokens), counted in
        ``pending_prefill_tokens`` while it waits and runs. Returns token, logits, wait and run ms."""
        n = len(ids) - keep
        self.pending_prefill_tokens += n
        self.pending_prefills += 1
        try:
            (tok, logits, ms), wait_ms = await self._run_job(
                lambda: self._advance(sess, ids[keep:], keep, greedy, tokens_hint, draw)
            )
        finally:
            self.pending_prefill_tokens -= n
            self.pending_prefills -= 1
        self._measured(n, ms, prefill=True)
        return tok, logits, wait_ms, ms

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: Sampling,
        session_id: str = "",
        *,
        session: LocalSession | None = None,
        prompt_param: str = "prompt",
    ) -> AsyncGenerator[LocalToken, None]:
        """Yield the turn's tokens; the last one carries ``finish_reason``.

        ``"stop"``: the token is in ``eos_token_ids`` (unless ``sampling.ignore_eos``) or in
        ``sampling.stop_token_ids``; it is yielded (vLLM counts it among the output token ids).
        ``"length"``: ``sampling.max_new_tokens`` tokens yielded.

        With a non-empty ``session_id`` (or a ``session`` of the caller's, e.g. one remote prefill
        filled) the session's KV of the longest common prefix with ``prompt_ids`` is reused (at least
        the last prompt token is recomputed, for its logits) and the session keeps the KV of the
        prompt and every generated token but the last. The session's lock is held for the whole turn;
        close the iterator (``contextlib.aclosing``) when stopping early, so the lock is released at
        once. The stepper decodes the turn on its own once its prefill ran, and may run ahead of
        the tokens taken from here; a turn closed early stops at the step after, its session then
        holding the tokens computed so far (the next turn's prompt reuses what it shares).

        A prefill the model's KV memory bound refuses (``QuotaExceeded``) drops the least recently
        used session no turn holds and starts again, until it fits or every session is in use; then,
        where the turn's own session holds KV (whose growth needs the old buffers and the new ones at
        once), it drops that KV too and computes the prompt afresh, once.

        Raises:
            InvalidRequest, TurnTooLarge: see ``validate`` (raised on the first iteration;
                ``prompt_param`` names the prompt's field).
            QuotaExceeded: the turn does not fit the model's KV memory bound beside what the turns
                in flight hold (it would once they end: worth retrying).
        """
        self.validate(prompt_ids, sampling, prompt_param)
        prompt = [int(t) for t in prompt_ids]
        self.active += 1
        try:
            sess = session if session is not None else self.sessions.get(session_id)
            if sess.release is None:
                sess.release = self._released.append
            async with sess.lock:
                run = self._begin(sess, prompt, sampling)
                prefilling = len(prompt) - run.step.keep
                try:
                    while True:
                        try:
                            tok = await run.next()
                        except QuotaExceeded:
                            if not prefilling or not (self._make_room() or self._start_afresh(sess)):
                                raise
                            run.cancelled = True  # the refused prefill; the turn starts again
                            self.pending_prefill_tokens -= prefilling
                            self.pending_prefills -= 1
                            run = self._begin(sess, prompt, sampling)
                            prefilling = len(prompt) - run.step.keep
                            continue
                        if prefilling:
                            self.pending_prefill_tokens -= prefilling
                            self.pending_prefills -= 1
                            prefilling = 0
                        yield tok
                        if tok.finish_reason:
                            return
                finally:
                    run.cancelled = True  # the stepper drops what is left of the turn
                    if prefilling:
                        self.pending_prefill_tokens -= prefilling
                        self.pending_prefills -= 1
        finally:
            self.active -= 1
            if session_id:
                self.sessions.evict()
            elif session is None:
                sess.drop()  # a stateless turn's KV goes back at once

    def _make_room(self) -> bool:
        """Drop the least recently used session no turn holds (the model's KV memory bound refused
        a prefill): its KV goes back to the model before the next run. False when every session is
        in use."""
        victim = self.sessions.evict_one()
        if victim is not None:
            log.info("local session %s dropped: the model's KV memory bound needs its room", victim)
        return victim is not None

    @staticmethod
    def _start_afresh(sess: LocalSession) -> bool:
        """Drop the KV the turn's own session holds (its growth did not fit beside it: the prompt is
        computed anew into buffers of the turn's size). False when it holds none."""
        if sess.kv is None:
            return False
        log.info("a local session's KV dropped: its growth does not fit beside it in the KV memory bound")
        sess.drop(final=False)
        return True

    def _begin(self, sess: LocalSession, prompt: list[int], s: Sampling) -> TurnRun:
        """The turn's state, its prefill queued (counted in ``pending_prefill_tokens``)."""
        keep = min(sess.common_prefix(prompt), len(prompt) - 1)
        self.last_computed_tokens, self.last_reused_tokens = len(prompt) - keep, keep
        rng = sampling_rng(s.seed)
        greedy = s.temperature < SAMPLING_EPS
        step = DecodeStep(sess, 0, keep, greedy, len(prompt) + s.max_new_tokens, _draw(s, rng))
        stops = frozenset(s.stop_token_ids) | (frozenset() if s.ignore_eos else self.eos_token_ids)
        run = TurnRun(asyncio.get_running_loop(), step, prompt, s, stops, rng)
        self.pending_prefill_tokens += len(prompt) - keep
        self.pending_prefills += 1
        self._stepper.submit(functools.partial(self._start_turn, run))
        return run

    async def warmup(self, n_tokens: int = 32) -> None:
        """A prefill of ``n_tokens`` (at least 2) and a few decode steps, twice: the first pass
        untimed (ONNX Runtime's first runs allocate and pick kernels, and a CUDA-graph model captures
        its decode step, whose buffers the second pass reuses), the second sets the measured rates.
        Then, for a model that names them (``DecoderGraph.warm_capacities``: CUDA graphs), one turn
        of the same prompt per larger KV capacity, stopped after a few decode steps, so that each
        capacity's decode graph is set up before a served turn needs it (as vLLM captures its CUDA
        graphs at start-up). A capacity that no turn within the engine's positions reaches, or that
        the engine refuses (``QuotaExceeded``, ``TurnTooLarge``, ``InvalidRequest``), ends that part,
        logged; the edge starts without it. Last, a model with a fixed set of prefill shapes
        (``DecoderGraph.warm_prefills``, ``edge.compute.prefill``) runs each of them once. The
        measured rates are the second pass's alone (a decode step on a larger capacity attends over
        more positions, and the set-up runs say nothing of a served turn). Stateless."""
        n = max(2, min(n_tokens, self.shape.max_position_embeddings - WARMUP_DECODE_STEPS))
        ids = [(1 + 7919 * i) % self.shape.vocab_size for i in range(n)]
        for timed in (False, True):
            if timed:
                self.prefill_rate, self.decode_rate = Ewma(), Ewma()
            await self._warm_turn(ids, n + WARMUP_DECODE_STEPS)
        self._measuring = False  # the rates are the timed pass's: larger capacities and shapes set up only
        try:
            await self._warm_up_shapes(ids, n)
        finally:
            self._measuring = True

    async def _warm_up_shapes(self, ids: list[int], n: int) -> None:
        """``warmup``'s set-up after its timed pass: a turn per larger KV capacity, then the model's
        prefill shapes (see ``warmup``)."""
        capacities: list[int] = getattr(self.model, "warm_capacities", list)()
        t0, warmed = time.perf_counter(), list[int]()
        for cap in capacities:
            # a turn holds at most the positions this engine serves (``load_local``'s ``max_positions``
            # may be fewer than the graph's): its longest turn lands in the first capacity past them
            tokens = min(cap, self.shape.max_position_embeddings)
            if tokens <= (warmed[-1] if warmed else n):
                break
            try:
                await self._warm_turn(ids, tokens)
            except (QuotaExceeded, TurnTooLarge, InvalidRequest) as e:  # refused: the edge starts without it
                log.info("decode graphs not set up past KV capacity %s: %s", warmed[-1] if warmed else "-", e)
                break
            warmed.append(cap)
        if warmed:
            log.info("decode graphs set up for KV capacities %s in %.1f s", warmed, time.perf_counter() - t0)
        warm_prefills: Callable[[int], list[int]] | None = getattr(self.model, "warm_prefills", None)
        if warm_prefills is not None:
            t0 = time.perf_counter()
            caps, _ = await self._run_job(functools.partial(warm_prefills, self.shape.max_position_embeddings))
            if caps:
                log.info("prefill shapes run on KV capacities %s in %.1f s", caps, time.perf_counter() - t0)

    async def _warm_turn(self, ids: list[int], tokens: int) -> None:
        """A stateless turn of ``ids`` whose prompt and ``max_new_tokens`` come to ``tokens`` (its KV
        slot the capacity that holds them), EOS ignored, stopped after ``WARMUP_DECODE_STEPS``
        tokens."""
        sampling = Sampling(max_new_tokens=tokens - len(ids), ignore_eos=True)
        async with contextlib.aclosing(self.generate(ids, sampling)) as it:
            got = 0
            async for _ in it:
                got += 1
                if got >= WARMUP_DECODE_STEPS:
                    break


@dataclass(frozen=True)
class LocalStep:
    token_id: int
    t_s: float  # perf_counter() when the token was sampled


class LocalGenerator:
    """Synchronous, stateless driver of a ``LocalModel``'s runs, for the edge-only baseline of the
    benchmarks (no event loop, no sessions)."""

    def __init__(self, model_path: Path, shape: ModelShape, intra_op_threads: int = 0) -> None:
        self.model = load_local_model(model_path, shape, intra_op_threads)
        self.engine = LocalEngine(self.model, shape, ())
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
        greedy = s.temperature < SAMPLING_EPS  # as ``Sampling`` took it (a low temperature raised)
        kv = self.model.new_kv(len(prompt_ids) + max_new_tokens)
        new = list(prompt_ids)
        try:
            for _ in range(max_new_tokens):
                draw = _draw(s, rng)
                tok_, logits, _ms = self.model.run(kv, new, greedy, draw)
                tok = next_token(tok_, logits, s, draw.uniform if draw else 0.0)
                yield LocalStep(tok, time.perf_counter())
                if tok in stop:
                    return
                new = [tok]
        finally:
            self.model.release(kv)
