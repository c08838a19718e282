"""Batched decode on the builder graph (``edge.compute.decoder.DecoderGraph.run_batch``) and continuous
batching in ``edge.compute.local.LocalEngine``, on SmolLM2's prepared ``edge-decoder/`` with ONNX Runtime's
CPU provider: several sessions' steps in one run give each session what it gets alone, token for
token, as sessions join and leave, sit out steps, grow past their capacity, sample with seeds or
are cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import numpy as np
import pytest

from tandem.common.protocol.chat import prompt_token_ids
from tandem.common.protocol.errors import InvalidRequest
from tandem.common.protocol.params import Sampling
from tandem.edge.compute.decoder import DecoderGraph
from tandem.edge.compute.decoder_batch import IDLE_STEPS
from tandem.edge.compute.local import LocalEngine

CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name two primary colours and say why they are called primary."},
    ],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three rivers of Europe, one per line, with their lengths."}],
]
NEW = 12


@pytest.fixture(scope="module")
def graph(decoder_dir):
    return DecoderGraph(decoder_dir, providers=["CPUExecutionProvider"], intra_op_threads=2)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    out = [prompt_token_ids(tokenizer, m) for m in CHATS]
    assert len({len(p) for p in out}) == len(out)  # every prompt length differs
    return out


def lone_greedy(graph: DecoderGraph, ids: list[int], n: int) -> list[int]:
    slot = graph.new_kv(len(ids) + n)
    try:
        tok, _, _ = graph.run(slot, ids, greedy=True)
        out = [tok]
        for _ in range(n - 1):
            tok, _, _ = graph.run(slot, [tok], greedy=True)
            out.append(tok)
        return out
    finally:
        graph.release(slot)


def test_a_batch_of_sessions_decodes_what_each_decodes_alone(graph, prompts):
    """Five sessions of different lengths (more than a pool's first rows); one joins late, one sits
    out steps (and leaves its row after ``IDLE_STEPS``) before it steps again, one grows past its
    slot's capacity mid-batch."""
    want = [lone_greedy(graph, p, NEW) for p in prompts]
    slots = [graph.new_kv(len(p) + NEW) for p in prompts]
    slots[2] = graph.new_slot(len(prompts[2]) + 3)  # grows at its fourth step
    got: list[list[int]] = []
    for s, p in zip(slots, prompts, strict=True):
        tok, _, _ = graph.run(s, p, greedy=True)
        got.append([tok])
    sits_out = range(2, 2 + IDLE_STEPS + 1)
    for k in range(NEW - 1):
        go = [i for i in range(len(prompts)) if not (i == 0 and k < 3) and not (i == 1 and k in sits_out)]
        toks, logits, ms = graph.run_batch([slots[i] for i in go], [got[i][-1] for i in go], [True] * len(go))
        assert logits == [None] * len(go) and ms > 0
        for i, t in zip(go, toks, strict=True):
            got[i].append(t)
        if k == max(sits_out):
            assert slots[1].pool is None  # it sat out IDLE_STEPS steps: back in its own buffers
    for i in (0, 1):  # the late joiner and the one that sat out finish alone
        while len(got[i]) < NEW:
            tok, _, _ = graph.run(slots[i], [got[i][-1]], greedy=True)
            got[i].append(tok)
    assert got == want
    assert slots[2].capacity_tokens > len(prompts[2]) + 3 and slots[2].pool is not None
    assert all(s.tokens == len(p) + NEW - 1 for s, p in zip(slots, prompts, strict=True))
    pool = slots[3].pool
    assert pool.rows == 8 and pool.table.members() == [m for m in pool.table.members() if m.pool is pool]
    for s in slots:
        graph.release(s)
    assert all(len(p.table) == 0 for p in graph._pools.values())


def test_kv_and_logits_of_a_batched_session_equal_its_lone_ones(graph, prompts):
    """A non-greedy row returns its logits; the KV a batched session holds reads back (and
    continues) as the KV computed alone."""
    p = prompts[4]
    alone = graph.new_kv(len(p) + 4)
    tok, _, _ = graph.run(alone, p, greedy=True)
    _, ref, _ = graph.run(alone, [tok], greedy=False)
    a, b = graph.new_kv(len(p) + 4), graph.new_kv(len(prompts[1]) + 4)
    graph.run(a, p, greedy=True)
    t2, _, _ = graph.run(b, prompts[1], greedy=True)
    toks, logits, _ = graph.run_batch([b, a], [t2, tok], [True, False])
    assert toks[0] is not None and toks[1] is None and logits[0] is None
    np.testing.assert_allclose(logits[1], ref, atol=1e-4, rtol=0)
    assert a.pool is not None
    got = graph.read_kv(a)  # brings it back to its own buffers
    assert a.pool is None
    for x, y in zip(got, graph.read_kv(alone), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=0)
    for s in (alone, a, b):
        graph.release(s)


def test_a_batched_step_refuses_bad_input_and_changes_nothing(graph, prompts):
    a = graph.new_kv(16)
    graph.run(a, prompts[0], greedy=True)
    held = a.tokens
    with pytest.raises(InvalidRequest, match="each live slot once"):
        graph.run_batch([a, a], [1, 2], [True, True])
    with pytest.raises(InvalidRequest, match="one token per slot"):
        graph.run_batch([a], [1, 2], [True])
    full = graph.new_kv(graph.spec.context_tokens)
    full.tokens = graph.spec.context_tokens
    with pytest.raises(InvalidRequest, match="exceed the model's"):
        graph.run_batch([a, full], [1, 2], [True, True])
    assert a.tokens == held and a.pool is None
    graph.release(a)
    with pytest.raises(InvalidRequest, match="each live slot once"):
        graph.run_batch([a], [1], [True])
    full.tokens = 0
    graph.release(full)


# ---- the engine ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(decoder_dir, manifest):
    eng = LocalEngine(decoder_dir, manifest.shape, (2,), intra_op_threads=2)
    assert eng.model.batched_decode
    return eng


@pytest.fixture
def batch_sizes(engine, monkeypatch):
    """The size of every batched run the engine makes (the real run, counted)."""
    sizes: list[int] = []
    real = engine.model.run_batch

    def counted(kvs, token_ids, greedy, draws=None):
        sizes.append(len(kvs))
        return real(kvs, token_ids, greedy, draws)

    monkeypatch.setattr(engine.model, "run_batch", counted)
    return sizes


async def turn(engine, ids, sampling, session_id="", after: asyncio.Event | None = None) -> list[int]:
    if after is not None:
        await after.wait()
    return [t.token_id async for t in engine.generate(ids, sampling, session_id)]


async def test_concurrent_turns_decode_in_batches_as_they_would_alone(engine, prompts, batch_sizes):
    """Five turns of different prompt lengths and lengths of output, two joining mid-decode: each
    gets its lone tokens, and the steps ran in batches."""
    sampling = [Sampling(max_new_tokens=NEW + 4 * i, ignore_eos=True) for i in range(len(prompts))]
    alone = [await turn(engine, p, s) for p, s in zip(prompts, sampling, strict=True)]
    batch_sizes.clear()
    started = asyncio.Event()

    async def first() -> list[int]:
        out = []
        async for t in engine.generate(prompts[0], sampling[0]):
            out.append(t.token_id)
            if len(out) == 4:
                started.set()
        return out

    got = await asyncio.gather(
        first(),
        *(turn(engine, p, s) for p, s in zip(prompts[1:3], sampling[1:3], strict=True)),
        *(turn(engine, p, s, after=started) for p, s in zip(prompts[3:], sampling[3:], strict=True)),
    )
    assert list(got) == alone
    assert max(batch_sizes) == len(prompts) and len(batch_sizes) < sum(len(a) - 1 for a in alone)
    assert engine.active == 0 and engine._stepper.idle


async def test_seeded_sampling_in_a_batch_equals_the_lone_turn(engine, prompts, batch_sizes):
    sampling = [Sampling(max_new_tokens=NEW, temperature=0.8, top_p=0.95, seed=100 + i) for i in range(4)]
    alone = [await turn(engine, p, s) for p, s in zip(prompts, sampling, strict=False)]
    batch_sizes.clear()
    got = await asyncio.gather(*(turn(engine, p, s) for p, s in zip(prompts, sampling, strict=False)))
    assert list(got) == alone and max(batch_sizes) == 4


async def test_a_cancelled_turn_leaves_the_batch_and_its_session_consistent(engine, prompts):
    sid = f"b-{uuid.uuid4().hex}"
    greedy = Sampling(max_new_tokens=NEW, ignore_eos=True)
    alone = [await turn(engine, p, greedy) for p in prompts[:3]]
    three = asyncio.Event()

    async def cancelled() -> None:
        n = 0
        async with contextlib.aclosing(engine.generate(prompts[1], greedy, sid)) as it:
            async for _ in it:
                n += 1
                if n == 3:
                    three.set()

    victim = asyncio.create_task(cancelled())
    others = asyncio.gather(turn(engine, prompts[0], greedy), turn(engine, prompts[2], greedy))
    await three.wait()
    victim.cancel()
    got = await others
    await asyncio.gather(victim, return_exceptions=True)
    assert victim.cancelled() and list(got) == [alone[0], alone[2]]
    sess = engine.sessions.peek(sid)
    assert sess.kv is not None and sess.kv.tokens == len(sess.token_ids) and not sess.lock.locked()
    assert sess.token_ids[: len(prompts[1])] == prompts[1]
    assert await turn(engine, prompts[1], greedy, sid) == alone[1]  # the session goes on from what it holds
    assert engine.last_reused_tokens == len(prompts[1]) - 1


async def test_a_session_grows_past_its_capacity_inside_a_batch(engine, tokenizer, prompts):
    """A second turn whose decode crosses the first turn's slot capacity, beside other turns."""
    long_chat = [{"role": "user", "content": " ".join(["Tell me about the sea and its tides."] * 40)}]
    cap = engine.model.min_slot_tokens
    p1 = prompt_token_ids(tokenizer, long_chat)[: cap - 10]
    first = Sampling(max_new_tokens=2, ignore_eos=True)
    greedy = Sampling(max_new_tokens=NEW, ignore_eos=True)

    async def two_turns(sid: str, beside: bool) -> list[int]:
        a = await turn(engine, p1, first, sid)
        p2 = p1 + a + [tokenizer.eos_token_id or 2, *prompts[0][:6]]
        assert len(p2) + 1 <= cap < len(p2) + NEW  # its prefill fits the slot, its decode crosses it
        if not beside:
            return await turn(engine, p2, greedy, sid)
        out = await asyncio.gather(turn(engine, p2, greedy, sid), turn(engine, prompts[3], greedy))
        assert engine.sessions.peek(sid).kv.capacity_tokens > cap
        return out[0]

    assert await two_turns(f"g-{uuid.uuid4().hex}", True) == await two_turns(f"g-{uuid.uuid4().hex}", False)


async def test_a_step_that_fails_fails_alone(engine, prompts):
    """In one batched job, a dropped session's step and a step past the model's positions raise for
    their own turns; the other session's step runs and stays consistent."""
    from tandem.common.protocol.errors import EngineError
    from tandem.edge.compute.local import DecodeStep

    good, full, dropped = engine.new_session(), engine.new_session(), engine.new_session()
    await engine.extend(good, prompts[1])
    await engine.extend(full, prompts[0])
    dropped.drop()

    def step(sess, tok: int) -> DecodeStep:
        return DecodeStep(sess, tok, len(sess.token_ids), True, 64)

    full.kv.tokens = engine.model.spec.context_tokens  # as if it held the model's every position
    full.token_ids = [1] * full.kv.tokens
    batch = [step(dropped, 5), step(good, 7), step(full, 9)]
    (results, _run_ms), _wait_ms = await engine._run_job(lambda: engine._advance_batch(batch))
    assert isinstance(results[0], EngineError) and isinstance(results[2], InvalidRequest)
    assert (
        isinstance(results[1][0], int) and good.token_ids == [*prompts[1], 7] and good.kv.tokens == len(good.token_ids)
    )
    assert full.kv.tokens == engine.model.spec.context_tokens
    full.kv.tokens, full.token_ids = 0, []
    for s in (good, full):
        s.drop()


async def test_extend_with_room_holds_the_turns_kv_in_one_slot(engine, prompts):
    """``extend(room_tokens=...)`` (a remote-prefill turn's own run) sizes the session's KV for the
    whole turn: the decode after it runs in that slot, never grown; the room is capped at the
    model's positions, and never below the tokens run."""
    roomy, plain = engine.new_session(), engine.new_session()
    p = prompts[1]
    await engine.extend(roomy, p, room_tokens=len(p) + 600)
    await engine.extend(plain, p)
    assert roomy.kv.capacity_tokens >= len(p) + 600 > plain.kv.capacity_tokens >= len(p)
    assert roomy.token_ids == plain.token_ids == p and roomy.kv.tokens == len(p)
    cap = roomy.kv.capacity_tokens
    sampling = Sampling(max_new_tokens=8, temperature=0.0)
    async with contextlib.aclosing(engine.generate([*p, 42], sampling, session=roomy)) as steps:
        got = [s.token_id async for s in steps]
    assert len(got) == 8 and roomy.kv.capacity_tokens == cap
    huge = engine.new_session()
    await engine.extend(huge, p, room_tokens=10**9)
    assert huge.kv.capacity_tokens <= engine.model.spec.context_tokens
    for s in (roomy, plain, huge):
        s.drop()
