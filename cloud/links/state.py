"""What ``cloud.links.table.LinkTable`` keeps per link and says about it: a link's objectives (``LinkSlo``),
its weight, requests running and waiting, recent latencies, durations and demand (``Link``, each
history bounded); the controller's settings (``ControllerConfig``) and trace (``TracePoint``); the
refusal of a request that found every slot taken (``LinkBusy``); the nearest-rank p99 over a window.
Pure data and arithmetic, no event loop."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from tandem.common.protocol.errors import QuotaExceeded

if TYPE_CHECKING:
    from tandem.cloud.links.table import Ticket

_MAX_SAMPLES = 4096  # per link and metric: bounds memory whatever the window


_MAX_DURATIONS = 64  # recent request durations per link, for the retry estimate


_MAX_TRACE = 10_000


class LinkBusy(QuotaExceeded):
    """Every slot is taken and the link's queue is full, or its request waited past its deadline or
    ``max_queue_wait_s`` with every slot still taken."""

    wire_name = "LinkBusy"

    def __init__(self, message: str = "", retry_after_ms: int = 1000) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


@dataclass(frozen=True)
class LinkSlo:
    ttft_ms: float  # p99 time-to-first-token objective declared by the edge (0 = none)
    itl_p99_ms: float  # p99 inter-token latency objective (0 = none)


@dataclass(frozen=True)
class ControllerConfig:
    # shrink/grow and high/low are the seed article's: x0.8 above 1.1x the SLO, x1.15 below 0.9x of it.
    interval_s: float = 2.0  # how often control_step runs (the caller schedules it)
    window_s: float = 10.0  # p99 over samples of the last window_s seconds
    min_samples: int = 5  # fewer samples of a metric in the window: that metric is not judged
    shrink: float = 0.8
    grow: float = 1.15
    high: float = 1.1
    low: float = 0.9
    min_weight: float = 0.1
    max_weight: float = 10.0


@dataclass(frozen=True)
class TracePoint:
    t_s: float
    link_id: str
    weight: float
    max_concurrent_requests: int
    p99_ttft_ms: float | None
    p99_itl_ms: float | None
    samples: int


@dataclass(eq=False)
class _Waiter:
    tokens: int
    seq: int
    enqueued_s: float
    future: asyncio.Future[Ticket]
    queued: bool = True


@dataclass(eq=False)
class Link:
    """Mutable state of one link. ``version`` is bumped whenever the link's share changes."""

    link_id: str
    edge_id: str
    slo: LinkSlo
    weight: float = 1.0
    version: int = 1
    running: int = 0
    running_tokens: int = 0  # prompt tokens of admitted requests still in prefill
    waiting: int = 0
    last_seen: float = 0.0
    share: tuple[int, int] = (1, 1)  # (max_concurrent_requests, max_batched_tokens) last computed
    _queue: deque[_Waiter] = field(default_factory=deque, init=False, repr=False)
    _ttft: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=_MAX_SAMPLES), init=False)
    _itl: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=_MAX_SAMPLES), init=False)
    _durations_s: deque[float] = field(default_factory=lambda: deque(maxlen=_MAX_DURATIONS), init=False)
    _demand: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=_MAX_SAMPLES), init=False)

    @property
    def busy(self) -> bool:
        """Requests running or waiting."""
        return bool(self.running or self.waiting)

    def note_demand(self, now: float) -> None:
        """Record the link's demand now (requests running plus waiting)."""
        self._demand.append((now, self.running + self.waiting))

    def peak_demand(self, since: float) -> int:
        """Most requests running plus waiting at once since ``since`` (and now); drops older samples."""
        while self._demand and self._demand[0][0] < since:
            self._demand.popleft()
        return max([n for _, n in self._demand] + [self.running + self.waiting])


def _p99(samples: deque[tuple[float, float]], since: float, min_samples: int) -> tuple[float | None, int]:
    """(p99 of the samples at or after ``since``, or None below ``min_samples``; their count). Drops older ones."""
    while samples and samples[0][0] < since:
        samples.popleft()
    if len(samples) < min_samples:
        return None, len(samples)
    return float(np.percentile([v for _, v in samples], 99)), len(samples)
