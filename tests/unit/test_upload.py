"""Unit tests of the cloud's upload verification (pure domain code, no network or engines)."""

import numpy as np
import pytest

from tandem.cloud.sessions.table import CloudSession, SessionTable
from tandem.cloud.uploads.upload import TurnUpload, check_header
from tandem.common.protocol.errors import (
    ChecksumMismatch,
    InvalidRequest,
    MerkleMismatch,
    ParamsVersionMismatch,
    SessionOutOfSync,
)
from tandem.common.protocol.params import LinkParams, Sampling
from tandem.common.wire import chunks as wire
from tandem.common.wire import merkle
from tandem.common.wire.kvblocks import block_hashes, hash_seed
from tandem.common.wire.messages import KVBlock, TurnHeader
from tests.doubles import HKV, D, H, K, toy_manifest

B = 4  # smaller blocks than the shared doubles' (32): prompts of a few tokens cover whole blocks
SEED = hash_seed("unit", B)
MANIFEST = toy_manifest(vocab_size=100, max_position_embeddings=64)
PARAMS = LinkParams(
    params_version=1,
    split_layer=K,
    chunk_tokens=3,
    wire_dtype=wire.WireDtype.FP32,
    codec=wire.Codec.NONE,
    codec_level=0,
    kv_block_size_tokens=B,
    inflight_window_bytes=8,
    max_concurrent_requests=4,
    max_batched_tokens=64,
    max_prompt_tokens=32,
    max_new_tokens=16,
    hidden_size=H,
    max_chunk_resends=2,
)


def make_turn(ids, cached=0, leaves_before=0):
    rng = np.random.default_rng(len(ids))
    hidden = rng.standard_normal((len(ids), H)).astype(np.float32)
    chunks = wire.split(hidden[cached:], cached, PARAMS.chunk_tokens, params_version=1)
    hashes = block_hashes(ids, B, SEED)
    blocks = {}
    for j in range(leaves_before, len(hashes)):
        raw = rng.standard_normal((K, 2, HKV, B, D)).astype(np.float32).tobytes()
        leaf = merkle.leaf_hash(merkle.leaf_data(hashes[j], 0, K, 1, raw))
        blocks[j] = KVBlock(
            leaf_index=j,
            block_hash=hashes[j],
            layer_lo=0,
            layer_hi=K,
            codec=wire.Codec.NONE,
            raw_nbytes=len(raw),
            payload=raw,
            leaf_hash=leaf,
            params_version=1,
        )
    header = TurnHeader(
        request_id="r",
        session_id="s",
        params_version=1,
        split_layer=K,
        prompt_token_ids=tuple(ids),
        cached_tokens=cached,
        num_chunks=len(chunks),
        num_kv_blocks=len(blocks),
        sampling=Sampling(max_new_tokens=4),
    )
    return header, hidden, chunks, blocks


def upload(header, session=None):
    return TurnUpload(header, PARAMS, MANIFEST, session or CloudSession(), SEED)


def test_clean_upload_verifies_and_updates_session():
    ids = list(range(10))
    header, hidden, chunks, blocks = make_turn(ids)
    check_header(header, PARAMS, MANIFEST)
    s = CloudSession()
    u = upload(header, s)
    for c in chunks:
        assert u.add_chunk(c)
    for b in blocks.values():
        u.add_block(b)
    leaves = [b.leaf_hash for b in blocks.values()]
    assert u.commit(len(leaves), merkle.root(leaves)) == []
    assert u.complete
    assert np.array_equal(u.activations(), hidden)
    u.apply_to(s, u.activations())
    assert s.token_ids == ids and len(s.leaves) == 2 and s.version == 1


def test_bad_crc_is_nacked_then_data_loss():
    header, _, chunks, _ = make_turn(list(range(10)))
    u = upload(header)
    bad = wire.Chunk(**{**chunks[0].__dict__, "crc32c": chunks[0].crc32c ^ 1})
    assert not u.add_chunk(bad) and not u.add_chunk(bad)
    with pytest.raises(ChecksumMismatch):
        u.add_chunk(bad)  # third failure > max_chunk_resends=2
    assert u.add_chunk(chunks[1])


def test_bad_leaf_asks_for_repair_and_bad_root_is_refused():
    ids = list(range(10))
    header, _, _, blocks = make_turn(ids)
    u = upload(header)
    b0 = blocks[0]
    u.add_block(KVBlock(**{**b0.__dict__, "payload": bytes(len(b0.payload))}))  # bytes changed in transit
    u.add_block(blocks[1])
    leaves = [b.leaf_hash for b in blocks.values()]
    assert u.commit(2, merkle.root(leaves)) == [0]
    u.add_block(b0)
    with pytest.raises(MerkleMismatch):
        u.commit(2, merkle.root(leaves[::-1]))
    with pytest.raises(MerkleMismatch):
        u.commit(3, merkle.root(leaves))


def test_blocks_must_match_the_prompt():
    header, _, _, blocks = make_turn(list(range(10)))
    u = upload(header)
    b = blocks[0]
    with pytest.raises(InvalidRequest, match="block hash"):
        u.add_block(KVBlock(**{**b.__dict__, "block_hash": bytes(32)}))
    with pytest.raises(InvalidRequest, match="outside"):
        u.add_block(KVBlock(**{**b.__dict__, "leaf_index": 7}))
    with pytest.raises(InvalidRequest, match="layers"):
        u.add_block(KVBlock(**{**b.__dict__, "layer_hi": K + 1}))


def test_header_limits():
    """A turn header with another params version raises ParamsVersionMismatch; token ids outside the
    vocabulary, a prompt, chunk count or max_new_tokens over the limits, bad sampling values or more cached
    tokens than the prompt raise InvalidRequest."""
    header, *_ = make_turn(list(range(10)))
    for bad, err in [
        (dict(params_version=2), ParamsVersionMismatch),
        (dict(prompt_token_ids=(1000,)), InvalidRequest),
        (dict(prompt_token_ids=tuple(range(40))), InvalidRequest),
        (dict(num_chunks=9), InvalidRequest),
        (dict(sampling=Sampling(max_new_tokens=99)), InvalidRequest),
        (dict(sampling=Sampling(temperature=-1)), InvalidRequest),
        (dict(sampling=Sampling(temperature=float("nan"))), InvalidRequest),
        (dict(cached_tokens=11), InvalidRequest),
    ]:
        with pytest.raises(err):
            check_header(TurnHeader(**{**header.__dict__, **bad}), PARAMS, MANIFEST)


def held(n=10, **kw):
    """A session holding ``n`` tokens 0..n-1 at split layer K in blocks of B."""
    base = dict(
        token_ids=list(range(n)),
        hidden=np.zeros((n, H), np.float32),
        leaves=[bytes([j]) * 32 for j in range(n // B)],
        split_layer=K,
        block_tokens=B,
    )
    return CloudSession(**{**base, **kw})


def test_second_turn_needs_the_sessions_state():
    s = held()
    header, *_ = make_turn(list(range(14)), cached=10, leaves_before=2)
    assert upload(header, s).first_new_leaf == 2
    other, *_ = make_turn([5] + list(range(1, 14)), cached=10, leaves_before=2)
    with pytest.raises(SessionOutOfSync, match="other token ids"):
        upload(other, s)
    ahead, *_ = make_turn(list(range(14)), cached=12, leaves_before=3)
    with pytest.raises(SessionOutOfSync, match="assumed 12"):
        upload(ahead, s)
    restart, *_ = make_turn([5] + list(range(1, 14)))
    assert upload(restart, s).first_new_leaf == 0  # cached_tokens=0 restarts the session
    with pytest.raises(SessionOutOfSync, match="split layer"):
        upload(header, held(split_layer=K + 1))
    with pytest.raises(SessionOutOfSync, match="blocks of"):
        upload(header, held(block_tokens=2 * B))


@pytest.mark.parametrize("cached", [0, 3, 4, 7, 9])
def test_an_edit_keeps_the_verified_prefix(cached):
    """An edit after token ``cached`` (or a regenerated answer, cached = T - 1) keeps the session's
    first ``cached`` activations and the leaves of the full blocks inside them; only the rest
    travels, and the committed root covers kept and new leaves together."""
    s = held()
    ids = list(range(cached)) + [50 + i for i in range(10 - cached)]
    header, hidden, chunks, blocks = make_turn(ids, cached=cached, leaves_before=cached // B)
    u = upload(header, s)
    assert u.first_new_leaf == cached // B and list(u.expected_leaves) == list(range(cached // B, 2))
    for c in chunks:
        assert u.add_chunk(c)
    for b in blocks.values():
        u.add_block(b)
    leaves = s.leaves[: cached // B] + [b.leaf_hash for b in blocks.values()]
    assert u.commit(len(leaves), merkle.root(leaves)) == []
    act = u.activations()
    assert act.shape == (10, H) and np.array_equal(act[cached:], hidden[cached:])
    u.apply_to(s, act)
    assert s.token_ids == ids and s.leaves == leaves and s.version == 1


def test_session_table_is_bounded_by_count_and_bytes():
    t = SessionTable(max_entries=2, max_bytes=1 << 20)
    for name in "abc":
        t.put(name, CloudSession())
    assert t.evict() == ["a"] and len(t) == 2
    t = SessionTable(max_entries=100, max_bytes=10_000)
    for i in range(5):
        t.put(f"{i}" * 4000, CloudSession())  # long ids count too
    t.evict()
    assert len(t) == 2 and t.nbytes() <= 10_000


def test_non_finite_or_huge_values_are_refused():
    header, hidden, chunks, blocks = make_turn(list(range(10)))
    for bad in (np.nan, np.inf, 1e9):
        u = upload(header)
        h = hidden.copy()
        h[3, 2] = bad
        with pytest.raises(InvalidRequest, match="activations"):
            for c in wire.split(h, 0, PARAMS.chunk_tokens, params_version=1):
                u.add_chunk(c)
    u = upload(header)
    raw = np.full((K, 2, HKV, B, D), np.nan, np.float32).tobytes()
    b = blocks[0]
    leaf = merkle.leaf_hash(merkle.leaf_data(b.block_hash, 0, K, 1, raw))
    with pytest.raises(InvalidRequest, match="NaN"):
        u.add_block(KVBlock(**{**b.__dict__, "payload": raw, "leaf_hash": leaf}))


def test_duplicates_and_unnegotiated_encodings_are_refused():
    header, hidden, chunks, blocks = make_turn(list(range(10)))
    u = upload(header)
    assert u.add_chunk(chunks[0])
    with pytest.raises(InvalidRequest, match="again"):
        u.add_chunk(chunks[0])
    fp16 = wire.split(hidden[3:6], 3, 3, wire.WireDtype.FP16, params_version=1)[0]
    with pytest.raises(InvalidRequest, match="negotiated"):
        u.add_chunk(wire.Chunk(**{**fp16.__dict__, "seq": 1}))
    u.add_block(blocks[0])
    with pytest.raises(InvalidRequest, match="again"):
        u.add_block(blocks[0])
    with pytest.raises(InvalidRequest, match="announces"):
        upload(TurnHeader(**{**header.__dict__, "num_kv_blocks": 1}))
    with pytest.raises(InvalidRequest, match="session_id"):
        check_header(TurnHeader(**{**header.__dict__, "session_id": "x" * 200}), PARAMS, MANIFEST)


def test_kv_blocks_in_another_format_than_the_links_are_refused():
    from dataclasses import replace

    from tandem.common.wire.kvwire import encode_kv

    header, _, _, blocks = make_turn(list(range(10)))
    b = blocks[0]
    x = np.frombuffer(b.payload, np.float32).reshape(K, 2, HKV, B, D)
    raw = encode_kv(x, wire.WireDtype.INT8)
    leaf = merkle.leaf_hash(merkle.leaf_data(b.block_hash, 0, K, wire.WireDtype.INT8, raw))
    i8 = wire.WireDtype.INT8
    int8 = KVBlock(**{**b.__dict__, "payload": raw, "raw_nbytes": len(raw), "leaf_hash": leaf, "wire_dtype": i8})
    with pytest.raises(InvalidRequest, match="negotiated FP32"):
        upload(header).add_block(int8)
    # under a link that negotiated int8 the same block verifies and is kept as its float32 decoding
    u = TurnUpload(header, replace(PARAMS, kv_wire_dtype=wire.WireDtype.INT8), MANIFEST, CloudSession(), SEED)
    u.add_block(int8)
    kept = np.frombuffer(u.blocks[0][1], np.float32)
    assert kept.size == x.size and np.abs(kept - x.ravel()).max() <= np.abs(x).max() / 127
    # the fp32 block announced as int8: its size is wrong for the format
    with pytest.raises(InvalidRequest, match="bytes"):
        u.add_block(KVBlock(**{**b.__dict__, "wire_dtype": i8, "leaf_index": 1, "block_hash": blocks[1].block_hash}))


def test_the_upload_budget_covers_what_is_kept_not_only_what_travels():
    """A quantised upload is kept as float32 (up to 8x its wire size): the reservation covers that."""
    from dataclasses import replace

    from tandem.cloud.uploads.upload import upload_bound_bytes

    header, _, chunks, blocks = make_turn(list(range(10)))
    fp32 = upload_bound_bytes(header, PARAMS, MANIFEST)
    small = replace(PARAMS, wire_dtype=wire.WireDtype.INT4, kv_wire_dtype=wire.WireDtype.INT4)
    kept = header.num_chunks * PARAMS.chunk_tokens * H * 4 + header.num_kv_blocks * K * 2 * HKV * B * D * 4
    assert upload_bound_bytes(header, small, MANIFEST) >= kept and fp32 >= kept


def test_the_verified_prefix_is_what_a_cut_upload_leaves_the_session():
    """A cut upload keeps the chunks from the first one on without a gap and the
    full KV blocks inside them; the prefix stops before a gap in either. chunk_tokens = 3, B = 4."""
    ids = list(range(20))
    header, hidden, chunks, blocks = make_turn(ids)
    u = upload(header)
    assert u.verified_prefix() == 0
    for c in chunks[:4]:  # tokens [0, 12)
        assert u.add_chunk(c)
    assert u.verified_prefix() == 0  # block 0 (tokens 0..3) not here yet
    u.add_block(blocks[0])
    assert u.verified_prefix() == 4  # block 1 (4..7) missing
    u.add_block(blocks[1])
    u.add_block(blocks[2])
    assert u.verified_prefix() == 12  # block 2 (8..11) in; chunk 4 (12..14) missing
    assert u.add_chunk(chunks[5])  # a later chunk does not bridge the gap
    assert u.verified_prefix() == 12
    h, got_ids, leaves = u.prefix(12)
    assert np.array_equal(h, hidden[:12]) and got_ids == ids[:12]
    assert leaves == [blocks[j].leaf_hash for j in range(3)]
    s = CloudSession()
    u.apply_prefix(s, 12, h, leaves)
    assert s.token_ids == ids[:12] and s.version == 1 and u.base_version == 1
    # the rest arrives: the turn's own commit continues from the prefix
    assert u.add_chunk(chunks[4])
    for c in chunks[6:]:
        assert u.add_chunk(c)
    for j in range(3, 5):
        u.add_block(blocks[j])
    all_leaves = [b.leaf_hash for b in blocks.values()]
    assert u.commit(5, merkle.root(all_leaves)) == [] and u.complete
    u.apply_to(s, u.activations())
    assert s.token_ids == ids and s.leaves == all_leaves and s.version == 2


def test_a_prefix_is_never_kept_over_a_turn_that_committed_meanwhile():
    ids = list(range(10))
    header, hidden, chunks, blocks = make_turn(ids)
    s = CloudSession()
    u = upload(header, s)
    for c in chunks:
        u.add_chunk(c)
    u.add_block(blocks[0])
    s.version += 1  # another turn of the session committed
    h, _, leaves = u.prefix(4)
    with pytest.raises(SessionOutOfSync):
        u.apply_prefix(s, 4, h, leaves)


def test_the_verified_prefix_of_a_turn_past_an_unaligned_cached_prefix():
    """cached_tokens = 6 (inside block 1): the prefix never drops below it, and grows once block
    1 (tokens 4..7) and the chunk holding token 7 are in."""
    ids = list(range(14))
    s = held(6)
    header, hidden, chunks, blocks = make_turn(ids, cached=6, leaves_before=1)
    u = upload(header, s)
    assert u.verified_prefix() == 6
    assert u.add_chunk(chunks[0])  # tokens 6..8
    assert u.verified_prefix() == 6  # block 1 missing
    u.add_block(blocks[1])
    assert u.verified_prefix() == 9
    h, got, leaves = u.prefix(9)
    assert got == ids[:9] and len(leaves) == 2 and h.shape == (9, H)
