"""The edge's framing of a turn's upload (``edge.link.framing``): pure functions, checked without a
network against the decoders the cloud uses (``common.wire.chunks.combine``, ``common.wire.kvwire``,
``common.wire.merkle``), and a pipelined turn's pieces against the turn framed in one run."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.common.protocol.modes import Mode
from tandem.common.protocol.params import LinkParams, Sampling
from tandem.common.wire import chunks as wire
from tandem.common.wire import merkle
from tandem.common.wire.kvwire import decode_kv
from tandem.common.wire.messages import TurnHeader
from tandem.edge.events import SentBytes, TurnDone
from tandem.edge.link import framing
from tandem.edge.session import EdgeSession
from tests.doubles import HKV, MANIFEST, B, D, H, K

T = 150  # prompt tokens: 4 full KV blocks of 32 and a partial one
KEY = MANIFEST.compatibility_key()


def params(**kw) -> LinkParams:
    base = LinkParams(
        params_version=7,
        split_layer=K,
        chunk_tokens=16,
        wire_dtype=wire.WireDtype.FP32,
        codec=wire.Codec.NONE,
        codec_level=3,
        kv_block_size_tokens=B,
        inflight_window_bytes=1 << 20,
        max_concurrent_requests=4,
        max_batched_tokens=64,
        max_prompt_tokens=4096,
        max_new_tokens=16,
        hidden_size=H,
        max_chunk_resends=2,
    )
    return LinkParams(**{**base.__dict__, **kw})


def session(cloud_tokens: int = 0, held_blocks: int = 0) -> EdgeSession:
    """A session whose head ran over ``T`` tokens; the cloud holds ``cloud_tokens`` and ``held_blocks`` leaves."""
    rng = np.random.default_rng(0)
    s = EdgeSession(token_ids=list(range(10, 10 + T)), k=K, block_tokens=B)
    s.hidden = rng.standard_normal((T, H), dtype=np.float32)  # [T, H]
    s.kv = rng.standard_normal((K, 2, HKV, T, D), dtype=np.float32)  # [k, 2, Hkv, T, D]
    s.cloud_tokens = cloud_tokens
    hashes = framing.block_ids(s.token_ids, params(), KEY, "s", "r")
    s.leaves = [b.leaf_hash for b in framing.kv_blocks(s.kv, hashes, params(), 0, held_blocks).values()]
    return s


def base(s: EdgeSession, p: LinkParams) -> TurnHeader:
    return TurnHeader(
        request_id="r",
        session_id="s",
        params_version=p.params_version,
        split_layer=p.split_layer,
        prompt_token_ids=tuple(s.token_ids),
        cached_tokens=0,
        num_chunks=0,
        num_kv_blocks=0,
        sampling=Sampling(),
        link_id="link",
    )


@pytest.mark.parametrize("cloud_tokens,held_blocks", [(0, 0), (70, 2)])
def test_a_split_turn_frames_what_the_cloud_lacks_and_commits_to_all_leaves(cloud_tokens, held_blocks):
    s, p = session(cloud_tokens, held_blocks), params()
    hashes = framing.block_ids(s.token_ids, p, KEY, "s", "r")
    out = framing.split_turn(s, base(s, p), p, hashes)
    h = out.header
    assert (h.cached_tokens, h.num_chunks, h.num_kv_blocks) == (cloud_tokens, len(out.chunks), T // B - held_blocks)
    assert h.num_chunks == -(-(T - cloud_tokens) // p.chunk_tokens)
    # what the cloud decodes is the session's activations past what it holds
    got = wire.combine(out.chunks, cloud_tokens, T - cloud_tokens, H)
    np.testing.assert_array_equal(got, s.hidden[cloud_tokens:])
    assert sorted(out.blocks) == list(range(held_blocks, T // B))
    for j, blk in out.blocks.items():
        raw = wire.decode_payload(blk.payload, blk.codec, blk.raw_nbytes)
        arr = decode_kv(raw, blk.wire_dtype, (K, 2, HKV, B, D))
        np.testing.assert_array_equal(arr, s.kv[:, :, :, j * B : (j + 1) * B])
        assert blk.leaf_hash == merkle.leaf_hash(merkle.leaf_data(hashes[j], 0, K, blk.wire_dtype, raw))
    leaves = s.leaves + [out.blocks[j].leaf_hash for j in sorted(out.blocks)]
    assert (out.leaf_count, out.merkle_root) == (T // B, merkle.root(leaves))


def test_a_direct_turn_is_its_header_alone_and_stateless():
    s, p = session(), params(split_layer=0)
    out = framing.direct_turn(base(s, p))
    assert (out.header.session_id, out.header.split_layer, out.chunks, out.blocks) == ("", 0, [], {})
    assert not out.split


@pytest.mark.parametrize("piece_tokens", [16, 40, 64])
def test_a_pipelined_turn_s_pieces_add_up_to_the_turn_framed_in_one_run(piece_tokens):
    s, p = session(), params()
    hashes = framing.block_ids(s.token_ids, p, KEY, "s", "r")
    whole = framing.split_turn(s, base(s, p), p, hashes)
    piped = framing.pipelined_turn(s, base(s, p), p, hashes)
    assert piped.header == whole.header and not piped.complete
    start, seq, next_block, computed = 0, 0, 0, 0
    while computed < T:
        computed = min(T, computed + piece_tokens)
        end = framing.whole_chunks_end(start, T, p.chunk_tokens, computed)
        last = max(next_block, min(len(hashes), end // B))
        chunks, blocks = framing.piece(s.hidden, s.kv, hashes, p, (start, end), seq, (next_block, last))
        piped.extend(chunks, blocks)
        seq, start, next_block = seq + len(chunks), end, last
    piped.finish(*framing.commit(s.leaves, piped.blocks))
    assert [(c.seq, c.token_offset, c.payload) for c in piped.chunks] == [
        (c.seq, c.token_offset, c.payload) for c in whole.chunks
    ]
    assert piped.blocks == whole.blocks
    assert (piped.leaf_count, piped.merkle_root) == (whole.leaf_count, whole.merkle_root)


def test_whole_chunks_end_cuts_where_one_run_cuts():
    assert framing.whole_chunks_end(0, 150, 16, 40) == 32  # the chunk [32, 48) is not whole yet
    assert framing.whole_chunks_end(32, 150, 16, 40) == 32
    assert framing.whole_chunks_end(144, 150, 16, 150) == 150  # the last, partial chunk
    assert framing.whole_chunks_end(0, 150, 16, 15) == 0


def test_the_sync_request_proves_the_believed_leaves_are_a_prefix():
    s, p = session(cloud_tokens=64, held_blocks=2), params()
    hashes = framing.block_ids(s.token_ids, p, KEY, "s", "")
    req, leaves = framing.sync_request(s, hashes, p, "link", "s")
    assert (req.leaf_count, req.proof_from, req.split_layer, req.block_size_tokens) == (T // B, 2, K, B)
    assert req.merkle_root == merkle.root(leaves) and leaves[:2] == s.leaves
    assert merkle.verify_consistency(2, T // B, merkle.root(s.leaves), req.merkle_root, list(req.consistency_proof))


def test_sent_bytes_reach_the_apis_under_their_stream_kinds():
    sent = SentBytes(header_bytes=10) + SentBytes(activations_bytes=200, kv_bytes=3000) + SentBytes(kv_bytes=1)
    assert sent.by_kind() == {"header": 10, "activations": 200, "kv": 3001} and sent.payload_bytes == 3201
    done = TurnDone(
        finish_reason="stop",
        prompt_tokens=3,
        output_tokens=1,
        head_tokens=3,
        external_tokens=0,
        split_layer=K,
        timings={},
        sent_bytes=sent,
        output_token_ids=(5,),
        mode=Mode.SPLIT,
        resent_chunks=1,
    )
    assert done.wire_sent_bytes() == {
        "header": 10,
        "activations": 200,
        "kv": 3001,
        "resent_chunks": 1,
        "repaired_blocks": 0,
    }
    assert dict(done.to_pb().done.sent_bytes) == done.wire_sent_bytes()
    local = TurnDone(
        finish_reason="stop",
        prompt_tokens=3,
        output_tokens=1,
        head_tokens=0,
        external_tokens=0,
        split_layer=0,
        timings={},
        sent_bytes=None,
        output_token_ids=(5,),
        mode=Mode.LOCAL,
    )
    assert local.wire_sent_bytes() == {} and dict(local.to_pb().done.sent_bytes) == {}
