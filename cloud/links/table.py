"""Per-link shares of the vLLM engines' batch, a bounded wait queue, and a p99 SLO controller.

``LinkTable`` admits a request into one of the engines' ``max_num_seqs`` sequence slots. Admission
is work-conserving: a request starts at once whenever a slot is free, whatever its link's share;
each active link (one edge's channel, seen within ``idle_s`` or with requests running or waiting)
is guaranteed ``max_num_seqs * w / W`` sequences and ``max_batched_tokens * w / W`` prompt tokens
in prefill (floored, at least 1), ``W`` the sum of the active links' weights, and a freed slot goes
to the waiting link furthest under its share (the oldest request first among equals). ``LinkBusy``
comes only when the link's queue is full, or the wait reaches ``max_queue_wait_s`` or the
request's deadline with every slot still taken.

``control_step`` moves each link's weight to meet the p99 TTFT / ITL objectives its edge declared:
when a link misses its objective, the links that shrink are the cause (peak demand above an equal
split of the node and at least as high, relative to it, as the missing link's), never a quiet
victim, and only when a request in the window found every slot taken.

The rules: docs/architecture.md, "Modes and negotiation" (quotas and admission, SLO controller);
why these and not the rules they replaced, measured with ``tandem-bench burst``:
docs/design-decisions.md, "Admission and the SLO controller". Pure domain code, single event loop.
Times are in the injected clock's seconds.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from types import TracebackType

from tandem.cloud.links.state import _MAX_TRACE, ControllerConfig, Link, LinkBusy, LinkSlo, TracePoint, _p99, _Waiter
from tandem.common.protocol.errors import InvalidRequest, QuotaExceeded


class Ticket:
    """One admitted request's slot; ``with ticket:`` releases it on exit."""

    def __init__(self, table: LinkTable, link: Link, prompt_tokens: int, queued_ms: float) -> None:
        self.link_id = link.link_id
        self.prompt_tokens = prompt_tokens
        self.queued_ms = queued_ms  # how long admit waited
        self.admitted_s = table._clock()
        self._table = table
        self._link = link
        self._in_prefill = True
        self._released = False

    def prefill_done(self) -> None:
        """The request's prompt tokens stop counting against its link's token share (idempotent)."""
        if self._in_prefill and not self._released:
            self._in_prefill = False
            self._table._free_tokens(self._link, self.prompt_tokens)

    def release(self) -> None:
        """Free the slot and wake the next waiter (idempotent)."""
        if self._released:
            return
        if self._in_prefill:
            self._in_prefill = False
            self._table._free_tokens(self._link, self.prompt_tokens)
        self._released = True
        self._table._release(self._link, self._table._clock() - self.admitted_s)

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


class LinkTable:
    """The cloud's links, their weighted-fair shares of the engines, admission and the SLO controller."""

    def __init__(
        self,
        max_num_seqs: int,
        max_batched_tokens: int,
        *,
        max_links: int = 256,
        idle_s: float = 60.0,
        max_queue: int = 32,
        max_queue_wait_s: float = 5.0,
        controller: ControllerConfig = ControllerConfig(),  # noqa: B008 (frozen, so sharing it is safe)
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_num_seqs < 1 or max_batched_tokens < 1 or max_links < 1:
            raise ValueError("max_num_seqs, max_batched_tokens and max_links must be at least 1")
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.max_links = max_links
        self.idle_s = idle_s
        self.max_queue = max_queue
        self.max_queue_wait_s = max_queue_wait_s
        self.controller = controller
        self._clock = clock
        self._links: dict[str, Link] = {}
        self._seq = itertools.count()
        self._changed: set[str] = set()  # links whose share changed since the last control_step
        self.trace: deque[TracePoint] = deque(maxlen=_MAX_TRACE)
        self.running = 0
        self.running_tokens = 0
        self.waiting = 0
        self._full_s = float("-inf")  # last time a request found every slot taken

    # --- links and shares ---------------------------------------------------------------------

    def register(self, link_id: str, edge_id: str, slo: LinkSlo) -> Link:
        """The link ``link_id`` (created at weight 1, or the known one with its SLO updated).

        Beyond ``max_links`` the least recently seen link with nothing running or waiting is evicted
        (never the anonymous link ``""``).

        Raises:
            InvalidRequest: ``link_id`` is registered to another edge.
            QuotaExceeded: ``max_links`` links are registered and all of them are busy.
        """
        now = self._clock()
        link = self._links.get(link_id)
        if link is not None:
            if link.edge_id != edge_id:
                raise InvalidRequest(f"link {link_id!r} belongs to another edge")
            link.slo = slo
        else:
            if len(self._links) >= self.max_links:
                # the anonymous link "" (headers without a link id) is permanent: never evicted
                idle = [lk for lk in self._links.values() if not lk.running and not lk.waiting and lk.link_id]
                if not idle:
                    raise QuotaExceeded(f"{len(self._links)} links, all busy; bound {self.max_links}")
                victim = min(idle, key=lambda lk: lk.last_seen)
                del self._links[victim.link_id]
                self._changed.discard(victim.link_id)
            # active (holding a share) only once it sends a request: negotiating alone takes nothing
            # from the others (else a few hundred Negotiate calls would dilute every share)
            link = self._links[link_id] = Link(link_id, edge_id, slo, last_seen=float("-inf"))
            link.share = self._shares(now)[link_id]
        self._rebalance()
        return link

    def get(self, link_id: str) -> Link | None:
        return self._links.get(link_id)

    def forget(self, link_id: str) -> bool:
        """Drop an idle link (nothing running or waiting); False if it is busy or unknown."""
        link = self._links.get(link_id)
        if link is None or link.running or link.waiting:
            return False
        del self._links[link_id]
        self._changed.discard(link_id)
        self._rebalance()
        return True

    def links(self) -> list[Link]:
        return list(self._links.values())

    def active(self) -> list[Link]:
        """Links with requests running or waiting, or seen within ``idle_s``."""
        now = self._clock()
        return [lk for lk in self._links.values() if self._is_active(lk, now)]

    def share(self, link_id: str) -> tuple[int, int]:
        """(max_concurrent_requests, max_batched_tokens) guaranteed to ``link_id`` now.

        Raises:
            InvalidRequest: the link is not registered.
        """
        self._get(link_id)
        return self._rebalance()[link_id]

    # --- admission ----------------------------------------------------------------------------

    async def admit(self, link_id: str, prompt_tokens: int, deadline: float | None) -> Ticket:
        """A slot for one request of ``prompt_tokens`` tokens: at once while a slot is free, else
        after waiting in the link's queue until a release hands it one (module docstring: who goes
        first).

        ``deadline`` is in the clock's time (None: none); waiting ends at it or ``max_queue_wait_s``.

        Raises:
            InvalidRequest: the link is not registered.
            LinkBusy: every slot is taken and the link's queue is full, or the wait ended with every
                slot still taken (``max_queue_wait_s`` or the request's deadline).
        """
        link = self._get(link_id)
        now = self._clock()
        link.last_seen = now
        self._rebalance()
        if self.running < self.max_num_seqs:  # work-conserving: a free slot means nobody waits
            return self._grant(link, prompt_tokens, 0.0)
        self._full_s = now
        queue_bound = now + self.max_queue_wait_s
        give_up = queue_bound if deadline is None else min(deadline, queue_bound)
        if link.waiting >= self.max_queue:
            raise self._busy(link, f"link {link_id!r} has {link.waiting} requests waiting (bound {self.max_queue})")
        if give_up <= now:
            raise self._busy(link, f"every slot is taken and the request's deadline has passed (link {link_id!r})")
        waiter = _Waiter(prompt_tokens, next(self._seq), now, asyncio.get_running_loop().create_future())
        link._queue.append(waiter)
        link.waiting += 1
        self.waiting += 1
        link.note_demand(now)
        ticket: Ticket | None = None
        try:
            async with asyncio.timeout(give_up - now):
                ticket = await waiter.future
            return ticket
        except TimeoutError:
            waited_ms = (self._clock() - now) * 1000
            raise self._busy(link, f"link {link_id!r} waited {waited_ms:.0f} ms with every slot taken") from None
        finally:
            if waiter.queued:  # timed out or cancelled while queued
                self._dequeue(link, waiter)
            elif ticket is None and waiter.future.done() and not waiter.future.cancelled():
                waiter.future.result().release()  # granted just as the wait ended: give the slot back

    def _grant(self, link: Link, tokens: int, queued_ms: float) -> Ticket:
        link.running += 1
        link.running_tokens += tokens
        self.running += 1
        self.running_tokens += tokens
        link.note_demand(self._clock())
        return Ticket(self, link, tokens, queued_ms)

    def _dequeue(self, link: Link, waiter: _Waiter) -> None:
        waiter.queued = False
        link._queue.remove(waiter)
        link.waiting -= 1
        self.waiting -= 1

    @staticmethod
    def _fill(link: Link, share: tuple[int, int]) -> float:
        """How full ``link`` is against its share: the larger of its running requests over its
        sequence share and its prompt tokens in prefill over its token share (below 1: under it)."""
        return max(link.running / share[0], link.running_tokens / share[1])

    def _wake(self) -> None:
        """Hand every free slot to a waiter: the link furthest under its share first, its oldest request."""
        shares = self._rebalance()
        while self.running < self.max_num_seqs:
            best: tuple[float, int, Link, _Waiter] | None = None
            for link in self._links.values():
                while link._queue and link._queue[0].future.done():  # cancelled, its task not yet resumed
                    self._dequeue(link, link._queue[0])
                if not link._queue:
                    continue
                head = link._queue[0]
                key = (self._fill(link, shares[link.link_id]), head.seq, link, head)
                if best is None or key[:2] < best[:2]:
                    best = key
            if best is None:
                return
            _, _, link, waiter = best
            self._dequeue(link, waiter)
            queued_ms = (self._clock() - waiter.enqueued_s) * 1000
            waiter.future.set_result(self._grant(link, waiter.tokens, queued_ms))

    def _free_tokens(self, link: Link, tokens: int) -> None:
        link.running_tokens -= tokens
        self.running_tokens -= tokens

    def _release(self, link: Link, duration_s: float) -> None:
        link.running -= 1
        self.running -= 1
        link.last_seen = self._clock()
        link._durations_s.append(duration_s)
        self._wake()

    def _busy(self, link: Link, message: str) -> LinkBusy:
        """``LinkBusy`` with a retry hint: the link's mean request duration over its share, in [100, 10000] ms."""
        if not link._durations_s:
            return LinkBusy(message, 1000)
        mean_ms = 1000 * sum(link._durations_s) / len(link._durations_s)
        return LinkBusy(message, int(min(10_000, max(100, mean_ms / max(1, link.share[0])))))

    # --- SLO controller -----------------------------------------------------------------------

    def record_ttft(self, link_id: str, ttft_ms: float) -> None:
        link = self._links.get(link_id)
        if link is not None:
            link._ttft.append((self._clock(), ttft_ms))

    def record_itl(self, link_id: str, itl_ms: float) -> None:
        link = self._links.get(link_id)
        if link is not None:
            link._itl.append((self._clock(), itl_ms))

    def control_step(self) -> list[str]:
        """Run the SLO controller once over the active links.

        Returns the ids of the links whose share changed (version bumped) since the previous step,
        by this step's weights or by links coming and going in between.
        """
        cfg = self.controller
        now = self._clock()
        judged: list[tuple[Link, float | None, float | None, int]] = []
        missing: list[Link] = []
        meeting: list[Link] = []
        for link in self._links.values():
            if not self._is_active(link, now):
                continue
            p99_ttft, n_ttft = _p99(link._ttft, now - cfg.window_s, cfg.min_samples)
            p99_itl, n_itl = _p99(link._itl, now - cfg.window_s, cfg.min_samples)
            judged.append((link, p99_ttft, p99_itl, n_ttft + n_itl))
            pairs = ((p99_ttft, link.slo.ttft_ms), (p99_itl, link.slo.itl_p99_ms))
            objectives = [(p, slo) for p, slo in pairs if slo > 0]
            if any(p is not None and p > cfg.high * slo for p, slo in objectives):
                missing.append(link)
            elif objectives and all(p is not None and p < cfg.low * slo for p, slo in objectives):
                meeting.append(link)
        causes = self._causes([lk for lk, *_ in judged], missing, now - cfg.window_s)
        for link in causes.values():
            link.weight = max(cfg.min_weight, link.weight * cfg.shrink)
        for link in meeting:
            if link.link_id not in causes:
                link.weight = min(cfg.max_weight, link.weight * cfg.grow)
        shares = self._rebalance()
        for link, p99_ttft, p99_itl, n in judged:
            self.trace.append(TracePoint(now, link.link_id, link.weight, shares[link.link_id][0], p99_ttft, p99_itl, n))
        self._wake()
        changed = sorted(self._changed)
        self._changed.clear()
        return changed

    def _causes(self, judged: list[Link], missing: list[Link], since: float) -> dict[str, Link]:
        """The links to shrink for the ``missing`` ones' misses (cause and victim, module docstring):
        above an equal split and pressing at least as hard as a missing link (the missing link itself
        only if nobody presses harder), and only while links compete for the node: a request found
        every slot taken since ``since``."""
        fair = max(1, self.max_num_seqs // max(1, len(judged)))
        pressure = {lk.link_id: lk.peak_demand(since) / fair for lk in judged}
        if self.waiting:
            self._full_s = self._clock()  # a request waits for a slot right now
        congested = self._full_s >= since
        causes: dict[str, Link] = {}
        for link in missing:
            p = pressure[link.link_id]
            hardest = p >= max(pressure.values())
            for lk in judged:
                q = pressure[lk.link_id]
                if congested and q > 1 and q >= p and (lk is not link or hardest):
                    causes[lk.link_id] = lk
        return causes

    # --- helpers ------------------------------------------------------------------------------

    def _get(self, link_id: str) -> Link:
        link = self._links.get(link_id)
        if link is None:
            raise InvalidRequest(f"unknown link {link_id!r}")
        return link

    def _is_active(self, link: Link, now: float) -> bool:
        return bool(link.running or link.waiting or now - link.last_seen <= self.idle_s)

    def _shares(self, now: float) -> dict[str, tuple[int, int]]:
        """Every link's share now; an idle link's as if it became active."""
        total = sum(lk.weight for lk in self._links.values() if self._is_active(lk, now))
        out: dict[str, tuple[int, int]] = {}
        for lk in self._links.values():
            frac = lk.weight / (total if self._is_active(lk, now) else total + lk.weight)
            out[lk.link_id] = (
                max(1, math.floor(self.max_num_seqs * frac)),
                max(1, math.floor(self.max_batched_tokens * frac)),
            )
        return out

    def _rebalance(self) -> dict[str, tuple[int, int]]:
        """Recompute the shares; bump the version of each link whose share changed."""
        shares = self._shares(self._clock())
        for lk in self._links.values():
            if shares[lk.link_id] != lk.share:
                lk.share = shares[lk.link_id]
                lk.version += 1
                self._changed.add(lk.link_id)
        return shares
