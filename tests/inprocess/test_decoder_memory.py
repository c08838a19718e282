"""The edge decoder's memory (``edge.compute.decoder.DecoderGraph``) on SmolLM2's prepared ``edge-decoder/``
with ONNX Runtime's CPU provider: a session's KV lives in its own buffers or in a batch pool row,
never both, and the bytes counted are the bytes held; idle pools shrink, empty ones and idle spare
buffers are freed;
``max_kv_bytes`` refuses what does not fit with ``QuotaExceeded`` while the other sessions decode
on, token for token as they would alone."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from tandem.common.protocol.chat import prompt_token_ids
from tandem.common.protocol.errors import QuotaExceeded
from tandem.common.protocol.params import Sampling
from tandem.edge.compute.decoder import DecoderGraph, KVSlot
from tandem.edge.compute.decoder_batch import IDLE_S
from tandem.edge.compute.local import LocalEngine

CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three rivers of Europe, one per line, with their lengths."}],
    [{"role": "user", "content": "Name two primary colours."}],
    [{"role": "user", "content": "Count from one to five."}],
]
NEW = 8


def make_graph(decoder_dir, max_kv_bytes: int | None = None, clock=time.monotonic) -> DecoderGraph:
    cpu = ["CPUExecutionProvider"]
    return DecoderGraph(decoder_dir, providers=cpu, intra_op_threads=2, max_kv_bytes=max_kv_bytes, clock=clock)


@pytest.fixture(scope="module")
def graph(decoder_dir):
    return make_graph(decoder_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [prompt_token_ids(tokenizer, m) for m in CHATS]


@pytest.fixture(scope="module")
def session_bytes(graph, prompts) -> int:
    """Bytes of one session's buffers at the first capacity (every prompt here fits it)."""
    cap = graph.min_slot_tokens
    assert all(len(p) + 4 * NEW < cap for p in prompts)
    return graph._session_nbytes(cap)


def lone(graph: DecoderGraph, ids: list[int], n: int, extra: list[int] | None = None) -> list[int]:
    """``n`` greedy tokens after ``ids`` alone; with ``extra``, then ``extra`` as a second turn and
    ``n`` tokens more."""
    slot = graph.new_kv(len(ids) + 2 * n + len(extra or []))
    out: list[int] = []
    try:
        for new in (ids, extra) if extra else (ids,):
            tok, _, _ = graph.run(slot, new, greedy=True)
            out.append(tok)
            for _ in range(n - 1):
                tok, _, _ = graph.run(slot, [tok], greedy=True)
                out.append(tok)
        return out
    finally:
        graph.release(slot)


def step_all(graph: DecoderGraph, slots: list[KVSlot], got: list[list[int]]) -> None:
    toks, _, _ = graph.run_batch(slots, [g[-1] for g in got], [True] * len(slots))
    for g, t in zip(got, toks, strict=True):
        g.append(t)


def held_by_buffers(graph: DecoderGraph, live: list[KVSlot]) -> int:
    """What the graph's buffers add up to: pools, spares and the live slots' own buffers."""
    spares = [s for kept in graph._free.values() for s in kept]
    return sum(p.nbytes for p in graph._pools.values()) + sum(s.own_nbytes() for s in spares + live)


def test_a_pooled_session_holds_its_kv_once_and_runs_its_next_turn_in_its_row(decoder_dir, prompts, session_bytes):
    g = make_graph(decoder_dir)
    extra = prompts[4][-6:]
    want = [lone(g, prompts[0], NEW, extra), lone(g, prompts[1], 2 * NEW)]
    g.trim()
    a, b = g.new_kv(64), g.new_kv(64)
    assert a.nbytes() == a.own_nbytes() == session_bytes
    got = [[g.run(s, p, greedy=True)[0]] for s, p in zip((a, b), prompts, strict=False)]
    for _ in range(NEW - 1):
        step_all(g, [a, b], got)
    pool = a.pool
    assert pool is not None and b.pool is pool and pool.rows == 2
    for s in (a, b):  # one copy: the row, no own buffers
        assert s.kv == [] and s.own_nbytes() == 0 and s.nbytes() == pool.row_nbytes == session_bytes
    assert pool.nbytes == 2 * session_bytes
    assert g.memory.held_bytes == held_by_buffers(g, [a, b])
    tok, _, _ = g.run(a, extra, greedy=True)  # a's next turn runs in its row
    assert a.pool is pool and a.kv == []
    got[0].append(tok)
    for _ in range(NEW):
        step_all(g, [a, b], got)
    got[0].pop()  # a ran NEW - 1 steps after its second turn's prefill in `want`
    assert got == want
    held = g.memory.held_bytes
    for s in (a, b):
        g.release(s)
    assert g.memory.held_bytes == held  # the pool waits, idle, for its next sessions
    assert g.trim() == held and g.memory.held_bytes == 0 and not g._pools


def test_past_the_graph_cap_steps_on_new_buffers_run_uncaptured_and_give_the_same_tokens(decoder_dir, prompts):
    """ONNX Runtime keeps every captured CUDA graph until its session ends, so a decoder captures at
    most ``max_graphs``: past it, a slot's or a pool's step on buffers without a graph runs
    uncaptured (once logged), the tokens unchanged. The captured path's bookkeeping runs here on
    the CPU provider (its run options name graph ids the CPU provider ignores); a CPU decoder gives
    idle buffers back after ``IDLE_S``, a CUDA-graph one keeps them (``idle_s`` None)."""
    ref = make_graph(decoder_dir)
    assert ref.idle_s == IDLE_S and not ref.thread_bound
    want = [lone(ref, p, NEW) for p in prompts[:4]]
    g = make_graph(decoder_dir)
    g.cuda_graph, g.max_graphs = True, 2
    assert lone(g, prompts[0], NEW) == want[0] and g.graphs == 1  # its slot's graph
    a, b = g.new_kv(64), g.new_kv(64)  # the spare (its graph kept) and new buffers
    got = [[g.run(s, p, greedy=True)[0]] for s, p in zip((a, b), prompts[1:3], strict=True)]
    for _ in range(NEW - 1):
        step_all(g, [a, b], got)  # a pool of 2 rows: its bucket's graph is the second
    assert got == want[1:3] and g.graphs == 2
    c = g.new_kv(64)  # a third: the pool grows to 4 rows, new buffers past the cap
    got.append([g.run(c, prompts[3], greedy=True)[0]])
    for _ in range(NEW - 1):
        step_all(g, [a, b, c], got)
    assert got[2] == want[3] and g.graphs == 2
    for s in (a, b, c):
        g.release(s)
    d = g.new_kv(1000)  # a new capacity, alone: its steps run uncaptured too
    assert d.binding is None
    out = [g.run(d, prompts[0], greedy=True)[0]]
    for _ in range(NEW - 1):
        out.append(g.run(d, [out[-1]], greedy=True)[0])
    assert out == want[0] and g.graphs == 2 and d.binding is None


def test_an_idle_pool_shrinks_to_its_sessions_and_an_empty_one_is_freed(decoder_dir, prompts):
    now = [0.0]
    g = make_graph(decoder_dir, clock=lambda: now[0])
    want = lone(g, prompts[0], 3 + 4 + 1)
    g.trim()
    slots = [g.new_kv(64) for _ in range(4)]
    got = [[g.run(s, p, greedy=True)[0]] for s, p in zip(slots, prompts, strict=False)]
    for _ in range(2):
        step_all(g, slots, got)
    pool = slots[0].pool
    assert pool is not None and pool.rows == 4 and len(pool.table) == 4 and len(g._free[pool.capacity_tokens]) == 4
    for s in slots[1:]:  # their sessions end
        g.release(s)
    keep = slots[0]
    for dt in (IDLE_S / 2, IDLE_S / 2 - 1, 0.5, 0.5):  # keep decodes alone in its row; 1 of 4 rows needed
        now[0] += dt
        tok, _, _ = g.run(keep, [got[0][-1]], greedy=True)
        got[0].append(tok)
        assert (keep.pool is pool) == (now[0] < IDLE_S)
    small = keep.pool
    assert small is not None and small.rows == 1 and pool.nbytes == 0 and keep.kv == []
    assert not any(g._free.values())  # the buffers the joiners gave up waited IDLE_S unused: freed
    late = g.new_kv(64)
    got.append([g.run(late, prompts[4], greedy=True)[0]])
    step_all(g, [keep, late], [got[0], got[-1]])  # the shrunk pool grows again for a joiner
    assert keep.pool is late.pool and keep.pool.rows == 2
    assert got[0] == want
    assert g.memory.held_bytes == held_by_buffers(g, [keep, late])
    g.release(keep)
    g.release(late)
    other = g.new_kv(64)
    tok, _, _ = g.run(other, prompts[5], greedy=True)
    now[0] += IDLE_S - 1
    tok, _, _ = g.run(other, [tok], greedy=True)
    assert len(g._pools) == 1  # empty, but not idle long enough: kept for the next burst
    now[0] += 1
    g.run(other, [tok], greedy=True)
    assert not g._pools  # empty for IDLE_S: freed, with its graphs
    assert g.memory.held_bytes == held_by_buffers(g, [other])
    g.release(other)
    g.trim()
    assert g.memory.held_bytes == 0


def test_the_memory_bound_refuses_clearly_and_the_other_sessions_decode_on(decoder_dir, prompts, session_bytes):
    """Room for five sessions' buffers: two sessions join a pool (their own buffers become spares,
    which the next two take), a fifth gets new ones, a sixth is refused; the pool cannot double,
    so the later sessions step alone, and every session's tokens are its lone ones."""
    bound = 5 * session_bytes
    g = make_graph(decoder_dir, max_kv_bytes=bound)
    want = [lone(g, p, 3 * NEW) for p in prompts[:5]]
    g.trim()
    a, b = g.new_kv(64), g.new_kv(64)
    got = [[g.run(s, p, greedy=True)[0]] for s, p in zip((a, b), prompts, strict=False)]
    for _ in range(NEW - 1):
        step_all(g, [a, b], got)
    assert a.pool is not None and b.pool is a.pool and g.memory.held_bytes == 4 * session_bytes
    rest = [g.new_kv(64) for _ in range(3)]  # two spares, one new
    assert g.memory.held_bytes == bound
    with pytest.raises(QuotaExceeded, match=r"KV memory is used up: \d+ of \d+ bytes held \(local_kv_bytes\)"):
        g.new_kv(64)
    slots = [a, b, *rest]
    got += [[g.run(s, p, greedy=True)[0]] for s, p in zip(rest, prompts[2:5], strict=True)]
    for _ in range(NEW - 1):
        step_all(g, slots, got)
        assert g.memory.held_bytes <= bound and all(s.pool is None for s in rest)
    for _ in range(NEW):
        step_all(g, [a, b], got[:2])
    assert [len(x) for x in got] == [3 * NEW - 1] * 2 + [NEW] * 3
    assert got == [w[: len(x)] for w, x in zip(want, got, strict=True)]
    g.release(rest[2])  # its buffers become a spare: the next session takes them
    f = g.new_kv(64)
    assert g.run(f, prompts[4], greedy=True)[0] == want[4][0]
    assert g.memory.held_bytes <= bound


async def test_the_engine_refuses_a_turn_beyond_the_bound_and_serves_the_others(decoder_dir, manifest, prompts):
    """Room for two sessions: a third concurrent turn fails with QuotaExceeded (RESOURCE_EXHAUSTED
    on the wire), the two others get their lone tokens; once they end, the third is served."""
    probe = make_graph(decoder_dir)
    one = probe._session_nbytes(probe.min_slot_tokens)
    eng = LocalEngine(make_graph(decoder_dir, max_kv_bytes=2 * one), manifest.shape, (2,))
    s = Sampling(max_new_tokens=NEW, ignore_eos=True)

    async def turn(ids: list[int], sid: str = "") -> list[int]:
        return [t.token_id async for t in eng.generate(ids, s, sid)]

    alone = [await turn(p) for p in prompts[:3]]
    sids = [f"m-{uuid.uuid4().hex}" for _ in range(2)]
    got = await asyncio.gather(
        turn(prompts[0], sids[0]), turn(prompts[1], sids[1]), turn(prompts[2]), return_exceptions=True
    )
    assert got[:2] == alone[:2]
    assert isinstance(got[2], QuotaExceeded) and "local_kv_bytes" in str(got[2])
    assert eng.sessions.nbytes() == 2 * one  # what the sessions hold, once each
    for sid in sids:
        await eng.end_session(sid)
    assert await turn(prompts[2]) == alone[2]


async def test_a_turn_beyond_the_bound_drops_the_least_recent_idle_session(decoder_dir, manifest, prompts):
    """Room for two sessions, both idle after their turns: a third session's turn drops the least
    recently used one (the session table is a cache) and gets its lone tokens; the other stays."""
    probe = make_graph(decoder_dir)
    one = probe._session_nbytes(probe.min_slot_tokens)
    eng = LocalEngine(make_graph(decoder_dir, max_kv_bytes=2 * one), manifest.shape, (2,))
    s = Sampling(max_new_tokens=NEW, ignore_eos=True)

    async def turn(ids: list[int], sid: str = "") -> list[int]:
        return [t.token_id async for t in eng.generate(ids, s, sid)]

    alone = await turn(prompts[2])
    sids = [f"i-{uuid.uuid4().hex}" for _ in range(3)]
    await turn(prompts[0], sids[0])
    await turn(prompts[1], sids[1])
    assert await turn(prompts[2], sids[2]) == alone
    assert sids[0] not in eng.sessions and sids[1] in eng.sessions and sids[2] in eng.sessions
    assert await turn(prompts[2]) == alone  # a stateless turn drops the next one


async def test_the_session_table_counts_one_copy_of_each_pooled_session(decoder_dir, manifest, prompts):
    eng = LocalEngine(make_graph(decoder_dir), manifest.shape, (2,))
    graph = eng.model
    s = Sampling(max_new_tokens=NEW, ignore_eos=True)
    sids = [f"p-{uuid.uuid4().hex}" for _ in range(3)]

    async def turn(ids: list[int], sid: str) -> list[int]:
        return [t.token_id async for t in eng.generate(ids, s, sid)]

    await asyncio.gather(*(turn(p, sid) for p, sid in zip(prompts, sids, strict=False)))
    kvs = [eng.sessions.peek(sid).kv for sid in sids]
    pooled = [kv for kv in kvs if kv.pool is not None]
    assert len(pooled) >= 2  # they decoded in a batch, and stay in its rows between turns
    assert all(kv.own_nbytes() == 0 and kv.nbytes() == kv.pool.row_nbytes for kv in pooled)
    assert eng.sessions.nbytes() == 3 * graph._session_nbytes(graph.min_slot_tokens)
    alone = [kv for kv in kvs if kv.pool is None]  # a turn whose prefill came after the others ended
    assert graph.memory.held_bytes == held_by_buffers(graph, alone)


async def test_an_edge_without_turns_gives_its_pools_and_spares_back(decoder_dir, manifest, prompts):
    now = [0.0]
    eng = LocalEngine(make_graph(decoder_dir, clock=lambda: now[0]), manifest.shape, (2,))
    graph = eng.model
    s = Sampling(max_new_tokens=NEW, ignore_eos=True)
    sids = [f"t-{uuid.uuid4().hex}" for _ in range(2)]

    async def turn(ids: list[int], sid: str) -> list[int]:
        return [t.token_id async for t in eng.generate(ids, s, sid)]

    await asyncio.gather(*(turn(p, sid) for p, sid in zip(prompts, sids, strict=False)))
    assert graph._pools and graph.memory.held_bytes > 0
    for sid in sids:
        await eng.end_session(sid)
    await eng.tidy()  # the ended sessions' rows are freed; the pool waits for the next burst
    assert graph._pools and all(len(p.table) == 0 for p in graph._pools.values())
    now[0] += IDLE_S
    await eng.tidy()
    assert not graph._pools and not any(graph._free.values()) and graph.memory.held_bytes == 0
