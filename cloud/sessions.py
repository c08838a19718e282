"""Per-session state the cloud keeps between turns: which prompt tokens it holds
activations for, the activations themselves (the tail engine needs ``prompt_embeds``
for the whole prompt), and the Merkle leaves of the head KV blocks it verified.

Bounded: least-recently-used sessions are dropped past ``max_sessions`` or
``max_bytes``. A dropped session is not an error for the next turn: the gateway
answers FAILED_PRECONDITION and the edge resends from token 0.
Other sessions are never touched by one session's bad input: state is committed
only after a turn's upload verified completely.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from common.lru import evict_lru


@dataclass
class CloudSession:
    """token_ids: prompt tokens with activations held; hidden: float32 ``[S, H]``;
    leaves: RFC 6962 leaf hashes of the session's full head-KV blocks, in order."""

    token_ids: list[int] = field(default_factory=list)
    hidden: np.ndarray | None = None
    leaves: list[bytes] = field(default_factory=list)
    version: int = 0  # bumped by every committed turn; an upload checked against version v commits only at v
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # held only while a turn commits

    @property
    def nbytes(self) -> int:
        return 0 if self.hidden is None else int(self.hidden.nbytes)


class SessionTable:
    """LRU of ``CloudSession`` bounded by count and activation bytes."""

    def __init__(self, max_sessions: int, max_bytes: int) -> None:
        self.max_sessions, self.max_bytes = max_sessions, max_bytes
        self._s: OrderedDict[str, CloudSession] = OrderedDict()

    def get(self, session_id: str) -> CloudSession | None:
        s = self._s.get(session_id) if session_id else None
        if s is not None:
            self._s.move_to_end(session_id)
        return s

    def put(self, session_id: str, session: CloudSession) -> None:
        """Insert or refresh a session (after a verified turn)."""
        self._s[session_id] = session
        self._s.move_to_end(session_id)

    def evict(self) -> list[str]:
        """Drop least-recently-used unlocked sessions until within bounds; returns dropped ids."""
        return evict_lru(
            self._s,
            lambda: len(self._s) > self.max_sessions or self.nbytes() > self.max_bytes,
            lambda s: s.lock.locked(),
        )

    def nbytes(self) -> int:
        """Activation bytes plus ids and leaves, all sessions."""
        return sum(s.nbytes + len(k) + 32 * len(s.leaves) + 8 * len(s.token_ids) for k, s in self._s.items())

    def __len__(self) -> int:
        return len(self._s)
