"""Flow control of one ``Generate`` call's payload, either direction: the sender keeps the payload
bytes it sent past the receiver's last acknowledgement within a window (``SendWindow``), the receiver
counts the payload bytes it received, each item once (``ReceivedBytes``), and acknowledges them
(``WindowAck`` going down for the upload, ``KVDownAck`` going up for remote prefill's KV). Pure
bookkeeping: who waits, and when an ack is sent, is the caller's.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field


@dataclass(kw_only=True)
class SendWindow:
    """The sender's side: ``window_bytes`` of payload may be in flight past the last acknowledged
    byte; an item larger than the window goes when nothing is in flight."""

    window_bytes: int
    sent_bytes: int = 0  # payload bytes of first sends (resends do not count, as the receiver counts)
    acked_bytes: int = 0  # the receiver's received_bytes, at most what was sent

    @property
    def in_flight_bytes(self) -> int:
        return self.sent_bytes - self.acked_bytes

    def fits(self, nbytes: int) -> bool:
        """Whether an item of ``nbytes`` payload bytes may go now."""
        return self.in_flight_bytes <= 0 or self.in_flight_bytes + nbytes <= self.window_bytes

    def sent(self, nbytes: int) -> None:
        """An item of ``nbytes`` payload bytes went (its first send)."""
        self.sent_bytes += nbytes

    def ack(self, received_bytes: int) -> None:
        """The receiver's count of payload received; never moves back nor past what was sent."""
        self.acked_bytes = max(self.acked_bytes, min(received_bytes, self.sent_bytes))


@dataclass(kw_only=True)
class ReceivedBytes:
    """The receiver's side: payload bytes received, each item (``key``) counted once."""

    received_bytes: int = 0
    seen: set[Hashable] = field(default_factory=set)

    def count(self, key: Hashable, nbytes: int) -> bool:
        """Count an item's ``nbytes`` the first time ``key`` arrives; returns whether it was new."""
        if key in self.seen:
            return False
        self.seen.add(key)
        self.received_bytes += nbytes
        return True
