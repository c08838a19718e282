"""Remote prefill's KV on the downlink, without a network: a block framed by the cloud
(``common.wire.kvcodec.encode_block``) opens on the edge to the same float32 in every lossless format;
every size, index, id, layer range, format and version is checked before the payload is touched;
a flipped bit fails the CRC32C or the leaf, and the edge asks for exactly that block again
(``edge.link.downlink.KVDownload``); the commit's root covers the blocks in order."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tandem.common.protocol.errors import ChecksumMismatch, InvalidRequest, MerkleMismatch, ParamsVersionMismatch
from tandem.common.protocol.params import LinkParams
from tandem.common.wire import chunks as wire
from tandem.common.wire import merkle
from tandem.common.wire.kvblocks import LayerRange
from tandem.common.wire.kvcodec import BlockSpec, Commit, KVBlock, check_block, check_commit, encode_block, open_block
from tandem.common.wire.kvdown import RemotePrefill, down_spec, full_model_key
from tandem.edge.link.downlink import KVDownload
from tests.doubles import MANIFEST, B

SHAPE = MANIFEST.shape
L, HKV, D = SHAPE.num_layers, SHAPE.num_kv_heads, SHAPE.head_dim
IDS = list(range(7, 7 + 3 * B + 5))  # 3 full blocks and a partial one


def params(kv: wire.WireDtype = wire.WireDtype.FP32, codec: wire.Codec = wire.Codec.NONE) -> LinkParams:
    return LinkParams(
        params_version=3,
        split_layer=0,
        chunk_tokens=16,
        wire_dtype=wire.WireDtype.FP32,
        codec=codec,
        codec_level=3,
        kv_block_size_tokens=B,
        inflight_window_bytes=1 << 20,
        max_concurrent_requests=4,
        max_batched_tokens=4096,
        max_prompt_tokens=4096,
        max_new_tokens=256,
        hidden_size=SHAPE.hidden_size,
        max_chunk_resends=3,
        kv_wire_dtype=kv,
    )


def blocks(n: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    # multiples of 1/1024 in [-1, 1): exact in fp16, so every lossless format gives the same float32
    return [(rng.integers(-1024, 1024, (L, 2, HKV, B, D)) / 1024).astype(np.float32) for _ in range(n)]


def expected(p: LinkParams, first: int = 0) -> BlockSpec:
    return down_spec(IDS, first, full_model_key(MANIFEST), "s", "r", SHAPE, p, p.params_version)


def frame_block(block: np.ndarray, j: int, block_hash: bytes, p: LinkParams, version: int) -> tuple[KVBlock, bytes]:
    """Block ``j`` as the cloud sends it, and its leaf (the commit's input)."""
    down = encode_block(block, j, block_hash, LayerRange(lo=0, hi=L), p, version)
    return down, down.leaf_hash


@pytest.mark.parametrize(
    ("kv", "codec"),
    [
        (wire.WireDtype.FP32, wire.Codec.NONE),
        (wire.WireDtype.FP16, wire.Codec.NONE),
        (wire.WireDtype.FP32, wire.Codec.ZSTD),
    ],
)
def test_a_framed_block_opens_to_its_float32(kv, codec):
    p, blk = params(kv, codec), blocks(1)[0]
    want = expected(p)
    down, leaf = frame_block(blk, 0, want.ids[0], p, p.params_version)
    assert down.leaf_hash == leaf and down.crc32c == wire.crc32c(down.payload)
    check_block(down, want)
    np.testing.assert_array_equal(open_block(down, want), blk)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"leaf_index": 3}, "outside"),
        ({"params_version": 2}, "params v2"),
        ({"wire_dtype": wire.WireDtype.FP16}, "negotiated"),
        ({"codec": wire.Codec.ZSTD}, "negotiated"),
        ({"layer_hi": 5}, "layers"),
        ({"raw_nbytes": 12}, "raw"),
        ({"payload": b"x" * (L * 2 * HKV * B * D * 4 + 1)}, "payload bytes"),
        ({"block_hash": b"\0" * 32}, "not the prompt's"),
    ],
)
def test_a_block_outside_the_turn_or_the_link_is_refused_before_its_payload(change, match):
    p = params()
    want = expected(p)
    down, _ = frame_block(blocks(1)[0], 0, want.ids[0], p, p.params_version)
    with pytest.raises(ParamsVersionMismatch if "params_version" in change else InvalidRequest, match=match):
        check_block(replace(down, **change), want)
    with pytest.raises(InvalidRequest, match="outside"):
        check_block(down, expected(p, first=1))  # the edge holds block 0 already


def test_a_flipped_bit_fails_the_crc_or_the_leaf():
    p = params()
    want = expected(p)
    down, _ = frame_block(blocks(1)[0], 0, want.ids[0], p, p.params_version)
    flipped = bytearray(down.payload)
    flipped[100] ^= 1
    with pytest.raises(ChecksumMismatch, match="CRC32C"):
        open_block(replace(down, payload=bytes(flipped)), want)
    resealed = replace(down, payload=bytes(flipped), crc32c=wire.crc32c(bytes(flipped)))  # a CRC made after the flip
    with pytest.raises(ChecksumMismatch, match="leaf"):
        open_block(resealed, want)
    nan = blocks(1)[0]
    nan[0, 0, 0, 0, 0] = np.nan
    bad, _ = frame_block(nan, 0, want.ids[0], p, p.params_version)
    with pytest.raises(InvalidRequest, match="NaN"):
        open_block(bad, want)


def test_the_commit_covers_the_blocks_in_order():
    p = params()
    want = expected(p, first=1)
    leaves = [frame_block(b, j, want.ids[j], p, 3)[1] for j, b in zip((1, 2), blocks(2), strict=True)]
    check_commit(Commit(leaf_count=2, merkle_root=merkle.root(leaves), first_leaf=1), want.first, leaves)
    for bad in (
        Commit(leaf_count=3, merkle_root=merkle.root(leaves), first_leaf=0),
        Commit(leaf_count=2, merkle_root=merkle.root(leaves[::-1]), first_leaf=1),
    ):
        with pytest.raises(MerkleMismatch):
            check_commit(bad, want.first, leaves)


def _corrupt(b: KVBlock) -> KVBlock:
    payload = bytearray(b.payload)
    payload[7] ^= 0x40
    return replace(b, payload=bytes(payload))


async def test_the_edge_asks_for_a_corrupt_block_again_and_never_uses_it():
    p = params()
    down = KVDownload(expected(p))
    framed = [frame_block(b, j, down.want.ids[j], p, 3) for j, b in enumerate(blocks())]
    a0 = await down.add(framed[0][0])
    bad = await down.add(_corrupt(framed[1][0]))
    assert a0 is not None and a0.verified_blocks == 1 and not a0.resend_blocks
    assert bad is not None and bad.resend_blocks == (1,) and 1 not in down.blocks
    down.add_commit(Commit(leaf_count=3, merkle_root=merkle.root([leaf for _, leaf in framed]), first_leaf=0))
    assert not down.ready  # the commit waits for the resent block
    await down.add(framed[2][0])
    again = await down.add(framed[1][0])
    assert again is not None and again.verified_blocks == 3 and down.ready
    assert down.received_bytes == sum(len(d.payload) for d, _ in framed)  # the resend counted once
    np.testing.assert_array_equal(down.kv(), np.concatenate(blocks(), axis=3))


async def test_a_block_failing_three_times_ends_the_download():
    p = params()
    down = KVDownload(expected(p))
    block, _ = frame_block(blocks(1)[0], 0, down.want.ids[0], p, 3)
    for _ in range(2):
        ack = await down.add(_corrupt(block))
        assert ack is not None and ack.resend_blocks == (0,)
    assert await down.add(_corrupt(block)) is None and "failed 3 times" in down.failed
    assert await down.add(block) is None and not down.ready  # never used once it failed


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"split_layer": 4}, "token ids only"),  # remote prefill from a split's activations
        ({"num_chunks": 1}, "token ids only"),
        ({"num_kv_blocks": 1}, "token ids only"),
        ({"cached_tokens": B}, "token ids only"),
        ({"remote_prefill": RemotePrefill(held_tokens=len(IDS) + 1)}, "held_tokens"),
        ({"remote_prefill": None}, "not a remote-prefill turn"),
    ],
)
def test_a_remote_prefill_header_that_is_not_direct_shaped_is_refused(change, says):
    """The cloud prefills from token ids: a header that also names a split layer, chunks, blocks or
    cached tokens, or holds more than its prompt, is an ``InvalidRequest`` (gRPC INVALID_ARGUMENT)."""
    from types import SimpleNamespace

    from tandem.cloud.remote_prefill import check_remote_prefill
    from tandem.common.protocol.params import Sampling
    from tandem.common.wire.messages import TurnHeader

    ok = TurnHeader(
        request_id="r",
        session_id="s",
        params_version=3,
        split_layer=0,
        prompt_token_ids=tuple(IDS),
        cached_tokens=0,
        num_chunks=0,
        num_kv_blocks=0,
        sampling=Sampling(max_new_tokens=4),
        remote_prefill=RemotePrefill(held_tokens=0),
    )
    check_remote_prefill(SimpleNamespace(header=ok, link_params=params()), (wire.WireDtype.FP32,))
    with pytest.raises(InvalidRequest, match=says):
        check_remote_prefill(
            SimpleNamespace(header=replace(ok, **change), link_params=params()), (wire.WireDtype.FP32,)
        )
    with pytest.raises(InvalidRequest, match="sends KV blocks in"):  # a KV format this cloud does not send
        check_remote_prefill(
            SimpleNamespace(header=ok, link_params=params(wire.WireDtype.FP16)), (wire.WireDtype.FP32,)
        )
