"""One verdict per request, whatever the mode: a request outside what the model, the edge or the
cloud accepts is refused with the same status and message in auto, local, split and direct mode,
because the edge checks it once, against the limits every mode shares, before choosing a route.
Each mode's own check (local mode's, the cloud's on the wire) is the same function, so where one
refuses on its own it says the same."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import replace

import pytest

from tandem.cloud.config import EngineConfig
from tandem.cloud.uploads.upload import check_header
from tandem.common.protocol.errors import OPENAI_CODES, TandemError
from tandem.common.protocol.grpc_errors import status_details, status_of
from tandem.common.protocol.limits import RequestLimits
from tandem.common.protocol.modes import Mode
from tandem.common.protocol.params import Sampling
from tandem.common.wire.messages import TurnHeader
from tandem.edge.events import ChatTurn, TurnDone
from tandem.v1 import tandem_pb2 as pb
from tests.doubles import MANIFEST, VOCAB, B, K, MemoryLocal, toy_stack

MAX_PROMPT_TOKENS = 100  # the cloud's bound on prompts (the edge's own is 1536)
MAX_MODEL_LEN_TOKENS = 300  # the cloud's engines' max_model_len (the local model's positions are 4096)
MAX_NEW_TOKENS = 250  # the cloud's bound on max_new_tokens (the edge's own is 4096)
MODES = (Mode.AUTO, Mode.LOCAL, Mode.SPLIT, Mode.DIRECT)


@pytest.fixture
async def toy():
    t = await toy_stack(
        max_prompt_tokens=MAX_PROMPT_TOKENS,
        max_new_tokens=MAX_NEW_TOKENS,
        engine=EngineConfig(block_size_tokens=B, max_model_len_tokens=MAX_MODEL_LEN_TOKENS),
    )
    t.edge.local = MemoryLocal()
    yield t
    await t.batcher.stop()


def text_of(prompt_tokens: int) -> str:
    """A user message whose chat-templated prompt is ``prompt_tokens`` tokens (role, text, end, reply role)."""
    return "x" * (prompt_tokens - 3)


def request(mode: Mode, *, tokens: int = 40, session: str = "s", **sampling) -> ChatTurn:
    s = Sampling(**{"max_new_tokens": 4, **sampling})
    return ChatTurn(messages=(("user", text_of(tokens)),), prompt="", session_id=session, sampling=s, mode=mode)


# (what is wrong, the request's arguments beside its mode)
BAD = [
    ("stop id = vocab size", dict(stop_token_ids=(VOCAB,))),
    ("stop id far past the vocabulary", dict(stop_token_ids=(1, 2**31))),
    ("negative stop id", dict(stop_token_ids=(-1,))),
    ("65 stop ids", dict(stop_token_ids=tuple(range(65)))),
    ("prompt too long for the cloud", dict(tokens=MAX_PROMPT_TOKENS + 1)),
    ("max_new_tokens past max_model_len", dict(tokens=MAX_PROMPT_TOKENS, max_new_tokens=MAX_NEW_TOKENS)),
    ("max_new_tokens past the cloud's bound", dict(max_new_tokens=MAX_NEW_TOKENS + 1)),
    ("max_new_tokens past the edge's own bound", dict(max_new_tokens=5000)),
    ("max_new_tokens 0", dict(max_new_tokens=0)),
    ("negative max_new_tokens", dict(max_new_tokens=-3)),
    ("temperature above 2", dict(temperature=3.0)),
    ("negative temperature", dict(temperature=-0.5)),
    ("temperature NaN", dict(temperature=math.nan)),
    ("top_p 0", dict(top_p=0.0)),
    ("top_p above 1", dict(top_p=1.5)),
    ("top_k below -1", dict(top_k=-2)),
    ("top_k past the wire's int32", dict(top_k=2**31)),
    ("seed past 64 bits", dict(seed=2**63, temperature=1.0)),
    ("session id longer than 128 bytes", dict(session="é" * 65)),
]


async def verdict(toy, turn: ChatTurn) -> tuple[str, str, str | None, str | None]:
    """(gRPC status name, status details, field, OpenAI code) of a refused turn, ("OK", "", None,
    None) of one that ran."""
    try:
        async for ev in toy.edge.chat(turn):
            if isinstance(ev, TurnDone):
                assert ev.mode in (Mode.LOCAL, Mode.SPLIT, Mode.DIRECT)
    except TandemError as e:
        return status_of(e).name, status_details(e), e.param, e.code
    return "OK", "", None, None


def split_args(args: dict) -> tuple[dict, dict]:
    args = dict(args)
    turn_kw = {k: args.pop(k) for k in ("tokens", "session") if k in args}
    return turn_kw, args


@pytest.mark.parametrize(("what", "args"), BAD, ids=[w for w, _ in BAD])
async def test_a_bad_request_gets_one_verdict_in_every_mode(toy, what, args):
    turn_kw, sampling = split_args(args)
    verdicts = {m: await verdict(toy, request(m, **turn_kw, **sampling)) for m in MODES}
    verdicts[Mode.AUTO, "again"] = {await verdict(toy, request(Mode.AUTO, **turn_kw, **sampling)) for _ in range(12)}
    first = verdicts[Mode.AUTO]
    assert first[0] == "INVALID_ARGUMENT", (what, verdicts)
    assert first[2] and first[3] in OPENAI_CODES, (what, first)  # the field named, OpenAI's code
    assert all(v == first for m, v in verdicts.items() if m in MODES), (what, verdicts)
    assert verdicts[Mode.AUTO, "again"] == {first}, (what, verdicts)
    assert not toy.edge.local.calls and not toy.engines.calls  # refused before any mode ran


async def test_requests_at_the_bounds_run_in_every_mode(toy):
    """The control: the largest prompt, output and stop ids every mode accepts run in each."""
    edge_cases = [
        dict(stop_token_ids=(VOCAB - 1, 0)),
        dict(stop_token_ids=tuple(range(64))),
        dict(tokens=MAX_PROMPT_TOKENS, max_new_tokens=MAX_MODEL_LEN_TOKENS - MAX_PROMPT_TOKENS),
        dict(max_new_tokens=MAX_NEW_TOKENS),
        dict(temperature=2.0, top_p=1.0, top_k=0, seed=-1),
        dict(temperature=1.0, top_k=-1),  # vLLM's off
        dict(temperature=1.0, top_k=2**31 - 1, seed=-(2**63)),  # a top_k past the vocabulary is off
        dict(session="é" * 64),
    ]
    for args in edge_cases:
        turn_kw, sampling = split_args(args)
        for m in MODES:
            assert (await verdict(toy, request(m, **turn_kw, **sampling)))[0] == "OK", (args, m)


async def test_the_cloud_bounds_stay_while_its_link_is_down(toy):
    """A request the cloud would refuse is refused in local mode also while the cloud is not
    connected: the edge keeps the limits it last negotiated, so the verdict does not follow the link."""
    before = await verdict(toy, request(Mode.LOCAL, max_new_tokens=MAX_NEW_TOKENS + 1))
    toy.edge.conn.connected.clear()
    assert not toy.edge.routes() or all(r.mode is Mode.LOCAL for r in toy.edge.routes())
    assert await verdict(toy, request(Mode.LOCAL, max_new_tokens=MAX_NEW_TOKENS + 1)) == before
    assert await verdict(toy, request(Mode.AUTO, max_new_tokens=MAX_NEW_TOKENS + 1)) == before
    assert before[0] == "INVALID_ARGUMENT"


# what the model itself bounds, which local mode and the cloud refuse on their own too; values the
# wire cannot carry (a negative stop id, a top_k past int32, a seed past int64) are not among them:
# only the edge's check can refuse those, before anything is encoded
UNCARRIED = ("negative stop id", "top_k past the wire's int32", "seed past 64 bits")
MODEL_BOUNDS = [(w, a) for w, a in BAD if not {"tokens", "session", "max_new_tokens"} & set(a) and w not in UNCARRIED]


@pytest.mark.parametrize(("what", "args"), MODEL_BOUNDS, ids=[w for w, _ in MODEL_BOUNDS])
async def test_each_mode_own_check_says_the_same(toy, monkeypatch, what, args):
    """With the edge's up-front check taken away, local mode and the cloud (split and direct) still
    refuse what the model cannot take, with one message: their checks are the same function."""
    monkeypatch.setattr(toy.edge, "validate", lambda request, ids: None)
    verdicts = {m: await verdict(toy, request(m, **args)) for m in (Mode.LOCAL, Mode.SPLIT, Mode.DIRECT)}
    assert len(set(verdicts.values())) == 1 and verdicts[Mode.LOCAL][0] == "INVALID_ARGUMENT", (what, verdicts)


async def test_the_cloud_checks_the_header_with_the_limits_it_negotiated(toy):
    """The limits the edge applies are those the cloud checks on the wire, message for message."""
    p = toy.edge.conn.params(0)
    assert (p.max_prompt_tokens, p.max_new_tokens, p.max_model_len_tokens, p.vocab_size) == (
        MAX_PROMPT_TOKENS,
        MAX_NEW_TOKENS,
        MAX_MODEL_LEN_TOKENS,
        VOCAB,
    )
    assert toy.edge.limits == RequestLimits(
        vocab_size=VOCAB,
        max_prompt_tokens=MAX_PROMPT_TOKENS,
        max_new_tokens=MAX_NEW_TOKENS,
        max_model_len_tokens=MAX_MODEL_LEN_TOKENS,
    )
    for _, args in BAD:
        turn_kw, sampling = split_args(args)
        t = request(Mode.DIRECT, **turn_kw, **sampling)
        if len(t.session_id.encode()) > 128:
            continue
        edge = await verdict(toy, t)
        ids = toy.edge.tokenize(t) if turn_kw.get("tokens", 0) <= MAX_PROMPT_TOKENS else [1] * turn_kw["tokens"]
        header = TurnHeader(
            request_id="r",
            session_id="",
            params_version=p.params_version,
            split_layer=0,
            prompt_token_ids=tuple(ids),
            cached_tokens=0,
            num_chunks=0,
            num_kv_blocks=0,
            sampling=t.sampling,
            link_id=toy.edge.conn.link_id,
        )
        with pytest.raises(TandemError) as e:
            check_header(header, p, MANIFEST)
        assert (status_of(e.value).name, status_details(e.value)) == edge[:2]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
async def test_http_refusals_name_the_requests_own_fields_wherever_the_message_names_one(toy, field):
    """A refusal over HTTP says the HTTP request's names, in its ``param`` and all through its
    message, whichever field it is about: a prompt too long for the model length with the output
    asked for names ``messages`` (or ``prompt``) and the request's own ``max_tokens`` /
    ``max_completion_tokens``, never the gRPC API's ``max_new_tokens``."""
    import httpx

    from tandem.edge.api.http_api import create_openai_app

    app = create_openai_app(toy.edge, "toy")
    chat = {"messages": [{"role": "user", "content": text_of(MAX_PROMPT_TOKENS)}], field: MAX_NEW_TOKENS}
    text = {"prompt": "x" * MAX_PROMPT_TOKENS, "max_tokens": MAX_NEW_TOKENS}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://edge") as h:
        for endpoint, body, prompt_param, named in (
            ("chat/completions", chat, "messages", field),
            ("completions", text, "prompt", "max_tokens"),
        ):
            r = await h.post(f"/v1/{endpoint}", json={"model": "toy", **body})
            err = r.json()["error"]
            assert r.status_code == 400 and (err["param"], err["code"]) == (prompt_param, "context_length_exceeded")
            assert f"{named} ({MAX_NEW_TOKENS})" in err["message"] and "max_new_tokens" not in err["message"], err


def test_limits_narrow_bound_by_bound():
    a, b = (
        RequestLimits(vocab_size=1000, max_prompt_tokens=1536, max_new_tokens=4096, max_model_len_tokens=0),
        RequestLimits(vocab_size=0, max_prompt_tokens=100, max_new_tokens=512, max_model_len_tokens=2048),
    )
    assert (
        a.narrowed(b)
        == b.narrowed(a)
        == RequestLimits(vocab_size=1000, max_prompt_tokens=100, max_new_tokens=512, max_model_len_tokens=2048)
    )
    assert replace(a, vocab_size=0).narrowed(RequestLimits()) == replace(a, vocab_size=0)


async def test_local_mode_of_the_real_model_takes_any_64_bit_seed_and_refuses_stop_ids_past_its_vocabulary(split_dir):
    """``LocalEngine`` (``edge-full.onnx``): a negative seed is a seed there as in vLLM, and a stop
    id past the vocabulary is refused with the cloud's message."""
    from tandem.common.protocol.manifest import FULL_ONNX, SplitManifest
    from tandem.edge.compute.local import LocalEngine

    shape = SplitManifest.load(split_dir).shape
    engine = LocalEngine(split_dir.parent / FULL_ONNX, shape, (), 1)
    s = Sampling(max_new_tokens=2, temperature=1.0, seed=-7)
    runs = [[t.token_id async for t in engine.generate([1, 2, 3], s)] for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 2
    v = shape.vocab_size
    with pytest.raises(TandemError) as e:
        async for _ in engine.generate([1, 2, 3], Sampling(max_new_tokens=2, stop_token_ids=(v,))):
            pass
    assert str(e.value) == f"stop_token_ids.[0] must be an integer in [0, {v - 1}], got {v}"
    assert (e.value.param, e.value.code) == ("stop_token_ids.[0]", "integer_above_max_value")


# --- one verdict per field on every surface: gRPC, the SDK, the HTTP API ----------------------------

SURFACE_MODEL = "toy"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
async def surfaces():
    """The toy edge behind its gRPC API (raw stub and the SDK's ``AsyncClient``) and its HTTP API."""
    import tandem
    from tandem.common.runtime.grpc_setup import add_service, start_server
    from tandem.edge.api.grpc_service import EDGE_SERVICE, EdgeServicer
    from tandem.edge.api.http_api import create_openai_app, serve_openai, stop_openai

    toy = await toy_stack()
    server, port, _ = await start_server(
        [lambda s: add_service(s, EdgeServicer(toy.edge, "toy"), "Edge")], [EDGE_SERVICE], "127.0.0.1", 0, 1 << 20
    )
    app = create_openai_app(toy.edge, SURFACE_MODEL)
    http, task, http_port = await serve_openai(app, "127.0.0.1", 0)
    client = tandem.AsyncClient(f"127.0.0.1:{port}", timeout_s=20)
    yield toy, port, client, http_port
    await client.close()
    await stop_openai(http, task, grace_s=1.0)
    await server.stop(0)
    await toy.batcher.stop()


def _role(r, role: str) -> None:
    r.messages[0].role = role


def _content(r, content: str) -> None:
    r.messages[0].content = content


def _sampling(**kw):
    def set_(r) -> None:
        for k, v in kw.items():
            setattr(r.sampling, k, v)

    return set_


def _stop(*stop: str):
    def set_(r) -> None:
        del r.stop[:]
        r.stop.extend(stop)

    return set_


def _stop_ids(*ids: int):
    def set_(r) -> None:
        del r.sampling.stop_token_ids[:]
        r.sampling.stop_token_ids.extend(ids)

    return set_


def _field(**kw):
    def set_(r) -> None:
        for k, v in kw.items():
            setattr(r, k, v)

    return set_


def _no_messages(r) -> None:
    del r.messages[:]


# (what, the SDK's chat() arguments, the raw gRPC request's change (None: protobuf cannot carry the
# value), the HTTP body's fields, the field (the SDK's and gRPC's name, then HTTP's when it differs),
# OpenAI's code). Each row's verdict is a refusal naming that field with that code on every surface.
FIELDS = [
    ("temperature above 2", dict(temperature=3.0), _sampling(temperature=3.0), dict(temperature=3.0),
     "temperature", None, "decimal_above_max_value"),
    ("negative temperature", dict(temperature=-0.5), _sampling(temperature=-0.5), dict(temperature=-0.5),
     "temperature", None, "decimal_below_min_value"),
    ("top_p above 1", dict(top_p=1.5), _sampling(top_p=1.5), dict(top_p=1.5), "top_p", None,
     "decimal_above_max_value"),
    ("negative top_p", dict(top_p=-0.1), _sampling(top_p=-0.1), dict(top_p=-0.1), "top_p", None,
     "decimal_below_min_value"),
    ("top_k below -1", dict(top_k=-2), _sampling(top_k=-2), dict(top_k=-2), "top_k", None,
     "integer_below_min_value"),
    ("top_k past int32", dict(top_k=2**31), None, dict(top_k=2**31), "top_k", None, "integer_above_max_value"),
    ("seed past 64 bits", dict(seed=2**63), None, dict(seed=2**63), "seed", None, "integer_above_max_value"),
    ("max_new_tokens 0", dict(max_new_tokens=0), _sampling(max_new_tokens=0), dict(max_tokens=0),
     "max_new_tokens", "max_tokens", "integer_below_min_value"),
    ("max_new_tokens past the edge's bound", dict(max_new_tokens=10**6), _sampling(max_new_tokens=10**6),
     dict(max_tokens=10**6), "max_new_tokens", "max_tokens", "integer_above_max_value"),
    ("max_completion_tokens past the edge's bound", dict(max_new_tokens=10**6), _sampling(max_new_tokens=10**6),
     dict(max_completion_tokens=10**6), "max_new_tokens", "max_completion_tokens", "integer_above_max_value"),
    ("stop token id out of the vocabulary", dict(stop_token_ids=[1, VOCAB]), _stop_ids(1, VOCAB),
     dict(stop_token_ids=[1, VOCAB]), "stop_token_ids.[1]", None, "integer_above_max_value"),
    ("negative stop token id", dict(stop_token_ids=[-1]), None, dict(stop_token_ids=[-1]), "stop_token_ids.[0]",
     None, "integer_below_min_value"),
    ("65 stop token ids", dict(stop_token_ids=list(range(65))), _stop_ids(*range(65)),
     dict(stop_token_ids=list(range(65))), "stop_token_ids", None, "array_above_max_length"),
    ("an empty stop string", dict(stop=["ok", ""]), _stop("ok", ""), dict(stop=["ok", ""]), "stop.[1]", None,
     "invalid_value"),
    ("17 stop strings", dict(stop=["s"] * 17), _stop(*["s"] * 17), dict(stop=["s"] * 17), "stop", None,
     "array_above_max_length"),
    ("a stop string too long", dict(stop=["x" * 257]), _stop("x" * 257), dict(stop=["x" * 257]), "stop.[0]", None,
     "string_above_max_length"),
    ("one stop string too long", dict(stop="x" * 257), _stop("x" * 257), dict(stop="x" * 257), "stop.[0]", "stop",
     "string_above_max_length"),
    ("one empty stop string", dict(stop=""), _stop(""), dict(stop=""), "stop.[0]", "stop", "invalid_value"),
    ("a NUL in a stop string", dict(stop=["a\x00"]), _stop("a\x00"), dict(stop=["a\x00"]), "stop.[0]", None,
     "invalid_value"),
    ("role tool", dict(messages=[{"role": "tool", "content": "x"}]), lambda r: _role(r, "tool"),
     dict(messages=[{"role": "tool", "content": "x"}]), "messages.[0].role", None, "invalid_value"),
    ("no role", dict(messages=[{"content": "x"}]), lambda r: _role(r, ""), dict(messages=[{"content": "x"}]),
     "messages.[0].role", None, "missing_required_parameter"),
    ("messages a string", dict(messages="Hi"), None, dict(messages="Hi"), "messages", None, "invalid_type"),
    ("no messages", dict(messages=[]), _no_messages, dict(messages=[]), "messages", None, "empty_array"),
    ("a NUL in a message", dict(messages=[{"role": "user", "content": "a\x00b"}]), lambda r: _content(r, "a\x00b"),
     dict(messages=[{"role": "user", "content": "a\x00b"}]), "messages.[0].content", None, "invalid_value"),
    ("a prompt too long", dict(messages=[{"role": "user", "content": "x" * 20_000}]),
     lambda r: _content(r, "x" * 20_000), dict(messages=[{"role": "user", "content": "x" * 20_000}]), "messages",
     None, "context_length_exceeded"),
    ("a NUL in the session id", dict(session_id="s\x00"), _field(session_id="s\x00"), dict(session_id="s\x00"),
     "session_id", None, "invalid_value"),
    ("a session id over 128 bytes", dict(session_id="é" * 65), _field(session_id="é" * 65),
     dict(session_id="é" * 65), "session_id", None, "string_above_max_length"),
    ("max_new_tokens a string", dict(max_new_tokens="5"), None, dict(max_tokens="5"), "max_new_tokens",
     "max_tokens", "invalid_type"),
    ("temperature a string", dict(temperature="0.5"), None, dict(temperature="0.5"), "temperature", None,
     "invalid_type"),
    ("ignore_eos not a bool", dict(ignore_eos=1), None, dict(ignore_eos=1), "ignore_eos", None, "invalid_type"),
    ("a stop string not a string", dict(stop=["ok", 5]), None, dict(stop=["ok", 5]), "stop.[1]", None,
     "invalid_type"),
    ("an unknown mode", dict(mode="fast"), _field(mode=99), dict(mode="fast"), "mode", None, "invalid_value"),
    ("a mode this edge lacks", dict(mode="local"), _field(mode=pb.MODE_LOCAL), dict(mode="local"), "mode", None,
     "unsupported_value"),
    ("split_layer without mode split", dict(split_layer=K), _field(split_layer=K), dict(split_layer=K),
     "split_layer", None, "invalid_value"),
    ("a split layer this edge lacks", dict(mode="split", split_layer=K + 5),
     _field(mode=pb.MODE_SPLIT, split_layer=K + 5), dict(mode="split", split_layer=K + 5), "split_layer", None,
     "unsupported_value"),
]  # fmt: skip


async def _grpc_verdict(port: int, request) -> tuple[str, str | None, str | None]:
    import grpc

    from tandem.v1 import tandem_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = pb_grpc.EdgeStub(ch).Chat(request, timeout=20)
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as e:
            md = dict(e.trailing_metadata() or ())
            return e.code().name, md.get("tandem-error-param"), md.get("tandem-error-code")
    return "OK", None, None


async def _sdk_verdict(client, kw: dict) -> tuple[str, str | None, str | None]:
    import tandem

    base = {"max_new_tokens": 4} if "prompt" in kw else {"messages": HI, "max_new_tokens": 4}
    try:
        async for _ in client.chat(**{**base, **kw}):
            pass
    except tandem.TandemClientError as e:
        return e.code.name, e.param, e.error_code
    return "OK", None, None


async def _http_verdict(
    port: int, body: dict, endpoint: str = "chat/completions"
) -> tuple[int, str | None, str | None]:
    import httpx

    base = {"model": SURFACE_MODEL, "max_tokens": 4} | ({"messages": HI} if endpoint == "chat/completions" else {})
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=20) as h:
        r = await h.post(f"/v1/{endpoint}", json={**base, **body})
    if r.status_code == 200:
        return 200, None, None
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error", err
    return r.status_code, err["param"], err["code"]


@pytest.mark.parametrize(
    ("what", "sdk", "raw", "http", "param", "http_param", "code"), FIELDS, ids=[row[0] for row in FIELDS]
)
async def test_a_bad_field_gets_one_verdict_on_every_surface(surfaces, what, sdk, raw, http, param, http_param, code):
    """The same bad value sent through the SDK, as a raw gRPC ``Chat`` and over HTTP is refused on
    each, naming the same field (``param``; HTTP's own name where it has one) with the same code from
    OpenAI's set: one check per field, whichever surface the request came in by."""
    from tandem.chat_request import build_request

    _, port, client, http_port = surfaces
    status = "FAILED_PRECONDITION" if code == "unsupported_value" else "INVALID_ARGUMENT"
    assert code in OPENAI_CODES
    assert await _sdk_verdict(client, sdk) == (status, param, code)
    if raw is not None:
        request = build_request(HI, max_new_tokens=4)
        raw(request)
        assert await _grpc_verdict(port, request) == (status, param, code)
    assert await _http_verdict(http_port, http) == (400, http_param or param, code)


# (what, the SDK's chat(prompt=...) arguments and the /v1/completions body, the field, OpenAI's code)
PROMPT_FIELDS = [
    ("a prompt too long", dict(prompt="x" * 20_000), "prompt", "context_length_exceeded"),
    ("a NUL in the prompt", dict(prompt="a\x00"), "prompt", "invalid_value"),
    ("a stop token id out of the vocabulary", dict(prompt="hi", stop_token_ids=[VOCAB]), "stop_token_ids.[0]",
     "integer_above_max_value"),
    ("top_p above 1", dict(prompt="hi", top_p=2.0), "top_p", "decimal_above_max_value"),
]  # fmt: skip


@pytest.mark.parametrize(("what", "kw", "param", "code"), PROMPT_FIELDS, ids=[row[0] for row in PROMPT_FIELDS])
async def test_a_bad_field_of_a_raw_prompt_gets_one_verdict_on_every_surface(surfaces, what, kw, param, code):
    """A raw prompt (the SDK's ``prompt=``, ``/v1/completions``): the same field and code on both."""
    _, _, client, http_port = surfaces
    assert await _sdk_verdict(client, kw) == ("INVALID_ARGUMENT", param, code)
    assert await _http_verdict(http_port, kw, "completions") == (400, param, code)


# Every float field of a request with a value below and one above its range: ``Sampling``'s (gRPC,
# the SDK, HTTP) and the HTTP API's own; with NaN, +inf and -inf too, each is a row of the table below.
FLOAT_FIELDS = {"temperature": (-0.5, 2.5), "top_p": (-0.1, 1.5)}
HTTP_FLOAT_FIELDS = {"presence_penalty": (-2.5, 2.5), "frequency_penalty": (-2.5, 2.5)}


def _float_rows(fields: dict[str, tuple[float, float]]) -> list[tuple[str, float, str]]:
    """(field, value, OpenAI's code) for NaN, +/-inf and a value below and above each field's range."""
    rows = []
    for name, (below, above) in fields.items():
        rows += [
            (name, math.nan, "invalid_value"),
            (name, math.inf, "decimal_above_max_value"),
            (name, -math.inf, "decimal_below_min_value"),
            (name, below, "decimal_below_min_value"),
            (name, above, "decimal_above_max_value"),
        ]
    return rows


def test_the_float_tables_name_every_float_field():
    """A float field added to ``Sampling`` or to the HTTP request models is in the tables above, so
    its NaN, infinities and out-of-range values are tried on every surface."""
    import typing

    from tandem.edge.api.request_models import ChatRequest, CompletionRequest

    hints = typing.get_type_hints(Sampling)
    assert {f.name for f in dataclasses.fields(Sampling) if hints[f.name] is float} == set(FLOAT_FIELDS)
    http = {
        name
        for model in (ChatRequest, CompletionRequest)
        for name, f in model.model_fields.items()
        if f.annotation in (float, float | None)
    }
    assert http == set(FLOAT_FIELDS) | set(HTTP_FLOAT_FIELDS)


async def _grpc_refusal(port: int, request) -> tuple[str, str, str | None, str | None]:
    """(status name, details, field, code) of a raw gRPC ``Chat`` that is refused."""
    import grpc

    from tandem.v1 import tandem_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = pb_grpc.EdgeStub(ch).Chat(request, timeout=20)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            async for _ in call:
                pass
    md = dict(ei.value.trailing_metadata() or ())
    return ei.value.code().name, ei.value.details(), md.get("tandem-error-param"), md.get("tandem-error-code")


async def _http_refusal(port: int, body: dict) -> tuple[int, dict]:
    """(status, error object) of a chat completion whose JSON body is ``body`` (NaN and the
    infinities as Python's json writes them: ``NaN``, ``Infinity``, ``-Infinity``)."""
    import httpx

    payload = json.dumps({"model": SURFACE_MODEL, "max_tokens": 4, "messages": HI, **body})
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=20) as h:
        r = await h.post("/v1/chat/completions", content=payload, headers={"content-type": "application/json"})
    return r.status_code, r.json().get("error") or {}


@pytest.mark.parametrize(("name", "value", "code"), _float_rows(FLOAT_FIELDS), ids=repr)
async def test_a_float_field_out_of_range_gets_one_message_and_code_over_grpc_and_http(surfaces, name, value, code):
    """NaN, +/-inf or a value outside the range of a sampling float: INVALID_ARGUMENT over gRPC and
    HTTP 400 in OpenAI's shape (streamed or not), with the same field, code and message on both (the
    SDK refuses it before sending, naming the same field and code)."""
    from tandem.chat_request import build_request

    _, port, client, http_port = surfaces
    request = build_request(HI, max_new_tokens=4)
    setattr(request.sampling, name, value)
    status, details, param, grpc_code = await _grpc_refusal(port, request)
    assert (status, param, grpc_code) == ("INVALID_ARGUMENT", name, code), details
    kind, _, message = details.partition(": ")
    assert kind == "InvalidRequest" and "must be a number in" in message and repr(value) in message
    for stream in (False, True):  # a stream is refused before it starts, the same way
        http_status, err = await _http_refusal(http_port, {name: value, "stream": stream})
        assert http_status == 400, err
        want = ("invalid_request_error", name, code, message)
        assert (err["type"], err["param"], err["code"], err["message"]) == want
    assert await _sdk_verdict(client, {name: value}) == ("INVALID_ARGUMENT", name, code)


# (what, the SDK's chat() arguments, the raw gRPC request's change (None: protobuf cannot carry it),
# the HTTP body's fields, the field (HTTP's name where it differs), the value, OpenAI's code, whether
# the SDK knows the bounds the edge checks (it checks the wire's range of max_new_tokens and of stop
# token ids; the edge narrows them to its limit and its vocabulary, and answers what the SDK sends))
INTEGERS = [
    ("top_k below -1", dict(top_k=-2), _sampling(top_k=-2), dict(top_k=-2), "top_k", None, -2,
     "integer_below_min_value", True),
    ("top_k past int32", dict(top_k=2**31), None, dict(top_k=2**31), "top_k", None, 2**31,
     "integer_above_max_value", True),
    ("seed past 64 bits", dict(seed=2**63), None, dict(seed=2**63), "seed", None, 2**63,
     "integer_above_max_value", True),
    ("seed below 64 bits", dict(seed=-(2**63) - 1), None, dict(seed=-(2**63) - 1), "seed", None, -(2**63) - 1,
     "integer_below_min_value", True),
    ("max_new_tokens 0", dict(max_new_tokens=0), _sampling(max_new_tokens=0), dict(max_tokens=0), "max_new_tokens",
     "max_tokens", 0, "integer_below_min_value", False),
    ("max_completion_tokens -1", dict(max_new_tokens=-1), None, dict(max_completion_tokens=-1), "max_new_tokens",
     "max_completion_tokens", -1, "integer_below_min_value", False),
    ("max_new_tokens past the edge's bound", dict(max_new_tokens=10**6), _sampling(max_new_tokens=10**6),
     dict(max_tokens=10**6), "max_new_tokens", "max_tokens", 10**6, "integer_above_max_value", True),
    ("stop token id out of the vocabulary", dict(stop_token_ids=[1, VOCAB]), _stop_ids(1, VOCAB),
     dict(stop_token_ids=[1, VOCAB]), "stop_token_ids.[1]", None, VOCAB, "integer_above_max_value", True),
    ("negative stop token id", dict(stop_token_ids=[-1]), None, dict(stop_token_ids=[-1]), "stop_token_ids.[0]",
     None, -1, "integer_below_min_value", False),
    ("negative split layer", dict(mode="split", split_layer=-1), None, dict(mode="split", split_layer=-1),
     "split_layer", None, -1, "integer_below_min_value", True),
]  # fmt: skip


async def _sdk_message(client, kw: dict) -> tuple[str, str | None, str | None, str]:
    """(status name, field, code, message) of a chat the SDK or the edge refuses."""
    import tandem

    with pytest.raises(tandem.TandemClientError) as ei:
        async for _ in client.chat(**{"messages": HI, "max_new_tokens": 4, **kw}):
            pass
    e = ei.value
    return e.code.name, e.param, e.error_code, str(e.details).removeprefix("InvalidRequest: ")


@pytest.mark.parametrize(
    ("what", "sdk", "raw", "http", "param", "http_param", "value", "code", "sdk_knows"),
    INTEGERS,
    ids=[row[0] for row in INTEGERS],
)
async def test_an_integer_field_out_of_range_gets_one_message_and_code_on_every_surface(
    surfaces, what, sdk, raw, http, param, http_param, value, code, sdk_knows
):
    """An integer outside its range: INVALID_ARGUMENT over gRPC, HTTP 400 and the SDK's refusal,
    naming the field with OpenAI's code and one message, ``<field> must be an integer in [<low>,
    <high>], got <value>`` (over HTTP with the request's name for the field); the SDK's says the
    same where it knows the edge's bounds, else the wire's range in the same words."""
    import re

    from tandem.chat_request import build_request

    _, port, client, http_port = surfaces
    pattern = re.escape(param) + r" must be an integer in \[-?\d+, \d+\], got " + re.escape(str(value))
    messages = []
    if raw is not None:
        request = build_request(HI, max_new_tokens=4)
        raw(request)
        status, details, got_param, got_code = await _grpc_refusal(port, request)
        assert (status, got_param, got_code) == ("INVALID_ARGUMENT", param, code), details
        kind, _, message = details.partition(": ")
        assert kind == "InvalidRequest", details
        messages.append(message)
    http_status, err = await _http_refusal(http_port, http)
    named = http_param or param
    assert (http_status, err["type"], err["param"], err["code"]) == (400, "invalid_request_error", named, code), err
    messages.append(err["message"].replace(named, param, 1))
    status, got_param, got_code, sdk_message = await _sdk_message(client, sdk)
    assert (status, got_param, got_code) == ("INVALID_ARGUMENT", param, code), sdk_message
    assert re.fullmatch(pattern, sdk_message), sdk_message
    if sdk_knows:
        messages.append(sdk_message)
    assert len(set(messages)) == 1 and re.fullmatch(pattern, messages[0]), messages


async def test_an_unset_sampling_field_means_its_default_and_an_explicit_zero_outside_its_range_is_refused(surfaces):
    """Over raw gRPC the sampling fields where 0 is no valid value (``top_p``, ``max_new_tokens``)
    have presence: unset, they take their defaults (1.0, 64 tokens); an explicit 0 is refused as the
    SDK and the HTTP API refuse it, with one message."""
    import grpc

    from tandem.chat_request import build_request
    from tandem.v1 import tandem_pb2_grpc as pb_grpc

    _, port, client, http_port = surfaces
    unset = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="hi")], sampling=pb.SamplingParams())
    unset.sampling.ignore_eos = True
    assert not unset.sampling.HasField("top_p") and not unset.sampling.HasField("max_new_tokens")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        events = [ev async for ev in pb_grpc.EdgeStub(ch).Chat(unset, timeout=20)]
    assert events[-1].done.output_tokens == Sampling().max_new_tokens == 64

    request = build_request(HI, max_new_tokens=4)
    request.sampling.top_p = 0.0
    assert request.sampling.HasField("top_p")
    status, details, param, code = await _grpc_refusal(port, request)
    want = "top_p must be a number in (0, 1], got 0.0"
    assert (status, param, code, details) == (
        "INVALID_ARGUMENT",
        "top_p",
        "decimal_below_min_value",
        f"InvalidRequest: {want}",
    )
    http_status, err = await _http_refusal(http_port, {"top_p": 0.0})
    assert (http_status, err["param"], err["code"], err["message"]) == (400, "top_p", "decimal_below_min_value", want)
    assert await _sdk_message(client, {"top_p": 0.0}) == ("INVALID_ARGUMENT", "top_p", "decimal_below_min_value", want)


@pytest.mark.parametrize(("name", "value", "code"), _float_rows(HTTP_FLOAT_FIELDS), ids=repr)
async def test_an_http_float_field_out_of_range_is_400_with_its_code(surfaces, name, value, code):
    """The HTTP API's own float fields (the penalties) refuse NaN, +/-inf and values outside
    ``[-2, 2]`` with the same message shape and codes as the sampling floats, before "only 0"."""
    _, _, _, http_port = surfaces
    http_status, err = await _http_refusal(http_port, {name: value})
    assert http_status == 400, err
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", name, code)
    assert err["message"] == f"{name} must be a number in [-2, 2], got {value!r}"


@pytest.mark.parametrize(("value", "code"), [(0, "integer_below_min_value"), (129, "integer_above_max_value")])
async def test_an_http_integer_field_out_of_range_is_400_with_the_integer_wording(surfaces, value, code):
    """The HTTP API's own integer field ``n`` (OpenAI's ``[1, 128]``) is refused out of its range in
    the words and codes of every integer field, before "only 1"."""
    _, _, _, http_port = surfaces
    http_status, err = await _http_refusal(http_port, {"n": value})
    assert (http_status, err["param"], err["code"]) == (400, "n", code), err
    assert err["message"] == f"n must be an integer in [1, 128], got {value}"


# (what, the SDK's chat() arguments, the HTTP body's fields): accepted alike on every surface
ACCEPTED = [
    ("role developer", dict(messages=[{"role": "developer", "content": "x"}, *HI]),
     dict(messages=[{"role": "developer", "content": "x"}, *HI])),
    ("top_k -1 (off, as vLLM's)", dict(top_k=-1), dict(top_k=-1)),
    ("a message without content", dict(messages=[{"role": "system"}, *HI]), dict(messages=[{"role": "system"}, *HI])),
    ("split_layer with mode split", dict(mode="split", split_layer=K), dict(mode="split", split_layer=K)),
    ("a session id of 128 bytes", dict(session_id="é" * 64), dict(session_id="é" * 64)),
]  # fmt: skip


@pytest.mark.parametrize(("what", "sdk", "http"), ACCEPTED, ids=[row[0] for row in ACCEPTED])
async def test_what_one_surface_accepts_every_surface_accepts(surfaces, what, sdk, http):
    _, _, client, http_port = surfaces
    assert await _sdk_verdict(client, sdk) == ("OK", None, None)
    assert await _http_verdict(http_port, http) == (200, None, None)


async def test_end_session_and_url_ids_get_the_verdict_chat_gives(surfaces):
    """A session id ``Chat`` refuses is refused by ``EndSession`` (gRPC and SDK) with the same field
    and code; a NUL in a URL's id (``DELETE /v1/conversations/%00``, ``GET /v1/models/%00``) is a 400
    naming the path parameter."""
    import grpc
    import httpx

    import tandem
    from tandem.v1 import tandem_pb2_grpc as pb_grpc

    _, port, client, http_port = surfaces
    for sid, code in (("s\x00", "invalid_value"), ("é" * 65, "string_above_max_length"),
                      ("", "missing_required_parameter")):  # fmt: skip
        with pytest.raises(tandem.InvalidArgument) as ei:
            await client.end_session(sid)
        assert (ei.value.param, ei.value.error_code) == ("session_id", code), sid
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as gi:
                await pb_grpc.EdgeStub(ch).EndSession(pb.EndSessionRequest(session_id=sid), timeout=10)
        md = dict(gi.value.trailing_metadata() or ())
        assert gi.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (md.get("tandem-error-param"), md.get("tandem-error-code")) == ("session_id", code), sid
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}") as h:
        for r, param, code in (
            (await h.delete("/v1/conversations/a%00b"), "conversation_id", "invalid_value"),
            (await h.delete("/v1/conversations/" + "%C3%A9" * 65), "conversation_id", "string_above_max_length"),
            (await h.get("/v1/models/a%00b"), "model", "invalid_value"),
        ):
            err = r.json()["error"]
            assert r.status_code == 400 and (err["param"], err["code"]) == (param, code), err


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"split_layers": 2}, "split_layers"),
        ({"min_p": 0.1}, "min_p"),
        ({"messages": [{"role": "user", "content": "hi", "weight": 1}]}, "messages.[0].weight"),
        ({"stream": True, "stream_options": {"include_usage": True, "chunk_size": 3}}, "stream_options.chunk_size"),
    ],
)
async def test_an_unknown_http_field_is_refused_by_name(surfaces, body, param):
    """A field the HTTP API does not know is 400 ``unknown_parameter`` naming it, never ignored."""
    assert await _http_verdict(surfaces[3], body) == (400, param, "unknown_parameter")


@pytest.mark.parametrize(
    "body",
    [
        {"metadata": {"app": "x"}, "store": False, "service_tier": "auto", "parallel_tool_calls": False},
        {"prompt_cache_key": "k", "safety_identifier": "u1"},
        {"messages": [{"role": "user", "content": "hi", "name": "ann"}]},
        {"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}},
    ],
)
async def test_the_openai_fields_ignored_by_design_are_accepted(surfaces, body):
    """The OpenAI fields that change nothing tandem does (docs/clients.md lists them) are accepted."""
    assert (await _http_verdict(surfaces[3], body))[0] == 200


@pytest.mark.parametrize("field", ["tool_choice", "reasoning_effort", "modalities"])
async def test_an_openai_field_tandem_cannot_honour_is_refused_by_name(surfaces, field):
    assert await _http_verdict(surfaces[3], {field: "auto"}) == (400, field, "unsupported_parameter")
