"""Per-session state the cloud keeps between turns: which prompt tokens it holds
activations for, the activations themselves (the tail engine needs ``prompt_embeds``
for the whole prompt), and the Merkle leaves of the head KV blocks it verified.

Bounded: least-recently-used sessions are dropped past ``max_sessions`` or
``max_bytes``, and a session without a turn for ``idle_s`` expires; a session with a
turn in flight (``turn``) is never dropped. The bounds count what is admitted as well as
what is committed: a turn holds its session's place and bytes from its start (``hold``),
so that concurrent new sessions cannot pass them; when every session in the way has a turn
in flight the new one is refused (``SessionTableFull``, RESOURCE_EXHAUSTED with a retry
delay). A dropped session is not an error for the next turn: the block store still holds
what it saved (``cloud.sessions.store``), from which the next turn resyncs, else the gateway
answers NOT_FOUND / FAILED_PRECONDITION and the edge resends from token 0.
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

from tandem.common.protocol.errors import QuotaExceeded, TurnTooLarge
from tandem.common.runtime.lru import BoundedLRU

LEAF_BYTES = 32  # one Merkle leaf hash
TOKEN_ID_BYTES = 8  # one token id in ``token_ids`` (a Python int, as the table counts it)


class SessionTableFull(QuotaExceeded):
    """The cloud's session table is at a bound and every session in the way has a turn in flight."""

    wire_name = "SessionTableFull"

    def __init__(self, message: str, retry_after_ms: int = 1000) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


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
    counts the turns in flight per session, which keep it from being dropped, and the places and
    bytes they hold (``hold``), which count against the bounds before anything is committed."""

    def __init__(
        self, max_entries: int, max_bytes: int, idle_s: float = math.inf, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(max_entries, max_bytes, idle_s, clock)
        self._turns: Counter[str] = Counter()
        self._quiet: dict[str, asyncio.Event] = {}  # set when a session's last turn in flight ends
        self._held: dict[str, list[int]] = {}  # key -> bytes held by each turn in flight that holds it

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
        return value.lock.locked() or self.in_flight(key) or key in self._held

    @contextlib.contextmanager
    def hold(self, key: str, nbytes: int) -> Iterator[None]:
        """Make room for session ``key`` holding ``nbytes`` (its ``entry_bytes`` after the turn,
        ``expected_bytes``) and hold that room for the ``with`` block, released on every exit: from
        now on the bounds count it, committed or not. Room is made by dropping the least recently
        used sessions that are not busy.

        Raises:
            TurnTooLarge: ``nbytes`` alone passes ``max_bytes``.
            SessionTableFull: every session in the way is busy.
        """
        self.make_room(key, nbytes)
        held = self._held.setdefault(key, [])
        held.append(nbytes)
        try:
            yield
        finally:
            held.remove(nbytes)
            if not held:
                del self._held[key]

    def make_room(self, key: str, nbytes: int) -> None:
        """Drop least recently used idle sessions until session ``key`` of ``nbytes`` fits beside every
        other session committed or held (see ``hold``).

        Raises:
            TurnTooLarge: ``nbytes`` alone passes ``max_bytes`` (never fits: no retry hint).
            SessionTableFull: every session in the way is busy.
        """
        if nbytes > self.max_bytes:
            raise TurnTooLarge(
                f"a session of {nbytes} bytes passes the cloud's whole bound on sessions, session_bytes = "
                f"{self.max_bytes} bytes: it can never be held; send a shorter prompt, use another mode, or raise "
                "the cloud's session_bytes",
                param="prompt",
            )
        others = (set(self._s) | set(self._held)) - {key}
        while key not in self._s and key not in self._held and len(others) >= self.max_entries:
            self._make_room(others, f"the cloud holds {len(others)} sessions, its bound is {self.max_entries}")
        own = max(nbytes, self._held_bytes(key))
        while sum(self._bytes_of(k) for k in others) + own > self.max_bytes:
            self._make_room(others, f"the cloud's sessions would pass {self.max_bytes} bytes")

    def _make_room(self, others: set[str], why: str) -> None:
        victim = self.evict_one(among=others)
        if victim is None:
            raise SessionTableFull(f"{why}, and each has a turn in flight: retry when one ends")
        others.discard(victim)

    def _held_bytes(self, key: str) -> int:
        return max(self._held.get(key, ()), default=0)

    def _bytes_of(self, key: str) -> int:
        """What session ``key`` takes against the byte bound: the larger of its committed entry and
        what a turn in flight holds for it."""
        v = self._s.get(key)
        return max(self.entry_bytes(key, v) if v is not None else 0, self._held_bytes(key))

    def holding(self) -> int:
        """Sessions with room held by a turn in flight (committed or not)."""
        return len(self._held)

    def owned_by(self, tag: str) -> dict[str, CloudSession]:
        """The sessions under ``tag``'s namespace (keys ``tag/...``, ``common.runtime.security.scoped``);
        not marked as used."""
        prefix = tag + "/"
        return {k: v for k, v in self._s.items() if k.startswith(prefix)}

    def entry_bytes(self, key: str, s: CloudSession) -> int:
        return s.nbytes + len(key) + LEAF_BYTES * len(s.leaves) + TOKEN_ID_BYTES * len(s.token_ids)

    @staticmethod
    def expected_bytes(key: str, tokens: int, hidden_bytes_per_token: int, block_tokens: int) -> int:
        """``entry_bytes`` of session ``key`` after a turn of ``tokens`` prompt tokens: activations,
        one leaf per full block of ``block_tokens``, the token ids."""
        leaves = tokens // block_tokens if block_tokens else 0
        return tokens * hidden_bytes_per_token + len(key) + LEAF_BYTES * leaves + TOKEN_ID_BYTES * tokens
