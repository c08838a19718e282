"""The edge's side of ``Cloud.Generate``: send one turn's upload, answer NACKs and
repair requests from the frames it kept, and hand downlink events on.

Network handling only: what to send is decided by ``edge.service``.
``tamper`` is a seam for link emulation and fault injection: it sees every
uplink message with its send attempt number and may return altered bytes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from common import wire
from common.errors import EngineError
from common.messages import KVBlock, TurnHeader, chunk_to_pb
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

Tamper = Callable[[pb.Uplink, int], pb.Uplink]


@dataclass
class OutgoingTurn:
    """Everything one turn may need to (re)send."""

    header: TurnHeader
    chunks: list[wire.Chunk]
    blocks: dict[int, KVBlock]
    leaf_count: int
    merkle_root: bytes
    sent_bytes: dict[str, int] = field(default_factory=lambda: {"header": 0, "activations": 0, "kv": 0})
    resent_chunks: int = 0
    repaired_blocks: int = 0
    upload_ms: float = 0.0


async def generate(
    stub: pb_grpc.CloudStub, turn: OutgoingTurn, tamper: Tamper | None = None, timeout_s: float | None = None
) -> AsyncIterator[pb.Downlink]:
    """Run one Generate call; yields downlink messages (tokens, upload ack, final).

    Raises:
        grpc.aio.AioRpcError: the cloud ended the call with an error status.
        EngineError: the cloud asked for a chunk or block this turn never sent.
    """
    queue: asyncio.Queue[pb.Uplink | None] = asyncio.Queue()
    attempts: dict[tuple[str, int], int] = {}

    def send(msg: pb.Uplink, kind: str, key: int) -> None:
        n = attempts[(kind, key)] = attempts.get((kind, key), 0) + 1
        if tamper is not None:
            msg = tamper(msg, n)
        turn.sent_bytes[kind] += msg.ByteSize()
        queue.put_nowait(msg)

    def send_commit() -> None:
        send(pb.Uplink(commit=pb.Commit(leaf_count=turn.leaf_count, merkle_root=turn.merkle_root)), "header", -1)

    send(pb.Uplink(header=turn.header.to_pb()), "header", -2)
    for c in turn.chunks:
        send(pb.Uplink(chunk=chunk_to_pb(c)), "activations", c.seq)
    for j, b in turn.blocks.items():
        send(pb.Uplink(kv_block=b.to_pb()), "kv", j)
    if turn.header.split_layer:
        send_commit()
    else:
        queue.put_nowait(None)

    async def uplink() -> AsyncIterator[pb.Uplink]:
        while (m := await queue.get()) is not None:
            yield m

    t0 = time.perf_counter()
    call = stub.Generate(uplink(), timeout=timeout_s)
    try:
        async for d in call:
            kind = d.WhichOneof("msg")
            if kind == "nack":
                if not 0 <= d.nack.seq < len(turn.chunks):
                    raise EngineError(f"cloud NACKed chunk {d.nack.seq}; this turn sent {len(turn.chunks)}")
                turn.resent_chunks += 1
                send(pb.Uplink(chunk=chunk_to_pb(turn.chunks[d.nack.seq])), "activations", d.nack.seq)
            elif kind == "repair":
                unknown = [j for j in d.repair.leaf_indices if j not in turn.blocks]
                if unknown:
                    raise EngineError(f"cloud asked to repair KV blocks {unknown[:8]} this turn did not send")
                for j in d.repair.leaf_indices:
                    turn.repaired_blocks += 1
                    send(pb.Uplink(kv_block=turn.blocks[j].to_pb()), "kv", j)
                send_commit()
            else:
                if kind == "upload_ack":
                    turn.upload_ms = (time.perf_counter() - t0) * 1e3
                    queue.put_nowait(None)
                yield d
    finally:
        queue.put_nowait(None)
        call.cancel()
