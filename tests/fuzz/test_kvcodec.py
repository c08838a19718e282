"""Property-based fuzzing of the one KV-block codec (``common.wire.kvcodec``) from both sides: a block the edge's
uplink frames (``edge.link.framing.kv_blocks``) received by the cloud (``cloud.uploads.upload.TurnUpload``) and a
block remote prefill frames (``encode_block``, as ``cloud.remote_prefill`` does) received by the edge
(``edge.link.downlink.KVDownload``), each through its own protobuf message and the wire bytes, with the same
mutation: truncated, extended or flipped payloads (with and without a CRC32C over the new bytes), a wrong raw
size, leaf, CRC, block id, layer range, params version, wire dtype or codec (known or unknown values), an index
outside the turn, NaN, inf or huge values behind a correct leaf. Both receivers must reach the same verdict, the
one the mutation calls for: refuse the block (the turn's error), ask for it again (a repair on the uplink, a resend
on the downlink), or take it, decoded to the float32 the sender framed. And a commit naming another span or root
than the verified leaves is a ``MerkleMismatch`` on both sides.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.cloud.sessions.table import CloudSession
from tandem.cloud.uploads.upload import TurnUpload
from tandem.common.protocol.errors import InvalidRequest, MerkleMismatch, ParamsVersionMismatch, TandemError
from tandem.common.protocol.params import Codec, LinkParams, Sampling, WireDtype
from tandem.common.wire import chunks as wire
from tandem.common.wire import merkle
from tandem.common.wire.kvblocks import request_seed
from tandem.common.wire.kvcodec import Commit, KVBlock, encode_block
from tandem.common.wire.kvdown import down_spec, full_model_key
from tandem.common.wire.messages import TurnHeader, downlink_from_pb, downlink_to_pb, uplink_from_pb, uplink_to_pb
from tandem.edge.link import framing
from tandem.edge.link.downlink import KVDownload
from tandem.v1 import tandem_pb2 as pb
from tests.toy import HKV, MANIFEST, VOCAB, B, D, H, K

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

L = MANIFEST.shape.num_layers
VERSION = 5
REFUSE, AGAIN, TAKE = "refuse", "ask again", "take"
FORMATS = [  # (KV wire dtype, codec) of the link
    (WireDtype.FP32, Codec.NONE),
    (WireDtype.FP16, Codec.ZSTD),
    (WireDtype.INT8, Codec.NONE),
    (WireDtype.INT4_HADAMARD, Codec.ZSTD),
]


def params(kv: WireDtype, codec: Codec, split_layer: int) -> LinkParams:
    return LinkParams(
        params_version=VERSION,
        split_layer=split_layer,
        chunk_tokens=16,
        wire_dtype=WireDtype.FP32,
        codec=codec,
        codec_level=3,
        kv_block_size_tokens=B,
        inflight_window_bytes=1 << 20,
        max_concurrent_requests=4,
        max_batched_tokens=4096,
        max_prompt_tokens=4096,
        max_new_tokens=64,
        hidden_size=H,
        max_chunk_resends=3,
        kv_wire_dtype=kv,
    )


# ------------------------------------------------------------------ mutations of one block's message


@dataclass(frozen=True)
class Mutation:
    """One change of a block's protobuf message (any value the wire can carry) and the verdict it calls for."""

    kind: str
    value: Any = None

    def apply(self, m: pb.KVBlockDelta | pb.KVBlockDown, index_field: str, max_payload: int) -> str:
        """Change ``m`` in place; returns the verdict every receiver must reach."""
        k, v = self.kind, self.value
        if k == "none":
            return TAKE
        if k == "index":  # past the prompt's blocks (the turn's blocks start at 0)
            setattr(m, index_field, getattr(m, index_field) + v)
            return REFUSE
        if k in ("params_version", "raw_nbytes", "layer_lo", "layer_hi"):
            setattr(m, k, getattr(m, k) + v)
            return REFUSE
        if k in ("wire_dtype", "codec"):  # another value, known or not (0 is fp32's unset wire dtype: skipped)
            if getattr(m, k) == v or (k == "wire_dtype" and v == 0 and m.wire_dtype == WireDtype.FP32):
                return TAKE
            setattr(m, k, v)
            return REFUSE
        if k == "block_hash":
            m.block_hash = bytes(b ^ 0xFF for b in m.block_hash[:1]) + m.block_hash[1:]
            return REFUSE
        if k == "leaf_hash":
            m.leaf_hash = bytes([m.leaf_hash[0] ^ 1]) + m.leaf_hash[1:]
            return AGAIN
        if k == "crc32c":
            m.crc32c = (m.crc32c + v) % (1 << 32) or 1
            return AGAIN
        if k == "extend":  # past the largest payload the codec allows for the block
            m.payload = m.payload + bytes(max_payload - len(m.payload) + v)
            return REFUSE
        payload, (fix_crc, pos) = bytes(m.payload), v
        checked = index_field == "block_index" or m.HasField("crc32c")  # an older edge's upload carries no CRC32C
        if k == "truncate":
            m.payload = payload[: pos % len(payload)]
        elif k == "flip":
            i = pos % len(payload)
            m.payload = payload[:i] + bytes([payload[i] ^ (1 << (pos % 8))]) + payload[i + 1 :]
        if fix_crc:
            m.crc32c = wire.crc32c(m.payload)
        if (fix_crc or not checked) and _decodes_to(m.payload, payload, m.codec, m.raw_nbytes):
            return TAKE  # e.g. a zstd frame header's unused bit: the same bytes in the wire dtype, as the leaf says
        return AGAIN  # a CRC32C, a payload that does not decode or a leaf that does not match: corrupt in transit


def _decodes_to(payload: bytes, sent: bytes, codec: int, raw_nbytes: int) -> bool:
    """Whether a changed ``payload`` decodes to the same raw bytes as the ``sent`` one."""
    try:
        decode = wire.decode_payload
        return decode(payload, Codec(codec), raw_nbytes) == decode(sent, Codec(codec), raw_nbytes)
    except TandemError:
        return False


_payload_change = st.tuples(st.booleans(), st.integers(0, 1 << 20))  # (with a CRC32C over the new bytes, where)
MUTATIONS: dict[str, st.SearchStrategy[Any]] = {  # every kind, each tested on its own
    "none": st.none(),
    "index": st.integers(3, 1 << 20),
    "params_version": st.integers(1, 1 << 16),
    "raw_nbytes": st.integers(1, 1 << 16),
    "layer_lo": st.integers(1, 8),
    "layer_hi": st.integers(1, 1 << 16),
    "wire_dtype": st.integers(0, 12),
    "codec": st.integers(0, 5),
    "block_hash": st.none(),
    "leaf_hash": st.none(),
    "crc32c": st.integers(1, (1 << 32) - 1),
    "extend": st.integers(1, 64),
    "truncate": _payload_change,
    "flip": _payload_change,
}
bad_values = st.tuples(st.integers(0, 1 << 20), st.sampled_from([np.nan, np.inf, -np.inf, 3e5, -1e9]))


# ------------------------------------------------------------------ the two sides


# per direction: the block's message into the stream's, the stream's message out, its index field's name
UP = (uplink_to_pb, lambda data: uplink_from_pb(pb.Uplink.FromString(data)), "leaf_index")
DOWN = (downlink_to_pb, lambda data: downlink_from_pb(pb.Downlink.FromString(data)), "block_index")


def _roundtrip(b: KVBlock, way: Any, mutation: Mutation, max_payload: int) -> tuple[KVBlock | None, str]:
    """The block as the receiver reads it off the wire after ``mutation`` (None: its message did not convert),
    and the verdict the mutation calls for."""
    to_pb, from_wire, index_field = way
    m = to_pb(b)
    want = mutation.apply(m.kv_block, index_field, max_payload)
    try:
        got = from_wire(m.SerializeToString())
    except InvalidRequest:
        return None, want
    assert isinstance(got, KVBlock)
    return got, want


def cloud_receives(
    ids: list[int], kv: np.ndarray, p: LinkParams, j: int, mutation: Mutation, crc: bool = True
) -> tuple[str, str, np.ndarray | None]:
    """The edge frames head-KV block ``j`` of ``kv`` (float32 ``[K, 2, Hkv, T, D]``) as its uplink does (``crc``
    False: as an older edge, without a CRC32C); the cloud's receive path checks it. Returns (the verdict called
    for, the cloud's verdict, what it kept)."""
    key, sid, rid = MANIFEST.compatibility_key(), "s", "r"
    hashes = framing.block_ids(ids, p, key, sid, rid)
    block = framing.kv_blocks(kv, hashes, p, j, j + 1)[j]
    if not crc:
        block = replace(block, crc32c=None)
    header = TurnHeader(
        request_id=rid,
        session_id=sid,
        params_version=VERSION,
        split_layer=K,
        prompt_token_ids=tuple(ids),
        cached_tokens=0,
        num_chunks=-(-len(ids) // 16),
        num_kv_blocks=len(hashes),
        sampling=Sampling(max_new_tokens=4),
    )
    upload = TurnUpload(header, p, MANIFEST, CloudSession(), request_seed(key, B, sid, rid))
    got, want = _roundtrip(block, UP, mutation, upload.block_spec.max_payload_bytes)
    if got is None:
        return want, REFUSE, None
    try:
        upload.add_block(got)
    except (InvalidRequest, ParamsVersionMismatch):
        return want, REFUSE, None
    if j not in upload.blocks:
        assert upload.missing_leaves() and j in upload.missing_leaves()  # asked for again at the commit
        return want, AGAIN, None
    raw = upload.blocks[j][1]
    return want, TAKE, np.frombuffer(raw, np.float32).reshape(upload.block_spec.block_shape)


def edge_receives(
    ids: list[int], block: np.ndarray, p: LinkParams, j: int, mutation: Mutation
) -> tuple[str, str, np.ndarray | None]:
    """The cloud frames whole-model block ``j`` (float32 ``[L, 2, Hkv, B, D]``) as remote prefill does; the edge's
    download checks it. Returns (the verdict called for, the edge's verdict, what it kept)."""
    want_spec = down_spec(ids, 0, full_model_key(MANIFEST), "s", "r", MANIFEST.shape, p, VERSION)
    framed = encode_block(block, j, want_spec.ids[j], want_spec.layers, p, VERSION)
    got, want = _roundtrip(framed, DOWN, mutation, want_spec.max_payload_bytes)
    if got is None:
        return want, REFUSE, None
    down = KVDownload(want_spec)
    ack = asyncio.run(down.add(got))
    if ack is None:
        assert down.failed
        return want, REFUSE, None
    if j in ack.resend_blocks:
        assert j not in down.blocks
        return want, AGAIN, None
    assert j in down.blocks and not ack.resend_blocks
    return want, TAKE, down.blocks[j]


def _lossy_close(got: np.ndarray, sent: np.ndarray, dtype: WireDtype) -> bool:
    """``got`` is ``sent`` through ``dtype``: exact for fp32, within the format's error otherwise."""
    if dtype == WireDtype.FP32:
        return bool(np.array_equal(got, sent))
    return bool(np.abs(got - sent).max() <= 0.25 * max(1.0, float(np.abs(sent).max())))


# ------------------------------------------------------------------ properties


@pytest.mark.parametrize("kind", sorted(MUTATIONS))
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    fmt=st.sampled_from(FORMATS),
    n_blocks=st.integers(1, 3),
    j_seed=st.integers(0, 2),
    values_seed=st.integers(0, 2**16),
    bad=st.none() | bad_values,
    up_crc=st.booleans(),
    data=st.data(),
)
def test_both_sides_give_a_mutated_block_the_verdict_it_calls_for(
    kind, fmt, n_blocks, j_seed, values_seed, bad, up_crc, data
):
    mutation = Mutation(kind, data.draw(MUTATIONS[kind], label="value"))
    kv_dtype, codec = fmt
    ids = [(values_seed + 7 * i) % VOCAB for i in range(n_blocks * B + 5)]
    j = j_seed % n_blocks
    rng = np.random.default_rng(values_seed)
    head_kv = (rng.standard_normal((K, 2, HKV, len(ids), D)) * 0.5).astype(np.float32)
    whole = (rng.standard_normal((L, 2, HKV, B, D)) * 0.5).astype(np.float32)
    if bad is not None:  # the sender frames a value the receivers refuse, behind a correct leaf and CRC32C
        pos, value = bad
        layer, kv, head, t, d = np.unravel_index(pos % (K * 2 * HKV * B * D), (K, 2, HKV, B, D))
        head_kv[layer, kv, head, j * B + t, d] = value
        whole.reshape(-1)[pos % whole.size] = value
    up_want, up_got, up_kept = cloud_receives(ids, head_kv, params(kv_dtype, codec, K), j, mutation, up_crc)
    down_want, down_got, down_kept = edge_receives(ids, whole, params(kv_dtype, codec, 0), j, mutation)
    assert up_want == down_want or not up_crc  # one verdict for one mutation, whichever way the block went
    # the receivers refuse NaN, inf and values beyond the bound; fp16 saturates finite ones at 65504, within it
    refused = bad is not None and not (np.isfinite(bad[1]) and kv_dtype == WireDtype.FP16)
    up_want, down_want = ((REFUSE if refused and w == TAKE else w) for w in (up_want, down_want))
    assert (up_got, down_got) == (up_want, down_want), f"{mutation}: cloud {up_got}, edge {down_got}"
    if up_want == down_want == TAKE:
        assert up_kept is not None and down_kept is not None
        sent_up = head_kv[:, :, :, j * B : (j + 1) * B]
        assert _lossy_close(up_kept, sent_up, kv_dtype) and _lossy_close(down_kept, whole, kv_dtype)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_blocks=st.integers(1, 3),
    change=st.sampled_from(["none", "count", "first", "root"]),
    by=st.integers(1, 5),
)
def test_both_sides_refuse_a_commit_other_than_the_verified_leaves(n_blocks, change, by):
    ids = list(range(n_blocks * B))
    # the cloud: an upload of every block, then its commit
    p_up = params(WireDtype.FP32, Codec.NONE, K)
    key = MANIFEST.compatibility_key()
    hashes = framing.block_ids(ids, p_up, key, "s", "r")
    head_kv = np.zeros((K, 2, HKV, len(ids), D), np.float32)
    header = TurnHeader(
        request_id="r",
        session_id="s",
        params_version=VERSION,
        split_layer=K,
        prompt_token_ids=tuple(ids),
        cached_tokens=0,
        num_chunks=-(-len(ids) // 16),
        num_kv_blocks=n_blocks,
        sampling=Sampling(max_new_tokens=4),
    )
    upload = TurnUpload(header, p_up, MANIFEST, CloudSession(), request_seed(key, B, "s", "r"))
    for b in framing.kv_blocks(head_kv, hashes, p_up, 0, n_blocks).values():
        upload.add_block(b)
    # the edge: a download of every block, then its commit
    p_down = params(WireDtype.FP32, Codec.NONE, 0)
    spec = down_spec(ids, 0, full_model_key(MANIFEST), "s", "r", MANIFEST.shape, p_down, VERSION)
    down = KVDownload(spec)
    framed = [
        encode_block(np.zeros(spec.block_shape, np.float32), j, spec.ids[j], spec.layers, p_down, VERSION)
        for j in spec.indices
    ]
    for b in framed:
        asyncio.run(down.add(b))

    def commit_of(leaves: list[bytes]) -> Commit:
        c = Commit(leaf_count=len(leaves), merkle_root=merkle.root(leaves))
        if change == "count":
            return replace(c, leaf_count=c.leaf_count + by)
        if change == "root":
            return replace(c, merkle_root=merkle.root(leaves[::-1] + [bytes(32)] * by))
        return replace(c, first_leaf=by) if change == "first" else c

    up_commit = commit_of(upload.leaves())
    down_commit = commit_of([b.leaf_hash for b in framed])
    if change == "none":
        assert upload.commit(up_commit.leaf_count, up_commit.merkle_root) == [] and upload.committed
        down.add_commit(down_commit)
        assert down.ready and not down.failed
        return
    if change == "first":  # the uplink's commit carries the whole tree from leaf 0: no first leaf on its wire
        with pytest.raises(InvalidRequest):
            uplink_to_pb(up_commit)
    else:
        with pytest.raises(MerkleMismatch):
            upload.commit(up_commit.leaf_count, up_commit.merkle_root)
    down.add_commit(Commit.from_down_pb(down_commit.to_down_pb()))
    assert not down.ready and "commit" in down.failed
