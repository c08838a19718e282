"""Activation chunk framing: pure ``split`` and ``combine`` functions, no network.

A chunk carries activations ``h_k`` of ``num_tokens`` consecutive prompt tokens
``[token_offset, token_offset + num_tokens)``, encoded as:

    payload = codec( wire_dtype bytes of [num_tokens, H] )   # int8: fp32 scales [num_tokens] first
    crc32c  = CRC32C(payload)                               # over the bytes as sent

CRC32C is the Castagnoli polynomial (RFC 3720, section 12.1), computed by the
``google-crc32c`` library (hardware-accelerated where the CPU has SSE4.2/ARMv8 CRC).

Int8 is symmetric per-token quantisation: ``scale_t = max|h_t| / 127``,
``q = round(h / scale_t)``; the reconstruction error per element is at most ``scale_t / 2``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import google_crc32c
import numpy as np
import zstandard

from common.errors import ChecksumMismatch, InvalidRequest


class WireDtype(enum.IntEnum):
    """Mirrors ``tandem.v1.WireDtype``."""

    FP32 = 1
    FP16 = 2
    BF16 = 3
    INT8 = 4


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


def crc32c(data: bytes) -> int:
    """CRC32C (Castagnoli) of ``data`` as an unsigned 32-bit int."""
    return int(google_crc32c.value(data))


def _bytes_per_token(dtype: WireDtype, hidden: int) -> int:
    return {
        WireDtype.FP32: 4 * hidden,
        WireDtype.FP16: 2 * hidden,
        WireDtype.BF16: 2 * hidden,
        WireDtype.INT8: hidden + 4,
    }[dtype]


def encode_dtype(h: np.ndarray, dtype: WireDtype) -> bytes:
    """float32 ``[T, H]`` -> wire bytes."""
    if dtype == WireDtype.FP32:
        return np.ascontiguousarray(h, dtype="<f4").tobytes()
    if dtype == WireDtype.FP16:
        return h.astype("<f2").tobytes()
    if dtype == WireDtype.BF16:
        u = np.ascontiguousarray(h, dtype="<f4").view("<u4")
        rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # round to nearest even
        return rounded.astype("<u2").tobytes()
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
) -> list[Chunk]:
    """Frame activations float32 ``[T, H]`` of tokens ``[token_offset, token_offset+T)``
    into chunks of at most ``chunk_tokens`` tokens.

    Raises:
        InvalidRequest: ``h`` is not 2-D float32, or ``chunk_tokens < 1``.
    """
    if h.ndim != 2 or h.dtype != np.float32:
        raise InvalidRequest(f"activations must be float32 [T, H], got {h.dtype} {h.shape}")
    if chunk_tokens < 1:
        raise InvalidRequest(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    cctx = zstandard.ZstdCompressor(level=level) if codec == Codec.ZSTD else None
    chunks = []
    for seq, start in enumerate(range(0, h.shape[0], chunk_tokens)):
        part = h[start : start + chunk_tokens]
        raw = encode_dtype(part, dtype)
        payload = cctx.compress(raw) if cctx else raw
        chunks.append(Chunk(seq, token_offset + start, part.shape[0], dtype, codec, len(raw), payload, crc32c(payload)))
    return chunks


def verify(chunk: Chunk) -> None:
    """Raises ChecksumMismatch if the chunk's CRC32C does not match its payload."""
    got = crc32c(chunk.payload)
    if got != chunk.crc32c:
        raise ChecksumMismatch(f"chunk {chunk.seq}: crc32c {got:#010x} != {chunk.crc32c:#010x}")


def decode_chunk(chunk: Chunk, hidden: int, max_tokens: int) -> np.ndarray:
    """Verify and decode one chunk to float32 ``[num_tokens, H]``.

    Raises:
        ChecksumMismatch: CRC mismatch (caller NACKs and waits for a resend).
        InvalidRequest: sizes outside limits, or a payload that does not decompress.
    """
    verify(chunk)
    if not 0 < chunk.num_tokens <= max_tokens:
        raise InvalidRequest(f"chunk {chunk.seq}: num_tokens {chunk.num_tokens} outside (0, {max_tokens}]")
    expected = chunk.num_tokens * _bytes_per_token(WireDtype(chunk.wire_dtype), hidden)
    if chunk.raw_nbytes != expected:
        raise InvalidRequest(f"chunk {chunk.seq}: raw_nbytes {chunk.raw_nbytes} != {expected}")
    raw = chunk.payload
    if chunk.codec == Codec.ZSTD:
        try:
            raw = zstandard.ZstdDecompressor().decompress(chunk.payload, max_output_size=expected)
        except zstandard.ZstdError as e:
            raise InvalidRequest(f"chunk {chunk.seq}: zstd: {e}") from e
    return decode_dtype(raw, WireDtype(chunk.wire_dtype), chunk.num_tokens, hidden)


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
