"""The router's accounting of its turns: each routed turn from the router's choice to its end.

``InFlight`` is the one set of this edge's routed turns running now: how many per route, how many
in the cloud, and what the cost model reads of them (``cloud_prefill_ms``, ``cloud_decode_ms``).
``RoutedTurn`` is one of them, a context manager (``Router.track``): it counts from its ``with``
to the block's end, however the block ends (its last event, an error, a cancel), and ends once.
The modes report to it: the first token came (``first_token``), the turn left the cloud
(``left_cloud``: remote prefill decodes on here), its outcome (``finished``, which calibrates the
cost model); they keep no counts of their own. Reads and counts only: no I/O, no grpc.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from tandem.edge.events import TurnDone
from tandem.edge.routing.costmodel import Route
from tandem.edge.routing.occupancy import CLOUD_MODES

if TYPE_CHECKING:
    from tandem.edge.routing.router import Decision


class InFlight:
    """This edge's routed turns running now (``RoutedTurn``), each counted once from its start to
    its end."""

    def __init__(self) -> None:
        self._turns: set[RoutedTurn] = set()

    def __iter__(self) -> Iterator[RoutedTurn]:
        return iter(tuple(self._turns))

    def __len__(self) -> int:
        return len(self._turns)

    def add(self, turn: RoutedTurn) -> None:
        self._turns.add(turn)

    def discard(self, turn: RoutedTurn) -> None:
        self._turns.discard(turn)

    def by_route(self) -> Counter[Route]:
        """Turns running now per route."""
        return Counter(t.route for t in self._turns)

    @property
    def in_cloud(self) -> int:
        """Turns in the cloud now: on a cloud route and not yet out of it."""
        return sum(1 for t in self._turns if t.in_cloud)

    @property
    def cloud_prefill_ms(self) -> float:
        """The predicted cloud compute (ms) of the turns in the cloud not yet at their first token:
        what a turn sent now queues behind there."""
        return sum(t.prefill_ms for t in self._turns if t.prefilling)

    def cloud_decode_ms(self, decode_ms_per_token: float) -> float:
        """``W_dec``: how long the turns in the cloud keep its decode engine busy decoding (ms) at
        ``decode_ms_per_token``: the longest of their expected remaining outputs (one batched
        stream: every step advances them all), a turn before its first token with all of its
        output (it decodes once its prefill, which the prefills after it wait for, is done); 0
        when that time is not measured (<= 0)."""
        if decode_ms_per_token <= 0:
            return 0.0
        now = time.perf_counter()
        left = (t.decode_left_ms(decode_ms_per_token, now) for t in self._turns if t.in_cloud and t.decode_tokens > 0)
        return max(0.0, max(left, default=0.0))


class RoutedTurn:
    """One routed turn (one leg of a chat turn on ``decision``'s route) as the router counts it:
    in ``live`` from ``__enter__`` to ``__exit__`` (or ``end``); on a cloud route, in the cloud
    from then until ``left_cloud`` or its end, with its predicted cloud compute (``prefill_ms``)
    until ``first_token`` and its ``decode_tokens`` expected output tokens after the first until
    it leaves. ``outcome`` hears its ``TurnDone`` (the router calibrates its models with it).
    Every call after the first of ``first_token``, ``left_cloud``, ``finished`` and ``end`` does
    nothing more."""

    def __init__(
        self,
        decision: Decision,
        live: InFlight,
        prefill_ms: float,
        decode_tokens: float,
        outcome: Callable[[Decision, TurnDone], None],
    ) -> None:
        self.decision, self.prefill_ms, self.decode_tokens = decision, prefill_ms, decode_tokens
        self.first_token_at: float | None = None  # ``time.perf_counter()`` of its first token
        self.in_cloud = False
        self._live, self._outcome = live, outcome
        self._started = self._ended = self._heard = False

    @property
    def route(self) -> Route:
        return self.decision.route

    def __enter__(self) -> RoutedTurn:
        """Count the turn (once; not after its end)."""
        if not self._started and not self._ended:
            self._started = True
            self.in_cloud = self.route.mode in CLOUD_MODES
            self._live.add(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()

    @property
    def prefilling(self) -> bool:
        """In the cloud and before its first token."""
        return self.in_cloud and self.first_token_at is None

    def first_token(self) -> None:
        """The turn's first token came: the cloud's prefill of it is done, it decodes from now on."""
        if self.prefilling:
            self.first_token_at = time.perf_counter()

    def left_cloud(self) -> None:
        """The turn's part in the cloud ended (remote prefill: the edge decodes on)."""
        self.in_cloud = False

    def finished(self, done: TurnDone, resumed: bool = False) -> None:
        """The turn's outcome (once): with a prediction, a first token and no resume before it
        (``resumed``: the leg continues a turn whose cloud failed), it calibrates the router's models."""
        if self._heard:
            return
        self._heard = True
        if self.decision.prediction is not None and done.ttft_ms > 0 and not resumed:
            self._outcome(self.decision, done)

    def end(self) -> None:
        """The turn ended (its last event, a handover, an error, a cancel): it counts no longer."""
        self._ended, self.in_cloud = True, False
        self._live.discard(self)

    def decode_left_ms(self, decode_ms_per_token: float, now: float) -> float:
        """Its expected decode still to come at ``decode_ms_per_token`` (ms): all of it before its
        first token, counted down by the time since then."""
        since_ms = 0.0 if self.first_token_at is None else (now - self.first_token_at) * 1e3
        return self.decode_tokens * decode_ms_per_token - since_ms
