"""The local engine's stepping (``edge.compute.local.LocalEngine`` over ``edge.compute.stepper.Stepper``) on
the in-memory model (``edge.compute.localmodel.MemoryModel``): concurrent turns get the tokens they get
alone, batched or not; prefills run one between two decode steps; a bad session fails alone; a
closed turn stops and leaves its session consistent; a prefill cancelled before it ran never runs;
each step's tokens go back to the event loop in one call; the thread ends when idle, but a
thread-bound model's only when the engine closes."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import numpy as np
import pytest

from tandem.common.protocol.errors import EngineError, InvalidRequest
from tandem.common.protocol.manifest import ModelShape
from tandem.common.protocol.params import Sampling
from tandem.edge.compute.local import LocalEngine, draw_uniform, sampling_rng
from tandem.edge.compute.localmodel import Draw, MemoryModel
from tandem.edge.compute.stepper import LINGER_S, Mailbox, Stepper

SHAPE = ModelShape(
    num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=2, vocab_size=500, max_position_embeddings=4096
)
EOS = 7
KINDS = {
    "batched": {"batched_decode": True},
    "unbatched": {"batched_decode": False},
    "batched-logits": {"batched_decode": True, "logits": True},
}


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(10, 400, 3 + 2 * i)] for i in range(n)]


def alone(kind: str, prompt: list[int], s: Sampling) -> list[int]:
    """The turn's tokens from the model's own runs, one after the other (the reference)."""
    m = MemoryModel(SHAPE, **KINDS[kind])
    kv, rng, out, ids = m.new_kv(0), sampling_rng(s.seed), [], prompt
    for _ in range(s.max_new_tokens):
        greedy = s.temperature == 0
        draw = None if greedy else Draw(s.temperature, s.top_k, s.top_p, draw_uniform(rng))
        tok, logits, _ = m.run(kv, ids, greedy, draw)
        tok = int(np.argmax(logits)) if tok is None else tok
        out.append(tok)
        if tok in s.stop_token_ids or (tok == EOS and not s.ignore_eos):
            break
        ids = [tok]
    return out


async def tokens(engine: LocalEngine, ids: list[int], s: Sampling, session_id: str = "") -> list[int]:
    return [t.token_id async for t in engine.generate(ids, s, session_id)]


def engine_of(kind: str, step_ms: float = 0.0) -> LocalEngine:
    return LocalEngine(MemoryModel(SHAPE, step_ms=step_ms, **KINDS[kind]), SHAPE, (EOS,))


@pytest.mark.parametrize("kind", KINDS)
async def test_turns_together_get_the_tokens_they_get_alone(kind):
    """Six turns, greedy and seeded-sampled, of different lengths, three joining mid-decode: each
    gets its lone tokens; a batching model ran them in batches of up to six."""
    engine = engine_of(kind, step_ms=0.2)
    ps = prompts(6)
    # the first turn decodes long enough (200 steps) for the three later ones to join it however
    # late the event loop starts them on a loaded host
    samplings = [
        Sampling(
            max_new_tokens=200 if i == 0 else 20 + 5 * i,
            ignore_eos=i % 2 == 0,
            temperature=0.8 * (i % 3 == 1),
            seed=40 + i,
        )
        for i in range(6)
    ]
    want = [alone(kind, p, s) for p, s in zip(ps, samplings, strict=True)]
    started = asyncio.Event()

    async def first() -> list[int]:
        out = []
        async for t in engine.generate(ps[0], samplings[0]):
            out.append(t.token_id)
            if len(out) == 3:
                started.set()
        return out

    async def later(p: list[int], s: Sampling) -> list[int]:
        await started.wait()
        return await tokens(engine, p, s)

    got = await asyncio.gather(
        first(),
        *(tokens(engine, p, s) for p, s in zip(ps[1:3], samplings[1:3], strict=True)),
        *(later(p, s) for p, s in zip(ps[3:], samplings[3:], strict=True)),
    )
    assert list(got) == want
    sizes = [n for what, n in engine.model.log if what == "batch"]
    assert (max(sizes) == 6) if KINDS[kind]["batched_decode"] else not sizes
    assert engine.active == 0 and engine._stepper.idle


@pytest.mark.parametrize("kind", ["batched", "unbatched"])
async def test_queued_prefills_run_one_between_two_decode_steps(kind):
    """Two turns decoding, then six prompts at once: every prefill runs after a decode step, never
    two back to back, and the decoding turns' tokens are unchanged."""
    engine = engine_of(kind, step_ms=0.5)
    ps = prompts(8, seed=1)
    long = Sampling(max_new_tokens=400, ignore_eos=True)  # decoding still while the prefills run
    short = Sampling(max_new_tokens=3, ignore_eos=True)
    going = [asyncio.Event(), asyncio.Event()]

    async def long_turn(p: list[int], ev: asyncio.Event) -> list[int]:
        out = []
        async for t in engine.generate(p, long):
            out.append(t.token_id)
            if len(out) == 2:
                ev.set()
        return out

    decoding = [asyncio.ensure_future(long_turn(p, ev)) for p, ev in zip(ps[:2], going, strict=True)]
    await asyncio.gather(*(ev.wait() for ev in going))  # both turns decode
    mark = len(engine.model.log)
    await asyncio.gather(*(tokens(engine, p, short) for p in ps[2:]))
    runs = engine.model.log[mark:]
    prefills = [i for i, (what, n) in enumerate(runs) if what == "run" and n > 1]
    assert len(prefills) == 6 and all(b - a > 1 for a, b in zip(prefills, prefills[1:], strict=False))
    assert await asyncio.gather(*decoding) == [alone(kind, p, long) for p in ps[:2]]


async def test_a_session_whose_step_fails_fails_alone():
    """A session's KV goes bad mid-decode: its turn raises, the batched run is rerun step by step,
    and the other turns get their lone tokens."""
    engine = engine_of("batched", step_ms=0.2)
    ps = prompts(3, seed=2)
    s = Sampling(max_new_tokens=30, ignore_eos=True)

    async def poisoned() -> None:
        async for _ in engine.generate(ps[1], s, "bad"):  # bad from its first token on
            engine.sessions.peek("bad").kv.poisoned = True

    got = await asyncio.gather(tokens(engine, ps[0], s), poisoned(), tokens(engine, ps[2], s), return_exceptions=True)
    assert isinstance(got[1], InvalidRequest) and "poisoned" in str(got[1])
    assert [got[0], got[2]] == [alone("batched", ps[0], s), alone("batched", ps[2], s)]
    bad = engine.sessions.peek("bad")
    assert bad.kv.tokens == len(bad.token_ids)


@pytest.mark.parametrize("kind", ["batched", "unbatched"])
async def test_a_closed_turn_stops_and_its_session_stays_consistent(kind):
    """A turn closed after three tokens beside another: the stepper stops it (no run after), its
    session holds its prompt and tokens with their KV, and its next turn goes on from them."""
    engine = engine_of(kind, step_ms=0.5)
    ps = prompts(2, seed=3)
    s = Sampling(max_new_tokens=400, ignore_eos=True)
    other = asyncio.ensure_future(tokens(engine, ps[0], s))
    seen = []
    async with contextlib.aclosing(engine.generate(ps[1], s, "c")) as it:
        async for t in it:
            seen.append(t.token_id)
            if len(seen) == 3:
                break
    assert await other == alone(kind, ps[0], s)
    sess = engine.sessions.peek("c")
    assert sess.kv.tokens == len(sess.token_ids) and not sess.lock.locked()
    # every token seen but the last one, and what the stepper ran ahead before it saw the turn closed
    assert sess.token_ids[: len(ps[1]) + 2] == ps[1] + seen[:2] and len(sess.token_ids) < len(ps[1]) + 399
    runs = len(engine.model.log)
    await asyncio.sleep(0.01)
    assert len(engine.model.log) == runs and engine._stepper.idle
    assert await tokens(engine, ps[1] + seen, s, "c") == alone(kind, ps[1] + seen, s)
    assert engine.last_reused_tokens == len(ps[1]) + 2


async def test_a_prefill_cancelled_before_it_ran_never_runs():
    engine = engine_of("batched")
    gate = threading.Event()
    busy = asyncio.ensure_future(engine._run_job(gate.wait))
    it = engine.generate(prompts(1)[0], Sampling(max_new_tokens=4))
    task = asyncio.ensure_future(it.__anext__())
    for _ in range(10):
        await asyncio.sleep(0)
    assert engine.pending_prefills == 1
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await it.aclose()
    gate.set()
    await busy
    await asyncio.sleep(0.01)
    assert engine.model.log == [] and engine.pending_prefills == 0 and engine.pending_prefill_tokens == 0


async def test_each_step_hands_every_turns_token_back_in_one_call(monkeypatch):
    """Eight turns of 20 tokens: the tokens come back to the event loop in one call per decode step
    (and per prefill), not one per token."""
    engine = engine_of("batched", step_ms=0.5)
    loop = asyncio.get_running_loop()
    calls = []
    real = loop.call_soon_threadsafe

    def counted(fn, *args, **kw):
        calls.append(fn)
        return real(fn, *args, **kw)

    monkeypatch.setattr(loop, "call_soon_threadsafe", counted)
    s = Sampling(max_new_tokens=20, ignore_eos=True)
    await asyncio.gather(*(tokens(engine, p, s) for p in prompts(8, seed=4)))
    steps = sum(1 for what, _ in engine.model.log if what == "batch")
    assert len(calls) <= steps + 8 < 8 * 20 // 2


async def test_kv_read_and_adopted_decodes_on_alike():
    """``read_kv`` of a session and ``adopt`` of it into another (remote prefill's handoff), then
    ``extend``: the second session's turn gets the first one's tokens."""
    engine = engine_of("batched")
    p = prompts(1, seed=5)[0]
    s = Sampling(max_new_tokens=8, ignore_eos=True)
    first = await tokens(engine, p, s, "a")
    held = engine.sessions.peek("a").token_ids
    past = await engine.read_kv(engine.sessions.peek("a"), len(p))
    other = engine.new_session()
    await engine.adopt(other, p, past)
    assert await engine.extend(other, held) == len(held) - len(p)
    assert other.kv.states == engine.sessions.peek("a").kv.states
    got = [t.token_id async for t in engine.generate(p, s, session=other)]
    assert got == first == alone("batched", p, s)


async def test_the_thread_ends_when_idle_and_a_new_one_serves_the_next_turn():
    engine = engine_of("unbatched")
    engine._stepper.linger_s = 0.01
    s = Sampling(max_new_tokens=4, ignore_eos=True)
    p = prompts(1, seed=6)[0]
    assert await tokens(engine, p, s) == alone("unbatched", p, s)
    for _ in range(200):
        if engine._stepper._thread is None:
            break
        await asyncio.sleep(0.005)
    assert engine._stepper._thread is None
    assert await tokens(engine, p, s) == alone("unbatched", p, s)


async def test_a_thread_bound_model_keeps_one_thread_across_idle_gaps_until_the_engine_closes():
    """A model replaying CUDA graphs (``thread_bound``) is run from one thread for the engine's life:
    an idle gap longer than the linger does not end it; ``close`` does, and later turns are refused."""
    model = MemoryModel(SHAPE, **KINDS["batched"])
    model.thread_bound = True
    engine = LocalEngine(model, SHAPE, (EOS,))
    s = Sampling(max_new_tokens=4, ignore_eos=True)
    p = prompts(1, seed=7)[0]
    assert await tokens(engine, p, s) == alone("batched", p, s)
    thread = engine._stepper._thread
    assert thread is not None and thread.daemon
    await asyncio.sleep(3 * LINGER_S)
    assert engine._stepper._thread is thread and thread.is_alive()
    assert await tokens(engine, p, s, "a") == alone("batched", p, s)
    assert engine._stepper.threads_started == 1
    await engine.close()
    assert not thread.is_alive() and engine._stepper._thread is None
    with pytest.raises(EngineError, match="closed"):
        await tokens(engine, p, s)
    await engine.close()  # twice: nothing more


class CapturingModel(MemoryModel):
    """A model whose first two one-token runs set a CUDA graph up (``setup_runs`` grows then)."""

    setup_runs = 0

    def run(self, kv, ids, greedy, draw=None):
        out = super().run(kv, ids, greedy, draw)
        if len(ids) == 1 and self.setup_runs < 2:
            self.setup_runs += 1
        return out


async def test_a_run_that_captures_a_cuda_graph_stays_out_of_the_measured_rates():
    engine = LocalEngine(CapturingModel(SHAPE, batched_decode=False), SHAPE, (EOS,))
    s = Sampling(max_new_tokens=6, ignore_eos=True)
    await tokens(engine, prompts(1, seed=9)[0], s)
    assert engine.prefill_rate.samples == 1
    assert engine.decode_rate.samples == s.max_new_tokens - 3  # 5 decode runs, the first two set a graph up


async def test_a_one_token_prefill_is_not_a_decode_step():
    """A turn whose prompt the session holds but its last token runs a one-token prefill (on a
    GPU the uncaptured prefill graph): it moves neither rate; the turn's two decode steps do."""
    engine = LocalEngine(MemoryModel(SHAPE), SHAPE, (EOS,))
    ids = prompts(1, seed=4)[0]
    await tokens(engine, ids, Sampling(max_new_tokens=1, ignore_eos=True), session_id="s")
    assert engine.prefill_rate.samples == 1 and engine.decode_rate.samples == 0
    await tokens(engine, ids, Sampling(max_new_tokens=3, ignore_eos=True), session_id="s")
    assert engine.last_computed_tokens == 1  # the prompt held: its last token run again
    assert engine.prefill_rate.samples == 1 and engine.decode_rate.samples == 2


async def test_warmup_times_its_second_pass():
    """The first pass captures and allocates, untimed; the rates come from the second alone."""
    engine = LocalEngine(CapturingModel(SHAPE, batched_decode=False), SHAPE, (EOS,))
    await engine.warmup(16)
    assert engine.prefill_rate.samples == 1 and engine.decode_rate.samples >= 1
    assert engine.prefill_ms_per_token > 0 and engine.decode_ms_per_token > 0


class WarmingModel(MemoryModel):
    """A model that names KV capacities to warm (as ``DecoderGraph`` with CUDA graphs does) and
    records the slot sizes asked for; ``refuse_from`` makes larger slots fail as the KV bound would."""

    def __init__(self, capacities, refuse_from=None, **kw):
        super().__init__(SHAPE, **kw)
        self.capacities, self.refuse_from, self.hints = list(capacities), refuse_from, []

    def warm_capacities(self):
        return self.capacities

    def new_kv(self, tokens_hint):
        from tandem.common.protocol.errors import QuotaExceeded

        self.hints.append(tokens_hint)
        if self.refuse_from is not None and tokens_hint >= self.refuse_from:
            raise QuotaExceeded(f"{tokens_hint} tokens do not fit")
        return super().new_kv(tokens_hint)


class LargerIsSlower(WarmingModel):
    """Decode steps cost 1 ms, 20 ms on a slot of 512 tokens or more (attention over more
    positions); the slot's size is the hint it was made for."""

    def new_kv(self, tokens_hint):
        kv = super().new_kv(tokens_hint)
        kv.large = tokens_hint >= 512
        return kv

    def run(self, kv, ids, greedy, draw=None):
        tok, logits, ms = super().run(kv, ids, greedy, draw)
        return tok, logits, (20.0 if getattr(kv, "large", False) else 1.0) if len(ids) == 1 else ms

    def run_batch(self, kvs, token_ids, greedy, draws=None):
        toks, logits, ms = super().run_batch(kvs, token_ids, greedy, draws)
        return toks, logits, 20.0 if any(getattr(kv, "large", False) for kv in kvs) else 1.0


@pytest.mark.parametrize("kind", ["batched", "unbatched"])
async def test_warmup_runs_a_few_steps_on_each_capacity_the_model_names(kind):
    """After its two passes the warm-up runs one turn per named capacity, its slot that size, cut
    after a few decode steps; the rates are the timed pass's alone (the larger capacities' steps,
    20 ms here against 1, set graphs up and say nothing of a served turn)."""
    model = LargerIsSlower([512, 1024], **KINDS[kind])
    engine = LocalEngine(model, SHAPE, (EOS,))
    await engine.warmup(16)
    assert model.hints[-2:] == [512, 1024], model.hints
    assert engine.decode_ms_per_token == pytest.approx(1.0) and engine.active == 0
    # a served turn afterwards is unaffected
    s = Sampling(max_new_tokens=5, ignore_eos=True)
    assert await tokens(engine, prompts(1, seed=3)[0], s) == alone(kind, prompts(1, seed=3)[0], s)


async def test_warmup_stops_at_the_first_capacity_that_does_not_fit(caplog):
    model = WarmingModel([512, 1024, 2048], refuse_from=1024, **KINDS["batched"])
    engine = LocalEngine(model, SHAPE, (EOS,))
    with caplog.at_level("INFO", logger="tandem.edge.compute.local"):
        await engine.warmup(16)
    assert [h for h in model.hints if h >= 512] == [512, 1024], model.hints  # 2048 never tried
    assert "not set up past KV capacity 512" in caplog.text


async def test_warmup_warms_capacities_only_as_far_as_the_engines_positions_reach():
    """An engine serving fewer positions than the model's graph holds (``load_local``'s
    ``max_positions``): a capacity past them is warmed by a turn of the positions it serves (the
    longest turn lands in that slot), and none past that is tried; the warm-up does not fail."""

    model = WarmingModel([512, 1024, 2048, 4096], **KINDS["batched"])
    engine = LocalEngine(model, SHAPE.model_copy(update={"max_position_embeddings": 1000}), (EOS,))
    await engine.warmup(16)
    assert [h for h in model.hints if h >= 512] == [512, 1000], model.hints


def test_warm_capacities_are_the_larger_slot_capacities_within_the_budget():
    from tandem.edge.compute.decoder import plan_warm_capacities

    def nbytes(cap):
        return cap * 10

    caps = [256, 512, 1024, 2048, 4096, 8192]
    assert plan_warm_capacities(caps, nbytes, float("inf")) == [512, 1024, 2048, 4096, 8192]
    assert plan_warm_capacities([256, 512, 1024, 2048, 3000], nbytes, float("inf")) == [512, 1024, 2048, 3000]
    # 2 x (256 + 512 + 1024) x 10 = 35840 fits in 40000; 2048 more does not
    assert plan_warm_capacities(caps, nbytes, 40_000) == [512, 1024]
    assert plan_warm_capacities(caps, nbytes, 100) == [] and plan_warm_capacities([], nbytes, 100) == []


async def test_close_lets_the_turns_in_flight_finish():
    model = MemoryModel(SHAPE, step_ms=2.0, **KINDS["batched"])
    model.thread_bound = True
    engine = LocalEngine(model, SHAPE, (EOS,))
    s = Sampling(max_new_tokens=12, ignore_eos=True)
    p = prompts(1, seed=8)[0]
    turn = asyncio.create_task(tokens(engine, p, s))
    while engine._stepper.idle:
        await asyncio.sleep(0.001)
    await engine.close()
    assert await turn == alone("batched", p, s)


def test_results_for_a_closed_loop_cancel_their_mailbox():
    """The thread hands results to a loop that is closed: the mailbox is cancelled, nothing raises."""
    loop = asyncio.new_event_loop()
    loop.close()

    class Box(Mailbox):
        def push(self, item):  # pragma: no cover - a closed loop runs nothing
            raise AssertionError(item)

    box = Box(loop)
    stepper: Stepper[Box] = Stepper(lambda decoding: None, lambda: None)
    stepper.deliver(box, 1)
    stepper.flush()
    assert box.cancelled


def test_a_decoders_captured_runs_from_a_second_thread_are_logged_once(caplog):
    """``GraphThread``: ONNX Runtime keeps CUDA graphs per thread, so a second thread is a warning."""
    from tandem.edge.compute.decoder import GraphThread

    g, session = GraphThread(), object()
    for _ in range(3):
        g.note(session, 1)
    assert len(g.threads) == 1 and not caplog.records
    assert g.setup_runs == 2  # a graph id's uncaptured first run and its capture
    both = threading.Barrier(2)  # both alive at once: their ids differ

    def note() -> None:
        g.note(session, 1)
        both.wait()

    threads = [threading.Thread(target=note) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(g.threads) == 3
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "second thread" in caplog.records[0].message
