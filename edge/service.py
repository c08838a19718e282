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
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tandem.common import merkle, metrics, wire
from tandem.common.chat import prompt_token_ids
from tandem.common.errors import DeadlineExceeded, InvalidRequest, SessionOutOfSync
from tandem.common.kvblocks import LayerRange, block_hashes, request_seed, split_blocks
from tandem.common.logs import bind_request, current_request_id, new_request_id, turn_log
from tandem.common.messages import KVBlock, TokensOut, TurnFinal, TurnHeader, UploadAck
from tandem.common.params import LinkParams
from tandem.common.tracing import span, traced
from tandem.edge.batcher import HeadBatcher
from tandem.edge.detok import TextStream
from tandem.edge.events import ChatTurn, TextOut, TurnDone
from tandem.edge.head_runner import HeadInput
from tandem.edge.link import CloudLink
from tandem.edge.session import EdgeSession, EdgeSessions
from tandem.edge.uplink import OutgoingTurn, stream_turn
from tandem.stages import Stage, Timings

log = logging.getLogger("tandem.edge")


@dataclass
class TurnClock:
    """One turn's request id (sent to the cloud, on every log line), stage timings from its
    start, and when tokens arrived."""

    t_start: float = field(default_factory=time.perf_counter)
    timings: Timings = field(default_factory=dict)
    acked: bool = False  # the cloud verified this turn's upload (its session moved on)
    request_id: str = field(default_factory=new_request_id)
    token_times: list[float] = field(default_factory=list)  # perf_counter at each arrival of tokens

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


class EdgeService:
    """Holds the tokenizer, the batched head, sessions and the negotiated link."""

    def __init__(
        self,
        tokenizer,
        batcher: HeadBatcher,
        link: CloudLink,
        params: LinkParams,
        compatibility_key: str,
        sessions: EdgeSessions,
        turn_timeout_s: float,
    ) -> None:
        self.tok, self.batcher, self.link, self.params = tokenizer, batcher, link, params
        self.k = batcher.head.k
        self.sessions = sessions
        self.model_key = compatibility_key
        self.turn_timeout_s = turn_timeout_s
        # no text longer than this can fit in max_prompt_tokens: every token covers at most
        # max_token_chars characters, so longer text is refused before it is tokenized
        self.max_prompt_chars = params.max_prompt_tokens * max_token_chars(tokenizer)
        self._inflight: set[str] = set()  # request ids of the turns in flight
        metrics.watch_edge_sessions(sessions)

    @traced("tokenize")
    def tokenize(self, turn: ChatTurn) -> list[int]:
        """Prompt token ids. Raises InvalidRequest for an empty or too long prompt."""
        if turn.messages and turn.prompt:
            raise InvalidRequest("pass messages or a prompt, not both")
        n_chars = len(turn.prompt) + sum(len(c) for _, c in turn.messages)
        if n_chars > self.max_prompt_chars:
            raise InvalidRequest(f"prompt of {n_chars} characters cannot fit in {self.params.max_prompt_tokens} tokens")
        messages = [{"role": r, "content": c} for r, c in turn.messages]
        ids = prompt_token_ids(self.tok, messages or None, turn.prompt or None)
        if not 0 < len(ids) <= self.params.max_prompt_tokens:
            raise InvalidRequest(f"prompt has {len(ids)} tokens; the link allows 1..{self.params.max_prompt_tokens}")
        return ids

    async def chat(self, turn: ChatTurn, timeout_s: float | None = None) -> AsyncIterator[TextOut | TurnDone]:
        """Run one turn within ``timeout_s`` (default ``turn_timeout_s``); yields text deltas then a
        ``TurnDone``. A turn that fails before the cloud acknowledged its upload leaves the session
        as it was before the turn. Its request id (``_turn_id``) is on every log line of the turn; its
        metrics and spans are recorded (``common.metrics``, ``common.tracing``).

        Raises:
            InvalidRequest: bad prompt or sampling parameters.
            TandemError: the cloud's verdict, EngineError (cloud unreachable), DeadlineExceeded.
        """
        clock = TurnClock()
        mode = "split" if self.params.split_layer > 0 and not turn.direct else "direct"
        with (
            self._turn_id(clock) as rid,
            bind_request(rid, turn.session_id),
            turn_log(log, mode) as done_fields,
            metrics.edge_turn(mode, clock) as counts,
            span("edge_turn", mode=mode, request_id=rid, session_id=turn.session_id),
        ):
            inner, finished = self._chat(turn, clock, timeout_s), False
            try:
                async for ev in inner:
                    if isinstance(ev, TurnDone):
                        counts.update(
                            prompt_tokens=ev.prompt_tokens, output_tokens=ev.output_tokens, head_tokens=ev.head_tokens
                        )
                        done_fields.update(
                            counts, finish=ev.finish_reason, ttft_ms=round(ev.timings.get(Stage.TTFT, 0), 1)
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
        """The turn itself (``chat`` adds its request id, logs, metrics and span)."""
        timeout_s = self.turn_timeout_s if timeout_s is None else min(timeout_s, self.turn_timeout_s)
        ids = await asyncio.to_thread(self.tokenize, turn)  # long prompts must not stall other requests
        clock.since(Stage.TOKENIZE)
        split = self.params.split_layer > 0 and not turn.direct
        session = self.sessions.get(turn.session_id) if split else EdgeSession()
        try:
            await _acquire(session.lock, timeout_s, turn.session_id)
            before = session.snapshot()
            try:
                head_tokens = await self._run_head(session, ids, clock) if split else 0
                async for ev in self._send_and_stream(session, ids, turn, split, clock, head_tokens, timeout_s):
                    yield ev
            except BaseException:
                if not clock.acked:  # nothing of this turn reached the cloud's session: keep no work of it
                    session.restore(before)
                raise
            finally:
                session.lock.release()
        finally:
            if split and turn.session_id:
                self.sessions.discard_if_empty(turn.session_id)
                self.sessions.evict()

    async def _send_and_stream(
        self,
        s: EdgeSession,
        ids: list[int],
        turn: ChatTurn,
        split: bool,
        clock: TurnClock,
        head_tokens: int,
        timeout_s: float,
    ) -> AsyncIterator[TextOut | TurnDone]:
        """Send what the cloud lacks; if the cloud lost the session, resend from token 0 once."""
        for attempt in (0, 1):
            out = self._build_turn(s, ids, turn, split, clock, resend_all=attempt == 1)
            try:
                async for ev in self._stream(out, s, ids, clock, head_tokens, timeout_s, turn.stop):
                    yield ev
                return
            except SessionOutOfSync:
                if attempt:
                    raise
                log.info("the cloud does not hold this session's state: resending from token 0")
                metrics.record_session_resync()

    @traced("edge_head")
    async def _run_head(self, s: EdgeSession, ids: list[int], clock: TurnClock) -> int:
        """Run the head over the tokens past the session's common prefix; updates ``s``."""
        t0 = time.perf_counter()
        c = s.common_prefix(ids)
        if c == len(ids):  # nothing new (identical prompt): recompute the last token so the turn has input
            c -= 1
        s.truncate(c)
        out = await self.batcher.run(HeadInput(np.asarray(ids[c:], np.int64), s.kv))
        s.kv = out.kv
        s.hidden = out.hidden if s.hidden is None else np.concatenate([s.hidden, out.hidden])
        s.token_ids = list(ids)
        clock.since(Stage.EDGE_HEAD, t0)
        return len(ids) - c

    @traced("encode")
    def _build_turn(
        self, s: EdgeSession, ids: list[int], turn: ChatTurn, split: bool, clock: TurnClock, resend_all: bool
    ) -> OutgoingTurn:
        """Frame what the cloud lacks: activations past ``cloud_tokens``, blocks past its leaves."""
        t0 = time.perf_counter()
        p = self.params
        rid = clock.request_id
        if not split:
            header = TurnHeader(rid, "", p.params_version, 0, tuple(ids), 0, 0, 0, turn.sampling)
            return OutgoingTurn(header, [], {}, 0, b"")
        if resend_all:
            s.cloud_tokens, s.leaves = 0, []
        if s.hidden is None or s.kv is None:
            raise InvalidRequest("the head produced no output for this turn")
        cached = s.cloud_tokens
        chunks = wire.split(s.hidden[cached:], cached, p.chunk_tokens, p.wire_dtype, p.codec, p.codec_level)
        bs = p.kv_block_size_tokens
        hashes = block_hashes(ids, bs, request_seed(self.model_key, bs, turn.session_id, rid))
        blocks = self._kv_blocks(s, hashes, LayerRange(0, self.k))
        leaves = list(s.leaves) + [b.leaf_hash for b in blocks.values()]
        header = TurnHeader(
            rid, turn.session_id, p.params_version, self.k, tuple(ids), cached, len(chunks), len(blocks), turn.sampling
        )
        clock.since(Stage.ENCODE, t0)
        return OutgoingTurn(header, chunks, blocks, len(leaves), merkle.root(leaves))

    def _kv_blocks(self, s: EdgeSession, hashes: list[bytes], part: LayerRange) -> dict[int, KVBlock]:
        """The session's full head-KV blocks past those the cloud holds, each with its Merkle leaf."""
        assert s.kv is not None  # checked by the caller
        p, first = self.params, len(s.leaves)
        blocks: dict[int, KVBlock] = {}
        for j, arr in zip(
            range(first, len(hashes)), split_blocks(s.kv, p.kv_block_size_tokens, first, len(hashes)), strict=True
        ):
            raw = arr.tobytes()
            leaf = merkle.leaf_hash(merkle.leaf_data(hashes[j], part.lo, part.hi, raw))
            payload = wire.encode_payload(raw, p.codec, p.codec_level)
            blocks[j] = KVBlock(j, hashes[j], part.lo, part.hi, p.codec, len(raw), payload, leaf)
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
    ) -> AsyncIterator[TextOut | TurnDone]:
        text = TextStream(self.tok, stop)
        async for ev in stream_turn(self.link, out, timeout_s):
            if isinstance(ev, UploadAck):
                s.cloud_tokens = len(ids)
                s.leaves = s.leaves + [out.blocks[j].leaf_hash for j in sorted(out.blocks)]
                clock.timings[Stage.UPLINK] = out.upload_ms
                clock.acked = True
            elif isinstance(ev, TokensOut):
                clock.tokens_arrived()
                delta = text.feed(ev.token_ids)
                if delta:
                    yield TextOut(delta, ev.token_ids)
                if text.stopped:  # leaving the loop cancels the call: the cloud stops decoding
                    n = len(text.token_ids)
                    yield self._done(TurnFinal("stop", len(ids), n, 0), out, clock, head_tokens, text.token_ids)
                    return
            elif isinstance(ev, TurnFinal):
                rest = text.flush()
                if rest:
                    yield TextOut(rest, ())
                yield self._done(ev, out, clock, head_tokens, text.token_ids)

    @staticmethod
    def _done(f: TurnFinal, out: OutgoingTurn, clock: TurnClock, head_tokens: int, out_ids: list[int]) -> TurnDone:
        clock.since(Stage.TOTAL)
        timings = {**clock.timings, **{k: v for k, v in f.timings.items() if k.is_cloud}}
        sent = {**out.sent_bytes, "resent_chunks": out.resent_chunks, "repaired_blocks": out.repaired_blocks}
        return TurnDone(
            f.finish_reason,
            f.prompt_tokens,
            f.output_tokens,
            head_tokens,
            f.external_tokens,
            out.header.split_layer,
            timings,
            sent,
            tuple(out_ids),
        )
