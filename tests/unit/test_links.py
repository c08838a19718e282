"""Unit tests of the per-link shares, admission queue and SLO controller (pure asyncio, no engines)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tandem.cloud.links.table import ControllerConfig, Link, LinkBusy, LinkSlo, LinkTable, Ticket
from tandem.common.protocol.errors import InvalidRequest, QuotaExceeded
from tests.doubles import FakeClock, settle

NO_SLO = LinkSlo(0, 0)
SLO = LinkSlo(ttft_ms=100, itl_p99_ms=20)


def join(t: LinkTable, link_id: str, slo: LinkSlo) -> Link:
    """Register a link and mark it active, as its first request does (negotiating alone holds no share)."""
    link = t.register(link_id, f"edge-{link_id}", slo)
    link.last_seen = t._clock()
    return link


def table(seqs: int = 4, tokens: int = 10_000, *links: str, **kw) -> LinkTable:
    t = LinkTable(seqs, tokens, **kw)
    for link_id in links:
        join(t, link_id, NO_SLO)
    return t


async def spawn(t: LinkTable, link_id: str, n: int, tokens: int = 1) -> list[asyncio.Task[Ticket]]:
    tasks = [asyncio.create_task(t.admit(link_id, tokens, None)) for _ in range(n)]
    await settle()
    return tasks


def running(t: LinkTable, link_id: str) -> int:
    link = t.get(link_id)
    assert link is not None
    return link.running


# --- shares ---------------------------------------------------------------------------------


def test_shares_split_by_weight_and_rebalance():
    clock = FakeClock()
    t = table(8, 800, "a", "b", clock=clock)
    assert t.share("a") == t.share("b") == (4, 400)
    a, b = t.get("a"), t.get("b")
    assert a is not None and b is not None
    a.weight = 3.0
    assert t.share("a") == (6, 600) and t.share("b") == (2, 200)
    assert (a.version, b.version) == (3, 2)  # a: (8,800) alone -> (4,400) with b -> (6,600); b: -> (2,200)
    clock.t += 61  # a goes idle; b is seen again
    join(t, "b", NO_SLO)
    assert [lk.link_id for lk in t.active()] == ["b"]
    assert t.share("b") == (8, 800)
    assert t.share("a") == (6, 600)  # an idle link's share as if it came back
    join(t, "c", NO_SLO)
    assert t.share("b") == t.share("c") == (4, 400)
    assert t.get("c") is not None and t.get("c").version == 1  # type: ignore[union-attr]


def test_share_is_at_least_one():
    t = table(2, 2, *"abcde")
    assert all(t.share(x) == (1, 1) for x in "abcde")


def test_register_is_idempotent_and_checks_the_edge():
    t = table(4, 100, "a")
    link = t.get("a")
    assert t.register("a", "edge-a", SLO) is link and link is not None and link.slo == SLO
    with pytest.raises(InvalidRequest, match="another edge"):
        t.register("a", "edge-x", SLO)


@pytest.mark.asyncio
async def test_register_beyond_max_links_evicts_idle_never_busy():
    clock = FakeClock()
    t = table(4, 100, "a", clock=clock, max_links=2)
    clock.t += 1
    join(t, "b", NO_SLO)
    clock.t += 1
    join(t, "c", NO_SLO)  # a is the least recently seen idle link
    assert sorted(lk.link_id for lk in t.links()) == ["b", "c"]
    ticket = await t.admit("b", 1, None)  # b busy: c is the only idle link
    clock.t += 1
    join(t, "d", NO_SLO)
    assert sorted(lk.link_id for lk in t.links()) == ["b", "d"]
    await t.admit("d", 1, None)
    with pytest.raises(QuotaExceeded):
        join(t, "e", NO_SLO)
    ticket.release()
    join(t, "e", NO_SLO)
    assert sorted(lk.link_id for lk in t.links()) == ["d", "e"]


# --- admission ------------------------------------------------------------------------------


async def keep_sending(t: LinkTable, clock: FakeClock, link_id: str, n: int = 2) -> None:
    """``n`` short requests of ``link_id``, one a second."""
    for _ in range(n):
        (await t.admit(link_id, 1, None)).release()
        clock.t += 1


@pytest.mark.asyncio
async def test_a_link_takes_every_free_slot_whatever_its_share():
    clock = FakeClock()
    t = table(4, 100, "a", "b", max_queue_wait_s=0.2, clock=clock)
    await keep_sending(t, clock, "b")  # b active and sending: it still keeps no slot idle for itself
    tickets = [await t.admit("a", 1, None) for _ in range(4)]  # a's share is 2
    assert t.running == 4 and t.share("a") == (2, 50) and all(tk.queued_ms == 0.0 for tk in tickets)
    start = time.monotonic()
    with pytest.raises(LinkBusy, match="every slot taken"):
        await t.admit("b", 1, None)  # every slot taken: b waits, and gives up at the queue bound
    assert 0.15 < time.monotonic() - start < 1.0 and t.waiting == 0
    for ticket in tickets:
        ticket.release()
    assert t.running == t.waiting == t.running_tokens == 0


@pytest.mark.asyncio
async def test_a_flooding_link_gives_way_at_each_release():
    """A flood takes every free slot (nobody waits then), and each slot it releases goes to a
    waiting link under its share before the flood's own older waiters."""
    t = table(4, 10_000, "a", "b", max_queue_wait_s=2)
    flood = await spawn(t, "a", 8)
    held = [task.result() for task in flood if task.done()]
    assert len(held) == 4 and running(t, "a") == 4 and t.waiting == 4
    b_tasks = await spawn(t, "b", 2)
    assert not any(task.done() for task in b_tasks)
    held[0].release()
    await settle()
    assert b_tasks[0].done() and t.running == 4  # b (0/2) before a's older waiters (a at 3/2)
    held[1].release()
    await settle()
    assert b_tasks[1].done()  # b (1/2) still under its share
    held[2].release()
    await settle()
    assert running(t, "a") == 2 and running(t, "b") == 2 and t.running == 4  # b at its share: a's turn
    for task in flood:
        if not task.done():
            task.cancel()
    await asyncio.gather(*flood, return_exceptions=True)
    for task in flood + b_tasks:
        if not task.cancelled() and task.exception() is None:
            task.result().release()
    assert t.running == t.waiting == t.running_tokens == 0


@pytest.mark.asyncio
async def test_prompt_tokens_in_prefill_order_the_waiters_and_never_hold_a_slot():
    """The token budget is vLLM's per step (it chunks prefills): prompt tokens never keep a request
    from a free slot; a link's prompt tokens in prefill over its token share put it after the others."""
    t = table(4, 100, "a", "b", max_queue_wait_s=2)  # shares (2 seqs, 50 tokens) each
    long_a = await t.admit("a", 90, None)
    long_b = await t.admit("b", 80, None)  # 170 tokens in prefill, past the budget: a slot is free, it starts
    short_a, short_b = await t.admit("a", 1, None), await t.admit("b", 1, None)
    assert t.running == 4 and t.running_tokens == 172
    [wait_a] = await spawn(t, "a", 1)
    [wait_b] = await spawn(t, "b", 1)
    short_a.release()  # a: 1/2 seqs but 90/50 tokens; b: 2/2 seqs, 81/50 tokens
    await settle()
    assert wait_b.done() and not wait_a.done()
    long_a.prefill_done()
    long_a.prefill_done()  # idempotent
    assert t.running_tokens == 82
    short_b.release()
    await settle()
    assert wait_a.done()
    for ticket in (long_a, long_b, wait_a.result(), wait_b.result()):
        ticket.release()
    assert t.running == t.waiting == t.running_tokens == 0


@pytest.mark.asyncio
async def test_waiters_woken_in_weighted_fair_order():
    clock = FakeClock()
    t = table(3, 100, "a", "b", "c", max_queue_wait_s=2, clock=clock)
    clock.t += 61  # a and b idle: c alone may take every slot
    held = [await t.admit("c", 1, None) for _ in range(3)]
    order: list[str] = []

    async def want(link_id: str) -> Ticket:
        ticket = await t.admit(link_id, 1, None)
        order.append(link_id)
        return ticket

    tasks = [asyncio.create_task(want(x)) for x in ("c", "a", "b", "a")]
    await settle()
    assert t.waiting == 4
    for ticket in held:
        ticket.release()
        await settle()
    # a (0/1, older than b's), b (0/1; a's second is at a's share while others wait), c (0/1 once c's are gone)
    assert order == ["a", "b", "c"]
    assert t.waiting == 1
    for task in tasks:
        if task.done():
            task.result().release()
    await settle()
    assert order[3:] == ["a"]
    tasks[3].result().release()
    assert t.running == t.waiting == 0


@pytest.mark.asyncio
async def test_queue_full_raises_at_once():
    t = table(1, 100, "a", max_queue=2, max_queue_wait_s=2)
    held = await t.admit("a", 1, None)
    waiters = await spawn(t, "a", 2)
    start = time.monotonic()
    with pytest.raises(LinkBusy) as err:
        await t.admit("a", 1, None)
    assert time.monotonic() - start < 0.1
    assert err.value.retry_after_ms == 1000  # no durations known yet
    assert isinstance(err.value, QuotaExceeded)
    for task in waiters:
        task.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    held.release()
    assert t.running == t.waiting == 0


@pytest.mark.asyncio
async def test_wait_past_max_queue_wait_gives_up_with_retry_hint():
    clock = FakeClock()  # frozen: request durations come out as set; the waits are real
    t = table(1, 100, "a", clock=clock, max_queue_wait_s=0.2)
    ticket = await t.admit("a", 1, None)
    clock.t += 3.0
    ticket.release()  # a 3 s request; share 1 -> retry after 3000 ms
    held = await t.admit("a", 1, None)
    start = time.monotonic()
    with pytest.raises(LinkBusy) as err:
        await t.admit("a", 1, None)
    assert 0.15 < time.monotonic() - start < 1.0
    assert err.value.retry_after_ms == 3000
    assert t.waiting == 0
    held.release()


@pytest.mark.asyncio
async def test_retry_hint_is_clamped():
    """A refusal's retry-after hint is clamped to 10 s however long the requests ahead have run."""
    clock = FakeClock()
    t = table(1, 100, "a", clock=clock, max_queue_wait_s=0.05)
    ticket = await t.admit("a", 1, None)
    clock.t += 60
    ticket.release()
    held = await t.admit("a", 1, None)
    with pytest.raises(LinkBusy) as err:
        await t.admit("a", 1, None)
    assert err.value.retry_after_ms == 10_000
    held.release()


@pytest.mark.asyncio
async def test_deadline_ends_the_wait():
    t = table(1, 100, "a", max_queue_wait_s=5)
    held = await t.admit("a", 1, None)
    start = time.monotonic()
    with pytest.raises(LinkBusy) as err:
        await t.admit("a", 1, time.monotonic() + 0.1)
    assert 0.05 < time.monotonic() - start < 1.0
    assert 100 <= err.value.retry_after_ms <= 10_000
    with pytest.raises(LinkBusy):
        await t.admit("a", 1, time.monotonic() - 1)  # already past: at once
    assert t.waiting == 0
    held.release()
    assert t.running == 0


@pytest.mark.asyncio
async def test_cancelled_waiter_leaves_no_trace():
    t = table(1, 100, "a", "b", max_queue_wait_s=2)
    held = await t.admit("a", 5, None)
    [task] = await spawn(t, "b", 1, tokens=7)
    assert t.waiting == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert t.waiting == 0 and t.get("b").waiting == 0  # type: ignore[union-attr]
    held.release()
    assert t.running == t.running_tokens == 0


@pytest.mark.asyncio
async def test_waiter_cancelled_as_it_is_granted_gives_the_slot_back():
    t = table(1, 100, "a", max_queue_wait_s=2)
    held = await t.admit("a", 5, None)
    [task] = await spawn(t, "a", 1, tokens=7)
    held.release()  # grants the waiter synchronously...
    assert t.running == 1 and t.waiting == 0
    task.cancel()  # ...which is cancelled before it resumes
    with pytest.raises(asyncio.CancelledError):
        await task
    assert t.running == t.running_tokens == t.waiting == 0
    (await t.admit("a", 1, None)).release()


@pytest.mark.asyncio
async def test_release_is_idempotent():
    t = table(2, 100, "a")
    with await t.admit("a", 10, None) as ticket:
        assert t.running == 1 and ticket.queued_ms == 0.0
    ticket.release()
    ticket.prefill_done()
    assert t.running == t.running_tokens == 0
    link = t.get("a")
    assert link is not None and link.running == link.running_tokens == 0


# --- SLO controller -------------------------------------------------------------------------


def controlled(slo: LinkSlo = SLO, seqs: int = 4, *, links: str = "a", **kw) -> tuple[LinkTable, FakeClock]:
    clock = FakeClock()
    t = LinkTable(seqs, seqs, clock=clock, **kw)
    for link_id in links:
        join(t, link_id, slo)
    return t, clock


def feed(
    t: LinkTable,
    link_id: str,
    ttft_ms: float | None,
    itl_ms: float | None,
    n: int = 10,
    demand: int | None = None,
    congested: bool = True,
) -> None:
    """Latency samples of a link, its peak demand in the window (default: one more than its share,
    so it presses above an equal split) and, with ``congested``, a request that found the node full."""
    link = t.get(link_id)
    assert link is not None
    link._demand.append((t._clock(), link.share[0] + 1 if demand is None else demand))
    if congested:
        t._full_s = t._clock()
    for _ in range(n):
        if ttft_ms is not None:
            t.record_ttft(link_id, ttft_ms)
        if itl_ms is not None:
            t.record_itl(link_id, itl_ms)


def weight(t: LinkTable, link_id: str = "a") -> float:
    link = t.get(link_id)
    assert link is not None
    return link.weight


@pytest.mark.parametrize(
    ("ttft", "itl", "expected"),
    [
        (111, 10, 0.8),  # TTFT p99 > 1.1 x SLO
        (50, 23, 0.8),  # ITL p99 > 1.1 x SLO
        (89, 17.9, 1.15),  # both < 0.9 x SLO
        (89, None, 1.0),  # ITL unknown: not every SLO is met
        (100, 15, 1.0),  # in between
        (110, 22, 1.0),  # at 1.1 x: not above
    ],
)
def test_controller_steps(ttft, itl, expected):
    """A control step multiplies a link's weight by 0.8 when its p99 TTFT or ITL is above 1.1 x its objective,
    by 1.15 when every p99 is known and below 0.9 x, and leaves it otherwise."""
    t, _ = controlled()
    feed(t, "a", ttft, itl)
    t.control_step()
    assert weight(t) == pytest.approx(expected)


def test_controller_ignores_metrics_without_slo():
    t, _ = controlled(LinkSlo(ttft_ms=100, itl_p99_ms=0))
    feed(t, "a", 50, 1e6)
    t.control_step()
    assert weight(t) == pytest.approx(1.15)
    t2, _ = controlled(NO_SLO)
    feed(t2, "a", 1e6, 1e6)
    t2.control_step()
    assert weight(t2) == 1.0


def test_controller_p99_of_the_window_only():
    t, clock = controlled()
    feed(t, "a", 500, 500)  # bad, but old by the next step
    clock.t += 11
    join(t, "a", SLO)  # still active
    feed(t, "a", 50, 10)
    t.control_step()
    assert weight(t) == pytest.approx(1.15)
    link = t.get("a")
    assert link is not None and len(link._ttft) == 10  # older samples dropped


def test_controller_p99_tail():
    """The controller judges the p99: 2% of a window's samples past the objective shrink the link."""
    t, _ = controlled()
    feed(t, "a", 50, 10, n=98)
    feed(t, "a", 1000, 10, n=2)  # 2% of the samples past the SLO: p99 is past it too
    t.control_step()
    assert weight(t) == pytest.approx(0.8)


def test_controller_bounded():
    """However many steps shrink or grow it, a link's weight stays within [0.1, 10]."""
    t, _ = controlled(controller=ControllerConfig(window_s=1e9))
    feed(t, "a", 1000, 1000)
    for _ in range(20):
        t.control_step()
    assert weight(t) == pytest.approx(0.1)
    t2, _ = controlled(controller=ControllerConfig(window_s=1e9))
    feed(t2, "a", 1, 1)
    for _ in range(30):
        t2.control_step()
    assert weight(t2) == pytest.approx(10.0)


def test_controller_skips_with_too_few_samples():
    t, _ = controlled()
    feed(t, "a", 1000, 1000, n=4)
    t.control_step()
    assert weight(t) == 1.0
    point = t.trace[-1]
    assert point.samples == 8 and point.p99_ttft_ms is None and point.p99_itl_ms is None


def test_controller_bumps_version_only_when_the_share_changed():
    t, clock = controlled(links="ab")  # 4 seqs, 4 tokens: (2, 2) each
    a, b = t.get("a"), t.get("b")
    assert a is not None and b is not None
    versions = (a.version, b.version)
    feed(t, "a", 1000, 1000)
    assert t.control_step() == ["a"]  # a: 0.8 -> (1, 1); b: floor(4 / 1.8) = 2, unchanged
    assert (a.version, b.version) == (versions[0] + 1, versions[1])
    assert t.share("a") == (1, 1) and t.share("b") == (2, 2)
    a.weight = 0.2
    clock.t += 11
    feed(t, "a", 100, 20)  # hold
    assert t.control_step() == ["b"]  # a still (1, 1); b floor(4 / 1.2) = 3
    assert (a.version, b.version) == (versions[0] + 1, versions[1] + 1) and t.share("b") == (3, 3)
    assert t.control_step() == []
    lone, _ = controlled()
    feed(lone, "a", 1000, 1000)
    assert lone.control_step() == [] and weight(lone) == pytest.approx(0.8)
    assert lone.get("a").version == 1  # type: ignore[union-attr]


def test_control_step_reports_changes_from_links_coming_and_going():
    t, clock = controlled(links="a")
    t.control_step()
    join(t, "b", SLO)
    assert t.control_step() == ["a"]  # a's share halved when b came
    clock.t += 61
    join(t, "a", SLO)
    # b went idle: a has everything again (b's share is reported as if it came back)
    assert "a" in t.control_step() and t.share("a") == (4, 4)


def test_trace_points_per_active_link_per_step():
    t, clock = controlled(links="ab")
    feed(t, "a", 1000, 1000)
    t.control_step()
    t.control_step()
    assert [(p.link_id, p.weight) for p in t.trace] == [("a", 0.8), ("b", 1.0), ("a", 0.8 * 0.8), ("b", 1.0)]
    assert t.trace[0].max_concurrent_requests == 1 and t.trace[1].max_concurrent_requests == 2
    assert t.trace[0].p99_ttft_ms == pytest.approx(1000) and t.trace[0].samples == 20
    clock.t += 61
    join(t, "b", SLO)
    t.control_step()
    assert [p.link_id for p in t.trace][4:] == ["b"]


def test_a_victim_is_not_shrunk_the_links_pressing_harder_are():
    """Cause and victim (found with tandem-bench burst): quiet link q misses its objective while
    flooding link f presses far above an equal split: f shrinks, q does not; a link that meets its
    objective but is a cause is not grown in that step."""
    t, _ = controlled(links="qfm", seqs=6)  # (2, 2) each
    feed(t, "q", 1000, 1000, demand=1)  # victim: one request at a time, below its share
    feed(t, "f", 50, 10, demand=9)  # floods: meets its own objective
    feed(t, "m", 50, 10, demand=1)  # meets its objective, below its share
    t.control_step()
    assert weight(t, "q") == 1.0 and weight(t, "f") == pytest.approx(0.8) and weight(t, "m") == pytest.approx(1.15)
    assert t.share("q")[0] >= 2
    # q above an equal split too, but f presses harder: still only f
    t2, _ = controlled(links="qf", seqs=4)  # fair 2 each
    feed(t2, "q", 1000, 1000, demand=3)
    feed(t2, "f", 50, 10, demand=12)
    t2.control_step()
    assert weight(t2, "q") == 1.0 and weight(t2, "f") == pytest.approx(0.8)
    # f misses too, pressing hardest: f shrinks (once per step), q keeps its weight
    feed(t2, "f", 5000, 1000, demand=12)
    t2.control_step()
    assert weight(t2, "q") == 1.0 and weight(t2, "f") == pytest.approx(0.64)


def test_nobody_shrinks_when_no_share_binds():
    """A node slower than the objective with every link below its share: shrinking a share nobody
    uses changes nothing, so no link shrinks and no version moves."""
    t, _ = controlled(links="ab", seqs=8)
    t.control_step()  # the shares as both links registered
    feed(t, "a", 1000, 1000, demand=1)
    feed(t, "b", 1000, 1000, demand=2)
    assert t.control_step() == [] and weight(t, "a") == weight(t, "b") == 1.0


def test_peak_demand_follows_admissions_within_the_window():
    t, clock = controlled(links="a", seqs=4)
    link = t.get("a")
    assert link is not None
    tickets = [t._grant(link, 1, 0.0) for _ in range(3)]
    for tk in tickets:
        tk.release()
    assert link.peak_demand(clock.t - 10) == 3
    clock.t += 11
    assert link.peak_demand(clock.t - 10) == 0  # older than the window


@pytest.mark.asyncio
async def test_a_link_the_controller_shrank_borrows_free_slots():
    """A weight is a priority among waiters, not a cap: a shrunk link still takes free slots nobody waits for."""
    t = table(4, 10_000, "a", "b", max_queue_wait_s=0.1)
    a = t.get("a")
    assert a is not None
    a.weight = 0.1
    assert t.share("a") == (1, 909)  # 4 * 0.1 / 1.1
    held = [await t.admit("a", 1, None) for _ in range(4)]
    assert t.running == 4 and all(tk.queued_ms == 0.0 for tk in held)
    for ticket in held:
        ticket.release()
    assert t.running == t.waiting == 0


# --- an idle node: nobody shrinks, free slots are lent -----------------------------------------

BURST_SLO = LinkSlo(ttft_ms=1000, itl_p99_ms=200)


@pytest.mark.asyncio
async def test_a_busy_link_on_an_idle_node_runs_in_every_slot_and_keeps_its_weight():
    """Three links that each sent one request, a quiet link sending one a second, and a busy link
    with four ~900-token requests missing its 200 ms ITL objective (600 ms): the busy link runs all
    four at once (share 1: the idle links count in the equal split) and, with nobody finding the
    node full, keeps its weight. The quiet link's next request waits for the next release, which is
    its own before the busy link's fifth request."""
    clock = FakeClock()
    t = LinkTable(4, 4096, clock=clock, max_queue_wait_s=30)
    for name in ("idle1", "idle2", "idle3", "quiet", "busy"):
        join(t, name, BURST_SLO)
    for name in ("idle1", "idle2", "idle3"):
        (await t.admit(name, 20, None)).release()
    await keep_sending(t, clock, "quiet")
    burst = await spawn(t, "busy", 4, tokens=900)
    assert all(task.done() for task in burst) and t.running == 4 and t.share("busy")[0] == 1
    tickets = [task.result() for task in burst]
    for ticket in tickets:
        ticket.prefill_done()  # decoding now: their ITL is what misses
    for _ in range(12):
        for _ in range(10):
            t.record_itl("busy", 600)
        t.control_step()
        clock.t += 1
    assert weight(t, "busy") == 1.0
    fifth = await spawn(t, "busy", 1)
    [quiet] = await spawn(t, "quiet", 1)
    tickets[0].release()
    await settle()
    assert quiet.done() and not fifth[0].done() and t.running == 4
    quiet.result().release()
    await settle()
    assert fifth[0].done() and running(t, "busy") == 4
    for ticket in [*tickets[1:], fifth[0].result()]:
        ticket.release()
    assert t.running == t.waiting == t.running_tokens == 0


@pytest.mark.asyncio
async def test_idle_links_keep_no_slot_and_take_lent_slots_back_at_the_next_release():
    """Links that each sent one request keep nothing: the busy link borrows every slot. When one of
    them comes back it waits for the next release, which is its, not the busy link's older waiter's;
    now links compete for the node, so the busy link, missing its objective, shrinks."""
    clock = FakeClock()
    t = LinkTable(4, 10_000, clock=clock, max_queue_wait_s=30)
    for name in ("idle1", "idle2", "idle3", "busy"):
        join(t, name, BURST_SLO)
    for name in ("idle1", "idle2", "idle3"):
        (await t.admit(name, 1, None)).release()
    burst = await spawn(t, "busy", 4)
    assert all(task.done() for task in burst) and t.running == 4
    for _ in range(10):
        t.record_itl("busy", 600)
    t.control_step()
    assert weight(t, "busy") == 1.0  # every slot in use, but no request found the node full
    burst += await spawn(t, "busy", 1)
    [back] = await spawn(t, "idle1", 1)
    assert not back.done() and not burst[4].done()
    burst[0].result().release()
    await settle()
    assert back.done() and running(t, "idle1") == 1 and running(t, "busy") == 3
    t.control_step()
    assert weight(t, "busy") == pytest.approx(0.8)
    for task in burst[4:]:
        task.cancel()
    await asyncio.gather(*burst[4:], return_exceptions=True)
    for ticket in [back.result(), *(task.result() for task in burst[1:4])]:
        ticket.release()
    assert t.running == t.waiting == 0


@pytest.mark.asyncio
async def test_a_decrease_needs_a_request_that_found_every_slot_taken():
    """A link missing its objective and pressing hardest shrinks only while links compete for the
    node: within the window a request found every slot taken."""
    clock = FakeClock()
    t = LinkTable(4, 10_000, clock=clock, max_queue_wait_s=30)
    for name in "abc":
        join(t, name, SLO)
    held = [await t.admit("a", 1, None) for _ in range(3)]
    feed(t, "a", 1000, 1000, demand=4, congested=False)
    t.control_step()
    assert weight(t, "a") == 1.0  # a's misses are its own: a slot is free and nobody waits
    held.append(await t.admit("a", 1, None))  # the last free slot: still nobody found the node full
    t.control_step()
    assert weight(t, "a") == 1.0
    [b_task] = await spawn(t, "b", 1)
    assert not b_task.done()
    t.control_step()
    assert weight(t, "a") == pytest.approx(0.8)  # b waits
    held.pop().release()
    await settle()
    assert b_task.done()  # b's wait ended; it still counts within the window
    t.control_step()
    assert weight(t, "a") == pytest.approx(0.64)
    clock.t += 11
    feed(t, "a", 1000, 1000, demand=4, congested=False)
    t.control_step()
    assert weight(t, "a") == pytest.approx(0.64)  # nobody found the node full in the window: no decrease
    for ticket in [*held, b_task.result()]:
        ticket.release()
    assert t.running == t.waiting == 0
