"""Activation chunk framing: pure ``split`` and ``combine`` functions, no network.

A chunk carries activations ``h_k`` of ``num_tokens`` consecutive prompt tokens
``[token_offset, token_offset + num_tokens)``, encoded as:

    payload = codec( wire_dtype bytes of [num_tokens, H] )   # quantised formats: scales first
    crc32c  = CRC32C(payload)                               # over the bytes as sent

CRC32C is the Castagnoli polynomial (RFC 3720, section 12.1), computed by the
``google-crc32c`` library (hardware-accelerated where the CPU has SSE4.2/ARMv8 CRC).

The wire dtypes' byte layouts, their sizes and the widths they suit are registered in
``common.wire.formats`` (``FORMATS``); this module frames and checks chunks and looks the format up
there. KV blocks are framed by ``common.wire.kvwire``.

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

import threading
from dataclasses import dataclass

import google_crc32c
import numpy as np
import zstandard

from tandem.common.protocol.errors import ChecksumMismatch, CorruptPayload, InvalidRequest
from tandem.common.protocol.params import Codec, WireDtype
from tandem.common.wire.formats import format_of


@dataclass(frozen=True, kw_only=True)
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


def crc32c(data: bytes) -> int:
    """CRC32C (Castagnoli) of ``data`` as an unsigned 32-bit int."""
    return int(google_crc32c.value(data))


def raw_nbytes_of(num_tokens: int, dtype: WireDtype, hidden: int) -> int:
    """Size in bytes of the uncompressed wire bytes of ``num_tokens`` tokens x ``hidden`` in ``dtype``
    (scales included).

    Raises:
        InvalidRequest: ``num_tokens < 0``, ``hidden < 1`` or ``dtype`` not a ``WireDtype``.
    """
    if num_tokens < 0 or hidden < 1:
        raise InvalidRequest(f"num_tokens {num_tokens} and hidden {hidden} must be >= 0 and >= 1")
    return format_of(dtype).activations.nbytes((num_tokens, hidden))


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
    """float32 ``[T, H]`` -> its wire bytes in ``dtype`` (``common.wire.formats``).

    Raises:
        InvalidRequest: ``dtype`` is not a ``WireDtype``.
    """
    return format_of(dtype).activations.encode(h)


def decode_dtype(raw: bytes, dtype: WireDtype, num_tokens: int, hidden: int) -> np.ndarray:
    """Wire bytes -> float32 ``[num_tokens, H]``.

    Raises:
        InvalidRequest: ``dtype`` is not a ``WireDtype``, or the byte count does not match
            ``num_tokens x H`` in ``dtype``.
    """
    fmt = format_of(dtype)
    want = fmt.activations.nbytes((num_tokens, hidden))
    if len(raw) != want:
        raise InvalidRequest(
            f"chunk holds {len(raw)} bytes, expected {want} for {num_tokens} tokens x H={hidden} in {fmt.name}"
        )
    return fmt.activations.decode(raw, (num_tokens, hidden))


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
                seq=seq,
                token_offset=token_offset + start,
                num_tokens=part.shape[0],
                wire_dtype=dtype,
                codec=codec,
                raw_nbytes=len(raw),
                payload=payload,
                crc32c=crc32c(payload),
                params_version=params_version,
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
