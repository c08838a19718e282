"""Activation chunk framing: pure ``split`` and ``combine`` functions, no network.

A chunk carries activations ``h_k`` of ``num_tokens`` consecutive prompt tokens
``[token_offset, token_offset + num_tokens)``, encoded as:

    payload = codec( wire_dtype bytes of [num_tokens, H] )   # int8: fp32 scales [num_tokens] first
    crc32c  = CRC32C(payload)                               # over the bytes as sent

CRC32C is the Castagnoli polynomial (RFC 3720, section 12.1), computed by the
``google-crc32c`` library (hardware-accelerated where the CPU has SSE4.2/ARMv8 CRC).

Int8 is symmetric per-token quantisation: ``scale_t = max|h_t| / 127``,
``q = round(h / scale_t)``; the reconstruction error per element is at most ``scale_t / 2``.
Int4 is symmetric per group of ``INT4_GROUP`` channels of a token: ``scale = max|h_g| / 7``
stored as fp16 (``[T, ceil(H / 32)]`` first), ``q`` in ``[-7, 7]`` two per byte (low nibble
first, each token's row padded to whole bytes). Int8-Hadamard first rotates each block of
``b = hadamard_block(H)`` (at most ``HADAMARD_BLOCK``) channels of a token by the orthonormal
Hadamard matrix ``H_b`` (``rotate``), then quantises symmetrically per (token, block):
``scale = max|y_blk| / 127`` as fp16 (``[T, H / b]`` first), then int8 ``[T, H]``; the cloud
rotates back (``H_b`` is its own inverse). The rotation spreads a token's few huge channels
(SmolLM2's residual stream after layer 4 has channels 30-600x its median) over the block, so the
step follows the block's RMS instead of its largest channel: on the fidelity set, greedy output
agrees with fp32 on 98.3% of prompts where per-token int8 agrees on 30% and per-32-channel int8 on
70% (incoherence processing: QuaRot, Ashkboos et al., arXiv:2404.00456, section 3; QuIP#,
Tseng et al., arXiv:2402.04396). A block holding NaN or inf gets a NaN scale, so it decodes to NaN
(refused by the cloud) and not to numbers. KV blocks have their own formats (``common.kvwire``).

Zstd payloads are exactly one complete zstd frame whose header declares the raw size
(``encode_payload`` always writes it). On arrival every size is checked against the
negotiated limits before anything is allocated or decompressed: ``raw_nbytes`` must equal
``raw_nbytes_of(num_tokens, dtype, H)``, the payload must be at most
``max_payload_bytes(raw_nbytes, codec)``, and ``decompress_exact`` refuses anything but one
frame of exactly ``raw_nbytes`` bytes (``CorruptPayload``, handled like a CRC failure).
Decompression is CPU work: async callers run ``decode_chunk`` / ``decode_payload`` in a
worker thread, off the event loop.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass

import google_crc32c
import numpy as np
import zstandard

from tandem.common.errors import ChecksumMismatch, CorruptPayload, InvalidRequest


class WireDtype(enum.IntEnum):
    """Mirrors ``tandem.v1.WireDtype``."""

    FP32 = 1
    FP16 = 2
    BF16 = 3
    INT8 = 4
    INT4 = 5
    INT8_HADAMARD = 6


class Codec(enum.IntEnum):
    """Mirrors ``tandem.v1.Codec``."""

    NONE = 1
    ZSTD = 2


def pb_name(v: WireDtype | Codec) -> str:
    """The ``tandem.v1`` enum value name (``WIRE_DTYPE_FP32``, ``CODEC_ZSTD``...) of a domain enum."""
    return ("WIRE_DTYPE_" if isinstance(v, WireDtype) else "CODEC_") + v.name


@dataclass(frozen=True)
class Chunk:
    """One framed activation chunk (see module doc)."""

    seq: int
    token_offset: int
    num_tokens: int
    wire_dtype: WireDtype
    codec: Codec
    raw_nbytes: int
    payload: bytes
    crc32c: int
    params_version: int = 0  # the link params it was made with


INT4_GROUP = 32  # channels per int4 scale (activations)
HADAMARD_BLOCK = 64  # most channels per rotation block and int8 scale (activations)


def hadamard_block(n: int, cap: int = HADAMARD_BLOCK) -> int:
    """The rotation block of ``n`` channels: the largest power of two that divides ``n``, at most ``cap``."""
    return min(n & -n, cap)


MIN_HADAMARD_BLOCK = 4  # below it an fp16 scale per block of int8 costs as much as fp16 itself


def suits(dtype: WireDtype, channels: int) -> bool:
    """Whether ``dtype`` makes sense for rows of ``channels`` values: ``INT8_HADAMARD`` needs a
    rotation block of at least ``MIN_HADAMARD_BLOCK`` channels (for an odd width it would be one
    channel, each with its own fp16 scale: larger than fp16, and nothing rotated); every other
    format suits any width. Real models' widths are multiples of 64."""
    return dtype != WireDtype.INT8_HADAMARD or hadamard_block(channels) >= MIN_HADAMARD_BLOCK


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


def quantize_rotated_int8(x: np.ndarray, b: int, scale_axes: int) -> tuple[bytes, bytes]:
    """``rotate(x, b)`` quantised to int8 with one fp16 scale per group of the last ``scale_axes``
    axes of ``[..., n // b, b]`` (1: per block; 2: per row of ``n``): ``(scales, int8)`` bytes.
    A group with NaN or inf gets a NaN scale (it decodes to NaN, never to numbers)."""
    with np.errstate(invalid="ignore", over="ignore"):
        y = rotate(np.ascontiguousarray(x, np.float32), b)
        g = y.reshape(*y.shape[:-1], y.shape[-1] // b, b)
        axes = (-1,) if scale_axes == 1 else (-2, -1)
        amax = np.abs(g).max(axis=axes, keepdims=True)
        s16, s = safe_scale(amax, 127)
        s16 = np.where(np.isfinite(amax), s16, np.float16(np.nan)).astype("<f2")
        q = quantize(g, s, -127, 127)
    return s16.tobytes(), q.tobytes()


def dequantize_rotated_int8(scales: np.ndarray, q: np.ndarray, b: int) -> np.ndarray:
    """The inverse of ``quantize_rotated_int8``: ``scales`` float32 broadcastable to
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


def crc32c(data: bytes) -> int:
    """CRC32C (Castagnoli) of ``data`` as an unsigned 32-bit int."""
    return int(google_crc32c.value(data))


def _bytes_per_token(dtype: WireDtype, hidden: int) -> int:
    return {
        WireDtype.FP32: 4 * hidden,
        WireDtype.FP16: 2 * hidden,
        WireDtype.BF16: 2 * hidden,
        WireDtype.INT8: hidden + 4,
        WireDtype.INT4: 2 * -(-hidden // INT4_GROUP) + (hidden + 1) // 2,
        WireDtype.INT8_HADAMARD: hidden + 2 * (hidden // hadamard_block(hidden)),
    }[dtype]


def raw_nbytes_of(num_tokens: int, dtype: WireDtype, hidden: int) -> int:
    """Size in bytes of the uncompressed wire bytes of ``num_tokens`` tokens x ``hidden`` in ``dtype``
    (int8 includes the fp32 per-token scales).

    Raises:
        InvalidRequest: ``num_tokens < 0``, ``hidden < 1`` or ``dtype`` not a ``WireDtype``.
    """
    if num_tokens < 0 or hidden < 1:
        raise InvalidRequest(f"num_tokens {num_tokens} and hidden {hidden} must be >= 0 and >= 1")
    try:
        dtype = WireDtype(dtype)
    except ValueError:
        raise InvalidRequest(f"unknown wire dtype {dtype!r}") from None
    return num_tokens * _bytes_per_token(dtype, hidden)


def max_payload_bytes(raw_nbytes: int, codec: Codec) -> int:
    """The largest legal payload, in bytes, for ``raw_nbytes`` raw bytes under ``codec``.

    ``NONE``: ``raw_nbytes`` itself. ``ZSTD``: zstd's worst-case compressed size of one frame
    (``ZSTD_COMPRESSBOUND`` from zstd.h, header included), which no frame made by
    ``encode_payload`` exceeds.

    Raises:
        InvalidRequest: ``raw_nbytes < 0`` or ``codec`` not a ``Codec``.
    """
    if raw_nbytes < 0:
        raise InvalidRequest(f"raw_nbytes {raw_nbytes} must be >= 0")
    try:
        codec = Codec(codec)
    except ValueError:
        raise InvalidRequest(f"unknown codec {codec!r}") from None
    if codec == Codec.NONE:
        return raw_nbytes
    n = raw_nbytes
    return n + (n >> 8) + (((128 << 10) - n) >> 11 if n < 128 << 10 else 0)


_ZSTD_MAGIC = 0xFD2FB528
_ZSTD_SKIPPABLE_MASK, _ZSTD_SKIPPABLE_MAGIC = 0xFFFFFFF0, 0x184D2A50
_ZSTD_BLOCK_MAX = 128 << 10  # Block_Maximum_Size (RFC 8878, 3.1.1.2.4)
_compressors = threading.local()  # ZstdCompressor objects are not thread-safe: one per thread and level


def encode_payload(raw: bytes, codec: Codec, level: int = 3) -> bytes:
    """Encode ``raw`` wire bytes for sending: ``raw`` itself for ``NONE``; for ``ZSTD``, one zstd
    frame at compression ``level`` whose header declares the content size (as ``decompress_exact``
    requires). The one compressor path for activation chunks (``split``) and KV blocks.

    Raises:
        InvalidRequest: ``codec`` not a ``Codec``.
        zstandard.ZstdError: ``level`` is not a valid zstd level.
    """
    try:
        codec = Codec(codec)
    except ValueError:
        raise InvalidRequest(f"unknown codec {codec!r}") from None
    if codec == Codec.NONE:
        return bytes(raw)
    cache: dict[int, zstandard.ZstdCompressor] = _compressors.__dict__.setdefault("by_level", {})
    cctx = cache.get(level)
    if cctx is None:
        cctx = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cctx.compress(raw)


def _describe_zstd_damage(payload: bytes, start: int, has_checksum: bool, max_blocks: int = 4096) -> str | None:
    """Why a zstd frame whose blocks begin at ``start`` is not the whole payload, found by walking
    its block headers (RFC 8878, 3.1.1.2) without decompressing: truncated, a reserved or oversized
    block, or what follows the frame. ``None`` when the walk finds nothing or gives up after
    ``max_blocks`` blocks (the walk runs only to explain an error, so it is kept cheap)."""
    n, pos = len(payload), start
    for _ in range(max_blocks):
        if pos + 3 > n:
            return f"zstd frame truncated: block header at byte {pos} of {n}"
        bh = payload[pos] | payload[pos + 1] << 8 | payload[pos + 2] << 16
        btype, bsize = (bh >> 1) & 3, bh >> 3
        if btype == 3:
            return f"zstd block at byte {pos} has the reserved block type"
        if bsize > _ZSTD_BLOCK_MAX:
            return f"zstd block at byte {pos} declares {bsize} bytes > {_ZSTD_BLOCK_MAX}"
        pos += 3 + (1 if btype == 1 else bsize)  # RLE: one byte; raw and compressed: bsize bytes
        if pos > n:
            return f"zstd frame truncated: a block ends at byte {pos}, the payload has {n}"
        if bh & 1:  # last block
            break
    else:
        return None
    pos += 4 if has_checksum else 0
    if pos > n:
        return f"zstd frame truncated: content checksum missing ({n} of {pos} bytes)"
    if pos == n:
        return None
    nxt = int.from_bytes(payload[pos : pos + 4], "little") if n - pos >= 4 else None
    if nxt == _ZSTD_MAGIC:
        what = "a second zstd frame follows"
    elif nxt is not None and nxt & _ZSTD_SKIPPABLE_MASK == _ZSTD_SKIPPABLE_MAGIC:
        what = "a skippable frame follows"
    else:
        what = f"{n - pos} trailing byte(s) follow"
    return f"zstd frame ends at byte {pos} of {n}: {what}"


def decompress_exact(payload: bytes, raw_nbytes: int) -> bytes:
    """Decompress a payload that must be exactly one complete zstd frame of exactly ``raw_nbytes``
    bytes of content.

    The frame header is checked before anything is decompressed or allocated: the zstd magic number
    (a skippable frame is refused), a complete header, a declared content size (``encode_payload``
    always writes it) equal to ``raw_nbytes``, no dictionary. Then the frame is decompressed into a
    buffer of exactly that declared size: zstd refuses content longer or shorter than declared, a
    truncated frame, and any byte after the frame (garbage, a second or a skippable frame). Memory
    never exceeds ``raw_nbytes`` plus a constant (zstd's decompression context and at most one
    128 KiB block), whatever the input.

    Args:
        payload: the bytes as received (CRC already verified by the caller).
        raw_nbytes: the announced, already limit-checked, uncompressed size in bytes.

    Returns:
        The ``raw_nbytes`` decompressed bytes.

    Raises:
        CorruptPayload: not a zstd frame (a skippable frame included), a truncated frame, a frame
            without a content size or declaring a size other than ``raw_nbytes``, a dictionary
            frame, bytes after the frame, or content that does not decompress to exactly
            ``raw_nbytes`` bytes. The message says which.
    """
    n = len(payload)
    if raw_nbytes < 0:
        raise CorruptPayload(f"raw size {raw_nbytes} must be >= 0")
    if n < 4:
        raise CorruptPayload(f"zstd payload of {n} bytes is shorter than a frame's magic number")
    magic = int.from_bytes(payload[:4], "little")
    if magic & _ZSTD_SKIPPABLE_MASK == _ZSTD_SKIPPABLE_MAGIC:
        raise CorruptPayload("zstd payload starts with a skippable frame; exactly one data frame is allowed")
    if magic != _ZSTD_MAGIC:
        raise CorruptPayload(f"zstd payload starts with {magic:#010x}, not the zstd magic number")
    try:
        header_size = zstandard.frame_header_size(payload)
        if header_size > n:
            raise CorruptPayload(f"zstd frame header truncated ({n} of {header_size} bytes)")
        params = zstandard.get_frame_parameters(payload)
        content_size = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as e:
        raise CorruptPayload(f"zstd frame header invalid or truncated: {e}") from e
    if content_size < 0:
        raise CorruptPayload("zstd frame does not declare its content size")
    if content_size != raw_nbytes:
        raise CorruptPayload(f"zstd frame declares {content_size} bytes of content, expected {raw_nbytes}")
    if params.dict_id:
        raise CorruptPayload(f"zstd frame needs dictionary {params.dict_id}; none is used on the wire")
    try:
        # The declared size (== raw_nbytes) sizes the output buffer; allow_extra_data=False refuses
        # anything after the first frame. max_output_size would not bind here (the header has a size).
        raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=raw_nbytes, allow_extra_data=False)
    except zstandard.ZstdError as e:
        why = _describe_zstd_damage(payload, header_size, params.has_checksum)
        raise CorruptPayload(why or f"zstd frame does not decompress to its declared {raw_nbytes} bytes: {e}") from e
    if len(raw) != raw_nbytes:
        raise CorruptPayload(f"zstd frame decompressed to {len(raw)} bytes, expected {raw_nbytes}")
    return raw


def decode_payload(payload: bytes, codec: Codec, raw_nbytes: int) -> bytes:
    """The ``raw_nbytes`` raw bytes of a received payload (CRC already verified by the caller):
    its size checked against ``max_payload_bytes`` first, then ``NONE`` must be exactly
    ``raw_nbytes`` bytes and ``ZSTD`` goes through ``decompress_exact``. Also for KV blocks.

    Raises:
        CorruptPayload: the payload is larger than ``max_payload_bytes(raw_nbytes, codec)``, a
            ``NONE`` payload is not ``raw_nbytes`` long, or ``decompress_exact`` refuses it.
        InvalidRequest: ``codec`` is not a ``Codec`` or ``raw_nbytes < 0``.
    """
    limit = max_payload_bytes(raw_nbytes, codec)
    if len(payload) > limit:
        raise CorruptPayload(
            f"payload of {len(payload)} bytes exceeds {limit}, the most {Codec(codec).name} allows for "
            f"{raw_nbytes} raw bytes"
        )
    if codec == Codec.ZSTD:
        return decompress_exact(payload, raw_nbytes)
    if len(payload) != raw_nbytes:
        raise CorruptPayload(f"uncompressed payload of {len(payload)} bytes, expected {raw_nbytes}")
    return bytes(payload)


def encode_dtype(h: np.ndarray, dtype: WireDtype) -> bytes:
    """float32 ``[T, H]`` -> wire bytes."""
    if dtype == WireDtype.FP32:
        return np.ascontiguousarray(h, dtype="<f4").tobytes()
    if dtype == WireDtype.FP16:
        return h.astype("<f2").tobytes()
    if dtype == WireDtype.BF16:
        return bf16_bits(h).tobytes()
    if dtype == WireDtype.INT4:
        t, hidden = h.shape
        g = -(-hidden // INT4_GROUP)
        padded = np.zeros((t, g * INT4_GROUP), np.float32)
        padded[:, :hidden] = h
        groups = padded.reshape(t, g, INT4_GROUP)
        s16, s = safe_scale(np.abs(groups).max(axis=2), 7)  # [T, G]
        q = quantize(groups, s[:, :, None], -7, 7).reshape(t, -1)[:, :hidden]
        return s16.tobytes() + pack_int4(q)
    if dtype == WireDtype.INT8_HADAMARD:
        scales, q8 = quantize_rotated_int8(h, hadamard_block(h.shape[1]), 1)
        return scales + q8
    scale = np.maximum(np.abs(h).max(axis=1), 1e-30).astype("<f4") / 127.0  # [T]
    q = np.clip(np.rint(h / scale[:, None]), -127, 127).astype(np.int8)
    return scale.tobytes() + q.tobytes()


def decode_dtype(raw: bytes, dtype: WireDtype, num_tokens: int, hidden: int) -> np.ndarray:
    """Wire bytes -> float32 ``[num_tokens, H]``.

    Raises:
        InvalidRequest: the byte count does not match ``num_tokens x H`` in ``dtype``.
    """
    want = num_tokens * _bytes_per_token(dtype, hidden)
    if len(raw) != want:
        raise InvalidRequest(
            f"chunk holds {len(raw)} bytes, expected {want} for {num_tokens} tokens x H={hidden} in {dtype.name}"
        )
    if dtype == WireDtype.FP32:
        return np.frombuffer(raw, "<f4").reshape(num_tokens, hidden).copy()
    if dtype == WireDtype.FP16:
        return np.frombuffer(raw, "<f2").reshape(num_tokens, hidden).astype(np.float32)
    if dtype == WireDtype.BF16:
        u = np.frombuffer(raw, "<u2").astype("<u4") << 16
        return u.view("<f4").reshape(num_tokens, hidden).copy()
    if dtype == WireDtype.INT4:
        g = -(-hidden // INT4_GROUP)
        s = np.frombuffer(raw[: 2 * g * num_tokens], "<f2").astype(np.float32).reshape(num_tokens, g)
        q4 = unpack_int4(raw[2 * g * num_tokens :], (num_tokens, hidden)).astype(np.float32)
        return q4 * np.repeat(s, INT4_GROUP, axis=1)[:, :hidden]
    if dtype == WireDtype.INT8_HADAMARD:
        b = hadamard_block(hidden)
        ns = num_tokens * (hidden // b)
        blk_scales = np.frombuffer(raw[: 2 * ns], "<f2").astype(np.float32).reshape(num_tokens, hidden // b, 1)
        q8 = np.frombuffer(raw[2 * ns :], np.int8).reshape(num_tokens, hidden)
        return dequantize_rotated_int8(blk_scales, q8, b)
    scale = np.frombuffer(raw[: 4 * num_tokens], "<f4")
    q = np.frombuffer(raw[4 * num_tokens :], np.int8).reshape(num_tokens, hidden)
    return q.astype(np.float32) * scale[:, None]


def split(
    h: np.ndarray,
    token_offset: int,
    chunk_tokens: int,
    dtype: WireDtype = WireDtype.FP32,
    codec: Codec = Codec.NONE,
    level: int = 3,
    params_version: int = 0,
    first_seq: int = 0,
) -> list[Chunk]:
    """Frame activations float32 ``[T, H]`` of tokens ``[token_offset, token_offset+T)``
    into chunks of at most ``chunk_tokens`` tokens, each naming ``params_version``, numbered
    from ``first_seq`` (a turn framed piece by piece as its head runs numbers on).

    Raises:
        InvalidRequest: ``h`` is not 2-D float32, or ``chunk_tokens < 1``.
    """
    if h.ndim != 2 or h.dtype != np.float32:
        raise InvalidRequest(f"activations must be float32 [T, H], got {h.dtype} {h.shape}")
    if chunk_tokens < 1:
        raise InvalidRequest(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    chunks = []
    for seq, start in enumerate(range(0, h.shape[0], chunk_tokens), first_seq):
        part = h[start : start + chunk_tokens]
        raw = encode_dtype(part, dtype)
        payload = encode_payload(raw, codec, level)
        chunks.append(
            Chunk(
                seq,
                token_offset + start,
                part.shape[0],
                dtype,
                codec,
                len(raw),
                payload,
                crc32c(payload),
                params_version,
            )
        )
    return chunks


def verify(chunk: Chunk) -> None:
    """Raises ChecksumMismatch if the chunk's CRC32C does not match its payload."""
    got = crc32c(chunk.payload)
    if got != chunk.crc32c:
        raise ChecksumMismatch(f"chunk {chunk.seq}: crc32c {got:#010x} != {chunk.crc32c:#010x}")


def decode_chunk(chunk: Chunk, hidden: int, max_tokens: int) -> np.ndarray:
    """Verify and decode one chunk to float32 ``[num_tokens, H]``.

    Order: CRC, then every size against the negotiated limits (``0 < num_tokens <= max_tokens``,
    ``raw_nbytes == raw_nbytes_of(num_tokens, dtype, hidden)``, payload at most
    ``max_payload_bytes``), then the payload itself (``decode_payload``). CPU-bound: run it off the
    event loop.

    Raises:
        ChecksumMismatch: CRC mismatch (caller NACKs and waits for a resend).
        CorruptPayload: the CRC matches but the payload is oversized, or not exactly one complete
            zstd frame of ``raw_nbytes`` bytes (caller treats it like a CRC failure).
        InvalidRequest: unknown dtype or codec, or header sizes outside the negotiated limits.
    """
    verify(chunk)
    try:
        dtype, codec = WireDtype(chunk.wire_dtype), Codec(chunk.codec)
    except ValueError:
        raise InvalidRequest(
            f"chunk {chunk.seq}: unknown wire dtype {chunk.wire_dtype} or codec {chunk.codec}"
        ) from None
    if not 0 < chunk.num_tokens <= max_tokens:
        raise InvalidRequest(f"chunk {chunk.seq}: num_tokens {chunk.num_tokens} outside (0, {max_tokens}]")
    expected = raw_nbytes_of(chunk.num_tokens, dtype, hidden)
    if chunk.raw_nbytes != expected:
        raise InvalidRequest(f"chunk {chunk.seq}: raw_nbytes {chunk.raw_nbytes} != {expected}")
    try:
        raw = decode_payload(chunk.payload, codec, expected)
    except CorruptPayload as e:
        raise CorruptPayload(f"chunk {chunk.seq}: {e}") from e
    return decode_dtype(raw, dtype, chunk.num_tokens, hidden)


def combine(chunks: list[Chunk], token_offset: int, num_tokens: int, hidden: int) -> np.ndarray:
    """Reassemble verified chunks covering exactly ``[token_offset, token_offset+num_tokens)``
    into float32 ``[num_tokens, H]``, in any arrival order.

    Raises:
        ChecksumMismatch: a chunk fails its CRC.
        InvalidRequest: gaps, overlaps or chunks outside the range.
    """
    out = np.empty((num_tokens, hidden), np.float32)
    covered = np.zeros(num_tokens, bool)
    for c in sorted(chunks, key=lambda c: c.token_offset):
        lo = c.token_offset - token_offset
        if lo < 0 or lo + c.num_tokens > num_tokens:
            raise InvalidRequest(f"chunk {c.seq} covers tokens outside [{token_offset}, {token_offset + num_tokens})")
        if covered[lo : lo + c.num_tokens].any():
            raise InvalidRequest(f"chunk {c.seq} overlaps another chunk")
        out[lo : lo + c.num_tokens] = decode_chunk(c, hidden, num_tokens)
        covered[lo : lo + c.num_tokens] = True
    if not covered.all():
        raise InvalidRequest(f"chunks leave {int((~covered).sum())} of {num_tokens} tokens uncovered")
    return out
