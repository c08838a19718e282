"""Several cloud targets of one deployment (``tandem-cloud`` replicas sharing one block store,
``--store-url``), one ``CloudTarget`` for the edge.

Each target has its own ``CloudConnection`` (its own link, params, measurements and load). A
turn is pinned to one replica when it starts (``pin``): rendezvous hashing (highest random
weight; Thaler and Ravishankar, "Using name-based mappings to increase hit rates", IEEE/ACM ToN
1998) of the session id over the replicas that answer now. A session therefore stays on its
replica while that replica is healthy, and when it is not, only its sessions move, each to the
replica next in its own order; when it answers again they come back. A moved session's next turn
finds another ``instance_id`` than the one that acknowledged it, so the edge syncs first
(``SyncSession``): the new replica loads the session from the shared store and only what it
lacks travels. Stateless requests hash their request id (spread over the healthy replicas).

Inside a turn ``current`` is the pinned replica (its params, link id, load, measurements); the pin
is a ``contextvars`` value, so concurrent turns (each its own task) never see each other's. Outside
a turn (health, ``GetInfo``, metrics), it is the first healthy replica.

The set of replicas may change while the edge runs (``discover``: a ``dns:`` target resolved by
``edge.link.discovery``, every ``resolve_s`` and, at most every ``min_resolve_s``, when a turn fails on
a replica). ``update`` routes over the new set: a replica that joins gets a connection and, by
rendezvous, its share of sessions (new ones, and the existing ones it now ranks first, which sync
on their next turn); one that leaves is dropped, and only its sessions move. Its connection stops
at once and its link closes after ``linger_s`` (turns pinned to it finish, or fail over, first).
A resolution that fails or finds nothing keeps the set as it is.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable

import blake3

from tandem.common.protocol.errors import TandemError
from tandem.edge.link.connection import CloudConnection

log = logging.getLogger("tandem.edge")
_pinned: contextvars.ContextVar[CloudConnection | None] = contextvars.ContextVar("tandem_replica", default=None)


def rendezvous(key: str, targets: list[str]) -> list[int]:
    """Indices of ``targets`` in ``key``'s rendezvous order (highest BLAKE3 weight first)."""
    weight = [blake3.blake3(f"{key}\x00{t}".encode()).digest()[:8] for t in targets]
    return sorted(range(len(targets)), key=lambda i: weight[i], reverse=True)


class ReplicaSet:
    """The edge's connections to ``targets`` (same order), as one ``CloudTarget``.

    ``discover`` (optional): answers the replicas' targets now (raises ``TandemError`` when it
    cannot tell); ``connect`` makes the connection of a target that joins. Both or neither."""

    def __init__(
        self,
        members: list[CloudConnection],
        targets: list[str],
        *,
        discover: Callable[[], Awaitable[list[str]]] | None = None,
        connect: Callable[[str], CloudConnection] | None = None,
        resolve_s: float = 30.0,
        min_resolve_s: float = 1.0,
        linger_s: float = 60.0,
    ) -> None:
        if not members or len(members) != len(targets) or len(set(targets)) != len(targets):
            raise ValueError("a replica set needs one connection per distinct target")
        if (discover is None) != (connect is None):
            raise ValueError("discover and connect go together")
        self.members, self.targets = members, targets
        self._discover, self._connect = discover, connect
        self.resolve_s, self.min_resolve_s, self.linger_s = resolve_s, min_resolve_s, linger_s
        self.resolutions = 0  # successful resolutions (each may or may not change the set)
        self._started = False
        self._resolve_now = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._retired: list[CloudConnection] = []  # left the set; their links close after linger_s

    def choose(self, key: str) -> CloudConnection:
        """The replica ``key`` goes to: its first healthy one in rendezvous order (the first of all,
        when none answers: the turn then waits for it or fails as with one cloud)."""
        order = rendezvous(key, self.targets)
        for i in order:
            if self.members[i].healthy:
                return self.members[i]
        return self.members[order[0]]

    def pin(self, key: str) -> CloudConnection:
        """Pin the calling task's turn to ``choose(key)``; returns it."""
        m = self.choose(key)
        _pinned.set(m)
        return m

    def current(self) -> CloudConnection:
        m = _pinned.get()
        if m is not None and (m in self.members or m in self._retired):  # a turn on a replica that left ends there
            return m
        return next((m for m in self.members if m.healthy), self.members[0])

    def fail_over(self, failed: CloudConnection, key: str, cause: Exception) -> CloudConnection | None:
        """Mark ``failed`` down (it reconnects in the background) and pin the turn to the next
        healthy replica in ``key``'s order; None if there is none."""
        failed.renegotiate_soon(f"a turn failed on it ({cause})")
        self._resolve_now.set()  # a replica that fails may have left: ask DNS again (rate-limited)
        nxt = self.pin(key)
        if nxt is failed or not nxt.healthy:
            return None
        log.warning(
            "cloud replica %s failed (%s): turn moves to %s", self.target_of(failed), cause, self.target_of(nxt)
        )
        return nxt

    def target_of(self, m: CloudConnection) -> str:
        """``m``'s target ("a replica that left" when it is no longer in the set)."""
        return self.targets[self.members.index(m)] if m in self.members else "a replica that left"

    def start(self) -> None:
        self._started = True
        for m in self.members:
            m.start()
        if self._discover is not None:
            self._spawn(self._resolve_loop(), "replica-discovery")

    async def stop(self) -> None:
        """Stop discovery and every connection; close the links of connections this set made."""
        self._started = False
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        for m in self.members:
            await m.stop()
        for m in self._retired + (self.members if self._connect is not None else []):
            await m.link.close()
        self._retired.clear()

    # ------------------------------------------------------------------ membership

    def update(self, targets: list[str]) -> bool:
        """Route over ``targets`` from now on (see module doc); [] keeps the set. True if it changed."""
        targets = list(dict.fromkeys(targets))
        if not targets or targets == self.targets or self._connect is None:
            return False
        have = dict(zip(self.targets, self.members, strict=True))
        members = [have.pop(t) if t in have else self._connect(t) for t in targets]
        joined = [t for t in targets if t not in self.targets]
        self.members, self.targets = members, targets
        log.info("cloud replicas now %s (joined: %s; left: %s)", targets, joined or "none", list(have) or "none")
        for t, m in zip(targets, members, strict=True):
            if t in joined and self._started:
                m.start()
        for m in have.values():
            self._spawn(self._retire(m), "replica-retire")
        return True

    async def refresh(self) -> bool:
        """Resolve the replicas now and ``update``; False (logged) when discovery failed or found
        nothing, or the set has no discovery."""
        if self._discover is None:
            return False
        try:
            targets = await self._discover()
        except TandemError as e:
            log.warning("cloud replica discovery failed (%s): keeping %s", e, self.targets)
            return False
        except Exception:  # a resolver's own bug must not end discovery: the next period tries again
            log.exception("cloud replica discovery failed: keeping %s", self.targets)
            return False
        self.resolutions += 1
        if not targets:
            log.warning("cloud replica discovery found no replica: keeping %s", self.targets)
            return False
        self.update(targets)
        return True

    async def _resolve_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            await self.refresh()
            self._resolve_now.clear()
            try:
                async with asyncio.timeout(self.resolve_s):
                    await self._resolve_now.wait()
            except TimeoutError:
                continue
            await asyncio.sleep(max(0.0, self.min_resolve_s - (loop.time() - t0)))

    async def _retire(self, m: CloudConnection) -> None:
        await m.stop()
        self._retired.append(m)
        await asyncio.sleep(self.linger_s)
        if m in self._retired:
            self._retired.remove(m)
            await m.link.close()

    def _spawn(self, coro, name: str) -> None:
        t = asyncio.create_task(coro, name=name)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def wait_connected(self, timeout_s: float) -> bool:
        """True as soon as any replica is connected (within ``timeout_s``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout_s)
        while not any(m.connected.is_set() for m in self.members):
            left = deadline - loop.time()
            if left <= 0:
                return False
            members = list(self.members)  # the set may change meanwhile: look again every 0.25 s
            waits = [asyncio.ensure_future(m.connected.wait()) for m in members]
            try:
                await asyncio.wait(waits, timeout=min(left, 0.25), return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
        return True

    def status(self) -> list[tuple[str, bool]]:
        """(target, answering now) per replica."""
        return [(t, m.healthy) for t, m in zip(self.targets, self.members, strict=True)]
