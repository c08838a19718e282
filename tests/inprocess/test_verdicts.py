"""One verdict per request, whatever the mode: a request outside what the model, the edge or the
cloud accepts is refused with the same status and message in auto, local, split and direct mode,
because the edge checks it once, against the limits every mode shares, before choosing a route.
Each mode's own check (local mode's, the cloud's on the wire) is the same function, so where one
refuses on its own it says the same."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from tandem.cloud.config import EngineConfig
from tandem.cloud.upload import check_header
from tandem.common.errors import TandemError
from tandem.common.grpc_errors import status_details, status_of
from tandem.common.messages import TurnHeader
from tandem.common.modes import Mode
from tandem.common.params import Sampling
from tandem.common.requestlimits import RequestLimits
from tandem.edge.events import ChatTurn, TurnDone
from tests.doubles import MANIFEST, VOCAB, B, MemoryLocal, toy_stack

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
    return ChatTurn((("user", text_of(tokens)),), "", session, s, mode=mode)


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
    ("negative top_k", dict(top_k=-1)),
    ("top_k past the wire's int32", dict(top_k=2**31)),
    ("seed past 64 bits", dict(seed=2**63, temperature=1.0)),
    ("session id longer than 128 bytes", dict(session="é" * 65)),
]


async def verdict(toy, turn: ChatTurn) -> tuple[str, str]:
    """(gRPC status name, status details) of a refused turn, ("OK", "") of one that ran."""
    try:
        async for ev in toy.edge.chat(turn):
            if isinstance(ev, TurnDone):
                assert ev.mode in (Mode.LOCAL, Mode.SPLIT, Mode.DIRECT)
    except TandemError as e:
        return status_of(e).name, status_details(e)
    return "OK", ""


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
        dict(temperature=1.0, top_k=2**31 - 1, seed=-(2**63)),  # a top_k past the vocabulary is off
        dict(session="é" * 64),
    ]
    for args in edge_cases:
        turn_kw, sampling = split_args(args)
        for m in MODES:
            assert await verdict(toy, request(m, **turn_kw, **sampling)) == ("OK", ""), (args, m)


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
    assert toy.edge.limits == RequestLimits(VOCAB, MAX_PROMPT_TOKENS, MAX_NEW_TOKENS, MAX_MODEL_LEN_TOKENS)
    for _, args in BAD:
        turn_kw, sampling = split_args(args)
        t = request(Mode.DIRECT, **turn_kw, **sampling)
        if len(t.session_id.encode()) > 128:
            continue
        edge = await verdict(toy, t)
        ids = toy.edge.tokenize(t) if turn_kw.get("tokens", 0) <= MAX_PROMPT_TOKENS else [1] * turn_kw["tokens"]
        header = TurnHeader("r", "", p.params_version, 0, tuple(ids), 0, 0, 0, t.sampling, toy.edge.conn.link_id)
        with pytest.raises(TandemError) as e:
            check_header(header, p, MANIFEST)
        assert (status_of(e.value).name, status_details(e.value)) == edge


def test_limits_narrow_bound_by_bound():
    a, b = RequestLimits(1000, 1536, 4096, 0), RequestLimits(0, 100, 512, 2048)
    assert a.narrowed(b) == b.narrowed(a) == RequestLimits(1000, 100, 512, 2048)
    assert replace(a, vocab_size=0).narrowed(RequestLimits()) == replace(a, vocab_size=0)


async def test_local_mode_of_the_real_model_takes_any_64_bit_seed_and_refuses_stop_ids_past_its_vocabulary(split_dir):
    """``LocalEngine`` (``edge-full.onnx``): a negative seed is a seed there as in vLLM, and a stop
    id past the vocabulary is refused with the cloud's message."""
    from tandem.common.manifest import FULL_ONNX, SplitManifest
    from tandem.edge.local import LocalEngine

    shape = SplitManifest.load(split_dir).shape
    engine = LocalEngine(split_dir.parent / FULL_ONNX, shape, (), 1)
    s = Sampling(max_new_tokens=2, temperature=1.0, seed=-7)
    runs = [[t.token_id async for t in engine.generate([1, 2, 3], s)] for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 2
    v = shape.vocab_size
    with pytest.raises(TandemError) as e:
        async for _ in engine.generate([1, 2, 3], Sampling(max_new_tokens=2, stop_token_ids=(v,))):
            pass
    assert str(e.value) == f"stop_token_ids.[0]: {v} is outside the vocabulary [0, {v})"
    assert (e.value.param, e.value.code) == ("stop_token_ids.[0]", "integer_above_max_value")
