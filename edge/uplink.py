"""The edge's side of one ``Cloud.Generate`` turn, over any ``edge.link.TurnCall``: send the
header, activation chunks, KV blocks and commit; answer NACKs and repair requests from
the frames it kept; hand tokens and the final summary on.

Network handling only: what to send is decided by ``edge.service``; how it travels by
the link. On the cloud's verdict (a ``TurnError``) the link stops writing at once and
the verdict is raised, so a refusal arrives as the cloud meant it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tandem.common import metrics, wire
from tandem.common.errors import InvalidRequest
from tandem.common.messages import (
    ChunkAck,
    Commit,
    DownEvent,
    KVBlock,
    Nack,
    Repair,
    TokensOut,
    TurnFinal,
    TurnHeader,
    UploadAck,
)
from tandem.common.tracing import start_span
from tandem.edge.link import CloudLink, TurnCall

log = logging.getLogger("tandem.edge")


@dataclass
class OutgoingTurn:
    """Everything one turn may need to (re)send, and what sending it cost."""

    header: TurnHeader
    chunks: list[wire.Chunk]
    blocks: dict[int, KVBlock]
    leaf_count: int
    merkle_root: bytes
    window: int = 1 << 30  # chunks in flight past the last the cloud acked (negotiated)
    sent_bytes: dict[str, int] = field(default_factory=lambda: {"header": 0, "activations": 0, "kv": 0})
    chunks_sent: int = 0
    resent_chunks: int = 0
    repaired_blocks: int = 0
    upload_ms: float = 0.0

    @property
    def split(self) -> bool:
        return self.header.split_layer > 0


def _send_chunks(call: TurnCall, turn: OutgoingTurn, acked: int) -> None:
    """Send chunks up to the window past ``acked`` (chunks ``[0, acked)`` verified by the cloud)."""
    while turn.chunks_sent < min(len(turn.chunks), acked + turn.window):
        turn.sent_bytes["activations"] += call.send(turn.chunks[turn.chunks_sent])
        turn.chunks_sent += 1


def _send_upload(call: TurnCall, turn: OutgoingTurn) -> None:
    """Header, the first window of chunks, every KV block and the commit; later chunks follow the
    cloud's ``ChunkAck``s (``_send_chunks``)."""
    turn.sent_bytes["header"] += call.send(turn.header)
    _send_chunks(call, turn, 0)
    for b in turn.blocks.values():
        turn.sent_bytes["kv"] += call.send(b)
    if turn.split:
        turn.sent_bytes["header"] += call.send(Commit(turn.leaf_count, turn.merkle_root))
    else:
        call.close_send()


def _answer_nack(call: TurnCall, turn: OutgoingTurn, nack: Nack) -> None:
    """Raises InvalidRequest if the cloud NACKs a chunk this turn never sent."""
    if not 0 <= nack.seq < turn.chunks_sent:
        raise InvalidRequest(f"cloud NACKed chunk {nack.seq}; this turn sent {len(turn.chunks)}")
    turn.resent_chunks += 1
    log.info("cloud NACKed chunk %d (%.100s): sending it again", nack.seq, nack.reason)
    turn.sent_bytes["activations"] += call.send(turn.chunks[nack.seq])


def _answer_repair(call: TurnCall, turn: OutgoingTurn, repair: Repair) -> None:
    """Raises InvalidRequest if the cloud asks for a block this turn never sent."""
    unknown = [j for j in repair.leaf_indices if j not in turn.blocks]
    if unknown:
        raise InvalidRequest(f"cloud asked to repair KV blocks {unknown[:8]} this turn did not send")
    log.info("cloud asked for %d KV blocks again (%.100s)", len(repair.leaf_indices), repair.reason)
    for j in repair.leaf_indices:
        turn.repaired_blocks += 1
        turn.sent_bytes["kv"] += call.send(turn.blocks[j])
    turn.sent_bytes["header"] += call.send(Commit(turn.leaf_count, turn.merkle_root))


async def stream_turn(
    link: CloudLink, turn: OutgoingTurn, timeout_s: float | None
) -> AsyncIterator[UploadAck | TokensOut | TurnFinal]:
    """Run one Generate call with deadline ``timeout_s``; yields the upload ack, tokens, the final.

    Raises:
        TandemError: the cloud's verdict (SessionOutOfSync, InvalidRequest, DataLoss kinds...),
            EngineError (UNAVAILABLE: cloud unreachable or dead link), DeadlineExceeded.
    """
    call = link.open(timeout_s)
    t0 = time.perf_counter()
    uplink = start_span("uplink")  # until the cloud verified the upload
    try:
        _send_upload(call, turn)
        ev: DownEvent
        async for ev in call.events():
            if isinstance(ev, ChunkAck):
                _send_chunks(call, turn, ev.through_seq)
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
        uplink.end()
        call.cancel()
        metrics.record_uplink(turn.sent_bytes, turn.resent_chunks, turn.repaired_blocks)
