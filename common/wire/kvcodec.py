"""The one codec of a KV block on the wire, whichever way it travels: the edge's head-KV blocks going
up (``KVBlockDelta``) and remote prefill's whole-model blocks coming down (``KVBlockDown``) are the
same block format, framed by ``encode_block`` and checked by ``check_block`` / ``open_block``, and
their commits by ``check_commit``. Pure functions and frozen dataclasses: no network, no session,
no store; what a receiver does with a verdict (ask again, repair at the commit, drop the download)
is its own.

A block is canonical float32 ``[Lp, 2, Hkv, B, D]`` (``common.wire.kvblocks``: K before V, keys after
RoPE) of the layers ``[layer_lo, layer_hi)`` in the link's KV wire dtype (``common.wire.kvwire``),
then the link's codec. Its id is the chained BLAKE3 of the prompt's token ids, which the receiver
computes itself; its leaf (``common.wire.merkle.leaf_data``) commits to that id, the layers, the
wire dtype and the bytes in it; a turn's blocks ``[first, n)`` with the leaves before them form an
RFC 6962 tree whose root the commit carries. The receiver's ``BlockSpec`` says what it expects;
nothing from the wire is used before its index, id, layers, format, version and sizes are checked
against it, so no allocation is sized by the sender.

``KVBlock`` and ``Commit`` are the domain forms of both directions' messages; the protobuf
conversion per direction is here too (``common.wire.messages`` dispatches on the direction). The
two directions' messages differ only in field numbers and names (``leaf_index`` / ``block_index``,
``Commit`` / ``KVCommitDown``), kept for wire compatibility with ``tandem.v1`` peers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tandem.common.protocol.errors import ChecksumMismatch, InvalidRequest, MerkleMismatch, ParamsVersionMismatch
from tandem.common.protocol.manifest import ModelShape
from tandem.common.protocol.params import Codec, LinkParams, WireDtype
from tandem.common.wire import chunks as wire
from tandem.common.wire import merkle
from tandem.common.wire.formats import BlockShape
from tandem.common.wire.kvblocks import LayerRange
from tandem.common.wire.kvwire import decode_kv, encode_kv, kv_raw_nbytes
from tandem.pbconv import from_pb, to_pb
from tandem.v1 import tandem_pb2 as pb

MAX_ABS_KV = 1e5  # default bound on |K|, |V| accepted from the wire (the cloud's is its max_abs_activation)


# ------------------------------------------------------------------ messages


def _formats(index: int, m: pb.KVBlockDelta | pb.KVBlockDown) -> tuple[WireDtype, Codec]:
    """The block's wire dtype (unset = fp32, an older peer) and codec.

    Raises:
        InvalidRequest: a value neither names.
    """
    dtype = m.wire_dtype or WireDtype.FP32
    if dtype not in WireDtype._value2member_map_ or m.codec not in Codec._value2member_map_:
        raise InvalidRequest(f"KV block {index}: unknown wire dtype {m.wire_dtype} or codec {m.codec}")
    return WireDtype(dtype), Codec(m.codec)


@dataclass(frozen=True, kw_only=True)
class KVBlock:
    """One full KV block of layers ``[layer_lo, layer_hi)``, either direction: canonical float32
    ``[Lp, 2, Hkv, B, D]`` in ``wire_dtype`` (``raw_nbytes`` of those bytes), then ``codec``
    (``payload``). ``leaf_index`` is the block's index in the prompt (tokens ``[j*B, (j+1)*B)``),
    which is its leaf's index in the session's tree; ``crc32c`` is of the payload as sent (None: the
    message carried none, an older edge's upload)."""

    leaf_index: int
    block_hash: bytes
    layer_lo: int
    layer_hi: int
    codec: Codec
    raw_nbytes: int
    payload: bytes
    leaf_hash: bytes
    params_version: int = 0
    wire_dtype: WireDtype = WireDtype.FP32
    crc32c: int | None = None

    @classmethod
    def from_up_pb(cls, m: pb.KVBlockDelta) -> KVBlock:
        """Raises InvalidRequest for an unknown codec or wire dtype."""
        dtype, codec = _formats(m.leaf_index, m)
        crc = m.crc32c if m.HasField("crc32c") else None
        return from_pb(cls, m, codec=codec, wire_dtype=dtype, crc32c=crc)

    def to_up_pb(self) -> pb.KVBlockDelta:
        return to_pb(pb.KVBlockDelta, self, exclude=("crc32c",) if self.crc32c is None else ())

    @classmethod
    def from_down_pb(cls, m: pb.KVBlockDown) -> KVBlock:
        """Raises InvalidRequest for an unknown codec or wire dtype."""
        dtype, codec = _formats(m.block_index, m)
        return from_pb(cls, m, leaf_index=m.block_index, codec=codec, wire_dtype=dtype, crc32c=m.crc32c)

    def to_down_pb(self) -> pb.KVBlockDown:
        """The block as remote prefill sends it (a block without a CRC goes with 0, which the edge's
        check refuses unless the payload's CRC32C is 0)."""
        crc = self.crc32c or 0
        return to_pb(pb.KVBlockDown, self, exclude=("leaf_index",), block_index=self.leaf_index, crc32c=crc)


@dataclass(frozen=True, kw_only=True)
class Commit:
    """The leaves ``[first_leaf, first_leaf + leaf_count)`` of a turn's tree have root ``merkle_root``.
    Going up, the tree is the session's from leaf 0 (``Commit``); coming down, remote prefill's
    blocks past the ones the edge holds (``KVCommitDown``)."""

    leaf_count: int
    merkle_root: bytes
    first_leaf: int = 0

    @classmethod
    def from_up_pb(cls, m: pb.Commit) -> Commit:
        return cls(leaf_count=m.leaf_count, merkle_root=m.merkle_root)

    def to_up_pb(self) -> pb.Commit:
        """Raises InvalidRequest for a commit not from leaf 0 (the uplink's carries the whole tree)."""
        if self.first_leaf:
            raise InvalidRequest(f"an uplink commit covers the session's tree from leaf 0, not {self.first_leaf}")
        return pb.Commit(leaf_count=self.leaf_count, merkle_root=self.merkle_root)

    @classmethod
    def from_down_pb(cls, m: pb.KVCommitDown) -> Commit:
        return cls(leaf_count=m.leaf_count, merkle_root=m.merkle_root, first_leaf=m.first_block)

    def to_down_pb(self) -> pb.KVCommitDown:
        return pb.KVCommitDown(first_block=self.first_leaf, leaf_count=self.leaf_count, merkle_root=self.merkle_root)


# ------------------------------------------------------------------ what a receiver expects


@dataclass(frozen=True, kw_only=True)
class BlockSpec:
    """What a receiver expects of one turn's blocks: their ids (``ids[j]`` for block ``j``, computed
    by the receiver from the prompt), the first block the turn carries (blocks ``[first, len(ids))``),
    their layers, shape, format and params version, and the bound on their values."""

    ids: tuple[bytes, ...]
    first: int
    layers: LayerRange
    num_kv_heads: int
    block_tokens: int
    head_dim: int
    wire_dtype: WireDtype
    codec: Codec
    params_version: int
    max_abs: float = MAX_ABS_KV

    @classmethod
    def of(
        cls,
        ids: Sequence[bytes],
        first: int,
        layers: LayerRange,
        shape: ModelShape,
        p: LinkParams,
        params_version: int,
        max_abs: float = MAX_ABS_KV,
    ) -> BlockSpec:
        """The spec of blocks ``[first, len(ids))`` of ``layers`` of a model of ``shape`` under ``p``."""
        return cls(
            ids=tuple(ids),
            first=first,
            layers=layers,
            num_kv_heads=shape.num_kv_heads,
            block_tokens=p.kv_block_size_tokens,
            head_dim=shape.head_dim,
            wire_dtype=p.kv_wire_dtype,
            codec=p.codec,
            params_version=params_version,
            max_abs=max_abs,
        )

    @property
    def indices(self) -> range:
        """The blocks the turn carries."""
        return range(self.first, len(self.ids))

    @property
    def block_shape(self) -> BlockShape:
        """``(Lp, 2, Hkv, B, D)`` of one block."""
        return (self.layers.num_layers, 2, self.num_kv_heads, self.block_tokens, self.head_dim)

    @property
    def raw_nbytes(self) -> int:
        """Bytes of one block in the wire dtype (before the codec)."""
        return kv_raw_nbytes(self.block_shape, self.wire_dtype)

    @property
    def max_payload_bytes(self) -> int:
        """The largest legal payload of one block under the codec."""
        return wire.max_payload_bytes(self.raw_nbytes, self.codec)


# ------------------------------------------------------------------ the sender frames


def encode_block(
    block: np.ndarray, leaf_index: int, block_hash: bytes, layers: LayerRange, p: LinkParams, params_version: int
) -> KVBlock:
    """Block ``leaf_index`` (canonical float32 ``[Lp, 2, Hkv, B, D]`` of ``layers``) in ``p``'s KV
    wire dtype and codec, with its leaf and the CRC32C of its payload.

    Raises:
        InvalidRequest: ``block`` is not a 5-D float32 array with 2 on axis 1 and ``Lp`` layers.
    """
    if block.ndim != 5 or block.shape[0] != layers.num_layers:
        want = f"[Lp={layers.num_layers}, 2, Hkv, B, D]"
        raise InvalidRequest(f"KV block of layers {layers.tag()} must be {want}, got {block.shape}")
    raw = encode_kv(block, p.kv_wire_dtype)
    leaf = merkle.leaf_hash(merkle.leaf_data(block_hash, layers.lo, layers.hi, p.kv_wire_dtype, raw))
    payload = wire.encode_payload(raw, p.codec, p.codec_level)
    return KVBlock(
        leaf_index=leaf_index,
        block_hash=block_hash,
        layer_lo=layers.lo,
        layer_hi=layers.hi,
        codec=p.codec,
        raw_nbytes=len(raw),
        payload=payload,
        leaf_hash=leaf,
        params_version=params_version,
        wire_dtype=p.kv_wire_dtype,
        crc32c=wire.crc32c(payload),
    )


# ------------------------------------------------------------------ the receiver checks


def check_block(b: KVBlock, want: BlockSpec) -> None:
    """Check a block's index, version, format, layers, sizes and id against ``want`` before its
    payload is touched (the order of the checks is the order of the messages' doubt: where it is,
    what it was made with, what it claims, who it is).

    Raises:
        InvalidRequest: an index outside ``want.indices``; another wire dtype or codec, other
            layers, another raw size or a payload larger than the codec allows; another id than
            the prompt's block.
        ParamsVersionMismatch: made with other link params than the turn's.
    """
    j = b.leaf_index
    if j not in want.indices:
        raise InvalidRequest(f"KV block {j} outside [{want.first}, {len(want.ids)})")
    if b.params_version != want.params_version:
        raise ParamsVersionMismatch(f"KV block {j} made with params v{b.params_version}, not v{want.params_version}")
    if b.wire_dtype != want.wire_dtype or b.codec != want.codec:
        raise InvalidRequest(
            f"KV block {j} in {b.wire_dtype.name}/{b.codec.name}; the link negotiated "
            f"{want.wire_dtype.name}/{want.codec.name}"
        )
    if (b.layer_lo, b.layer_hi) != (want.layers.lo, want.layers.hi):
        raise InvalidRequest(f"KV block {j} holds layers [{b.layer_lo}, {b.layer_hi}), not {want.layers.tag()}")
    if b.raw_nbytes != want.raw_nbytes or len(b.payload) > want.max_payload_bytes:
        raise InvalidRequest(
            f"KV block {j}: {len(b.payload)} payload bytes announcing {b.raw_nbytes} raw; a block "
            f"{want.block_shape} in {want.wire_dtype.name} is {want.raw_nbytes} raw bytes, at most "
            f"{want.max_payload_bytes} payload bytes"
        )
    if b.block_hash != want.ids[j]:
        raise InvalidRequest(f"KV block {j}: its block hash is not the prompt's (other tokens or another model)")


def open_block(b: KVBlock, want: BlockSpec) -> np.ndarray:
    """The canonical float32 ``[Lp, 2, Hkv, B, D]`` of a block ``check_block`` accepted: its CRC32C
    (when it carries one), its payload (exactly ``raw_nbytes`` under ``NONE``, one zstd frame of
    exactly that under ``ZSTD``), its leaf over the bytes in the wire dtype, then its values.
    CPU-bound: run it off the event loop.

    Raises:
        ChecksumMismatch: the CRC32C or the leaf does not match (corrupt in transit: ask again).
        CorruptPayload: the payload does not decode to ``raw_nbytes`` bytes (ask again).
        InvalidRequest: NaN, inf or values beyond ``want.max_abs``.
    """
    if b.crc32c is not None and wire.crc32c(b.payload) != b.crc32c:
        raise ChecksumMismatch(f"KV block {b.leaf_index}: CRC32C mismatch")
    raw = wire.decode_payload(b.payload, b.codec, b.raw_nbytes)
    leaf = merkle.leaf_hash(merkle.leaf_data(b.block_hash, b.layer_lo, b.layer_hi, b.wire_dtype, raw))
    if leaf != b.leaf_hash:
        raise ChecksumMismatch(f"KV block {b.leaf_index}: its bytes do not hash to its leaf")
    kv = decode_kv(raw, b.wire_dtype, want.block_shape)
    if not np.isfinite(kv).all() or float(np.abs(kv).max(initial=0.0)) > want.max_abs:
        raise InvalidRequest(f"KV block {b.leaf_index}: NaN, inf or values beyond {want.max_abs:g}")
    return kv


def check_commit_span(c: Commit, first_leaf: int, leaf_count: int) -> None:
    """Check that a commit names the tree the turn makes: leaves ``[first_leaf, first_leaf + leaf_count)``.

    Raises:
        MerkleMismatch: another first leaf or leaf count.
    """
    if (c.first_leaf, c.leaf_count) != (first_leaf, leaf_count):
        raise MerkleMismatch(
            f"the commit names leaves [{c.first_leaf}, +{c.leaf_count}); the turn makes [{first_leaf}, +{leaf_count})"
        )


def check_commit(c: Commit, first_leaf: int, leaves: Sequence[bytes]) -> None:
    """Check a commit against the verified ``leaves`` of ``[first_leaf, first_leaf + len(leaves))``
    in order: their span, then the RFC 6962 root over them.

    Raises:
        MerkleMismatch: another span, or another root.
    """
    check_commit_span(c, first_leaf, len(leaves))
    if merkle.root(list(leaves)) != c.merkle_root:
        raise MerkleMismatch(f"the Merkle root over {len(leaves)} KV blocks does not match the commit")
