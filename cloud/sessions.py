"""Per-session state the cloud keeps between turns: which prompt tokens it holds
activations for, the activations themselves (the tail engine needs ``prompt_embeds``
for the whole prompt), and the Merkle leaves of the head KV blocks it verified.

Bounded: least-recently-used sessions are dropped past ``max_sessions`` or
``max_bytes``, and a session without a turn for ``idle_s`` expires; a session with a
turn in flight (``turn``) is never dropped. A dropped session is not an error for the
next turn: the block store still holds what it saved (``cloud.sessionstore``), from
which the next turn resyncs, else the gateway answers NOT_FOUND / FAILED_PRECONDITION and
the edge resends from token 0.
Other sessions are never touched by one session's bad input: state is committed
only after a turn's upload verified completely.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from tandem.common.lru import BoundedLRU


@dataclass
class CloudSession:
    """token_ids: prompt tokens with activations held; hidden: float32 ``[S, H]``;
    leaves: RFC 6962 leaf hashes of the session's full head-KV blocks, in order."""

    token_ids: list[int] = field(default_factory=list)
    hidden: np.ndarray | None = None
    leaves: list[bytes] = field(default_factory=list)
    split_layer: int = 0  # the k its activations and leaves belong to
    block_tokens: int = 0  # the KV block size its leaves were cut at
    version: int = 0  # bumped by every committed turn; an upload checked against version v commits only at v
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # held only while a turn commits

    @property
    def nbytes(self) -> int:
        return 0 if self.hidden is None else int(self.hidden.nbytes)


class SessionTable(BoundedLRU[CloudSession]):
    """LRU of ``CloudSession`` bounded by count and bytes (activations, ids, leaves) and idle time;
    counts the turns in flight per session, which keep it from being dropped."""

    def __init__(
        self, max_entries: int, max_bytes: int, idle_s: float = math.inf, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(max_entries, max_bytes, idle_s, clock)
        self._turns: Counter[str] = Counter()
        self._quiet: dict[str, asyncio.Event] = {}  # set when a session's last turn in flight ends

    def get(self, session_id: str) -> CloudSession | None:
        return self.peek(session_id) if session_id else None

    @contextlib.contextmanager
    def turn(self, key: str) -> Iterator[None]:
        """Count a turn of session ``key`` in flight for the ``with`` block ("": stateless, nothing)."""
        if not key:
            yield
            return
        self._turns[key] += 1
        try:
            yield
        finally:
            self._turns[key] -= 1
            if not self._turns[key]:
                del self._turns[key]
                quiet = self._quiet.pop(key, None)
                if quiet is not None:
                    quiet.set()

    def in_flight(self, key: str) -> bool:
        """Whether a turn of session ``key`` is in flight."""
        return self._turns.get(key, 0) > 0

    async def wait_quiet(self, key: str) -> None:
        """Return once no turn of session ``key`` is in flight."""
        if self.in_flight(key):
            await self._quiet.setdefault(key, asyncio.Event()).wait()

    def busy(self, key: str, value: CloudSession) -> bool:
        return value.lock.locked() or self.in_flight(key)

    def owned_by(self, tag: str) -> dict[str, CloudSession]:
        """The sessions under ``tag``'s namespace (keys ``tag/...``, ``common.security.scoped``);
        not marked as used."""
        prefix = tag + "/"
        return {k: v for k, v in self._s.items() if k.startswith(prefix)}

    def entry_bytes(self, key: str, s: CloudSession) -> int:
        return s.nbytes + len(key) + 32 * len(s.leaves) + 8 * len(s.token_ids)
