"""Domain forms of the ``Cloud.Generate`` stream, both directions, and their protobuf
conversion in one place.

Uplink (edge -> cloud): ``TurnHeader``, then ``wire.Chunk`` / ``KVBlock`` / ``Commit``, or, in
remote prefill, ``KVDownAck`` / ``Takeover`` (``common.wire.kvdown``).
Downlink (cloud -> edge): ``Nack``, ``Repair``, ``WindowAck``, ``UploadAck``, ``TokensOut``,
``TurnFinal``, ``TurnError``, and remote prefill's ``KVBlock`` / ``Commit``. A KV block and a commit
are one domain type each (``common.wire.kvcodec``) whichever way they travel; the direction picks
their protobuf message (``KVBlockDelta`` / ``Commit`` up, ``KVBlockDown`` / ``KVCommitDown`` down). Domain
code passes these frozen dataclasses around; only ``uplink_to_pb`` / ``uplink_from_pb`` /
``downlink_to_pb`` / ``downlink_from_pb`` see protobuf. Dispatch is by type (registries below),
never by ``if kind == "..."``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.common.protocol.errors import InvalidRequest, TandemError, base_names, error_from_name
from tandem.common.protocol.params import Sampling, ServerLoad
from tandem.common.wire import chunks as wire
from tandem.common.wire.kvcodec import Commit, KVBlock
from tandem.common.wire.kvdown import KVDownAck, RemotePrefill, Takeover
from tandem.pbconv import from_pb, to_pb
from tandem.stages import Timings, timings_from_wire, timings_to_wire
from tandem.v1 import tandem_pb2 as pb

# ------------------------------------------------------------------ uplink


@dataclass(frozen=True, kw_only=True)
class TurnHeader:
    """First uplink message of a turn; see ``RequestHeader`` in the proto for units."""

    request_id: str
    session_id: str
    params_version: int
    split_layer: int
    prompt_token_ids: tuple[int, ...]
    cached_tokens: int
    num_chunks: int
    num_kv_blocks: int
    sampling: Sampling
    link_id: str = ""
    remote_prefill: RemotePrefill | None = None  # set: remote prefill (``split_layer`` 0)

    @classmethod
    def from_pb(cls, m: pb.RequestHeader) -> TurnHeader:
        rp = RemotePrefill.from_pb(m.remote_prefill) if m.HasField("remote_prefill") else None
        return from_pb(cls, m, sampling=Sampling.from_pb(m.sampling), remote_prefill=rp)

    def to_pb(self) -> pb.RequestHeader:
        m = to_pb(pb.RequestHeader, self, exclude=("remote_prefill",), sampling=self.sampling.to_pb())
        if self.remote_prefill is not None:
            m.remote_prefill.CopyFrom(self.remote_prefill.to_pb())
        return m


def chunk_from_pb(m: pb.ActivationChunk) -> wire.Chunk:
    """Raises InvalidRequest for unknown enum values."""
    if m.wire_dtype not in wire.WireDtype._value2member_map_ or m.codec not in wire.Codec._value2member_map_:
        raise InvalidRequest(f"chunk {m.seq}: unknown wire_dtype {m.wire_dtype} or codec {m.codec}")
    return from_pb(wire.Chunk, m, wire_dtype=wire.WireDtype(m.wire_dtype), codec=wire.Codec(m.codec))


def chunk_to_pb(c: wire.Chunk) -> pb.ActivationChunk:
    return to_pb(pb.ActivationChunk, c)


UplinkItem = TurnHeader | wire.Chunk | KVBlock | Commit | KVDownAck | Takeover

_UP_TO: dict[type, tuple[str, Callable[[Any], Any]]] = {
    TurnHeader: ("header", TurnHeader.to_pb),
    wire.Chunk: ("chunk", chunk_to_pb),
    KVBlock: ("kv_block", KVBlock.to_up_pb),
    Commit: ("commit", Commit.to_up_pb),
    KVDownAck: ("kv_ack", KVDownAck.to_pb),
    Takeover: ("takeover", Takeover.to_pb),
}
_UP_FROM: dict[str, Callable[[Any], UplinkItem]] = {
    "header": TurnHeader.from_pb,
    "chunk": chunk_from_pb,
    "kv_block": KVBlock.from_up_pb,
    "commit": Commit.from_up_pb,
    "kv_ack": KVDownAck.from_pb,
    "takeover": Takeover.from_pb,
}


def uplink_to_pb(item: UplinkItem) -> pb.Uplink:
    name, conv = _UP_TO[type(item)]
    return pb.Uplink(**{name: conv(item)})


def uplink_from_pb(m: pb.Uplink) -> UplinkItem:
    """Raises InvalidRequest for an empty message."""
    kind = m.WhichOneof("msg")
    if kind is None:
        raise InvalidRequest("empty uplink message")
    return _UP_FROM[kind](getattr(m, kind))


# ------------------------------------------------------------------ downlink


@dataclass(frozen=True, kw_only=True)
class Nack:
    """Chunk ``seq`` failed its CRC32C or did not decode: send it again."""

    seq: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class Repair:
    """Send exactly these KV blocks again, then the commit."""

    leaf_indices: tuple[int, ...]
    reason: str


@dataclass(frozen=True, kw_only=True)
class WindowAck:
    """The cloud received ``received_bytes`` of the upload's payload, each item once (the edge's
    send window moves on); it keeps the first ``held_tokens`` prompt tokens of the session turn if
    the upload is cut now (a resumed upload starts there; 0 = nothing kept, stateless)."""

    received_bytes: int
    held_tokens: int = 0


@dataclass(frozen=True, kw_only=True)
class UploadAck:
    """The upload verified: the cloud holds activations of ``verified_tokens`` prompt tokens
    and ``leaf_count`` head-KV leaves of the session."""

    verified_tokens: int
    leaf_count: int
    merkle_root: bytes = b""


@dataclass(frozen=True, kw_only=True)
class TokensOut:
    """Output tokens starting at output position ``index``."""

    token_ids: tuple[int, ...]
    index: int


@dataclass(frozen=True, kw_only=True)
class TurnFinal:
    finish_reason: str
    prompt_tokens: int
    output_tokens: int
    external_tokens: int
    timings: Timings = field(default_factory=dict)
    received_bytes: dict[str, int] = field(default_factory=dict)
    load: ServerLoad | None = None  # the cloud's load as the turn ended
    queue_wait_ms: float = 0.0  # this turn's wait for admission


@dataclass(frozen=True, kw_only=True)
class TurnError:
    """The cloud's verdict on a failed turn (see ``Error`` in the proto)."""

    error: TandemError


DownEvent = Nack | Repair | WindowAck | UploadAck | TokensOut | TurnFinal | TurnError | KVBlock | Commit


def _final_to_pb(e: TurnFinal) -> pb.Final:
    load = e.load.to_pb() if e.load is not None else None
    return to_pb(pb.Final, e, exclude=("timings", "load"), timings_ms=timings_to_wire(e.timings), load=load)


def _final_from_pb(m: pb.Final) -> TurnFinal:
    load = ServerLoad.from_pb(m.load) if m.HasField("load") else None
    return from_pb(TurnFinal, m, timings=timings_from_wire(m.timings_ms), load=load)


_DOWN_TO: dict[type, Callable[[Any], pb.Downlink]] = {
    Nack: lambda e: pb.Downlink(nack=pb.Nack(seq=e.seq, reason=e.reason)),
    WindowAck: lambda e: pb.Downlink(
        window_ack=pb.WindowAck(received_bytes=e.received_bytes, held_tokens=e.held_tokens)
    ),
    Repair: lambda e: pb.Downlink(repair=pb.RepairRequest(leaf_indices=list(e.leaf_indices), reason=e.reason)),
    UploadAck: lambda e: pb.Downlink(
        upload_ack=pb.UploadAck(verified_tokens=e.verified_tokens, leaf_count=e.leaf_count, merkle_root=e.merkle_root)
    ),
    TokensOut: lambda e: pb.Downlink(tokens=pb.Tokens(token_ids=list(e.token_ids), index=e.index)),
    TurnFinal: lambda e: pb.Downlink(final=_final_to_pb(e)),
    KVBlock: lambda e: pb.Downlink(kv_block=e.to_down_pb()),
    Commit: lambda e: pb.Downlink(kv_commit=e.to_down_pb()),
    TurnError: lambda e: pb.Downlink(
        error=pb.Error(
            kind=e.error.wire_name,
            message=str(e.error),
            retry_after_ms=max(0, int(getattr(e.error, "retry_after_ms", 0) or 0)),
            base_kinds=base_names(e.error),
        )
    ),
}
_DOWN_FROM: dict[str, Callable[[Any], DownEvent]] = {
    "nack": lambda m: Nack(seq=m.seq, reason=m.reason),
    "repair": lambda m: Repair(leaf_indices=tuple(m.leaf_indices), reason=m.reason),
    "window_ack": lambda m: WindowAck(received_bytes=m.received_bytes, held_tokens=m.held_tokens),
    "upload_ack": lambda m: UploadAck(
        verified_tokens=m.verified_tokens, leaf_count=m.leaf_count, merkle_root=m.merkle_root
    ),
    "tokens": lambda m: TokensOut(token_ids=tuple(m.token_ids), index=m.index),
    "final": _final_from_pb,
    "kv_block": KVBlock.from_down_pb,
    "kv_commit": Commit.from_down_pb,
    "error": lambda m: TurnError(error=error_from_name(m.kind, m.message, tuple(m.base_kinds[:16]), m.retry_after_ms)),
}


def downlink_to_pb(ev: DownEvent) -> pb.Downlink:
    return _DOWN_TO[type(ev)](ev)


def downlink_from_pb(m: pb.Downlink) -> DownEvent:
    """Raises InvalidRequest for an empty message (a cloud newer than this edge)."""
    kind = m.WhichOneof("msg")
    if kind is None:
        raise InvalidRequest("empty downlink message")
    return _DOWN_FROM[kind](getattr(m, kind))
