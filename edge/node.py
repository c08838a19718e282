"""The edge's domain service: one chat turn from messages to streamed text.

``EdgeNode.chat`` reads like the design's data path: tokenize -> route (``edge.routing.router``: local,
split at ``k`` or direct) -> run it: local mode on the whole model here (``edge.modes.local``), or
through the cloud (``edge.modes.cloud``: the head over the tokens the edge has not processed,
activations and new KV blocks framed by ``edge.link.framing`` and streamed over the pinned
``CloudConnection``), or remote prefill (``edge.modes.remote_prefill``: the cloud prefills, the prompt's KV
comes down, the whole model here decodes the rest) -> detokenize tokens as they come back. A cloud
that fails mid-stream does not end the turn: it resumes. Each leg runs inside the router's
accounting of it (``Router.track``). ``edge.server.build_node`` assembles a node from the config.
No grpc here; ``edge.api.grpc_service`` adapts it, ``edge.link.grpc_link`` carries it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from tandem.common.protocol.chat import prompt_token_ids
from tandem.common.protocol.errors import (
    EngineError,
    InvalidRequest,
    LinkLost,
    ParamsVersionMismatch,
    QuotaExceeded,
    TurnTooLarge,
)
from tandem.common.protocol.limits import RequestLimits
from tandem.common.protocol.modes import Mode
from tandem.common.runtime.logs import bind_request, current_caller, current_request_id, new_request_id, turn_log
from tandem.common.runtime.tracing import span, traced
from tandem.edge import metrics
from tandem.edge.compute.batcher import HeadBatcher
from tandem.edge.compute.local import LocalEngine
from tandem.edge.detok import TextStream
from tandem.edge.events import ChatTurn, TextOut, TurnDone
from tandem.edge.lifetime import SessionLifetime
from tandem.edge.link.connection import CloudTarget
from tandem.edge.modes.cloud import CloudCalls
from tandem.edge.modes.local import run_local
from tandem.edge.modes.remote_prefill import run_remote_prefill
from tandem.edge.modes.split_head import Head
from tandem.edge.routing.costmodel import CostModel, Route
from tandem.edge.routing.router import Decision, Router
from tandem.edge.session import EdgeSessions
from tandem.edge.turn import Turn, TurnClock
from tandem.edge.validation import check_turn, cloud_limits, edge_limits
from tandem.stages import Stage

log = logging.getLogger("tandem.edge")
MAX_RESUMES = 3  # continuations of one turn after mid-stream cloud failures

Events = AsyncIterator[TextOut | TurnDone]


def max_token_chars(tokenizer: Any, default: int = 64) -> int:
    """Most characters one token of ``tokenizer`` stands for (its longest vocabulary entry; byte-level
    BPE entries are one character per byte, so this bounds characters too); ``default`` if unknown."""
    try:
        return max(len(t) for t in tokenizer.get_vocab()) or default
    except (AttributeError, TypeError, ValueError):
        return default


@dataclass
class EdgeCompute:
    """What this edge computes a turn with besides the router's local model: the tokenizer, the
    heads by split layer, the ids that end a sequence, and the whole model's identity
    (``common.wire.kvdown.full_model_key``), which remote prefill's KV blocks are named from ("": no
    remote prefill)."""

    tokenizer: Any
    heads: dict[int, Head]
    eos_token_ids: frozenset[int]
    model_key: str = ""


class EdgeNode:
    """Runs turns over its collaborators, built at the entry point (``edge.server.build_node``):
    ``compute`` (tokenizer, heads), ``router`` (the route per request, the local model, the cost
    model, the sessions, the accounting of the turns), ``calls`` (the turns through the cloud it talks
    to), and the bounds of a turn."""

    def __init__(
        self, compute: EdgeCompute, router: Router, calls: CloudCalls, limits: RequestLimits, turn_timeout_s: float
    ) -> None:
        """``limits``: this edge's own bounds (the cloud's and the local model's narrow them,
        ``limits``); ``turn_timeout_s``: a turn's deadline when its caller sets none.

        Raises:
            ValueError: nothing to serve (no head, no local model, no cloud).
        """
        if not compute.heads and router.local is None and calls.cloud is None:
            raise ValueError("an edge needs a head (split), the whole model (local) or a cloud (direct)")
        self.compute, self.router, self.calls = compute, router, calls
        self.turn_timeout_s = turn_timeout_s
        self._own_limits = limits
        # no text longer than this can fit in max_prompt_tokens: every token covers at most
        # max_token_chars characters, so longer text is refused before it is tokenized
        self._token_chars = max_token_chars(compute.tokenizer)
        self._inflight: set[str] = set()  # request ids of the turns in flight
        self._runners: dict[Mode, Callable[[Turn], Events]] = {
            Mode.LOCAL: self._run_local,
            Mode.SPLIT: self.calls.run,
            Mode.DIRECT: self.calls.run,
            Mode.REMOTE_PREFILL: self._run_remote_prefill,
        }
        self.lifetime = SessionLifetime(router.sessions, calls.cloud, lambda: self.local)

    @property
    def tok(self) -> Any:
        """The tokenizer."""
        return self.compute.tokenizer

    @property
    def heads(self) -> dict[int, Head]:
        """The heads this edge holds, by split layer."""
        return self.compute.heads

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.compute.eos_token_ids

    @property
    def conn(self) -> CloudTarget | None:
        """The cloud this edge talks to (None: none)."""
        return self.calls.cloud

    @property
    def sessions(self) -> EdgeSessions:
        """The split and direct sessions (the router's)."""
        return self.router.sessions

    # ------------------------------------------------------------------ what this edge can do now

    @property
    def local(self) -> LocalEngine | None:
        """The whole model on this edge (local mode), or None."""
        return self.router.local

    @local.setter
    def local(self, engine: LocalEngine | None) -> None:
        self.router.local = engine

    @property
    def cost(self) -> CostModel:
        """The cost model that predicts each mode's TTFT (the router's)."""
        return self.router.cost

    @cost.setter
    def cost(self, model: CostModel) -> None:
        self.router.cost = model

    @property
    def batcher(self) -> HeadBatcher:
        """The head batcher of the deepest split held (tests and tools)."""
        return self.heads[max(self.heads)].batcher

    @property
    def limits(self) -> RequestLimits:
        """What a request may ask for, the same in every mode (``edge.validation``): this edge's
        bounds narrowed by local mode's and by the cloud's as last negotiated."""
        n = self.conn.current().negotiated if self.conn is not None else None
        cloud = cloud_limits(n.params_by_split.get(0) if n is not None else None)
        return edge_limits(self._own_limits, self.local.limits if self.local is not None else None, cloud)

    @property
    def max_prompt_tokens(self) -> int:
        """Longest prompt accepted (``limits``)."""
        return self.limits.max_prompt_tokens

    @property
    def max_prompt_chars(self) -> int:
        """No text longer than this can fit in ``max_prompt_tokens`` (refused before tokenizing)."""
        return self.max_prompt_tokens * self._token_chars

    @property
    def max_new_tokens(self) -> int:
        """Largest ``max_new_tokens`` accepted (``limits``)."""
        return self.limits.max_new_tokens

    @property
    def split_layers(self) -> tuple[int, ...]:
        """Split layers usable now: the edge holds the head and the connected cloud the tail."""
        return self.router.split_layers

    @property
    def cloud_connected(self) -> bool:
        return self.conn is not None and self.conn.current().connected.is_set()

    @property
    def turns_in_flight(self) -> tuple[int, int]:
        """(turns in the cloud now, turns in flight now)."""
        return self.router.cloud_inflight, len(self._inflight)

    def routes(self) -> list[Route]:
        """Routes servable now."""
        return self.router.routes()

    def degraded(self) -> str:
        """Why not every mode this edge was built for is available ("" when all are)."""
        return self.router.degraded()

    @traced("tokenize")
    def tokenize(self, request: ChatTurn) -> list[int]:
        """Prompt token ids. Raises InvalidRequest (``param`` ``messages`` or ``prompt``) for no
        prompt, both kinds, or one too long (``context_length_exceeded``)."""
        if request.messages and request.prompt:
            raise InvalidRequest("pass messages or a prompt, not both", param="prompt")
        if not request.messages and not request.prompt:
            raise InvalidRequest("messages: a request needs messages or a prompt", param="messages", code="empty_array")
        limits = self.limits
        param = "prompt" if request.prompt else "messages"
        n_chars = len(request.prompt) + sum(len(c) for _, c in request.messages)
        if n_chars > limits.max_prompt_tokens * self._token_chars:
            raise InvalidRequest(
                f"prompt of {n_chars} characters cannot fit in {limits.max_prompt_tokens} tokens",
                param=param,
                code="context_length_exceeded",
            )
        messages = [{"role": r, "content": c} for r, c in request.messages]
        ids = prompt_token_ids(self.tok, messages or None, request.prompt or None)
        limits.check_prompt_length(len(ids), param)
        return ids

    def validate(self, request: ChatTurn, ids: list[int]) -> None:
        """The request's verdict, the same in every mode, before a route is chosen
        (``edge.validation.check_turn`` under ``limits``). Raises InvalidRequest or ModeUnavailable."""
        check_turn(request, ids, self.limits, self.heads)

    async def end_session(self, session_id: str, timeout_s: float | None = None) -> bool:
        """End a chat session in every mode, here and in the cloud (``edge.lifetime``); True if
        either held state of it.

        Raises:
            InvalidRequest: an empty or too long session id.
            DeadlineExceeded: a turn of the session was still running after ``timeout_s``.
        """
        return await self.lifetime.end(session_id, timeout_s)

    # ------------------------------------------------------------------ the turn

    async def chat(self, request: ChatTurn, timeout_s: float | None = None) -> Events:
        """Run one turn within ``timeout_s`` (default ``turn_timeout_s``); yields text deltas then a
        ``TurnDone``. A turn that fails before the cloud acknowledged its upload leaves the session
        as it was before the turn. Its request id (``_turn_id``) is on every log line of the turn; its
        metrics and spans are recorded (``edge.metrics``, ``common.runtime.tracing``).

        Raises:
            InvalidRequest: bad prompt or sampling parameters (the same verdict in every mode:
                ``validate``, before the route is chosen).
            ModeUnavailable: the requested mode (or split layer) cannot run on this edge.
            TandemError: the cloud's verdict, EngineError (cloud unreachable), DeadlineExceeded.
        """
        clock = TurnClock(mode=request.mode)
        with (
            self._turn_id(clock) as rid,
            bind_request(rid, request.session_id),
            turn_log(log, request.mode, "requested") as done_fields,
            metrics.edge_turn(clock) as counts,
            span(
                "edge_turn",
                mode=request.mode,
                request_id=rid,
                session_id=request.session_id,
                **({"caller": c} if (c := current_caller()) else {}),
            ),
        ):
            inner, finished = self._chat(request, clock, timeout_s), False
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
                        if ev.mode is Mode.DIRECT:  # nothing of the session kept: still one to end
                            self.lifetime.served_without_state(request.session_id)
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
        self, request: ChatTurn, clock: TurnClock, timeout_s: float | None
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
        ids = await asyncio.to_thread(self.tokenize, request)  # long prompts must not stall other requests
        clock.since(Stage.TOKENIZE)
        self.validate(request, ids)
        first = leg = Turn(request, ids, clock, TextStream(self.tok, request.stop), deadline)
        finished = False
        while True:
            try:
                async for ev in self._legs(leg):
                    if isinstance(ev, TurnDone):
                        finished = True
                        if clock.resumes:  # the whole turn's output, not the last leg's
                            n_out = len(first.text.token_ids)
                            ev = replace(ev, prompt_tokens=len(ids), output_tokens=n_out, resumes=clock.resumes)
                    yield ev
                return
            except EngineError as e:
                if finished:  # the answer ended; the connection broke only afterwards
                    log.info("the cloud's stream broke after the turn ended (%s): nothing lost", e)
                    return
                finish = self._final_lost(first)
                if finish:  # only the final message was lost: finish here
                    for ev in self._finish_without_cloud(first, finish):
                        yield ev
                    return
                if not self._may_resume(first, e):
                    raise
                leg = await self._resume(first, leg, e)

    def _final_lost(self, first: Turn) -> str:
        """The finish reason of a turn whose every token reached the client (its token budget is
        spent, or its last token ends it) but whose final message was lost; "" otherwise."""
        out, sampling = first.text.token_ids, first.sampling
        if not out:
            return ""
        ended = out[-1] in sampling.stop_token_ids or (out[-1] in self.eos_token_ids and not sampling.ignore_eos)
        if ended:
            return "stop"
        return "length" if sampling.max_new_tokens - len(out) <= 0 else ""

    def _may_resume(self, first: Turn, cause: EngineError) -> bool:
        """A turn goes on after ``cause`` if tokens reached the client, or the connection broke
        under the turn (no verdict), within the prompt bound and ``MAX_RESUMES``, and not locally."""
        out, clock = first.text.token_ids, first.clock
        began = bool(out) or (clock.cloud_called and isinstance(cause, LinkLost))
        too_long = len(first.ids) + len(out) > self.max_prompt_tokens
        return began and clock.mode is not Mode.LOCAL and not too_long and clock.resumes < MAX_RESUMES

    async def _resume(self, first: Turn, failed: Turn, cause: EngineError) -> Turn:
        """The next leg of ``first``'s turn, after waiting for the cloud unless auto mode can run
        it locally (and backing off when no token was streamed yet).

        Raises:
            EngineError: the cloud did not come back within ``resume_wait_s`` (``wait_for_cloud``).
            DeadlineExceeded: the cloud did not come back before the deadline.
        """
        first.clock.resumes += 1
        metrics.record_resume()
        log.warning("the cloud failed after %d tokens (%s): resuming", len(first.text.token_ids), cause)
        if first.requested is not Mode.AUTO or self.local is None:
            await self.calls.wait_for_cloud(failed, cause)
            if not first.text.token_ids:  # nothing streamed yet: back off before sending it all again
                left_s = first.deadline - asyncio.get_running_loop().time()
                await asyncio.sleep(max(0.0, min(left_s, 0.25 * 2**first.clock.resumes)))
        return first.continued()

    def _finish_without_cloud(self, first: Turn, finish: str) -> list[TextOut | TurnDone]:
        """End a turn whose every token reached the client but whose final message was lost: the
        text held back (for stop strings), then its ``TurnDone``."""
        rest, ids = first.text.flush(), first.text.take_ids()
        first.clock.since(Stage.TOTAL)
        mode = first.clock.mode if first.clock.mode is not Mode.AUTO else Mode.DIRECT
        closing = Turn(first.request, first.ids, first.clock, first.text, first.deadline)
        closing.decision = Decision(Route(mode), None, "resumed")
        events: list[TextOut | TurnDone] = [TextOut(text=rest, token_ids=ids)] if rest or ids else []
        return [*events, closing.done(finish, len(first.ids))]

    async def _legs(self, turn: Turn) -> AsyncGenerator[TextOut | TurnDone, None]:
        """One leg of a turn: decide the route and run it; in auto mode a cloud that refuses before
        the first token (busy, unreachable) is answered by local mode, local mode (or remote
        prefill) refusing for the edge's KV memory (``QuotaExceeded``: full now; ``TurnTooLarge``:
        the turn never fits it) by direct mode while the cloud is up, a split turn too large for the
        cloud's state bounds by direct (else local) mode, and a stale params version by
        renegotiating and running again."""
        may_wait = turn.requested is not Mode.AUTO or self.local is None  # no local mode to serve meanwhile
        await self.calls.pin(turn, may_wait)  # one replica for the whole leg
        turn.decision = self.router.decide(turn.request, turn.ids)
        too_large = False  # the edge's KV memory can never hold this turn: no local fallback
        for attempt in (0, 1, 2):
            before, started = len(turn.text.token_ids), False
            try:
                async for ev in self._run_route(turn):
                    started = True
                    yield ev
                return
            except ParamsVersionMismatch as e:
                if started or len(turn.text.token_ids) > before or attempt or turn.conn is None:
                    raise
                await self.calls.renegotiate(turn, e)
                turn.decision = self.router.decide(turn.request, turn.ids)
            except TurnTooLarge as e:  # refused before it ran (a bound checked ahead of any token)
                if len(turn.text.token_ids) > before:
                    raise
                other = self._other_mode(turn, e, too_large)
                too_large = too_large or turn.route_decision.route.mode in (Mode.LOCAL, Mode.REMOTE_PREFILL)
                if other is None:
                    raise
                turn.decision = other
            except (QuotaExceeded, EngineError) as e:
                started = started or len(turn.text.token_ids) > before
                if not started and isinstance(e, EngineError) and self.calls.move_replica(turn, e):
                    turn.decision = self.router.decide(turn.request, turn.ids)
                    continue
                if started or turn.requested is not Mode.AUTO:
                    raise
                if turn.route_decision.route.mode is Mode.LOCAL:
                    # the edge's own KV memory is full with turns in flight: the cloud answers, if up
                    cloud = self.router.fallback_to_cloud(turn.request, turn.ids, "fallback: edge memory full")
                    if not isinstance(e, QuotaExceeded) or cloud is None:
                        raise
                    log.info("edge memory full (%s): serving this turn in the cloud", e)
                    metrics.record_fallback("edge memory full")
                    turn.decision = cloud
                    continue
                if self.local is None or too_large:
                    raise
                reason = "cloud busy" if isinstance(e, QuotaExceeded) else "cloud unavailable"
                log.info("%s (%s): serving this turn locally", reason, e)
                metrics.record_fallback(reason)
                turn.decision = self.router.fallback(turn.request, turn.ids, f"fallback: {reason}")
        raise EngineError("no mode could serve this turn")  # not reached: the last attempt returns or raises

    def _other_mode(self, turn: Turn, e: TurnTooLarge, too_large_here: bool) -> Decision | None:
        """Where an auto turn goes that its route refused before it ran, as too large for a bound it
        can never fit (``e``): direct mode for one local mode or remote prefill refused (the edge's
        KV memory) or the cloud refused for its state bounds (split: direct keeps no state there),
        else local mode for the latter while the edge's memory can hold it; None (``e`` stands) when
        none is up or the turn was not auto. A cloud's refusal names the prompt's field (its bounds
        are on the prompt; the wire carries no field)."""
        refused = turn.route_decision.route.mode
        here = refused in (Mode.LOCAL, Mode.REMOTE_PREFILL)
        if not here:
            e.param = turn.prompt_param
        if turn.requested is not Mode.AUTO:
            return None
        where = "edge" if here else "cloud"
        reason = f"turn too large for the {where}"
        other = self.router.fallback_to_cloud(turn.request, turn.ids, f"fallback: {reason}")
        if (other is None or refused is Mode.DIRECT) and not here and not too_large_here and self.local is not None:
            other = self.router.fallback(turn.request, turn.ids, f"fallback: {reason}")
        if other is None or other.route == turn.route_decision.route:
            return None
        log.info("%s (%s): serving it in %s mode", reason, e, other.route.mode)
        metrics.record_fallback(reason)
        return other

    async def _run_route(self, turn: Turn) -> Events:
        """Run the leg on its decided route, inside the router's accounting of it (``Router.track``:
        counted until the leg ends however it ends; its first event is its first token; its
        ``TurnDone`` is its outcome)."""
        d = turn.route_decision
        turn.clock.mode, turn.head_tokens = d.route.mode, 0
        with self.router.track(d) as account:
            turn.account = account
            async for ev in self._runners[d.route.mode](turn):
                account.first_token()
                if isinstance(ev, TurnDone):
                    account.finished(ev, resumed=bool(turn.clock.resumes))
                yield ev

    def _run_local(self, turn: Turn) -> Events:
        assert self.local is not None  # routed here only when present
        return run_local(turn, self.local)

    def _run_remote_prefill(self, turn: Turn) -> Events:
        assert self.local is not None  # routed here only when present
        return run_remote_prefill(turn, self.local, self.compute.model_key, self.router.cost)
