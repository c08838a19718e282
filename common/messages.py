"""Domain forms of the ``Generate`` uplink messages, with ``from_pb`` / ``to_pb``."""

from __future__ import annotations

from dataclasses import dataclass

from common import wire
from common.errors import InvalidRequest
from common.params import Sampling
from tandem.v1 import tandem_pb2 as pb


@dataclass(frozen=True)
class TurnHeader:
    request_id: str
    session_id: str
    params_version: int
    split_layer: int
    prompt_token_ids: tuple[int, ...]
    cached_tokens: int
    num_chunks: int
    num_kv_blocks: int
    sampling: Sampling

    @classmethod
    def from_pb(cls, m: pb.RequestHeader) -> TurnHeader:
        return cls(
            m.request_id,
            m.session_id,
            m.params_version,
            m.split_layer,
            tuple(m.prompt_token_ids),
            m.cached_tokens,
            m.num_chunks,
            m.num_kv_blocks,
            Sampling.from_pb(m.sampling),
        )

    def to_pb(self) -> pb.RequestHeader:
        return pb.RequestHeader(
            request_id=self.request_id,
            session_id=self.session_id,
            params_version=self.params_version,
            split_layer=self.split_layer,
            prompt_token_ids=list(self.prompt_token_ids),
            cached_tokens=self.cached_tokens,
            num_chunks=self.num_chunks,
            num_kv_blocks=self.num_kv_blocks,
            sampling=self.sampling.to_pb(),
        )


@dataclass(frozen=True)
class KVBlock:
    leaf_index: int
    block_hash: bytes
    layer_lo: int
    layer_hi: int
    codec: wire.Codec
    raw_nbytes: int
    payload: bytes
    leaf_hash: bytes

    @classmethod
    def from_pb(cls, m: pb.KVBlockDelta) -> KVBlock:
        if m.codec not in wire.Codec._value2member_map_:
            raise InvalidRequest(f"KV block {m.leaf_index}: unknown codec {m.codec}")
        codec = wire.Codec(m.codec)
        return cls(m.leaf_index, m.block_hash, m.layer_lo, m.layer_hi, codec, m.raw_nbytes, m.payload, m.leaf_hash)

    def to_pb(self) -> pb.KVBlockDelta:
        return pb.KVBlockDelta(
            leaf_index=self.leaf_index,
            block_hash=self.block_hash,
            layer_lo=self.layer_lo,
            layer_hi=self.layer_hi,
            codec=wire.pb_name(self.codec),
            raw_nbytes=self.raw_nbytes,
            payload=self.payload,
            leaf_hash=self.leaf_hash,
        )


def chunk_from_pb(m: pb.ActivationChunk) -> wire.Chunk:
    """Raises InvalidRequest for unknown enum values."""
    if m.wire_dtype not in wire.WireDtype._value2member_map_ or m.codec not in wire.Codec._value2member_map_:
        raise InvalidRequest(f"chunk {m.seq}: unknown wire_dtype {m.wire_dtype} or codec {m.codec}")
    return wire.Chunk(
        m.seq,
        m.token_offset,
        m.num_tokens,
        wire.WireDtype(m.wire_dtype),
        wire.Codec(m.codec),
        m.raw_nbytes,
        m.payload,
        m.crc32c,
    )


def chunk_to_pb(c: wire.Chunk) -> pb.ActivationChunk:
    return pb.ActivationChunk(
        seq=c.seq,
        token_offset=c.token_offset,
        num_tokens=c.num_tokens,
        wire_dtype=wire.pb_name(c.wire_dtype),
        codec=wire.pb_name(c.codec),
        raw_nbytes=c.raw_nbytes,
        payload=c.payload,
        crc32c=c.crc32c,
    )
