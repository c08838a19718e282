"""Every bound counts what is admitted and in flight, not only what is committed, so concurrent
requests are admitted exactly up to it: sessions per edge, bytes an edge stores, the node's session
table, uploads (count and bytes, per edge and in total) and links per edge. Many turns are held in
flight at once (their uplinks wait behind a gate after the header), exactly the bound's number are
admitted, the rest are refused with RESOURCE_EXHAUSTED (``QuotaExceeded``), and once they end, by
success, error or cancellation, nothing is left held. A turn that alone passes a bound is refused
at once as never fitting (``TurnTooLarge``, FAILED_PRECONDITION, no retry hint). The engines'
slots are held the other way: no turn waits while one is free. In-memory stack (``tests/doubles.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from tandem.cloud.config import EngineConfig
from tandem.cloud.links.tenancy import EdgeOverLimit
from tandem.cloud.sessions.table import SessionTableFull
from tandem.cloud.turn import as_principal
from tandem.common.protocol.errors import QuotaExceeded
from tandem.common.protocol.modes import Mode
from tandem.common.protocol.params import NegotiateOffer
from tandem.edge.link.base import InProcessLink
from tests.doubles import MANIFEST, B, GatedLink, K, Toy, toy_stack
from tests.helpers import run, turn

CALLER = as_principal("in-process")  # the identity of the toy edge
PROMPT = "Tell me about the arches and bridges of the Romans, and how they were built. " * 2


async def gated_stack(**cloud_kw) -> tuple[Toy, GatedLink]:
    gate = asyncio.Event()
    links: list[GatedLink] = []

    def wrap(inner):
        links.append(GatedLink(inner, gate))
        return links[0]

    engine = EngineConfig(block_size_tokens=B, max_num_seqs=32)  # slots for every turn: only the bound refuses
    toy = await toy_stack(link_wrapper=wrap, engine=engine, **cloud_kw)
    return toy, links[0]


async def until(cond: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.005)


def refused(tasks: list[asyncio.Task]) -> list[BaseException]:
    return [t.exception() for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]


def nothing_held(toy: Toy) -> None:
    """Every bound back to what is committed: no hold, upload, slot or turn left in flight."""
    gw = toy.gateway
    assert gw.edge_limits.holding(CALLER) == (0, 0)
    assert gw.sessions.holding() == 0
    budget = gw.receiver.budget
    assert budget.uploads == budget.nbytes == 0
    assert gw.links.running == gw.links.waiting == gw.links.running_tokens == 0


async def admit_concurrently(
    toy: Toy, link: GatedLink, turns: list, admitted: Callable[[], int]
) -> tuple[list[asyncio.Task], list[BaseException]]:
    """Start every turn at once behind the closed gate; wait until each is either admitted (counted
    by ``admitted``) or refused. Returns the tasks and the refusals."""
    tasks = [asyncio.create_task(run(toy.edge, t)) for t in turns]
    await until(lambda: admitted() + len(refused(tasks)) == len(turns), "every turn admitted or refused")
    return tasks, refused(tasks)


def split_turns(n: int, sessions: bool | list[bool] = True, prefix: str = "s") -> list:
    flags = sessions if isinstance(sessions, list) else [sessions] * n
    return [turn(PROMPT, session=f"{prefix}{i}" if flags[i] else "", n=2) for i in range(n)]


# ------------------------------------------------------------------ sessions and stored bytes per edge


async def test_concurrent_new_sessions_are_admitted_exactly_up_to_the_edges_bound():
    """``edge_max_sessions`` 4, six new split conversations at once: four are admitted and held in
    flight, two refused; the cloud then holds exactly four sessions, and a seventh takes the place of
    the least recently used."""
    toy, link = await gated_stack(edge_max_sessions=4)
    gw = toy.gateway
    try:
        tasks, no = await admit_concurrently(toy, link, split_turns(6), lambda: gw.edge_limits.holding(CALLER)[0])
        assert len(no) == 2 and all(isinstance(e, EdgeOverLimit) and isinstance(e, QuotaExceeded) for e in no)
        assert gw.edge_limits.holding(CALLER)[0] == 4 and gw.sessions.holding() == 4
        admitted = [t for t in tasks if not t.done()]
        link.gate.set()
        done = await asyncio.gather(*admitted)
        assert len(done) == 4 and all(d.mode is Mode.SPLIT for d in done)
        assert len(gw.sessions.owned_by(CALLER.tag)) == 4
        nothing_held(toy)
        assert (await run(toy.edge, turn(PROMPT, session="seventh", n=2))).mode is Mode.SPLIT
        assert len(gw.sessions.owned_by(CALLER.tag)) == 4
        nothing_held(toy)
    finally:
        await toy.batcher.stop()


async def test_concurrent_turns_hold_the_edges_stored_bytes_exactly():
    """Stored bytes: room for three turns' state; six at once, stateful and stateless alike, hold
    their bytes from their header: three admitted, three refused; afterwards the sessions kept fit."""
    toy, link = await gated_stack()
    gw = toy.gateway
    per_turn = gw.edge_limits.turn_bytes(len(toy.edge.tokenize(turn(PROMPT))))
    gw.edge_limits.max_stored_bytes = 3 * per_turn + per_turn // 2
    try:
        turns = split_turns(6, [True, False, True, False, True, True], prefix="b")
        tasks, no = await admit_concurrently(toy, link, turns, lambda: gw.edge_limits.holding(CALLER)[0])
        assert len(no) == 3 and all(isinstance(e, EdgeOverLimit) for e in no)
        assert gw.edge_limits.holding(CALLER) == (3, 3 * per_turn)
        link.gate.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        kept = gw.sessions.owned_by(CALLER.tag)
        assert sum(gw.edge_limits.session_bytes(s) for s in kept.values()) <= gw.edge_limits.max_stored_bytes
        nothing_held(toy)
    finally:
        await toy.batcher.stop()


async def test_concurrent_new_sessions_hold_the_nodes_session_table_exactly():
    toy, link = await gated_stack(max_sessions=3)
    gw = toy.gateway
    try:
        tasks, no = await admit_concurrently(toy, link, split_turns(5, prefix="n"), gw.sessions.holding)
        assert len(no) == 2 and all(isinstance(e, SessionTableFull) for e in no)
        assert gw.sessions.holding() == 3
        link.gate.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert len(gw.sessions) == 3
        nothing_held(toy)
    finally:
        await toy.batcher.stop()


@pytest.mark.parametrize("how", ["cancelled", "failed"])
async def test_holds_are_released_when_turns_are_cancelled_or_fail(how: str):
    """Turns held in flight that are cancelled by their caller, or whose upload fails, give back
    their places: the bound admits as many new sessions again."""
    toy, link = await gated_stack(edge_max_sessions=3)
    gw = toy.gateway
    try:
        tasks, no = await admit_concurrently(toy, link, split_turns(3, prefix="c"), lambda: gw.sessions.holding())
        assert not no and gw.edge_limits.holding(CALLER)[0] == 3
        if how == "cancelled":
            for task in tasks:
                task.cancel()
        else:
            link.cut = True  # the held uplinks close before their uploads complete
            link.gate.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, asyncio.CancelledError if how == "cancelled" else Exception) for r in results)
        await until(lambda: gw.edge_limits.holding(CALLER)[0] == 0, "the cloud's turns ended")
        nothing_held(toy)
        assert len(gw.sessions.owned_by(CALLER.tag)) == 0
        link.cut = False
        link.gate.set()
        done = await asyncio.gather(*(run(toy.edge, t) for t in split_turns(3, prefix="again")))
        assert all(d.mode is Mode.SPLIT for d in done) and len(gw.sessions.owned_by(CALLER.tag)) == 3
        nothing_held(toy)
    finally:
        await toy.batcher.stop()


# ------------------------------------------------------------------ uploads


def upload_bound(field: str, one_upload_bytes: int) -> int:
    """Room for exactly three uploads under the ``UploadBudget`` bound ``field``."""
    return 3 if field in ("max_uploads", "max_uploads_per_peer") else 3 * one_upload_bytes + one_upload_bytes // 2


@pytest.mark.parametrize("field", ["max_uploads", "max_uploads_per_peer", "max_bytes", "max_bytes_per_peer"])
async def test_concurrent_uploads_are_admitted_exactly_up_to_each_upload_bound(field: str):
    toy, link = await gated_stack()
    budget = toy.gateway.receiver.budget
    try:
        probe = asyncio.create_task(run(toy.edge, turn(PROMPT, n=2)))  # how much one upload reserves
        await until(lambda: budget.uploads == 1, "the probe's upload reserved")
        one = budget.nbytes
        link.gate.set()
        await probe
        link.gate.clear()
        assert hasattr(budget, field)
        setattr(budget, field, upload_bound(field, one))
        tasks, no = await admit_concurrently(toy, link, split_turns(7, sessions=False), lambda: budget.uploads)
        assert len(no) == 4 and all(isinstance(e, QuotaExceeded) and "upload" in str(e) for e in no)
        assert budget.uploads == 3 and budget.nbytes == 3 * one
        link.gate.set()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        assert sum(1 for d in done if not isinstance(d, BaseException)) == 3
        nothing_held(toy)
    finally:
        await toy.batcher.stop()


# ------------------------------------------------------------------ a turn larger than a whole bound

# (the bound's owner, its field): each bounds what one split turn holds in the cloud
WHOLE_BOUNDS = [
    ("edge_limits", "max_stored_bytes"),
    ("sessions", "max_bytes"),
    ("budget", "max_bytes_per_peer"),
    ("budget", "max_bytes"),
]


@pytest.mark.parametrize(("owner", "field"), WHOLE_BOUNDS, ids=[f"{o}.{f}" for o, f in WHOLE_BOUNDS])
async def test_a_turn_larger_than_a_whole_bound_is_refused_as_never_fitting(owner: str, field: str):
    """A split turn that alone passes a bound (here 1 byte) can never be admitted, however long it
    waits: ``TurnTooLarge`` (FAILED_PRECONDITION) naming the prompt, without a retry hint, and
    nothing left held; not ``QuotaExceeded`` with ``retry-after-ms``."""
    from tandem.common.protocol.errors import TurnTooLarge
    from tandem.common.protocol.grpc_errors import retry_after_ms, status_of

    toy = await toy_stack()
    gw = toy.gateway
    target = {"edge_limits": gw.edge_limits, "sessions": gw.sessions, "budget": gw.receiver.budget}[owner]
    try:
        setattr(target, field, 1)
        with pytest.raises(TurnTooLarge) as e:
            await run(toy.edge, turn(PROMPT, session="big", n=2))
        assert status_of(e.value).name == "FAILED_PRECONDITION" and retry_after_ms(e.value) is None
        assert e.value.param == "messages" and e.value.code == "context_length_exceeded"  # a chat's prompt
        nothing_held(toy)
    finally:
        await toy.batcher.stop()


# ------------------------------------------------------------------ links


async def test_concurrent_negotiations_hold_the_edges_link_bound():
    """``edge_max_links`` 2, both links with a turn in flight: six negotiations at once are all
    refused and the edge still holds two links; once the turns end, six at once each forget the
    least recently used idle link (a link negotiated and never used first) and the edge holds
    exactly two."""
    toy, link = await gated_stack(edge_max_links=2)
    gw = toy.gateway
    other = await toy.another_edge("e2")
    other.conn.link = GatedLink(other.conn.link, link.gate)  # type: ignore[attr-defined]

    def links_of_edge() -> int:
        return sum(1 for owner in gw.registry._owners.values() if owner == str(CALLER))

    try:
        assert links_of_edge() == 2
        tasks = [asyncio.create_task(run(edge, turn(PROMPT, n=2))) for edge in (toy.edge, other)]
        await until(lambda: gw.links.running == 2, "both links busy")
        key = MANIFEST.compatibility_key()
        offers = [
            NegotiateOffer(edge_id=f"x{i}", model_id="toy", head_keys={K: key}, edge_max_batch=4) for i in range(6)
        ]
        results = await asyncio.gather(*(InProcessLink(gw).negotiate(o) for o in offers), return_exceptions=True)
        assert all(isinstance(r, EdgeOverLimit) for r in results) and links_of_edge() == 2
        link.gate.set()
        await asyncio.gather(*tasks)
        results = await asyncio.gather(*(InProcessLink(gw).negotiate(o) for o in offers))
        assert links_of_edge() == 2
        held = {lk.link_id for lk in gw.links.links()} - {""}  # the anonymous link is the node's own
        assert len(held) == 2 and results[-1].link_id in held
        nothing_held(toy)
    finally:
        await other.batcher.stop()
        await toy.batcher.stop()


# ------------------------------------------------------------------ engine slots


async def test_no_turn_waits_on_the_gateway_while_a_slot_is_free():
    """``max_num_seqs`` 4: two busy edges (four closed-loop clients each, their links at the
    controller's floor) beside an edge that sent one turn and went quiet (weight 1, the larger
    share). Sampled at every step of the event loop, whenever a turn waits for a slot all four run."""
    toy = await toy_stack(engine=EngineConfig(block_size_tokens=B, max_num_seqs=4), max_queue_wait_s=30)
    gw = toy.gateway
    quiet, other = await toy.another_edge("quiet"), await toy.another_edge("b2")
    samples: list[tuple[int, int]] = []
    try:
        await run(quiet, turn(PROMPT, n=2))
        for edge in (toy.edge, other):
            link = gw.links.get(edge.conn.link_id)
            assert link is not None
            link.weight = 0.1

        async def sample() -> None:
            while True:
                samples.append((gw.links.running, gw.links.waiting))
                await asyncio.sleep(0)

        async def client(edge, i: int) -> None:
            for j in range(3):
                assert (await run(edge, turn(f"{PROMPT} {i} {j}", n=8))).mode is Mode.SPLIT

        sampler = asyncio.create_task(sample())
        await asyncio.gather(*(client(edge, i) for edge in (toy.edge, other) for i in range(4)))
        sampler.cancel()
        assert gw.links.share(quiet.conn.link_id)[0] == 3  # with both busy links active
        waiting = [running for running, w in samples if w]
        assert waiting and all(running == 4 for running in waiting), sorted(set(waiting))
        nothing_held(toy)
    finally:
        await quiet.batcher.stop()
        await other.batcher.stop()
        await toy.batcher.stop()
