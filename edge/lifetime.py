"""How the edge's sessions end, and the cloud hearing of it.

A session ends in one of three ways, each counted (``tandem:sessions_ended_total{reason}``):

* **ended**: its client asks (``Edge.EndSession``, the SDK's ``end_session``, the OpenAI API's
  ``DELETE /v1/conversations/{id}``): ``SessionLifetime.end`` waits for a turn of it in flight,
  drops the edge's state (head KV and activations, local mode's KV) and asks the cloud to drop
  its own (``Cloud.EndSession``);
* **expired**: no turn for ``idle_s`` (``edge.session.EdgeSessions``, swept by ``sweep_loop``);
* **evicted**: the edge's bound on sessions or bytes, least recently used first, never one with
  a turn in flight.

A session served only in direct mode holds no state on either side; its id is kept
(``StatelessSessions``, bounded and expired as the session table is), so that ending it answers
as ending any other session does, and only an id unknown everywhere is "not found".

An expired or evicted session the cloud holds part of is ended there too, in the background, one
call at a time (``dropped``): the edge will never again send a turn that builds on the cloud's
copy (it starts that session over from token 0), so the cloud's copy only takes room. A cloud
that cannot be reached keeps its copy until its own idle expiry. No grpc.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.common.protocol.errors import DeadlineExceeded, InvalidRequest, TandemError
from tandem.common.protocol.limits import check_session_id
from tandem.common.runtime.lru import BoundedLRU
from tandem.edge import metrics
from tandem.edge.compute.local import LocalEngine
from tandem.edge.link.connection import CloudTarget
from tandem.edge.session import EdgeSession, EdgeSessions

log = logging.getLogger("tandem.edge")
CLOUD_END_TIMEOUT_S = 5.0  # one Cloud.EndSession call


@dataclass
class StatelessSession:
    """A session served in a mode that keeps no state of it: nothing to wait for (``lock`` is never
    held, so the table may always drop it)."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class StatelessSessions(BoundedLRU[StatelessSession]):
    """The ids of sessions whose turns ran in a mode that keeps no state of them on either side
    (direct mode: the cloud decodes from the prompt's token ids, the edge keeps nothing), so that
    ending one answers as ending a session with state does. Bounded by count and idle time as the
    edge's session table is."""

    def entry_bytes(self, key: str, value: StatelessSession) -> int:
        return 0


class SessionLifetime:
    """Ends the sessions of ``sessions`` (and of local mode, ``local()``), telling ``cloud``.
    Installs itself as the table's ``on_drop``. Single event loop."""

    def __init__(
        self, sessions: EdgeSessions, cloud: CloudTarget | None, local: Callable[[], LocalEngine | None]
    ) -> None:
        self.sessions, self.cloud, self.local = sessions, cloud, local
        self.stateless = StatelessSessions(sessions.max_entries, 0, sessions.idle_s)
        self._to_end: asyncio.Queue[str] | None = None  # sessions the cloud holds part of, to end there
        self._worker: asyncio.Task | None = None
        sessions.on_drop = self.dropped

    def dropped(self, session_id: str, s: EdgeSession, reason: str) -> None:
        """The table dropped ``session_id`` (``reason``: expired or evicted): count it, and have the
        cloud end its copy when it holds one."""
        metrics.record_edge_session_end(reason)
        log.debug("session %s %s", session_id, reason)
        if self.cloud is not None and (s.cloud_tokens or s.leaves):
            if self._to_end is None:
                self._to_end = asyncio.Queue()
            self._to_end.put_nowait(session_id)
            if self._worker is None or self._worker.done():
                self._worker = asyncio.create_task(self._end_in_cloud(), name="cloud-session-ends")

    def served_without_state(self, session_id: str) -> None:
        """A turn of ``session_id`` ran in a mode that keeps no state of it (direct): ``end`` finds
        it until it has been idle for the session table's ``idle_s`` (or the least recently used
        past its count bound). Nothing for a stateless turn ("")."""
        if session_id:
            self.stateless.put(session_id, StatelessSession())
            self.stateless.evict()

    async def end(self, session_id: str, timeout_s: float | None = None) -> bool:
        """End ``session_id`` on this edge and in the cloud, after a turn of it in flight (at most
        ``timeout_s``); True if either held state of it or it was served in a mode that keeps none
        (``served_without_state``): False only for a session unknown on both sides. A cloud that
        cannot be reached is logged, not raised: its copy expires there.

        Raises:
            InvalidRequest: an empty session id, or one longer than the cloud takes.
            DeadlineExceeded: a turn of the session was still running after ``timeout_s``.
        """
        if not session_id:
            raise InvalidRequest("EndSession needs a session_id", param="session_id", code="missing_required_parameter")
        check_session_id(session_id)
        try:
            async with asyncio.timeout(timeout_s):
                found = await self._end_here(session_id)
                found = await self._end_cloud(session_id, self.cloud) or found
                found = self.stateless.discard(session_id) is not None or found
        except TimeoutError:
            raise DeadlineExceeded(f"session {session_id!r} busy with a turn past the deadline") from None
        if found:
            metrics.record_edge_session_end("ended")
        return found

    async def _end_here(self, session_id: str) -> bool:
        """Drop the edge's and local mode's state of the session, each once no turn uses it."""
        found = False
        s = self.sessions.lookup(session_id)
        if s is not None:
            async with s.lock:
                if self.sessions.lookup(session_id) is s:
                    self.sessions.discard(session_id)
            found = True
        local = self.local()
        if local is not None:
            found = await local.end_session(session_id) or found
        return found

    @staticmethod
    async def _end_cloud(session_id: str, cloud: CloudTarget | None) -> bool:
        """``Cloud.EndSession`` on the replica the session lives on; False (logged) when it fails."""
        if cloud is None:
            return False
        try:
            return await cloud.pin(session_id).link.end_session(session_id, CLOUD_END_TIMEOUT_S)
        except TandemError as e:
            log.info("the cloud did not end session %s (%s): its copy expires there", session_id, e)
            return False

    async def _end_in_cloud(self) -> None:
        """End the queued sessions in the cloud, one call at a time, until the queue is empty."""
        q = self._to_end
        while q is not None and not q.empty():
            sid = q.get_nowait()
            if sid not in self.sessions:  # not started again meanwhile
                await self._end_cloud(sid, self.cloud)

    async def sweep_loop(self, period_s: float) -> None:
        """Every ``period_s``, expire the sessions idle past their tables' ``idle_s`` and let local
        mode give back what idle state holds (``LocalEngine.tidy``). Until cancelled."""
        while True:
            await asyncio.sleep(period_s)
            self.sessions.expire()
            self.stateless.expire()
            local = self.local()
            if local is not None:
                local.sessions.expire()
                await local.tidy()

    async def settle(self) -> None:
        """Wait until the cloud heard of every session dropped so far (tests, a drain)."""
        while self._worker is not None and not self._worker.done():
            await asyncio.shield(self._worker)

    async def close(self) -> None:
        """Stop ending sessions in the cloud (at shutdown; the cloud's copies expire there)."""
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
