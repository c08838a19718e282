"""Remote prefill's KV on the downlink: the messages of the prompt's whole-model KV coming down a
``Generate`` call (``KVBlockDown``, ``KVCommitDown``) and the edge's answers going up
(``KVDownAck``, ``Takeover``), with their protobuf conversion; how the cloud frames one block
(``frame_block``) and how the edge checks one (``check_block``, ``open_block``) and a turn's
commit (``check_commit``). Pure functions and frozen dataclasses: no network, no store, no engine.

A block is canonical float32 ``[L, 2, Hkv, B, D]`` (``common.wire.kvblocks``: K before V, keys after
RoPE, every layer ``[0, L)``) in the link's KV wire dtype (``common.wire.kvwire``), then the link's
codec. Its identity is the chained BLAKE3 of the prompt's token ids (``block_ids``) seeded with
the whole model's key (``full_model_key``) and the request's scope, which the edge computes itself;
its leaf (``common.wire.merkle.leaf_data``) commits to that id, the layers, the wire dtype and the
bytes in it; the turn's blocks ``[first_block, n)`` form an RFC 6962 tree whose root the commit
carries. Nothing from the wire is used before its sizes are checked against the link's params.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tandem.common.protocol.errors import ChecksumMismatch, InvalidRequest, MerkleMismatch
from tandem.common.protocol.manifest import ModelShape, SplitManifest
from tandem.common.protocol.params import LinkParams
from tandem.common.wire import chunks as wire
from tandem.common.wire import merkle
from tandem.common.wire.kvblocks import LayerRange, block_hashes, request_seed
from tandem.common.wire.kvwire import decode_kv, encode_kv, kv_raw_nbytes
from tandem.pbconv import from_pb, to_pb
from tandem.v1 import tandem_pb2 as pb

MAX_ABS_KV = 1e5  # bound on |K|, |V| accepted from the wire (the cloud's bound on uploaded KV)


def full_model_key(manifest: SplitManifest) -> str:
    """The whole model's identity, for the seed of its KV blocks' ids: the weights, dtype and shape
    (not the split layer), so an edge whose model differs from the cloud's refuses every block."""
    s = manifest.shape
    weights = manifest.weights_blake3 or f"{manifest.model_id}|{manifest.checkpoint_blake3}"
    shape = f"L{s.num_layers}.H{s.hidden_size}.Hq{s.num_heads}.Hkv{s.num_kv_heads}.D{s.head_dim}.V{s.vocab_size}"
    return f"tandem-full-v1|weights={weights}|{manifest.dtype}|{shape}"


def block_ids(ids: Sequence[int], block_tokens: int, model_key: str, session_id: str, request_id: str) -> list[bytes]:
    """Chained ids of the full blocks of ``ids`` (``common.wire.kvblocks.block_hashes``), seeded with the
    whole model's key and the turn's session (or, stateless, its request): both sides compute them."""
    return block_hashes(list(ids), block_tokens, request_seed(model_key, block_tokens, session_id, request_id))


def block_shape(shape: ModelShape, block_tokens: int) -> tuple[int, int, int, int, int]:
    """``(L, 2, Hkv, B, D)`` of one whole-model block."""
    return (shape.num_layers, 2, shape.num_kv_heads, block_tokens, shape.head_dim)


# ------------------------------------------------------------------ messages


@dataclass(frozen=True)
class RemotePrefill:
    """A header's remote-prefill request: the edge holds the whole-model KV of the first
    ``held_tokens`` prompt tokens, so blocks ``[held_tokens // B, T // B)`` come down."""

    held_tokens: int = 0

    @classmethod
    def from_pb(cls, m: pb.RemotePrefill) -> RemotePrefill:
        return cls(m.held_tokens)

    def to_pb(self) -> pb.RemotePrefill:
        return pb.RemotePrefill(held_tokens=self.held_tokens)


@dataclass(frozen=True)
class KVBlockDown:
    """One whole-model KV block, cloud -> edge (see ``KVBlockDown`` in the proto for units)."""

    block_index: int
    block_hash: bytes
    layer_lo: int
    layer_hi: int
    wire_dtype: wire.WireDtype
    codec: wire.Codec
    raw_nbytes: int
    payload: bytes
    crc32c: int
    leaf_hash: bytes
    params_version: int = 0

    @classmethod
    def from_pb(cls, m: pb.KVBlockDown) -> KVBlockDown:
        """Raises InvalidRequest for an unknown wire dtype or codec."""
        if m.wire_dtype not in wire.WireDtype._value2member_map_ or m.codec not in wire.Codec._value2member_map_:
            raise InvalidRequest(f"KV block {m.block_index}: unknown wire dtype {m.wire_dtype} or codec {m.codec}")
        return from_pb(cls, m, wire_dtype=wire.WireDtype(m.wire_dtype), codec=wire.Codec(m.codec))

    def to_pb(self) -> pb.KVBlockDown:
        return to_pb(pb.KVBlockDown, self)


@dataclass(frozen=True)
class KVCommitDown:
    """The turn's blocks ``[first_block, first_block + leaf_count)`` have Merkle root ``merkle_root``."""

    first_block: int
    leaf_count: int
    merkle_root: bytes

    @classmethod
    def from_pb(cls, m: pb.KVCommitDown) -> KVCommitDown:
        return from_pb(cls, m)

    def to_pb(self) -> pb.KVCommitDown:
        return to_pb(pb.KVCommitDown, self)


@dataclass(frozen=True)
class KVDownAck:
    """The edge received ``received_bytes`` of block payload (each block once), verified blocks
    ``[first_block, first_block + verified_blocks)``, and asks for ``resend_blocks`` again."""

    received_bytes: int
    verified_blocks: int = 0
    resend_blocks: tuple[int, ...] = ()

    @classmethod
    def from_pb(cls, m: pb.KVDownAck) -> KVDownAck:
        return from_pb(cls, m)

    def to_pb(self) -> pb.KVDownAck:
        return to_pb(pb.KVDownAck, self)


@dataclass(frozen=True)
class Takeover:
    """The edge decodes on from output token ``output_tokens`` (the tokens it has received)."""

    output_tokens: int

    @classmethod
    def from_pb(cls, m: pb.Takeover) -> Takeover:
        return cls(m.output_tokens)

    def to_pb(self) -> pb.Takeover:
        return pb.Takeover(output_tokens=self.output_tokens)


# ------------------------------------------------------------------ the cloud frames


def frame_block(
    block: np.ndarray, index: int, block_hash: bytes, p: LinkParams, params_version: int
) -> tuple[KVBlockDown, bytes]:
    """Block ``index`` of the prompt (canonical float32 ``[L, 2, Hkv, B, D]``) in ``p``'s KV wire
    dtype and codec, with its CRC32C and leaf; also returns the leaf (the commit's input).

    Raises:
        InvalidRequest: ``block`` is not a 5-D float32 array with 2 on axis 1.
    """
    raw = encode_kv(block, p.kv_wire_dtype)
    layers = LayerRange(0, block.shape[0])
    leaf = merkle.leaf_hash(merkle.leaf_data(block_hash, layers.lo, layers.hi, p.kv_wire_dtype, raw))
    payload = wire.encode_payload(raw, p.codec, p.codec_level)
    down = KVBlockDown(
        index, block_hash, layers.lo, layers.hi, p.kv_wire_dtype, p.codec, len(raw), payload, wire.crc32c(payload),
        leaf, params_version,
    )  # fmt: skip
    return down, leaf


# ------------------------------------------------------------------ the edge checks


@dataclass(frozen=True)
class Expected:
    """What the edge expects of one turn's blocks: their ids (``ids[j]`` for block ``j``), the first
    block it asked for, the link's params and version, and the model's shape."""

    ids: tuple[bytes, ...]
    first_block: int
    params: LinkParams
    params_version: int
    shape: ModelShape

    @property
    def num_blocks(self) -> int:
        """The prompt's full blocks (the last one the turn brings down is ``num_blocks - 1``)."""
        return len(self.ids)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return block_shape(self.shape, self.params.kv_block_size_tokens)

    @property
    def raw_nbytes(self) -> int:
        return kv_raw_nbytes(self.block_shape, self.params.kv_wire_dtype)


def check_block(b: KVBlockDown, want: Expected) -> None:
    """Check a block's index, identity, layers, format, version and sizes against ``want`` before
    its payload is touched.

    Raises:
        InvalidRequest: any of them outside what the turn asked for under the link's params.
    """
    p = want.params
    if not want.first_block <= b.block_index < want.num_blocks:
        raise InvalidRequest(f"KV block {b.block_index} outside [{want.first_block}, {want.num_blocks})")
    if b.params_version != want.params_version:
        raise InvalidRequest(f"KV block {b.block_index} uses params v{b.params_version}, not v{want.params_version}")
    if b.wire_dtype != p.kv_wire_dtype or b.codec != p.codec:
        raise InvalidRequest(
            f"KV block {b.block_index} in {b.wire_dtype.name}/{b.codec.name}; the link negotiated "
            f"{p.kv_wire_dtype.name}/{p.codec.name}"
        )
    if (b.layer_lo, b.layer_hi) != (0, want.shape.num_layers):
        raise InvalidRequest(f"KV block {b.block_index} holds layers [{b.layer_lo}, {b.layer_hi}), not [0, L)")
    if b.raw_nbytes != want.raw_nbytes or len(b.payload) > wire.max_payload_bytes(want.raw_nbytes, p.codec):
        raise InvalidRequest(
            f"KV block {b.block_index}: {len(b.payload)} payload bytes announcing {b.raw_nbytes} raw; a block "
            f"{want.block_shape} in {p.kv_wire_dtype.name} is {want.raw_nbytes} raw bytes"
        )
    if b.block_hash != want.ids[b.block_index]:
        raise InvalidRequest(f"KV block {b.block_index}: its id is not the prompt's (other tokens or another model)")


def open_block(b: KVBlockDown, want: Expected) -> np.ndarray:
    """The canonical float32 ``[L, 2, Hkv, B, D]`` of a block ``check_block`` accepted: its CRC32C,
    then its payload (one zstd frame of exactly ``raw_nbytes`` under zstd), its leaf over the bytes
    in the wire dtype, and its values. CPU-bound: run it off the event loop.

    Raises:
        ChecksumMismatch: the CRC32C or the leaf does not match (corrupt in transit: ask again).
        CorruptPayload: the payload does not decode to ``raw_nbytes`` bytes (ask again).
        InvalidRequest: NaN, inf or values beyond ``MAX_ABS_KV``.
    """
    if wire.crc32c(b.payload) != b.crc32c:
        raise ChecksumMismatch(f"KV block {b.block_index}: CRC32C mismatch")
    raw = wire.decode_payload(b.payload, b.codec, b.raw_nbytes)
    leaf = merkle.leaf_hash(merkle.leaf_data(b.block_hash, b.layer_lo, b.layer_hi, b.wire_dtype, raw))
    if leaf != b.leaf_hash:
        raise ChecksumMismatch(f"KV block {b.block_index}: its bytes do not hash to its leaf")
    kv = decode_kv(raw, b.wire_dtype, want.block_shape)
    if not np.isfinite(kv).all() or float(np.abs(kv).max(initial=0.0)) > MAX_ABS_KV:
        raise InvalidRequest(f"KV block {b.block_index}: NaN, inf or values beyond {MAX_ABS_KV:g}")
    return kv


def check_commit(c: KVCommitDown, want: Expected, leaves: Sequence[bytes]) -> None:
    """Check the turn's commit against the leaves of the verified blocks ``[first_block, n)`` in order.

    Raises:
        MerkleMismatch: other first block or leaf count than the turn asked for, or another root.
    """
    n = want.num_blocks - want.first_block
    if (c.first_block, c.leaf_count) != (want.first_block, n):
        raise MerkleMismatch(
            f"KV commit names blocks [{c.first_block}, +{c.leaf_count}); the turn asked for [{want.first_block}, +{n})"
        )
    if merkle.root(list(leaves)) != c.merkle_root:
        raise MerkleMismatch(f"the Merkle root over {n} KV blocks does not match the commit")
