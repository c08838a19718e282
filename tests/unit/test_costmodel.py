"""The edge's cost model (``edge.routing.costmodel``): formula per mode, online calibration, the choice
with hysteresis and exploration, and when zstd pays."""

from __future__ import annotations

import time

import pytest

from tandem.common.protocol.modes import Mode
from tandem.edge.routing.costmodel import (
    CostModel,
    EdgeLoad,
    Line,
    LineKey,
    LineKind,
    LinkState,
    Prediction,
    RequestShape,
    Route,
    zstd_pays,
)
from tandem.stages import Stage

LOCAL, SPLIT, DIRECT = Mode.LOCAL, Mode.SPLIT, Mode.DIRECT


def model() -> CostModel:
    m = CostModel(hysteresis=0.1, explore_every=0)
    m.edge.local_prefill_ms_per_token.add(2.0)
    m.edge.local_decode_ms_per_token.add(40.0)
    m.edge.head(4).add(0.3)
    return m


def link(**kw) -> LinkState:
    base = dict(
        rtt_ms=20.0,
        goodput_mbps=80.0,  # 10 bytes per microsecond: 10_000 bytes per ms
        cloud_prefill_ms_per_token=0.5,
        cloud_tail_prefill_ms_per_token={4: 0.4},
        bytes_per_token={4: 8448.0},
        block_size_tokens=32,
        num_layers=30,
    )
    return LinkState(**{**base, **kw})


def test_formula_per_mode_matches_the_documented_terms():
    m, lk = model(), link()
    shape = RequestShape(100)
    assert m.formula(Route(LOCAL), shape, lk) == pytest.approx(100 * 2.0)
    assert m.formula(Route(DIRECT), shape, lk) == pytest.approx(20 + 100 * 5 / 10_000 + 100 * 0.5)
    split = 100 * 0.3 + 100 * 8448 / 10_000 + 20 + 100 * 0.4
    assert m.formula(Route(SPLIT, 4), shape, lk) == pytest.approx(split)


def test_what_a_session_holds_is_not_paid_again():
    m, lk = model(), link()
    held = RequestShape(100, local_cached_tokens=90, head_cached_tokens={4: 90}, cloud_cached_tokens={4: 90})
    assert m.formula(Route(LOCAL), held, lk) == pytest.approx(10 * 2.0)
    # head and wire for 10 tokens; the tail reloads the 2 full blocks (64 tokens) the cloud computed
    split = 10 * 0.3 + 10 * 8448 / 10_000 + 20 + (100 - 64) * 0.4
    assert m.formula(Route(SPLIT, 4), held, lk) == pytest.approx(split)
    # an identical prompt still runs its last token
    same = RequestShape(100, local_cached_tokens=100)
    assert m.formula(Route(LOCAL), same, lk) == pytest.approx(2.0)


def test_queues_and_unknowns():
    """Each queue enters the TTFT formula once: the local engine's FIFO prefills and decoding turns, processor
    sharing with the split head, the cloud's admission wait or this edge's own cloud prefills (the larger),
    passed in per prediction and never kept; without a cloud rate the edge's own rate scaled to the layers
    run stands in."""
    m = model()
    assert m.formula(Route(LOCAL), RequestShape(10), link(), load=EdgeLoad(2)) == pytest.approx(2 * 40 + 10 * 2.0)
    # the local engine runs FIFO: a prefill of 500 tokens waiting ahead costs its prefill, and the
    # turn it belongs to does not also count as decoding
    queued = EdgeLoad(local_active=3, local_pending_prefill_tokens=500, local_pending_prefills=1)
    assert m.formula(Route(LOCAL), RequestShape(10), link(), load=queued) == pytest.approx(
        500 * 2.0 + 2 * 40 + 10 * 2.0
    )
    # the split's head shares the edge's processor with those prefills: 30 ms of head beside 1000 ms
    # of local work finishes after 60 ms; beside 10 ms of it, after 40
    alone = 100 * 0.3 + 100 * 8448 / 10_000 + 20 + 100 * 0.4
    assert m.formula(Route(SPLIT, 4), RequestShape(100), link(), load=queued) == pytest.approx(alone + 30.0)
    few = EdgeLoad(local_active=3, local_pending_prefill_tokens=5, local_pending_prefills=1)
    assert m.formula(Route(SPLIT, 4), RequestShape(100), link(), load=few) == pytest.approx(alone + 10.0)
    assert m.formula(Route(SPLIT, 4), RequestShape(100), link()) == pytest.approx(alone)
    # the load is an input of the prediction alone: the model keeps none of it
    assert (
        m.predict(Route(LOCAL), RequestShape(10), link(), queued).ttft_ms
        > m.predict(Route(LOCAL), RequestShape(10), link()).ttft_ms
    )
    assert m.formula(Route(LOCAL), RequestShape(10), link()) == pytest.approx(10 * 2.0)
    busy = link(cloud_busy=True, queue_wait_ms=300.0)
    assert m.formula(Route(DIRECT), RequestShape(10), busy) == pytest.approx(
        m.formula(Route(DIRECT), RequestShape(10), link()) + 300
    )
    # this edge's own turns in the cloud before their first token: at least their compute is ahead
    for route in (Route(DIRECT), Route(SPLIT, 4)):
        idle = m.formula(route, RequestShape(10), link())
        assert m.formula(route, RequestShape(10), link(own_cloud_prefill_ms=500.0)) == pytest.approx(idle + 500)
        both = link(cloud_busy=True, queue_wait_ms=300.0, own_cloud_prefill_ms=200.0)
        assert m.formula(route, RequestShape(10), both) == pytest.approx(idle + 300)  # the larger of the two
    # before the cloud measured a rate, the prior is the edge's own rate scaled to the layers run
    unknown = link(cloud_prefill_ms_per_token=0.0, cloud_tail_prefill_ms_per_token={}, goodput_mbps=0.0)
    assert m.formula(Route(DIRECT), RequestShape(10), unknown) == pytest.approx(20 + 10 * 2.0)
    assert m.formula(Route(SPLIT, 4), RequestShape(10), unknown) == pytest.approx(10 * 0.3 + 20 + 10 * 2.0 * 26 / 30)


def test_head_batchers_queue_the_split_and_share_the_processor_with_the_local_engine():
    m = model()
    alone = 100 * 0.3 + 100 * 8448 / 10_000 + 20 + 100 * 0.4
    local_alone = m.formula(Route(LOCAL), RequestShape(100), link())
    # 400 tokens in the k=4 batcher (120 ms at 0.3 ms per token): a k=4 head waits for them (FIFO)
    k4 = EdgeLoad(head_pending_tokens={4: 400})
    assert m.formula(Route(SPLIT, 4), RequestShape(100), link(), load=k4) == pytest.approx(alone + 120)
    # a local prefill (200 ms) runs beside them: it finishes after 200 + min(200, 120)
    assert m.formula(Route(LOCAL), RequestShape(100), link(), load=k4) == pytest.approx(local_alone + 120)
    # a head at another split layer shares the processor with that batcher rather than queueing
    m.edge.head(8).add(0.5)
    both = EdgeLoad(head_pending_tokens={4: 40, 8: 0})  # 12 ms of k=4 work beside a 50 ms head at k=8
    k8 = m.formula(Route(SPLIT, 8), RequestShape(100), link(bytes_per_token={8: 0.0}), load=both)
    assert k8 - m.formula(Route(SPLIT, 8), RequestShape(100), link(bytes_per_token={8: 0.0})) == pytest.approx(12)
    p = m.predict(Route(LOCAL), RequestShape(100), link())
    assert p.within == {LineKey(LineKind.LOCAL): 0.0}


def test_contention_inside_a_stage_is_not_left_to_the_residual():
    """A stage's measured time holds the contention the formula predicts inside it (this edge's other
    prefills in the cloud engine, the heads beside a local prefill): the line learns the compute
    without it and the residual stays near zero, rather than cancelling the queue term."""
    m, lk = model(), link(own_cloud_prefill_ms=400.0)
    for n in (64, 256, 1024, 100, 700):
        p = m.predict(Route(DIRECT), RequestShape(n), lk)
        assert p.within[LineKey(LineKind.DIRECT)] == pytest.approx(400.0)
        compute = 30 + 0.8 * n
        measured = 20 + n * 5 / 10_000 + 400 + compute
        m.observe(p, measured, {Stage.CLOUD_DECODE_FIRST_TOKEN: 400 + compute})
    a, b, _ = m.lines[LineKey(LineKind.DIRECT)].coefficients(0.5)
    assert a == pytest.approx(30, abs=1e-3) and b == pytest.approx(0.8, rel=1e-4)
    assert abs(m.residual_ms(Route(DIRECT), 256)) < 1e-6
    # the same load, now measured: the prediction holds the queue
    truth = 20 + 256 * 5 / 10_000 + 400 + 30 + 0.8 * 256
    assert m.predict(Route(DIRECT), RequestShape(256), lk).ttft_ms == pytest.approx(truth, rel=1e-6)


def test_stage_lines_are_fitted_from_stage_timings_and_the_residual_takes_the_rest():
    m, lk = model(), link()
    # the cloud's whole-model prefill really costs 30 ms + 0.8 ms per token; the measured rate said 0.5
    for n in (64, 256, 1024, 100, 700):
        p = m.predict(Route(DIRECT), RequestShape(n), lk)
        measured = 20 + n * 5 / 10_000 + (30 + 0.8 * n) + 12.0  # RTT + ids + prefill + 12 ms unmodelled
        m.observe(p, measured, {Stage.CLOUD_DECODE_FIRST_TOKEN: 30 + 0.8 * n})
    a, b, c = m.lines[LineKey(LineKind.DIRECT)].coefficients(0.5)
    assert a == pytest.approx(30, abs=1e-3) and b == pytest.approx(0.8, rel=1e-4) and c == pytest.approx(0, abs=1e-7)
    for n in (32, 512, 2048):  # also lengths it never saw
        truth = 20 + n * 5 / 10_000 + 30 + 0.8 * n + 12.0
        assert m.predict(Route(DIRECT), RequestShape(n), lk).ttft_ms == pytest.approx(truth, rel=0.05)
    # one length only: the slope stays the prior rate, the intercept absorbs the difference
    q = m.predict(Route(LOCAL), RequestShape(200), lk)
    for _ in range(5):
        m.observe(q, 480.0, {Stage.LOCAL_PREFILL: 470.0})
    a, b, c = m.lines[LineKey(LineKind.LOCAL)].coefficients(2.0)
    assert b == pytest.approx(2.0) and a == pytest.approx(70.0) and c == 0
    # one local run's time (the remote-prefill catch-up's and auto's handover model's) is that line's
    assert m.local_run_ms(10) == pytest.approx(70.0 + 2.0 * 10) and m.local_run_ms(0) == 0.0
    # attention makes long prefills superlinear: the quadratic term is found
    quad = Line()
    for n in (64, 256, 1024, 128, 512):
        quad.add(n, 20 + 1.0 * n + 0.001 * n * n)
    qa, qb, qc = quad.coefficients(0.0)
    assert (qa, qb, qc) == (pytest.approx(20, abs=1e-3), pytest.approx(1.0, rel=1e-4), pytest.approx(0.001, rel=1e-3))
    # a line never goes negative, and the prediction keeps at least half of the formula
    m.lines[LineKey(LineKind.TAIL, 4)] = Line()
    for n in (800, 900, 1000, 1100):
        m.lines[LineKey(LineKind.TAIL, 4)].add(n, 10.0)
    assert all(c >= 0 for c in m.lines[LineKey(LineKind.TAIL, 4)].coefficients(0.4))
    p = m.predict(Route(SPLIT, 4), RequestShape(2), lk)
    assert p.ttft_ms >= 0.5 * p.formula_ms > 0


def pred(mode: str, ms: float, k: int = 0) -> Prediction:
    return Prediction(Route(mode, k), ms, ms)


def test_short_prompts_stay_accurate_when_long_ones_are_off():
    """The fit minimises relative error: 1024-token samples 20% below the curve (a quiet spell; the
    fit then falls back to a line) must not move the 64-token prediction by more than a few percent
    (an unweighted fit moved it by a third)."""
    truth = lambda n: 15 + 1.8 * n + 0.0004 * n * n  # noqa: E731 - ms, a local prefill of this shape
    line = Line()
    for i in range(40):
        for n in (64 + i % 5, 256 + i % 7, 1024 + i % 3):
            line.add(n, truth(n) * (0.8 if n >= 1024 else 1.0))
    for n in (64, 96):
        assert line.predict(n, 0.0) == pytest.approx(truth(n), rel=0.08)


def test_residuals_are_kept_per_prompt_length_octave():
    m, lk = model(), link()
    # transport overhead: 10 ms at short prompts, -150 ms (an over-fitted line) at long ones
    for _ in range(6):
        for n, extra in ((64, 10.0), (1024, -150.0)):
            p = m.predict(Route(DIRECT), RequestShape(n), lk)
            m.observe(p, p.formula_ms + extra, {})
    assert m.residual_ms(Route(DIRECT), 64) == pytest.approx(10.0, rel=0.05)
    assert m.residual_ms(Route(DIRECT), 100) == pytest.approx(10.0, rel=0.05)  # same octave
    assert m.residual_ms(Route(DIRECT), 2000) == pytest.approx(-150.0, rel=0.05)  # nearest octave
    assert m.residual_ms(Route(DIRECT), 8) == pytest.approx(10.0, rel=0.05)
    assert m.residual_ms(Route(LOCAL), 64) == 0.0  # never observed
    short = m.predict(Route(DIRECT), RequestShape(64), lk)
    assert short.ttft_ms == pytest.approx(short.formula_ms + 10.0, rel=0.01)


def test_choice_takes_the_lowest_and_does_not_flap_on_near_ties():
    m = model()
    pick, why = m.choose([pred(LOCAL, 100), pred(DIRECT, 120)])
    assert pick.route == Route(LOCAL) and why == "lowest predicted TTFT"
    # direct now 5% faster: within the hysteresis, local stays
    pick, why = m.choose([pred(LOCAL, 100), pred(DIRECT, 95)])
    assert pick.route == Route(LOCAL) and why.startswith("hysteresis")
    # 20% faster: switch
    pick, _ = m.choose([pred(LOCAL, 100), pred(DIRECT, 80)])
    assert pick.route == Route(DIRECT)
    # alternating near-ties never flap
    picks = {m.choose([pred(LOCAL, 100 + (i % 2) * 8), pred(DIRECT, 100)])[0].route for i in range(20)}
    assert picks == {Route(DIRECT)}


def test_exploration_refreshes_a_near_route_and_never_a_far_one():
    m = CostModel(hysteresis=0.1, explore_every=5, explore_within=1.5)
    seen = []
    for _ in range(10):
        pick, why = m.choose([pred(LOCAL, 100), pred(DIRECT, 140), pred(SPLIT, 900, 4)])
        m.ran(pick.route)
        seen.append((pick.route.mode, why.split(":")[0]))
    assert seen.count((DIRECT, "exploration")) == 2 and all(mode != SPLIT for mode, _ in seen)
    assert m.last == Route(LOCAL)  # exploring does not move the hysteresis anchor
    assert seen[0] == (DIRECT, "exploration") and seen[5] == (DIRECT, "exploration")  # never ran, then stale
    # requests of other kinds (an app asking for direct mode) keep the route fresh: no exploration
    fresh = CostModel(hysteresis=0.1, explore_every=5, explore_within=1.5)
    for _ in range(10):
        pick, why = fresh.choose([pred(LOCAL, 100), pred(DIRECT, 140)])
        fresh.ran(pick.route)
        fresh.ran(Route(DIRECT))
        assert not why.startswith("exploration") or fresh.choices == 1


def test_empty_choice_is_an_error():
    with pytest.raises(ValueError):
        model().choose([])


def test_zstd_pays_only_on_slow_links():
    # fp32 activations: ~8% smaller, compress 400 MB/s, decompress 1500 MB/s
    assert zstd_pays(0.92, 400, 1500, 10.0)  # 10 Mbit/s: saves 64 ns per byte, costs 3 ns
    assert not zstd_pays(0.92, 400, 1500, 10_000.0)  # loopback-class goodput
    assert not zstd_pays(0.92, 400, 1500, 0.0)  # unknown
    assert not zstd_pays(1.01, 400, 1500, 1.0)  # incompressible


def test_two_lengths_make_a_line_and_an_overshooting_prior_gives_way():
    """Two prompt lengths make a line through their samples, and a prior rate that overshoots them
    gives way: with the cloud's tail rate prior (4.5 ms per token, measured on a 30-token request
    whose fixed part it counts per token) and samples of 30 tokens in 140 ms and 65 in 164 ms (a
    sequence from `make run`, where the prior's slope would predict 296 ms at 65 tokens and choose
    a mode 18% slower than the best), the line goes through them; one length with such a prior
    goes through its mean."""
    line = Line()
    line.add(30, 140.0)
    line.add(65, 164.5)
    assert line.predict(65, 4.55) == pytest.approx(164.5, rel=0.02)
    assert line.predict(30, 4.55) == pytest.approx(140.0, rel=0.02)
    one = Line()
    one.add(65, 164.5)
    assert one.predict(65, 4.55) == pytest.approx(164.5, rel=1e-6)  # 4.55 x 65 = 296 would overshoot
    assert one.predict(65, 1.0) == pytest.approx(164.5, rel=1e-6)  # a fitting prior keeps its slope
    assert one.coefficients(1.0)[1] == pytest.approx(1.0)
    noisy = Line()  # longer measured faster: noise; as if of one length (the prior slope)
    noisy.add(100, 200.0)
    noisy.add(300, 150.0)
    a, b, c = noisy.coefficients(0.1)
    assert b == pytest.approx(0.1) and c == 0.0 and a > 0
    close = Line()  # two lengths too close to tell a slope from noise: the prior's, not a flat line
    close.add(30, 150.0)
    close.add(50, 148.0)
    assert close.predict(4000, 4.5) > 1000  # through the origin and the mean: about 3.7 ms per token


def test_a_line_fitted_badly_once_leaves_no_lasting_residual():
    """The residual is what the measured stages leave out, not the line's error at that moment: a
    split turn whose tail line was far off (prior 4.55 ms per token at 65 tokens = 296 ms, measured
    164 ms) leaves a residual of the unmodelled few ms, so the next prediction is close to the
    measured TTFT once the line is right (a residual against the line's error would be -178 ms and
    predict half the formula)."""
    m = CostModel(hysteresis=0.05, explore_every=0)
    m.edge.head(4).add(0.4)
    lk = link(rtt_ms=17.0, goodput_mbps=700.0, cloud_tail_prefill_ms_per_token={4: 4.55})
    route = Route(SPLIT, 4)
    for n, head_ms, tail_ms, ttft in ((30, 20.0, 140.0, 185.0), (65, 26.0, 164.5, 215.0)):
        p = m.predict(route, RequestShape(n), lk)
        m.observe(p, ttft, {Stage.EDGE_HEAD: head_ms, Stage.CLOUD_TAIL_PREFILL: tail_ms})
    assert abs(m.residual_ms(route, 65)) < 15.0
    assert m.predict(route, RequestShape(65), lk).ttft_ms == pytest.approx(215.0, rel=0.1)


def _router(m: CostModel, **kw):
    """A ``Router`` over ``m`` with a head at k=4 and a cloud whose measured decode time per token is 20 ms."""
    from tandem.edge.link.connection import CloudTarget
    from tandem.edge.routing.router import Router
    from tandem.edge.session import EdgeSessions

    class Conn:  # what the router reads of the cloud: its measured decode time per token
        class load:
            decode_ms_per_token = 20.0

    class Target(CloudTarget):
        def current(self):
            return Conn()

    return Router([4], Target(), EdgeSessions(8, 1 << 20), m, **kw)


def test_the_router_counts_its_cloud_turns_prefill_until_their_first_token_and_their_decode_until_their_end():
    """``Router.track``: a cloud turn's predicted cloud compute counts in what later turns queue
    behind until its first token (or its end), once; its expected decode counts in
    ``cloud_decode_ms`` (the longest remaining, at the cloud's decode time per token) until its end,
    whole while it prefills, counted down from its first token; a remote-prefill turn's decode no
    longer counts once it left the cloud."""
    from tandem.edge.routing.occupancy import Occupancy
    from tandem.edge.routing.router import Decision

    m = model()
    router = _router(m)
    lk = link()
    direct = m.predict(Route(DIRECT), RequestShape(100), lk)  # its cloud stage: 100 x 0.5 ms
    occ = Occupancy(0.0, 0.0, cloud_tokens=11, decode_ms_per_token=20.0)  # 10 tokens after the first
    with router.track(Decision(Route(DIRECT), direct, "test", occ)) as first:
        with router.track(Decision(Route(DIRECT), direct, "test")) as second:
            assert router.cloud_prefill_ms == pytest.approx(100.0) and router.cloud_inflight == 2
            assert router.cloud_decode_ms() == pytest.approx(200.0)  # before its first token: all 10 x 20 ms to come
            time.sleep(0.02)
            assert router.cloud_decode_ms() == pytest.approx(200.0)  # and not counted down while it prefills
            first.first_token()
            first.first_token()  # a second call does nothing
            assert router.cloud_prefill_ms == pytest.approx(50.0)
            assert 150.0 < router.cloud_decode_ms() <= 200.0  # 10 x 20 ms, less the time since
        assert router.cloud_prefill_ms == 0.0  # ended before its first token: its prefill no longer counts
        second.first_token()  # after its end: nothing
        assert router.cloud_prefill_ms == 0.0 and router.cloud_inflight == 1
    assert router.cloud_decode_ms() == 0.0 and router.cloud_prefill_ms == 0.0 and router.cloud_inflight == 0
    with router.track(Decision(Route(LOCAL), None, "no prediction")):
        assert router.cloud_prefill_ms == 0.0 and router.cloud_inflight == 0 and len(router.inflight) == 1
    rp = Decision(Route(Mode.REMOTE_PREFILL), direct, "test", occ)
    with router.track(rp) as turn:
        turn.first_token()
        assert router.cloud_decode_ms() > 0 and router.cloud_inflight == 1
        turn.left_cloud()  # the edge decodes on: the cloud no longer holds it
        assert router.cloud_decode_ms() == 0.0 and router.cloud_inflight == 0 and len(router.inflight) == 1
    assert len(router.inflight) == 0


async def test_a_routed_turn_ends_once_however_its_block_ends():
    """Whatever ends a turn's block (its last event, an error, a cancel of the task running it, a
    consumer that stops reading its events), the router counts it no longer, and ending twice does
    not count it out twice; the counts per route follow the turns running."""
    import asyncio

    from tandem.edge.routing.router import Decision

    m = model()
    router = _router(m)
    direct = m.predict(Route(DIRECT), RequestShape(100), link())

    async def events(started: asyncio.Event | None = None):
        with router.track(Decision(Route(DIRECT), direct, "test")) as turn:
            for i in range(3):
                yield i
                turn.first_token()
                if started is not None:
                    started.set()
                    await asyncio.sleep(3600)

    assert [i async for i in events()] == [0, 1, 2] and router.cloud_inflight == 0
    with pytest.raises(RuntimeError), router.track(Decision(Route(SPLIT, 4), direct, "test")):
        assert router.inflight.by_route() == {Route(SPLIT, 4): 1}
        raise RuntimeError("the cloud failed")
    assert router.cloud_inflight == 0 and not router.inflight.by_route()
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in events(started):
            pass

    task = asyncio.create_task(consume())
    await started.wait()
    assert router.cloud_inflight == 1 and router.cloud_decode_ms() == 0.0  # no expected output predicted
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert router.cloud_inflight == 0
    gen = events()
    assert await anext(gen) == 0 and router.cloud_inflight == 1
    await gen.aclose()  # the consumer stopped reading
    assert router.cloud_inflight == 0
    with router.track(Decision(Route(DIRECT), direct, "test")) as turn:
        turn.end()
        turn.end()
        with router.track(Decision(Route(DIRECT), direct, "test")):
            assert router.cloud_inflight == 1
    assert router.cloud_inflight == 0 and len(router.inflight) == 0


def test_the_router_hears_each_turns_outcome_once_and_decides_without_writing_into_the_cost_model():
    """A routed turn's ``TurnDone`` calibrates the cost model once (a second report, or a resumed
    leg's, does not); ``decide`` passes the edge's queues to each prediction (``Router.load``) and
    leaves the cost model's state as it was."""
    from tandem.common.protocol.params import Sampling
    from tandem.edge.events import ChatTurn, TurnDone
    from tandem.edge.routing.router import Decision, Router
    from tandem.edge.session import EdgeSessions

    m = model()

    class Local:  # what the router reads of a local engine: its rates and its queue
        prefill_rate, decode_rate = m.edge.local_prefill_ms_per_token, m.edge.local_decode_ms_per_token
        active, pending_prefill_tokens, pending_prefills = 3, 500, 1

        def cached_tokens(self, session_id, ids):
            return 0

    router = Router([4], None, EdgeSessions(8, 1 << 20), m, local=Local())  # type: ignore[arg-type]
    assert router.load() == EdgeLoad(3, 500, 1, {})
    before = vars(m.edge).copy()
    request = ChatTurn(
        messages=(("user", "hi"),), prompt="", session_id="", sampling=Sampling(max_new_tokens=4), mode=LOCAL
    )
    d = router.decide(request, list(range(10)))
    assert d.prediction is not None
    lk = router.link_state()
    assert d.prediction.ttft_ms == pytest.approx(m.predict(Route(LOCAL), RequestShape(10), lk, router.load()).ttft_ms)
    assert d.prediction.ttft_ms > m.predict(Route(LOCAL), RequestShape(10), lk).ttft_ms  # the queue counted
    assert vars(m.edge) == before
    done = TurnDone(
        finish_reason="stop",
        prompt_tokens=10,
        output_tokens=4,
        head_tokens=0,
        external_tokens=0,
        split_layer=0,
        timings={Stage.LOCAL_PREFILL: 20.0},
        sent_bytes=None,
        output_token_ids=(),
        mode=LOCAL,
        ttft_ms=1500.0,
    )
    with router.track(d) as turn:
        turn.finished(done)
        turn.finished(done)
    assert m.lines[LineKey(LineKind.LOCAL)].samples == 1
    with router.track(d) as turn:
        turn.finished(done, resumed=True)
    with router.track(Decision(Route(LOCAL), None, "no prediction")) as turn:
        turn.finished(done)
    assert m.lines[LineKey(LineKind.LOCAL)].samples == 1


def test_a_cloud_prefill_beside_this_edges_decodes_learns_how_much_they_slow_it():
    """``s_dec = alpha_dec * min(p, W_dec)``: from the prior 0.5, alpha_dec follows what the cloud
    stages measured beside decodes took beyond their lines: all of the bound (cores shared), or none
    (a GPU batching the decode steps beside the prefill)."""
    for truth in (1.0, 0.0):
        m, lk = model(), link()
        for n in (64, 256, 1024, 100, 700):  # the lines first, on a quiet cloud
            p = m.predict(Route(DIRECT), RequestShape(n), lk)
            m.observe(p, 20 + n * 0.0005 + 30 + 0.8 * n, {Stage.CLOUD_DECODE_FIRST_TOKEN: 30 + 0.8 * n})
        quiet = m.predict(Route(DIRECT), RequestShape(256), lk).ttft_ms
        busy = link(own_cloud_decode_ms=1000.0)
        p = m.predict(Route(DIRECT), RequestShape(256), busy)
        assert p.ttft_ms == pytest.approx(quiet + 0.5 * (30 + 0.8 * 256), rel=1e-3)
        for _ in range(30):
            p = m.predict(Route(DIRECT), RequestShape(256), busy)
            stage = (30 + 0.8 * 256) * (1 + truth)
            m.observe(p, 20 + 256 * 0.0005 + stage, {Stage.CLOUD_DECODE_FIRST_TOKEN: stage})
        assert m.alpha_dec == pytest.approx(truth, abs=0.01)
        assert m.predict(Route(DIRECT), RequestShape(256), busy).ttft_ms == pytest.approx(
            quiet + truth * (30 + 0.8 * 256), rel=0.03
        )


def test_a_decode_overlap_sample_is_taken_against_the_fraction_its_prediction_used():
    """Requests observed out of order: a prediction made while ``alpha_dec`` was the prior, observed
    after others moved it, still yields the true fraction (its ``within`` held the prior's share)."""
    m, lk = model(), link()
    for n in (64, 256, 1024, 100, 700):
        p = m.predict(Route(DIRECT), RequestShape(n), lk)
        m.observe(p, 20 + n * 0.0005 + 30 + 0.8 * n, {Stage.CLOUD_DECODE_FIRST_TOKEN: 30 + 0.8 * n})
    busy = link(own_cloud_decode_ms=1000.0)
    stage = (30 + 0.8 * 256) * 1.5  # half the bound: the truth is 0.5, the prior
    early = m.predict(Route(DIRECT), RequestShape(256), busy)
    assert early.alpha_dec == pytest.approx(0.5)
    later = m.predict(Route(DIRECT), RequestShape(256), busy)
    m.observe(later, 20 + stage, {Stage.CLOUD_DECODE_FIRST_TOKEN: (30 + 0.8 * 256) * 2.0})  # one sample of 1.0
    moved = m.alpha_dec
    assert moved > 0.55
    m.observe(early, 20 + stage, {Stage.CLOUD_DECODE_FIRST_TOKEN: stage})
    assert m.alpha_dec == pytest.approx(moved + 0.2 * (0.5 - moved), abs=1e-6)  # a sample of 0.5 exactly


def test_a_weighted_sample_moves_the_average_as_that_many_samples():
    from tandem.common.runtime.ewma import ALPHA, Ewma

    one, many = Ewma(), Ewma()
    for e in (one, many):
        e.add(10.0)
    for _ in range(4):
        one.add(2.0)
    many.add(2.0, weight=4)
    assert many.value == pytest.approx(one.value) and many.value == pytest.approx(2 + 8 * (1 - ALPHA) ** 4)
    light = Ewma()
    light.add(10.0)
    light.add(0.0, weight=1 / 16)  # one token gap of a 2-token turn, in tokens of 16
    assert light.value > 9.8
    for bad in (float("nan"), 0.0, -1.0):
        light.add(1.0, weight=bad)
    assert light.samples == 2


def test_a_light_first_sample_does_not_outweigh_a_heavy_second():
    """A first sample of little weight (one token gap of a 2-token turn, a burst near 0 ms) is not
    the average's whole: a heavier sample after it weighs by the weights seen, as samples of weight
    1 after a first one would."""
    from tandem.common.runtime.ewma import Ewma

    e = Ewma()
    e.add(0.01, weight=1 / 16)
    e.add(10.0, weight=39 / 16)  # a 40-token turn
    assert e.value == pytest.approx((0.01 / 16 + 10.0 * 39 / 16) / (40 / 16)), e.value
    unit = Ewma()  # unit weights: the first sample, then alpha per sample
    unit.add(4.0)
    unit.add(2.0)
    assert unit.value == pytest.approx(0.8 * 4.0 + 0.2 * 2.0)
