"""Wire formats of one head-KV block: canonical float32 ``[Lp, 2, Hkv, B, D]`` (K before V,
keys after RoPE; ``common.kvblocks``) to bytes and back. Pure numpy, no network.

Formats (``WireDtype``), all little-endian:

* ``FP32``: the canonical bytes (exact).
* ``FP16`` / ``BF16``: element-wise (fp16 saturates at its largest finite value; bf16 rounds
  to nearest even, as ``common.wire`` does).
* ``INT8``: symmetric, one fp16 scale per (layer, K/V, head, token) over the ``D`` channels of
  that head: ``scale = max|x| / 127``; layout: scales ``[Lp, 2, Hkv, B]`` then int8 ``[Lp, 2, Hkv, B, D]``.
* ``INT8_HADAMARD``: ``INT8``'s layout and size, but each ``D``-channel row is first rotated by
  the orthonormal Hadamard matrix of ``b = hadamard_block(D, 256)`` channels (``common.wire.rotate``;
  the whole head for ``D`` a power of two), so a key's outlier channels after RoPE do not set
  the step of the whole row (QuaRot, Ashkboos et al., arXiv:2404.00456, section 4, rotates keys and
  values the same way). A row holding NaN or inf gets a NaN scale.
* ``INT4``: asymmetric 4-bit after KIVI (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit
  Quantization for KV Cache", ICML 2024, arXiv:2402.02750): keys per *channel* (their outliers
  sit in fixed channels), values per *token*; each group stores ``min`` and
  ``scale = (max - min) / 15`` as fp16 and ``q = round((x - min) / scale)`` in ``[0, 15]``.
  Layout: key ``(scale, min)`` ``[2, Lp, Hkv, D]``, value ``(scale, min)`` ``[2, Lp, Hkv, B]``
  (fp16), then ``q`` of ``[Lp, 2, Hkv, B, D]`` two per byte (low nibble first, ``D`` rows padded
  to whole bytes).

The Merkle leaf of a block commits to these bytes (``merkle.leaf_data`` with the dtype), i.e. to
exactly what the cloud decodes, so integrity covers the block whatever its format; the cloud
stores the decoded float32 (its engines' KV dtype is converted by the connector).
"""

from __future__ import annotations

import numpy as np

from tandem.common.errors import InvalidRequest
from tandem.common.wire import (
    FP16_MAX,
    WireDtype,
    bf16_bits,
    dequantize_rotated_int8,
    hadamard_block,
    pack_int4,
    quantize,
    quantize_rotated_int8,
    safe_scale,
    unpack_int4,
)

KV_HADAMARD_MAX = 256  # largest rotation block over a head's D channels (INT8_HADAMARD)


def kv_raw_nbytes(shape: tuple[int, int, int, int, int], dtype: WireDtype) -> int:
    """Bytes of one block of ``shape = (Lp, 2, Hkv, B, D)`` in ``dtype`` (before any codec).

    Raises:
        InvalidRequest: ``dtype`` is not a ``WireDtype`` or the shape is not ``(Lp, 2, Hkv, B, D)``.
    """
    lp, two, hkv, b, d = shape
    if two != 2 or min(shape) < 1:
        raise InvalidRequest(f"KV block shape {shape} is not (Lp, 2, Hkv, B, D)")
    n = lp * 2 * hkv * b * d
    try:
        dtype = WireDtype(dtype)
    except ValueError:
        raise InvalidRequest(f"unknown wire dtype {dtype!r}") from None
    if dtype == WireDtype.FP32:
        return 4 * n
    if dtype in (WireDtype.FP16, WireDtype.BF16):
        return 2 * n
    if dtype in (WireDtype.INT8, WireDtype.INT8_HADAMARD):
        return n + 2 * lp * 2 * hkv * b
    return 2 * 2 * lp * hkv * (d + b) + lp * 2 * hkv * b * ((d + 1) // 2)


def encode_kv(block: np.ndarray, dtype: WireDtype) -> bytes:
    """float32 ``[Lp, 2, Hkv, B, D]`` -> its bytes in ``dtype`` (see module doc); NaN and inf are
    carried, not warned about (the cloud refuses them).

    Raises:
        InvalidRequest: ``block`` is not a 5-D float32 array with 2 on axis 1.
    """
    with np.errstate(invalid="ignore", over="ignore"):
        return _encode_kv(block, dtype)


def _encode_kv(block: np.ndarray, dtype: WireDtype) -> bytes:
    """float32 ``[Lp, 2, Hkv, B, D]`` -> its bytes in ``dtype`` (see module doc).

    Raises:
        InvalidRequest: ``block`` is not a 5-D float32 array with 2 on axis 1.
    """
    if block.ndim != 5 or block.shape[1] != 2 or block.dtype != np.float32:
        raise InvalidRequest(f"KV block must be float32 [Lp, 2, Hkv, B, D], got {block.dtype} {block.shape}")
    x = np.ascontiguousarray(block, dtype="<f4")
    if dtype == WireDtype.FP32:
        return x.tobytes()
    if dtype == WireDtype.FP16:  # finite values saturate; NaN and inf stay so (the cloud refuses them)
        return np.where(np.isfinite(x), np.clip(x, -FP16_MAX, FP16_MAX), x).astype("<f2").tobytes()
    if dtype == WireDtype.BF16:
        return bf16_bits(x).tobytes()
    if dtype == WireDtype.INT8:
        s16, s = safe_scale(np.abs(x).max(axis=4), 127)  # [Lp, 2, Hkv, B]
        return s16.tobytes() + quantize(x, s[..., None], -127, 127).tobytes()
    if dtype == WireDtype.INT8_HADAMARD:
        scales, q8 = quantize_rotated_int8(x, hadamard_block(x.shape[4], KV_HADAMARD_MAX), 2)
        return scales + q8
    if dtype != WireDtype.INT4:
        raise InvalidRequest(f"unknown wire dtype {dtype!r}")
    k, v = x[:, 0], x[:, 1]  # [Lp, Hkv, B, D]
    k_lo, k_hi = k.min(axis=2), k.max(axis=2)  # per channel: [Lp, Hkv, D]
    v_lo, v_hi = v.min(axis=3), v.max(axis=3)  # per token: [Lp, Hkv, B]
    ks16, ks = safe_scale(k_hi - k_lo, 15)
    vs16, vs = safe_scale(v_hi - v_lo, 15)
    k_lo16, v_lo16 = (np.clip(a, -FP16_MAX, FP16_MAX).astype("<f2") for a in (k_lo, v_lo))  # no inf minimum
    qk = quantize(k - k_lo16.astype(np.float32)[:, :, None, :], ks[:, :, None, :], 0, 15)
    qv = quantize(v - v_lo16.astype(np.float32)[..., None], vs[..., None], 0, 15)
    q = np.stack([qk, qv], axis=1)  # [Lp, 2, Hkv, B, D]
    return b"".join(a.tobytes() for a in (ks16, k_lo16, vs16, v_lo16)) + pack_int4(q)


def decode_kv(raw: bytes, dtype: WireDtype, shape: tuple[int, int, int, int, int]) -> np.ndarray:
    """Bytes of one block in ``dtype`` -> float32 ``shape = (Lp, 2, Hkv, B, D)`` (NaN and inf
    decode as such, without warnings: the caller checks the values).

    Raises:
        InvalidRequest: ``len(raw)`` is not ``kv_raw_nbytes(shape, dtype)``, or an unknown dtype.
    """
    with np.errstate(invalid="ignore", over="ignore"):
        return _decode_kv(raw, dtype, shape)


def _decode_kv(raw: bytes, dtype: WireDtype, shape: tuple[int, int, int, int, int]) -> np.ndarray:
    """Bytes of one block in ``dtype`` -> float32 ``shape = (Lp, 2, Hkv, B, D)``.

    Raises:
        InvalidRequest: ``len(raw)`` is not ``kv_raw_nbytes(shape, dtype)``, or an unknown dtype.
    """
    want = kv_raw_nbytes(shape, dtype)
    if len(raw) != want:
        raise InvalidRequest(f"KV block holds {len(raw)} bytes, expected {want} for {shape} in {dtype.name}")
    lp, _, hkv, b, d = shape
    if dtype == WireDtype.FP32:
        return np.frombuffer(raw, "<f4").reshape(shape).copy()
    if dtype == WireDtype.FP16:
        return np.frombuffer(raw, "<f2").reshape(shape).astype(np.float32)
    if dtype == WireDtype.BF16:
        return (np.frombuffer(raw, "<u2").astype("<u4") << 16).view("<f4").reshape(shape).copy()
    if dtype == WireDtype.INT8:
        ns = lp * 2 * hkv * b
        s = np.frombuffer(raw[: 2 * ns], "<f2").astype(np.float32).reshape(shape[:4])
        return np.frombuffer(raw[2 * ns :], np.int8).reshape(shape).astype(np.float32) * s[..., None]
    if dtype == WireDtype.INT8_HADAMARD:
        ns = lp * 2 * hkv * b
        s = np.frombuffer(raw[: 2 * ns], "<f2").astype(np.float32).reshape(*shape[:4], 1, 1)
        q = np.frombuffer(raw[2 * ns :], np.int8).reshape(shape)
        return dequantize_rotated_int8(s, q, hadamard_block(d, KV_HADAMARD_MAX))
    nk, nv = lp * hkv * d, lp * hkv * b
    f16 = np.frombuffer(raw[: 4 * (nk + nv)], "<f2").astype(np.float32)
    ks, k_lo = f16[:nk].reshape(lp, hkv, d), f16[nk : 2 * nk].reshape(lp, hkv, d)
    vs, v_lo = f16[2 * nk : 2 * nk + nv].reshape(lp, hkv, b), f16[2 * nk + nv :].reshape(lp, hkv, b)
    q = unpack_int4(raw[4 * (nk + nv) :], shape, signed=False).astype(np.float32)
    out = np.empty(shape, np.float32)
    out[:, 0] = q[:, 0] * ks[:, :, None, :] + k_lo[:, :, None, :]
    out[:, 1] = q[:, 1] * vs[..., None] + v_lo[..., None]
    return out
