"""Several cloud targets of one deployment (``tandem-cloud`` replicas sharing one block store,
``--store-url``), used by the edge service as one connection.

Each target has its own ``CloudConnection`` (its own link, params, measurements and load). A
turn is pinned to one replica when it starts (``pin``): rendezvous hashing (highest random
weight; Thaler and Ravishankar, "Using name-based mappings to increase hit rates", IEEE/ACM ToN
1998) of the session id over the replicas that answer now. A session therefore stays on its
replica while that replica is healthy, and when it is not, only its sessions move, each to the
replica next in its own order; when it answers again they come back. A moved session's next turn
finds another ``instance_id`` than the one that acknowledged it, so the edge syncs first
(``SyncSession``): the new replica loads the session from the shared store and only what it
lacks travels. Stateless requests hash their request id (spread over the healthy replicas).

Inside a turn every attribute the service reads (params, link id, load, measurements) is the
pinned replica's; the pin is a ``contextvars`` value, so concurrent turns (each its own task)
never see each other's. Outside a turn (health, ``GetInfo``), it is the first healthy replica's.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import Any

import blake3

from tandem.edge.cloudconn import CloudConnection

log = logging.getLogger("tandem.edge")
_pinned: contextvars.ContextVar[CloudConnection | None] = contextvars.ContextVar("tandem_replica", default=None)


def rendezvous(key: str, targets: list[str]) -> list[int]:
    """Indices of ``targets`` in ``key``'s rendezvous order (highest BLAKE3 weight first)."""
    weight = [blake3.blake3(f"{key}\x00{t}".encode()).digest()[:8] for t in targets]
    return sorted(range(len(targets)), key=lambda i: weight[i], reverse=True)


class ReplicaSet:
    """The edge's connections to ``targets`` (same order), seen as one ``CloudConnection``."""

    def __init__(self, members: list[CloudConnection], targets: list[str]) -> None:
        if not members or len(members) != len(targets) or len(set(targets)) != len(targets):
            raise ValueError("a replica set needs one connection per distinct target")
        self.members, self.targets = members, targets

    def healthy(self, m: CloudConnection) -> bool:
        return m.connected.is_set() and not m._paused

    def choose(self, key: str) -> CloudConnection:
        """The replica ``key`` goes to: its first healthy one in rendezvous order (the first of all,
        when none answers: the turn then waits for it or fails as with one cloud)."""
        order = rendezvous(key, self.targets)
        for i in order:
            if self.healthy(self.members[i]):
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
        return next((m for m in self.members if self.healthy(m)), self.members[0])

    def target_of(self, m: CloudConnection) -> str:
        return self.targets[self.members.index(m)]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.current(), name)

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
        return [(t, self.healthy(m)) for t, m in zip(self.targets, self.members, strict=True)]
