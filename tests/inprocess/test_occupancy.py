"""The cost model beyond TTFT (``edge.routing.occupancy``): each route's end-to-end time and cloud engine
time, remote prefill's handover, the auto choice under cloud pressure or a declared cloud budget
and for a client that uses the reply only whole, and the calibration and prediction errors of
served turns."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tandem.common.protocol.modes import Mode
from tandem.edge import metrics
from tandem.edge.routing.costmodel import CostModel, LinkState, RequestShape, Route
from tandem.edge.routing.occupancy import (
    Occupancy,
    OccupancyModel,
    PromptKV,
    lightest,
    prompt_kv_plan,
    quickest,
    under_pressure,
)
from tandem.stages import Stage

LOCAL, SPLIT, DIRECT, RP = Route(Mode.LOCAL), Route(Mode.SPLIT, 4), Route(Mode.DIRECT), Route(Mode.REMOTE_PREFILL)
BLOCK = 737_280  # a whole-model fp16 block of SmolLM2 (30 layers, 3 KV heads, B = 32, D = 64)


def model(local_decode_ms: float = 20.0) -> CostModel:
    m = CostModel(hysteresis=0.0, explore_every=0)
    m.edge.local_prefill_ms_per_token.add(2.0)
    m.edge.local_decode_ms_per_token.add(local_decode_ms)
    m.edge.head(4).add(0.3)
    return m


def link(**kw) -> LinkState:
    base = dict(
        rtt_ms=20.0,
        goodput_mbps=800.0,  # 100 bytes per microsecond
        cloud_prefill_ms_per_token=0.5,
        cloud_tail_prefill_ms_per_token={4: 0.4},
        bytes_per_token={4: 8448.0},
        cloud_decode_ms_per_token=30.0,
        full_kv_block_bytes=BLOCK,
        ttft_slo_ms=1000.0,
        itl_slo_ms=200.0,
    )
    return LinkState(**{**base, **kw})


def test_remote_prefill_has_directs_ttft_and_hands_the_decode_over():
    """1024-token prompt, 256 new tokens: the handover comes after the 32 blocks' download (236 ms at
    800 Mbit/s), the edge's run over the tokens meanwhile and a round trip; the cloud decodes until
    then, the edge the rest at its own rate."""
    m, lk, occ = model(), link(), OccupancyModel(prompt_kv=PromptKV.DOWNLOAD)
    shape = RequestShape(1024)
    rp, direct = m.predict(RP, shape, lk), m.predict(DIRECT, shape, lk)
    assert rp.ttft_ms == pytest.approx(direct.ttft_ms)
    o_rp, o_d = occ.predict(rp, shape, lk, m, 256), occ.predict(direct, shape, lk, m, 256)
    wire = 32 * BLOCK * 8 / (800 * 1e3)
    h = occ.handover_ms(shape, lk, m, 30.0, rp.ttft_ms)
    assert wire < h < wire + 20 + 2.0 * (wire / 30 + 2) + 1e-6
    m_tokens = 1 + h / 30.0
    assert o_rp.cloud_tokens == pytest.approx(m_tokens)
    assert o_rp.e2e_ms == pytest.approx(rp.ttft_ms + h + (256 - m_tokens) * 20.0)
    assert o_d.e2e_ms == pytest.approx(direct.ttft_ms + 255 * 30.0)
    assert o_rp.cloud_ms < o_d.cloud_ms / 10  # the cloud is free after about 10 tokens, not 256


def test_remote_prefill_is_direct_when_the_cloud_finishes_before_the_handover():
    m, lk, occ = model(), link(goodput_mbps=10.0), OccupancyModel(prompt_kv=PromptKV.DOWNLOAD)  # 19 s for 32 blocks
    shape = RequestShape(1024)
    o_rp = occ.predict(m.predict(RP, shape, lk), shape, lk, m, 64)
    o_d = occ.predict(m.predict(DIRECT, shape, lk), shape, lk, m, 64)
    assert (o_rp.e2e_ms, o_rp.cloud_ms, o_rp.cloud_tokens) == pytest.approx((o_d.e2e_ms, o_d.cloud_ms, 64))


def test_what_the_edge_holds_does_not_come_down_again():
    m, lk = model(), link(rtt_ms=1.0)  # the catch-up runs never fit in the RTT
    occ = OccupancyModel(prompt_kv=PromptKV.DOWNLOAD)
    cold = occ.handover_ms(RequestShape(1024), lk, m, 30.0, 600.0)
    warm = occ.handover_ms(RequestShape(1024, local_cached_tokens=960), lk, m, 30.0, 600.0)
    wire = 30 * BLOCK * 8 / (800 * 1e3)
    assert wire < cold - warm < wire + 2.0 * wire / 30.0 + 1e-6  # and the edge's run over fewer tokens meanwhile


@pytest.mark.parametrize("prefill_ms_per_token", [0.1, 2.0])
def test_a_catch_up_run_within_the_rtt_does_not_lengthen_the_handover(prefill_ms_per_token):
    """The handover's catch-up run (the partial block and the cloud's ~9 tokens meanwhile, 1024
    prompt tokens, RTT 20 ms): at 0.1 ms a token it fits in the takeover's round trip, which the
    takeover goes up before it (``takeover_first``), so the handover is the download and the round
    trip alone; at 2 ms a token (about 20 ms) it fits too; on a link of 5 ms it does not, and the run
    adds to the handover."""
    m = CostModel(hysteresis=0.0, explore_every=0)
    m.edge.local_prefill_ms_per_token.add(prefill_ms_per_token)
    occ, shape = OccupancyModel(prompt_kv=PromptKV.DOWNLOAD), RequestShape(1024)
    wire = 32 * BLOCK * 8 / (800 * 1e3)
    assert occ.handover_ms(shape, link(), m, 30.0, 600.0) == pytest.approx(wire + 20.0)
    slow_link = occ.handover_ms(shape, link(rtt_ms=5.0), m, 30.0, 600.0)
    if prefill_ms_per_token * (wire / 30.0 + 1) <= 5.0:
        assert slow_link == pytest.approx(wire + 5.0)
    else:
        assert slow_link > wire + 5.0 + prefill_ms_per_token * wire / 30.0


@pytest.mark.parametrize("edge_decode_ms", [20.0, 50.0])
def test_under_pressure_or_a_budget_auto_holds_the_cloud_least_within_the_objectives(edge_decode_ms):
    """Under pressure: the route within the TTFT objective that holds the cloud least: local when
    its TTFT is within it, else remote prefill; a budget takes the fastest route within it. An edge
    that decodes slower than the inter-token objective takes no decode over."""
    m, occ = model(edge_decode_ms), OccupancyModel()
    calm, busy = link(), link(cloud_waiting=1)
    assert not under_pressure(calm) and not under_pressure(link(cloud_busy=True))  # this edge's own share: no
    assert under_pressure(busy) and under_pressure(link(kv_cache_usage=0.95))

    def choice(T: int, lk: LinkState, budget_ms: float = 0.0):
        shape = RequestShape(T)
        preds = [m.predict(r, shape, lk) for r in (LOCAL, SPLIT, DIRECT, RP)]
        o = {p.route: occ.predict(p, shape, lk, m, 128) for p in preds}
        return lightest(preds, o, lk, budget_ms)

    if edge_decode_ms > 40.0:  # outside the 40 ms objective: only the cloud decodes
        strict = link(cloud_waiting=1, itl_slo_ms=40.0)
        assert choice(256, strict)[0].route == choice(1024, strict)[0].route == SPLIT  # less cloud time than direct
        return
    assert choice(256, busy)[0].route == LOCAL  # 512 ms locally: within 1 s, no cloud time
    assert choice(1024, busy)[0].route == RP  # 2 s locally: outside; remote prefill holds the cloud least
    pick, why = choice(1024, calm, budget_ms=2000.0)
    assert pick.route == RP and "budget" in why  # direct's 4.3 s of engine time is over the budget
    pick, _ = choice(1024, calm, budget_ms=60_000.0)
    assert pick.route == DIRECT  # everything is within it: the fastest


def test_a_whole_reply_takes_the_route_that_finishes_first():
    """For a client that uses the reply only whole the first token is not the end: a cloud that
    decodes 10x faster than the edge serves a 256-token reply though the edge's first token comes
    first (128 ms locally against a 200 ms round trip); for a one-token reply the two coincide."""
    m, lk, occ = model(local_decode_ms=20.0), link(cloud_decode_ms_per_token=2.0, rtt_ms=200.0), OccupancyModel()
    shape = RequestShape(64)
    preds = [m.predict(r, shape, lk) for r in (LOCAL, SPLIT, DIRECT, RP)]
    assert min(preds, key=lambda p: p.ttft_ms).route == LOCAL

    def pick(max_new_tokens: int):
        expected = occ.expected_output(max_new_tokens)
        return quickest(preds, {p.route: occ.predict(p, shape, lk, m, max_new_tokens) for p in preds}, expected)

    route, why = pick(256)
    assert route.route == DIRECT and "end-to-end" in why  # 255 x 2 ms against 255 x 20 ms of decode
    # the reason names the quickest routes' predictions, the pick first, then what they assume
    named, assumed = why.split("(", 1)[1].rstrip(")").split("; ")
    named = named.split(", ")
    assert named[0].startswith("direct ") and any(n.startswith("local ") for n in named), why
    assert assumed == "256 tokens at local 20.00, cloud 2.00 ms/token", why
    assert pick(1)[0].route == LOCAL
    with pytest.raises(ValueError):
        quickest([], {})


def test_a_cloud_that_has_decoded_nothing_yet_is_predicted_at_the_edges_decode_rate():
    """A cloud reports its decode time per token 0 until it has decoded a turn. Its routes' end to
    end and cloud time then count the decode at the edge's rate (the same model's), not as free: a
    256-token whole reply goes to the route with the earlier first token (local, 128 ms against a
    200 ms round trip), as it would where the cloud decodes no faster than the edge."""
    m, lk, occ = model(local_decode_ms=20.0), link(cloud_decode_ms_per_token=0.0, rtt_ms=200.0), OccupancyModel()
    shape = RequestShape(64)
    preds = [m.predict(r, shape, lk) for r in (LOCAL, SPLIT, DIRECT, RP)]
    o = {p.route: occ.predict(p, shape, lk, m, 256) for p in preds}
    for p in preds:
        if p.route.mode is Mode.LOCAL:
            continue
        assert o[p.route].e2e_ms >= p.ttft_ms + 255 * 20.0 - 1e-6, (p.route, o[p.route])
        assert o[p.route].cloud_ms > 0.0
    assert o[DIRECT].cloud_ms == pytest.approx(m.cloud_stages_ms(preds[2].stages) + 255 * 20.0)
    pick, why = quickest(preds, o)
    assert pick.route == LOCAL, why
    measured = link(cloud_decode_ms_per_token=2.0, rtt_ms=200.0)  # once measured, the cloud's own rate
    d = m.predict(DIRECT, shape, measured)
    assert occ.predict(d, shape, measured, m, 256).e2e_ms == pytest.approx(d.ttft_ms + 255 * 2.0)


async def test_auto_streams_from_the_edge_and_takes_the_faster_decoder_for_a_whole_reply():
    """The in-memory stack with an edge that prefills fast and decodes at 30 ms per token and a cloud
    that decodes at about 1 ms: a whole-reply turn goes to the cloud (lowest predicted end-to-end
    time), a streamed one to the edge (lowest predicted TTFT)."""
    from tandem.common.protocol.params import Sampling
    from tandem.edge.events import ChatTurn
    from tests.helpers import RP_LONG, stream
    from tests.remote_doubles import rp_stack

    toy = await rp_stack(step_delay_s=0.001, local_step_s=0.03)
    try:
        toy.edge.conn.load = replace(toy.edge.conn.load, decode_ms_per_token=1.0, prefill_ms_per_token=0.1)
        toy.edge.router.cost.explore_every = 0  # the choice itself, not the refresh of a near route
        turn = ChatTurn(
            messages=(("user", RP_LONG),),
            prompt="",
            session_id="",
            sampling=Sampling(max_new_tokens=24),
            whole_reply=True,
        )
        _, whole = await stream(toy.edge, turn)
        assert whole.mode is not Mode.LOCAL and "end-to-end" in whole.mode_reason, (whole.mode, whole.mode_reason)
        _, streamed = await stream(toy.edge, replace(turn, whole_reply=False))
        assert streamed.mode is Mode.LOCAL and "TTFT" in streamed.mode_reason, streamed.mode_reason
    finally:
        await toy.batcher.stop()


def test_served_turns_calibrate_and_report_their_errors():
    occ = OccupancyModel()
    before = _count("remote_prefill", "e2e"), _count("remote_prefill", "cloud_engine")
    timings = {
        Stage.TTFT: 100.0,
        Stage.CLOUD_KV_SAVE_WAIT: 10.0,
        Stage.KV_DOWNLINK: 210.0,
        Stage.TOTAL: 900.0,
        Stage.CLOUD_DECODE: 400.0,
    }
    occ.observe(Mode.REMOTE_PREFILL, Occupancy(1000.0, 300.0, 12, 20.0), timings, 40, 1_000_000)
    assert occ.output_tokens.value == 40 and occ.kv_save_wait_ms.value == 10.0
    assert occ.down_goodput_mbps.value == pytest.approx(1_000_000 * 8 / (100 * 1e3))  # 1 MB in 100 ms
    assert occ.expected_output(16) == 16 and occ.expected_output(64) == 40
    assert (_count("remote_prefill", "e2e"), _count("remote_prefill", "cloud_engine")) == (before[0] + 1, before[1] + 1)


def test_a_turn_that_brought_no_block_down_does_not_calibrate_the_wait_for_the_kv_writes():
    """A remote-prefill turn whose edge computed the whole prompt asked for no block: the cloud
    reports a save wait of 0 for it, which says nothing of the wait a download meets; a turn whose
    blocks never landed (a wait, no bytes) still counts."""
    occ, o = OccupancyModel(), Occupancy(1000.0, 300.0, 12, 20.0)
    occ.observe(Mode.REMOTE_PREFILL, o, {Stage.CLOUD_KV_SAVE_WAIT: 10.0, Stage.TOTAL: 900.0}, 40, 1_000_000)
    for _ in range(5):
        occ.observe(Mode.REMOTE_PREFILL, o, {Stage.CLOUD_KV_SAVE_WAIT: 0.0, Stage.TOTAL: 900.0}, 40, 0)
    assert occ.kv_save_wait_ms.value == 10.0
    occ.observe(Mode.REMOTE_PREFILL, o, {Stage.CLOUD_KV_SAVE_WAIT: 30.0, Stage.TOTAL: 900.0}, 40, 0)
    assert occ.kv_save_wait_ms.value > 10.0


async def test_remote_prefills_plan_counts_blocks_of_the_links_size_on_an_edge_without_heads():
    """An edge that holds no split head (a direct manifest beside its whole model) still plans
    remote prefill's prompt KV in the blocks the link moves (the direct params' block size), so the
    boundary the router plans is the one the turn asks the cloud for."""
    from tests.remote_doubles import rp_stack

    toy = await rp_stack()
    try:
        router, conn = toy.edge.router, toy.edge.conn
        params = conn.negotiated.params_by_split
        params[0] = replace(params[0], kv_block_size_tokens=16)
        router.head_layers = frozenset()
        assert router.link_state().block_size_tokens == 16
    finally:
        await toy.batcher.stop()


def test_a_split_counts_its_hand_off_into_the_decode_engine_as_cloud_time():
    """The decode engine loads every layer's KV of a split turn before its first step: measured per
    prompt token on split turns, added to the split's cloud time; with it a split at 1024 tokens holds
    the cloud longer than direct here (0.4 ms tail + 0.3 ms hand-off per token against 0.5 ms)."""
    m, lk, occ = model(), link(cloud_waiting=1), OccupancyModel()
    shape = RequestShape(1024)
    split, direct = m.predict(SPLIT, shape, lk), m.predict(DIRECT, shape, lk)
    before = occ.predict(split, shape, lk, m, 128).cloud_ms
    assert before < occ.predict(direct, shape, lk, m, 128).cloud_ms  # uncalibrated: the tail alone
    occ.observe(Mode.SPLIT, Occupancy(1.0, 1.0, 1, 30.0), {Stage.CLOUD_DECODE_FIRST_TOKEN: 300.0}, 0, 0, 1000)
    occ.observe(Mode.DIRECT, Occupancy(1.0, 1.0, 1, 30.0), {Stage.CLOUD_DECODE_FIRST_TOKEN: 900.0}, 0, 0, 1000)
    assert occ.split_handoff_ms_per_token.value == pytest.approx(0.3)  # split turns only
    after = occ.predict(split, shape, lk, m, 128).cloud_ms
    assert after == pytest.approx(before + 1024 * 0.3)
    assert after > occ.predict(direct, shape, lk, m, 128).cloud_ms
    preds = [m.predict(r, shape, lk) for r in (SPLIT, DIRECT)]
    pick, _ = lightest(preds, {p.route: occ.predict(p, shape, lk, m, 128) for p in preds}, lk, 0.0)
    assert pick.route == DIRECT  # under pressure the lighter of the two is direct


def _count(mode: str, quantity: str) -> float:
    for family in metrics.OTHER_PREDICTION_ERROR.collect():
        for sample in family.samples:
            if sample.name.endswith("_count") and sample.labels == {"mode": mode, "quantity": quantity}:
                return sample.value
    return 0.0


async def test_an_auto_turn_under_a_cloud_budget_takes_remote_prefill_and_reports_its_errors():
    """The in-memory stack with a budget no cloud-decoded reply keeps and a local model too slow for
    the TTFT objective: auto serves the turn in remote prefill, and its end-to-end and cloud-time
    predictions are compared with what it measured."""
    from tandem.common.protocol.params import Sampling
    from tandem.edge.events import ChatTurn
    from tests.helpers import RP_LONG, stream
    from tests.remote_doubles import rp_stack

    toy = await rp_stack(step_delay_s=0.02)
    try:
        r = toy.edge.router
        r.cloud_budget_ms = 200.0
        for _ in range(20):  # about 240 ms for the prompt here: outside 1.5x direct's TTFT
            toy.edge.local.prefill_rate.add(1.0)
        toy.edge.conn.load = replace(toy.edge.conn.load, decode_ms_per_token=20.0, prefill_ms_per_token=0.1)
        before = _count("remote_prefill", "cloud_engine")
        _, done = await stream(
            toy.edge,
            ChatTurn(messages=(("user", RP_LONG),), prompt="", session_id="", sampling=Sampling(max_new_tokens=40)),
        )
        assert done.mode is Mode.REMOTE_PREFILL and "budget" in done.mode_reason and done.edge_decoded_tokens > 0
        assert _count("remote_prefill", "cloud_engine") == before + 1
    finally:
        await toy.batcher.stop()


def _runs(ms_per_token: float, fixed_ms: float = 0.0):
    import numpy as np

    return lambda n: np.where(np.asarray(n) > 0, fixed_ms + ms_per_token * np.asarray(n, np.float64), 0.0)


def test_an_edge_that_prefills_before_the_first_token_downloads_no_block():
    """1024 prompt tokens, B = 32: a GPU edge (20 ms for the prompt) against a first token at 40 ms
    computes the whole prompt beside the cloud's prefill and holds it by then: nothing to wait for."""
    plan = prompt_kv_plan(1024, 0, 32, 40.0, _runs(0.02), 5.0, 7.4)
    assert (plan.first_down_block, plan.down_blocks, plan.compute_to_tokens, plan.edge_tokens) == (32, 0, 1024, 1024)
    assert plan.ready_ms == 0.0


def test_a_slow_edge_computes_the_front_and_downloads_the_rest():
    """2 ms a token on the edge, 7.4 ms a block on the downlink, first token at 532 ms: the edge's run
    and the download meet in the middle (Cake's split), earlier than either alone."""
    T, B, F, w, blk = 1024, 32, 532.0, 5.0, 7.4
    runs = _runs(2.0)
    plan = prompt_kv_plan(T, 0, B, F, runs, w, blk)
    down_only = prompt_kv_plan(T, 0, B, F, runs, w, blk, PromptKV.DOWNLOAD)
    here_only = prompt_kv_plan(T, 0, B, F, runs, w, blk, PromptKV.COMPUTE)
    assert 0 < plan.first_down_block < T // B and plan.down_blocks == T // B - plan.first_down_block
    assert plan.compute_to_tokens == plan.first_down_block * B
    assert plan.ready_ms < min(down_only.ready_ms, here_only.ready_ms)
    # the two halves finish within one block of each other
    edge_done = 2.0 * plan.edge_tokens - F
    assert abs(edge_done - (w + plan.down_blocks * blk)) <= max(2.0 * B, blk)
    assert (down_only.first_down_block, down_only.down_blocks, down_only.edge_tokens) == (0, 32, 0)
    assert down_only.ready_ms == pytest.approx(w + 32 * blk)
    assert (here_only.down_blocks, here_only.compute_to_tokens) == (0, T)
    assert here_only.ready_ms == pytest.approx(2.0 * T - F)


def test_the_plan_starts_at_what_the_session_holds():
    """A session holding 960 of 1000 tokens (30 blocks of 32; the prompt has 31 full ones): no
    block it holds comes down and the edge never recomputes them; with every full block held, the
    edge runs the partial last one up front."""
    for policy in PromptKV:
        plan = prompt_kv_plan(1000, 960, 32, 40.0, _runs(2.0), 5.0, 7.4, policy)
        assert plan.first_down_block >= 30 and plan.first_down_block + plan.down_blocks == 31
        assert plan.compute_to_tokens in (960, 1000) and plan.held_tokens == 960
    held_all = prompt_kv_plan(1000, 992, 32, 40.0, _runs(2.0), 5.0, 7.4, PromptKV.DOWNLOAD)
    assert (held_all.down_blocks, held_all.compute_to_tokens, held_all.edge_tokens) == (0, 1000, 8)
    short = prompt_kv_plan(20, 0, 32, 40.0, _runs(2.0), 5.0, 7.4, PromptKV.DOWNLOAD)  # shorter than a block
    assert (short.down_blocks, short.compute_to_tokens) == (0, 20)


def test_a_gpu_edge_that_holds_the_prompt_first_takes_over_for_the_first_token():
    """The prompt computed here (20 ms for 1024 tokens) before the first token: the takeover goes up
    then, for that token, and the cloud stops right after it (no handover time past it, one token
    from the cloud) however long the prompt, where downloading its 32 blocks takes longer than the
    reply; a first token sooner than the edge's run plus a round trip leaves the difference."""
    m = CostModel(hysteresis=0.0, explore_every=0)
    m.edge.local_prefill_ms_per_token.add(0.02)
    m.edge.local_decode_ms_per_token.add(1.3)
    lk, shape = link(rtt_ms=6.0, cloud_decode_ms_per_token=1.5, goodput_mbps=500.0), RequestShape(1024)
    rp = m.predict(RP, shape, lk)
    assert rp.ttft_ms > 20.48 + 6.0
    auto, down = OccupancyModel(), OccupancyModel(prompt_kv=PromptKV.DOWNLOAD)
    assert auto.kv_plan(shape, lk, m, rp.ttft_ms).down_blocks == 0
    assert auto.handover_ms(shape, lk, m, 1.5, rp.ttft_ms) == 0.0
    assert auto.handover_ms(shape, lk, m, 1.5, 22.48) == pytest.approx(20.48 + 6.0 - 22.48)
    o_auto, o_down = auto.predict(rp, shape, lk, m, 128), down.predict(rp, shape, lk, m, 128)
    assert o_auto.cloud_tokens == pytest.approx(1.0)
    assert o_auto.cloud_ms == pytest.approx(m.cloud_stages_ms(rp.stages))
    # 24 MB down at 500 Mbit/s (377 ms) outlasts the cloud's 128 tokens: it decodes them all
    assert o_down.cloud_tokens == 128 and o_down.cloud_ms == pytest.approx(o_auto.cloud_ms + 127 * 1.5)


def test_whole_replies_are_predicted_at_the_time_per_token_the_clients_saw():
    """The local engine's decode-step rate says 4.4 ms a token and the cloud reports 2.4, but local
    turns' clients saw 1.5 ms a token and direct turns' 2.6: once both kinds were served, a 128-token
    whole reply is predicted at what the clients saw and goes to the edge."""
    m, lk, occ = model(local_decode_ms=4.4), link(cloud_decode_ms_per_token=2.4, rtt_ms=6.0), OccupancyModel()
    shape = RequestShape(64)
    preds = [m.predict(r, shape, lk) for r in (LOCAL, DIRECT)]
    assert occ.edge_ms_per_token(m) == 4.4 and occ.cloud_ms_per_token(lk, m) == 2.4  # nothing served yet
    for mode, per_token in ((Mode.LOCAL, 1.5), (Mode.DIRECT, 2.6), (Mode.SPLIT, 2.6)):
        timings = {Stage.TTFT: 20.0, Stage.TOTAL: 20.0 + 127 * per_token}
        occ.observe(mode, Occupancy(1.0, 1.0, 1, 1.0), timings, 128, 0)
    occ.observe(Mode.LOCAL, Occupancy(1.0, 1.0, 1, 1.0), {Stage.TTFT: 5.0, Stage.TOTAL: 9.0}, 1, 0)  # one token: no ITL
    assert occ.edge_ms_per_token(m) == pytest.approx(1.5) and occ.cloud_ms_per_token(lk, m) == pytest.approx(2.6)
    o = {p.route: occ.predict(p, shape, lk, m, 128) for p in preds}
    assert o[LOCAL].decode_ms_per_token == pytest.approx(1.5) and o[DIRECT].decode_ms_per_token == pytest.approx(2.6)
    assert quickest(preds, o, 128)[0].route == LOCAL


def test_a_busy_local_engine_moves_the_plan_toward_the_download():
    """The edge's own run waits for the local engine's queue first: 500 ms of other turns' work
    makes a prompt the idle edge computes all of (20 ms, first token at 40 ms) come down instead."""
    idle = prompt_kv_plan(1024, 0, 32, 40.0, _runs(0.02), 5.0, 7.4)
    busy = prompt_kv_plan(1024, 0, 32, 40.0, _runs(0.02), 5.0, 7.4, queue_ms=500.0)
    assert idle.down_blocks == 0 and busy.down_blocks == 32 and busy.edge_tokens == 0
