"""What a remote-prefill turn's ``ChatDone`` reports reaches the SDK's ``ChatResult`` (gRPC
``Edge`` service on loopback) and the OpenAI API's ``tandem`` field: the KV bytes that came
down, the tokens the edge decoded after it took over, the resumes. In-memory stack
(``tests.remote_doubles.rp_stack``), no vLLM."""

from __future__ import annotations

import httpx
import pytest

from tandem import AsyncClient
from tandem.common.runtime.grpc_setup import add_service, start_server
from tandem.edge.api.grpc_service import EDGE_SERVICE, EdgeServicer
from tandem.edge.api.http_api import create_openai_app
from tandem.edge.events import TurnDone
from tests.helpers import RP_LONG as LONG
from tests.remote_doubles import rp_stack

MESSAGES = [{"role": "user", "content": LONG}]


@pytest.fixture
async def toy():
    t = await rp_stack()
    yield t
    await t.batcher.stop()


def record_done(toy) -> list[TurnDone]:
    """The ``TurnDone`` of every turn the edge serves from here on (the handover's timing, and so
    the tokens the edge decodes, vary from run to run)."""
    seen: list[TurnDone] = []
    chat = toy.edge.chat

    async def recorded(*a, **kw):
        async for ev in chat(*a, **kw):
            if isinstance(ev, TurnDone):
                seen.append(ev)
            yield ev

    toy.edge.chat = recorded
    return seen


async def test_chat_result_reports_the_kv_that_came_down_and_the_edges_tokens(toy):
    seen = record_done(toy)
    server, port, _ = await start_server(
        [lambda s: add_service(s, EdgeServicer(toy.edge, "toy"), "Edge")], [EDGE_SERVICE], "127.0.0.1", 0, 1 << 20
    )
    try:
        async with AsyncClient(f"127.0.0.1:{port}") as c:
            r = await c.complete(MESSAGES, mode="remote_prefill", max_new_tokens=40)
            d = await c.complete(MESSAGES, mode="direct", max_new_tokens=40)
    finally:
        await server.stop(0)
    want = seen[0]
    assert want.received_kv_bytes > 0 and want.edge_decoded_tokens > 0
    assert r.mode == "remote_prefill" and r.output_token_ids == d.output_token_ids
    assert r.received_bytes == {"kv": want.received_kv_bytes}
    assert r.edge_decoded_tokens == want.edge_decoded_tokens and r.resumes == 0
    assert d.received_bytes == {} and d.edge_decoded_tokens == 0  # direct: the cloud decoded everything


@pytest.mark.parametrize("streaming", [False, True], ids=["response", "stream"])
async def test_the_openai_api_reports_them_in_its_tandem_field(toy, streaming):
    seen = record_done(toy)
    app = create_openai_app(toy.edge, "toy")
    body = {"model": "toy", "messages": MESSAGES, "max_tokens": 40, "mode": "remote_prefill", "stream": streaming}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://edge") as http:
        r = await http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    (want,) = seen
    if streaming:
        import json

        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        extra = next(c["tandem"] for c in chunks if "tandem" in c)
    else:
        extra = r.json()["tandem"]
    assert extra["mode"] == "remote_prefill" and extra["received_bytes"] == {"kv": want.received_kv_bytes}
    assert extra["edge_decoded_tokens"] == want.edge_decoded_tokens > 0 and extra["resumes"] == 0
