"""Split and direct turns through the cloud: the turn's session under its lock, the head
(``edge.modes.split_head``), a ``SyncSession`` where the cloud's copy may differ (``edge.modes.sync``), the
framed upload (``edge.link.framing``) streamed over the pinned connection (``edge.link.uplink``), and the
tokens coming back detokenized. A turn that fails before the cloud acknowledged its upload leaves
the session as it was.

Also the waits and moves around a cloud call: pinning a leg to its replica, a short wait while
its link is set up again, renegotiating on a stale params version, moving to another replica,
and waiting for the cloud to come back before a turn resumes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping

from tandem.common.protocol.errors import DeadlineExceeded, EngineError, SessionOutOfSync
from tandem.common.protocol.modes import Mode
from tandem.common.protocol.params import LinkParams
from tandem.common.runtime.tracing import traced
from tandem.common.wire.messages import TokensOut, TurnFinal, UploadAck
from tandem.edge import metrics
from tandem.edge.events import TextOut, TurnDone
from tandem.edge.link import framing
from tandem.edge.link.connection import CloudConnection, CloudTarget, upload_receive_ms
from tandem.edge.link.uplink import OutgoingTurn, Pieces, stream_turn
from tandem.edge.modes import sync
from tandem.edge.modes.split_head import Head, PipelinedHead, run_head
from tandem.edge.routing.router import Router
from tandem.edge.session import EdgeSession, EdgeSessions
from tandem.edge.turn import Turn
from tandem.stages import Stage

log = logging.getLogger("tandem.edge")


async def _acquire(lock: asyncio.Lock, timeout_s: float, session_id: str) -> None:
    """Raises DeadlineExceeded when another turn of the session holds ``lock`` past ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            await lock.acquire()
    except TimeoutError:
        raise DeadlineExceeded(f"session {session_id!r} busy with another turn past the deadline") from None


class CloudCalls:
    """Runs turns through ``cloud`` (None: an edge without one, which runs none)."""

    def __init__(
        self,
        cloud: CloudTarget | None,
        heads: Mapping[int, Head],
        sessions: EdgeSessions,
        router: Router,
        renegotiate_wait_s: float = 5.0,
        resume_wait_s: float = 120.0,
    ) -> None:
        """``router``: its cost model times the heads and decides on pipelining;
        ``renegotiate_wait_s``: the longest wait for a link being set up again; ``resume_wait_s``:
        the longest wait of a turn whose cloud failed mid-stream (``wait_for_cloud``)."""
        self.cloud, self.heads, self.sessions, self.router = cloud, heads, sessions, router
        self.renegotiate_wait_s, self.resume_wait_s = renegotiate_wait_s, resume_wait_s

    # ------------------------------------------------------------------ around the call

    async def pin(self, turn: Turn, may_wait: bool) -> None:
        """Pin the leg to one replica (its session's, by rendezvous hashing) for the whole leg; if
        that replica's link is being set up again and ``may_wait``, wait a little for it."""
        if self.cloud is None:
            return
        c = turn.conn = self.cloud.pin(turn.session_id or turn.request_id)
        if c.reconnecting and not c.connected.is_set() and may_wait:
            await self.cloud.wait_connected(min(self.renegotiate_wait_s, turn.timeout_s))

    async def renegotiate(self, turn: Turn, cause: Exception) -> None:
        """The cloud refused the leg's params version: renegotiate this replica's link and wait for it."""
        m = turn.cloud
        m.renegotiate_soon(f"the cloud refused this link's params ({cause})")
        await m.wait_connected(min(self.renegotiate_wait_s, turn.timeout_s))

    def move_replica(self, turn: Turn, cause: Exception) -> bool:
        """With several cloud replicas: mark the leg's replica down (it reconnects in the
        background) and pin the leg to the next healthy one. False if there is none."""
        if self.cloud is None or turn.conn is None or turn.clock.mode is Mode.LOCAL:
            return False
        moved = self.cloud.fail_over(turn.conn, turn.session_id or turn.request_id, cause)
        turn.conn = self.cloud.current()
        if moved is None:
            return False
        metrics.record_fallback("replica down")
        return True

    async def wait_for_cloud(self, turn: Turn, cause: Exception) -> None:
        """Wait until the cloud (this or a restarted instance) answers again, at most
        ``resume_wait_s`` and to the turn's deadline.

        Raises:
            EngineError: it did not answer within ``resume_wait_s`` (UNAVAILABLE: a cloud that stays
                down fails the turn then, not at its deadline minutes later).
            DeadlineExceeded: the deadline came first. Both messages name the failure.
        """
        assert self.cloud is not None and turn.conn is not None  # a leg that failed in the cloud
        turn.conn.renegotiate_soon(f"a turn's stream failed ({cause})")
        left = turn.deadline - asyncio.get_running_loop().time()
        wait = min(left, self.resume_wait_s)
        if wait > 0 and await self.cloud.wait_connected(wait):
            return
        if left > self.resume_wait_s:
            raise EngineError(
                f"the cloud failed mid-stream ({cause}) and did not answer again within {self.resume_wait_s:g} s "
                "(the edge's resume_wait_s)"
            )
        raise DeadlineExceeded(f"the cloud failed mid-stream ({cause}) and did not come back before the deadline")

    # ------------------------------------------------------------------ the call

    async def run(self, turn: Turn) -> AsyncIterator[TextOut | TurnDone]:
        """Split or direct mode: the leg through the cloud, under the link's current params.

        Raises:
            EngineError: no params for the route's split layer (the cloud is not connected).
            DeadlineExceeded: another turn held the session past the leg's budget.
            TandemError: the cloud's verdict (``edge.link.uplink.stream_turn``).
        """
        k = turn.route_decision.route.k
        params = turn.cloud.params(k)
        if params is None:
            raise EngineError(f"no link params for split layer {k}: the cloud is not connected")
        if k and self.sessions.expired(turn.session_id):
            turn.clock.session_expired = True
            log.info("session %s had expired (evicted by the edge's bound): starting it again", turn.session_id)
        session = turn.session = self.sessions.get(turn.session_id) if k else EdgeSession()
        try:
            await _acquire(session.lock, turn.timeout_s, turn.session_id)
            before = session.snapshot()
            try:
                async for ev in self._locked(turn, params):
                    yield ev
            except BaseException:
                if not turn.clock.acked:  # nothing of this turn reached the cloud's session: keep no work of it
                    session.restore(before)
                raise
            finally:
                session.lock.release()
        finally:
            if k and turn.session_id:
                self.sessions.discard_if_empty(turn.session_id)
                self.sessions.evict()

    async def _locked(self, turn: Turn, p: LinkParams) -> AsyncIterator[TextOut | TurnDone]:
        """The leg with its session's lock held: the head (unless pipelined), then the upload."""
        s, k = turn.edge_session, p.split_layer
        if k and s.k != k:
            s.reset(k)
        piece_tokens = self._piece_tokens(turn, p) if k else 0
        if piece_tokens:  # the head runs piece by piece inside the first upload attempt
            turn.head_tokens = len(turn.ids) - s.common_prefix(turn.ids)
        elif k:
            turn.head_tokens = await run_head(turn, self.heads[k], self.router.cost)
        async for ev in self._send_and_stream(turn, p, piece_tokens):
            yield ev

    def _piece_tokens(self, turn: Turn, p: LinkParams) -> int:
        """Head tokens per piece if this split leg is to be pipelined, else 0: pipelining is on,
        the session needs no ``SyncSession`` first (that needs the whole head's KV), and the cost
        model's rule holds (``CostModel.pipeline_pieces``: at least two pieces of new tokens, and
        an upload predicted to take at least as long as the head; at most
        ``MAX_PIPELINE_PIECES`` pieces). A piece is at least one activation chunk."""
        cost, s = self.router.cost, turn.edge_session
        if not cost.pipeline_tokens or sync.needs_sync(s, turn.cloud):
            return 0
        n_head = len(turn.ids) - s.common_prefix(turn.ids)
        pieces = cost.split_pipeline_pieces(p.split_layer, n_head, self.router.link_state())
        if not pieces:
            return 0
        return max(cost.pipeline_piece_tokens(n_head, pieces), p.chunk_tokens)

    async def _send_and_stream(self, turn: Turn, p: LinkParams, piece_tokens: int) -> AsyncIterator[TextOut | TurnDone]:
        """Send what the cloud lacks. When the cloud's copy may differ from what this edge believes
        (another cloud instance since the session's last turn, or the cloud refused the turn as out
        of sync), ``SyncSession`` first finds what it holds and only the rest is sent; if the cloud
        still refuses, the turn is resent from token 0 once. With ``piece_tokens`` the first
        attempt runs the head piece by piece while its pieces travel; a later attempt first
        finishes a head that attempt left unfinished."""
        s, k = turn.edge_session, p.split_layer
        for attempt in (0, 1, 2):
            seg = piece_tokens if attempt == 0 else 0
            if k and not seg and s.token_ids != list(turn.ids):  # a pipelined attempt ended before its head did
                await run_head(turn, self.heads[k], self.router.cost)
            if k and turn.session_id and (attempt == 1 or (attempt == 0 and sync.needs_sync(s, turn.cloud))):
                await sync.sync(turn, p, self.heads[k].compatibility_key)
            out, pieces = self._frame(turn, p, seg, resend_all=attempt == 2)
            try:
                async for ev in self._stream(turn, out, pieces):
                    yield ev
                return
            except SessionOutOfSync as e:
                if attempt == 2:
                    raise
                log.info("the cloud's copy of this session differs (%s): %s", e, "sync" if not attempt else "resend")
                if attempt == 1:
                    metrics.record_session_resync()

    def _frame(
        self, turn: Turn, p: LinkParams, piece_tokens: int, resend_all: bool
    ) -> tuple[OutgoingTurn, AsyncIterator[Pieces] | None]:
        """The upload to stream, and a pipelined head's pieces (None when the head ran whole)."""
        if piece_tokens:
            head = PipelinedHead(turn, self.heads[p.split_layer], p, self.router.cost, piece_tokens)
            return head.start(turn.cloud.link_id), head.pieces()
        return self._frame_whole(turn, p, resend_all), None

    @traced("encode")
    def _frame_whole(self, turn: Turn, p: LinkParams, resend_all: bool) -> OutgoingTurn:
        """Frame what the cloud lacks under params ``p``: activations past ``cloud_tokens``, blocks
        past its leaves (split), or just the token ids (direct, ``p.split_layer == 0``)."""
        t0 = time.perf_counter()
        base = turn.header(p, turn.cloud.link_id)
        if not p.split_layer:
            return framing.direct_turn(base)
        s = turn.edge_session
        if resend_all or (s.block_tokens and s.block_tokens != p.kv_block_size_tokens):
            s.forget_cloud_past(0)  # the cloud lost the session, or its leaves were cut at another block size
        key = self.heads[p.split_layer].compatibility_key
        out = framing.split_turn(s, base, p, framing.block_ids(turn.ids, p, key, turn.session_id, turn.request_id))
        turn.clock.since(Stage.ENCODE, t0)
        return out

    async def _stream(
        self, turn: Turn, out: OutgoingTurn, pieces: AsyncIterator[Pieces] | None
    ) -> AsyncIterator[TextOut | TurnDone]:
        """Stream ``out`` on the leg's connection; an upload cut after the cloud acknowledged part
        of it keeps that part (``sync.keep_acknowledged_prefix``)."""
        conn, s = turn.cloud, turn.edge_session
        turn.clock.cloud_called = True
        with conn.uploading() as upload_done:
            try:
                async for ev in self._events(turn, out, pieces, upload_done):
                    yield ev
            except BaseException:
                if not turn.clock.acked and out.held_tokens > s.cloud_tokens:
                    sync.keep_acknowledged_prefix(s, out, turn.ids, conn)
                    turn.clock.acked = True  # the cloud's session moved on: the edge keeps this turn's head work
                raise

    async def _events(
        self,
        turn: Turn,
        out: OutgoingTurn,
        pieces: AsyncIterator[Pieces] | None,
        upload_done: Callable[[], None],
    ) -> AsyncIterator[TextOut | TurnDone]:
        conn, text = turn.cloud, turn.text
        async for ev in stream_turn(conn.link, out, turn.timeout_s, pieces):
            if isinstance(ev, UploadAck):
                upload_done()
                sync.acknowledged(turn.edge_session, out, turn.ids, conn)
                turn.clock.timings[Stage.UPLINK] = out.upload_ms
                turn.clock.acked = True
            elif isinstance(ev, TokensOut):
                turn.clock.tokens_arrived()
                delta = text.feed(ev.token_ids)
                if delta:
                    yield TextOut(text=delta, token_ids=text.take_ids())
                if text.stopped:  # leaving the loop cancels the call: the cloud stops decoding
                    yield self._done(
                        turn,
                        out,
                        TurnFinal(
                            finish_reason="stop",
                            prompt_tokens=len(turn.ids),
                            output_tokens=len(text.token_ids),
                            external_tokens=0,
                        ),
                    )
                    return
            elif isinstance(ev, TurnFinal):
                rest, ids = text.flush(), text.take_ids()
                if rest or ids:
                    yield TextOut(text=rest, token_ids=ids)
                _observe(conn, out, ev)
                yield self._done(turn, out, ev)

    def _done(self, turn: Turn, out: OutgoingTurn, f: TurnFinal) -> TurnDone:
        turn.clock.since(Stage.TOTAL)
        turn.clock.timings.update({k: v for k, v in f.timings.items() if k.is_cloud})
        return turn.done(
            f.finish_reason,
            f.prompt_tokens,
            output_tokens=f.output_tokens,
            external_tokens=f.external_tokens,
            split_layer=out.header.split_layer,
            sent_bytes=out.sent_bytes,
            resent_chunks=out.resent_chunks,
            repaired_blocks=out.repaired_blocks,
            params_version=out.header.params_version,
        )


def _observe(conn: CloudConnection, out: OutgoingTurn, f: TurnFinal) -> None:
    """The cloud's load from a turn's final message, and its upload as a goodput sample: not from
    a turn queued for admission (buffered meanwhile) or pipelined (the cloud's wait includes the
    edge's head)."""
    conn.observe_load(f.load)
    if out.split:
        receive_ms = upload_receive_ms(f.timings)
        if receive_ms > 0 and not out.pipelined:
            conn.observe_upload(out.sent_bytes.payload_bytes, receive_ms)
