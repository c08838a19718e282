"""Unit tests: activation chunk framing, CRC32C, dtypes and codecs (no network)."""

import numpy as np
import pytest

from common import wire
from common.errors import ChecksumMismatch, InvalidRequest


def h(t=37, hidden=16, seed=0):
    return np.random.default_rng(seed).standard_normal((t, hidden)).astype(np.float32) * 10


def test_crc32c_known_vector():
    # RFC 3720 B.4: 32 bytes of zeros -> 0x8A9136AA
    assert wire.crc32c(bytes(32)) == 0x8A9136AA
    assert wire.crc32c(b"123456789") == 0xE3069283  # the CRC catalogue's check value for CRC-32C


@pytest.mark.parametrize("codec", list(wire.Codec))
def test_fp32_roundtrip_is_exact(codec):
    x = h()
    chunks = wire.split(x, 5, 8, wire.WireDtype.FP32, codec)
    assert [c.num_tokens for c in chunks] == [8, 8, 8, 8, 5]
    assert [c.token_offset for c in chunks] == [5, 13, 21, 29, 37]
    y = wire.combine(list(reversed(chunks)), 5, 37, 16)  # arrival order does not matter
    assert np.array_equal(x, y)


@pytest.mark.parametrize(
    "dtype,tol", [(wire.WireDtype.FP16, 1e-3), (wire.WireDtype.BF16, 8e-3), (wire.WireDtype.INT8, None)]
)
def test_lossy_dtypes_within_bounds(dtype, tol):
    x = h()
    y = wire.combine(wire.split(x, 0, 10, dtype, wire.Codec.ZSTD), 0, 37, 16)
    if dtype == wire.WireDtype.INT8:
        bound = np.abs(x).max(axis=1, keepdims=True) / 127 / 2 + 1e-6  # half a quantisation step per token
        assert (np.abs(x - y) <= bound).all()
    else:
        assert np.allclose(x, y, rtol=tol, atol=tol)


def test_corrupted_payload_is_detected():
    c = wire.split(h(), 0, 64)[0]
    bad = wire.Chunk(**{**c.__dict__, "payload": bytes([c.payload[0] ^ 1]) + c.payload[1:]})
    with pytest.raises(ChecksumMismatch):
        wire.verify(bad)
    with pytest.raises(ChecksumMismatch):
        wire.combine([bad], 0, 37, 16)


def test_combine_rejects_gaps_overlaps_and_bad_sizes():
    chunks = wire.split(h(), 0, 10)
    with pytest.raises(InvalidRequest, match="uncovered"):
        wire.combine(chunks[:-1], 0, 37, 16)
    with pytest.raises(InvalidRequest, match="overlaps"):
        wire.combine(chunks + [chunks[0]], 0, 37, 16)
    with pytest.raises(InvalidRequest, match="outside"):
        wire.combine(chunks, 1, 37, 16)
    with pytest.raises(InvalidRequest, match="raw_nbytes"):
        wire.combine(chunks, 0, 37, 17)  # a hidden size other than the one negotiated
    with pytest.raises(InvalidRequest):
        wire.split(h().astype(np.float64), 0, 8)
    with pytest.raises(InvalidRequest):
        wire.split(h(), 0, 0)


def test_zstd_bomb_is_bounded():
    import zstandard

    c = wire.split(h(4), 0, 4, wire.WireDtype.FP32, wire.Codec.NONE)[0]
    big = zstandard.ZstdCompressor().compress(bytes(10 * len(c.payload)))
    bomb = wire.Chunk(c.seq, 0, 4, wire.WireDtype.FP32, wire.Codec.ZSTD, c.raw_nbytes, big, wire.crc32c(big))
    with pytest.raises(InvalidRequest):
        wire.decode_chunk(bomb, 16, 4)
