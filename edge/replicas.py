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
"""

from __future__ import annotations

import asyncio
import contextvars
import logging

import blake3

from tandem.edge.cloudconn import CloudConnection

log = logging.getLogger("tandem.edge")
_pinned: contextvars.ContextVar[CloudConnection | None] = contextvars.ContextVar("tandem_replica", default=None)


def rendezvous(key: str, targets: list[str]) -> list[int]:
    """Indices of ``targets`` in ``key``'s rendezvous order (highest BLAKE3 weight first)."""
    weight = [blake3.blake3(f"{key}\x00{t}".encode()).digest()[:8] for t in targets]
    return sorted(range(len(targets)), key=lambda i: weight[i], reverse=True)


class ReplicaSet:
    """The edge's connections to ``targets`` (same order), as one ``CloudTarget``."""

    def __init__(self, members: list[CloudConnection], targets: list[str]) -> None:
        if not members or len(members) != len(targets) or len(set(targets)) != len(targets):
            raise ValueError("a replica set needs one connection per distinct target")
        self.members, self.targets = members, targets

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
        if m is not None and m in self.members:
            return m
        return next((m for m in self.members if m.healthy), self.members[0])

    def fail_over(self, failed: CloudConnection, key: str, cause: Exception) -> CloudConnection | None:
        """Mark ``failed`` down (it reconnects in the background) and pin the turn to the next
        healthy replica in ``key``'s order; None if there is none."""
        failed.renegotiate_soon(f"a turn failed on it ({cause})")
        nxt = self.pin(key)
        if nxt is failed or not nxt.healthy:
            return None
        log.warning(
            "cloud replica %s failed (%s): turn moves to %s", self.target_of(failed), cause, self.target_of(nxt)
        )
        return nxt

    def target_of(self, m: CloudConnection) -> str:
        return self.targets[self.members.index(m)]

    def start(self) -> None:
        for m in self.members:
            m.start()

    async def stop(self) -> None:
        for m in self.members:
            await m.stop()

    async def wait_connected(self, timeout_s: float) -> bool:
        """True as soon as any replica is connected (within ``timeout_s``)."""
        if any(m.connected.is_set() for m in self.members):
            return True
        waits = [asyncio.ensure_future(m.connected.wait()) for m in self.members]
        try:
            done, _ = await asyncio.wait(waits, timeout=max(0.0, timeout_s), return_when=asyncio.FIRST_COMPLETED)
            return bool(done)
        finally:
            for w in waits:
                w.cancel()

    def status(self) -> list[tuple[str, bool]]:
        """(target, answering now) per replica."""
        return [(t, m.healthy) for t, m in zip(self.targets, self.members, strict=True)]
