"""Numeric building blocks of the wire formats (``common.wire.formats``): bfloat16 bits, fp16 scales
saturated to fp16's range, symmetric rounding to integers, two int4 values per byte, and the
orthonormal Hadamard rotation over blocks of channels. Pure numpy, no network; the formats that
combine them are ``common.wire.formats``.
"""

from __future__ import annotations

import numpy as np

HADAMARD_BLOCK = 64  # most channels per rotation block and int8 scale (activations)


def hadamard_block(n: int, cap: int = HADAMARD_BLOCK) -> int:
    """The rotation block of ``n`` channels: the largest power of two that divides ``n``, at most ``cap``."""
    return min(n & -n, cap)


_HADAMARD: dict[int, np.ndarray] = {}


def hadamard(n: int) -> np.ndarray:
    """The orthonormal Sylvester Hadamard matrix, float32 ``[n, n]`` for ``n`` a power of two:
    ``H_1 = [1]``, ``H_2m = [[H_m, H_m], [H_m, -H_m]]``, scaled by ``1 / sqrt(n)`` (Sylvester,
    "Thoughts on inverse orthogonal matrices...", Phil. Mag. 1867). Symmetric and orthogonal,
    so it is its own inverse. Cached; do not modify the result.

    Raises:
        ValueError: ``n`` is not a power of two.
    """
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power of two, got {n}")
    if n not in _HADAMARD:
        m = np.ones((1, 1), np.float64)
        while m.shape[0] < n:
            m = np.block([[m, m], [m, -m]])
        _HADAMARD[n] = (m / np.sqrt(n)).astype(np.float32)
    return _HADAMARD[n]


def rotate(x: np.ndarray, b: int) -> np.ndarray:
    """``x`` float32 ``[..., n]`` with every block of ``b`` consecutive channels of the last axis
    multiplied by ``hadamard(b)``; ``rotate(rotate(x, b), b) == x`` up to float32 rounding.

    Raises:
        ValueError: ``b`` does not divide ``n`` or is not a power of two.
    """
    n = x.shape[-1]
    if n % b:
        raise ValueError(f"rotation block {b} does not divide {n} channels")
    return (x.reshape(*x.shape[:-1], n // b, b) @ hadamard(b)).reshape(x.shape)


def quantize_rotated(x: np.ndarray, b: int, scale_axes: int, levels: int = 127) -> tuple[bytes, np.ndarray]:
    """``rotate(x, b)`` quantised symmetrically to integers in ``[-levels, levels]`` with one fp16
    scale ``max|y| / levels`` per group of the last ``scale_axes`` axes of ``[..., n // b, b]``
    (1: per block; 2: per row of ``n``): ``(scales as bytes, q)``, ``q`` int8 of ``x``'s shape.
    A group with NaN or inf gets a NaN scale (it decodes to NaN, never to numbers)."""
    with np.errstate(invalid="ignore", over="ignore"):
        y = rotate(np.ascontiguousarray(x, np.float32), b)
        g = y.reshape(*y.shape[:-1], y.shape[-1] // b, b)
        axes = (-1,) if scale_axes == 1 else (-2, -1)
        amax = np.abs(g).max(axis=axes, keepdims=True)
        s16, s = safe_scale(amax, levels)
        s16 = np.where(np.isfinite(amax), s16, np.float16(np.nan)).astype("<f2")
        q = quantize(g, s, -levels, levels)
    return s16.tobytes(), q.reshape(x.shape)


def quantize_rotated_int8(x: np.ndarray, b: int, scale_axes: int) -> tuple[bytes, bytes]:
    """``quantize_rotated`` to int8 (``levels`` 127): ``(scales, int8)`` bytes."""
    scales, q = quantize_rotated(x, b, scale_axes)
    return scales, q.tobytes()


def dequantize_rotated_int8(scales: np.ndarray, q: np.ndarray, b: int) -> np.ndarray:
    """The inverse of ``quantize_rotated`` (any ``levels``): ``scales`` float32 broadcastable to
    ``q.reshape(..., n // b, b)``, ``q`` int8 ``[..., n]`` -> float32 ``[..., n]``."""
    g = q.reshape(*q.shape[:-1], q.shape[-1] // b, b).astype(np.float32) * scales
    with np.errstate(invalid="ignore", over="ignore"):
        return rotate(g.reshape(q.shape), b)


def pack_int4(q: np.ndarray) -> bytes:
    """int8 values in ``[-8, 7]``, shape ``[..., n]`` -> two per byte (low nibble first), each
    last-axis row padded to whole bytes."""
    if q.shape[-1] % 2:
        q = np.concatenate([q, np.zeros((*q.shape[:-1], 1), q.dtype)], axis=-1)
    u = (q.astype(np.int16) & 0x0F).astype(np.uint8)
    return np.ascontiguousarray(u[..., 0::2] | (u[..., 1::2] << 4)).tobytes()


def unpack_int4(raw: bytes, shape: tuple[int, ...], signed: bool = True) -> np.ndarray:
    """The inverse of ``pack_int4``: int8 ``shape`` (signed: ``[-8, 7]``, else ``[0, 15]``)."""
    n = shape[-1]
    u = np.frombuffer(raw, np.uint8).reshape(*shape[:-1], (n + 1) // 2)
    out = np.empty((*shape[:-1], 2 * u.shape[-1]), np.int8)
    out[..., 0::2] = (u & 0x0F).astype(np.int8)
    out[..., 1::2] = (u >> 4).astype(np.int8)
    if signed:
        out -= (out > 7).astype(np.int8) * 16
    return out[..., :n]


FP16_MAX = 65504.0  # largest finite float16


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (``<u2``), rounded to nearest even; NaN stays NaN (some
    NaN patterns would wrap around to 0 in 32-bit arithmetic)."""
    u = np.ascontiguousarray(x, dtype="<f4").view("<u4").astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded).astype("<u2")


def safe_scale(amax: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """``(scale as fp16, the same as float32)`` for ``amax / levels``, saturated to fp16's range;
    a scale that rounds to 0 encodes zeros."""
    s16 = np.minimum(amax / levels, FP16_MAX).astype("<f2")
    return s16, s16.astype(np.float32)


def quantize(x: np.ndarray, scale: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """``round(x / scale)`` clipped to ``[lo, hi]`` as int8 (0 where ``scale`` is 0)."""
    with np.errstate(invalid="ignore", over="ignore"):
        q = np.rint(x / np.where(scale > 0, scale, 1.0))
        return np.clip(np.where(scale > 0, q, 0), lo, hi).astype(np.int8)
