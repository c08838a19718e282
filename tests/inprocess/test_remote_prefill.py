"""Remote prefill on the in-memory stack: the cloud prefills and streams the first tokens, the
prompt's whole-model KV comes down verified, the edge takes the decode over. The cloud's decode
and the edge's whole model are one toy model (``tests.remote_doubles``) whose tokens depend on
every K and V of the context, so equal tokens mean the KV that came down is the cloud's."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from tandem.common.protocol.modes import Mode
from tandem.common.wire import chunks as wire
from tandem.common.wire.kvdown import Takeover
from tandem.edge.events import ChatTurn, TurnDone
from tandem.edge.routing.occupancy import takeover_first
from tandem.stages import Stage
from tests.doubles import B
from tests.helpers import RP_LONG, rp_chat, rp_turn, stream
from tests.remote_doubles import DownTamperLink, rp_stack


@pytest.fixture(
    params=[(wire.WireDtype.FP32, "download"), (wire.WireDtype.FP16, "download"), (wire.WireDtype.FP32, "compute")],
    ids=["fp32", "fp16", "computed-here"],
)
async def toy(request):
    kv, prompt_kv = request.param
    t = await rp_stack(kv_wire_dtypes=[kv], offer_kw={"kv_wire_dtypes": (kv,)}, prompt_kv=prompt_kv)
    t.prompt_kv = prompt_kv
    yield t
    await t.batcher.stop()


@pytest.mark.parametrize("text", ["hi", "what is the capital of France?", RP_LONG], ids=["short", "two-blocks", "long"])
async def test_remote_prefill_equals_direct_and_local_token_for_token(toy, text):
    """Greedy: the tokens streamed in remote prefill (the cloud's first ones, then the edge's after
    the takeover) equal direct mode's and local mode's, none repeated or missing; the edge decoded
    some of them itself and the cloud stopped early. Its prompt KV came down (``download``: every
    full block; the edge computed only the partial last block and the cloud's tokens, one run) or
    was computed here beside the cloud's prefill (``compute``: no block came down)."""
    direct, d_done = await stream(toy.edge, rp_turn(text, Mode.DIRECT))
    local, _ = await stream(toy.edge, rp_turn(text, Mode.LOCAL))
    runs = len(toy.edge.local.runs)
    got, done = await stream(toy.edge, rp_turn(text, Mode.REMOTE_PREFILL))
    assert got == direct == local == list(done.output_token_ids) and len(got) == 40
    assert done.mode is Mode.REMOTE_PREFILL and done.finish_reason == d_done.finish_reason == "length"
    T = len(toy.edge.tokenize(rp_turn(text, Mode.DIRECT)))
    downloaded = toy.prompt_kv == "download" and T >= B
    assert done.edge_decoded_tokens > 0 and (done.received_kv_bytes > 0) == downloaded
    assert (Stage.EDGE_PREFILL in done.timings) == (not downloaded)
    edge_runs = toy.edge.local.runs[runs:]
    cloud_tokens = 40 - done.edge_decoded_tokens
    prompt_here = T % B if downloaded else T
    assert sum(edge_runs) <= prompt_here + cloud_tokens + done.edge_decoded_tokens + 1, edge_runs
    assert toy.gateway.links.running == 0


async def test_the_edge_computes_the_prompts_front_while_the_rest_comes_down(monkeypatch):
    """A plan that splits the prompt (``auto`` on an edge whose prefill and the downlink meet in the
    middle): the edge runs the first block beside the cloud's prefill and only the blocks after it
    come down; the tokens are direct's."""
    from tandem.edge.routing.occupancy import PromptKVPlan

    toy = await rp_stack(prompt_kv="auto")
    try:
        direct, _ = await stream(toy.edge, rp_turn(RP_LONG, Mode.DIRECT))
        T = len(toy.edge.tokenize(rp_turn(RP_LONG, Mode.DIRECT)))
        assert T // B >= 3
        plan = PromptKVPlan(held_tokens=0, compute_to_tokens=B, first_down_block=1, down_blocks=T // B - 1)
        monkeypatch.setattr(toy.edge.router.occupancy, "kv_plan", lambda *a, **kw: plan)
        got, done = await stream(toy.edge, rp_turn(RP_LONG, Mode.REMOTE_PREFILL))
        assert got == direct and done.edge_decoded_tokens > 0
        assert done.received_kv_bytes == (T // B - 1) * block_bytes()
        assert done.timings[Stage.EDGE_PREFILL] > 0 and done.timings[Stage.KV_ADOPT] > 0
    finally:
        await toy.batcher.stop()


@pytest.mark.parametrize("rtt_ms", [0.0, 50.0], ids=["catch-up-first", "takeover-first"])
async def test_the_takeover_goes_up_before_the_catch_up_run_only_where_that_run_fits_in_the_rtt(rtt_ms):
    """The edge's catch-up run (the partial last block and the cloud's tokens so far, at 0.01 ms a
    token) against the link's RTT: within it, the takeover goes up as soon as the session holds the
    KV and the run follows; with no RTT measured, the run comes first. The tokens are direct's
    either way."""
    toy = await rp_stack()
    try:
        direct, _ = await stream(toy.edge, rp_turn(RP_LONG, Mode.DIRECT))
        if rtt_ms:
            toy.edge.conn.rtt_ms.add(rtt_ms)
        order: list[str] = []
        model = toy.edge.local.model
        forward = model.forward

        def watched(*a, **kw):
            order.append("run")
            return forward(*a, **kw)

        model.forward = watched

        def up(item):
            if isinstance(item, Takeover):
                order.append("takeover")
            return item

        toy.edge.conn.link = DownTamperLink(toy.edge.conn.link, up=up)
        got, done = await stream(toy.edge, rp_turn(RP_LONG, Mode.REMOTE_PREFILL))
        assert got == direct and done.edge_decoded_tokens > 0
        assert order[:2] == (["takeover", "run"] if rtt_ms else ["run", "takeover"]), order
        t = done.timings  # the handover's parts, for the benchmarks' records
        assert t[Stage.KV_DOWNLINK] <= t[Stage.TAKEOVER] <= t[Stage.HANDOVER] and t[Stage.CATCH_UP] > 0
        assert t[Stage.KV_ADOPT] > 0
    finally:
        await toy.batcher.stop()


def test_the_takeover_goes_first_where_the_predicted_catch_up_fits_in_the_rtt():
    assert takeover_first(4.0, 6.0) and takeover_first(6.0, 6.0) and not takeover_first(8.0, 6.0)
    assert not takeover_first(0.0, 6.0)  # no measured rate: the run comes first
    assert not takeover_first(0.1, 0.0)  # no measured RTT


async def test_a_cloud_that_finishes_before_the_kv_came_down_ends_the_turn_as_direct():
    """The engine's KV writes land after its 8 tokens: no KV comes down, the cloud decodes all."""
    toy = await rp_stack()
    toy.engines.save_delay_s = 1.0
    try:
        direct, _ = await stream(toy.edge, rp_turn(RP_LONG, Mode.DIRECT, n=8))
        got, done = await stream(toy.edge, rp_turn(RP_LONG, Mode.REMOTE_PREFILL, n=8))
        assert got == direct and done.edge_decoded_tokens == 0 and done.received_kv_bytes == 0
        assert done.mode is Mode.REMOTE_PREFILL and done.finish_reason == "length"
    finally:
        await toy.batcher.stop()


async def test_kv_blocks_go_down_as_the_engine_writes_them_not_after_the_last():
    """The engine's writes land one block every 40 ms: the first block is framed for the downlink
    before the last is in the store, the turn still equals direct, and the cloud's save wait is the
    time the downlink waited on the store."""
    import time

    toy = await rp_stack(step_delay_s=0.02)
    toy.engines.save_block_interval_s = 0.04
    put_s: dict[str, float] = {}
    framed_s: dict[int, float] = {}
    put, frame = toy.store.put, toy.gateway.remote._frame

    def timed_put(key, value):
        put_s.setdefault(key, time.perf_counter())
        return put(key, value)

    def timed_frame(turn, b, j):
        framed_s.setdefault(j, time.perf_counter())
        return frame(turn, b, j)

    toy.store.put, toy.gateway.remote._frame = timed_put, timed_frame
    try:
        direct, _ = await stream(toy.edge, rp_turn(RP_LONG, Mode.DIRECT, n=60))
        put_s.clear()
        got, done = await stream(toy.edge, rp_turn(RP_LONG, Mode.REMOTE_PREFILL, n=60))
        assert got == direct and done.edge_decoded_tokens > 0 and done.received_kv_bytes > 0
        assert len(framed_s) == len(put_s) >= 5
        assert framed_s[0] < max(put_s.values()), (framed_s, put_s)
        wait_ms = done.timings[Stage.CLOUD_KV_SAVE_WAIT]
        assert wait_ms >= 40 * (len(put_s) - 2), wait_ms
    finally:
        await toy.batcher.stop()


async def test_short_turns_barely_move_the_clouds_decode_rate():
    """The cloud's time per output token weighs each turn by its token gaps: 2-token turns whose one
    gap is a burst (no step delay, as vLLM's stream groups tokens) leave a 40-token turn's rate
    nearly whole, so a whole-reply choice is not tilted toward the cloud by them."""
    toy = await rp_stack(step_delay_s=0.01)
    try:
        await stream(toy.edge, rp_turn(RP_LONG, Mode.DIRECT, n=40))
        rate = toy.gateway.calls.rates.decode_ms_per_token
        long_ms = rate.value
        assert long_ms >= 8.0, long_ms
        toy.engines.step_delay_s = 0.0
        for _ in range(5):
            await stream(toy.edge, rp_turn("hi", Mode.DIRECT, n=2))
        assert rate.samples == 6 and rate.value >= 0.75 * long_ms, (rate.value, long_ms)
    finally:
        await toy.batcher.stop()


async def test_the_downlink_learns_every_block_that_landed_at_one_look():
    """``Pins.await_prefix``: the present keys from the first, in one look; 0 where the first does
    not land within the wait; the first landing late is waited for."""
    from tandem.cloud.store.blocks import MemoryBlockStore
    from tandem.cloud.turn import Background
    from tandem.cloud.uploads.pins import Pins

    store = MemoryBlockStore(1 << 20)
    pins = Pins(store, tail_save_wait_s=0.05, background=Background())
    for k in ("a", "b", "d"):
        store.put(k, b"x")
    assert await pins.await_prefix(["a", "b", "c", "d"], None) == 2
    assert await pins.await_prefix(["c", "d"], None) == 0  # c never lands: 50 ms, then nothing
    asyncio.get_running_loop().call_later(0.01, store.put, "c", b"x")
    assert await pins.await_prefix(["c", "d"], None) == 2
    assert await pins.await_prefix([], None) == 0


async def test_remote_prefill_over_grpc_equals_direct():
    """The same over real grpc.aio on loopback: the new uplink and downlink messages pass the
    servicer both ways, and the edge takes over."""
    from tandem.common.wire.kvdown import full_model_key
    from tests.doubles import MANIFEST
    from tests.helpers import Cloud, close_edge, edge_to
    from tests.remote_doubles import ToyLocal, toy_lm

    cloud = Cloud()
    await cloud.start()
    lm = toy_lm()
    cloud.engines.toy, cloud.engines.step_delay_s = lm, 0.005
    edge = await edge_to(f"127.0.0.1:{cloud.port}", local=ToyLocal(lm), model_key=full_model_key(MANIFEST))
    try:
        direct, _ = await stream(edge, rp_turn(RP_LONG, Mode.DIRECT))
        got, done = await stream(edge, rp_turn(RP_LONG, Mode.REMOTE_PREFILL))
        assert got == direct and done.edge_decoded_tokens > 0 and done.received_kv_bytes > 0
    finally:
        await close_edge(edge)
        await cloud.stop()


def block_bytes() -> int:
    from tests.doubles import MANIFEST

    sh = MANIFEST.shape
    return sh.num_layers * 2 * sh.num_kv_heads * B * sh.head_dim * 4  # fp32


def held_tokens(toy, first: TurnDone, second: ChatTurn) -> int:
    """What the edge's session holds of ``second``'s prompt after turn ``first``: the common prefix
    with turn 1's prompt and output but its last token (whose KV was never computed)."""
    held = toy.edge.tokenize(rp_chat(RP_LONG, session="")) + list(first.output_token_ids[:-1])
    ids, n = toy.edge.tokenize(second), 0
    while n < min(len(ids), len(held)) and ids[n] == held[n]:
        n += 1
    return n


async def two_turns(toy, session: str) -> tuple[ChatTurn, TurnDone, TurnDone]:
    """Turn 1 of ``session`` in remote prefill, then turn 2 (its answer and a new message)."""
    _, first = await stream(toy.edge, rp_chat(RP_LONG, session=session))
    answer = toy.edge.tok.decode(first.output_token_ids)
    second = rp_chat(RP_LONG, answer, "and then what happened to the fox in the woods?", session=session)
    _, done = await stream(toy.edge, second)
    return second, first, done


async def test_the_next_turn_brings_down_only_the_blocks_the_edge_lacks():
    """Turn 2: the edge holds turn 1's prompt and the tokens it decoded, so only the blocks past
    them come down; the cloud's prefill loaded turn 1's stored blocks and recomputed the answer's
    (the edge never uploads KV); the tokens equal a fresh session's and direct mode's."""
    toy = await rp_stack()
    try:
        second, first, done = await two_turns(toy, "s")
        held, T2 = held_tokens(toy, first, second), len(toy.edge.tokenize(second))
        assert done.received_kv_bytes == (T2 // B - held // B) * block_bytes() > 0
        T1 = len(toy.edge.tokenize(rp_chat(RP_LONG, session="")))
        assert done.edge_decoded_tokens > 0 and done.external_tokens == T1 // B * B > 0  # turn 1's stored blocks
        direct, _ = await stream(toy.edge, replace(second, mode=Mode.DIRECT, session_id=""))
        fresh, _ = await stream(toy.edge, replace(second, session_id="fresh"))
        assert list(done.output_token_ids) == direct == fresh
        _, decode_spec = [c for c in toy.engines.calls if c[2] is not None][-1][1:]
        assert decode_spec.loads and decode_spec.save  # the cloud loads what it stored, saves the rest
    finally:
        await toy.batcher.stop()


@pytest.mark.parametrize("lost", ["edge", "cloud"])
async def test_after_a_restart_or_an_eviction_only_missing_blocks_travel(lost):
    """The edge lost its sessions (a restart, an eviction): turn 2 brings down every block of its
    prompt. The cloud lost its store: it recomputes the prompt, and only what the edge lacks comes
    down. Either way the tokens are unchanged."""
    toy = await rp_stack()
    try:
        _, first, _ = await two_turns(toy, "ref")
        answer = toy.edge.tok.decode(first.output_token_ids)
        await stream(toy.edge, rp_chat(RP_LONG, session="s"))
        second = rp_chat(RP_LONG, answer, "and then what happened to the fox in the woods?", session="s")
        if lost == "edge":
            toy.edge.local.sessions.clear()
        else:
            toy.store._data.clear()
        _, done = await stream(toy.edge, second)
        direct, _ = await stream(toy.edge, replace(second, mode=Mode.DIRECT, session_id=""))
        assert list(done.output_token_ids) == direct
        held = 0 if lost == "edge" else held_tokens(toy, first, second)
        assert done.received_kv_bytes == (len(toy.edge.tokenize(second)) // B - held // B) * block_bytes()
    finally:
        await toy.batcher.stop()


async def test_kv_that_came_down_stays_for_the_next_turn_when_the_cloud_finishes_first():
    """The edge's whole model is slow (0.3 s a run): the cloud's 10 tokens end the turn while the
    edge still computes past the KV; the session keeps the blocks, so asking again brings none down."""
    toy = await rp_stack(step_delay_s=0.001, local_step_s=0.3)
    try:
        first_ids, first = await stream(toy.edge, rp_chat(RP_LONG, session="k", n=10))
        assert first.edge_decoded_tokens == 0 and first.received_kv_bytes > 0
        again_ids, again = await stream(toy.edge, rp_chat(RP_LONG, session="k", n=10))
        assert again.received_kv_bytes == 0 and again_ids == first_ids
    finally:
        await toy.batcher.stop()


async def test_a_cloud_that_finishes_first_does_not_wait_for_the_edges_own_prompt_run():
    """The edge computes the prompt itself (``compute``) at 1 s a run; the cloud's 8 tokens end the
    turn long before: the turn ends with them, not after the edge's run (which finishes alone)."""
    toy = await rp_stack(step_delay_s=0.001, local_step_s=1.0, prompt_kv="compute")
    try:
        direct, _ = await stream(toy.edge, rp_turn(RP_LONG, Mode.DIRECT, n=8))
        t0 = time.perf_counter()
        got, done = await stream(toy.edge, rp_turn(RP_LONG, Mode.REMOTE_PREFILL, n=8))
        elapsed = time.perf_counter() - t0
        assert got == direct and done.edge_decoded_tokens == 0 and done.finish_reason == "length"
        assert elapsed < 0.6, elapsed
    finally:
        await toy.batcher.stop()


async def test_a_stateless_turn_that_the_cloud_finishes_does_not_wait_to_adopt_kv_it_drops():
    """A stateless turn's session goes at its end: where the cloud's 8 tokens end the turn while the
    edge still writes the KV that came down into it (1 s here), the turn ends without waiting."""
    toy = await rp_stack(step_delay_s=0.02)
    model = toy.edge.local.model
    write_kv = model.write_kv

    def slow_write(*a, **kw):
        time.sleep(1.0)
        return write_kv(*a, **kw)

    model.write_kv = slow_write
    try:
        direct, _ = await stream(toy.edge, rp_turn(RP_LONG, Mode.DIRECT, n=8))
        t0 = time.perf_counter()
        got, done = await stream(toy.edge, rp_turn(RP_LONG, Mode.REMOTE_PREFILL, n=8))
        elapsed = time.perf_counter() - t0
        assert got == direct and done.edge_decoded_tokens == 0 and done.received_kv_bytes > 0
        assert elapsed < 0.8, elapsed
    finally:
        await toy.batcher.stop()


async def test_a_client_that_leaves_after_the_edges_run_failed_leaves_no_error_unheard():
    """The edge's own run over the prompt fails (here: refused) and the client stops reading a few
    tokens later: the turn's tasks end with it and none holds an exception nobody retrieved."""
    import contextlib
    import gc

    from tandem.common.protocol.errors import EngineError

    toy = await rp_stack(prompt_kv="compute")
    loop, unheard = asyncio.get_running_loop(), []
    loop.set_exception_handler(lambda _loop, ctx: unheard.append(ctx.get("message")))
    local, extend = toy.edge.local, toy.edge.local.extend

    async def refused(sess, ids, room_tokens=0):
        local.extend = extend
        raise EngineError("refused")

    local.extend = refused
    try:
        async with contextlib.aclosing(toy.edge.chat(rp_turn(RP_LONG, Mode.REMOTE_PREFILL))) as events:
            n = 0
            async for ev in events:
                n += len(getattr(ev, "token_ids", ()))
                if n >= 4:
                    break
        await asyncio.sleep(0.05)
        gc.collect()
        await asyncio.sleep(0)
        assert not unheard, unheard
    finally:
        loop.set_exception_handler(None)
        await toy.batcher.stop()


def test_the_apis_name_the_mode_and_chatdone_reports_what_came_down():
    from tandem.client import build_request
    from tandem.edge.api.request_models import ChatRequest
    from tandem.v1 import tandem_pb2 as pb

    r = build_request([{"role": "user", "content": "hi"}], mode="remote_prefill")
    assert r.mode == pb.MODE_REMOTE_PREFILL and ChatTurn.from_pb(r).mode is Mode.REMOTE_PREFILL
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "mode": "remote_prefill"}
    assert ChatRequest.model_validate(body).mode == "remote_prefill"
    done = TurnDone(
        finish_reason="length",
        prompt_tokens=5,
        output_tokens=8,
        head_tokens=0,
        external_tokens=0,
        split_layer=0,
        timings={},
        sent_bytes=None,
        output_token_ids=(),
        mode=Mode.REMOTE_PREFILL,
        received_kv_bytes=9,
        edge_decoded_tokens=3,
    )
    m = done.to_pb().done
    assert (m.mode, dict(m.received_bytes), m.edge_decoded_tokens) == ("remote_prefill", {"kv": 9}, 3)


async def test_remote_prefill_is_refused_without_the_whole_model_or_the_cloud():
    from tandem.common.protocol.errors import EngineError, ModeUnavailable

    toy = await rp_stack()
    try:
        local = toy.edge.local
        toy.edge.local = None
        with pytest.raises(ModeUnavailable, match="whole model"):
            await stream(toy.edge, rp_turn("hi", Mode.REMOTE_PREFILL))
        toy.edge.local = local
        assert "remote_prefill" in {r.mode.value for r in toy.edge.routes()}
        toy.edge.conn.connected.clear()  # the cloud is not connected
        with pytest.raises(EngineError, match="needs the cloud"):
            await stream(toy.edge, rp_turn("hi", Mode.REMOTE_PREFILL))
    finally:
        await toy.batcher.stop()


async def test_completed_remote_prefill_turns_count_as_ok_at_the_cloud():
    """The edge cancels its call once the cloud's final came (a handover or the end of the reply);
    the cloud counts such a turn by how it ended, ``ok``, not by the cancel that followed it."""
    from prometheus_client import REGISTRY

    def count(outcome: str) -> float:
        labels = {"mode": "remote_prefill", "outcome": outcome}
        return REGISTRY.get_sample_value("tandem:cloud_requests_total", labels) or 0.0

    toy = await rp_stack()
    try:
        ok, cancelled = count("ok"), count("cancelled")
        _, handed = await stream(toy.edge, rp_turn(RP_LONG, Mode.REMOTE_PREFILL))
        toy.engines.save_delay_s = 1.0  # the cloud decodes all 8 tokens: its own final ends the turn
        _, whole = await stream(toy.edge, rp_turn(RP_LONG, Mode.REMOTE_PREFILL, n=8))
        assert handed.edge_decoded_tokens > 0 and whole.edge_decoded_tokens == 0
        for _ in range(100):  # the cloud's side of each call ends after the edge has its reply
            if count("ok") - ok == 2:
                break
            await asyncio.sleep(0.02)
        assert (count("ok") - ok, count("cancelled") - cancelled) == (2, 0)
    finally:
        await toy.batcher.stop()


@pytest.mark.parametrize("seed", [3, 11])
async def test_a_seeded_sampled_turn_gives_one_reply_whatever_the_links_timing(seed):
    """A seeded sampled remote-prefill turn hands over after the cloud's first token and asks for
    no block, whatever the plan (the edge computes the prompt, so its sampler's KV never depends on
    the link): with the cloud fast (many tokens decoded before the edge holds the prompt), slow, or
    slow to write its KV, under each plan, the reply is the same, and every token after the first
    is the edge's."""
    sampling = {"temperature": 0.9, "top_k": 20, "seed": seed}
    replies = []
    cases = [(0.001, 0.0, "download"), (0.03, 0.0, "download"), (0.001, 1.0, "auto"), (0.001, 0.0, "compute")]
    for step_delay_s, save_delay_s, prompt_kv in cases:
        toy = await rp_stack(step_delay_s=step_delay_s, prompt_kv=prompt_kv)
        toy.engines.save_delay_s = save_delay_s
        try:
            got, done = await stream(toy.edge, rp_turn(RP_LONG, Mode.REMOTE_PREFILL, n=16, **sampling))
            assert done.mode is Mode.REMOTE_PREFILL and len(got) == 16
            assert done.edge_decoded_tokens == 15, (step_delay_s, save_delay_s, done)
            assert done.received_kv_bytes == 0 and done.timings[Stage.EDGE_PREFILL] > 0
            replies.append(got)
        finally:
            await toy.batcher.stop()
    assert all(r == replies[0] for r in replies)
    greedy_first, _ = await _first_greedy_token()
    assert replies[0][0] == greedy_first  # the cloud's token (the toy engine samples greedily)


async def _first_greedy_token() -> tuple[int, TurnDone]:
    """Direct mode's first token of ``RP_LONG`` on a fresh toy stack."""
    toy = await rp_stack()
    try:
        got, done = await stream(toy.edge, rp_turn(RP_LONG, Mode.DIRECT, n=1))
        return got[0], done
    finally:
        await toy.batcher.stop()


async def test_the_next_turn_over_a_link_starts_its_kv_window_where_the_last_ended(monkeypatch):
    """The cloud keeps, per caller and link, the downlink window a remote-prefill turn ended with,
    and the next turn over that link starts from it (a slow link's turn does not queue a full window
    ahead of its tokens first)."""
    from tandem.common.wire.flow import DelayBoundWindow

    toy = await rp_stack()
    resumed: list[int] = []
    real = DelayBoundWindow.resume

    def spy(self, window_bytes):
        resumed.append(window_bytes)
        real(self, window_bytes)

    monkeypatch.setattr(DelayBoundWindow, "resume", spy)
    try:
        got, _ = await stream(toy.edge, rp_turn(RP_LONG, Mode.REMOTE_PREFILL))
        kept = dict(toy.gateway.remote._link_windows)
        assert len(kept) == 1 and not resumed
        (caller, link_id), window = next(iter(kept.items()))
        assert link_id and window >= 1
        toy.gateway.remote._link_windows[(caller, link_id)] = 1  # as a slow link would leave it
        again, _ = await stream(toy.edge, rp_turn(RP_LONG, Mode.REMOTE_PREFILL))
        assert again == got and resumed == [1]
    finally:
        await toy.batcher.stop()


async def test_the_edges_own_run_leaves_room_for_the_whole_turn():
    """The edge's run over the prompt reserves the KV of the prompt and every output token (as a
    local turn's prefill does), so the decode it takes over starts in that KV."""
    toy = await rp_stack(prompt_kv="compute")
    local, extend, rooms = toy.edge.local, toy.edge.local.extend, []

    async def recorded(sess, ids, room_tokens=0):
        rooms.append((len(ids), room_tokens))
        return await extend(sess, ids, room_tokens=room_tokens)

    local.extend = recorded
    try:
        turn = rp_turn(RP_LONG, Mode.REMOTE_PREFILL, n=24)
        direct, _ = await stream(toy.edge, rp_turn(RP_LONG, Mode.DIRECT, n=24))
        got, done = await stream(toy.edge, turn)
        assert got == direct and done.edge_decoded_tokens > 0
        T = len(toy.edge.tokenize(turn))
        assert rooms and rooms[0] == (T, T + 24), rooms
    finally:
        await toy.batcher.stop()


async def test_the_edges_own_run_takes_the_prompts_room_where_the_whole_turns_does_not_fit_beside_what_is_held():
    """The KV memory holds the prompt's KV beside what other sessions hold but not the whole turn's
    (``QuotaExceeded`` for more): the edge's own run still computes the prompt, into KV of its size,
    and the edge takes the decode over (the KV grows at its first step, as before the room was
    reserved), the tokens direct's."""
    from tandem.common.protocol.errors import QuotaExceeded

    toy = await rp_stack(prompt_kv="compute")
    model = toy.edge.local.model
    turn = rp_turn(RP_LONG, Mode.REMOTE_PREFILL, n=24)
    T = len(toy.edge.tokenize(turn))
    new_kv, hints = model.new_kv, []

    def bounded(tokens_hint):
        hints.append(tokens_hint)
        if tokens_hint > T:
            raise QuotaExceeded(f"no room for {tokens_hint} tokens beside the sessions held")
        return new_kv(tokens_hint)

    model.new_kv = bounded
    try:
        direct, _ = await stream(toy.edge, rp_turn(RP_LONG, Mode.DIRECT, n=24))
        got, done = await stream(toy.edge, turn)
        assert got == direct and done.edge_decoded_tokens > 0, (hints, done.edge_decoded_tokens)
        assert hints[:2] == [T + 24, T], hints  # the whole turn's room refused, the prompt's taken
    finally:
        await toy.batcher.stop()


@pytest.mark.parametrize("session", ["", "chat-1"], ids=["stateless", "session"])
async def test_a_turn_that_asks_for_no_block_saves_no_kv_unless_a_session_keeps_it(session):
    """The edge computes the prompt itself (``compute``): a stateless turn is a plain engine request
    that writes nothing to the store (nothing would read it); a session's turn still stores its
    prompt's blocks, which its next turns' prefills load."""
    toy = await rp_stack(prompt_kv="compute")
    put, written = toy.store.put, []

    def counted(key, value):
        written.append(key)
        return put(key, value)

    toy.store.put = counted
    try:
        direct, _ = await stream(toy.edge, rp_turn(RP_LONG, Mode.DIRECT))
        written.clear()
        got, done = await stream(toy.edge, rp_turn(RP_LONG, Mode.REMOTE_PREFILL, session=session))
        assert got == direct and done.edge_decoded_tokens > 0 and done.received_kv_bytes == 0
        T = len(toy.edge.tokenize(rp_turn(RP_LONG, Mode.DIRECT)))
        await asyncio.sleep(0.05)  # the connector's last writes
        assert len(written) == (T // B if session else 0), written
    finally:
        await toy.batcher.stop()


async def test_an_edge_holding_the_prompt_before_the_first_token_takes_over_for_it():
    """The edge computes the prompt (``compute``) before the cloud's first token (50 ms a step): the
    takeover goes up before any token, for the first one; the cloud streams that token alone and
    hands over, and the edge decodes the other 11, the reply equal to direct's."""
    from tandem.common.wire.messages import TokensOut

    toy = await rp_stack(step_delay_s=0.05, prompt_kv="compute")
    try:
        direct, _ = await stream(toy.edge, rp_turn(RP_LONG, Mode.DIRECT, n=12))
        order: list = []

        def up(item):
            if isinstance(item, Takeover):
                order.append(("takeover", item.output_tokens))
            return item

        def down(ev, n):
            if isinstance(ev, TokensOut):
                order.append(("tokens", len(ev.token_ids)))
            return ev

        toy.edge.conn.link = DownTamperLink(toy.edge.conn.link, up=up, down=down)
        got, done = await stream(toy.edge, rp_turn(RP_LONG, Mode.REMOTE_PREFILL, n=12))
        assert got == direct and done.received_kv_bytes == 0
        assert order == [("takeover", 1), ("tokens", 1)], order
        assert done.edge_decoded_tokens == 11 and done.finish_reason == "length"
    finally:
        await toy.batcher.stop()
