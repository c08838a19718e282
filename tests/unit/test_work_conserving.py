"""Admission is work-conserving: no request waits while a sequence slot is free, whatever the links'
shares, weights and objectives; shares decide only who goes first when slots are short (a freed slot
goes to the waiting link furthest under its share). A property test drives ``LinkTable`` through
random link mixes, arrivals, completions, cancellations, latencies and controller steps and checks
the invariant and the order after every step; the named tests replay two busy links beside one that
went quiet. Pure asyncio on a fake clock, no engines."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.cloud.links.table import LinkBusy, LinkSlo, LinkTable, Ticket
from tests.doubles import FakeClock, settle

OBJECTIVES = st.sampled_from([LinkSlo(0, 0), LinkSlo(100, 20), LinkSlo(1000, 200), LinkSlo(50, 0), LinkSlo(0, 5)])


@dataclass
class Held:
    ticket: Ticket
    in_prefill: bool = True


@dataclass
class Driver:
    """A ``LinkTable`` and the requests sent to it: waiting (tasks not done) and held (tickets)."""

    table: LinkTable
    clock: FakeClock
    links: list[str]
    waiting: list[tuple[str, asyncio.Task[Ticket]]] = field(default_factory=list)
    held: list[Held] = field(default_factory=list)
    refused: int = 0

    def collect(self) -> None:
        """Move the requests admitted since the last look to ``held``; count the refused ones, each
        refused only with every slot taken."""
        still = []
        for link_id, task in self.waiting:
            if not task.done():
                still.append((link_id, task))
            elif task.cancelled():
                continue
            elif isinstance(task.exception(), LinkBusy):
                self.refused += 1
            else:
                self.held.append(Held(task.result()))
        self.waiting = still

    def check(self) -> None:
        """Work conservation and consistent counts."""
        t = self.table
        assert t.waiting == 0 or t.running == t.max_num_seqs, (t.running, t.waiting)
        assert t.running == len(self.held) == sum(lk.running for lk in t.links())
        assert t.waiting == len(self.waiting) == sum(lk.waiting for lk in t.links())
        in_prefill = sum(h.ticket.prompt_tokens for h in self.held if h.in_prefill)
        assert t.running_tokens == in_prefill == sum(lk.running_tokens for lk in t.links())

    def first_in_line(self, released: Held) -> str | None:
        """The link whose waiter a release of ``released`` must serve: the lowest (fill against its
        share, oldest head request) among links with a request waiting; None when nobody waits."""
        t = self.table
        candidates = []
        for link in t.links():
            if not link.waiting:
                continue
            running = link.running - (link.link_id == released.ticket.link_id)
            tokens = link.running_tokens - (
                released.ticket.prompt_tokens if released.in_prefill and link.link_id == released.ticket.link_id else 0
            )
            seqs, toks = t._shares(self.clock.t)[link.link_id]
            candidates.append((max(running / seqs, tokens / toks), link._queue[0].seq, link.link_id))
        return min(candidates)[2] if candidates else None


OPS = st.one_of(
    st.tuples(st.just("arrive"), st.integers(0, 4), st.integers(1, 120)),
    st.tuples(st.just("release"), st.integers(0, 63)),
    st.tuples(st.just("prefill"), st.integers(0, 63)),
    st.tuples(st.just("cancel"), st.integers(0, 63)),
    st.tuples(st.just("tick"), st.sampled_from([0.5, 3.0, 11.0, 70.0])),
    st.tuples(st.just("latency"), st.integers(0, 4), st.floats(1, 5000), st.floats(0.1, 1000)),
    st.tuples(st.just("control"), st.just(0)),
    st.tuples(st.just("weight"), st.integers(0, 4), st.floats(0.1, 10)),
)


async def drive(seqs: int, tokens: int, objectives: list[LinkSlo], max_queue: int, ops: list[tuple]) -> None:
    clock = FakeClock()
    t = LinkTable(seqs, tokens, max_queue=max_queue, max_queue_wait_s=1e6, clock=clock)
    names = [f"l{i}" for i in range(len(objectives))]
    for name, slo in zip(names, objectives, strict=True):
        t.register(name, f"edge-{name}", slo)
    d = Driver(t, clock, names)
    for op in ops:
        kind = op[0]
        expected: str | None = None
        before = {lk.link_id: lk.running for lk in t.links()}
        if kind == "arrive":
            name = names[op[1] % len(names)]
            d.waiting.append((name, asyncio.create_task(t.admit(name, op[2], None))))
        elif kind == "release" and d.held:
            h = d.held.pop(op[1] % len(d.held))
            expected = d.first_in_line(h)
            before[h.ticket.link_id] -= 1
            h.ticket.release()
        elif kind == "prefill" and d.held:
            h = d.held[op[1] % len(d.held)]
            h.ticket.prefill_done()
            h.in_prefill = False
        elif kind == "cancel" and d.waiting:
            d.waiting[op[1] % len(d.waiting)][1].cancel()
        elif kind == "tick":
            clock.t += op[1]
        elif kind == "latency":
            name = names[op[1] % len(names)]
            for _ in range(5):
                t.record_ttft(name, op[2])
                t.record_itl(name, op[3])
        elif kind == "control":
            t.control_step()
        elif kind == "weight":
            link = t.get(names[op[1] % len(names)])
            assert link is not None
            link.weight = op[2]
        refused = d.refused
        await settle()
        d.collect()
        if d.refused > refused:  # LinkBusy at once: only a full queue with every slot taken
            assert t.running == t.max_num_seqs
        d.check()
        if expected is not None:
            grown = [lk.link_id for lk in t.links() if lk.running > before[lk.link_id]]
            assert grown == [expected], (grown, expected)
    for _, task in d.waiting:
        task.cancel()
    await asyncio.gather(*(task for _, task in d.waiting), return_exceptions=True)
    d.collect()
    for h in d.held:
        h.ticket.release()
    assert t.running == t.waiting == t.running_tokens == 0


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seqs=st.integers(1, 6),
    tokens=st.integers(6, 200),
    objectives=st.lists(OBJECTIVES, min_size=1, max_size=5),
    max_queue=st.integers(1, 8),
    ops=st.lists(OPS, max_size=80),
)
def test_no_request_waits_while_a_slot_is_free_and_the_furthest_under_its_share_goes_first(
    seqs, tokens, objectives, max_queue, ops
):
    asyncio.run(drive(seqs, tokens, objectives, max_queue, ops))


# --- two busy links beside one that sent a request and went quiet -----------------------------

BUSY_SLO = LinkSlo(ttft_ms=1000, itl_p99_ms=200)


def two_busy_and_an_idle_link(with_idle: bool) -> tuple[LinkTable, FakeClock]:
    """``max_num_seqs`` 4; links "b1", "b2" and (``with_idle``) "idle", which sent one request."""
    clock = FakeClock()
    t = LinkTable(4, 4096, max_queue_wait_s=1e6, clock=clock)
    for name in ("b1", "b2", "idle") if with_idle else ("b1", "b2"):
        t.register(name, f"edge-{name}", BUSY_SLO)
    return t, clock


def shrink_the_busy_links(t: LinkTable, clock: FakeClock) -> None:
    """Both busy links, each with requests waiting, miss their ITL objective until the controller
    holds them at its weight floor (30 s: the idle link stays active, at weight 1)."""
    for _ in range(15):
        for name in ("b1", "b2"):
            for _ in range(10):
                t.record_itl(name, 600)
        t.control_step()
        clock.t += 2


@pytest.mark.asyncio
async def test_two_busy_links_run_in_every_slot_beside_a_quiet_link_with_the_larger_share():
    """``max_num_seqs`` 4: the idle link keeps weight 1 and 3 of 4 slots' share while the busy links
    sit at the controller's floor; a burst of both busy links, arriving in turn, runs in every slot
    and keeps every slot running at each release while any of it waits."""
    t, clock = two_busy_and_an_idle_link(with_idle=True)
    (await t.admit("idle", 20, None)).release()
    burst = [asyncio.create_task(t.admit(name, 20, None)) for _ in range(4) for name in ("b1", "b2")]
    await settle()
    assert t.running == 4 and t.waiting == 4
    shrink_the_busy_links(t, clock)
    assert t.get("b1").weight == t.get("b2").weight == pytest.approx(0.1)  # type: ignore[union-attr]
    assert t.share("idle")[0] == 3 and t.share("b1")[0] == t.share("b2")[0] == 1
    released = 0
    while t.waiting:
        ticket = next(task.result() for task in burst if task.done())
        burst = [task for task in burst if not task.done() or task.result() is not ticket]
        ticket.release()
        released += 1
        await settle()
        assert t.waiting == 0 or t.running == 4, (released, t.running, t.waiting)
    assert released == 4 and t.running == 4
    for task in burst:
        task.result().release()
    assert t.running == 0


async def closed_loop(with_idle: bool, clients_per_link: int = 4, duration_s: float = 3.0, run_s: float = 120.0):
    """Closed-loop clients of both busy links, each request ``duration_s`` long on the fake clock,
    with the controller stepping every 2 s while both miss their objectives. Returns (requests
    served, samples with a request waiting, of which with a slot free)."""
    t, clock = two_busy_and_an_idle_link(with_idle)
    if with_idle:
        (await t.admit("idle", 20, None)).release()
    started: dict[asyncio.Task[Ticket], float] = {}
    pending = [asyncio.create_task(t.admit(name, 20, None)) for name in ("b1", "b2") for _ in range(clients_per_link)]
    served = waiting_samples = idle_while_waiting = 0
    end, next_step = clock.t + run_s, clock.t + 2
    while clock.t < end:
        await settle()
        for task in [task for task in pending if task.done()]:
            pending.remove(task)
            started[task] = clock.t
        if t.waiting:
            waiting_samples += 1
            idle_while_waiting += t.running < t.max_num_seqs
        first = min(started, key=lambda task: started[task])
        clock.t = max(clock.t, started.pop(first) + duration_s)
        if clock.t >= next_step:
            for name in ("b1", "b2"):
                for _ in range(10):
                    t.record_itl(name, 600)
            t.control_step()
            next_step += 2
        ticket = first.result()
        ticket.release()
        served += 1
        pending.append(asyncio.create_task(t.admit(ticket.link_id, 20, None)))
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for task in started:
        task.result().release()
    assert t.running == t.waiting == 0
    return served, waiting_samples, idle_while_waiting


@pytest.mark.asyncio
async def test_a_quiet_link_costs_two_busy_links_nothing_in_a_closed_loop():
    served, waiting, idle = await closed_loop(with_idle=True)
    served_alone, _, _ = await closed_loop(with_idle=False)
    assert waiting > 0 and idle == 0
    assert served == served_alone >= 4 * (120 // 3 - 1)  # every slot busy throughout
