"""KV block wire formats (``common.wire.kvwire``) and activation int4 (``common.wire.chunks``): sizes,
round trips and their error bounds, and what a leaf commits to."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.common.protocol.errors import InvalidRequest
from tandem.common.protocol.params import WireDtype
from tandem.common.wire import chunks as wire
from tandem.common.wire import formats, merkle, quant
from tandem.common.wire.kvwire import decode_kv, encode_kv, kv_raw_nbytes

SHAPE = (4, 2, 3, 32, 64)  # SmolLM2-135M at k = 4, block size 32


def block(seed: int = 0, shape=SHAPE) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * 2
    x[:, 0, :, :, 7 % shape[4]] += 15.0  # keys carry outlier channels after RoPE (KIVI, section 3)
    return x


@pytest.mark.parametrize("dtype", list(WireDtype))
def test_sizes_and_round_trip(dtype):
    """Every KV format encodes a block to its stated size and decodes to float32 of the same shape within the
    format's error bound; re-encoding a decoded block is stable for the non-integer formats."""
    x = block()
    raw = encode_kv(x, dtype)
    assert len(raw) == kv_raw_nbytes(SHAPE, dtype)
    y = decode_kv(raw, dtype, SHAPE)
    assert y.shape == SHAPE and y.dtype == np.float32
    rel = float(np.linalg.norm(y - x) / np.linalg.norm(x))
    bound = {WireDtype.FP32: 0, WireDtype.FP16: 1e-3, WireDtype.BF16: 5e-3, WireDtype.INT8: 2e-2}
    bound |= {WireDtype.INT8_HADAMARD: 1e-2, WireDtype.INT4_HADAMARD: 0.15}
    assert rel <= bound.get(dtype, 0.1)
    lossy_int = (WireDtype.INT8, WireDtype.INT4, WireDtype.INT8_HADAMARD, WireDtype.INT4_HADAMARD)
    assert encode_kv(y, dtype) == raw or dtype in lossy_int  # re-encoding is stable


def test_bytes_per_token_at_k4():
    per_token = {d: kv_raw_nbytes(SHAPE, d) / 32 for d in WireDtype}
    assert per_token == {
        WireDtype.FP32: 6144,
        WireDtype.FP16: 3072,
        WireDtype.BF16: 3072,
        WireDtype.INT8: 1584,  # 1536 + an fp16 scale per (layer, K/V, head, token)
        WireDtype.INT4: 912,  # 768 + fp16 (scale, min) per key channel and per value token
        WireDtype.INT8_HADAMARD: 1584,  # INT8's layout, rows rotated
        WireDtype.INT4_HADAMARD: 816,  # 768 + an fp16 scale per (layer, K/V, head, token): D = 64, one block
    }


def test_int8_error_is_half_a_step_per_token_and_head():
    x = block(1)
    y = decode_kv(encode_kv(x, WireDtype.INT8), WireDtype.INT8, SHAPE)
    step = np.abs(x).max(axis=4, keepdims=True) / 127
    assert np.all(np.abs(y - x) <= step * 0.5 * (1 + 2e-3) + 1e-7)  # fp16 scale rounding: 2^-11


def test_int4_quantises_keys_per_channel():
    """An outlier key channel costs only its own channel's resolution (per-token scales would
    spread it over every channel of the token)."""
    x = block(2)
    y = decode_kv(encode_kv(x, WireDtype.INT4), WireDtype.INT4, SHAPE)
    k, yk = x[:, 0], y[:, 0]
    normal = [c for c in range(64) if c != 7]
    per_channel_err = np.abs(yk - k)[..., normal].max()
    span = (k[..., normal].max(axis=2) - k[..., normal].min(axis=2)).max()
    assert per_channel_err <= span / 15 * 0.5 * 1.01
    assert per_channel_err < 15.0 / 15 * 0.5  # below a per-token step stretched by the outlier


def test_degenerate_values():
    """All-zero blocks stay zero in every format, a constant block survives int4, fp16 keeps huge values
    finite, and an odd head dim pads int4 rows to whole bytes."""
    zeros = np.zeros(SHAPE, np.float32)
    for d in WireDtype:
        assert not decode_kv(encode_kv(zeros, d), d, SHAPE).any()
    const = np.full(SHAPE, 3.0, np.float32)  # max == min: scale 0, the minimum carries it
    assert np.allclose(decode_kv(encode_kv(const, WireDtype.INT4), WireDtype.INT4, SHAPE), 3.0)
    huge = np.full(SHAPE, 1e6, np.float32)
    assert np.isfinite(decode_kv(encode_kv(huge, WireDtype.FP16), WireDtype.FP16, SHAPE)).all()
    odd = (1, 2, 1, 3, 5)  # odd D: int4 rows are padded to whole bytes
    x = block(3, odd)
    assert len(encode_kv(x, WireDtype.INT4)) == kv_raw_nbytes(odd, WireDtype.INT4)
    assert decode_kv(encode_kv(x, WireDtype.INT4), WireDtype.INT4, odd).shape == odd


def test_bad_input_is_refused():
    """A payload of the wrong length, a block of the wrong rank or dtype, and an unknown format raise
    InvalidRequest."""
    with pytest.raises(InvalidRequest, match="expected"):
        decode_kv(b"\0" * 10, WireDtype.INT8, SHAPE)
    with pytest.raises(InvalidRequest):
        encode_kv(np.zeros((4, 3, 3, 32, 64), np.float32), WireDtype.FP16)
    with pytest.raises(InvalidRequest):
        encode_kv(np.zeros(SHAPE, np.float64), WireDtype.FP16)
    with pytest.raises(InvalidRequest):
        kv_raw_nbytes((4, 2, 3, 32, 64), 9)  # type: ignore[arg-type]


def test_a_leaf_commits_to_the_format():
    x, h = block(4), bytes(32)
    leaves = {merkle.leaf_hash(merkle.leaf_data(h, 0, 4, d, encode_kv(x, d))) for d in WireDtype}
    assert len(leaves) == len(WireDtype)
    # the same bytes announced under another format are another leaf
    raw = encode_kv(x, WireDtype.FP16)
    assert merkle.leaf_data(h, 0, 4, WireDtype.FP16, raw) != merkle.leaf_data(h, 0, 4, WireDtype.BF16, raw)


@pytest.mark.parametrize("hidden", [576, 577, 8, 33])
def test_activation_int4(hidden):
    """int4 activations have the stated size and an error per element of at most half their group's step, for
    widths that do and do not fill whole groups."""
    rng = np.random.default_rng(hidden)
    h = rng.standard_normal((5, hidden)).astype(np.float32)
    raw = wire.encode_dtype(h, WireDtype.INT4)
    assert len(raw) == wire.raw_nbytes_of(5, WireDtype.INT4, hidden)
    y = wire.decode_dtype(raw, WireDtype.INT4, 5, hidden)
    g = -(-hidden // formats.INT4_GROUP)
    padded = np.zeros((5, g * formats.INT4_GROUP), np.float32)
    padded[:, :hidden] = np.abs(h)
    step = np.repeat(padded.reshape(5, g, -1).max(axis=2) / 7, formats.INT4_GROUP, axis=1)[:, :hidden]
    assert np.all(np.abs(y - h) <= step * 0.5 * 1.01 + 1e-7)
    assert wire.raw_nbytes_of(1, WireDtype.INT4, 576) == 36 + 288


def test_fp32_leaves_carry_no_format_byte():
    """An fp32 leaf hashes the block without a format byte, the layout every edge and cloud shares for fp32."""
    import struct

    raw, h = encode_kv(block(5), WireDtype.FP32), bytes(range(32))
    assert merkle.leaf_data(h, 0, 4, WireDtype.FP32, raw) == h + struct.pack("<II", 0, 4) + raw


def test_non_finite_values_stay_non_finite_and_huge_ones_finite():
    """The cloud refuses NaN and inf (``upload.check_values``): no format may turn them into
    numbers; and a finite value past fp16's range must not become inf in a format that saturates."""
    x = block(6)
    x.reshape(-1).view("<u4")[:3] = [0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001]  # NaNs that wrapped to 0 in bf16
    x.reshape(-1)[3] = np.inf
    for d in WireDtype:
        y = decode_kv(encode_kv(x, d), d, SHAPE).reshape(-1)
        if d in (WireDtype.INT8_HADAMARD, WireDtype.INT4_HADAMARD):  # their rows decode to NaN: refused
            assert np.isnan(y[:64]).all() and np.isfinite(y[64:]).all(), d
            continue
        assert not np.isfinite(y[:4]).any() or d in (WireDtype.INT8, WireDtype.INT4), d
        if d in (WireDtype.INT8, WireDtype.INT4):  # the whole group is non-finite or huge: refused too
            assert not (np.isfinite(y[:4]) & (np.abs(y[:4]) <= 1e5)).all(), d
    big = block(7)
    big[0, 0, 0, :, 3] = -70000.0  # a key channel's minimum past fp16's range
    big[0, 1, 0, 2, :] = 66000.0  # a value token's
    for d in (WireDtype.FP16, WireDtype.INT4):
        assert np.isfinite(decode_kv(encode_kv(big, d), d, SHAPE)).all(), d
    h = np.zeros((2, 8), np.float32)
    h.view("<u4")[0, :2] = [0x7FFFFFFF, 0xFFFFFFFF]
    assert np.isnan(wire.decode_dtype(wire.encode_dtype(h, WireDtype.BF16), WireDtype.BF16, 2, 8)[0, :2]).all()


def test_int8_hadamard_beats_int8_on_outlier_channels_and_keeps_error_bounded():
    """Keys with an outlier channel (``block``: channel 7 at +15): the rotation spreads it over the
    row, so the other channels' error falls; the error is at most half a step of the rotated row,
    and an orthonormal rotation keeps that bound in the original basis (in L2 per row)."""
    x = block(3)
    y8 = decode_kv(encode_kv(x, WireDtype.INT8), WireDtype.INT8, SHAPE)
    yh = decode_kv(encode_kv(x, WireDtype.INT8_HADAMARD), WireDtype.INT8_HADAMARD, SHAPE)
    normal = [c for c in range(64) if c != 7]
    err8 = np.linalg.norm((y8 - x)[:, 0][..., normal])
    errh = np.linalg.norm((yh - x)[:, 0][..., normal])
    assert errh < 0.7 * err8, (errh, err8)
    rotated = quant.rotate(x, 64)
    step = np.abs(rotated).max(axis=4, keepdims=True) / 127 * (1 + 2e-3)
    row_err = np.linalg.norm(yh - x, axis=4, keepdims=True)
    assert np.all(row_err <= 0.5 * step * np.sqrt(64) + 1e-5)


def test_hadamard_is_orthonormal_and_its_own_inverse():
    for n in (1, 2, 8, 64, 256):
        h = quant.hadamard(n)
        assert h.shape == (n, n) and np.allclose(h @ h, np.eye(n), atol=1e-6) and np.allclose(h, h.T)
    x = np.random.default_rng(0).standard_normal((3, 5, 576)).astype(np.float32)
    assert np.allclose(quant.rotate(quant.rotate(x, 64), 64), x, atol=1e-5)
    assert quant.hadamard_block(576) == 64 and quant.hadamard_block(96) == 32 and quant.hadamard_block(577) == 1
    with pytest.raises(ValueError):
        quant.hadamard(12)
    with pytest.raises(ValueError):
        quant.rotate(x, 128)  # 576 is not a multiple of 128


@pytest.mark.parametrize("hidden", [576, 96, 577, 8])
def test_activation_int8_hadamard(hidden):
    """Sizes, the error bound, and the case it exists for: a token whose residual stream has one
    channel ~500x its median (SmolLM2 after layer 4), where per-token int8 loses every other channel."""
    rng = np.random.default_rng(hidden)
    h = rng.standard_normal((5, hidden)).astype(np.float32)
    h[:, hidden // 3] = 700.0
    raw = wire.encode_dtype(h, WireDtype.INT8_HADAMARD)
    b = quant.hadamard_block(hidden)
    assert len(raw) == wire.raw_nbytes_of(5, WireDtype.INT8_HADAMARD, hidden) == 5 * (hidden + 2 * (hidden // b))
    y = wire.decode_dtype(raw, WireDtype.INT8_HADAMARD, 5, hidden)
    blocks = quant.rotate(h, b).reshape(5, hidden // b, b)
    step = np.abs(blocks).max(axis=2) / 127 * (1 + 2e-3)  # [T, blocks]
    err = np.linalg.norm((y - h).reshape(5, hidden // b, b), axis=2)
    assert np.all(err <= 0.5 * step * np.sqrt(b) + 1e-5)
    if hidden == 576:
        others = np.arange(hidden) != hidden // 3
        per_token = wire.decode_dtype(wire.encode_dtype(h, WireDtype.INT8), WireDtype.INT8, 5, hidden)
        rel = lambda z: np.linalg.norm((z - h)[:, others]) / np.linalg.norm(h[:, others])  # noqa: E731
        assert rel(y) < 0.1 < 0.9 < rel(per_token)
    bad = h.copy()
    bad[0, 0], bad[1, 0] = np.nan, np.inf
    z = wire.decode_dtype(wire.encode_dtype(bad, WireDtype.INT8_HADAMARD), WireDtype.INT8_HADAMARD, 5, hidden)
    assert np.isnan(z[0, :b]).all() and np.isnan(z[1, :b]).all() and np.isfinite(z[2:]).all()


@pytest.mark.parametrize("kind", ["activations", "kv"])
def test_int4_hadamard_error_is_half_a_step_of_the_rotated_block(kind):
    """Rotated int4 (scales ``max|y| / 7`` per row and rotation block, inside the bytes): the error
    of each block is at most half a step per channel in L2, in the original basis too (the rotation
    is orthonormal). Sizes: activations ``T * (2 * H / b + H / 2)``."""
    rng = np.random.default_rng(11)
    d = WireDtype.INT4_HADAMARD
    if kind == "activations":
        x = rng.standard_normal((5, 576)).astype(np.float32)
        x[:, 100] = 300.0  # one channel ~300x the others, as SmolLM2's residual stream after layer 4
        raw = wire.encode_dtype(x, d)
        assert len(raw) == wire.raw_nbytes_of(5, d, 576) == 5 * (2 * 9 + 288)
        y, b = wire.decode_dtype(raw, d, 5, 576), 64
    else:
        x = block(12)
        y, b = decode_kv(encode_kv(x, d), d, SHAPE), 64
    rows = x.reshape(-1, x.shape[-1] // b, b)
    step = np.abs(quant.rotate(x, b).reshape(rows.shape)).max(axis=2) / 7 * (1 + 2e-3)
    err = np.linalg.norm((y - x).reshape(rows.shape), axis=2)
    assert np.all(err <= 0.5 * step * np.sqrt(b) + 1e-5)


@pytest.mark.parametrize("dtype", [WireDtype.INT8_HADAMARD, WireDtype.INT4_HADAMARD])
def test_rotated_formats_are_negotiated_only_for_widths_they_suit(dtype):
    """An odd width would rotate single channels, each with its own scale: more bytes than fp16."""
    hadamard = formats.FORMATS[dtype]
    assert hadamard.suits(576) and hadamard.suits(72)
    assert not hadamard.suits(577) and not hadamard.suits(6)
    rotated = (WireDtype.INT8_HADAMARD, WireDtype.INT4_HADAMARD)
    assert all(formats.FORMATS[d].suits(577) for d in WireDtype if d not in rotated)
    assert wire.raw_nbytes_of(1, WireDtype.INT8_HADAMARD, 577) > wire.raw_nbytes_of(1, WireDtype.FP16, 577)
