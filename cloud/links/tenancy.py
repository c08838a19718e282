"""Per-edge bounds in the cloud: request rate, sessions held and bytes stored per principal.

An edge's identity (``common.runtime.security.Principal``: its API key's name, its client
certificate's subject, or its host where no authentication is configured) scopes what
it keeps here: its sessions live under ``scoped(principal, session_id)``, so another
edge that sends the same session id finds nothing of them; and it bounds what one edge
may take from the others:

* **rate**: Generate calls started per window, in the ``limits`` library's notation
  (``"50/second;1000/minute"``, moving windows); past it ``EdgeOverLimit`` with the
  time until the window frees a slot;
* **sessions**: sessions one edge holds in memory here; a new one past the bound takes
  the place of the edge's least recently used session without a turn in flight;
* **stored bytes**: what its sessions hold here, activations ``[T, H]`` float32 plus
  the KV blocks of every layer of each full block (head part from the edge, tail
  part computed here), counted with the turn's prompt before the upload starts; past
  it, the edge's least recently used sessions without a turn in flight make room.

The state bounds count what is admitted and in flight, not only what is committed: a turn
(or a ``SyncSession`` that loads a session from the store) holds its session's place and
bytes from the moment it passes the check until it ends, on every path (``hold_state``), so
concurrent new sessions of one edge are admitted exactly up to the bound. A stateless turn
holds its bytes too. The same hold takes the session's room in the node's session table
(``SessionTable.hold``: the cloud's ``max_sessions`` and ``session_bytes``).

A session dropped to make room leaves memory only: the block store keeps its record,
from which its next turn resyncs (``cloud.sessions.sync``), else that turn starts over
from token 0; it never fails. Only when every session of the edge has a turn in flight
(or one turn alone needs more than the bound) is the turn refused: ``EdgeOverLimit``
(RESOURCE_EXHAUSTED, with ``retry-after-ms``), as for the rate. Pure domain code, single
event loop.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from limits import RateLimitItem, parse_many, storage, strategies

from tandem.cloud.sessions.table import CloudSession, SessionTable
from tandem.common.protocol.errors import QuotaExceeded, TurnTooLarge
from tandem.common.runtime.security import Principal


class EdgeOverLimit(QuotaExceeded):
    """One edge passed its own bound (rate, sessions or stored bytes)."""

    wire_name = "EdgeOverLimit"

    def __init__(self, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


@dataclass(eq=False)
class _Hold:
    """What one turn in flight holds of its edge's state bounds."""

    session_key: str  # "" for a stateless turn
    nbytes: int  # ``EdgeLimits.turn_bytes`` of its prompt


def parse_rate(spec: str | None) -> list[RateLimitItem]:
    """``"50/second;1000/minute"`` as ``limits`` items ([] for None or empty).

    Raises:
        ValueError: not in the ``limits`` notation.
    """
    return parse_many(spec) if spec else []


class EdgeLimits:
    """Args:
    rate: ``limits`` notation, or None for no rate bound.
    max_sessions: sessions one edge may hold.
    max_stored_bytes: bytes one edge's sessions may hold.
    block_bytes: bytes of one full KV block over every layer (float32, ``[L, 2, Hkv, B, D]``).
    hidden_bytes_per_token: bytes of one token's activations (``4 * H``).
    """

    def __init__(
        self,
        rate: str | None,
        max_sessions: int,
        max_stored_bytes: int,
        block_bytes: int,
        block_tokens: int,
        hidden_bytes_per_token: int,
    ) -> None:
        self.rate = parse_rate(rate)
        self._limiter = strategies.MovingWindowRateLimiter(storage.MemoryStorage())
        self.max_sessions, self.max_stored_bytes = max_sessions, max_stored_bytes
        self.block_bytes, self.block_tokens = block_bytes, block_tokens
        self.hidden_bytes_per_token = hidden_bytes_per_token
        self._holds: dict[str, list[_Hold]] = {}  # principal tag -> the holds of its turns in flight

    def check_rate(self, principal: Principal) -> None:
        """Count one request of ``principal``.

        Raises:
            EdgeOverLimit: a window is full; ``retry_after_ms`` until it frees a slot.
        """
        key = principal.tag
        full = [item for item in self.rate if not self._limiter.test(item, key)]
        if full:
            reset_s = max(self._limiter.get_window_stats(item, key).reset_time for item in full)
            wait_ms = max(1, math.ceil((reset_s - time.time()) * 1e3))
            raise EdgeOverLimit(
                f"this edge is over its request rate ({'; '.join(str(i) for i in full)}); retry in {wait_ms} ms",
                retry_after_ms=wait_ms,
            )
        for item in self.rate:
            self._limiter.hit(item, key)

    def session_bytes(self, s: CloudSession) -> int:
        """What one session holds here: its activations and the KV blocks of its leaves."""
        return s.nbytes + len(s.leaves) * self.block_bytes

    def turn_bytes(self, prompt_tokens: int) -> int:
        """What a session holds after a turn of ``prompt_tokens``."""
        return prompt_tokens * self.hidden_bytes_per_token + (prompt_tokens // self.block_tokens) * self.block_bytes

    @contextmanager
    def hold_state(
        self, principal: Principal, sessions: SessionTable, session_key: str, prompt_tokens: int
    ) -> Iterator[None]:
        """Make room for ``principal``'s session ``session_key`` (``""``: a stateless turn) after a
        turn of ``prompt_tokens`` tokens, within the edge's bounds (``check_state``) and the node's
        session table (``SessionTable.hold``), and hold that room for the ``with`` block: from now on
        both count it, committed or not; released on every exit (success, error, cancellation).

        Raises:
            EdgeOverLimit, TurnTooLarge: see ``check_state``. SessionTableFull: the node's table has
                no room (TurnTooLarge: never, for this session alone).
        """
        self.check_state(principal, sessions, session_key, prompt_tokens)
        hold = _Hold(session_key, self.turn_bytes(prompt_tokens))
        mine = self._holds.setdefault(principal.tag, [])
        mine.append(hold)
        try:
            if not session_key:
                yield
                return
            entry = sessions.expected_bytes(session_key, prompt_tokens, self.hidden_bytes_per_token, self.block_tokens)
            with sessions.hold(session_key, entry):
                yield
        finally:
            mine.remove(hold)
            if not mine:
                del self._holds[principal.tag]

    def holding(self, principal: Principal) -> tuple[int, int]:
        """(turns in flight, bytes they hold) of ``principal``."""
        mine = self._holds.get(principal.tag, [])
        return len(mine), sum(h.nbytes for h in mine)

    def check_state(self, principal: Principal, sessions: SessionTable, session_key: str, prompt_tokens: int) -> None:
        """Make room for ``principal`` to hold the session ``session_key`` (``""`` for a stateless
        turn) with ``prompt_tokens`` tokens beside its other sessions, committed or held by a turn in
        flight (``hold_state``), dropping from memory the edge's least recently used sessions without
        a turn in flight (never ``session_key``).

        Raises:
            TurnTooLarge: the turn alone would pass ``max_stored_bytes`` (never fits: no retry hint).
            EdgeOverLimit: every other session of the edge in the way has a turn in flight
                (``retry_after_ms``: a turn ending frees room).
        """
        mine = sessions.owned_by(principal.tag)
        held: dict[str, int] = {}  # session key -> the most a turn in flight holds for it
        stateless = 0
        for h in self._holds.get(principal.tag, []):
            if h.session_key:
                held[h.session_key] = max(held.get(h.session_key, 0), h.nbytes)
            else:
                stateless += h.nbytes
        others = (set(mine) | set(held)) - {session_key}
        new = self.turn_bytes(prompt_tokens)
        if new > self.max_stored_bytes:
            raise TurnTooLarge(
                f"a turn of {prompt_tokens} prompt tokens holds {new} bytes in the cloud, more than this edge's whole "
                f"bound there, edge_max_stored_bytes = {self.max_stored_bytes} bytes: it can never be held; send a "
                "shorter prompt, use another mode, or raise the cloud's edge_max_stored_bytes",
                param="prompt",
            )
        fresh = session_key and session_key not in mine and session_key not in held
        while fresh and len(others) >= self.max_sessions:
            why = f"this edge holds {len(others)} sessions, its bound is {self.max_sessions}"
            self._make_room(sessions, others, why)

        def size(key: str) -> int:
            return max(self.session_bytes(mine[key]) if key in mine else 0, held.get(key, 0))

        own = max(new, held.get(session_key, 0)) if session_key else new
        while sum(size(k) for k in others) + stateless + own > self.max_stored_bytes:
            why = f"this edge's sessions and turns in flight would pass {self.max_stored_bytes} bytes"
            self._make_room(sessions, others, why)

    @staticmethod
    def _make_room(sessions: SessionTable, others: set[str], why: str) -> None:
        """Drop the least recently used of ``others`` without a turn in flight (removed from ``others``).

        Raises:
            EdgeOverLimit: each of them has a turn in flight.
        """
        victim = sessions.evict_one(among=others)
        if victim is None:
            raise EdgeOverLimit(f"{why}, and each has a turn in flight: retry when one ends", retry_after_ms=1000)
        others.discard(victim)
