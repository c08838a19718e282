"""Edge-only serving (``edge.compute.local.LocalEngine``) on both of the edge's runtimes, ONNX Runtime GenAI's
builder graph (``edge-decoder/``, ``edge.compute.decoder.DecoderGraph``) and tandem's ``edge-full.onnx``
(``edge.compute.localmodel.OnnxForward``), against HF greedy references: greedy tokens, session prefix
reuse, stops, sampling, validation, concurrency and cancellation. Short chat prompts, 16 new
tokens; one engine per runtime."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid

import numpy as np
import pytest
import torch

from tandem.common.protocol.chat import prompt_token_ids
from tandem.common.protocol.errors import InvalidRequest
from tandem.common.protocol.params import Sampling
from tandem.edge.compute.local import (
    LocalEngine,
    LocalGenerator,
    LocalSession,
    LocalSessions,
    LocalToken,
    draw_uniform,
    sample_token,
    sampling_rng,
)
from tandem.edge.compute.localmodel import GrowingKV
from tandem.edge.compute.prefill import PrefillPlan

MAX_NEW = 16
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name two primary colours."},
    ],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]


@pytest.fixture(scope="module")
def edge_full(split_dir):
    path = split_dir.parent / "edge-full.onnx"
    if not path.is_file():
        pytest.fail(f"no {path}: run `make model` (make test does it)")
    return path


@pytest.fixture(scope="module")
def eos(hf_model) -> tuple[int, ...]:
    e = hf_model.generation_config.eos_token_id
    return tuple(e) if isinstance(e, list) else (e,)


# the builder graph with the CUDA provider's prefill shapes (``PrefillPlan.bucketed``) at a size these
# prompts cross: runs of 16 tokens at most, padded to 4, 8 or 16, the mask over the KV slot
PLANNED = PrefillPlan(16, (4, 8, 16), capacity_mask=True)


@pytest.fixture(scope="module", params=["edge-decoder", "edge-decoder, bucketed prefills", "edge-full.onnx"])
def engine(request, split_dir, manifest, eos):
    path = split_dir.parent / request.param.split(",")[0]
    if not path.exists():
        pytest.fail(f"no {path}: run `make model` (make test does it)")
    plan = PLANNED if "bucketed" in request.param else None
    return LocalEngine(path, manifest.shape, eos, intra_op_threads=2, prefill=plan)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [prompt_token_ids(tokenizer, m) for m in CHATS]


class Refs:
    """HF greedy references, computed once per prompt."""

    def __init__(self, model) -> None:
        self.model = model
        self._cache: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, ids: list[int], n: int = MAX_NEW) -> list[int]:
        key = (*ids, -n)
        if key not in self._cache:
            with torch.no_grad():
                out = self.model.generate(
                    torch.tensor([ids]),
                    max_new_tokens=n,
                    do_sample=False,
                    pad_token_id=self.model.config.eos_token_id,
                )
            self._cache[key] = out[0, len(ids) :].tolist()
        return self._cache[key]


@pytest.fixture(scope="module")
def ref(hf_model) -> Refs:
    return Refs(hf_model)


async def run(engine, ids, sampling=None, session_id="") -> list[LocalToken]:
    return [t async for t in engine.generate(ids, sampling or Sampling(max_new_tokens=MAX_NEW), session_id)]


def toks(out: list[LocalToken]) -> list[int]:
    return [t.token_id for t in out]


def consistent(s: LocalSession) -> bool:
    return s.kv is not None and s.kv.tokens == len(s.token_ids) and not s.lock.locked()


async def test_warmup_measures_rates(engine, caplog):
    """Warm-up measures the local engine's prefill and decode rates (ms per token), both positive;
    with bucketed prefills it runs their shapes once and holds nothing after."""
    with caplog.at_level(logging.INFO, logger="tandem.edge.compute.local"):
        await engine.warmup(32)
    assert engine.prefill_ms_per_token > 0 and engine.decode_ms_per_token > 0
    planned = getattr(engine.model, "prefill", None) == PLANNED
    assert ("prefill shapes run on KV capacities [256" in caplog.text) == planned
    assert all(s.tokens == 0 for spares in getattr(engine.model, "_free", {}).values() for s in spares)
    print(f"prefill {engine.prefill_ms_per_token:.2f} ms/token, decode {engine.decode_ms_per_token:.2f} ms/token")


@pytest.mark.parametrize("idx", range(len(CHATS)))
async def test_greedy_equals_hf(engine, prompts, ref, eos, idx):
    out = await run(engine, prompts[idx])
    want = ref(prompts[idx])
    assert toks(out) == want
    assert all(t.finish_reason is None for t in out[:-1])
    assert out[-1].finish_reason == ("stop" if want[-1] in eos else "length")
    assert engine.last_computed_tokens == len(prompts[idx]) and engine.active == 0


async def test_second_turn_reuses_session_kv(engine, prompts, tokenizer, ref):
    sid = f"s-{uuid.uuid4().hex}"
    p1 = prompts[0]
    a1 = toks(await run(engine, p1, session_id=sid))
    assert a1 == ref(p1)
    tail = ("" if a1[-1] == tokenizer.eos_token_id else "<|im_end|>") + (
        "\n<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n"
    )
    p2 = p1 + a1 + tokenizer(tail, add_special_tokens=False)["input_ids"]

    a2 = toks(await run(engine, p2, session_id=sid))
    reused = len(p1) + len(a1) - 1  # the last answer token had no KV
    assert engine.last_reused_tokens == reused and engine.last_computed_tokens == len(p2) - reused
    sess = engine.sessions.peek(sid)
    assert consistent(sess) and sess.token_ids == (p2 + a2)[: len(p2) + len(a2) - 1]

    stateless = toks(await run(engine, p2))
    assert engine.last_computed_tokens == len(p2)
    assert a2 == stateless


async def test_stop_token_ids_stop_and_are_included(engine, prompts, ref):
    want = ref(prompts[1])
    stop = want[3]
    i = want.index(stop)
    out = await run(engine, prompts[1], Sampling(max_new_tokens=MAX_NEW, stop_token_ids=(stop,)))
    assert toks(out) == want[: i + 1] and out[-1].finish_reason == "stop"


async def test_eos_stops_unless_ignored(engine, prompts, ref, eos):
    want = ref(prompts[0])
    if want[-1] not in eos:
        pytest.skip("the reference answer does not end with EOS within MAX_NEW tokens")
    out = await run(engine, prompts[0], Sampling(max_new_tokens=len(want) + 3, ignore_eos=True))
    assert toks(out)[: len(want)] == want and len(out) == len(want) + 3 and out[-1].finish_reason == "length"


async def test_max_new_tokens_gives_length(engine, prompts, ref):
    out = await run(engine, prompts[2], Sampling(max_new_tokens=3))
    assert toks(out) == ref(prompts[2])[:3]
    assert [t.finish_reason for t in out] == [None, None, "length"]


async def test_seeded_sampling_is_reproducible(engine, prompts, ref):
    s = Sampling(max_new_tokens=8, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    a, b = await run(engine, prompts[2], s), await run(engine, prompts[2], s)
    assert toks(a) == toks(b)
    greedy_k = Sampling(max_new_tokens=8, temperature=1.0, top_k=1, seed=7)  # top_k=1 leaves only the argmax
    assert toks(await run(engine, prompts[2], greedy_k)) == ref(prompts[2])[:8]


def test_sample_token_filters():
    """Sampling draws only within top-k and the top-p nucleus (the smallest set reaching p), temperature 0 is
    the argmax, one draw gives one token, and the draws of one seed repeat."""
    p = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(p).astype(np.float32)
    rng = np.random.default_rng(0)

    def support(**kw) -> set[int]:
        s = Sampling(temperature=1.0, **kw)
        return {sample_token(logits, s, draw_uniform(rng)) for _ in range(400)}

    assert support() == {0, 1, 2, 3}
    assert support(top_k=2) == {0, 1}
    assert support(top_p=0.8) == {0, 1}
    assert support(top_p=0.81) == {0, 1, 2}
    assert support(top_p=1e-9) == {0}
    assert sample_token(logits, Sampling(temperature=0.0), 0.99) == 0
    s = Sampling(temperature=1.0)
    assert [sample_token(logits, s, u) for u in (0.0, 0.49, 0.51, 0.79, 0.81, 0.94, 0.96, 0.999)] == [
        0,
        0,
        1,
        1,
        2,
        2,
        3,
        3,
    ]
    a, b = sampling_rng(42), sampling_rng(42)
    assert [draw_uniform(a) for _ in range(5)] == [draw_uniform(b) for _ in range(5)]


def test_seed_minus_one_is_no_seed_in_every_mode():
    """-1 seeds nothing on the edge (local mode, remote prefill's decode) as vLLM's ``SamplingParams``
    reads it on the cloud (direct, split): two turns of seed -1 draw anew; any other seed, a
    negative one too, repeats its draws."""

    def draws(seed: int | None) -> list[float]:
        rng = sampling_rng(seed)
        return [draw_uniform(rng) for _ in range(8)]

    assert draws(-1) != draws(-1) and draws(None) != draws(None)
    assert draws(-2) == draws(-2) and draws(-(2**63)) == draws(-(2**63)) and draws(2**63 - 1) == draws(2**63 - 1)
    pytest.importorskip("vllm")
    from tandem.cloud.engines.vllm_engines import to_vllm_sampling

    assert to_vllm_sampling(Sampling(temperature=1.0, seed=-1)).seed is None
    assert to_vllm_sampling(Sampling(temperature=1.0, seed=-2)).seed == -2


@pytest.mark.parametrize("temperature", [1e-7, 1e-5, 0.005])
def test_a_temperature_below_vllms_lowest_samples_at_it_on_both_sides(temperature):
    """vLLM raises a temperature in (0, 0.01) to 0.01 and samples; the edge reads the same turn the
    same way (not greedy below 1e-5, not at the smaller temperature): one ``Sampling`` for both."""
    from tandem.common.protocol.params import MIN_SAMPLED_TEMPERATURE

    s = Sampling(temperature=temperature, seed=3)
    assert s.temperature == MIN_SAMPLED_TEMPERATURE == 0.01
    assert Sampling.from_pb(s.to_pb()).temperature == 0.01 and Sampling(temperature=0.0).temperature == 0.0
    logits = np.array([5.0, 4.99, -3.0], np.float32)  # a near-tie: at 0.01 a draw can take either
    picks = {sample_token(logits, s, u) for u in np.linspace(0.0, 0.999, 64)}
    assert picks == {0, 1}
    pytest.importorskip("vllm")
    from tandem.cloud.engines.vllm_engines import to_vllm_sampling

    assert to_vllm_sampling(Sampling(temperature=temperature)).temperature == 0.01


@pytest.mark.parametrize(
    "ids,sampling",
    [
        ([], Sampling()),
        ([1, 49152], Sampling()),
        ([1, -1], Sampling()),
        ([1, 2], Sampling(max_new_tokens=0)),
        ([1] * 8000, Sampling(max_new_tokens=200)),
        ([1, 2], Sampling(temperature=-1.0)),
        ([1, 2], Sampling(temperature=float("nan"))),
        ([1, 2], Sampling(top_p=0.0)),
        ([1, 2], Sampling(top_k=-2)),
    ],
    ids=["empty", "vocab", "negative", "zero-new", "too-long", "temperature", "nan", "top_p", "top_k"],
)
async def test_invalid_requests(engine, ids, sampling):
    """An empty prompt, a token id outside the vocabulary, zero new tokens, a prompt over the model's length,
    or sampling values out of range raise InvalidRequest and leave no turn active."""
    with pytest.raises(InvalidRequest):
        await run(engine, ids, sampling)
    assert engine.active == 0


async def test_concurrent_turns_interleave_and_stay_correct(engine, prompts, ref):
    arrivals: list[int] = []

    firsts: dict[int, LocalToken] = {}

    async def one(i: int) -> list[int]:
        out = []
        async for t in engine.generate(prompts[i], Sampling(max_new_tokens=MAX_NEW)):
            arrivals.append(i)
            firsts.setdefault(i, t)
            out.append(t.token_id)
        return out

    seen: list[tuple[int, int]] = []  # (pending prefills, their prompt tokens) while the turns run

    async def watch() -> None:
        while True:
            seen.append((engine.pending_prefills, engine.pending_prefill_tokens))
            await asyncio.sleep(0)

    watcher = asyncio.create_task(watch())
    a, b = await asyncio.gather(one(1), one(2))
    watcher.cancel()
    assert a == ref(prompts[1]) and b == ref(prompts[2])
    assert arrivals.index(2) < len(arrivals) - 1 - arrivals[::-1].index(1)  # b started before a ended
    # both prefills were queued at once (the second waiting for the first's run), then none
    assert (2, len(prompts[1]) + len(prompts[2])) in seen
    # each first token reports its prefill's run, and the second its wait for the first's run
    assert firsts[1].run_ms > 0 and firsts[2].run_ms > 0
    assert firsts[2].wait_ms >= 0.9 * firsts[1].run_ms
    assert engine.active == 0 and engine.pending_prefills == 0 and engine.pending_prefill_tokens == 0


async def test_cancel_mid_decode_leaves_session_usable(engine, prompts, ref):
    sid = f"c-{uuid.uuid4().hex}"
    got = asyncio.Event()

    async def consume() -> None:
        n = 0
        async with contextlib.aclosing(engine.generate(prompts[1], Sampling(max_new_tokens=MAX_NEW), sid)) as it:
            async for _ in it:
                n += 1
                if n == 3:
                    got.set()

    task = asyncio.create_task(consume())
    await got.wait()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled()
    sess = engine.sessions.peek(sid)
    assert consistent(sess) and sess.token_ids[: len(prompts[1])] == prompts[1]
    assert len(prompts[1]) <= len(sess.token_ids) < len(prompts[1]) + MAX_NEW

    # The same prompt again: all of it is in the session, only its last token is recomputed.
    assert toks(await run(engine, prompts[1], session_id=sid)) == ref(prompts[1])
    assert engine.last_reused_tokens == len(prompts[1]) - 1 and engine.last_computed_tokens == 1
    # A different prompt on the same session: the diverging part is recomputed.
    assert toks(await run(engine, prompts[2], session_id=sid)) == ref(prompts[2])
    assert consistent(engine.sessions.peek(sid)) and engine.active == 0


async def test_a_turn_cancelled_while_its_prefill_waits_leaves_no_queue_behind(engine, prompts):
    """The prefill queue the cost model reads (``pending_prefill_tokens``) counts a waiting prefill
    and forgets it when its turn is cancelled before it ran."""
    import threading

    gate = threading.Event()
    busy = asyncio.ensure_future(engine._run_job(gate.wait))  # the model is busy: the turn's prefill waits
    try:
        it = engine.generate(prompts[1], Sampling(max_new_tokens=2))
        task = asyncio.create_task(it.__anext__())
        for _ in range(20):
            await asyncio.sleep(0)
        assert engine.pending_prefills == 1 and engine.pending_prefill_tokens == len(prompts[1])
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await it.aclose()
    finally:
        gate.set()
        await busy
    assert engine.pending_prefills == 0 and engine.pending_prefill_tokens == 0 and engine.active == 0


def test_sessions_are_bounded_lru():
    def sess(n_tokens: int) -> LocalSession:
        return LocalSession(
            list(range(n_tokens)), GrowingKV([np.zeros((1, 3, n_tokens, 64), np.float32)] * 2, n_tokens)
        )

    table = LocalSessions(max_entries=2, max_bytes=10 * 2 * 3 * 64 * 4)  # 10 tokens of 2 arrays
    table.put("a", sess(4))
    table.put("b", sess(4))
    table.peek("a")
    table.put("c", sess(1))
    assert table.evict() == ["b"] and "a" in table and "c" in table
    table.put("d", sess(10))
    assert table.evict() == ["a", "c"] and len(table) == 1
    assert table.get("") is not table.get("")  # stateless: a throwaway session each time
    assert table.get("e") is table.get("e")


def test_the_session_table_reports_each_session_it_dropped_as_expired_once():
    """Evicted (count or bytes) and idle sessions are ``expired`` once, at their next turn, as the
    edge's split sessions are; one ended by its client (``discard``) or held again is not."""
    now = [0.0]
    table = LocalSessions(max_entries=1, max_bytes=1 << 20, idle_s=10.0, clock=lambda: now[0])
    table.put("a", LocalSession())
    table.put("b", LocalSession())
    assert table.evict() == ["a"]
    assert table.expired("a") and not table.expired("a")  # once
    assert not table.expired("b") and not table.expired("") and not table.expired("never")
    now[0] = 11.0  # "b" idle past idle_s, not swept yet: its next turn drops it and is told
    assert table.expired("b") and "b" not in table
    table.put("c", LocalSession())
    table.put("d", LocalSession())
    table.evict()
    table.discard("c")  # absent already: its client ends it; a later turn is a new session
    assert not table.expired("c")


def test_local_generator_wrapper(edge_full, manifest, prompts, ref, eos):
    """The benchmark's LocalGenerator yields the reference greedy tokens with non-decreasing timestamps."""
    gen = LocalGenerator(edge_full, manifest.shape, intra_op_threads=2)
    want = ref(prompts[0])
    steps = list(gen.generate(prompts[0], MAX_NEW, eos[0]))
    assert [s.token_id for s in steps] == want
    assert all(b.t_s >= a.t_s for a, b in zip(steps, steps[1:], strict=False))


def test_local_generator_samples_a_temperature_below_the_least_at_the_least(edge_full, manifest, prompts):
    """A temperature above 0 and below ``MIN_SAMPLED_TEMPERATURE`` (greedy's bound among them) is
    sampled at it, as ``Sampling`` and vLLM take it: the runs sample, and the tokens are those of
    the least temperature with the same seed."""
    from tandem.common.protocol.params import MIN_SAMPLED_TEMPERATURE

    gen = LocalGenerator(edge_full, manifest.shape, intra_op_threads=2)
    run, greedy = gen.model.run, []

    def spy(kv, ids, g, draw=None):
        greedy.append(g)
        return run(kv, ids, g, draw)

    gen.model.run = spy
    low = [s.token_id for s in gen.generate(prompts[0], 6, None, temperature=1e-6, seed=7)]
    assert greedy and not any(greedy)
    least = [s.token_id for s in gen.generate(prompts[0], 6, None, temperature=MIN_SAMPLED_TEMPERATURE, seed=7)]
    assert low == least


async def test_kv_bound_through_io_binding_stays_an_ort_tensor_and_answers_alike(
    edge_full, manifest, eos, prompts, tokenizer, ref
):
    """The IO-binding path the CUDA provider takes (``kv_device``), run on the CPU: the session's KV
    is kept as ``OrtValue`` tensors between decode steps and turns, greedy tokens equal HF's over two
    turns of one session (the second reusing the first's KV without a copy), and what remote prefill
    reads back (``blocks_from_past``) equals the unbound engine's KV of the same tokens."""
    import onnxruntime as ort

    from tandem.edge.compute.local import blocks_from_past

    bound = LocalEngine(edge_full, manifest.shape, eos, intra_op_threads=2, kv_device="cpu")
    plain = LocalEngine(edge_full, manifest.shape, eos, intra_op_threads=2)
    sid = f"s-{uuid.uuid4().hex}"
    p1 = prompts[0]
    a1 = toks(await run(bound, p1, session_id=sid))
    assert a1 == ref(p1)
    sess = bound.sessions.peek(sid)
    assert sess is not None and all(isinstance(a, ort.OrtValue) for a in sess.kv.past)
    assert all(a.shape()[2] == len(sess.token_ids) for a in sess.kv.past)
    assert (
        sess.nbytes()
        == 2
        * manifest.shape.num_layers
        * manifest.shape.num_kv_heads
        * len(sess.token_ids)
        * manifest.shape.head_dim
        * 4
    )
    tail = ("" if a1[-1] == tokenizer.eos_token_id else "<|im_end|>") + (
        "\n<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n"
    )
    p2 = p1 + a1 + tokenizer(tail, add_special_tokens=False)["input_ids"]
    a2 = toks(await run(bound, p2, session_id=sid))
    assert a2 == ref(p2) and bound.last_reused_tokens == len(p1) + len(a1) - 1
    psid = f"p-{uuid.uuid4().hex}"
    await run(plain, p1, session_id=psid)
    held = bound.sessions.peek(sid)
    other = plain.sessions.peek(psid)
    n = len(other.token_ids)
    assert held.token_ids[:n] == other.token_ids
    np.testing.assert_allclose(blocks_from_past(held.kv.past)[:, :, :, :n], blocks_from_past(other.kv.past), atol=1e-5)


def test_kv_device_is_checked_against_the_active_providers(edge_full, manifest, eos):
    with pytest.raises(ValueError, match="kv_device 'gpu'"):
        LocalEngine(edge_full, manifest.shape, eos, kv_device="gpu")
    with pytest.raises(ValueError, match="CUDA provider"):
        LocalEngine(edge_full, manifest.shape, eos, providers=["CPUExecutionProvider"], kv_device="cuda")


async def test_a_stateless_turns_kv_goes_back_to_the_model(engine, prompts):
    """A turn without a session gives its KV back at its end (taken by the model at the next run),
    and a run still queued for a session dropped that way allocates nothing."""
    from tandem.common.protocol.errors import EngineError

    await run(engine, prompts[0], Sampling(max_new_tokens=2))
    await run(engine, prompts[1], Sampling(max_new_tokens=2))
    assert len(engine._released) == 1  # the second turn's; the first's went back at the second's first run
    dropped = engine.new_session()
    dropped.drop()
    with pytest.raises(EngineError, match="dropped"):
        await engine._run_job(lambda: engine._advance(dropped, [1], 0, True, 4))
    assert dropped.kv is None
