"""The edge's side of one ``Cloud.Generate`` turn, over any ``edge.link.base.TurnCall``: send the
header, activation chunks, KV blocks and commit; answer NACKs and repair requests from
the frames it kept; hand tokens and the final summary on.

Network handling only: what to send is framed by ``edge.link.framing``; how it travels by
the link. On the cloud's verdict (a ``TurnError``) the link stops writing at once and
the verdict is raised, so a refusal arrives as the cloud meant it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

from tandem.common.protocol.errors import EngineError, InvalidRequest
from tandem.common.runtime.tracing import start_span
from tandem.common.wire import chunks as wire
from tandem.common.wire.flow import SendWindow
from tandem.common.wire.messages import (
    Commit,
    DownEvent,
    KVBlock,
    Nack,
    Repair,
    TokensOut,
    TurnFinal,
    TurnHeader,
    UploadAck,
    WindowAck,
)
from tandem.edge import metrics
from tandem.edge.events import SentBytes
from tandem.edge.link.base import CloudLink, TurnCall

log = logging.getLogger("tandem.edge")


@dataclass
class OutgoingTurn:
    """Everything one turn may need to (re)send, and what sending it cost."""

    header: TurnHeader
    chunks: list[wire.Chunk]
    blocks: dict[int, KVBlock]
    leaf_count: int
    merkle_root: bytes
    window: int = 1 << 62  # payload bytes in flight past the cloud's last WindowAck (negotiated)
    block_tokens: int = 0  # KV block size B: block j travels after the chunk holding token (j+1)*B - 1
    sent_bytes: SentBytes = SentBytes()
    next_item: int = 0
    committed: bool = False
    sent_chunks: set[int] = field(default_factory=set)
    held_tokens: int = 0  # the cloud keeps the first held_tokens prompt tokens if the upload is cut (WindowAck)
    complete: bool = True  # every chunk and block is known (False while a pipelined head still runs)
    pipelined: bool = False  # the head ran while the upload went (``edge.modes.split_head.PipelinedHead``)
    flow: SendWindow = field(init=False)  # payload bytes of first sends against the cloud's WindowAcks

    def __post_init__(self) -> None:
        self.order = send_order(self.chunks, self.blocks, self.block_tokens)
        self.flow = SendWindow(window_bytes=self.window)

    def extend(self, chunks: list[wire.Chunk], blocks: dict[int, KVBlock]) -> None:
        """More of a pipelined turn (``complete`` False): the next chunks in ``seq`` order and the
        KV blocks inside the tokens they end at; they queue behind what is already ordered.

        Raises:
            InvalidRequest: the turn is complete, a chunk is out of order, or a block is known.
        """
        if self.complete:
            raise InvalidRequest("a complete turn takes no more chunks or blocks")
        if [c.seq for c in chunks] != list(range(len(self.chunks), len(self.chunks) + len(chunks))):
            raise InvalidRequest(f"chunks {[c.seq for c in chunks]} do not follow chunk {len(self.chunks) - 1}")
        if self.blocks.keys() & blocks.keys():
            raise InvalidRequest(f"KV blocks {sorted(self.blocks.keys() & blocks.keys())} were already queued")
        self.chunks += chunks
        self.blocks.update(blocks)
        self.order += send_order(chunks, blocks, self.block_tokens)

    def finish(self, leaf_count: int, merkle_root: bytes) -> None:
        """The pipelined head is done: the commit (``leaf_count``, ``merkle_root``) may follow the last item."""
        self.leaf_count, self.merkle_root, self.complete = leaf_count, merkle_root, True

    resent_chunks: int = 0  # chunks sent again on the cloud's NACK (events, not bytes)
    repaired_blocks: int = 0  # KV blocks sent again on the cloud's repair request
    upload_ms: float = 0.0

    @property
    def split(self) -> bool:
        return self.header.split_layer > 0


def send_order(chunks: list[wire.Chunk], blocks: dict[int, KVBlock], block_tokens: int) -> list[wire.Chunk | KVBlock]:
    """Chunks in order, each followed by the KV blocks it completes (block ``j`` covers tokens
    ``[j*B, (j+1)*B)``); blocks of tokens before the first chunk lead, any others trail."""
    pending = sorted(blocks.items())
    order: list[wire.Chunk | KVBlock] = []
    first = chunks[0].token_offset if chunks else 0
    while pending and block_tokens and (pending[0][0] + 1) * block_tokens <= first:
        order.append(pending.pop(0)[1])
    for c in chunks:
        order.append(c)
        end = c.token_offset + c.num_tokens
        while pending and block_tokens and (pending[0][0] + 1) * block_tokens <= end:
            order.append(pending.pop(0)[1])
    return order + [b for _, b in pending]


def _send_more(call: TurnCall, turn: OutgoingTurn, received_bytes: int) -> None:
    """The cloud received ``received_bytes`` of the upload's payload (its last ``WindowAck``): send
    chunks and KV blocks in ``turn.order`` while the payload in flight past that stays within the
    window (``turn.flow``), or nothing is in flight; the commit after the last of them."""
    turn.flow.ack(received_bytes)
    while turn.next_item < len(turn.order):
        item = turn.order[turn.next_item]
        if not turn.flow.fits(len(item.payload)):
            return
        if isinstance(item, wire.Chunk):
            turn.sent_bytes += SentBytes(activations_bytes=call.send(item))
            turn.sent_chunks.add(item.seq)
        else:
            turn.sent_bytes += SentBytes(kv_bytes=call.send(item))
        turn.flow.sent(len(item.payload))
        turn.next_item += 1
    if turn.split and turn.complete and not turn.committed:
        turn.committed = True
        turn.sent_bytes += SentBytes(
            header_bytes=call.send(Commit(leaf_count=turn.leaf_count, merkle_root=turn.merkle_root))
        )


def _send_upload(call: TurnCall, turn: OutgoingTurn) -> None:
    """The header and the first window of the upload; the rest follows the cloud's ``WindowAck``s."""
    turn.sent_bytes += SentBytes(header_bytes=call.send(turn.header))
    if turn.split:
        _send_more(call, turn, 0)
    else:
        call.close_send()


def _answer_nack(call: TurnCall, turn: OutgoingTurn, nack: Nack) -> None:
    """Raises InvalidRequest if the cloud NACKs a chunk this turn never sent."""
    if nack.seq not in turn.sent_chunks:
        raise InvalidRequest(f"cloud NACKed chunk {nack.seq}; this turn sent {len(turn.chunks)}")
    turn.resent_chunks += 1
    log.info("cloud NACKed chunk %d (%.100s): sending it again", nack.seq, nack.reason)
    turn.sent_bytes += SentBytes(activations_bytes=call.send(turn.chunks[nack.seq]))


def _answer_repair(call: TurnCall, turn: OutgoingTurn, repair: Repair) -> None:
    """Raises InvalidRequest if the cloud asks for a block this turn never sent."""
    unknown = [j for j in repair.leaf_indices if j not in turn.blocks]
    if unknown:
        raise InvalidRequest(f"cloud asked to repair KV blocks {unknown[:8]} this turn did not send")
    log.info("cloud asked for %d KV blocks again (%.100s)", len(repair.leaf_indices), repair.reason)
    for j in repair.leaf_indices:
        turn.repaired_blocks += 1
        turn.sent_bytes += SentBytes(kv_bytes=call.send(turn.blocks[j]))
    turn.sent_bytes += SentBytes(
        header_bytes=call.send(Commit(leaf_count=turn.leaf_count, merkle_root=turn.merkle_root))
    )


Pieces = tuple[list[wire.Chunk], dict[int, KVBlock]]


async def _guard(events: AsyncIterator[DownEvent], failed: list[Exception]) -> AsyncGenerator[DownEvent, None]:
    """``events``, except that once the pipelined head failed (``failed``), the call's end (which
    ``_feed`` caused by cancelling it) is reported as the head's error. A cancellation of the turn
    itself (its task being cancelled) and the generator's own close pass through unchanged."""
    try:
        async with contextlib.aclosing(events) as evs:  # type: ignore[type-var]
            async for ev in evs:
                if failed:
                    break
                yield ev
    except GeneratorExit:
        raise
    except BaseException as e:
        task = asyncio.current_task()
        ours = isinstance(e, Exception) or (
            isinstance(e, asyncio.CancelledError) and task is not None and not task.cancelling()
        )
        if failed and ours:
            raise failed[0] from None
        raise
    if failed:
        raise failed[0]


async def _feed(call: TurnCall, turn: OutgoingTurn, pieces: AsyncIterator[Pieces], failed: list[Exception]) -> None:
    """Queue a pipelined turn's pieces as its head produces them, within the window; the producer
    calls ``turn.finish`` after the last, and the commit follows. If the head fails (or is
    cancelled under it: a stopped batcher), the error goes to ``failed`` and the call is cancelled,
    so the turn ends at once with that error rather than the cloud waiting for pieces until the
    deadline."""
    try:
        async for chunks, blocks in pieces:
            turn.extend(chunks, blocks)
            _send_more(call, turn, turn.flow.acked_bytes)
        if not turn.complete:
            raise InvalidRequest("the pipelined head ended without finishing its turn")
        _send_more(call, turn, turn.flow.acked_bytes)
    except Exception as e:
        failed.append(e)
        call.cancel()
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and not task.cancelling():  # the head's await was cancelled, not this task
            failed.append(EngineError("the edge head was cancelled"))
            call.cancel()
            return
        raise


async def stream_turn(
    link: CloudLink,
    turn: OutgoingTurn,
    timeout_s: float | None,
    pieces: AsyncIterator[Pieces] | None = None,
) -> AsyncIterator[UploadAck | TokensOut | TurnFinal]:
    """Run one Generate call with deadline ``timeout_s``; yields the upload ack, tokens, the final.
    With ``pieces`` (a pipelined turn, ``turn.complete`` False), the header and each piece go out
    while the head computes the next; the commit follows the last piece.

    Raises:
        TandemError: the cloud's verdict (SessionOutOfSync, InvalidRequest, DataLoss kinds...),
            EngineError (UNAVAILABLE: cloud unreachable or dead link), DeadlineExceeded; whatever
            ``pieces`` raised (the head failed), the call then cancelled.
    """
    call = link.open(timeout_s)
    t0 = time.perf_counter()
    uplink = start_span("uplink")  # until the cloud verified the upload
    feeder: asyncio.Task[None] | None = None
    failed: list[Exception] = []  # the pipelined head's error, if it failed
    try:
        _send_upload(call, turn)
        if pieces is not None:
            feeder = asyncio.create_task(_feed(call, turn, pieces, failed))
        ev: DownEvent
        async with contextlib.aclosing(_guard(call.events(), failed)) as events:
            async for ev in events:
                if isinstance(ev, WindowAck):
                    if turn.split and turn.header.session_id:  # within the prompt: a resumed upload starts there
                        n = min(ev.held_tokens, len(turn.header.prompt_token_ids))
                        turn.held_tokens = max(turn.held_tokens, n)
                    _send_more(call, turn, ev.received_bytes)
                elif isinstance(ev, Nack):
                    _answer_nack(call, turn, ev)
                elif isinstance(ev, Repair):
                    _answer_repair(call, turn, ev)
                elif isinstance(ev, UploadAck | TokensOut | TurnFinal):
                    if isinstance(ev, UploadAck):
                        turn.upload_ms = (time.perf_counter() - t0) * 1e3
                        uplink.end()
                        call.close_send()
                    yield ev
    finally:
        if feeder is not None and not feeder.done():
            feeder.cancel()
            await asyncio.wait({feeder})  # its own cancellation stays inside it; ours propagates
        uplink.end()
        call.cancel()
        metrics.record_uplink(turn.sent_bytes.by_kind(), turn.resent_chunks, turn.repaired_blocks)
