"""The edge head's work in a split turn: the head over the prompt tokens past the session's
common prefix, either whole before the upload (``run_head``) or in pieces whose upload overlaps
the next piece's compute (``PipelinedHead``). Both update the turn's ``EdgeSession`` (its token
ids, head KV and activations) and calibrate the cost model's head rate (ms per token).

Shapes: ``T`` new tokens, ``P`` tokens before them, ``H`` hidden size, ``k`` head layers,
``Hkv`` KV heads, ``D`` head dim: the head's output is float32 hidden ``[T, H]`` and KV
``[k, 2, Hkv, P + T, D]``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from tandem.common.protocol.params import LinkParams
from tandem.common.runtime.tracing import span, traced
from tandem.edge.compute.batcher import HeadBatcher
from tandem.edge.compute.head import HeadInput
from tandem.edge.link import framing
from tandem.edge.link.uplink import OutgoingTurn, Pieces
from tandem.edge.routing.costmodel import CostModel
from tandem.edge.turn import Turn
from tandem.stages import Stage

T = TypeVar("T")


@dataclass
class Head:
    """An edge head at split layer ``k``: its batched ONNX runner and the manifest key it was cut with."""

    batcher: HeadBatcher
    compatibility_key: str

    @property
    def k(self) -> int:
        return self.batcher.head.k


@traced("edge_head")
async def run_head(turn: Turn, head: Head, cost: CostModel) -> int:
    """Run ``head`` over the turn's tokens past its session's common prefix (an identical prompt
    recomputes its last token, so the turn has input); updates the session. Returns the tokens
    computed."""
    s, ids = turn.edge_session, turn.ids
    c = s.common_prefix(ids)
    if c == len(ids):
        c -= 1
    s.truncate(c)
    r = await head.batcher.run_timed(HeadInput(np.asarray(ids[c:], np.int64), s.kv))
    out = r.out
    s.kv = out.kv
    s.hidden = out.hidden if s.hidden is None else np.concatenate([s.hidden, out.hidden])
    s.token_ids = list(ids)
    turn.clock.timings[Stage.EDGE_HEAD_QUEUE], turn.clock.timings[Stage.EDGE_HEAD] = r.wait_ms, r.run_ms
    cost.edge.head(head.k).add(r.run_ms / (len(ids) - c))
    return len(ids) - c


@dataclass
class PipelinedHead:
    """A split turn whose head runs ``piece_tokens`` tokens at a time while its pieces travel:
    ``start`` frames the header and truncates the session to its common prefix with the prompt;
    ``pieces`` then runs the head piece by piece (each with the KV of those before it, so the
    result equals one run up to fp32 rounding) and yields, after each, the activation chunks now
    whole and the KV blocks inside them. After the last piece the turn's commit is set. The head
    (its batches' run times), head queue (the waits for the batcher) and encode times of the turn
    are the sums over its pieces."""

    turn: Turn
    head: Head
    params: LinkParams
    cost: CostModel
    piece_tokens: int
    out: OutgoingTurn | None = None
    _first: int = 0  # the first token the head computes (the session's common prefix)
    _hashes: tuple[bytes, ...] = ()

    def start(self, link_id: str) -> OutgoingTurn:
        """The turn to stream, before the head has run (``framing.pipelined_turn``)."""
        s, p, ids = self.turn.edge_session, self.params, self.turn.ids
        if s.block_tokens and s.block_tokens != p.kv_block_size_tokens:
            s.forget_cloud_past(0)
        self._first = s.common_prefix(ids)
        s.truncate(self._first)
        hashes = framing.block_ids(ids, p, self.head.compatibility_key, self.turn.session_id, self.turn.request_id)
        self._hashes = tuple(hashes)
        self.out = framing.pipelined_turn(s, self.turn.header(p, link_id), p, hashes)
        return self.out

    async def pieces(self) -> AsyncIterator[Pieces]:
        """The turn's pieces as the head produces them (``start`` first)."""
        assert self.out is not None, "start() frames the turn first"
        s, p, ids, out = self.turn.edge_session, self.params, self.turn.ids, self.out
        hashes, n = list(self._hashes), len(ids)
        start, seq, next_block = out.header.cached_tokens, 0, len(s.leaves)
        head_ms = queue_ms = encode_ms = 0.0
        e = self._first
        while e < n:
            e2 = min(n, e + self.piece_tokens)
            wait_ms, run_ms = await self._compute(e, e2)
            e = e2
            t1 = time.perf_counter()
            end = framing.whole_chunks_end(start, n, p.chunk_tokens, e)
            last = max(next_block, min(len(hashes), end // p.kv_block_size_tokens))
            hidden, kv = s.hidden, s.kv
            assert hidden is not None and kv is not None  # the piece just computed them
            chunks, blocks = await asyncio.to_thread(  # off the loop: acks and sends go on meanwhile
                _in_span, "encode", framing.piece, hidden, kv, hashes, p, (start, end), seq, (next_block, last)
            )
            seq, start, next_block = seq + len(chunks), end, last
            head_ms += run_ms
            queue_ms += wait_ms
            encode_ms += (time.perf_counter() - t1) * 1e3
            yield chunks, blocks
        out.finish(*framing.commit(s.leaves, out.blocks))
        timings = self.turn.clock.timings
        timings[Stage.EDGE_HEAD], timings[Stage.EDGE_HEAD_QUEUE], timings[Stage.ENCODE] = head_ms, queue_ms, encode_ms
        self.cost.edge.head(self.head.k).add(head_ms / (n - self._first))

    async def _compute(self, e: int, e2: int) -> tuple[float, float]:
        """The head over tokens ``[e, e2)``; the session then holds their KV and activations.
        Returns the piece's wait for the batcher and its batch's run time (ms)."""
        s, ids = self.turn.edge_session, self.turn.ids
        with span("edge_head", piece_tokens=e2 - e):
            t = await self.head.batcher.run_timed(HeadInput(np.asarray(ids[e:e2], np.int64), s.kv))
        r = t.out
        s.kv = r.kv
        s.hidden = r.hidden if s.hidden is None else np.concatenate([s.hidden, r.hidden])
        s.token_ids = list(ids[:e2])
        return t.wait_ms, t.run_ms


def _in_span(name: str, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` inside a tracing span ``name`` (the encode span of a piece: quantise, compress,
    CRC, leaf hashes; run in a worker thread)."""
    with span(name):
        return fn(*args)
