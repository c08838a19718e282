"""The wire formats (``WireDtype``) and their registry, ``FORMATS``: one ``WireFormat`` entry per
format with its fidelity class, the row widths it suits, and its byte layouts for activations and
for head-KV blocks. Pure numpy, no network. Chunk framing is ``common.wire.chunks``, KV blocks
``common.wire.kvwire``; both look formats up here (``format_of``), as do negotiation (``suits``,
``common_formats``) and ``merkle.leaf_data`` (``leaf_tag``). Adding a format is adding its value
to ``WireDtype`` (mirroring ``tandem.v1.WireDtype``) and one entry to ``FORMATS``.

Activations ``h_k`` are float32 ``[T, H]``; KV blocks are canonical float32 ``[Lp, 2, Hkv, B, D]``
(K before V, keys after RoPE; ``common.wire.kvblocks``). All bytes are little-endian.

* ``FP32`` (lossless): the float32 bytes.
* ``FP16`` / ``BF16`` (half precision): element by element; bf16 rounds to nearest even and keeps
  NaN a NaN. Activations beyond fp16's range become inf; KV values saturate at its largest finite
  value, NaN and inf staying so (the cloud refuses them).
* ``INT8`` (8-bit), symmetric. Activations per token: ``scale_t = max|h_t| / 127`` as fp32 ``[T]``
  first, then ``q = round(h / scale_t)`` int8 ``[T, H]``; the error per element is at most
  ``scale_t / 2``. KV blocks per (layer, K/V, head, token) over the ``D`` channels of that head:
  fp16 scales ``[Lp, 2, Hkv, B]``, then int8 ``[Lp, 2, Hkv, B, D]``.
* ``INT8_HADAMARD`` (8-bit): every block of ``b`` channels of a row is first rotated by the
  orthonormal Hadamard matrix ``H_b`` (``quant.rotate``; ``H_b`` is its own inverse, so the cloud
  rotates back), then quantised symmetrically to int8 with fp16 scales ``max|y| / 127``.
  Activations: ``b = hadamard_block(H)`` (at most ``HADAMARD_BLOCK``), a scale per (token, block),
  ``[T, H / b]`` first, then int8 ``[T, H]``. KV blocks: ``b = hadamard_block(D, KV_HADAMARD_MAX)``
  (the whole head for ``D`` a power of two) and ``INT8``'s layout and size. The rotation spreads a
  row's few huge channels (SmolLM2's residual stream after layer 4 has channels 30-600x its median;
  keys have outlier channels after RoPE) over the block, so the step follows the block's RMS
  instead of its largest channel: on the fidelity set, greedy output agrees with fp32 on 98.3% of
  prompts where per-token int8 agrees on 30% and per-32-channel int8 on 70% (incoherence
  processing: QuaRot, Ashkboos et al., arXiv:2404.00456, sections 3 and 4; QuIP#, Tseng et al.,
  arXiv:2402.04396). A block holding NaN or inf gets a NaN scale, so it decodes to NaN (refused by
  the cloud) and not to numbers. It suits rows whose rotation block has at least
  ``MIN_HADAMARD_BLOCK`` channels.
* ``INT4`` (4-bit). Activations: symmetric per group of ``INT4_GROUP`` channels of a token,
  ``scale = max|h_g| / 7`` as fp16 ``[T, ceil(H / 32)]`` first, then ``q`` in ``[-7, 7]`` two per
  byte (low nibble first, each token's row padded to whole bytes). KV blocks: asymmetric after KIVI
  (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML 2024,
  arXiv:2402.02750): keys per *channel* (their outliers sit in fixed channels), values per
  *token*; each group stores ``min`` and ``scale = (max - min) / 15`` as fp16 and
  ``q = round((x - min) / scale)`` in ``[0, 15]``. Layout: key ``(scale, min)`` ``[2, Lp, Hkv, D]``,
  value ``(scale, min)`` ``[2, Lp, Hkv, B]`` (fp16), then ``q`` of ``[Lp, 2, Hkv, B, D]`` two per
  byte (low nibble first, ``D`` rows padded to whole bytes).
* ``INT4_HADAMARD`` (4-bit): ``INT8_HADAMARD``'s rotation, then symmetric int4 with one fp16 scale
  ``max|y| / 7`` per (row, rotation block), ``q`` in ``[-7, 7]`` two per byte (low nibble first).
  Activations: ``b = hadamard_block(H)``, scales ``[T, H / b]`` first, then ``q`` of ``[T, H]``.
  KV blocks: ``b = hadamard_block(D, KV_HADAMARD_MAX)``, scales ``[Lp, 2, Hkv, B, D / b]`` first,
  then ``q`` of ``[Lp, 2, Hkv, B, D]``. At 4 bits the rotation is what makes per-token scales
  usable: QuaRot quantises activations and KV caches to 4 bits per token after exactly this kind
  of rotation (Ashkboos et al., arXiv:2404.00456, section 4). The scales are part of the bytes,
  so a KV leaf commits to them. It suits the widths ``INT8_HADAMARD`` suits.
"""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Generic, TypeVar

import numpy as np

from tandem.common.protocol.errors import InvalidRequest
from tandem.common.protocol.params import WireDtype
from tandem.common.wire.quant import (
    FP16_MAX,
    bf16_bits,
    dequantize_rotated_int8,
    hadamard_block,
    pack_int4,
    quantize,
    quantize_rotated,
    quantize_rotated_int8,
    safe_scale,
    unpack_int4,
)


class Fidelity(enum.IntEnum):
    """How faithfully a format carries float32 values, most faithful first (``a < b``: ``a`` loses
    less). Which formats a cloud allows is measured (``tandem-bench fidelity``); this is the class."""

    LOSSLESS = 0  # bit-exact float32
    HALF = 1  # 16-bit floats
    INT8 = 2  # 8-bit integers with per-row or per-block scales
    INT4 = 3  # 4-bit integers with per-group scales


TokensShape = tuple[int, int]  # activations: (T, H)
BlockShape = tuple[int, int, int, int, int]  # a KV block: (Lp, 2, Hkv, B, D)
S = TypeVar("S", bound=tuple[int, ...], contravariant=True)  # a layout of any shape serves one of a given shape

INT4_GROUP = 32  # channels per int4 scale (activations)
KV_HADAMARD_MAX = 256  # largest rotation block over a head's D channels (KV blocks)
MIN_HADAMARD_BLOCK = 4  # below it an fp16 scale per block of int8 costs as much as fp16 itself


@dataclass(frozen=True)
class Layout(Generic[S]):
    """One kind of tensor in one format. Callers (``wire``, ``kvwire``) check the tensor's shape
    and dtype and the byte count before calling ``encode`` or ``decode``.

    ``nbytes(shape)``: bytes of a tensor of ``shape`` (before any codec). ``encode(x)``: float32
    ``x`` -> exactly ``nbytes(x.shape)`` bytes. ``decode(raw, shape)``: those bytes -> float32
    ``shape``, a new array."""

    nbytes: Callable[[S], int]
    encode: Callable[[np.ndarray], bytes]
    decode: Callable[[bytes, S], np.ndarray]


def _any_width(channels: int) -> bool:
    return True


@dataclass(frozen=True, kw_only=True)
class WireFormat:
    """One wire format (see the module doc for each): its enum value, fidelity class, byte layouts
    of activations ``[T, H]`` and of KV blocks ``[Lp, 2, Hkv, B, D]``, the row widths it suits
    (``suits(channels)``, channels being ``H`` for activations and ``D`` for KV blocks: a format
    that does not suit the model is not negotiated), and whether a KV leaf names it."""

    dtype: WireDtype
    fidelity: Fidelity
    activations: Layout[TokensShape]
    kv: Layout[BlockShape]
    suits: Callable[[int], bool] = _any_width
    tagged_leaf: bool = True  # False: its KV leaves carry no format byte (``leaf_tag``)

    @property
    def name(self) -> str:
        """The enum name (``INT8_HADAMARD``), as configs and messages spell the format."""
        return self.dtype.name

    @property
    def leaf_tag(self) -> bytes:
        """What a KV block's Merkle leaf carries to name the format (``merkle.leaf_data``): its
        value as one byte, or nothing where ``tagged_leaf`` is False."""
        return struct.pack("<B", self.dtype) if self.tagged_leaf else b""


def _rotation_fits(channels: int) -> bool:
    """A rotation block of at least ``MIN_HADAMARD_BLOCK`` channels: for an odd width it would be one
    channel, each with its own fp16 scale (larger than fp16, and nothing rotated). Real models'
    widths are multiples of 64."""
    return hadamard_block(channels) >= MIN_HADAMARD_BLOCK


# --- element-wise formats: the same for activations and KV blocks, except fp16's saturation


def _fp32_nbytes(shape: tuple[int, ...]) -> int:
    return 4 * math.prod(shape)


def _half_nbytes(shape: tuple[int, ...]) -> int:
    return 2 * math.prod(shape)


def _fp32_encode(x: np.ndarray) -> bytes:
    return np.ascontiguousarray(x, dtype="<f4").tobytes()


def _fp32_decode(raw: bytes, shape: tuple[int, ...]) -> np.ndarray:
    return np.frombuffer(raw, "<f4").reshape(shape).copy()


def _act_fp16_encode(h: np.ndarray) -> bytes:
    return h.astype("<f2").tobytes()


def _kv_fp16_encode(x: np.ndarray) -> bytes:  # finite values saturate; NaN and inf stay so
    return np.where(np.isfinite(x), np.clip(x, -FP16_MAX, FP16_MAX), x).astype("<f2").tobytes()


def _fp16_decode(raw: bytes, shape: tuple[int, ...]) -> np.ndarray:
    return np.frombuffer(raw, "<f2").reshape(shape).astype(np.float32)


def _bf16_encode(x: np.ndarray) -> bytes:
    return bf16_bits(x).tobytes()


def _bf16_decode(raw: bytes, shape: tuple[int, ...]) -> np.ndarray:
    return (np.frombuffer(raw, "<u2").astype("<u4") << 16).view("<f4").reshape(shape).copy()


# --- activations, float32 [T, H]


def _act_int8_nbytes(shape: TokensShape) -> int:
    return shape[0] * (shape[1] + 4)


def _act_int8_encode(h: np.ndarray) -> bytes:
    scale = np.maximum(np.abs(h).max(axis=1), 1e-30).astype("<f4") / 127.0  # [T]
    q = np.clip(np.rint(h / scale[:, None]), -127, 127).astype(np.int8)
    return scale.tobytes() + q.tobytes()


def _act_int8_decode(raw: bytes, shape: TokensShape) -> np.ndarray:
    t, hidden = shape
    scale = np.frombuffer(raw[: 4 * t], "<f4")
    q = np.frombuffer(raw[4 * t :], np.int8).reshape(t, hidden)
    return q.astype(np.float32) * scale[:, None]


def _act_int4_nbytes(shape: TokensShape) -> int:
    t, hidden = shape
    return t * (2 * -(-hidden // INT4_GROUP) + (hidden + 1) // 2)


def _act_int4_encode(h: np.ndarray) -> bytes:
    t, hidden = h.shape
    g = -(-hidden // INT4_GROUP)
    padded = np.zeros((t, g * INT4_GROUP), np.float32)
    padded[:, :hidden] = h
    groups = padded.reshape(t, g, INT4_GROUP)
    s16, s = safe_scale(np.abs(groups).max(axis=2), 7)  # [T, G]
    q = quantize(groups, s[:, :, None], -7, 7).reshape(t, -1)[:, :hidden]
    return s16.tobytes() + pack_int4(q)


def _act_int4_decode(raw: bytes, shape: TokensShape) -> np.ndarray:
    t, hidden = shape
    g = -(-hidden // INT4_GROUP)
    s = np.frombuffer(raw[: 2 * g * t], "<f2").astype(np.float32).reshape(t, g)
    q4 = unpack_int4(raw[2 * g * t :], (t, hidden)).astype(np.float32)
    return q4 * np.repeat(s, INT4_GROUP, axis=1)[:, :hidden]


def _act_int8h_nbytes(shape: TokensShape) -> int:
    t, hidden = shape
    return t * (hidden + 2 * (hidden // hadamard_block(hidden)))


def _act_int8h_encode(h: np.ndarray) -> bytes:
    scales, q8 = quantize_rotated_int8(h, hadamard_block(h.shape[1]), 1)
    return scales + q8


def _act_int8h_decode(raw: bytes, shape: TokensShape) -> np.ndarray:
    t, hidden = shape
    b = hadamard_block(hidden)
    ns = t * (hidden // b)
    blk_scales = np.frombuffer(raw[: 2 * ns], "<f2").astype(np.float32).reshape(t, hidden // b, 1)
    q8 = np.frombuffer(raw[2 * ns :], np.int8).reshape(t, hidden)
    return dequantize_rotated_int8(blk_scales, q8, b)


# --- KV blocks, float32 [Lp, 2, Hkv, B, D] (kvwire passes them C-contiguous, under np.errstate)


def _kv_int8_nbytes(shape: BlockShape) -> int:
    lp, _, hkv, b, d = shape
    return lp * 2 * hkv * b * d + 2 * lp * 2 * hkv * b


def _kv_int8_encode(x: np.ndarray) -> bytes:
    s16, s = safe_scale(np.abs(x).max(axis=4), 127)  # [Lp, 2, Hkv, B]
    return s16.tobytes() + quantize(x, s[..., None], -127, 127).tobytes()


def _kv_int8_decode(raw: bytes, shape: BlockShape) -> np.ndarray:
    ns = math.prod(shape[:4])
    s = np.frombuffer(raw[: 2 * ns], "<f2").astype(np.float32).reshape(shape[:4])
    return np.frombuffer(raw[2 * ns :], np.int8).reshape(shape).astype(np.float32) * s[..., None]


def _kv_int8h_encode(x: np.ndarray) -> bytes:
    scales, q8 = quantize_rotated_int8(x, hadamard_block(x.shape[4], KV_HADAMARD_MAX), 2)
    return scales + q8


def _kv_int8h_decode(raw: bytes, shape: BlockShape) -> np.ndarray:
    ns = math.prod(shape[:4])
    s = np.frombuffer(raw[: 2 * ns], "<f2").astype(np.float32).reshape(*shape[:4], 1, 1)
    q = np.frombuffer(raw[2 * ns :], np.int8).reshape(shape)
    return dequantize_rotated_int8(s, q, hadamard_block(shape[4], KV_HADAMARD_MAX))


def _kv_int4_nbytes(shape: BlockShape) -> int:
    lp, _, hkv, b, d = shape
    return 2 * 2 * lp * hkv * (d + b) + lp * 2 * hkv * b * ((d + 1) // 2)


def _kv_int4_encode(x: np.ndarray) -> bytes:
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


def _kv_int4_decode(raw: bytes, shape: BlockShape) -> np.ndarray:
    lp, _, hkv, b, d = shape
    nk, nv = lp * hkv * d, lp * hkv * b
    f16 = np.frombuffer(raw[: 4 * (nk + nv)], "<f2").astype(np.float32)
    ks, k_lo = f16[:nk].reshape(lp, hkv, d), f16[nk : 2 * nk].reshape(lp, hkv, d)
    vs, v_lo = f16[2 * nk : 2 * nk + nv].reshape(lp, hkv, b), f16[2 * nk + nv :].reshape(lp, hkv, b)
    q = unpack_int4(raw[4 * (nk + nv) :], shape, signed=False).astype(np.float32)
    out = np.empty(shape, np.float32)
    out[:, 0] = q[:, 0] * ks[:, :, None, :] + k_lo[:, :, None, :]
    out[:, 1] = q[:, 1] * vs[..., None] + v_lo[..., None]
    return out


# --- INT4_HADAMARD: activations float32 [T, H] and KV blocks [Lp, 2, Hkv, B, D], rows of n channels


def _rot4_nbytes(rows: int, n: int, b: int) -> int:
    return rows * (2 * (n // b) + (n + 1) // 2)


def _rot4_encode(x: np.ndarray, b: int) -> bytes:
    scales, q = quantize_rotated(x, b, 1, 7)
    return scales + pack_int4(q)


def _rot4_decode(raw: bytes, shape: tuple[int, ...], b: int) -> np.ndarray:
    rows, n = math.prod(shape[:-1]), shape[-1]
    ns = rows * (n // b)
    s = np.frombuffer(raw[: 2 * ns], "<f2").astype(np.float32).reshape(*shape[:-1], n // b, 1)
    q = unpack_int4(raw[2 * ns :], shape)
    return dequantize_rotated_int8(s, q, b)


def _act_int4h_nbytes(shape: TokensShape) -> int:
    return _rot4_nbytes(shape[0], shape[1], hadamard_block(shape[1]))


def _kv_int4h_nbytes(shape: BlockShape) -> int:
    return _rot4_nbytes(math.prod(shape[:4]), shape[4], hadamard_block(shape[4], KV_HADAMARD_MAX))


_ACT_INT4H = Layout(
    _act_int4h_nbytes,
    lambda h: _rot4_encode(h, hadamard_block(h.shape[1])),
    lambda raw, shape: _rot4_decode(raw, shape, hadamard_block(shape[1])),
)
_KV_INT4H = Layout(
    _kv_int4h_nbytes,
    lambda x: _rot4_encode(x, hadamard_block(x.shape[4], KV_HADAMARD_MAX)),
    lambda raw, shape: _rot4_decode(raw, shape, hadamard_block(shape[4], KV_HADAMARD_MAX)),
)


def registry(*formats: WireFormat) -> Mapping[WireDtype, WireFormat]:
    """A read-only index of ``formats`` by ``dtype``, in ``WireDtype`` order.

    Raises:
        ValueError: two entries for one ``WireDtype``, or a ``WireDtype`` without one.
    """
    by_dtype: dict[WireDtype, WireFormat] = {}
    for f in formats:
        if f.dtype in by_dtype:
            raise ValueError(f"two wire formats for {f.name}")
        by_dtype[f.dtype] = f
    missing = [d.name for d in WireDtype if d not in by_dtype]
    if missing:
        raise ValueError(f"no wire format for {missing}")
    return MappingProxyType({d: by_dtype[d] for d in WireDtype})


_FP32 = Layout(_fp32_nbytes, _fp32_encode, _fp32_decode)
_BF16 = Layout(_half_nbytes, _bf16_encode, _bf16_decode)

FORMATS: Mapping[WireDtype, WireFormat] = registry(
    # fp32 leaves keep the layout they had before KV formats existed (``merkle.leaf_data``)
    WireFormat(dtype=WireDtype.FP32, fidelity=Fidelity.LOSSLESS, activations=_FP32, kv=_FP32, tagged_leaf=False),
    WireFormat(
        dtype=WireDtype.FP16,
        fidelity=Fidelity.HALF,
        activations=Layout(_half_nbytes, _act_fp16_encode, _fp16_decode),
        kv=Layout(_half_nbytes, _kv_fp16_encode, _fp16_decode),
    ),
    WireFormat(dtype=WireDtype.BF16, fidelity=Fidelity.HALF, activations=_BF16, kv=_BF16),
    WireFormat(
        dtype=WireDtype.INT8,
        fidelity=Fidelity.INT8,
        activations=Layout(_act_int8_nbytes, _act_int8_encode, _act_int8_decode),
        kv=Layout(_kv_int8_nbytes, _kv_int8_encode, _kv_int8_decode),
    ),
    WireFormat(
        dtype=WireDtype.INT4,
        fidelity=Fidelity.INT4,
        activations=Layout(_act_int4_nbytes, _act_int4_encode, _act_int4_decode),
        kv=Layout(_kv_int4_nbytes, _kv_int4_encode, _kv_int4_decode),
    ),
    WireFormat(
        dtype=WireDtype.INT8_HADAMARD,
        fidelity=Fidelity.INT8,
        activations=Layout(_act_int8h_nbytes, _act_int8h_encode, _act_int8h_decode),
        kv=Layout(_kv_int8_nbytes, _kv_int8h_encode, _kv_int8h_decode),
        suits=_rotation_fits,
    ),
    WireFormat(
        dtype=WireDtype.INT4_HADAMARD,
        fidelity=Fidelity.INT4,
        activations=_ACT_INT4H,
        kv=_KV_INT4H,
        suits=_rotation_fits,
    ),
)
"""Every wire format by its ``WireDtype``."""


def format_of(dtype: int) -> WireFormat:
    """The ``FORMATS`` entry of ``dtype`` (a ``WireDtype`` or its value).

    Raises:
        InvalidRequest: ``dtype`` is not a ``WireDtype`` value.
    """
    try:
        return FORMATS[WireDtype(dtype)]
    except ValueError:
        raise InvalidRequest(f"unknown wire dtype {dtype!r}") from None


F = TypeVar("F", bound=Hashable)


def common_formats(
    offered: Iterable[F], accepted: Iterable[F], suits: Callable[[F], bool] = lambda _: True
) -> tuple[F, ...]:
    """What both sides can use: the items of ``offered`` (the edge's, in its order of preference)
    that ``accepted`` (the cloud's limits) holds and ``suits`` keeps, each once, in ``offered``'s
    order. For wire formats (``suits``: e.g. ``lambda d: FORMATS[d].suits(hidden_size)``) and for
    codecs alike; empty when nothing is common."""
    allowed = set(accepted)
    return tuple(dict.fromkeys(x for x in offered if x in allowed and suits(x)))
