"""What the edge keeps per chat session between turns.

token_ids: prompt tokens the head has processed; kv: head KV float32 ``[k, 2, Hkv, S, D]``;
hidden: ``h_k`` float32 ``[S, H]`` (kept so the edge can resend activations the cloud lost);
cloud_tokens / leaves: what the cloud acknowledged (activations of the first
``cloud_tokens`` tokens and the head-KV Merkle leaves).

Bounded by count and by bytes (head KV + activations of all sessions) and by idle time;
least recently used sessions that no turn is using are dropped first. Arrays are replaced, never
written in place, so a snapshot of a session's fields is a cheap rollback point for a
turn that fails: a failed turn leaves the session as it was.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, fields, replace

import numpy as np

from tandem.common.runtime.lru import RememberingLRU


@dataclass
class EdgeSession:
    token_ids: list[int] = field(default_factory=list)
    kv: np.ndarray | None = None
    hidden: np.ndarray | None = None
    cloud_tokens: int = 0
    leaves: list[bytes] = field(default_factory=list)
    k: int = 0  # the split layer its head KV and activations belong to
    block_tokens: int = 0  # KV block size of ``leaves`` (0 until the cloud acknowledged a turn)
    synced_with: str = ""  # the cloud (its instance id) that ``cloud_tokens`` and ``leaves`` describe
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def nbytes(self) -> int:
        """Head KV and activation bytes held."""
        return sum(0 if a is None else int(a.nbytes) for a in (self.kv, self.hidden))

    def common_prefix(self, ids: list[int]) -> int:
        n = min(len(ids), len(self.token_ids))
        i = 0
        while i < n and ids[i] == self.token_ids[i]:
            i += 1
        return i

    def truncate(self, n: int) -> None:
        """Keep only the first ``n`` processed tokens (a conversation edited in the middle, or a
        regenerated answer). What the cloud holds of the common prefix stays valid: its first
        ``min(cloud_tokens, n)`` activations and the leaves of the full blocks inside them (a Merkle
        tree cut to a prefix of its leaves is the tree of that prefix), so only the rest is resent."""
        if n < len(self.token_ids):
            self.token_ids = self.token_ids[:n]
            self.kv = None if self.kv is None or n == 0 else np.ascontiguousarray(self.kv[:, :, :, :n])
            self.hidden = None if self.hidden is None or n == 0 else self.hidden[:n]
        self.forget_cloud_past(n)

    def forget_cloud_past(self, n: int) -> None:
        """The cloud's copy is good for the first ``n`` tokens at most: keep ``cloud_tokens <= n`` and
        only the leaves of full blocks within them."""
        self.cloud_tokens = min(self.cloud_tokens, n)
        keep = self.cloud_tokens // self.block_tokens if self.block_tokens else 0
        self.leaves = self.leaves[:keep]
        if not self.leaves and not self.cloud_tokens:
            self.block_tokens = 0

    def reset(self, k: int) -> None:
        """Start over at split layer ``k`` (the session moves to another head): nothing is kept."""
        self.truncate(0)
        self.kv = self.hidden = None
        self.k = k
        self.synced_with = ""

    def snapshot(self) -> EdgeSession:
        """A rollback point (shares the arrays, which are never modified in place)."""
        return replace(self, token_ids=list(self.token_ids), leaves=list(self.leaves))

    def restore(self, snap: EdgeSession) -> None:
        """Return to ``snap`` (the lock stays this session's)."""
        for f in fields(self):
            if f.name != "lock":
                setattr(self, f.name, getattr(snap, f.name))


class EdgeSessions(RememberingLRU[EdgeSession]):
    """LRU of edge sessions bounded by count and bytes (head KV + activations) and by idle time
    (``idle_s`` without a turn). Remembers the ids of the last ``4 * max_entries`` sessions it
    dropped, so a turn of one can be told its session expired (``expired``); ``on_drop`` (the edge
    node's) is told of each, so that the cloud can drop its copy."""

    def get(self, session_id: str) -> EdgeSession:
        """The session (created empty if unknown); a stateless request gets a throwaway one."""
        if not session_id:
            return EdgeSession()
        s = self.peek(session_id)
        if s is None:
            s = EdgeSession()
            self.put(session_id, s)
        return s

    def discard_if_empty(self, session_id: str) -> None:
        """Forget a session that holds nothing (its first turn failed)."""
        s = self._s.get(session_id)
        if s is not None and not s.token_ids and not s.lock.locked():
            self.discard(session_id)

    def entry_bytes(self, key: str, s: EdgeSession) -> int:
        return s.nbytes
