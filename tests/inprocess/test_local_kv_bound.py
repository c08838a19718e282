"""Local mode under the edge's bound on its KV memory (``local_kv_bytes``) as a client sees it on the
edge's gRPC API (raw and the SDK) and its HTTP API: SmolLM2's builder graph (``edge-decoder/``) with
ONNX Runtime's CPU provider as the local model, bounded to one session of the first slot capacity,
in a toy stack (toy tokenizer, the in-memory cloud for direct mode).

A turn whose own KV is larger than the whole bound is refused before it runs, without a retry hint
(FAILED_PRECONDITION, HTTP 400 ``context_length_exceeded``), saying what it needs and what to do;
auto mode serves it in the cloud while the cloud is up. A local session the bound evicts reports
``session_expired`` on its next turn, as a split session the edge evicted does."""

from __future__ import annotations

import asyncio
import contextlib
import math

import grpc
import httpx
import pytest

import tandem
from tandem.chat_request import build_request
from tandem.common.protocol.modes import Mode
from tandem.common.runtime.grpc_setup import add_service, start_server
from tandem.edge.api.grpc_service import EDGE_SERVICE, EdgeServicer
from tandem.edge.api.http_api import create_openai_app, serve_openai, stop_openai
from tandem.edge.compute.decoder import DecoderGraph
from tandem.edge.compute.local import LocalEngine
from tandem.edge.routing.costmodel import CostModel
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc
from tests.doubles import toy_stack

MODEL = "toy"
HI = [{"role": "user", "content": "Hi"}]
TOO_MANY = 400  # prompt + this many new tokens need the next slot capacity (512), past the bound


class Edge:
    """The toy edge with SmolLM2's decoder as its local model behind its gRPC and HTTP APIs."""

    def __init__(self, toy, engine: LocalEngine, grpc_port: int, client, http_port: int, servers) -> None:
        self.toy, self.engine, self.grpc_port, self.client, self.http_port = toy, engine, grpc_port, client, http_port
        self._servers = servers

    @property
    def graph(self) -> DecoderGraph:
        return self.engine.model

    async def chat(self, request: pb.ChatRequest) -> tuple[pb.ChatDone | None, grpc.aio.AioRpcError | None]:
        """A raw ``Chat``: its ``ChatDone``, or the status it ended with."""
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.grpc_port}") as ch:
            done = None
            try:
                async for ev in pb_grpc.EdgeStub(ch).Chat(request, timeout=60):
                    if ev.HasField("done"):
                        done = ev.done
            except grpc.aio.AioRpcError as e:
                return None, e
        return done, None

    async def http(self, body: dict) -> httpx.Response:
        base = {"model": MODEL, "messages": HI, "max_tokens": 4, "temperature": 0}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.http_port}", timeout=60) as h:
            return await h.post("/v1/chat/completions", json={**base, **body})

    async def close(self) -> None:
        server, http, task = self._servers
        await self.client.close()
        await stop_openai(http, task, grace_s=1.0)
        await server.stop(0)
        await self.toy.batcher.stop()


@pytest.fixture
async def edge(decoder_dir, manifest):
    """The edge, its local model bounded to one session of the first slot capacity (1.5 of its bytes)."""
    cpu = ["CPUExecutionProvider"]
    probe = DecoderGraph(decoder_dir, providers=cpu, intra_op_threads=2)
    bound = probe._session_nbytes(probe.min_slot_tokens) * 3 // 2
    graph = DecoderGraph(decoder_dir, providers=cpu, intra_op_threads=2, max_kv_bytes=bound)
    engine = LocalEngine(graph, manifest.shape, (2,))
    engine.prefill_rate.add(1e-4)  # auto predicts local quickest (its first choice)
    engine.decode_rate.add(1e-4)
    toy = await toy_stack(node_kw={"local": engine})
    toy.edge.cost = CostModel(explore_every=0)
    server, port, _ = await start_server(
        [lambda s: add_service(s, EdgeServicer(toy.edge, MODEL), "Edge")], [EDGE_SERVICE], "127.0.0.1", 0, 1 << 20
    )
    http, task, http_port = await serve_openai(create_openai_app(toy.edge, MODEL), "127.0.0.1", 0)
    e = Edge(toy, engine, port, tandem.AsyncClient(f"127.0.0.1:{port}", timeout_s=60), http_port, (server, http, task))
    yield e
    await e.close()


def _no_retry_hint(md: dict) -> None:
    assert "retry-after-ms" not in md and "grpc-retry-pushback-ms" not in md, md


async def test_a_local_turn_larger_than_the_whole_kv_bound_is_refused_without_a_retry_hint(edge):
    """gRPC: FAILED_PRECONDITION naming ``max_new_tokens`` (``context_length_exceeded``), the bytes
    the turn needs and the bound in the details, no ``retry-after-ms``; the SDK's
    ``FailedPrecondition`` without ``retry_after_s``; HTTP: 400 ``invalid_request_error`` naming
    ``max_tokens``, no ``Retry-After``. A prompt too large alone names the prompt's field. A turn
    that fits runs."""
    ids = edge.toy.edge.tokenize(_turn(TOO_MANY))
    tokens = len(ids) + TOO_MANY
    need, bound = edge.graph.turn_kv_bytes(tokens), edge.graph.max_kv_bytes
    capacity = edge.graph.turn_capacity_tokens(tokens)
    assert need > bound and capacity == 512 and need == edge.graph.turn_kv_bytes(capacity)

    _, err = await edge.chat(build_request(HI, max_new_tokens=TOO_MANY, mode="local"))
    assert err is not None and err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
    md = dict(err.trailing_metadata() or ())
    _no_retry_hint(md)
    assert (md.get("tandem-error-param"), md.get("tandem-error-code")) == ("max_new_tokens", "context_length_exceeded")
    details = err.details()
    assert details.startswith("TurnTooLarge: ") and f"{need} bytes" in details and f"= {bound} bytes" in details
    assert "local_kv_bytes" in details and "fewer tokens" in details
    assert f"a KV slot of {capacity} tokens" in details and f"= {tokens} tokens rounded up" in details

    with pytest.raises(tandem.FailedPrecondition) as ei:
        async for _ in edge.client.chat(HI, max_new_tokens=TOO_MANY, mode="local"):
            pass
    assert ei.value.retry_after_s is None and (ei.value.param, ei.value.error_code) == (
        "max_new_tokens",
        "context_length_exceeded",
    )

    r = await edge.http({"max_tokens": TOO_MANY, "mode": "local"})
    assert r.status_code == 400 and "retry-after" not in r.headers, r.text
    body = r.json()["error"]
    want = ("invalid_request_error", "max_tokens", "context_length_exceeded")
    assert (body["type"], body["param"], body["code"]) == want
    assert "max_tokens" in body["message"] and "local_kv_bytes" in body["message"]
    assert "max_new_tokens" not in body["message"], body["message"]  # the HTTP request's names only
    r = await edge.http({"max_completion_tokens": TOO_MANY, "max_tokens": None, "mode": "local"})
    body = r.json()["error"]
    assert r.status_code == 400 and body["param"] == "max_completion_tokens", r.text
    assert "max_completion_tokens" in body["message"] and "max_new_tokens" not in body["message"]

    long_prompt = [{"role": "user", "content": "x" * 600}]  # one toy token per character: past 512 alone
    _, err = await edge.chat(build_request(long_prompt, max_new_tokens=4, mode="local"))
    assert err is not None and err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert dict(err.trailing_metadata())["tandem-error-param"] == "messages"
    r = await edge.http({"messages": long_prompt, "mode": "local"})
    body = r.json()["error"]
    assert r.status_code == 400 and body["param"] == "messages", r.text
    assert "max_tokens" in body["message"] and "max_new_tokens" not in body["message"], body["message"]

    done, err = await edge.chat(build_request(HI, max_new_tokens=4, mode="local"))
    assert err is None and done.mode == "local" and done.output_tokens == 4


async def test_auto_serves_a_turn_too_large_for_the_edge_in_the_cloud_and_refuses_it_without_one(edge):
    """Auto mode chooses local (predicted quickest); the refusal sends the turn to direct mode
    (``fallback: turn too large for the edge``); with the cloud down the refusal is the client's,
    as in local mode."""
    done, err = await edge.chat(build_request(HI, max_new_tokens=TOO_MANY, ignore_eos=True))
    assert err is None, err
    assert done.mode == "direct" and done.mode_reason == "fallback: turn too large for the edge"
    assert done.output_tokens == TOO_MANY
    r = await edge.http({"max_tokens": TOO_MANY})
    assert r.status_code == 200 and r.json()["tandem"]["mode"] == "direct", r.text

    edge.toy.edge.conn.connected.clear()  # no cloud: local is the only route
    _, err = await edge.chat(build_request(HI, max_new_tokens=TOO_MANY))
    assert err is not None and err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
    _no_retry_hint(dict(err.trailing_metadata() or ()))


def _turn(max_new_tokens: int):
    from tandem.common.protocol.params import Sampling
    from tandem.edge.events import ChatTurn

    return ChatTurn(
        messages=(("user", "Hi"),), prompt="", sampling=Sampling(max_new_tokens=max_new_tokens), mode=Mode.LOCAL
    )


async def test_a_local_session_the_kv_bound_evicts_reports_session_expired_on_its_next_turn(edge):
    """Room for one session: the next session's turn evicts the idle one; that one's next turn
    (gRPC ``ChatDone.session_expired``, the HTTP API's ``tandem.session_expired``) says it expired,
    once, and answers as a fresh session would."""
    first, err = await edge.chat(build_request(HI, max_new_tokens=4, mode="local", session_id="a"))
    assert err is None and not first.session_expired and "a" in edge.engine.sessions
    other, _ = await edge.chat(build_request(HI, max_new_tokens=4, mode="local", session_id="b"))
    assert not other.session_expired and "a" not in edge.engine.sessions  # evicted for b's KV

    again, err = await edge.chat(build_request(HI, max_new_tokens=4, mode="local", session_id="a"))
    assert err is None and again.session_expired and again.mode == "local"
    assert list(again.output_token_ids) == list(first.output_token_ids)
    later, _ = await edge.chat(build_request(HI, max_new_tokens=4, mode="local", session_id="a"))
    assert not later.session_expired

    # over HTTP: a conversation (its own edge session), evicted by another one's turn
    r = await edge.http({"mode": "local", "session_id": "conv-1"})
    extra = r.json()["tandem"]
    assert r.status_code == 200 and not extra["session_expired"], r.text
    await edge.http({"mode": "local", "session_id": "conv-2"})
    assert extra["session_id"] not in edge.engine.sessions
    r = await edge.http({"mode": "local", "session_id": "conv-1"})
    assert r.json()["tandem"]["session_expired"] and r.json()["tandem"]["session_id"] == extra["session_id"]


async def test_a_local_session_dropped_idle_reports_session_expired(edge):
    """A local session dropped for idleness (the edge's sweep) reports ``session_expired`` too; one
    its client ended does not (it starts as a new one)."""
    edge.engine.sessions.idle_s = 0.05
    await edge.chat(build_request(HI, max_new_tokens=2, mode="local", session_id="idle"))
    await asyncio.sleep(0.1)
    edge.engine.sessions.expire()  # the sweep (or the end of a turn)
    assert "idle" not in edge.engine.sessions
    edge.engine.sessions.idle_s = math.inf
    done, _ = await edge.chat(build_request(HI, max_new_tokens=2, mode="local", session_id="idle"))
    assert done.session_expired
    assert await edge.toy.edge.end_session("idle")
    done, _ = await edge.chat(build_request(HI, max_new_tokens=2, mode="local", session_id="idle"))
    assert not done.session_expired


def room_for_one_second_capacity_session(decoder_dir, manifest) -> tuple[LocalEngine, DecoderGraph, int]:
    """An engine whose KV bound holds one session of the second slot capacity, or two of the first,
    but not one of each; with an unbounded probe of the same graph and the bound (bytes)."""
    cpu = ["CPUExecutionProvider"]
    probe = DecoderGraph(decoder_dir, providers=cpu, intra_op_threads=2)
    small, big = probe.turn_kv_bytes(probe.min_slot_tokens), probe.turn_kv_bytes(probe.min_slot_tokens + 1)
    bound = big + small // 2
    engine = LocalEngine(
        DecoderGraph(decoder_dir, providers=cpu, intra_op_threads=2, max_kv_bytes=bound), manifest.shape, (2,)
    )
    return engine, probe, bound


async def test_a_session_whose_growth_does_not_fit_beside_its_kv_computes_its_prompt_afresh(decoder_dir, manifest):
    """Room for one session of the second capacity but not beside one of the first: a session's next
    turn that needs to grow drops its own KV and computes its prompt anew (one run), answering as a
    stateless turn does, instead of being refused (retryably) forever."""
    from tandem.common.protocol.params import Sampling

    engine, probe, bound = room_for_one_second_capacity_session(decoder_dir, manifest)
    prompt = [1, 2, 3, 4, 5]
    s = Sampling(max_new_tokens=4, ignore_eos=True)
    first = [t.token_id async for t in engine.generate(prompt, s, "g")]
    longer = Sampling(max_new_tokens=probe.min_slot_tokens, ignore_eos=True)
    follow = [*prompt, *first[:-1]]
    got = [t.token_id async for t in engine.generate(follow, longer, "g")]
    assert got == [t.token_id async for t in engine.generate(follow, longer)]  # stateless: the same tokens
    assert engine.model.memory.held_bytes <= bound


async def test_a_run_whose_turns_room_does_not_fit_beside_a_held_session_reserves_its_prompt(decoder_dir, manifest):
    """Room for a session of the second capacity, or two of the first, but not both: ``extend`` with
    room for a whole turn (a remote-prefill turn's own run) beside a held session computes the prompt
    into KV of its size instead of failing, and the decode after it answers as a stateless turn
    does (``generate`` makes the room then)."""
    from tandem.common.protocol.params import Sampling

    engine, probe, bound = room_for_one_second_capacity_session(decoder_dir, manifest)
    prompt = [1, 2, 3, 4, 5]
    longer = Sampling(max_new_tokens=probe.min_slot_tokens, ignore_eos=True)

    async def first_tokens(steps, n: int = 8) -> list[int]:  # the decode's first steps; the slot is the turn's
        got: list[int] = []
        async with contextlib.aclosing(steps) as it:
            async for t in it:
                got.append(t.token_id)
                if len(got) == n:
                    break
        return got

    want = await first_tokens(engine.generate(prompt, longer))  # stateless, nothing else held
    s = Sampling(max_new_tokens=4, ignore_eos=True)
    assert len([t async for t in engine.generate([7, 8, 9], s, "held")]) == 4  # a session of the first capacity
    sess = engine.new_session()
    assert await engine.extend(sess, prompt, room_tokens=len(prompt) + longer.max_new_tokens) == len(prompt)
    assert sess.token_ids == prompt and sess.kv.capacity_tokens == probe.min_slot_tokens
    assert await first_tokens(engine.generate(prompt, longer, session=sess)) == want
    assert engine.model.memory.held_bytes <= bound
    sess.drop()
