"""Per-edge bounds in the cloud: request rate, sessions held and bytes stored per principal.

An edge's identity (``common.security.Principal``: its API key's name, its client
certificate's subject, or its host where no authentication is configured) scopes what
it keeps here: its sessions live under ``scoped(principal, session_id)``, so another
edge that sends the same session id finds nothing of them; and it bounds what one edge
may take from the others:

* **rate**: Generate calls started per window, in the ``limits`` library's notation
  (``"50/second;1000/minute"``, moving windows); past it ``EdgeOverLimit`` with the
  time until the window frees a slot;
* **sessions**: sessions one edge holds (a new one past the bound is refused; its
  existing sessions keep working);
* **stored bytes**: what its sessions hold here, activations ``[T, H]`` float32 plus
  the KV blocks of every layer of each full block (head part from the edge, tail
  part computed here), counted with the turn's prompt before the upload starts.

All three answer ``EdgeOverLimit`` (RESOURCE_EXHAUSTED, with ``retry-after-ms`` for the
rate). Pure domain code, single event loop.
"""

from __future__ import annotations

import math
import time

from limits import RateLimitItem, parse_many, storage, strategies

from tandem.cloud.sessions import CloudSession, SessionTable
from tandem.common.errors import QuotaExceeded
from tandem.common.security import Principal


class EdgeOverLimit(QuotaExceeded):
    """One edge passed its own bound (rate, sessions or stored bytes)."""

    wire_name = "EdgeOverLimit"

    def __init__(self, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


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

    def check_state(self, principal: Principal, sessions: SessionTable, session_key: str, prompt_tokens: int) -> None:
        """Before a turn's upload: may ``principal`` hold the session ``session_key`` (``""`` for a
        stateless turn) with ``prompt_tokens`` tokens?

        Raises:
            EdgeOverLimit: a new session past ``max_sessions``, or the edge's sessions would pass
                ``max_stored_bytes``.
        """
        mine = sessions.owned_by(principal.tag)
        new = self.turn_bytes(prompt_tokens)
        if session_key and session_key not in mine and len(mine) >= self.max_sessions:
            raise EdgeOverLimit(
                f"this edge holds {len(mine)} sessions, its bound is {self.max_sessions}: end or reuse one"
            )
        held = sum(self.session_bytes(s) for key, s in mine.items() if key != session_key)
        if held + new > self.max_stored_bytes:
            raise EdgeOverLimit(
                f"this edge's sessions would hold {held + new} bytes here, its bound is {self.max_stored_bytes}"
            )
