"""Unit tests: activation chunk framing, CRC32C, dtypes and codecs (no network)."""

import numpy as np
import pytest
import zstandard

from tandem.common.protocol.errors import ChecksumMismatch, CorruptPayload, InvalidRequest
from tandem.common.wire import chunks as wire


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
    bomb = wire.Chunk(
        seq=c.seq,
        token_offset=0,
        num_tokens=4,
        wire_dtype=wire.WireDtype.FP32,
        codec=wire.Codec.ZSTD,
        raw_nbytes=c.raw_nbytes,
        payload=big,
        crc32c=wire.crc32c(big),
    )
    with pytest.raises(InvalidRequest):
        wire.decode_chunk(bomb, 16, 4)


# --- zstd frames: exactly one complete frame of exactly the announced raw size -------------------------------------

H = 16
SKIPPABLE = (0x184D2A50).to_bytes(4, "little") + (4).to_bytes(4, "little") + b"skip"


def _raw(t=4, dtype=wire.WireDtype.FP32):
    """Wire bytes of t constant tokens (compress to a few bytes, so two frames stay under the payload bound)."""
    return wire.encode_dtype(np.full((t, H), 1.5, np.float32), dtype)


def _chunk(payload, t=4, dtype=wire.WireDtype.FP32, codec=wire.Codec.ZSTD, raw_nbytes=None, crc=None):
    raw_nbytes = wire.raw_nbytes_of(t, dtype, H) if raw_nbytes is None else raw_nbytes
    return wire.Chunk(
        seq=0,
        token_offset=0,
        num_tokens=t,
        wire_dtype=dtype,
        codec=codec,
        raw_nbytes=raw_nbytes,
        payload=payload,
        crc32c=wire.crc32c(payload) if crc is None else crc,
    )


def _rle_frame(declared, blocks, block=128 << 10):
    """A hand-made zstd frame (RFC 8878): header declaring ``declared`` content bytes (4-byte FCS field,
    128 KiB window, no checksum), then ``blocks`` RLE blocks of ``block`` zero bytes, 4 bytes each."""
    out = bytearray(zstandard.FRAME_HEADER + bytes([0x80, 7 << 3]) + declared.to_bytes(4, "little"))
    for i in range(blocks):
        out += ((i == blocks - 1) | 1 << 1 | block << 3).to_bytes(3, "little") + b"\0"
    return bytes(out)


def _frame(raw, **kw):
    return zstandard.ZstdCompressor(**kw).compress(raw)


@pytest.mark.parametrize("dtype", list(wire.WireDtype))
def test_zstd_roundtrip_every_dtype(dtype):
    x = h()
    chunks = wire.split(x, 3, 10, dtype, wire.Codec.ZSTD)
    for c in chunks:  # split writes exactly one frame declaring the raw size, within the payload bound
        assert zstandard.frame_content_size(c.payload) == c.raw_nbytes == wire.raw_nbytes_of(c.num_tokens, dtype, H)
        assert len(c.payload) <= wire.max_payload_bytes(c.raw_nbytes, wire.Codec.ZSTD)
        assert wire.decompress_exact(c.payload, c.raw_nbytes) == wire.encode_dtype(x[c.token_offset - 3 :][:10], dtype)
    plain = wire.combine(wire.split(x, 3, 10, dtype, wire.Codec.NONE), 3, 37, H)
    assert np.array_equal(wire.combine(chunks, 3, 37, H), plain)  # zstd is lossless on top of the dtype


def test_sizes_and_bounds():
    """raw_nbytes_of gives each activation format's size, max_payload_bytes bounds a zstd frame of
    incompressible input at every level and size, and negative sizes or unknown formats raise
    InvalidRequest."""
    assert wire.raw_nbytes_of(3, wire.WireDtype.FP32, H) == 3 * 4 * H
    assert wire.raw_nbytes_of(3, wire.WireDtype.BF16, H) == 3 * 2 * H
    assert wire.raw_nbytes_of(3, wire.WireDtype.INT8, H) == 3 * (H + 4)
    assert wire.max_payload_bytes(1000, wire.Codec.NONE) == 1000
    assert wire.max_payload_bytes(0, wire.Codec.ZSTD) == 64
    assert wire.max_payload_bytes(1000, wire.Codec.ZSTD) == 1000 + 3 + 63
    assert wire.max_payload_bytes(1 << 20, wire.Codec.ZSTD) == (1 << 20) + 4096
    for bad in (lambda: wire.raw_nbytes_of(-1, wire.WireDtype.FP32, H), lambda: wire.raw_nbytes_of(1, 9, H)):
        with pytest.raises(InvalidRequest):
            bad()
    with pytest.raises(InvalidRequest):
        wire.max_payload_bytes(-1, wire.Codec.ZSTD)
    # The bound holds for incompressible input at every level, across the 128 KiB block boundary.
    rng = np.random.default_rng(1)
    for n in (0, 1, 255, 4096, (128 << 10) - 1, 128 << 10, (128 << 10) + 1, 1 << 20):
        raw = rng.bytes(n)
        for level in (-5, 1, 3, 19):
            payload = wire.encode_payload(raw, wire.Codec.ZSTD, level)
            assert len(payload) <= wire.max_payload_bytes(n, wire.Codec.ZSTD)
            assert wire.decode_payload(payload, wire.Codec.ZSTD, n) == raw
    assert wire.encode_payload(b"abc", wire.Codec.NONE, 3) == b"abc"


FRAME = _frame(_raw(), write_content_size=True)
BAD_ZSTD_PAYLOADS = {
    "trailing garbage": (FRAME + b"garbage!", "8 trailing byte"),
    "one trailing byte": (FRAME + b"\0", "1 trailing byte"),
    "two frames": (FRAME + FRAME, "second zstd frame"),
    "skippable frame after": (FRAME + SKIPPABLE, "skippable frame"),
    "skippable frame first": (SKIPPABLE + FRAME, "skippable frame"),
    "truncated frame": (FRAME[:-1], "truncated"),
    "truncated header": (FRAME[:6], "truncated"),
    "magic only": (FRAME[:4], "truncated"),
    "too short": (FRAME[:3], "shorter than"),
    "no content size": (_frame(_raw(), write_content_size=False), "does not declare its content size"),
    "smaller content size": (_frame(_raw()[:-4]), "declares 252 bytes of content, expected 256"),
    "not zstd": (_raw(), "not the zstd magic"),
    "content longer than declared": (_rle_frame(256, 1, 512), "does not decompress to its declared 256"),
    "content shorter than declared": (_rle_frame(256, 1, 128), "does not decompress to its declared 256"),
}


@pytest.mark.parametrize("name", list(BAD_ZSTD_PAYLOADS))
def test_bad_zstd_payload_is_corrupt(name):
    payload, why = BAD_ZSTD_PAYLOADS[name]
    with pytest.raises(CorruptPayload, match=why):
        wire.decompress_exact(payload, 256)
    # Through the chunk path, with a CRC computed over the whole payload: CorruptPayload, not a CRC failure.
    with pytest.raises(CorruptPayload):
        wire.decode_chunk(_chunk(payload), H, 8)
    with pytest.raises(ChecksumMismatch):  # a CRC failure is still reported as such
        wire.decode_chunk(_chunk(payload, crc=wire.crc32c(payload) ^ 1), H, 8)


def test_frame_declaring_one_gib_is_refused_before_allocating():
    import resource
    import time
    import tracemalloc

    bomb = _rle_frame(1 << 30, 8192)  # 1 GiB of zeros in 32 KiB: a valid frame
    assert len(bomb) < 33 << 10 and zstandard.frame_content_size(bomb) == 1 << 30
    assert zstandard.ZstdDecompressor().stream_reader(bomb).read(1 << 20) == bytes(1 << 20)
    liar = _rle_frame(256, 8192)  # the same blocks under a header declaring the expected 256 bytes
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(CorruptPayload, match="exceeds"):  # 32 KiB payload for 256 raw bytes
            wire.decode_chunk(_chunk(bomb), H, 8)
        with pytest.raises(CorruptPayload, match="declares 1073741824 bytes"):
            wire.decompress_exact(bomb, 256)
        with pytest.raises(CorruptPayload, match="declares 1073741824 bytes"):
            wire.decompress_exact(bomb, (1 << 30) - 1)
        with pytest.raises(CorruptPayload):
            wire.decompress_exact(liar, 256)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 0.5
    assert peak < 16 << 20, peak
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 256 << 10


def test_payload_over_bound_is_corrupt():
    raw = _raw()
    with pytest.raises(CorruptPayload, match="exceeds"):
        wire.decode_chunk(_chunk(raw + b"x", codec=wire.Codec.NONE), H, 8)
    with pytest.raises(CorruptPayload, match="256"):
        wire.decode_chunk(_chunk(raw[:-1], codec=wire.Codec.NONE), H, 8)
    over = bytes(wire.max_payload_bytes(len(raw), wire.Codec.ZSTD) + 1)
    with pytest.raises(CorruptPayload, match="exceeds"):
        wire.decode_chunk(_chunk(over), H, 8)
    with pytest.raises(CorruptPayload, match="exceeds"):
        wire.decode_payload(FRAME + bytes(400), wire.Codec.ZSTD, len(raw))
    ok = wire.decode_chunk(_chunk(FRAME), H, 8)  # the same frame alone is fine
    assert np.array_equal(ok, np.full((4, H), 1.5, np.float32))


def test_header_sizes_checked_against_limits():
    with pytest.raises(InvalidRequest, match="num_tokens"):
        wire.decode_chunk(_chunk(FRAME, t=9), H, 8)
    with pytest.raises(InvalidRequest, match="raw_nbytes"):
        wire.decode_chunk(_chunk(FRAME, raw_nbytes=1 << 30), H, 8)
    with pytest.raises(InvalidRequest, match="unknown"):
        wire.decode_chunk(_chunk(FRAME, codec=7), H, 8)
    with pytest.raises(InvalidRequest, match="unknown"):
        wire.decode_chunk(_chunk(FRAME, dtype=0), H, 8)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # int8 scales flipped to huge values
def test_random_payloads_only_raise_domain_errors():
    rng = np.random.default_rng(2024)
    good = [c.payload for d in wire.WireDtype for c in wire.split(h(8, H, int(d)), 0, 4, d, wire.Codec.ZSTD)]
    outcomes = {"ok": 0, "corrupt": 0, "invalid": 0, "crc": 0}
    for _ in range(3000):
        kind = rng.integers(5)
        if kind == 0:
            payload = rng.bytes(int(rng.integers(0, 400)))
        elif kind == 1:
            payload = zstandard.FRAME_HEADER + rng.bytes(int(rng.integers(0, 400)))
        else:
            b = bytearray(good[rng.integers(len(good))])
            if kind == 2:
                for i in rng.integers(0, len(b), int(rng.integers(1, 4))):
                    b[i] ^= 1 << int(rng.integers(8))
            elif kind == 3:
                del b[int(rng.integers(len(b))) :]
            else:
                b += rng.bytes(int(rng.integers(1, 16)))
            payload = bytes(b)
        t = int(rng.integers(0, 10))
        dtype = int(rng.choice([0, 1, 2, 3, 4, 4]))
        codec = int(rng.choice([0, 1, 2, 2, 2, 3]))
        raw_nbytes = int(rng.integers(0, 2000)) if rng.random() < 0.2 else None
        if raw_nbytes is None and dtype in wire.WireDtype._value2member_map_:
            raw_nbytes = wire.raw_nbytes_of(t, wire.WireDtype(dtype), H)
        crc = int(rng.integers(1 << 32)) if rng.random() < 0.1 else None
        try:
            out = wire.decode_chunk(_chunk(payload, t, dtype, codec, raw_nbytes or 0, crc), H, 8)
        except CorruptPayload:
            outcomes["corrupt"] += 1
        except ChecksumMismatch:
            outcomes["crc"] += 1
        except InvalidRequest:
            outcomes["invalid"] += 1
        else:
            assert out.shape == (t, H) and out.dtype == np.float32
            outcomes["ok"] += 1
    assert all(outcomes.values()), outcomes  # every path was exercised
