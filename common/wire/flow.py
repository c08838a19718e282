"""Flow control of one ``Generate`` call's payload, either direction: the sender keeps the payload
bytes it sent past the receiver's last acknowledgement within a window (``SendWindow``), the receiver
counts the payload bytes it received, each item once (``ReceivedBytes``), and acknowledges them
(``WindowAck`` going down for the upload, ``KVDownAck`` going up for remote prefill's KV). A flow
that shares the call with what a user waits for (remote prefill's KV beside the reply's tokens)
also keeps the queueing delay it adds within a bound (``DelayBoundWindow``). Pure bookkeeping: who
waits, and when an ack is sent, is the caller's.
"""

from __future__ import annotations

import math
from collections import deque
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
class DelayBoundWindow(SendWindow):
    """A ``SendWindow`` for a flow that must not hold up what else goes down the same call (remote
    prefill's KV blocks, queued in one stream with the reply's tokens: a token waits behind every
    block byte still in the link's queues). Each ack's delay is timed from the send of the last item
    it covers; the smallest seen is the base (the round trip, one item's transmission, the
    receiver's check); the rest is queueing. A delay more than ``target_queue_ms`` above the base
    halves the window (at most once per window's worth of acks), else it grows by one item per
    window's worth of acks (TCP's congestion avoidance), between one item (the largest of those the
    ack covered; ``fits`` lets an item go when nothing is in flight) and ``max_bytes`` (the
    ``window_bytes`` it is made with). The delay-based rule of LEDBAT (RFC 6817, whose target is
    100 ms for bulk background traffic; a reply's tokens want tens of ms). On a link whose
    bandwidth-delay product holds the window, the acks show no queue and the window stays at
    ``max_bytes``.

    Times are the caller's clock (ms)."""

    target_queue_ms: float
    max_bytes: int = field(init=False)
    base_delay_ms: float = math.inf
    queue_ms: float = 0.0  # the last ack's delay above the base
    _sends: deque[tuple[int, int, float]] = field(default_factory=deque)  # (sent_bytes after, size, when)
    _hold_until: int = -1  # no second halving until the acks pass this byte (the last sent at a halving)

    def __post_init__(self) -> None:
        self.window_bytes = self.max_bytes = max(1, self.window_bytes)

    def resume(self, window_bytes: int) -> None:
        """Start from the window an earlier flow over the same link ended with, within ``[1,
        max_bytes]``: a slow link's next flow does not queue a full window ahead of what shares
        the call before its acks show the queue again. The base delay is this flow's own to
        measure (a link whose round trip grew since would otherwise read it all as queueing)."""
        self.window_bytes = min(self.max_bytes, max(1, int(window_bytes)))

    def sent_at(self, nbytes: int, now_ms: float) -> None:
        """An item of ``nbytes`` payload bytes went at ``now_ms`` (its first send)."""
        self.sent(nbytes)
        self._sends.append((self.sent_bytes, nbytes, now_ms))

    def ack_at(self, received_bytes: int, now_ms: float) -> None:
        """The receiver's count of payload received, heard at ``now_ms``."""
        before = self.acked_bytes
        self.ack(received_bytes)
        sent_ms, items, covered_bytes, item_bytes = None, 0, 0, 0
        while self._sends and self._sends[0][0] <= self.acked_bytes:
            _, nbytes, sent_ms = self._sends.popleft()
            items, covered_bytes, item_bytes = items + 1, covered_bytes + nbytes, max(item_bytes, nbytes)
        if sent_ms is None:  # no item wholly acknowledged by this ack
            return
        delay_ms = max(0.0, now_ms - sent_ms)
        self.base_delay_ms = min(self.base_delay_ms, delay_ms)
        self.queue_ms = delay_ms - self.base_delay_ms
        if self.queue_ms > self.target_queue_ms:
            if self.acked_bytes > self._hold_until:  # halved, to one item at the least
                self.window_bytes = max(min(item_bytes, self.max_bytes), self.window_bytes // 2, 1)
                self._hold_until = self.sent_bytes
        else:  # one item more per window's worth of acks
            acked = self.acked_bytes - before
            grow = math.ceil(acked * (covered_bytes / items) / self.window_bytes)
            self.window_bytes = min(self.max_bytes, self.window_bytes + grow)


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
