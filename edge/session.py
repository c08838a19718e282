"""What the edge keeps per chat session between turns.

token_ids: prompt tokens the head has processed; kv: head KV float32 ``[k, 2, Hkv, S, D]``;
hidden: ``h_k`` float32 ``[S, H]`` (kept so the edge can resend activations the cloud lost);
cloud_tokens / leaves: what the cloud acknowledged (activations of the first
``cloud_tokens`` tokens and the head-KV Merkle leaves).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np


@dataclass
class EdgeSession:
    token_ids: list[int] = field(default_factory=list)
    kv: np.ndarray | None = None
    hidden: np.ndarray | None = None
    cloud_tokens: int = 0
    leaves: list[bytes] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def common_prefix(self, ids: list[int]) -> int:
        n = min(len(ids), len(self.token_ids))
        i = 0
        while i < n and ids[i] == self.token_ids[i]:
            i += 1
        return i

    def truncate(self, n: int) -> None:
        """Keep only the first ``n`` processed tokens (a conversation edited in the middle)."""
        if n < len(self.token_ids):
            self.token_ids = self.token_ids[:n]
            self.kv = None if self.kv is None or n == 0 else np.ascontiguousarray(self.kv[:, :, :, :n])
            self.hidden = None if self.hidden is None or n == 0 else self.hidden[:n]
            self.cloud_tokens, self.leaves = 0, []  # the cloud's copy no longer matches: resend


class EdgeSessions:
    """LRU of edge sessions bounded by count."""

    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
        self._s: OrderedDict[str, EdgeSession] = OrderedDict()

    def get(self, session_id: str) -> EdgeSession:
        if not session_id:
            return EdgeSession()
        s = self._s.get(session_id)
        if s is None:
            s = self._s[session_id] = EdgeSession()
        self._s.move_to_end(session_id)
        while len(self._s) > self.max_sessions:
            victim = next((k for k, v in self._s.items() if not v.lock.locked()), None)
            if victim is None:
                break
            del self._s[victim]
        return s
