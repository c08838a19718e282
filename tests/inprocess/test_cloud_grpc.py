"""The gateway and the edge over real grpc.aio on loopback, with in-memory engines and head
(fast): the cloud's verdict always reaches the edge, keepalive pings are accepted on silent
streams and a cloud that stops answering is detected."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
import numpy as np
import pytest

from tandem.cloud.links.registry import HEADER_SLACK_BYTES, MAX_PROBE_BYTES
from tandem.common.protocol.errors import InvalidRequest
from tandem.common.protocol.modes import Mode
from tandem.common.protocol.params import NegotiateOffer, Sampling
from tandem.common.runtime.grpc_setup import add_service, channel_options, start_server
from tandem.common.wire import chunks as wire
from tandem.edge.events import ChatTurn, TurnDone
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc
from tests.doubles import MANIFEST, B, H, K, TamperLink, ToyTokenizer, rechunk
from tests.helpers import LONG_UPLOAD, Cloud, close_edge, edge_to, run


def chat(text: str, session: str = "", n: int = 6) -> ChatTurn:
    return ChatTurn(
        messages=(("user", text),), prompt="", session_id=session, sampling=Sampling(max_new_tokens=n), mode=Mode.SPLIT
    )


@pytest.fixture
async def cloud():
    c = Cloud()
    await c.start()
    yield c
    await c.stop()


async def test_cloud_restart_mid_session_is_answered_by_a_full_resend(cloud):
    """Two turns, restart the cloud (same store), a third turn through the
    same edge: the cloud says FAILED_PRECONDITION, the edge resends from token 0, the client gets its
    answer (the upload is many chunks, so the edge is still writing when the cloud refuses)."""
    edge = await edge_to(f"127.0.0.1:{cloud.port}")
    try:
        convo = [("user", LONG_UPLOAD)]
        for i in range(5):
            done = await run(
                edge,
                ChatTurn(
                    messages=tuple(convo),
                    prompt="",
                    session_id="s",
                    sampling=Sampling(max_new_tokens=6),
                    mode=Mode.SPLIT,
                ),
            )
            convo += [("assistant", "sure"), ("user", f"and question {i}?")]
            if i >= 1:
                await cloud.stop()
                await cloud.start()
        assert done.output_tokens == 6 and done.head_tokens < done.prompt_tokens
    finally:
        await close_edge(edge)


async def test_a_full_size_upload_refused_midway_keeps_its_status(cloud):
    """A NaN in chunk 5 of 28: the client sees INVALID_ARGUMENT with the cloud's message, every time."""

    def nan_in_chunk_5(item, attempt):
        if isinstance(item, wire.Chunk) and item.seq == 5:
            return rechunk(item, np.full((item.num_tokens, H), np.nan, np.float32))
        return item

    edge = await edge_to(f"127.0.0.1:{cloud.port}")
    edge.conn.link = TamperLink(edge.conn.link, nan_in_chunk_5)
    try:
        for _ in range(20):
            with pytest.raises(InvalidRequest, match="NaN"):
                await run(edge, chat(LONG_UPLOAD))
        assert cloud.gateway.receiver.budget.uploads == 0
    finally:
        await close_edge(edge)


async def test_the_verdict_travels_as_a_message_before_the_status(cloud):
    ids = ToyTokenizer().apply_chat_template([{"role": "user", "content": LONG_UPLOAD}])
    p = cloud.gateway.params
    header = pb.RequestHeader(
        request_id="r", session_id="never-seen", params_version=p.params_version, split_layer=K,
        prompt_token_ids=ids, cached_tokens=32, num_chunks=-(-(len(ids) - 32) // p.chunk_tokens),
        num_kv_blocks=len(ids) // B - 1, sampling=pb.SamplingParams(max_new_tokens=4),
    )  # fmt: skip
    chunk = pb.ActivationChunk(seq=0, token_offset=32, num_tokens=16, wire_dtype=1, codec=1, payload=bytes(512))
    msgs = [pb.Uplink(header=header)] + [pb.Uplink(chunk=chunk)] * 20
    async with grpc.aio.insecure_channel(f"127.0.0.1:{cloud.port}") as ch:
        call = pb_grpc.CloudStub(ch).Generate(iter(msgs))
        got = [m async for m in _until_error(call)]
        assert got and got[0].WhichOneof("msg") == "error" and got[0].error.kind == "SessionNotFound"
        assert await call.code() == grpc.StatusCode.NOT_FOUND


async def _until_error(call):
    with contextlib.suppress(grpc.aio.AioRpcError):
        async for m in call:
            yield m


async def test_keepalive_pings_are_accepted_on_a_silent_stream(cloud):
    """A client pinging every second while its stream is silent is not cut off."""
    ids = ToyTokenizer().apply_chat_template([{"role": "user", "content": LONG_UPLOAD}])
    p = cloud.gateway.params
    header = pb.RequestHeader(
        request_id="r", session_id="quiet", params_version=p.params_version, split_layer=K, prompt_token_ids=ids,
        num_chunks=-(-len(ids) // p.chunk_tokens), num_kv_blocks=len(ids) // B,
        sampling=pb.SamplingParams(max_new_tokens=4),
    )  # fmt: skip

    async def silent():
        yield pb.Uplink(header=header)
        await asyncio.sleep(3.5)

    opts = channel_options(0.5, 1.0, 1 << 20)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{cloud.port}", options=opts) as ch:
        call = pb_grpc.CloudStub(ch).Generate(silent())
        with contextlib.suppress(grpc.aio.AioRpcError):
            async for _ in call:
                pass
        # the stream ended because the client stopped sending, not because the server cut the connection
        assert await call.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert "ping" not in (await call.details() or "").lower()
        r = await pb_grpc.CloudStub(ch).Negotiate(
            NegotiateOffer(
                edge_id="e", model_id="toy", head_keys={K: MANIFEST.compatibility_key()}, edge_max_batch=4
            ).to_pb()
        )
        assert r.params.split_layer == K


class FreezableProxy:
    """TCP forwarder on loopback that can stop moving bytes both ways (a stopped process, a dead link)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.running = asyncio.Event()
        self.running.set()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _conn(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection("127.0.0.1", self.target_port)
        await asyncio.gather(self._pipe(r, uw), self._pipe(ur, w), return_exceptions=True)

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(65536):
            await self.running.wait()
            w.write(data)
            await w.drain()
        w.close()

    async def stop(self) -> None:
        self.running.set()
        self.server.close()


async def test_a_cloud_that_stays_silent_fails_the_turn_at_its_deadline(cloud):
    """The cloud stops answering mid-turn (as under SIGSTOP, or a
    dead host); the edge's keepalive (1 s + 1 s here) ends the call, the edge waits for a cloud to
    resume on, and none answers: the client gets DeadlineExceeded naming the failure at the turn's
    deadline (within 1 s of it), never a hang."""
    import time

    from tandem.common.protocol.errors import DeadlineExceeded

    cloud.engines.step_delay_s = 0.2
    proxy = FreezableProxy(cloud.port)
    port = await proxy.start()
    edge = await edge_to(f"127.0.0.1:{port}", keepalive_s=1.0)
    try:
        await run(edge, chat("warm up"))
        proxy.running.clear()  # silent from now on, for up to 30 s
        t0 = time.perf_counter()
        with pytest.raises(DeadlineExceeded):
            async for _ in edge.chat(chat(LONG_UPLOAD, n=50), 6.0):
                pass
        assert time.perf_counter() - t0 < 6.0 + 1.0
    finally:
        await proxy.stop()
        await close_edge(edge)
        cloud.engines.step_delay_s = 0.0


async def test_a_cloud_that_stays_down_fails_the_turn_unavailable_after_the_resume_wait(cloud):
    """The same silent cloud, the turn's deadline far off: the turn waits ``resume_wait_s`` (2 s
    here) for a cloud to resume on, then fails UNAVAILABLE (``EngineError``) naming the failure and
    the setting, not at its deadline."""
    import time

    from tandem.common.protocol.errors import DeadlineExceeded, EngineError

    cloud.engines.step_delay_s = 0.2
    proxy = FreezableProxy(cloud.port)
    port = await proxy.start()
    edge = await edge_to(f"127.0.0.1:{port}", keepalive_s=1.0, resume_wait_s=2.0)
    try:
        await run(edge, chat("warm up"))
        proxy.running.clear()
        t0 = time.perf_counter()
        with pytest.raises(EngineError, match="resume_wait_s") as got:
            async for _ in edge.chat(chat(LONG_UPLOAD, n=50), 30.0):
                pass
        assert not isinstance(got.value, DeadlineExceeded) and time.perf_counter() - t0 < 15.0
    finally:
        await proxy.stop()
        await close_edge(edge)
        cloud.engines.step_delay_s = 0.0


async def test_a_link_cut_mid_decode_resumes_when_the_link_comes_back(cloud):
    """Over a real gRPC link: the link goes silent after some tokens, the
    keepalive ends the call (UNAVAILABLE, no verdict), the link comes back: the turn continues
    from the prompt plus the tokens emitted, and the client's stream repeats none of them."""
    cloud.engines.step_delay_s = 0.2
    proxy = FreezableProxy(cloud.port)
    port = await proxy.start()
    edge = await edge_to(f"127.0.0.1:{port}", keepalive_s=1.0)
    try:
        await run(edge, chat("warm up"))
        streamed: list[int] = []
        done = None
        async for ev in edge.chat(chat(LONG_UPLOAD, session="cut", n=20), 60.0):
            if isinstance(ev, TurnDone):
                done = ev
                continue
            streamed += ev.token_ids
            if len(streamed) >= 3 and proxy.running.is_set() and not getattr(proxy, "was_cut", False):
                proxy.was_cut = True
                proxy.running.clear()
                asyncio.get_running_loop().call_later(4.0, proxy.running.set)
        assert done is not None and done.resumes >= 1
        assert list(done.output_token_ids) == streamed and len(streamed) == done.output_tokens == 20
    finally:
        await proxy.stop()
        await close_edge(edge)
        cloud.engines.step_delay_s = 0.0


async def test_edge_health_follows_the_clouds(cloud):
    """An edge without a local model says NOT_SERVING
    while its cloud is not serving or gone, and SERVING again once it renegotiated with the cloud
    that came back (another instance: a new link)."""
    from grpc_health.v1 import health, health_pb2

    from tandem.common.runtime.grpc_setup import set_health
    from tandem.edge.api.grpc_service import EDGE_SERVICE, follow_link

    async def edge_status() -> int:
        r = await edge_hs.Check(health_pb2.HealthCheckRequest(service=EDGE_SERVICE), None)
        return r.status

    async def wait_for(status: int) -> None:
        for _ in range(200):
            if await edge_status() == status:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"edge health never became {status}")

    edge_hs = health.aio.HealthServicer()
    await set_health(edge_hs, False, ["", EDGE_SERVICE])
    SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    edge = await edge_to(f"127.0.0.1:{cloud.port}")
    task = asyncio.create_task(follow_link(edge, edge_hs, period_s=0.05))
    try:
        await wait_for(SERVING)
        cloud.gateway.serving = False  # what CloudServer.set_serving(False) does besides the health service
        await wait_for(NOT_SERVING)
        cloud.gateway.serving = True
        await wait_for(SERVING)
        link_before = edge.conn.negotiated.link_id
        await cloud.stop()
        await wait_for(NOT_SERVING)
        assert "not connected" in edge.degraded()
        await cloud.start()
        await wait_for(SERVING)
        assert edge.conn.negotiated.link_id != link_before  # renegotiated with the new instance
        done = await run(edge, chat("back again"))
        assert done.output_tokens == 6
    finally:
        task.cancel()
        await close_edge(edge)


async def test_messages_beyond_the_largest_legal_one_are_refused_by_grpc(cloud):
    """The server's message limit follows the negotiated limits, so a 5 MiB chunk
    never reaches the gateway's memory: the transport refuses it (RESOURCE_EXHAUSTED)."""
    ids = ToyTokenizer().apply_chat_template([{"role": "user", "content": LONG_UPLOAD}])
    p = cloud.gateway.params
    header = pb.RequestHeader(
        request_id="r", session_id="", params_version=p.params_version, split_layer=K, prompt_token_ids=ids,
        num_chunks=-(-len(ids) // p.chunk_tokens), num_kv_blocks=len(ids) // B,
        sampling=pb.SamplingParams(max_new_tokens=4),
    )  # fmt: skip
    big = pb.ActivationChunk(seq=0, token_offset=0, num_tokens=16, wire_dtype=1, codec=1, payload=bytes(5 << 20))
    opts = channel_options(5, 5, 64 << 20)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{cloud.port}", options=opts) as ch:
        call = pb_grpc.CloudStub(ch).Generate(iter([pb.Uplink(header=header), pb.Uplink(chunk=big)]))
        with contextlib.suppress(grpc.aio.AioRpcError):
            async for _ in call:
                pass
        assert await call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # the toy link's largest legal message is far below the goodput probe's bound, which sets the limit
    assert cloud.gateway.registry.max_message_bytes() == MAX_PROBE_BYTES + HEADER_SLACK_BYTES < 5 << 20


async def test_a_draining_cloud_logs_the_turns_in_flight_and_the_grace_and_lets_them_finish(caplog):
    """``CloudServer.stop`` (the daemon's answer to SIGTERM) logs at INFO that it drains, naming the
    signal, the turns in flight and the grace period, then how many were still in flight at its end;
    the turn in flight finishes."""
    from tandem.cloud.server import CloudServer
    from tandem.cloud.service import CloudServicer

    toy = Cloud()
    toy.engines.step_delay_s = 0.05
    await toy.start()
    gateway = toy.gateway
    servicer = CloudServicer(gateway, "toy-cloud")
    await toy.server.stop(0)  # the same gateway, served by a ``CloudServer`` that drains as the daemon does
    server, port, hs = await start_server(
        [lambda s: add_service(s, servicer, "Cloud")], ["tandem.v1.Cloud"], "127.0.0.1", 0, 1 << 22
    )
    daemon = CloudServer(server, port, gateway, hs, None, servicer)
    edge = await edge_to(f"127.0.0.1:{port}")
    try:
        turn = ChatTurn(
            messages=(("user", "hello"),), prompt="", sampling=Sampling(max_new_tokens=20), mode=Mode.DIRECT
        )
        in_flight = asyncio.create_task(run(edge, turn))
        while not servicer.in_flight:
            await asyncio.sleep(0.02)
        with caplog.at_level(logging.INFO, "tandem.cloud"):
            await daemon.stop(5.0, "SIGTERM")
        assert (await in_flight).output_tokens == 20
    finally:
        await close_edge(edge)
    said = [r.getMessage() for r in caplog.records if r.name == "tandem.cloud"]
    assert "tandem-cloud draining (SIGTERM): 1 turns in flight, grace 5 s" in said, said
    assert "tandem-cloud drained: 0 turns still in flight at the grace period" in said, said


async def test_a_draining_edge_refuses_new_turns_and_finishes_those_in_flight(cloud):
    """On stop the edge goes NOT_SERVING, a turn in flight completes,
    a new one gets UNAVAILABLE with a retry hint."""
    from tandem import AsyncClient, Unavailable
    from tandem.edge.api.grpc_service import EDGE_SERVICE, EdgeServicer

    cloud.engines.step_delay_s = 0.05
    edge = await edge_to(f"127.0.0.1:{cloud.port}")
    servicer = EdgeServicer(edge, "toy")
    server, port, _ = await start_server(
        [lambda s: add_service(s, servicer, "Edge")], [EDGE_SERVICE], "127.0.0.1", 0, 1 << 20
    )
    try:
        async with AsyncClient(f"127.0.0.1:{port}") as c:
            in_flight = asyncio.create_task(c.complete([{"role": "user", "content": "hello"}], max_new_tokens=20))
            await asyncio.sleep(0.3)
            servicer.draining = True  # what EdgeDaemon.stop does before server.stop(grace)
            with pytest.raises(Unavailable) as e:
                await c.complete([{"role": "user", "content": "hello again"}], max_new_tokens=2)
            assert "draining" in e.value.details and e.value.retry_after_s == 2.0
            assert not in_flight.done()
            await server.stop(10)  # the grace lets the turn in flight finish
            done = await in_flight
            assert done.output_tokens == 20
    finally:
        cloud.engines.step_delay_s = 0.0
        await close_edge(edge)


async def test_a_port_in_use_is_an_error_not_shared(cloud):
    """Binding a port in use fails: gRPC's default SO_REUSEPORT would let a second daemon share it."""
    with pytest.raises(RuntimeError, match="bind"):
        await start_server([], ["tandem.v1.Cloud"], "127.0.0.1", cloud.port, 1 << 20)


def test_a_verdict_the_edge_does_not_know_keeps_its_nearest_kind_and_retry_hint():
    """The cloud's LinkBusy / EdgeOverLimit (cloud-only subclasses of QuotaExceeded) reach a
    standalone edge as QuotaExceeded with their retry hint, not as a bare TandemError (which would be
    INTERNAL to the client, with no local fallback and no retry hint): the verdict names the error's
    ancestors and its retry hint."""
    from tandem.cloud.links.table import LinkBusy
    from tandem.common.protocol.errors import QuotaExceeded
    from tandem.common.wire.messages import TurnError, downlink_from_pb, downlink_to_pb

    m = downlink_to_pb(TurnError(error=LinkBusy("link 'x' waited 5007 ms for a slot", retry_after_ms=750)))
    assert m.error.kind == "LinkBusy" and list(m.error.base_kinds)[:2] == ["QuotaExceeded", "TandemError"]
    assert m.error.retry_after_ms == 750
    m.error.kind = "SomeNewerCloudError"  # a kind this process has never heard of
    ev = downlink_from_pb(m)
    assert isinstance(ev, TurnError) and type(ev.error) is QuotaExceeded
    assert ev.error.retry_after_ms == 750 and "waited 5007 ms" in str(ev.error)


async def test_an_explicit_split_turn_waits_out_a_cloud_that_briefly_stops_serving(cloud):
    """A turn that arrives while the cloud drains for a restart (health NOT_SERVING for a moment) is
    not refused at once: it waits up to the edge's renegotiation bound for the cloud."""
    edge = await edge_to(f"127.0.0.1:{cloud.port}")
    try:
        cloud.gateway.serving = False
        for _ in range(50):  # the edge's poll sees it
            if not edge.conn.connected.is_set():
                break
            await asyncio.sleep(0.1)
        assert not edge.conn.connected.is_set() and edge.conn.reconnecting

        async def back() -> None:
            await asyncio.sleep(1.0)
            cloud.gateway.serving = True

        task = asyncio.create_task(back())
        done = await run(edge, chat("hello after a pause"))
        await task
        assert done.mode == "split" and done.output_tokens == 6
    finally:
        await close_edge(edge)
