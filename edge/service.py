"""The edge's domain service: one chat turn from messages to streamed text.

``EdgeService.chat`` reads like the design's data path: tokenize -> head over
the tokens the edge has not processed -> frame activations (CRC32C) and new
full KV blocks (BLAKE3 leaves, RFC 6962 root) -> stream to the cloud over the
``CloudLink`` -> detokenize tokens as they come back. No grpc here; ``edge.server``
adapts it, ``edge.grpc_link`` carries it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from tandem.common import merkle, metrics, wire
from tandem.common.chat import prompt_token_ids
from tandem.common.errors import (
    DeadlineExceeded,
    EngineError,
    InvalidRequest,
    LinkLost,
    ModeUnavailable,
    ParamsVersionMismatch,
    QuotaExceeded,
    SessionOutOfSync,
    TandemError,
)
from tandem.common.kvblocks import LayerRange, block_hashes, request_seed, split_blocks
from tandem.common.kvwire import encode_kv, kv_raw_nbytes
from tandem.common.logs import bind_request, current_request_id, new_request_id, turn_log
from tandem.common.manifest import ModelShape
from tandem.common.messages import KVBlock, TokensOut, TurnFinal, TurnHeader, UploadAck
from tandem.common.modes import Mode
from tandem.common.params import LinkParams, SyncRequest
from tandem.common.tracing import span, traced
from tandem.edge.batcher import HeadBatcher
from tandem.edge.cloudconn import CloudTarget, upload_receive_ms
from tandem.edge.costmodel import CostModel, LinkState, Prediction, RequestShape, Route
from tandem.edge.detok import TextStream
from tandem.edge.events import ChatTurn, SentBytes, TextOut, TurnDone
from tandem.edge.head_runner import HeadInput
from tandem.edge.local import LocalEngine
from tandem.edge.session import EdgeSession, EdgeSessions
from tandem.edge.uplink import OutgoingTurn, Pieces, stream_turn
from tandem.stages import Stage, Timings

log = logging.getLogger("tandem.edge")
MAX_RESUMES = 3  # continuations of one turn after mid-stream cloud failures


@dataclass
class TurnClock:
    """One turn's request id (sent to the cloud, on every log line), stage timings from its
    start, when tokens arrived, and the mode that served it."""

    t_start: float = field(default_factory=time.perf_counter)
    timings: Timings = field(default_factory=dict)
    acked: bool = False  # the cloud verified this turn's upload (its session moved on)
    request_id: str = field(default_factory=new_request_id)
    token_times: list[float] = field(default_factory=list)  # perf_counter at each arrival of tokens
    mode: Mode = Mode.AUTO  # the mode that served the turn (the requested one until a mode runs)
    text: TextStream | None = None  # the turn's output so far, shared by its legs when it resumes
    resumes: int = 0  # times the turn continued after its cloud failed mid-stream
    cloud_called: bool = False  # a Generate call of this turn reached the cloud
    session_expired: bool = False  # the edge had evicted this turn's session (bounded state)

    def since(self, stage: Stage, t0: float | None = None) -> None:
        self.timings[stage] = (time.perf_counter() - (self.t_start if t0 is None else t0)) * 1e3

    def tokens_arrived(self) -> None:
        """New output tokens arrived (the first ones set the time to first token)."""
        self.token_times.append(time.perf_counter())
        if len(self.token_times) == 1:
            self.since(Stage.TTFT)


def max_token_chars(tokenizer: Any, default: int = 64) -> int:
    """Most characters one token of ``tokenizer`` stands for (its longest vocabulary entry; byte-level
    BPE entries are one character per byte, so this bounds characters too); ``default`` if unknown."""
    try:
        return max(len(t) for t in tokenizer.get_vocab()) or default
    except (AttributeError, TypeError, ValueError):
        return default


async def _acquire(lock: asyncio.Lock, timeout_s: float, session_id: str) -> None:
    """Raises DeadlineExceeded when another turn of the session holds ``lock`` past ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            await lock.acquire()
    except TimeoutError:
        raise DeadlineExceeded(f"session {session_id!r} busy with another turn past the deadline") from None


@dataclass
class Head:
    """An edge head at split layer ``k``: its batched ONNX runner and the manifest key it was cut with."""

    batcher: HeadBatcher
    compatibility_key: str

    @property
    def k(self) -> int:
        return self.batcher.head.k


@dataclass(frozen=True)
class Decision:
    """The route a turn runs on, the cost model's prediction for it, and why it was chosen."""

    route: Route
    prediction: Prediction | None
    reason: str


class EdgeService:
    """Holds the tokenizer, the heads, the local model, sessions, the link to the cloud and the
    cost model that picks a route per request (``edge.costmodel``)."""

    def __init__(
        self,
        tokenizer,
        heads: list[Head],
        conn: CloudTarget | None,
        sessions: EdgeSessions,
        turn_timeout_s: float,
        *,
        local: LocalEngine | None = None,
        max_prompt_tokens: int = 1536,
        cost: CostModel | None = None,
        shape: ModelShape | None = None,
        renegotiate_wait_s: float = 5.0,
        pipeline_tokens: int = 0,
    ) -> None:
        """``pipeline_tokens``: head tokens per piece of a pipelined split turn (see ``_pieces``);
        0 = the head runs whole before the upload starts."""
        if not heads and local is None:
            raise ValueError("an edge needs a head (split) or the whole model (local)")
        self.tok, self.conn = tokenizer, conn
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_ids: frozenset[int] = frozenset([eos] if isinstance(eos, int) else [])  # the server sets all
        self._local_engine: LocalEngine | None = None
        self._cost = cost or CostModel()
        self._cost.pipeline_tokens = pipeline_tokens
        self.local = local
        self.heads = {h.k: h for h in heads}
        self.sessions = sessions
        self.turn_timeout_s = turn_timeout_s
        self.shape = shape  # for wire bytes per token in the cost model (None: wire time not modelled)
        self.renegotiate_wait_s = renegotiate_wait_s
        self._max_prompt_tokens = max_prompt_tokens
        # no text longer than this can fit in max_prompt_tokens: every token covers at most
        # max_token_chars characters, so longer text is refused before it is tokenized
        self._token_chars = max_token_chars(tokenizer)
        self._inflight: set[str] = set()  # request ids of the turns in flight
        self._cloud_inflight = 0  # this edge's turns in the cloud now
        metrics.watch_edge_sessions(sessions)
        if conn is not None:
            metrics.watch_link(conn)

    @property
    def local(self) -> LocalEngine | None:
        """The whole model on this edge (local mode), or None."""
        return self._local_engine

    @local.setter
    def local(self, engine: LocalEngine | None) -> None:
        self._local_engine = engine
        self._share_local_rates()

    @property
    def cost(self) -> CostModel:
        """The cost model that predicts each mode's TTFT."""
        return self._cost

    @cost.setter
    def cost(self, model: CostModel) -> None:
        model.pipeline_tokens = self._cost.pipeline_tokens
        self._cost = model
        self._share_local_rates()

    @property
    def pipeline_tokens(self) -> int:
        """Head tokens per piece of a pipelined split turn (0: off); the cost model reads the same."""
        return self._cost.pipeline_tokens

    @pipeline_tokens.setter
    def pipeline_tokens(self, n: int) -> None:
        self._cost.pipeline_tokens = n

    def _share_local_rates(self) -> None:
        """One measurement of the local model's rates: the cost model reads the engine's own EWMAs."""
        if self._local_engine is not None:
            self._cost.edge.local_prefill_ms_per_token = self._local_engine.prefill_rate
            self._cost.edge.local_decode_ms_per_token = self._local_engine.decode_rate

    # ------------------------------------------------------------------ what this edge can do now

    @property
    def batcher(self) -> HeadBatcher:
        """The head batcher of the deepest split held (tests and tools)."""
        return self.heads[max(self.heads)].batcher

    @property
    def max_prompt_tokens(self) -> int:
        """Longest prompt accepted: the edge's bound, and the cloud's while connected."""
        p = self.conn.current().params(0) if self.conn is not None else None
        return min(self._max_prompt_tokens, p.max_prompt_tokens) if p is not None else self._max_prompt_tokens

    @property
    def max_prompt_chars(self) -> int:
        """No text longer than this can fit in ``max_prompt_tokens`` (refused before tokenizing)."""
        return self.max_prompt_tokens * self._token_chars

    @property
    def max_new_tokens(self) -> int:
        p = self.conn.current().params(0) if self.conn is not None else None
        return p.max_new_tokens if p is not None else 4096

    @property
    def split_layers(self) -> tuple[int, ...]:
        """Split layers usable now: the edge holds the head and the connected cloud the tail."""
        if self.conn is None:
            return ()
        return tuple(k for k in self.conn.current().split_layers if k in self.heads)

    def routes(self) -> list[Route]:
        """Routes servable now."""
        out = [Route(Mode.LOCAL)] if self.local is not None else []
        if self.conn is not None and self.conn.current().params(0) is not None:
            out += [Route(Mode.SPLIT, k) for k in self.split_layers] + [Route(Mode.DIRECT)]
        return out

    def degraded(self) -> str:
        """Why not every mode this edge was built for is available ("" when all are)."""
        if self.conn is None:
            return ""
        c = self.conn.current()
        if c.params(0) is None:
            return f"cloud not connected ({c.last_error or 'connecting'}): local mode only"
        missing = sorted(set(self.heads) - set(self.split_layers))
        return f"the cloud serves no tail for k in {missing}" if missing else ""

    # ------------------------------------------------------------------ tokenize and decide

    @traced("tokenize")
    def tokenize(self, turn: ChatTurn) -> list[int]:
        """Prompt token ids. Raises InvalidRequest for an empty or too long prompt."""
        if turn.messages and turn.prompt:
            raise InvalidRequest("pass messages or a prompt, not both")
        limit = self.max_prompt_tokens
        n_chars = len(turn.prompt) + sum(len(c) for _, c in turn.messages)
        if n_chars > self.max_prompt_chars:
            raise InvalidRequest(f"prompt of {n_chars} characters cannot fit in {limit} tokens")
        messages = [{"role": r, "content": c} for r, c in turn.messages]
        ids = prompt_token_ids(self.tok, messages or None, turn.prompt or None)
        if not 0 < len(ids) <= limit:
            raise InvalidRequest(f"prompt has {len(ids)} tokens; this edge allows 1..{limit}")
        return ids

    def link_state(self) -> LinkState:
        """The cost model's view of the link and the cloud right now."""
        st = LinkState(num_layers=self.shape.num_layers if self.shape else 30)
        if self.conn is None:
            return st
        c = self.conn.current()
        load = c.load
        st.rtt_ms, st.goodput_mbps = c.rtt_ms.value, c.goodput_mbps.value
        st.cloud_prefill_ms_per_token = load.prefill_ms_per_token
        st.cloud_tail_prefill_ms_per_token = dict(load.tail_prefill_ms_per_token)
        st.queue_wait_ms = load.queue_wait_ms
        p = c.params(0)
        share = p.max_concurrent_requests if p is not None else 1
        st.cloud_busy = load.waiting_requests > 0 or self._cloud_inflight >= share
        for k in self.heads:
            pk = c.params(k)
            if pk is not None:
                st.block_size_tokens = pk.kv_block_size_tokens
                ratio = self.codec_ratio if pk.codec != wire.Codec.NONE else 1.0
                per_token = self.wire_bytes_per_token(k, pk.wire_dtype, pk.kv_wire_dtype, pk.kv_block_size_tokens)
                st.bytes_per_token[k] = per_token * ratio
        return st

    codec_ratio = 1.0  # compressed / raw size of this model's wire bytes under zstd (measured at start-up)

    def wire_bytes_per_token(
        self, k: int, dtype: wire.WireDtype, kv_dtype: wire.WireDtype = wire.WireDtype.FP32, block_tokens: int = 32
    ) -> float:
        """Uncompressed uplink bytes per prompt token at split layer ``k``: activations in ``dtype``
        and head KV of layers ``[0, k)`` in ``kv_dtype`` (its scales spread over a block of
        ``block_tokens``); 0 without a model shape."""
        if self.shape is None:
            return 0.0
        sh = self.shape
        block = kv_raw_nbytes((k, 2, sh.num_kv_heads, block_tokens, sh.head_dim), kv_dtype) if k else 0
        return wire.raw_nbytes_of(1, dtype, sh.hidden_size) + block / block_tokens

    def request_shape(self, turn: ChatTurn, ids: list[int]) -> RequestShape:
        """What the session already holds, per route (for the cost model)."""
        local_cached = self.local.cached_tokens(turn.session_id, ids) if self.local is not None else 0
        s = self.sessions.peek(turn.session_id) if turn.session_id else None
        head, cloud = {}, {}
        if s is not None and s.k in self.heads:
            head[s.k] = s.common_prefix(ids)
            cloud[s.k] = min(s.cloud_tokens, s.common_prefix(ids))
        return RequestShape(len(ids), local_cached, head, cloud)

    def decide(self, turn: ChatTurn, ids: list[int]) -> Decision:
        """The route for this turn: the requested one (refused with a clear error when it cannot
        run), or in auto mode the cost model's choice among the routes servable now.

        Raises:
            ModeUnavailable: the requested mode (or split layer) is not available on this edge now.
        """
        routes = self.routes()
        want = turn.mode
        if want is Mode.LOCAL:
            if self.local is None:
                raise ModeUnavailable("local mode needs the whole model on the edge (edge-full.onnx); none loaded")
            candidates = [Route(Mode.LOCAL)]
        elif want is Mode.DIRECT:
            if Route(Mode.DIRECT) not in routes:
                raise EngineError(f"direct mode needs the cloud; {self.degraded() or 'not connected'}")
            candidates = [Route(Mode.DIRECT)]
        elif want is Mode.SPLIT:
            ks = [turn.split_layer] if turn.split_layer else sorted(self.heads)
            candidates = [Route(Mode.SPLIT, k) for k in ks if Route(Mode.SPLIT, k) in routes]
            if not candidates:
                if turn.split_layer and turn.split_layer not in self.heads:
                    raise ModeUnavailable(
                        f"this edge holds heads for k in {sorted(self.heads)}, not k={turn.split_layer}"
                    )
                raise EngineError(f"split mode needs the cloud and a common split layer; {self.degraded()}")
        else:
            candidates = routes
        if not candidates:
            raise EngineError(f"no mode can serve now: {self.degraded()}")
        # every turn gets a prediction, so that every turn calibrates the cost model (and reports its error)
        shape, link = self.request_shape(turn, ids), self.link_state()
        preds = [self.cost.predict(r, shape, link) for r in candidates]
        if len(preds) == 1 and want is not Mode.AUTO:
            return Decision(preds[0].route, preds[0], "requested")
        if want is not Mode.AUTO:
            best = min(preds, key=lambda p: p.ttft_ms)
            return Decision(best.route, best, f"requested {want}; lowest predicted TTFT of its split layers")
        pick, why = self.cost.choose(preds)
        return Decision(pick.route, pick, f"auto: {why}")

    # ------------------------------------------------------------------ the turn

    async def chat(self, turn: ChatTurn, timeout_s: float | None = None) -> AsyncIterator[TextOut | TurnDone]:
        """Run one turn within ``timeout_s`` (default ``turn_timeout_s``); yields text deltas then a
        ``TurnDone``. A turn that fails before the cloud acknowledged its upload leaves the session
        as it was before the turn. Its request id (``_turn_id``) is on every log line of the turn; its
        metrics and spans are recorded (``common.metrics``, ``common.tracing``).

        Raises:
            InvalidRequest: bad prompt or sampling parameters.
            ModeUnavailable: the requested mode cannot run on this edge.
            TandemError: the cloud's verdict, EngineError (cloud unreachable), DeadlineExceeded.
        """
        clock = TurnClock(mode=turn.mode)
        with (
            self._turn_id(clock) as rid,
            bind_request(rid, turn.session_id),
            turn_log(log, turn.mode) as done_fields,
            metrics.edge_turn(clock) as counts,
            span("edge_turn", mode=turn.mode, request_id=rid, session_id=turn.session_id),
        ):
            inner, finished = self._chat(turn, clock, timeout_s), False
            try:
                async for ev in inner:
                    if isinstance(ev, TurnDone):
                        counts.update(
                            prompt_tokens=ev.prompt_tokens, output_tokens=ev.output_tokens, head_tokens=ev.head_tokens
                        )
                        done_fields.update(
                            counts,
                            mode=ev.mode,
                            k=ev.split_layer,
                            finish=ev.finish_reason,
                            ttft_ms=round(ev.ttft_ms, 1),
                            predicted_ttft_ms=round(ev.predicted_ttft_ms, 1),
                        )
                        finished = True
                    yield ev
            except GeneratorExit:  # the consumer stopped reading: a cancel, unless the turn had finished
                await inner.aclose()
                if not finished:
                    raise

    @contextlib.contextmanager
    def _turn_id(self, clock: TurnClock) -> Iterator[str]:
        """Give the turn (``clock.request_id``) the request id its caller bound (a servicer binds one
        per call) unless it is not a short ASCII id or a turn in flight has it; else a new one."""
        rid = current_request_id()
        if not (0 < len(rid) <= 64 and rid.isascii()) or rid in self._inflight:
            rid = new_request_id()
        clock.request_id = rid
        self._inflight.add(rid)
        try:
            yield rid
        finally:
            self._inflight.discard(rid)

    async def _chat(
        self, turn: ChatTurn, clock: TurnClock, timeout_s: float | None
    ) -> AsyncGenerator[TextOut | TurnDone, None]:
        """Run the turn's legs (``_legs``) within its deadline. A cloud that fails after tokens
        reached the client (its process died, the link dropped, an engine died: ``EngineError``)
        does not end the turn: it resumes from the prompt plus the tokens already emitted, on the
        cloud once it (or a restarted instance) answers, or at once locally in auto mode, so the
        client sees one continuous stream in which no token repeats (greedy decoding gives the
        tokens an unbroken run gives). At most ``MAX_RESUMES`` times; past the deadline, a
        ``DeadlineExceeded`` that names the failure."""
        timeout_s = self.turn_timeout_s if timeout_s is None else min(timeout_s, self.turn_timeout_s)
        deadline = asyncio.get_running_loop().time() + timeout_s
        ids = await asyncio.to_thread(self.tokenize, turn)  # long prompts must not stall other requests
        clock.since(Stage.TOKENIZE)
        text = clock.text = TextStream(self.tok, turn.stop)
        leg_turn, leg_ids = turn, ids
        finished = False
        while True:
            try:
                async for ev in self._legs(leg_turn, leg_ids, clock, deadline):
                    if isinstance(ev, TurnDone):
                        finished = True
                        if clock.resumes:  # the whole turn's output, not the last leg's
                            n_out = len(text.token_ids)
                            ev = replace(ev, prompt_tokens=len(ids), output_tokens=n_out, resumes=clock.resumes)
                    yield ev
                return
            except EngineError as e:
                if finished:  # the answer ended; the connection broke only afterwards
                    log.info("the cloud's stream broke after the turn ended (%s): nothing lost", e)
                    return
                out = text.token_ids
                left = turn.sampling.max_new_tokens - len(out)
                ended = bool(out) and (
                    out[-1] in turn.sampling.stop_token_ids
                    or (out[-1] in self.eos_token_ids and not turn.sampling.ignore_eos)
                )
                if out and (left <= 0 or ended):  # only the final message was lost: finish here
                    async for ev in self._finish_without_cloud("stop" if ended else "length", ids, clock):
                        yield ev
                    return
                # tokens reached the client, or the connection broke under the turn (no verdict): go on
                began = bool(out) or (clock.cloud_called and isinstance(e, LinkLost))
                too_long = len(ids) + len(out) > self.max_prompt_tokens
                if not began or clock.mode is Mode.LOCAL or too_long or clock.resumes >= MAX_RESUMES:
                    raise
                # tokens already reached the client: continue from the prompt plus them, never repeat them
                clock.resumes += 1
                metrics.record_resume()
                log.warning("the cloud failed after %d tokens (%s): resuming", len(text.token_ids), e)
                leg_ids = ids + text.token_ids
                leg_turn = replace(turn, sampling=replace(turn.sampling, max_new_tokens=left))
                if turn.mode is not Mode.AUTO or self.local is None:
                    await self._wait_for_cloud(deadline, e)
                    if not text.token_ids:  # nothing streamed yet: back off before sending it all again
                        left_s = deadline - asyncio.get_running_loop().time()
                        await asyncio.sleep(max(0.0, min(left_s, 0.25 * 2**clock.resumes)))

    async def _finish_without_cloud(
        self, finish: str, ids: list[int], clock: TurnClock
    ) -> AsyncIterator[TextOut | TurnDone]:
        """End a turn whose every token reached the client but whose final message was lost."""
        text = clock.text
        assert text is not None
        rest = text.flush()
        if rest:
            yield TextOut(rest, ())
        clock.since(Stage.TOTAL)
        mode = clock.mode if clock.mode in (Mode.LOCAL, Mode.SPLIT, Mode.DIRECT) else Mode.DIRECT
        d = Decision(Route(mode), None, "resumed")
        done = self._turn_done(finish, len(ids), clock, d, text.token_ids, 0, 0, 0, None, 0)
        yield replace(done, resumes=clock.resumes)

    def _move_replica(self, turn: ChatTurn, clock: TurnClock, cause: Exception) -> bool:
        """With several cloud replicas: mark the turn's replica down (its connection reconnects in
        the background) and pin the turn to the next healthy one. False if there is none."""
        if self.conn is None or clock.mode is Mode.LOCAL:
            return False
        if self.conn.fail_over(self.conn.current(), turn.session_id or clock.request_id, cause) is None:
            return False
        metrics.record_fallback("replica down")
        return True

    async def _wait_for_cloud(self, deadline: float, cause: Exception) -> None:
        """Wait until the cloud (this or a restarted instance) answers again, at most to ``deadline``.

        Raises:
            DeadlineExceeded: it did not answer in time (the message names the failure).
        """
        assert self.conn is not None
        self.conn.current().renegotiate_soon(f"a turn's stream failed ({cause})")
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0 or not await self.conn.wait_connected(left):
            raise DeadlineExceeded(f"the cloud failed mid-stream ({cause}) and did not come back before the deadline")

    async def _legs(
        self, turn: ChatTurn, ids: list[int], clock: TurnClock, deadline: float
    ) -> AsyncGenerator[TextOut | TurnDone, None]:
        """One leg of a turn: decide the route and run it; in auto mode a cloud that refuses before
        the first token (busy, unreachable) is answered by local mode, and a stale params version
        by renegotiating and running again."""
        timeout_s = max(0.001, deadline - asyncio.get_running_loop().time())
        text = clock.text
        assert text is not None
        if self.conn is not None:  # one replica for the whole leg (the session's, by rendezvous hashing)
            c = self.conn.pin(turn.session_id or clock.request_id)
            may_wait = turn.mode is not Mode.AUTO or self.local is None  # no local mode to serve meanwhile
            if c.reconnecting and not c.connected.is_set() and may_wait:
                await self.conn.wait_connected(min(self.renegotiate_wait_s, timeout_s))  # its link is set up again
        decision = self.decide(turn, ids)
        for attempt in (0, 1, 2):
            before = len(text.token_ids)
            started = False
            try:
                async for ev in self._run_route(decision, turn, ids, clock, timeout_s):
                    started = True
                    yield ev
                return
            except ParamsVersionMismatch as e:
                started = started or len(text.token_ids) > before
                if started or attempt or self.conn is None:
                    raise
                m = self.conn.current()  # this replica's link
                m.renegotiate_soon(f"the cloud refused this link's params ({e})")
                await m.wait_connected(min(self.renegotiate_wait_s, timeout_s))
                decision = self.decide(turn, ids)
            except (QuotaExceeded, EngineError) as e:
                started = started or len(text.token_ids) > before
                if not started and isinstance(e, EngineError) and self._move_replica(turn, clock, e):
                    decision = self.decide(turn, ids)
                    continue
                if started or turn.mode is not Mode.AUTO or self.local is None or decision.route.mode is Mode.LOCAL:
                    raise
                reason = "cloud busy" if isinstance(e, QuotaExceeded) else "cloud unavailable"
                log.info("%s (%s): serving this turn locally", reason, e)
                metrics.record_fallback(reason)
                local = Route(Mode.LOCAL)
                decision = Decision(
                    local,
                    self.cost.predict(local, self.request_shape(turn, ids), self.link_state()),
                    f"fallback: {reason}",
                )
        raise EngineError("no mode could serve this turn")  # not reached: the last attempt returns or raises

    async def _run_route(
        self, d: Decision, turn: ChatTurn, ids: list[int], clock: TurnClock, timeout_s: float
    ) -> AsyncIterator[TextOut | TurnDone]:
        clock.mode = d.route.mode
        self.cost.ran(d.route)
        events = (
            self._local(turn, ids, clock, d)
            if d.route.mode is Mode.LOCAL
            else self._cloud(turn, ids, clock, timeout_s, d)
        )
        async for ev in events:
            if isinstance(ev, TurnDone) and d.prediction is not None and ev.ttft_ms > 0 and not clock.resumes:
                self.cost.observe(d.prediction, ev.ttft_ms, ev.timings)
                metrics.record_prediction(d.route.mode, d.prediction.ttft_ms, ev.ttft_ms)
            yield ev

    async def _local(
        self, turn: ChatTurn, ids: list[int], clock: TurnClock, d: Decision
    ) -> AsyncIterator[TextOut | TurnDone]:
        """Local mode: the whole model here (``edge.local.LocalEngine``), streamed and detokenized."""
        assert self.local is not None  # decided only when present
        text = clock.text or TextStream(self.tok, turn.stop)
        out: list[int] = []
        finish = "length"
        t0 = time.perf_counter()
        self.cost.edge.local_active = self.local.active
        async for step in self.local.generate(ids, turn.sampling, turn.session_id):
            if not out:
                clock.since(Stage.LOCAL_PREFILL, t0)
            clock.tokens_arrived()
            out.append(step.token_id)
            delta = text.feed([step.token_id])
            if delta:
                yield TextOut(delta, (step.token_id,))
            if text.stopped:
                finish = "stop"
                break
            if step.finish_reason is not None:
                finish = step.finish_reason
        rest = text.flush()
        if rest:
            yield TextOut(rest, ())
        clock.since(Stage.TOTAL)
        yield self._turn_done(finish, len(ids), clock, d, text.token_ids, 0, 0, 0, None, 0)

    def _turn_done(
        self,
        finish: str,
        prompt_tokens: int,
        clock: TurnClock,
        d: Decision,
        out_ids: list[int],
        head_tokens: int,
        external_tokens: int,
        k: int,
        sent: SentBytes | None,
        params_version: int,
        resent_chunks: int = 0,
        repaired_blocks: int = 0,
    ) -> TurnDone:
        return TurnDone(
            finish,
            prompt_tokens,
            len(out_ids),
            head_tokens,
            external_tokens,
            k,
            dict(clock.timings),
            sent,
            tuple(out_ids),
            mode=d.route.mode,
            predicted_ttft_ms=d.prediction.ttft_ms if d.prediction is not None else 0.0,
            ttft_ms=clock.timings.get(Stage.TTFT, 0.0),
            params_version=params_version,
            mode_reason=d.reason,
            session_expired=clock.session_expired,
            resent_chunks=resent_chunks,
            repaired_blocks=repaired_blocks,
        )

    async def _cloud(
        self, turn: ChatTurn, ids: list[int], clock: TurnClock, timeout_s: float, d: Decision
    ) -> AsyncIterator[TextOut | TurnDone]:
        """Split or direct mode: the turn through the cloud, under the link's current params."""
        assert self.conn is not None
        k = d.route.k
        params = self.conn.current().params(k)
        if params is None:
            raise EngineError(f"no link params for split layer {k}: the cloud is not connected")
        split = k > 0
        if split and self.sessions.expired(turn.session_id):
            clock.session_expired = True
            log.info("session %s had expired (evicted by the edge's bound): starting it again", turn.session_id)
        session = self.sessions.get(turn.session_id) if split else EdgeSession()
        self._cloud_inflight += 1
        try:
            await _acquire(session.lock, timeout_s, turn.session_id)
            before = session.snapshot()
            try:
                if split and session.k != k:
                    session.reset(k)
                seg = self._pipeline_tokens(session, ids, params) if split else 0
                if seg:  # the head runs piece by piece inside the first upload attempt
                    head_tokens = len(ids) - session.common_prefix(ids)
                else:
                    head_tokens = await self._run_head(session, ids, clock, k) if split else 0
                async for ev in self._send_and_stream(
                    session, ids, turn, params, clock, head_tokens, timeout_s, d, seg
                ):
                    yield ev
            except BaseException:
                if not clock.acked:  # nothing of this turn reached the cloud's session: keep no work of it
                    session.restore(before)
                raise
            finally:
                session.lock.release()
        finally:
            self._cloud_inflight -= 1
            if split and turn.session_id:
                self.sessions.discard_if_empty(turn.session_id)
                self.sessions.evict()

    async def _send_and_stream(
        self,
        s: EdgeSession,
        ids: list[int],
        turn: ChatTurn,
        params: LinkParams,
        clock: TurnClock,
        head_tokens: int,
        timeout_s: float,
        d: Decision,
        pipeline_tokens: int = 0,
    ) -> AsyncIterator[TextOut | TurnDone]:
        """Send what the cloud lacks. When the cloud's copy may differ from what this edge believes
        (another cloud instance since the session's last turn, or the cloud refused the turn as out
        of sync), ``SyncSession`` first finds what it holds and only the rest is sent; if the cloud
        still refuses, the turn is resent from token 0 once. With ``pipeline_tokens`` the first
        attempt runs the head piece by piece while its pieces travel (``_pieces``); a later attempt
        first finishes a head that attempt left unfinished."""
        k = params.split_layer
        for attempt in (0, 1, 2):
            seg = pipeline_tokens if attempt == 0 else 0
            if k and not seg and s.token_ids != list(ids):  # a pipelined attempt ended before its head did
                await self._run_head(s, ids, clock, k)
            if k and turn.session_id and (attempt == 1 or (attempt == 0 and self._needs_sync(s))):
                await self._sync(s, turn.session_id, params, timeout_s)
            pieces = None
            if seg:
                out, pieces = self._build_pipelined_turn(s, ids, turn, params, clock, seg)
            else:
                out = self._build_turn(s, ids, turn, params, clock, resend_all=attempt == 2)
            try:
                async for ev in self._stream(out, s, ids, clock, head_tokens, timeout_s, turn.stop, d, pieces):
                    yield ev
                return
            except SessionOutOfSync as e:
                if attempt == 2:
                    raise
                log.info("the cloud's copy of this session differs (%s): %s", e, "sync" if not attempt else "resend")
                if attempt == 1:
                    metrics.record_session_resync()

    def _instance_id(self) -> str:
        """The instance id of the cloud (the turn's replica) this edge is negotiated with; "" if none."""
        n = self.conn.current().negotiated if self.conn is not None else None
        return n.instance_id if n is not None else ""

    def _needs_sync(self, s: EdgeSession) -> bool:
        """The session's cloud state was acknowledged by another cloud instance (a restart, or
        another replica) than the one connected now."""
        now = self._instance_id()
        return bool(s.cloud_tokens) and bool(now) and s.synced_with != now

    @traced("edge_sync")
    async def _sync(self, s: EdgeSession, session_id: str, p: LinkParams, timeout_s: float = 5.0) -> None:
        """``SyncSession``: set ``s.cloud_tokens`` and ``s.leaves`` to what the cloud proves it holds.

        The edge sends the Merkle tree of all its full head-KV blocks (``n`` leaves) and a
        consistency proof from the leaves it believes the cloud holds (RFC 6962 2.1.2); the
        cloud checks it, or hands back its leaves and the edge finds the first that differs.
        A cloud that cannot answer (an older one, an error) leaves the session to be resent
        from token 0."""
        assert self.conn is not None and s.kv is not None
        bs, k = p.kv_block_size_tokens, p.split_layer
        if s.block_tokens != bs:
            s.forget_cloud_past(0)
        hashes = block_hashes(s.token_ids, bs, request_seed(self.heads[k].compatibility_key, bs, session_id, ""))
        believed = list(s.leaves)
        leaves = believed + [b.leaf_hash for b in self._kv_blocks(s, hashes, LayerRange(0, k), p).values()]
        m = len(believed)
        proof = merkle.consistency_proof(leaves, m) if 0 < m < len(leaves) else []
        req = SyncRequest(
            self._link_id(), session_id, k, tuple(s.token_ids), len(leaves), merkle.root(leaves), m, tuple(proof), bs
        )
        try:
            reply = await self.conn.current().link.sync_session(req, max(0.001, min(5.0, timeout_s)))
        except QuotaExceeded as e:  # the edge is over its request rate: keep its belief, the turn will tell
            log.info("SyncSession refused (%s): the turn goes on with what this edge believes", e)
            return
        except TandemError as e:
            log.warning("SyncSession failed (%s): resending the session from token 0", e)
            s.forget_cloud_past(0)
            metrics.record_session_sync("lost")
            return
        if not reply.found:
            ok = 0
        elif reply.proven:
            ok = min(reply.held_leaves, len(leaves))
        else:
            ok = 0
            for mine, theirs in zip(leaves, reply.leaf_hashes, strict=False):
                if mine != theirs:
                    break
                ok += 1
        held = min(reply.held_tokens, len(s.token_ids), (ok + 1) * bs - 1) if reply.found else 0
        s.cloud_tokens, s.leaves, s.block_tokens = held, leaves[: held // bs], bs
        s.synced_with = self._instance_id()
        outcome = "lost" if not held else "in_sync" if held == len(s.token_ids) else "partial"
        log.info("SyncSession: the cloud holds %d of %d tokens (%s)", held, len(s.token_ids), outcome)
        metrics.record_session_sync(outcome)

    @traced("edge_head")
    async def _run_head(self, s: EdgeSession, ids: list[int], clock: TurnClock, k: int) -> int:
        """Run the head at ``k`` over the tokens past the session's common prefix; updates ``s``.
        Returns the tokens computed; calibrates the head rate (ms per token) of the cost model."""
        t0 = time.perf_counter()
        c = s.common_prefix(ids)
        if c == len(ids):  # nothing new (identical prompt): recompute the last token so the turn has input
            c -= 1
        s.truncate(c)
        out = await self.heads[k].batcher.run(HeadInput(np.asarray(ids[c:], np.int64), s.kv))
        s.kv = out.kv
        s.hidden = out.hidden if s.hidden is None else np.concatenate([s.hidden, out.hidden])
        s.token_ids = list(ids)
        clock.since(Stage.EDGE_HEAD, t0)
        self.cost.edge.head(k).add(clock.timings[Stage.EDGE_HEAD] / (len(ids) - c))
        return len(ids) - c

    def _pipeline_tokens(self, s: EdgeSession, ids: list[int], p: LinkParams) -> int:
        """Head tokens per piece if this split turn is to be pipelined, else 0: pipelining is on,
        the session needs no ``SyncSession`` first (that needs the whole head's KV), and the cost
        model's rule holds (``CostModel.pipeline_pieces``: at least two pieces of new tokens, and
        an upload predicted to take at least as long as the head). A piece is at least one
        activation chunk."""
        if not self.pipeline_tokens or self._needs_sync(s):
            return 0
        if not self.cost.split_pipeline_pieces(p.split_layer, len(ids) - s.common_prefix(ids), self.link_state()):
            return 0
        return max(self.pipeline_tokens, p.chunk_tokens)

    def _build_pipelined_turn(
        self, s: EdgeSession, ids: list[int], turn: ChatTurn, p: LinkParams, clock: TurnClock, seg: int
    ) -> tuple[OutgoingTurn, AsyncIterator[Pieces]]:
        """``_build_turn`` before the head has run: the header (its chunk and block counts follow
        from the token ids alone) and an empty turn that ``_pieces`` fills as the head runs."""
        if s.block_tokens and s.block_tokens != p.kv_block_size_tokens:
            s.forget_cloud_past(0)
        c = s.common_prefix(ids)
        s.truncate(c)
        rid, k, bs, n = clock.request_id, p.split_layer, p.kv_block_size_tokens, len(ids)
        cached = s.cloud_tokens
        hashes = block_hashes(ids, bs, request_seed(self.heads[k].compatibility_key, bs, turn.session_id, rid))
        header = self._header(
            rid, turn, p, ids, cached, -(-(n - cached) // p.chunk_tokens), len(hashes) - len(s.leaves)
        )
        out = OutgoingTurn(
            header,
            [],
            {},
            0,
            b"",
            window=p.inflight_window_bytes,
            block_tokens=bs,
            complete=False,
            pipelined=True,
        )
        return out, self._pieces(s, ids, out, p, clock, c, seg, hashes)

    async def _pieces(
        self,
        s: EdgeSession,
        ids: list[int],
        out: OutgoingTurn,
        p: LinkParams,
        clock: TurnClock,
        c: int,
        seg: int,
        hashes: list[bytes],
    ) -> AsyncIterator[Pieces]:
        """Run the head over ``ids[c:]`` ``seg`` tokens at a time (each piece with the KV of those
        before it, so the result equals one run up to fp32 rounding) and yield, after each piece,
        the activation chunks that are now whole and the KV blocks inside them; their upload
        overlaps the next piece's compute (issue 9 item 4). After the last piece, the turn's
        commit (leaf count and Merkle root) is set. Updates ``s`` as ``_run_head`` does; the head
        and encode times are the sums over the pieces.

        Shapes: each piece's head output is float32 hidden ``[seg, H]`` and KV ``[k, 2, Hkv, P, D]``.
        """
        k, n, ct, bs = p.split_layer, len(ids), p.chunk_tokens, p.kv_block_size_tokens
        part = LayerRange(0, k)
        start, seq, next_block = out.header.cached_tokens, 0, len(s.leaves)
        head_ms = encode_ms = 0.0
        e = c
        while e < n:
            e2 = min(n, e + seg)
            t0 = time.perf_counter()
            with span("edge_head", piece_tokens=e2 - e):
                r = await self.heads[k].batcher.run(HeadInput(np.asarray(ids[e:e2], np.int64), s.kv))
            s.kv = r.kv
            s.hidden = r.hidden if s.hidden is None else np.concatenate([s.hidden, r.hidden])
            s.token_ids = list(ids[:e2])
            e = e2
            t1 = time.perf_counter()
            end = start
            while end < n and min(n, end + ct) <= e:  # whole chunks only: the framing of one run
                end = min(n, end + ct)
            last = max(next_block, min(len(hashes), end // bs))

            def frame(hidden=s.hidden, a=start, z=end, first_seq=seq, j0=next_block, j1=last):
                """This piece's chunks and blocks (CPU work: quantise, compress, CRC, leaf hashes)."""
                with span("encode"):
                    chunks = (
                        []
                        if z == a
                        else wire.split(
                            hidden[a:z], a, ct, p.wire_dtype, p.codec, p.codec_level, p.params_version, first_seq
                        )
                    )
                    return chunks, self._kv_blocks(s, hashes, part, p, j0, j1)

            chunks, blocks = await asyncio.to_thread(frame)  # off the loop: acks and sends go on meanwhile
            seq, start, next_block = seq + len(chunks), end, last
            head_ms += (t1 - t0) * 1e3
            encode_ms += (time.perf_counter() - t1) * 1e3
            yield chunks, blocks
        leaves = list(s.leaves) + [out.blocks[j].leaf_hash for j in sorted(out.blocks)]
        out.finish(len(leaves), merkle.root(leaves))
        clock.timings[Stage.EDGE_HEAD], clock.timings[Stage.ENCODE] = head_ms, encode_ms
        self.cost.edge.head(k).add(head_ms / (n - c))

    @traced("encode")
    def _build_turn(
        self, s: EdgeSession, ids: list[int], turn: ChatTurn, p: LinkParams, clock: TurnClock, resend_all: bool
    ) -> OutgoingTurn:
        """Frame what the cloud lacks under params ``p``: activations past ``cloud_tokens``, blocks
        past its leaves (split), or just the token ids (direct, ``p.split_layer == 0``)."""
        t0 = time.perf_counter()
        rid, k, link_id = clock.request_id, p.split_layer, self._link_id()
        if not k:
            header = TurnHeader(rid, "", p.params_version, 0, tuple(ids), 0, 0, 0, turn.sampling, link_id)
            return OutgoingTurn(header, [], {}, 0, b"")
        if resend_all or (s.block_tokens and s.block_tokens != p.kv_block_size_tokens):
            s.forget_cloud_past(0)  # the cloud lost the session, or its leaves were cut at another block size
        if s.hidden is None or s.kv is None:
            raise InvalidRequest("the head produced no output for this turn")
        cached = s.cloud_tokens
        chunks = wire.split(
            s.hidden[cached:], cached, p.chunk_tokens, p.wire_dtype, p.codec, p.codec_level, p.params_version
        )
        bs = p.kv_block_size_tokens
        key = self.heads[k].compatibility_key
        hashes = block_hashes(ids, bs, request_seed(key, bs, turn.session_id, rid))
        blocks = self._kv_blocks(s, hashes, LayerRange(0, k), p)
        leaves = list(s.leaves) + [b.leaf_hash for b in blocks.values()]
        header = self._header(rid, turn, p, ids, cached, len(chunks), len(blocks))
        clock.since(Stage.ENCODE, t0)
        return OutgoingTurn(
            header,
            chunks,
            blocks,
            len(leaves),
            merkle.root(leaves),
            window=p.inflight_window_bytes,
            block_tokens=p.kv_block_size_tokens,
        )

    def _header(
        self, rid: str, turn: ChatTurn, p: LinkParams, ids: list[int], cached: int, chunks: int, blocks: int
    ) -> TurnHeader:
        """A split turn's header: ``chunks`` activation chunks from token ``cached`` on, ``blocks`` KV blocks."""
        return TurnHeader(
            rid, turn.session_id, p.params_version, p.split_layer, tuple(ids), cached, chunks, blocks, turn.sampling,
            self._link_id(),
        )  # fmt: skip

    def _link_id(self) -> str:
        n = self.conn.current().negotiated if self.conn is not None else None
        return n.link_id if n is not None else ""

    def _kv_blocks(
        self,
        s: EdgeSession,
        hashes: list[bytes],
        part: LayerRange,
        p: LinkParams,
        first: int | None = None,
        end: int | None = None,
    ) -> dict[int, KVBlock]:
        """The session's full head-KV blocks ``[first, end)`` (default: all past those the cloud
        holds), each with its Merkle leaf."""
        assert s.kv is not None  # checked by the caller
        first = len(s.leaves) if first is None else first
        end = len(hashes) if end is None else end
        blocks: dict[int, KVBlock] = {}
        for j, arr in zip(range(first, end), split_blocks(s.kv, p.kv_block_size_tokens, first, end), strict=True):
            raw = encode_kv(arr, p.kv_wire_dtype)
            leaf = merkle.leaf_hash(merkle.leaf_data(hashes[j], part.lo, part.hi, p.kv_wire_dtype, raw))
            payload = wire.encode_payload(raw, p.codec, p.codec_level)
            blocks[j] = KVBlock(
                j, hashes[j], part.lo, part.hi, p.codec, len(raw), payload, leaf, p.params_version, p.kv_wire_dtype
            )
        return blocks

    async def _stream(
        self,
        out: OutgoingTurn,
        s: EdgeSession,
        ids: list[int],
        clock: TurnClock,
        head_tokens: int,
        timeout_s: float,
        stop: tuple[str, ...],
        d: Decision,
        pieces: AsyncIterator[Pieces] | None = None,
    ) -> AsyncIterator[TextOut | TurnDone]:
        assert self.conn is not None
        text = clock.text or TextStream(self.tok, stop)
        clock.cloud_called = True
        with self.conn.current().uploading() as upload_done:
            try:
                async for ev in self._stream_events(
                    out, s, ids, clock, head_tokens, timeout_s, text, d, upload_done, pieces
                ):
                    yield ev
            except BaseException:
                if not clock.acked and out.held_tokens > s.cloud_tokens:
                    self._keep_acknowledged_prefix(s, out, ids)
                    clock.acked = True  # the cloud's session moved on: the edge keeps this turn's head work
                raise

    def _keep_acknowledged_prefix(self, s: EdgeSession, out: OutgoingTurn, ids: list[int]) -> None:
        """An upload cut after the cloud acknowledged keeping its first ``out.held_tokens`` prompt
        tokens (``WindowAck.held_tokens``): the session's cloud state moves there, so a resumed
        upload (``_build_turn``) sends only the rest."""
        bs, n = out.block_tokens, out.held_tokens
        first = len(s.leaves)
        new: list[bytes] = []
        for j in range(first, n // bs):
            if j not in out.blocks:  # not a block this turn sent: hold only what precedes it
                n = j * bs
                break
            new.append(out.blocks[j].leaf_hash)
        if n <= s.cloud_tokens:
            return
        s.cloud_tokens, s.leaves, s.block_tokens = n, s.leaves + new, bs
        s.synced_with = self._instance_id()
        metrics.record_upload_kept(n - out.header.cached_tokens)
        log.info("upload cut with %d of %d prompt tokens acknowledged: a resumed upload starts there", n, len(ids))

    async def _stream_events(
        self,
        out: OutgoingTurn,
        s: EdgeSession,
        ids: list[int],
        clock: TurnClock,
        head_tokens: int,
        timeout_s: float,
        text: TextStream,
        d: Decision,
        upload_done: Callable[[], None],
        pieces: AsyncIterator[Pieces] | None = None,
    ) -> AsyncIterator[TextOut | TurnDone]:
        assert self.conn is not None
        conn = self.conn.current()  # the turn's replica
        async for ev in stream_turn(conn.link, out, timeout_s, pieces):
            if isinstance(ev, UploadAck):
                upload_done()
                s.cloud_tokens = len(ids)
                s.leaves = s.leaves + [out.blocks[j].leaf_hash for j in sorted(out.blocks)]
                s.block_tokens = out.block_tokens
                s.synced_with = self._instance_id()
                clock.timings[Stage.UPLINK] = out.upload_ms
                clock.acked = True
            elif isinstance(ev, TokensOut):
                clock.tokens_arrived()
                delta = text.feed(ev.token_ids)
                if delta:
                    yield TextOut(delta, ev.token_ids)
                if text.stopped:  # leaving the loop cancels the call: the cloud stops decoding
                    n = len(text.token_ids)
                    yield self._done(TurnFinal("stop", len(ids), n, 0), out, clock, head_tokens, text.token_ids, d)
                    return
            elif isinstance(ev, TurnFinal):
                rest = text.flush()
                if rest:
                    yield TextOut(rest, ())
                conn.observe_load(ev.load)
                if out.split:
                    nbytes = out.sent_bytes.payload_bytes
                    # no sample from a turn queued for admission (buffered meanwhile) or pipelined (the
                    # cloud's wait includes the edge's head)
                    receive_ms = upload_receive_ms(ev.timings)
                    if receive_ms > 0 and not out.pipelined:
                        conn.observe_upload(nbytes, receive_ms)
                yield self._done(ev, out, clock, head_tokens, text.token_ids, d)

    def _done(
        self,
        f: TurnFinal,
        out: OutgoingTurn,
        clock: TurnClock,
        head_tokens: int,
        out_ids: list[int],
        d: Decision,
    ) -> TurnDone:
        clock.since(Stage.TOTAL)
        clock.timings.update({k: v for k, v in f.timings.items() if k.is_cloud})
        done = self._turn_done(
            f.finish_reason,
            f.prompt_tokens,
            clock,
            d,
            out_ids,
            head_tokens,
            f.external_tokens,
            out.header.split_layer,
            out.sent_bytes,
            out.header.params_version,
            out.resent_chunks,
            out.repaired_blocks,
        )
        return replace(done, output_tokens=f.output_tokens)
