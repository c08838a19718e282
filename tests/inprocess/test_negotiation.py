"""Negotiation per link: params that follow the measured link, refusals and notes,
params versions (a request finishes under its own), the link's share enforced with a bounded
queue, and the edge's modes: fallback to local, renegotiation. In-memory doubles
(``tests.doubles``) and a grpc loopback cloud where the transport matters."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest

from tandem.cloud.links.negotiation import (
    KEPT_VERSIONS,
    MAX_WINDOW_BYTES,
    MIN_CHUNK_TOKENS,
    MIN_WINDOW_BYTES,
    LinkVersions,
    pick_chunk_tokens,
    pick_window_bytes,
)
from tandem.cloud.links.table import LinkBusy
from tandem.common.protocol.errors import (
    EngineError,
    IncompatibleModel,
    InvalidRequest,
    ModeUnavailable,
    ParamsVersionMismatch,
    QuotaExceeded,
)
from tandem.common.protocol.modes import Mode
from tandem.common.protocol.params import Codec, NegotiateOffer, Sampling, WireDtype
from tandem.edge.events import ChatTurn
from tandem.edge.routing.costmodel import CostModel, RequestShape, Route
from tests.doubles import MANIFEST, K, MemoryLocal, toy_manifest, toy_stack
from tests.helpers import run

KEY = MANIFEST.compatibility_key()


def offer(**kw) -> NegotiateOffer:
    return replace(NegotiateOffer(edge_id="edge-a", model_id="toy", head_keys={K: KEY}, edge_max_batch=4), **kw)


def turn(text: str = "hello there", mode: Mode = Mode.AUTO, session: str = "", n: int = 4, **kw) -> ChatTurn:
    return ChatTurn(
        messages=(("user", text),), prompt="", session_id=session, sampling=Sampling(max_new_tokens=n), mode=mode, **kw
    )


# ---------------------------------------------------------------- pure rules


def test_chunk_size_follows_goodput_and_window_follows_the_bandwidth_delay_product():
    assert pick_chunk_tokens(0.0, 8448, 64, 256) == 64  # unknown: the configured default
    slow, fast = pick_chunk_tokens(1.0, 8448, 64, 256), pick_chunk_tokens(10_000.0, 8448, 64, 256)
    assert slow == MIN_CHUNK_TOKENS and fast == 256
    mid = pick_chunk_tokens(100.0, 8448, 64, 256)  # 125 KB in 10 ms = ~15 tokens of 8448 B
    assert MIN_CHUNK_TOKENS <= mid <= 32 and mid & (mid - 1) == 0
    assert pick_window_bytes(0.0, 50.0, 1 << 16) == MAX_WINDOW_BYTES  # not measured
    assert pick_window_bytes(10_000.0, 0.1, 1 << 16) == MIN_WINDOW_BYTES  # loopback: a BDP of 125 KB
    assert pick_window_bytes(10_000.0, 0.1, 1 << 20) == 4 << 20  # never below 4 of the largest item
    # 100 Mbit/s x 100 ms = 1.25 MB in flight: a window of twice that
    assert pick_window_bytes(100.0, 100.0, 1 << 16) == 2_500_000


def test_link_versions_keep_recent_sets_and_only_change_on_a_difference():
    rec = LinkVersions(offer(), (K,))
    p = toy_params()
    assert rec.update({0: p}) and rec.version == 1
    assert not rec.update({0: replace(p, params_version=77)})  # same apart from the version
    for i in range(KEPT_VERSIONS + 2):
        assert rec.update({0: replace(p, max_concurrent_requests=i + 2)})
    assert rec.params(rec.version, 0).max_concurrent_requests == KEPT_VERSIONS + 3
    with pytest.raises(ParamsVersionMismatch, match="unknown"):
        rec.params(1, 0)  # dropped
    with pytest.raises(InvalidRequest, match="split layer 9 was not negotiated"):
        rec.params(rec.version, 9)


def toy_params():
    from tandem.common.protocol.params import LinkParams

    return LinkParams(
        params_version=1,
        split_layer=0,
        chunk_tokens=16,
        wire_dtype=WireDtype.FP32,
        codec=Codec.NONE,
        codec_level=3,
        kv_block_size_tokens=32,
        inflight_window_bytes=1 << 20,
        max_concurrent_requests=4,
        max_batched_tokens=64,
        max_prompt_tokens=100,
        max_new_tokens=16,
        hidden_size=8,
        max_chunk_resends=2,
    )


# ---------------------------------------------------------------- Negotiate in the gateway


@pytest.mark.parametrize(
    "edge_id",
    ["x\n2026-12-06 05:00:00,000 tandem.cloud ERROR FORGED", "a\x00b\r\x1b[31m", "\u2028/../é", "e" * 128, ""],
)
async def test_a_link_id_is_a_bounded_name_whatever_edge_id_the_edge_claims(edge_id):
    """A link id is sent back, echoed in headers, logged and traced: it is the claimed edge id (of an
    unauthenticated peer) in letters, digits, ``._-`` only, at most 48 of them, then a uuid."""
    import re

    toy = await toy_stack()
    try:
        link_id = toy.gateway.negotiate(offer(edge_id=edge_id)).link_id
        assert re.fullmatch(r"[A-Za-z0-9._-]{1,48}-[0-9a-f]{32}", link_id), link_id
        assert toy.gateway.links.get(link_id).edge_id == edge_id  # who it claims to be, for the trace
    finally:
        await toy.batcher.stop()


async def test_negotiate_gives_a_link_with_params_per_split_and_follows_the_offer():
    toy = await toy_stack(codecs=[Codec.NONE, Codec.ZSTD], max_chunk_tokens=256, chunk_tokens=64)
    try:
        gw = toy.gateway
        n = gw.negotiate(offer())
        assert set(n.params_by_split) == {0, K} and n.split_layers == (K,) and n.note == ""
        assert n.link_id.startswith("edge-a-") and n.instance_id == gw.registry.instance_id
        p = n.params_by_split[K]
        assert (p.split_layer, p.chunk_tokens, p.codec, p.params_version) == (K, 64, Codec.NONE, 1)
        # the same link renegotiated with a slow link measured: smaller chunks, zstd first, a new version
        again = gw.negotiate(offer(link_id=n.link_id, goodput_mbps=0.01, rtt_ms=80.0, codecs=(Codec.ZSTD,)))
        q = again.params_by_split[K]
        assert again.link_id == n.link_id and q.params_version == 2
        assert (q.chunk_tokens, q.codec) == (MIN_CHUNK_TOKENS, Codec.ZSTD)
        # nothing changed: no new version
        assert (
            gw.negotiate(offer(link_id=n.link_id, goodput_mbps=0.01, rtt_ms=80.0, codecs=(Codec.ZSTD,))).params_version
            == 2
        )
    finally:
        await toy.batcher.stop()


async def test_the_kv_format_is_the_edges_first_choice_among_the_clouds():
    from tandem.common.protocol.params import WireDtype as W

    toy = await toy_stack(kv_wire_dtypes=[W.INT8, W.FP16, W.FP32], wire_dtypes=[W.FP32, W.INT8])
    try:
        gw = toy.gateway
        got = gw.negotiate(offer(kv_wire_dtypes=(W.INT4, W.FP16, W.INT8), wire_dtypes=(W.INT8,))).params_by_split
        assert (got[K].kv_wire_dtype, got[K].wire_dtype) == (W.FP16, W.INT8)
        assert gw.negotiate(offer()).params_by_split[K].kv_wire_dtype == W.FP32  # default offer: fp32 first
        none = gw.negotiate(offer(kv_wire_dtypes=(W.INT4,)))
        assert set(none.params_by_split) == {0} and "no common KV block format" in none.note
        # a newer edge's formats this cloud does not know are skipped, not refused
        newer = offer().to_pb()
        newer.wire_dtypes[:] = [99, W.INT8]
        newer.kv_wire_dtypes[:] = [98, W.FP16]
        newer.codecs[:] = [97]
        p = gw.negotiate(NegotiateOffer.from_pb(newer)).params_by_split[K]
        assert (p.wire_dtype, p.kv_wire_dtype, p.codec) == (W.INT8, W.FP16, Codec.NONE)
        newer.wire_dtypes[:] = [99]  # no activation format in common: direct only, with a note
        only_direct = gw.negotiate(NegotiateOffer.from_pb(newer))
        assert set(only_direct.params_by_split) == {0} and "no common activation format" in only_direct.note
        # the format shrinks the per-token bytes the chunk size is planned with
        slow = dict(goodput_mbps=2.0, rtt_ms=50.0)
        fp32 = gw.negotiate(offer(kv_wire_dtypes=(W.FP32,), **slow)).params_by_split[K].chunk_tokens
        int8 = gw.negotiate(offer(kv_wire_dtypes=(W.INT8,), **slow)).params_by_split[K].chunk_tokens
        assert int8 >= fp32
    finally:
        await toy.batcher.stop()


async def test_negotiate_refuses_another_model_and_says_when_it_lacks_the_edges_split():
    toy = await toy_stack()
    try:
        gw = toy.gateway
        with pytest.raises(IncompatibleModel, match=f"k={K}"):
            gw.negotiate(offer(head_keys={K: "other weights"}))
        n = gw.negotiate(offer(head_keys={K + 3: toy_manifest().compatibility_key()}))
        assert set(n.params_by_split) == {0} and "no tail for the edge's k in [5]" in n.note
        assert "direct mode only" in n.note
        only_direct = gw.negotiate(offer(wire_dtypes=(WireDtype.INT8,)))  # no common activation format
        assert set(only_direct.params_by_split) == {0} and "no common activation format" in only_direct.note
        with pytest.raises(InvalidRequest):
            gw.negotiate(offer(edge_id="x" * 300))
        with pytest.raises(InvalidRequest, match="link_id longer"):
            gw.server_info("x" * 257)
    finally:
        await toy.batcher.stop()


async def test_a_request_finishes_under_its_params_version_and_new_ones_use_the_new_version():
    toy = await toy_stack()
    try:
        edge, gw = toy.edge, toy.gateway
        link_id = edge.conn.negotiated.link_id
        old = edge.conn.params(K)
        # the SLO controller shrinks this link: a new params version
        rec = gw.registry._versions[link_id]
        assert rec.update({k: replace(p, max_concurrent_requests=1) for k, p in rec.current.items()})
        assert rec.version == old.params_version + 1
        # the edge has not polled yet: its request names the old version and is served under it
        done = await run(edge, turn(mode=Mode.SPLIT))
        assert done.params_version == old.params_version and done.output_tokens == 4
        # a poll brings the new params; the next request names them
        await edge.conn._poll()
        assert edge.conn.params(K).params_version == rec.version
        assert (await run(edge, turn(mode=Mode.SPLIT))).params_version == rec.version
        # a chunk made under another version than its header's is refused
        with pytest.raises(ParamsVersionMismatch):
            gw.registry._versions[link_id].params(999, K)
    finally:
        await toy.batcher.stop()


async def test_the_edge_renegotiates_when_the_cloud_forgot_its_link():
    toy = await toy_stack()
    try:
        edge, gw = toy.edge, toy.gateway
        first = edge.conn.negotiated.link_id
        edge.conn.start()  # the loop renegotiates on request
        gw.registry._versions.pop(first)  # e.g. a cloud restart: the link is unknown there
        done = await run(edge, turn(mode=Mode.SPLIT))
        assert done.output_tokens == 4 and edge.conn.negotiated.link_id != first
    finally:
        await edge.conn.stop()
        await toy.batcher.stop()


# ---------------------------------------------------------------- shares, queue and fallback


async def test_a_link_beyond_its_share_waits_then_gets_resource_exhausted_with_a_retry_delay():
    toy = await toy_stack(
        max_queue_wait_s=0.2, max_queue_per_link=1, engine={"max_num_seqs": 1, "block_size_tokens": 32}
    )
    try:
        toy.engines.step_delay_s = 0.05
        edge = toy.edge
        first = asyncio.create_task(run(edge, turn(mode=Mode.SPLIT, n=30)))
        await asyncio.sleep(0.05)
        with pytest.raises(LinkBusy) as e:
            await run(edge, turn("another", mode=Mode.DIRECT))
        assert 100 <= e.value.retry_after_ms <= 10_000
        assert (await first).output_tokens == 30
        assert toy.gateway.links.running == 0 and toy.gateway.links.waiting == 0
    finally:
        await toy.batcher.stop()


async def test_auto_falls_back_to_local_when_the_cloud_is_busy_or_gone():
    toy = await toy_stack(
        max_queue_wait_s=0.1, max_queue_per_link=0, engine={"max_num_seqs": 1, "block_size_tokens": 32}
    )
    try:
        toy.engines.step_delay_s = 0.05
        edge = toy.edge
        edge.cost = CostModel(explore_every=0)  # the choice must follow the predictions alone
        edge.local = MemoryLocal(prefill_ms_per_token=1e3)  # local looks slow: auto prefers the cloud
        before = edge.cost.predict(Route(Mode.LOCAL), RequestShape(30), edge.router.link_state()).ttft_ms
        # another edge holds the cloud's one sequence: only the cloud's admission tells this edge
        other = await toy.another_edge("other")
        hog = asyncio.create_task(run(other, turn(mode=Mode.DIRECT, n=30)))
        await asyncio.sleep(0.05)
        done = await run(edge, turn("busy now"))
        assert done.mode == "local" and done.mode_reason == "fallback: cloud busy"
        await hog
        # the local run measured its rate, which the cost model reads: local is predicted faster now
        assert edge.cost.predict(Route(Mode.LOCAL), RequestShape(30), edge.router.link_state()).ttft_ms < before
        edge.cost = CostModel(explore_every=0)  # forget it: local looks slow again
        edge.local = MemoryLocal(prefill_ms_per_token=1e3)
        toy.engines.alive = False  # the engines are down: EngineError (UNAVAILABLE)
        done = await run(edge, turn("down now"))
        assert done.mode == "local" and done.mode_reason == "fallback: cloud unavailable"
        with pytest.raises(EngineError):  # an explicit cloud mode is refused, not rerouted
            await run(edge, turn("down now", mode=Mode.DIRECT))
    finally:
        await toy.batcher.stop()


async def test_explicit_modes_are_honoured_or_refused_clearly():
    toy = await toy_stack()
    try:
        edge = toy.edge
        with pytest.raises(ModeUnavailable, match="local mode"):
            await run(edge, turn(mode=Mode.LOCAL))
        with pytest.raises(ModeUnavailable, match="not k=7"):
            await run(edge, turn(mode=Mode.SPLIT, split_layer=7))
        assert (await run(edge, turn(mode=Mode.DIRECT))).mode == "direct"
        done = await run(edge, turn(mode=Mode.SPLIT, split_layer=K))
        assert (done.mode, done.split_layer, done.mode_reason) == ("split", K, "requested")
        assert done.predicted_ttft_ms > 0 and done.ttft_ms > 0
        edge.local = MemoryLocal()
        local = await run(edge, turn(mode=Mode.LOCAL, session="s"))
        assert local.mode == "local" and local.output_token_ids == MemoryLocal.tokens(4)
        assert {"local", "split", "direct"} == {r.mode for r in edge.routes()}
        edge.conn.connected.clear()  # the cloud went away: only local remains
        assert [r.mode for r in edge.routes()] == ["local"] and "not connected" in edge.degraded()
        with pytest.raises(EngineError):
            await run(edge, turn(mode=Mode.SPLIT))
        assert (await run(edge, turn())).mode == "local"
    finally:
        await toy.batcher.stop()


async def test_auto_follows_the_cost_model_and_its_error_is_reported():
    toy = await toy_stack()
    try:
        edge = toy.edge
        edge.cost = CostModel(explore_every=0)
        edge.local = MemoryLocal(prefill_ms_per_token=0.001)  # local looks nearly free: auto picks it
        done = await run(edge, turn())
        assert done.mode == "local" and done.mode_reason.startswith("auto")
        edge.cost = type(edge.cost)(hysteresis=0.1, explore_every=0)
        edge.local = MemoryLocal(prefill_ms_per_token=1e3)  # now prohibitively slow
        done = await run(edge, turn())
        assert done.mode in ("split", "direct") and done.predicted_ttft_ms > 0
        assert np.isfinite(done.ttft_ms)
    finally:
        await toy.batcher.stop()


# ---------------------------------------------------------------- measurement over a shaped link


async def test_the_edge_measures_rtt_and_goodput_over_the_channel_and_follows_a_change():
    """Probes at connect, then every upload; a link that changes is followed within
    a few requests. The cloud is a grpc server behind the benchmarks' link emulator."""
    from tandem.benchmarks.linkproxy import LinkProxy
    from tandem.benchmarks.links import LinkProfile
    from tests.helpers import LONG_UPLOAD, Cloud, chat, close_edge, edge_to

    cloud = Cloud(max_chunk_tokens=256)
    await cloud.start()
    proxy = LinkProxy("127.0.0.1", cloud.port)
    server = await asyncio.start_server(proxy.handle, "127.0.0.1", 0)
    # RTTs far apart: the cloud, the emulator and the edge share one event loop, whose delays on
    # two loaded cores add tens of ms to a poll's round trip
    proxy.set_profile(LinkProfile("slow", rtt_ms=120.0, uplink_mbps=4.0, downlink_mbps=None))
    edge = await edge_to(f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
    try:
        c = edge.conn
        assert 120.0 <= c.rtt_ms.value < 200.0, c.rtt_ms.value
        assert 2.0 <= c.goodput_mbps.value <= 5.0, c.goodput_mbps.value
        proxy.set_profile(LinkProfile("fast", rtt_ms=10.0, uplink_mbps=64.0, downlink_mbps=None))
        for i in range(5):  # ~1300-token uploads of ~125 KB: each one a goodput sample
            await run(edge, chat(LONG_UPLOAD * 3 + str(i), n=6))
        # the passive estimate is the upload pipeline's rate (bytes over the cloud's receive-and-verify
        # time): on this toy model ~50 tiny items per upload cost the cloud more than the wire does
        # (about 7-18 Mbit/s on two loaded cores), so it lands below the shaped rate; what shows that
        # it followed the change is that it is above anything the slow link could carry (its shaped
        # 4 Mbit/s plus 10% for the token bucket's burst), and never above the fast link's 64 (+10%).
        assert 4.0 * 1.1 < c.goodput_mbps.value <= 64.0 * 1.1, c.goodput_mbps.value
        await asyncio.sleep(8 * c.poll_s)  # polls follow the RTT (alpha 0.3: 8 samples leave 6% of the old value)
        assert 10.0 <= c.rtt_ms.value < 60.0, c.rtt_ms.value  # under half the slow link's
    finally:
        await close_edge(edge)
        server.close()
        await cloud.stop()


# ---------------------------------------------------------------- the upload window


class _Call:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, item) -> int:
        self.sent.append(item)
        return len(getattr(item, "payload", b"")) + 10

    def close_send(self) -> None:
        self.sent.append("half-close")


def _upload_rate_mbps(estimate_mbps: float, link_mbps: float, rtt_ms: float, threshold_fn) -> float:
    """One 4 MB upload over a link of ``link_mbps`` and ``rtt_ms`` (a FIFO at the link rate, then
    RTT/2), with the real edge sender (``_send_more``) under the window the cloud grants for
    ``estimate_mbps`` (``pick_window_bytes``) and the cloud acking every ``threshold_fn(window,
    item)`` bytes. Returns payload bits over the receive interval, as the edge's passive sample."""
    import heapq

    from tandem.cloud.links.negotiation import pick_window_bytes
    from tandem.common.wire import chunks as wire
    from tandem.common.wire.messages import TurnHeader
    from tandem.edge.link.uplink import OutgoingTurn, _send_more

    chunks = wire.split(np.zeros((1024, 1024), np.float32), 0, 16, params_version=1)  # 64 x 64 KiB
    header = TurnHeader(
        request_id="r",
        session_id="",
        params_version=1,
        split_layer=K,
        prompt_token_ids=tuple(range(1024)),
        cached_tokens=0,
        num_chunks=len(chunks),
        num_kv_blocks=0,
        sampling=Sampling(max_new_tokens=1),
    )
    item = len(chunks[0].payload)
    window = pick_window_bytes(estimate_mbps, rtt_ms, item)
    turn = OutgoingTurn(header, chunks, {}, 0, bytes(32), window=window, block_tokens=32)
    rate, half = link_mbps * 1e6 / 8 / 1e3, rtt_ms / 2  # bytes per ms, one-way ms
    events: list[tuple[float, int, str, int]] = []  # (time ms, order, kind, bytes)
    clock = {"now": 0.0, "link_free": 0.0, "n": 0}

    class Call:
        def send(self, it) -> int:
            n = len(getattr(it, "payload", b""))
            done = max(clock["now"], clock["link_free"]) + n / rate
            clock["link_free"] = done
            clock["n"] += 1
            heapq.heappush(events, (done + half, clock["n"], "arrive", n))
            return n

    call, threshold = Call(), threshold_fn(window, item)
    _send_more(call, turn, 0)
    received = acked = 0
    first = last = None
    while events:
        t, _, kind, n = heapq.heappop(events)
        clock["now"] = t
        if kind == "arrive":
            first = t - n / rate if first is None else first
            last, received = t, received + n
            if received - acked >= threshold:
                acked = received
                clock["n"] += 1
                heapq.heappush(events, (t + half, clock["n"], "ack", received))
        else:
            _send_more(call, turn, n)
    assert received == 64 * item
    return received * 8 / ((last - first) * 1e3)


def _uploads_on_a_faster_link(threshold_fn, start_mbps: float, link_mbps: float, rtt_ms: float, n: int) -> list[float]:
    """The rates of ``n`` 4 MB uploads on a link faster than the edge's estimate ``start_mbps``: the
    real ``CloudConnection`` estimate (EWMA of passive samples) and renegotiation rule, each upload at
    the rate the window negotiated from the last offer lets through (``_upload_rate_mbps``)."""
    from tandem.common.protocol.params import NegotiateOffer
    from tandem.edge.link.connection import CloudConnection

    conn = CloudConnection(None, NegotiateOffer(edge_id="e", model_id="m", head_keys={K: "k"}))  # type: ignore[arg-type]
    conn.goodput_mbps.add(start_mbps)
    conn.offered_goodput_mbps = start_mbps
    rates = []
    for _ in range(n):
        mbps = _upload_rate_mbps(conn.offered_goodput_mbps, link_mbps, rtt_ms, threshold_fn)
        nbytes = 4 << 20
        conn.observe_upload(nbytes, nbytes * 8 / (mbps * 1e3))
        if conn._should_renegotiate():
            conn.offered_goodput_mbps = conn.goodput_mbps.value
        rates.append(mbps)
    return rates


def test_an_edge_whose_link_got_faster_climbs_to_its_rate():
    """A window-limited upload measures only what its window lets through, and the window is sized
    from the edge's last offer. With half-window acks the guaranteed rate is the offer itself: an
    edge moved from a slow link to a 100 Mbit/s 80 ms one stays near its old estimate. Quarter
    acks (the cloud's ``ack_threshold_bytes``) guarantee 1.5x it and the edge renegotiates up at
    ``RENEGOTIATE_UP_RATIO``, so within a few uploads it offers the link's rate."""
    from tandem.cloud.links.negotiation import ack_threshold_bytes

    def half(window: int, item: int) -> int:  # the half-window rule
        return max(1, min(window // 2, window - item))

    assert max(_uploads_on_a_faster_link(half, 60.0, 100.0, 80.0, 12)) < 75.0  # stuck at 2/3 of the link
    rates = _uploads_on_a_faster_link(ack_threshold_bytes, 60.0, 100.0, 80.0, 12)
    assert min(rates[3:]) >= 95.0, rates  # from the 4th upload on, at the link's rate


def test_the_edge_sends_within_the_window_and_commits_after_the_last_item():
    from tandem.common.wire import chunks as wire
    from tandem.common.wire.messages import Commit, KVBlock, TurnHeader
    from tandem.edge.link.uplink import OutgoingTurn, _send_more, _send_upload

    h = np.zeros((64, 8), np.float32)
    chunks = wire.split(h, 0, 16, params_version=1)  # 4 chunks of 512 B, tokens [0, 64)
    blocks = {
        j: KVBlock(
            leaf_index=j,
            block_hash=bytes(32),
            layer_lo=0,
            layer_hi=2,
            codec=Codec.NONE,
            raw_nbytes=1000,
            payload=bytes(1000),
            leaf_hash=bytes(32),
            params_version=1,
        )
        for j in range(2)
    }
    header = TurnHeader(
        request_id="r",
        session_id="",
        params_version=1,
        split_layer=K,
        prompt_token_ids=tuple(range(64)),
        cached_tokens=0,
        num_chunks=4,
        num_kv_blocks=2,
        sampling=Sampling(max_new_tokens=1),
    )
    turn = OutgoingTurn(header, chunks, blocks, 2, bytes(32), window=2000, block_tokens=32)
    # block j follows the chunk that completes it: c0 c1 b0 c2 c3 b1
    assert [type(x).__name__[0] + str(getattr(x, "seq", getattr(x, "leaf_index", ""))) for x in turn.order] == [
        "C0",
        "C1",
        "K0",
        "C2",
        "C3",
        "K1",
    ]
    call = _Call()
    _send_upload(call, turn)
    assert turn.flow.sent_bytes == 1024  # c0 c1; b0 (1000 B) would pass the 2000-byte window
    _send_more(call, turn, 512)  # the cloud received c0: 512 in flight + 1000 fits
    assert turn.flow.sent_bytes == 2024 and not turn.committed
    _send_more(call, turn, 2024)  # all received: c2 c3; b1 would pass the window again
    assert turn.flow.sent_bytes == 3048 and not turn.committed
    _send_more(call, turn, 3048)  # the last block, then the commit
    assert turn.flow.sent_bytes == 4048 and turn.committed and isinstance(call.sent[-1], Commit)
    big = OutgoingTurn(header, chunks, blocks, 2, bytes(32), window=100, block_tokens=32)
    _send_upload(_Call(), big)
    assert big.flow.sent_bytes == 512  # an item larger than the window goes when nothing is in flight


async def test_a_small_window_paces_the_upload_on_the_clouds_acks():
    toy = await toy_stack()
    try:
        edge, gw = toy.edge, toy.gateway
        link_id = edge.conn.negotiated.link_id
        rec = gw.registry._versions[link_id]
        rec.update({k: replace(p, inflight_window_bytes=3000) for k, p in rec.current.items()})
        await edge.conn._poll()
        acks = []
        inner_open = edge.conn.link.open

        def counting_open(timeout_s):
            call = inner_open(timeout_s)
            events = call.events

            async def counted():
                async for ev in events():
                    if type(ev).__name__ == "WindowAck":
                        acks.append(ev.received_bytes)
                    yield ev

            call.events = counted
            return call

        edge.conn.link.open = counting_open
        done = await run(edge, turn("a prompt long enough for several chunks of sixteen tokens " * 4, mode=Mode.SPLIT))
        assert done.output_tokens == 4 and len(acks) >= 3 and acks == sorted(acks)
        assert done.sent_bytes.payload_bytes > 3 * 3000  # it took several windows
    finally:
        await toy.batcher.stop()


async def test_default_configs_negotiate_fp16_for_weights_without_a_fidelity_table():
    """A default edge and a default cloud serving weights no fidelity table names (the toy model)
    agree on the edge's first preference, fp16 activations and fp16 KV; a cloud set to fp32 only
    keeps every split reply equal to the unsplit model's. (With a table: ``test_fidelity.py``.)"""
    from tandem.cloud.config import CloudConfig
    from tandem.common.protocol.params import WireDtype as W
    from tandem.edge.config import EdgeConfig

    e, c = EdgeConfig(), CloudConfig()
    edge_offer = offer(wire_dtypes=tuple(e.wire_dtypes), kv_wire_dtypes=tuple(e.kv_wire_dtypes))
    toy = await toy_stack(wire_dtypes=c.wire_dtypes, kv_wire_dtypes=c.kv_wire_dtypes)
    exact = await toy_stack(wire_dtypes=[W.FP32], kv_wire_dtypes=[W.FP32])
    try:
        p = toy.gateway.negotiate(edge_offer).params_by_split[K]
        assert (p.wire_dtype, p.kv_wire_dtype) == (W.FP16, W.FP16)
        q = exact.gateway.negotiate(edge_offer).params_by_split[K]
        assert (q.wire_dtype, q.kv_wire_dtype) == (W.FP32, W.FP32)
    finally:
        await toy.batcher.stop()
        await exact.batcher.stop()


class FullLocal(MemoryLocal):
    """Local mode whose KV memory is full: every turn is refused before its first token."""

    async def generate(self, prompt_ids, sampling, session_id: str = "", *, prompt_param: str = "prompt"):
        self.calls.append(list(prompt_ids))
        raise QuotaExceeded("the local model's KV memory is used up (local_kv_bytes)")
        yield  # an async generator


async def test_auto_serves_a_turn_local_mode_refuses_for_memory_in_the_cloud():
    toy = await toy_stack()
    try:
        edge = toy.edge
        edge.cost = CostModel(explore_every=0)
        edge.local = FullLocal(prefill_ms_per_token=1e-4, decode_ms_per_token=1e-4)  # auto picks local
        done = await run(edge, turn("memory full"))
        assert edge.local.calls and done.mode == "direct" and done.mode_reason == "fallback: edge memory full"
        assert done.output_tokens > 0
        with pytest.raises(QuotaExceeded):  # an explicit local turn is refused, not rerouted
            await run(edge, turn("memory full", mode=Mode.LOCAL))
        edge.conn.connected.clear()  # no cloud: auto's local turn is refused as it stands
        with pytest.raises(QuotaExceeded):
            await run(edge, turn("memory full, no cloud"))
    finally:
        await toy.batcher.stop()
