"""Sessions have a lifetime, and a reached bound never makes a mode unavailable for good: a session
expires after its idle time, the least recently used idle one makes room when a bound is reached
(never one with a turn in flight), an evicted session's next turn resyncs from the block store or
starts over (it never fails), a session can be ended explicitly (``EndSession`` on both services,
the SDK's ``end_session``, the OpenAI API's ``DELETE /v1/conversations/{id}``), the edge ends in
the cloud what it drops itself, and all of it is counted. In-memory stack, fake clocks; the
services over real gRPC on loopback."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client import REGISTRY

from tandem.cloud.links.tenancy import EdgeOverLimit
from tandem.cloud.sessions.store import record_key
from tandem.cloud.turn import as_principal
from tandem.common.protocol.errors import QuotaExceeded, TurnTooLarge
from tandem.common.protocol.grpc_errors import retry_after_ms, status_of
from tandem.common.protocol.modes import Mode
from tandem.common.protocol.params import NegotiateOffer, Sampling
from tandem.common.runtime.grpc_setup import add_service, start_server
from tandem.common.runtime.security import scoped
from tandem.common.wire import chunks as wire
from tandem.edge.compute.batcher import HeadBatcher
from tandem.edge.compute.head import MemoryHead
from tandem.edge.events import ChatTurn, TurnDone
from tandem.edge.link.base import InProcessLink
from tandem.edge.link.connection import CloudConnection
from tandem.edge.modes.split_head import Head
from tandem.edge.node import EdgeNode
from tandem.edge.routing.costmodel import CostModel, Route
from tandem.edge.session import EdgeSessions
from tests.doubles import HKV, MANIFEST, D, H, K, MemoryLocal, toy_node, toy_stack
from tests.helpers import run

CALLER = "in-process"  # the identity of every in-process edge: two of them share it, as two edges without keys do
OPENING = "Tell me about the arches and bridges of the Romans, and how they were built. " * 2  # ~160 tokens


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def chat(session: str, *texts: str, n: int = 2, mode: Mode = Mode.SPLIT) -> ChatTurn:
    msgs: list[tuple[str, str]] = []
    for i, t in enumerate(texts or (OPENING,)):
        if i:
            msgs.append(("assistant", "ok"))
        msgs.append(("user", t))
    return ChatTurn(messages=tuple(msgs), prompt="", session_id=session, sampling=Sampling(max_new_tokens=n), mode=mode)


def ended(role: str, reason: str) -> float:
    name = "tandem:sessions_ended_total" if role == "edge" else "tandem:cloud_sessions_ended_total"
    return REGISTRY.get_sample_value(name, {"reason": reason}) or 0.0


async def second_edge(toy, sessions: EdgeSessions | None = None) -> EdgeNode:
    """Another edge on the toy's gateway under the same identity (no keys, one host)."""
    key = MANIFEST.compatibility_key()
    conn = CloudConnection(
        InProcessLink(toy.gateway, CALLER),
        NegotiateOffer(edge_id="e2", model_id="toy", head_keys={K: key}, edge_max_batch=4),
        probe_bytes=0,
    )
    await conn.connect()
    batcher = HeadBatcher(MemoryHead(K, H, HKV, D), 4)
    batcher.start()
    return toy_node([Head(batcher, key)], conn, sessions)


def sent_tokens(toy, done: TurnDone) -> float:
    """Tokens whose activations the turn sent (uncompressed links)."""
    assert done.sent_bytes is not None
    return done.sent_bytes.activations_bytes / wire.raw_nbytes_of(1, toy.edge.conn.params(K).wire_dtype, H)


def cloud_key(session_id: str) -> str:
    return scoped(as_principal(CALLER), session_id)


def stored(toy, session_id: str) -> bool:
    return toy.store.get(record_key(cloud_key(session_id))) is not None


async def settle(edge: EdgeNode) -> None:
    """Wait for the edge's ends in the cloud (they run in the background)."""
    await edge.lifetime.settle()


# ------------------------------------------------------------------ bounds reached over time


async def test_more_sessions_than_the_cloud_bound_keep_split_mode_serving():
    """An edge's session bound in the cloud is a working set, never a refusal for good: every turn of
    12 sessions over a bound of 3, revisited in turn, runs in split mode, the cloud holding at most 3
    in memory and resyncing the others from the block store."""
    toy = await toy_stack(edge_max_sessions=3)
    try:
        evicted = ended("cloud", "evicted")
        for rnd in range(3):
            for i in range(12):
                texts = [OPENING] + [f"and then {j}?" for j in range(rnd)]
                done = await run(toy.edge, chat(f"s{i}", *texts))
                assert done.mode is Mode.SPLIT
                assert len(toy.gateway.sessions.owned_by(as_principal(CALLER).tag)) <= 3
                if rnd:  # a revisit sends only the new tokens: the cloud resynced the rest from its store
                    assert sent_tokens(toy, done) < 20, (rnd, i, done.sent_bytes)
        assert ended("cloud", "evicted") - evicted >= 12 * 3 - 3
    finally:
        await toy.batcher.stop()


async def test_two_edges_sharing_the_anonymous_identity_share_the_bound_without_blocking():
    """Two edges without keys are one identity to the cloud: their sessions share its bound, even
    their ids; turns of both, more sessions than the bound, all run in split mode."""
    toy = await toy_stack(edge_max_sessions=2)
    other = await second_edge(toy)
    try:
        for rnd in range(2):
            for i in range(5):
                for edge in (toy.edge, other):
                    texts = [OPENING] + ["more?"] * rnd
                    assert (await run(edge, chat(f"shared-{i}", *texts))).mode is Mode.SPLIT
                    assert (await run(edge, chat(f"{id(edge)}-{i}", *texts))).mode is Mode.SPLIT
        assert len(toy.gateway.sessions) <= 2
    finally:
        await other.batcher.stop()
        await toy.batcher.stop()


async def test_an_evicted_session_the_store_lost_starts_over_and_does_not_fail():
    toy = await toy_stack(edge_max_sessions=1)
    try:
        await run(toy.edge, chat("a"))
        await run(toy.edge, chat("b"))  # a leaves memory
        assert toy.cloud_session("a") is None and stored(toy, "a")
        toy.gateway.sync.store.drop(cloud_key("a"))  # and the store lost it too
        done = await run(toy.edge, chat("a", OPENING, "go on"))
        assert done.mode is Mode.SPLIT and toy.cloud_session("a") is not None
    finally:
        await toy.batcher.stop()


async def test_a_session_with_a_turn_in_flight_is_never_evicted():
    """Only sessions without a turn in flight make room; while every one has one the new turn is
    refused as retryable (auto mode serves it locally meanwhile), and goes once one ends."""
    toy = await toy_stack(edge_max_sessions=2)
    toy.edge.local = MemoryLocal()
    try:
        await run(toy.edge, chat("a"))
        await run(toy.edge, chat("b"))
        with toy.gateway.sessions.turn(cloud_key("a")), toy.gateway.sessions.turn(cloud_key("b")):
            assert not toy.gateway.sessions.expire() and not toy.gateway.sessions.evict_one()
            with pytest.raises(EdgeOverLimit, match="turn in flight") as e:
                await run(toy.edge, chat("c"))
            assert isinstance(e.value, QuotaExceeded) and e.value.retry_after_ms
            assert (await run(toy.edge, chat("c2", mode=Mode.AUTO))).mode in (Mode.LOCAL, Mode.DIRECT)
            assert toy.cloud_session("a") is not None and toy.cloud_session("b") is not None
        assert (await run(toy.edge, chat("c"))).mode is Mode.SPLIT
        assert toy.cloud_session("c") is not None and toy.cloud_session("a") is None  # a was the LRU
    finally:
        await toy.batcher.stop()


async def test_stored_bytes_past_the_bound_make_room_too():
    toy = await toy_stack()
    per_session = toy.gateway.edge_limits.turn_bytes(len(toy.edge.tokenize(chat("x"))))
    toy.gateway.edge_limits.max_stored_bytes = 2 * per_session + 1
    try:
        for i in range(6):
            assert (await run(toy.edge, chat(f"b{i}"))).mode is Mode.SPLIT
            assert len(toy.gateway.sessions) <= 2
        toy.gateway.edge_limits.max_stored_bytes = per_session - 1  # one turn alone is too large: refused
        with pytest.raises(TurnTooLarge, match="edge_max_stored_bytes") as e:
            await run(toy.edge, chat("too-big"))
        # never fits: not retryable, and it names the prompt's field
        assert status_of(e.value).name == "FAILED_PRECONDITION" and retry_after_ms(e.value) is None
        assert (e.value.param, e.value.code) == ("messages", "context_length_exceeded")
        # auto mode, choosing split (the route it ran last, kept however much faster another is
        # predicted): the refusal sends the turn to direct mode, which keeps no state in the cloud
        toy.edge.cost = CostModel(hysteresis=1e9, explore_every=0)
        toy.edge.cost.last = Route(Mode.SPLIT, K)
        done = await run(toy.edge, chat("too-big-auto", mode=Mode.AUTO))
        assert done.mode is Mode.DIRECT and done.mode_reason == "fallback: turn too large for the cloud"
    finally:
        await toy.batcher.stop()


# ------------------------------------------------------------------ idle expiry


async def test_idle_cloud_sessions_expire_and_their_next_turn_resyncs():
    clock = FakeClock()
    toy = await toy_stack(session_idle_s=60)
    toy.gateway.sessions.clock = clock
    try:
        expired = ended("cloud", "expired")
        await run(toy.edge, chat("old"))
        clock.t += 30
        await run(toy.edge, chat("young"))
        clock.t += 31
        with toy.gateway.sessions.turn(cloud_key("young")):  # a turn in flight: never expires
            clock.t += 1000
            assert toy.gateway.sessions.expire() == [cloud_key("old")]
        assert toy.cloud_session("old") is None and stored(toy, "old")  # the store keeps it
        assert ended("cloud", "expired") - expired == 1
        done = await run(toy.edge, chat("old", OPENING, "still there?"))
        assert done.mode is Mode.SPLIT and sent_tokens(toy, done) < 20  # resynced: only the new tokens went up
        assert cloud_key("young") not in toy.gateway.sessions  # expired at that turn's commit (idle 1000 s)
    finally:
        await toy.batcher.stop()


async def test_the_sweep_loop_expires_sessions_without_any_turn():
    clock = FakeClock()
    toy = await toy_stack(session_idle_s=60)
    toy.gateway.sessions.clock = clock
    try:
        await run(toy.edge, chat("s"))
        clock.t += 61
        sweep = asyncio.create_task(toy.gateway.sync.sweep_loop(0.01))
        await asyncio.sleep(0.05)
        sweep.cancel()
        assert len(toy.gateway.sessions) == 0
    finally:
        await toy.batcher.stop()


async def test_an_idle_edge_session_expires_and_the_cloud_drops_its_copy():
    clock = FakeClock()
    toy = await toy_stack()
    toy.edge.sessions.clock, toy.edge.sessions.idle_s = clock, 60.0
    try:
        expired = ended("edge", "expired")
        await run(toy.edge, chat("e"))
        assert toy.cloud_session("e") is not None and stored(toy, "e")
        clock.t += 61
        assert toy.edge.sessions.expire() == ["e"]
        await settle(toy.edge)
        assert toy.cloud_session("e") is None and not stored(toy, "e")  # the edge told the cloud
        assert ended("edge", "expired") - expired == 1
        done = await run(toy.edge, chat("e", OPENING, "again"))
        assert done.session_expired and done.mode is Mode.SPLIT
    finally:
        await toy.batcher.stop()


async def test_a_session_the_edge_evicts_is_ended_in_the_cloud():
    toy = await toy_stack()
    toy.edge.sessions.max_entries = 2
    try:
        evicted = ended("edge", "evicted")
        for s in ("a", "b", "c"):
            await run(toy.edge, chat(s))
        await settle(toy.edge)
        assert toy.edge.sessions.keys() == ["b", "c"] and ended("edge", "evicted") - evicted == 1
        assert toy.cloud_session("a") is None and not stored(toy, "a")
        assert toy.cloud_session("b") is not None and toy.cloud_session("c") is not None
    finally:
        await toy.batcher.stop()


async def test_the_edge_never_evicts_a_session_with_a_turn_in_flight():
    sessions = EdgeSessions(1, 1 << 30)
    a = sessions.get("a")
    sessions.get("b")
    async with a.lock:
        assert sessions.evict() == ["b"]  # a, the least recently used, has a turn in flight
        c = sessions.get("c")
        async with c.lock:
            assert sessions.evict() == [] and sessions.keys() == ["a", "c"]  # both busy: over the bound meanwhile
    assert sessions.evict() == ["a"] and sessions.keys() == ["c"]


# ------------------------------------------------------------------ ending a session


async def test_end_session_drops_it_on_the_edge_and_in_the_cloud():
    toy = await toy_stack()
    toy.edge.local = MemoryLocal()
    try:
        n_ended = ended("edge", "ended"), ended("cloud", "ended")
        await run(toy.edge, chat("x"))
        assert await toy.edge.end_session("x") is True
        assert "x" not in toy.edge.sessions and toy.cloud_session("x") is None and not stored(toy, "x")
        assert toy.edge.local.ended == ["x"]
        assert (ended("edge", "ended") - n_ended[0], ended("cloud", "ended") - n_ended[1]) == (1, 1)
        assert await toy.edge.end_session("x") is False  # nothing left to end
        done = await run(toy.edge, chat("x", OPENING, "again"))
        assert done.mode is Mode.SPLIT and not done.session_expired
        assert done.head_tokens == len(toy.edge.tokenize(chat("x", OPENING, "again")))  # a new session
    finally:
        await toy.batcher.stop()


async def test_end_session_waits_for_the_turn_in_flight():
    toy = await toy_stack()
    toy.engines.step_delay_s = 0.02
    try:
        turn = asyncio.create_task(run(toy.edge, chat("busy", n=10)))
        while toy.cloud_session("busy") is None:
            await asyncio.sleep(0.005)
        assert await toy.edge.end_session("busy") is True
        assert turn.done() and (turn.result()).finish_reason == "length"
        assert toy.cloud_session("busy") is None and "busy" not in toy.edge.sessions
    finally:
        await toy.batcher.stop()


async def test_the_cloud_ends_only_the_callers_session():
    toy = await toy_stack()
    try:
        await run(toy.edge, chat("mine"))
        assert await toy.gateway.end_session("mine", "someone-else") is False
        assert toy.cloud_session("mine") is not None
        assert await toy.gateway.end_session("mine", CALLER) is True
        assert toy.cloud_session("mine") is None
    finally:
        await toy.batcher.stop()


async def test_end_session_over_grpc_from_the_sdk_and_from_the_edge_to_the_cloud():
    """``Client.end_session`` / ``AsyncClient.end_session`` -> ``Edge.EndSession`` -> the edge ->
    ``Cloud.EndSession`` over a real gRPC link."""
    from tandem import AsyncClient, Client, InvalidArgument
    from tandem.cloud.service import CloudServicer
    from tandem.edge.api.grpc_service import EDGE_SERVICE, EdgeServicer
    from tandem.edge.link.grpc_link import GrpcCloudLink

    toy = await toy_stack()
    cloud_server, cloud_port, _ = await start_server(
        [lambda s: add_service(s, CloudServicer(toy.gateway, "toy"), "Cloud")],
        ["tandem.v1.Cloud"],
        "127.0.0.1",
        0,
        toy.gateway.registry.max_message_bytes(),
    )
    link = GrpcCloudLink(f"127.0.0.1:{cloud_port}", 5.0, 5.0)
    key = MANIFEST.compatibility_key()
    conn = CloudConnection(
        link, NegotiateOffer(edge_id="g", model_id="toy", head_keys={K: key}, edge_max_batch=4), probe_bytes=0
    )
    await conn.connect()
    edge = toy_node([Head(toy.batcher, key)], conn)
    edge_server, edge_port, _ = await start_server(
        [lambda s: add_service(s, EdgeServicer(edge, "toy"), "Edge")], [EDGE_SERVICE], "127.0.0.1", 0, 1 << 20
    )
    principal = as_principal("ipv4:127.0.0.1")
    try:
        async with AsyncClient(f"127.0.0.1:{edge_port}") as c:
            await c.complete([{"role": "user", "content": OPENING}], session_id="g1", mode="split", max_new_tokens=2)
            assert toy.gateway.sessions.get(scoped(principal, "g1")) is not None
            assert await c.end_session("g1") is True
            assert toy.gateway.sessions.get(scoped(principal, "g1")) is None and "g1" not in edge.sessions
            assert await c.end_session("g1") is False
            with pytest.raises(InvalidArgument):
                await c.end_session("é" * 65)

        def sync_client() -> tuple[bool, bool]:
            with Client(f"127.0.0.1:{edge_port}") as c:
                c.complete([{"role": "user", "content": OPENING}], session_id="g2", mode="split", max_new_tokens=2)
                return c.end_session("g2"), c.end_session("g2")

        assert await asyncio.to_thread(sync_client) == (True, False)
        with pytest.raises(ValueError):
            Client("127.0.0.1:1").end_session("")
    finally:
        await edge_server.stop(0)
        await link.close()
        await cloud_server.stop(0)
        await toy.batcher.stop()


async def test_the_openai_api_ends_a_conversation_of_its_key_only():
    from tandem.edge.api.http_api import create_openai_app

    toy = await toy_stack()
    app = create_openai_app(toy.edge, "toy", api_keys=("sk-one-0123456789", "sk-two-0123456789"))
    body = {"model": "toy", "messages": [{"role": "user", "content": OPENING}], "max_tokens": 2, "mode": "split"}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://edge") as http:
            one = {"authorization": "Bearer sk-one-0123456789"}
            two = {"authorization": "Bearer sk-two-0123456789"}
            r = await http.post("/v1/chat/completions", json=body, headers=one)
            sid = r.headers["x-tandem-session"]
            assert r.status_code == 200 and toy.cloud_session(sid) is not None
            r = await http.delete(f"/v1/conversations/{sid}", headers=two)  # another key's: not found
            assert r.status_code == 404 and r.json()["error"]["param"] == "conversation_id"
            assert (await http.delete(f"/v1/conversations/{sid}")).status_code == 401
            r = await http.delete(f"/v1/conversations/{sid}", headers=one)
            assert r.status_code == 200 and r.json() == {"id": sid, "object": "conversation.deleted", "deleted": True}
            assert toy.cloud_session(sid) is None and sid not in toy.edge.sessions
            assert (await http.delete(f"/v1/conversations/{sid}", headers=one)).status_code == 404
    finally:
        await toy.batcher.stop()


@pytest.mark.parametrize("mode", ["direct", "split"])
async def test_a_conversation_ends_with_its_own_answer_whichever_mode_served_it(mode):
    """``DELETE /v1/conversations/{id}`` and ``EndSession`` end a conversation served in direct mode
    (no state kept on either side) as one served in split mode: 200 ``conversation.deleted`` /
    ``found``, then 404 / not found once ended; an id of the key that was never served is 404."""
    from tandem.common.protocol.limits import check_session_id
    from tandem.edge.api.http_api import create_openai_app
    from tandem.edge.api.request_models import conversation_session_id

    toy = await toy_stack()
    app = create_openai_app(toy.edge, "toy", api_keys=("sk-one-0123456789",), session_secret=b"s" * 32)
    key = {"authorization": "Bearer sk-one-0123456789"}
    body = {"model": "toy", "messages": [{"role": "user", "content": OPENING}], "max_tokens": 2, "mode": mode}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://edge") as http:
            r = await http.post("/v1/chat/completions", json=body, headers=key)
            sid = r.headers["x-tandem-session"]
            assert r.status_code == 200 and r.json()["tandem"]["mode"] == mode, r.text
            r = await http.delete(f"/v1/conversations/{sid}", headers=key)
            assert r.status_code == 200 and r.json() == {"id": sid, "object": "conversation.deleted", "deleted": True}
            assert sid not in toy.edge.sessions and toy.cloud_session(sid) is None
            assert (await http.delete(f"/v1/conversations/{sid}", headers=key)).status_code == 404
            never = conversation_session_id(b"s" * 32, ["chat", "sk-one-0123456789", "", "never", "", ""])
            assert check_session_id(never) and never != sid
            r = await http.delete(f"/v1/conversations/{never}", headers=key)
            assert r.status_code == 404 and r.json()["error"]["param"] == "conversation_id"
        done = await run(toy.edge, chat("g-" + mode, OPENING, mode=Mode(mode)))
        assert done.mode is Mode(mode)
        assert await toy.edge.end_session("g-" + mode) is True  # EndSession (gRPC, the SDK)
        assert await toy.edge.end_session("g-" + mode) is False
    finally:
        await toy.batcher.stop()
