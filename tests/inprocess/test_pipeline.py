"""A pipelined split turn (the edge head runs in pieces; each piece's chunks and
KV blocks travel while the next is computed) sends what one whole run sends, overlaps the two,
and fails cleanly when the head fails midway. In-memory stack (``tests.doubles``)."""

from __future__ import annotations

import asyncio

import pytest

from tandem.common.protocol.errors import EngineError, TandemError
from tandem.common.wire.chunks import Chunk
from tandem.common.wire.messages import KVBlock
from tandem.edge.compute.head import HeadInput
from tandem.edge.link.base import CloudLink, TurnCall
from tests.doubles import MANIFEST, B, toy_stack
from tests.helpers import LONG, run, turn

LONGER = LONG + " And then the dog woke up and chased the fox around the whole farm, twice. " * 2


class Journal:
    """What happened, in order: head pieces (their new-token counts) and uplink sends."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []


class JournalLink:
    """Wraps a ``CloudLink``: records each chunk (token offset) and KV block (leaf index) sent."""

    def __init__(self, inner: CloudLink, journal: Journal) -> None:
        self.inner, self.journal = inner, journal

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def open(self, timeout_s):
        call, journal = self.inner.open(timeout_s), self.journal

        class Call:
            def send(self, item) -> int:
                if isinstance(item, Chunk):
                    journal.events.append(("chunk", item.token_offset))
                elif isinstance(item, KVBlock):
                    journal.events.append(("block", item.leaf_index))
                return call.send(item)

            def __getattr__(self, name):
                return getattr(call, name)

        c: TurnCall = Call()  # type: ignore[assignment]
        return c


def journal_head(toy, journal: Journal, fail_at_piece: int = 0) -> None:
    """Record each head run on ``journal``; with ``fail_at_piece`` the head raises at that call."""
    inner = toy.batcher.run_timed
    calls = [0]

    async def run_logged(row: HeadInput):
        calls[0] += 1
        if calls[0] == fail_at_piece:
            raise EngineError("head failed (injected)")
        journal.events.append(("head", int(row.token_ids.shape[0])))
        await asyncio.sleep(0.01)  # a piece takes time: what was framed meanwhile goes out
        return await inner(row)

    toy.batcher.run_timed = run_logged


def slow_link(toy, mbps: float = 0.5) -> None:
    """The edge measured a slow link: uploads are predicted to outlast the head, so split turns
    with enough new tokens pipeline (``CostModel.pipeline_pieces``). The toy edge is told its
    model's shape, so the cost model knows its bytes per token."""
    toy.edge.router.shape = MANIFEST.shape
    toy.edge.conn.goodput_mbps.add(mbps)


async def stacks(pipeline_tokens: int):
    journal = Journal()
    toy = await toy_stack(link_wrapper=lambda link: JournalLink(link, journal), pipeline_tokens=pipeline_tokens)
    journal_head(toy, journal)
    slow_link(toy)
    return toy, journal


async def test_a_pipelined_turn_sends_what_one_run_sends_and_overlaps_head_and_upload():
    whole, wj = await stacks(0)
    piped, pj = await stacks(32)
    try:
        for text in (LONG, LONGER):  # the second turn extends the first: only its new tokens run
            a = await run(whole.edge, turn(text, "s"))
            b = await run(piped.edge, turn(text, "s"))
            assert b.output_token_ids == a.output_token_ids
            assert (b.sent_bytes.activations_bytes, b.sent_bytes.kv_bytes) == (
                a.sent_bytes.activations_bytes,
                a.sent_bytes.kv_bytes,
            )
            assert b.head_tokens == a.head_tokens
            assert whole.cloud_session("s").leaves == piped.cloud_session("s").leaves
            assert whole.edge.sessions.peek("s").cloud_tokens == piped.edge.sessions.peek("s").cloud_tokens
        # one run: the head once, then everything; pipelined: 32-token pieces, sends between them
        heads = [n for kind, n in pj.events if kind == "head"]
        assert heads[0] == 32 and len(heads) > 4 and all(n <= 32 for n in heads)
        first_send = next(i for i, (kind, _) in enumerate(pj.events) if kind != "head")
        last_head = max(i for i, (kind, _) in enumerate(pj.events) if kind == "head")
        assert first_send < last_head  # chunk 0 was on the wire before the last piece ran
        whole_heads = [i for i, (kind, _) in enumerate(wj.events) if kind == "head"]
        assert len(whole_heads) == 2  # one per turn
        # the chunks went out in order, each block after the chunk that completes it
        offsets = [n for kind, n in pj.events if kind == "chunk"]
        assert offsets == sorted(offsets)
        sent: list[tuple[str, int]] = [e for e in pj.events if e[0] != "head"]
        for i, (kind, j) in enumerate(sent):
            if kind == "block":
                covered = max((n for kk, n in sent[:i] if kk == "chunk"), default=0) + 16
                assert (j + 1) * B <= covered + 16 * 2, (j, covered)
        assert piped.edge.sessions.peek("s").token_ids == whole.edge.sessions.peek("s").token_ids
    finally:
        await whole.batcher.stop()
        await piped.batcher.stop()


async def test_a_head_that_fails_midway_fails_the_turn_at_once_and_keeps_the_session(caplog):
    journal = Journal()
    toy = await toy_stack(link_wrapper=lambda link: JournalLink(link, journal), pipeline_tokens=32)
    slow_link(toy)
    try:
        first = await run(toy.edge, turn(LONG[:60], "s"))  # short: not pipelined
        before = toy.edge.sessions.peek("s").token_ids
        journal_head(toy, journal, fail_at_piece=3)
        with caplog.at_level("INFO"), pytest.raises(TandemError, match="head failed"):
            await run(toy.edge, turn(LONGER, "s"), timeout_s=20.0)
        # the edge cancelled the call at once: the cloud saw the upload end, it did not wait it out
        assert "UploadTimeout" not in caplog.text and "DeadlineExceeded" not in caplog.text, caplog.text
        assert toy.edge.sessions.peek("s").token_ids == before  # the failed turn left nothing behind
        assert any(kind == "chunk" for kind, _ in journal.events)  # it had started uploading
        toy.batcher.run_timed = type(toy.batcher).run_timed.__get__(toy.batcher)
        again = await run(toy.edge, turn(LONGER, "s"))
        fresh = await toy_stack(pipeline_tokens=0)
        try:
            await run(fresh.edge, turn(LONG[:60], "s"))
            assert again.output_token_ids == (await run(fresh.edge, turn(LONGER, "s"))).output_token_ids
        finally:
            await fresh.batcher.stop()
        assert first.output_token_ids
    finally:
        await toy.batcher.stop()


async def test_a_pipelined_turn_the_cloud_refuses_as_out_of_sync_finishes_its_head_and_syncs(caplog):
    """The cloud lost the session (a restart without its store): the pipelined first attempt is
    refused at its header, the edge finishes its head, syncs, and resends from token 0."""
    toy = await toy_stack(pipeline_tokens=32)
    ref = await toy_stack(pipeline_tokens=0)
    slow_link(toy)
    try:
        for t in (turn(LONG, "s"),):
            await run(toy.edge, t)
            await run(ref.edge, t)
        toy.lose_cloud_sessions(stored=True)
        journal = Journal()
        journal_head(toy, journal)
        with caplog.at_level("INFO", "tandem.edge"):
            done = await run(toy.edge, turn(LONGER, "s"))
        assert "differs" in caplog.text  # refused as out of sync
        pieces = [n for _, n in journal.events]
        assert pieces[0] == 32 and len(pieces) >= 2  # the refused attempt was pipelined
        want = await run(ref.edge, turn(LONGER, "s"))
        assert done.output_token_ids == want.output_token_ids
        assert toy.edge.sessions.peek("s").token_ids == ref.edge.sessions.peek("s").token_ids
        assert toy.cloud_session("s").leaves == ref.cloud_session("s").leaves
    finally:
        await toy.batcher.stop()
        await ref.batcher.stop()


async def test_a_fast_link_or_a_short_turn_runs_the_head_whole():
    """Pipelining pays only where the upload outlasts the head (and the cloud, holding the turn's
    admission slot from its header, would otherwise wait on the edge): an unmeasured or fast
    link, or fewer than two pieces of new tokens, runs the head in one piece."""
    toy, journal = await stacks(32)
    try:
        g = toy.edge.conn.goodput_mbps
        toy.edge.conn.goodput_mbps = type(g)(g.alpha)  # forget the measurement
        await run(toy.edge, turn(LONG, "a"))  # unknown goodput: the upload is predicted free
        await run(toy.edge, turn(LONG[:50], "b"))
        slow_link(toy)
        await run(toy.edge, turn(LONG[:50], "c"))  # slow link, but one piece of new tokens
        heads = [n for kind, n in journal.events if kind == "head"]
        assert len(heads) == 3 and heads[0] > 2 * 32  # one head call per turn, the long one too
    finally:
        await toy.batcher.stop()


def test_the_cost_model_counts_the_overlap_of_a_pipelined_head():
    from tandem.edge.routing.costmodel import MAX_PIPELINE_PIECES, CostModel

    cm = CostModel(pipeline_tokens=128)
    assert cm.pipeline_pieces(1024, head_ms=500.0, wire_ms=4000.0) == 8
    assert cm.pipeline_pieces(1024, head_ms=500.0, wire_ms=100.0) == 0  # fast link: whole
    assert cm.pipeline_pieces(200, head_ms=100.0, wire_ms=4000.0) == 0  # one piece
    assert cm.pipeline_pieces(1024, head_ms=0.0, wire_ms=0.0) == 0  # a link not measured
    assert CostModel().pipeline_pieces(1024, 500.0, 4000.0) == 0  # pipelining off
    # a long prompt: at most MAX_PIPELINE_PIECES pieces, each longer (every piece re-reads the KV before it)
    assert cm.pipeline_pieces(4096, head_ms=500.0, wire_ms=4000.0) == MAX_PIPELINE_PIECES == 8
    assert cm.pipeline_piece_tokens(4096, 8) == 512 and cm.pipeline_piece_tokens(1024, 8) == 128
    assert cm.pipeline_piece_tokens(1000, 8) == 128  # never below --pipeline-tokens
