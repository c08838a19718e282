"""The edge's OpenAI-compatible HTTP API (``edge/api/http_api.py``) driven by the official ``openai``
client over a real uvicorn server on 127.0.0.1, in front of the in-memory stack (``toy_stack``: a real
``EdgeNode`` and gateway, toy tokenizer, deterministic in-memory engines). No vLLM."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from tandem.edge.api.http_api import (
    conversation_session_id,
    create_openai_app,
    serve_openai,
    stop_openai,
)
from tests.doubles import toy_stack

KEY = "sk-tandem-test"
MODEL = "toy"
SYSTEM = {"role": "system", "content": "You are terse."}


@pytest.fixture(scope="module")
async def stack():
    toy = await toy_stack()
    app = create_openai_app(toy.edge, MODEL, api_keys=(KEY, "sk-other"))
    server, task, port = await serve_openai(app, "127.0.0.1", 0)
    yield toy, port
    await stop_openai(server, task, grace_s=1.0)
    await toy.batcher.stop()


@pytest.fixture
async def client(stack):
    _, port = stack
    c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=20)
    yield c
    await c.close()


SPLIT = {"mode": "split"}  # tandem's mode extension: these tests look at the split's head tokens


def tandem_of(obj) -> dict:
    return (obj.model_extra or {})["tandem"]


def sessions_idle(toy) -> bool:
    return not any(s.lock.locked() for s in toy.edge.sessions._s.values())


async def test_models_list(client):
    """GET /v1/models lists the one served model, owned by tandem; retrieving another model is 404."""
    models = await client.models.list()
    assert [(m.id, m.owned_by, m.object) for m in models.data] == [(MODEL, "tandem", "model")]
    assert (await client.models.retrieve(MODEL)).id == MODEL
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("gpt-4")


async def test_a_model_id_with_slashes_is_retrieved():
    """``GET /v1/models/{id}`` for a served model id of the form ``org/name`` (a Hugging Face id, the
    edge's default): the card, through OpenAI's client too; another id with slashes is 404."""
    toy = await toy_stack()
    model = "HuggingFaceTB/SmolLM2-135M-Instruct"
    server, task, port = await serve_openai(create_openai_app(toy.edge, model, api_keys=(KEY,)), "127.0.0.1", 0)
    c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=20)
    try:
        assert (await c.models.retrieve(model)).id == model
        with pytest.raises(openai.NotFoundError):
            await c.models.retrieve("HuggingFaceTB/other")
    finally:
        await c.close()
        await stop_openai(server, task, grace_s=1.0)
        await toy.batcher.stop()


async def test_chat_completion(client):
    """A chat completion has OpenAI's shape (id, object, usage, finish_reason length) and the tandem field
    with the mode, split layer, session id and timings."""
    r = await client.chat.completions.create(
        model=MODEL,
        messages=[SYSTEM, {"role": "user", "content": "hello"}],
        max_tokens=8,
        temperature=0,
        extra_body=SPLIT,
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL and r.created > 0
    (c,) = r.choices
    assert c.message.role == "assistant" and len(c.message.content) == 8  # toy tokens decode to one char each
    assert c.finish_reason == "length"
    assert r.usage.prompt_tokens == 24 and r.usage.completion_tokens == 8 and r.usage.total_tokens == 32
    extra = tandem_of(r)
    assert extra["split_layer"] == 2 and extra["session_id"].startswith("oai:") and "total_ms" in extra["timings_ms"]
    assert extra["mode"] == "split" and extra["predicted_ttft_ms"] > 0


async def test_content_parts_and_developer_role_are_text(client):
    parts = [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]
    a = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "developer", "content": "sys"}, {"role": "user", "content": parts}],
        seed=1,
        extra_body=SPLIT,  # one mode for both: auto may choose another after the first (the doubles differ)
    )
    b = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "sys"}, {"role": "user", "content": "hel\nlo"}],
        seed=1,
        extra_body=SPLIT,
    )
    assert a.choices[0].message.content == b.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="only text content parts"):
        image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [image]}])


async def test_streaming_equals_non_streaming(client):
    msgs = [{"role": "user", "content": "stream me something"}]
    # one mode for both (the toy engines answer differently per mode; auto may choose another one)
    kw = {"model": MODEL, "messages": msgs, "max_tokens": 12, "temperature": 0, "extra_body": SPLIT}
    ref = await client.chat.completions.create(**kw)
    stream = await client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == ref.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


async def test_a_request_without_stream_is_a_whole_reply_turn(client, stack, monkeypatch):
    """Its client sees nothing before the last token, so auto weighs the end-to-end time
    (``ChatTurn.whole_reply``); a streamed request is not one."""
    toy, _ = stack
    turns, chat = [], toy.edge.chat

    def recording(turn, *a, **kw):
        turns.append(turn)
        return chat(turn, *a, **kw)

    monkeypatch.setattr(toy.edge, "chat", recording)
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    whole = await client.chat.completions.create(**kw)
    async for _ in await client.chat.completions.create(**kw, stream=True):
        pass
    await client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0, stream=False)
    assert [t.whole_reply for t in turns] == [True, False, True]
    assert "end-to-end" in tandem_of(whole)["mode_reason"]  # the response says which objective chose


async def test_completions(client):
    # one mode throughout (as the chat tests): the toy engines answer differently per mode, and auto may
    # choose another mode for the second request (seen under CI load)
    """A text completion has OpenAI's shape, max_tokens defaults to 16, and its stream's text equals the whole
    reply's."""
    kw = {"model": MODEL, "prompt": "Once upon a time", "temperature": 0, "extra_body": SPLIT}
    r = await client.completions.create(max_tokens=5, **kw)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert len(r.choices[0].text) == 5 and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len("Once upon a time") and r.usage.completion_tokens == 5
    default = await client.completions.create(**kw)
    assert default.usage.completion_tokens == 16 and default.choices[0].text.startswith(r.choices[0].text)
    stream = await client.completions.create(max_tokens=5, stream=True, **kw)
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_stop_strings(client):
    # one mode throughout: the toy engines answer differently in split and direct mode, and auto may switch
    """A stop string (or any of a list) cuts the reply before it, streamed or not, for chat and completions,
    with finish_reason stop."""
    msgs = [{"role": "user", "content": "stop strings"}]
    full = (
        await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0, extra_body=SPLIT)
    ).choices[0]
    text = full.message.content
    stop = text[5:7]
    cut = text[: text.find(stop)]
    r = await client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=16, temperature=0, stop=stop, extra_body=SPLIT
    )
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    s = await client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=16, temperature=0, stop=["zzzz", stop], stream=True, extra_body=SPLIT
    )
    chunks = [c async for c in s]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    c = await client.completions.create(
        model=MODEL, prompt="stop strings", max_tokens=16, temperature=0, extra_body=SPLIT
    )
    ctext = c.choices[0].text
    c2 = await client.completions.create(
        model=MODEL, prompt="stop strings", max_tokens=16, temperature=0, stop=[ctext[3:5]], extra_body=SPLIT
    )
    assert c2.choices[0].text == ctext[: ctext.find(ctext[3:5])] and c2.choices[0].finish_reason == "stop"


async def test_second_turn_of_a_conversation_runs_the_head_over_new_tokens_only(stack, client):
    toy, _ = stack
    msgs = [SYSTEM, {"role": "user", "content": "first question, fairly long to fill a block or two of tokens"}]
    r1 = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, extra_body=SPLIT)
    t1 = tandem_of(r1)
    assert t1["head_tokens"] == r1.usage.prompt_tokens
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "more?"}]
    r2 = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, extra_body=SPLIT)
    t2 = tandem_of(r2)
    assert t2["session_id"] == t1["session_id"]
    assert t2["head_tokens"] == r2.usage.prompt_tokens - r1.usage.prompt_tokens < r2.usage.prompt_tokens
    assert t2["external_tokens"] > 0  # the cloud loaded the conversation's earlier KV blocks
    assert toy.edge.sessions.peek(t1["session_id"]).token_ids  # the edge keeps the conversation
    # another user with the same opening gets a session of its own
    r3 = await client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=6, temperature=0, user="bob", extra_body=SPLIT
    )
    assert tandem_of(r3)["session_id"] != t1["session_id"] and tandem_of(r3)["head_tokens"] == r3.usage.prompt_tokens
    assert r3.choices[0].message.content == r2.choices[0].message.content


def test_session_ids_name_the_conversation_opening():
    a = conversation_session_id(b"s", ["chat", "key", "", "", "sys", "hi"])
    assert a == conversation_session_id(b"s", ["chat", "key", "", "", "sys", "hi"]) and a.startswith("oai:")
    others = [
        ["chat", "key", "bob", "", "sys", "hi"],
        ["chat", "key2", "", "", "sys", "hi"],
        ["chat", "key", "", "", "sys", "hello"],
        ["chat", "key", "", "", "sy", "shi"],
        ["text", "key", "", "", "sys", "hi"],
    ]
    assert len({a, *(conversation_session_id(b"s", p) for p in others)}) == 6
    assert conversation_session_id(b"t", ["chat", "key", "", "", "sys", "hi"]) != a


async def test_concurrent_turns_of_one_conversation_do_not_wait_for_each_other(stack, client):
    toy, _ = stack
    toy.engines.step_delay_s = 0.02
    try:
        msgs = [{"role": "user", "content": "same opening, same time"}]
        rs = await asyncio.gather(
            *(
                client.chat.completions.create(
                    model=MODEL, messages=msgs, max_tokens=10, temperature=0, extra_body=SPLIT
                )
                for _ in "abc"
            )
        )
    finally:
        toy.engines.step_delay_s = 0.0
    assert len({r.choices[0].message.content for r in rs}) == 1
    assert sorted(tandem_of(r)["session_id"] == "" for r in rs) == [False, True, True]  # two ran stateless


async def test_errors_in_openai_shape(stack, client):
    """Refusals are OpenAI's errors: 400 for bad parameters, over-long prompts and refused fields (not
    FastAPI's 422), 401 invalid_api_key, 404 for an unknown model or URL, 400 for a body that is not JSON,
    503 EngineError while the engines are down."""
    toy, port = stack
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as ei:
        await client.chat.completions.create(model=MODEL, messages=msgs, n=2)
    assert ei.value.status_code == 400 and ei.value.param == "n" and ei.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="prompt has"):
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * 2000}])
    with pytest.raises(openai.BadRequestError, match="prompt has"):
        await client.completions.create(model=MODEL, prompt="x" * 2000, stream=True)
    with pytest.raises(openai.BadRequestError) as ei:  # validation errors are 400, not FastAPI's 422
        await client.chat.completions.create(model=MODEL, messages=msgs, temperature=3)
    assert ei.value.param == "temperature"
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10**6)
    for kw in ({"echo": True}, {"logprobs": 2}, {"best_of": 3}):
        with pytest.raises(openai.BadRequestError, match=next(iter(kw))):
            await client.completions.create(model=MODEL, prompt="hi", **kw)
    with pytest.raises(openai.BadRequestError, match="role"):
        await client.chat.completions.create(model=MODEL, messages=[{"role": "tool", "content": "x"}])
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="gpt-4o", messages=msgs)
    bad = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as ai:
        await bad.chat.completions.create(model=MODEL, messages=msgs)
    assert ai.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        await bad.models.list()
    await bad.close()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as h:
        r = await h.post("/v1/chat/completions", content=b"{not json", headers={"authorization": f"Bearer {KEY}"})
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        r = await h.get("/v1/nothing", headers={"authorization": f"Bearer {KEY}"})
        assert r.status_code == 404 and "error" in r.json()
    toy.engines.alive = False
    try:
        with pytest.raises(openai.InternalServerError) as si:
            await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4)
        assert si.value.status_code == 503 and si.value.code == "EngineError"
    finally:
        toy.engines.alive = True


async def _decoding_stops(toy, steps: list[int]) -> None:
    """Wait until no decode step happened for 0.3 s (the engine emulates 50 ms per token); fail after 2 s."""
    t0 = time.monotonic()
    while True:
        n = len(steps)
        await asyncio.sleep(0.3)
        if len(steps) == n and sessions_idle(toy):
            return
        assert time.monotonic() - t0 < 2.0, "the turn kept running after the client left"


async def test_a_client_that_disconnects_stops_the_turn(stack, client):
    toy, _ = stack
    steps: list[int] = []
    token = toy.engines._token

    def counting(*parts: bytes) -> int:
        steps.append(1)
        return token(*parts)

    toy.engines._token = counting  # type: ignore[method-assign]
    toy.engines.step_delay_s = 0.05  # 200 tokens take 10 s
    try:
        msgs = [{"role": "user", "content": "a long answer please"}]
        stream = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=200, stream=True)
        got = 0
        async for _ in stream:
            got += 1
            if got == 3:
                break
        await stream.close()
        await _decoding_stops(toy, steps)
        assert len(steps) < 50
        # the same for a non-streaming request whose client gives up
        steps.clear()
        impatient = client.with_options(timeout=0.5)
        with pytest.raises(openai.APITimeoutError):
            msgs2 = [{"role": "user", "content": "another long answer"}]
            await impatient.chat.completions.create(model=MODEL, messages=msgs2, max_tokens=200)
        assert steps  # it was decoding
        await _decoding_stops(toy, steps)
        assert len(steps) < 50
    finally:
        toy.engines.step_delay_s = 0.0
        del toy.engines._token
    r = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length" and len(r.choices[0].message.content) == 4
    assert tandem_of(r)["session_id"]  # the conversation's session was released


async def test_out_of_range_values_and_huge_bodies_are_400_and_413(stack, client):
    """Out-of-range integers and temperatures are HTTP 400, not 500; a body over 4 MiB is 413 before it is
    buffered."""
    import httpx

    from tandem.edge.metrics import REQUESTS

    for extra in ({"stop_token_ids": [-1]}, {"stop_token_ids": [2**32]}, {"top_k": 2**31}):
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body=extra
            )
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=3)
    _, port = stack
    async with httpx.AsyncClient() as h:
        big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * (5 << 20)}]}
        r = await h.post(
            f"http://127.0.0.1:{port}/v1/chat/completions", json=big, headers={"authorization": f"Bearer {KEY}"}
        )
        assert r.status_code == 413 and r.json()["error"]["message"]

    # a stream read to its end counts as a completed turn, not a cancelled one
    def completed() -> float:  # whichever mode the edge chose
        return sum(REQUESTS.labels(m, "ok")._value.get() for m in ("split", "direct", "local"))

    before = completed()
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "count"}], max_tokens=3, temperature=0, stream=True
    )
    async for _ in stream:
        pass
    for _ in range(250):
        if completed() > before:
            break
        await asyncio.sleep(0.02)
    assert completed() == before + 1


# every string field of both endpoints, with a lone surrogate (JSON escape) or a NUL in it
NOT_TEXT_BODIES = [
    ("chat/completions", {"messages": [{"role": "user", "content": "\ud800 hi"}]}),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}, {"role": "user\x00", "content": "x"}]}),
    ("chat/completions", {"messages": [{"role": "user", "content": "a\x00b"}]}),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi", "name": "\ud83d"}]}),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": ["ok", "\udc00"]}),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": "\x00"}),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "session_id": "s\ud800"}),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "user": "\ud800"}),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "metadata": {"\ud800": "x"}}),
    ("completions", {"prompt": "\udfff"}),
    ("completions", {"prompt": ["\ud800"]}),
    ("completions", {"prompt": "hi", "stop": ["\x00"]}),
    ("completions", {"prompt": "hi", "user": "a\x00"}),
    ("completions", {"prompt": "hi", "suffix": "\ud800"}),
]


@pytest.mark.parametrize(("endpoint", "body"), NOT_TEXT_BODIES)
async def test_strings_that_are_not_text_are_400_in_every_field(stack, endpoint, body):
    """A string that is not text (a lone UTF-16 surrogate such as ``"\\ud800 hi"``) in a chat message,
    a text content part or a completion prompt is HTTP 400 in OpenAI's shape, checked before any
    work (``common.protocol.text``), never a 500 from the tokenizer."""
    _, port = stack
    payload = json.dumps({"model": MODEL, "max_tokens": 2, **body})  # ensure_ascii: surrogates stay escapes
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as h:
        r = await h.post(
            f"/v1/{endpoint}",
            content=payload.encode(),
            headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"},
        )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "not valid text" in err["message"] and err["type"] == "invalid_request_error"


async def test_a_model_name_that_is_not_text_is_400(stack):
    _, port = stack
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as h:
        r = await h.get("/v1/models/a%00b", headers={"authorization": f"Bearer {KEY}"})
        assert r.status_code == 400 and "not valid text" in r.json()["error"]["message"]
        body = json.dumps({"model": "to\ud800y", "messages": [{"role": "user", "content": "hi"}]})
        r = await h.post(
            "/v1/chat/completions",
            content=body.encode(),
            headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"},
        )
        assert r.status_code == 400 and "not valid text" in r.json()["error"]["message"]


async def test_the_openai_client_gets_a_bad_request_for_a_nul(client):
    with pytest.raises(openai.BadRequestError, match="not valid text"):
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a\x00b"}])
    with pytest.raises(openai.BadRequestError, match="not valid text"):
        await client.completions.create(model=MODEL, prompt="hi", stop=["\x00"])


# --- every validation error in OpenAI's shape -------------------------------------------------------

HI = [{"role": "user", "content": "hi"}]
# (endpoint, body without "model" unless given, status, param, code): each refusal as OpenAI writes it
REFUSALS = [
    (
        "chat/completions",
        {"messages": [*HI, {"role": "tool", "content": "x"}]},
        400,
        "messages.[1].role",
        "invalid_value",
    ),
    ("chat/completions", {"messages": [{"role": "root", "content": "x"}]}, 400, "messages.[0].role", "invalid_value"),
    ("chat/completions", {"messages": HI, "n": 2}, 400, "n", "unsupported_value"),
    ("chat/completions", {"messages": HI, "temperature": 3}, 400, "temperature", "decimal_above_max_value"),
    ("chat/completions", {"messages": HI, "top_p": 0}, 400, "top_p", "decimal_below_min_value"),
    ("chat/completions", {"messages": HI, "max_tokens": 0}, 400, "max_tokens", "integer_below_min_value"),
    ("chat/completions", {"messages": HI, "max_tokens": 10**6}, 400, "max_tokens", "integer_above_max_value"),
    ("chat/completions", {"messages": HI, "seed": 2**64}, 400, "seed", "integer_above_max_value"),
    ("chat/completions", {}, 400, "messages", "missing_required_parameter"),
    ("chat/completions", {"messages": []}, 400, "messages", "empty_array"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages.[0].content", "invalid_type"),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]},
        400,
        "messages.[0].content.[0].type",
        "unsupported_value",
    ),
    ("chat/completions", {"messages": [{"content": "x"}]}, 400, "messages.[0].role", "missing_required_parameter"),
    ("chat/completions", {"messages": HI, "stop": ["s"] * 17}, 400, "stop", "array_above_max_length"),
    ("chat/completions", {"messages": HI, "stop": ["ok", "x" * 257]}, 400, "stop.[1]", "string_above_max_length"),
    ("chat/completions", {"messages": HI, "user": "u" * 257}, 400, "user", "string_above_max_length"),
    (
        "chat/completions",
        {"messages": HI, "stop_token_ids": [3, -1]},
        400,
        "stop_token_ids.[1]",
        "integer_below_min_value",
    ),
    ("chat/completions", {"messages": HI, "mode": "fast"}, 400, "mode", "invalid_value"),
    ("chat/completions", {"messages": HI, "mode": "local"}, 400, "mode", "unsupported_value"),
    ("chat/completions", {"messages": HI, "logprobs": True}, 400, "logprobs", "unsupported_parameter"),
    ("chat/completions", {"messages": HI, "tools": [{"type": "function"}]}, 400, "tools", "unsupported_parameter"),
    ("chat/completions", {"messages": HI, "logit_bias": {"1": 2}}, 400, "logit_bias", "unsupported_parameter"),
    ("chat/completions", {"messages": HI, "frequency_penalty": 1}, 400, "frequency_penalty", "unsupported_value"),
    (
        "chat/completions",
        {"messages": HI, "response_format": {"type": "json_object"}},
        400,
        "response_format.type",
        "unsupported_value",
    ),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "\ud800"}]},
        400,
        "messages.[0].content",
        "invalid_value",
    ),
    ("chat/completions", {"model": None, "messages": HI}, 400, "model", "invalid_type"),
    ("chat/completions", {"model": "gpt-4o", "messages": HI}, 404, "model", "model_not_found"),
    ("completions", {}, 400, "prompt", "missing_required_parameter"),
    ("completions", {"prompt": [1, 2, 3]}, 400, "prompt", "invalid_type"),
    ("completions", {"prompt": ""}, 400, "prompt", "invalid_value"),
    ("completions", {"prompt": "hi", "echo": True}, 400, "echo", "unsupported_parameter"),
    ("completions", {"prompt": "hi", "best_of": 3}, 400, "best_of", "unsupported_parameter"),
    ("completions", {"prompt": "hi", "suffix": "x"}, 400, "suffix", "unsupported_parameter"),
    ("completions", {"prompt": "hi", "stop": "x" * 257}, 400, "stop", "string_above_max_length"),
    ("completions", {"prompt": ["\udfff"]}, 400, "prompt.[0]", "invalid_value"),
]


def _body(body: dict) -> dict:
    return {"model": MODEL, **body}


@pytest.mark.parametrize(("endpoint", "body", "status", "param", "code"), REFUSALS)
async def test_every_refusal_has_openais_shape(stack, client, endpoint, body, status, param, code):
    """Every refusal (an unsupported role among them) has its parameter in ``param``, the kind in
    ``type`` and OpenAI's ``code``, in the raw body and as the ``openai`` client reads it."""
    _, port = stack
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as h:
        r = await h.post(
            f"/v1/{endpoint}",
            content=json.dumps(_body(body)).encode(),
            headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"},
        )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, code), err
    if "\\ud" in json.dumps(body):  # the openai client cannot send a lone surrogate (it encodes UTF-8)
        return
    with pytest.raises(openai.APIStatusError) as ei:
        await client.post(f"/{endpoint}", body=_body(body), cast_to=httpx.Response)
    assert ei.value.status_code == status
    assert isinstance(ei.value, openai.NotFoundError if status == 404 else openai.BadRequestError)
    assert (ei.value.type, ei.value.param, ei.value.code) == ("invalid_request_error", param, code)


async def test_transport_level_refusals_have_openais_shape(stack):
    """A body that is not JSON, a body too large, an unknown URL or method, a wrong key: OpenAI's
    shape, ``param`` and ``code`` null where OpenAI's are (``invalid_api_key`` for the key)."""
    _, port = stack
    auth = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as h:
        cases = [
            (await h.post("/v1/chat/completions", content=b"{not json", headers=auth), 400, None, "could not parse"),
            (await h.post("/v1/chat/completions", content=b"[1]", headers=auth), 400, "invalid_type", "dictionary"),
            (await h.post("/v1/chat/completions", content=b"x" * (5 << 20), headers=auth), 413, None, "over"),
            (await h.post("/v1/nothing", content=b"{}", headers=auth), 404, None, "Invalid URL (POST /v1/nothing)"),
            (await h.delete("/v1/models", headers=auth), 405, None, "DELETE /v1/models"),
            (
                await h.get("/v1/models", headers={"authorization": "Bearer sk-wrong"}),
                401,
                "invalid_api_key",
                "API key",
            ),
        ]
    for r, status, code, words in cases:
        err = r.json()["error"]
        assert r.status_code == status and set(err) == {"message", "type", "param", "code"}, r.text
        assert err["type"] == "invalid_request_error" and err["param"] is None and err["code"] == code, err
        assert words in err["message"], err


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_a_body_over_the_limit_is_413_whether_its_length_is_announced_or_streamed(stack, path):
    """A body sent without a length (chunked) that grows past 4 MiB is 413 in OpenAI's shape, as one
    that announces its length is: not the 400 of a body that does not parse. A chunked body within
    the limit is served, and the edge serves the next request."""
    _, port = stack
    auth = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    if path == "/v1/completions":
        body = {"model": MODEL, "prompt": "x" * (5 << 20), "max_tokens": 2}
    else:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * (5 << 20)}], "max_tokens": 2}
    big = json.dumps(body).encode()

    async def chunked(data: bytes):  # no content-length: httpx sends it chunked
        for i in range(0, len(data), 64 << 10):
            yield data[i : i + (64 << 10)]

    small = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=20) as h:
        for r in (
            await h.post(path, content=chunked(big), headers=auth),
            await h.post(path, content=big, headers=auth),
        ):
            err = r.json()["error"]
            assert r.status_code == 413 and "over 4194304 bytes" in err["message"], r.text
            assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", None, None)
        r = await h.post("/v1/chat/completions", content=chunked(small), headers=auth)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text


async def test_the_log_lines_of_a_request_name_its_api_key_by_its_name(client):
    """Every line of an authenticated request carries ``caller=key:<the key's name>`` (never the key)."""
    import io
    import logging

    from tandem.common.runtime.logs import setup_logging
    from tandem.common.runtime.security import key_name

    buf = io.StringIO()
    root = logging.getLogger()
    level = root.level
    handler = setup_logging("text", "DEBUG", stream=buf)
    try:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * 20_000}])
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    turns = [x for x in buf.getvalue().splitlines() if " tandem.edge " in x and "turn " in x]
    assert any("turn done" in x for x in turns) and any("turn refused" in x for x in turns)
    assert all(f"caller=key:{key_name(KEY)}]" in x for x in turns) and KEY not in buf.getvalue()


async def test_health_and_metrics_answer_without_a_key(stack, monkeypatch):
    """``/health`` and ``/metrics`` where the HTTP API listens, as vLLM's server has them: a probe or a
    scraper needs no API key; health is 503 once no mode can serve."""
    toy, port = stack
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
        r = await http.get("/health")
        assert r.status_code == 200 and r.json()["status"] == "SERVING" and "split" in r.json()["modes"]
        r = await http.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        assert "tandem:requests_total" in r.text
        monkeypatch.setattr(toy.edge, "routes", lambda: [])
        r = await http.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "NOT_SERVING"
        assert (await http.get("/v1/models")).status_code == 401  # the API itself still needs its key


async def test_a_port_in_use_is_an_oserror_that_names_it(stack):
    import socket

    toy, _ = stack
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot bind the HTTP API to 127.0.0.1:{port}"):
            await serve_openai(create_openai_app(toy.edge, MODEL), "127.0.0.1", port)
