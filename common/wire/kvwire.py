"""One head-KV block on the wire: canonical float32 ``[Lp, 2, Hkv, B, D]`` (K before V, keys
after RoPE; ``common.wire.kvblocks``) to the bytes of a ``WireDtype`` and back, with the block's shape
and byte count checked. Pure numpy, no network. The formats' layouts (the KV block layout of
every ``common.wire.formats.FORMATS`` entry) and their sizes are in ``common.wire.formats``.

The Merkle leaf of a block commits to these bytes (``merkle.leaf_data`` with the dtype), i.e. to
exactly what the cloud decodes, so integrity covers the block whatever its format; the cloud
stores the decoded float32 (its engines' KV dtype is converted by the connector).
"""

from __future__ import annotations

import numpy as np

from tandem.common.protocol.errors import InvalidRequest
from tandem.common.protocol.params import WireDtype
from tandem.common.wire.formats import BlockShape, format_of


def kv_raw_nbytes(shape: BlockShape, dtype: WireDtype) -> int:
    """Bytes of one block of ``shape = (Lp, 2, Hkv, B, D)`` in ``dtype`` (before any codec).

    Raises:
        InvalidRequest: ``dtype`` is not a ``WireDtype`` or the shape is not ``(Lp, 2, Hkv, B, D)``.
    """
    if len(shape) != 5 or shape[1] != 2 or min(shape) < 1:
        raise InvalidRequest(f"KV block shape {shape} is not (Lp, 2, Hkv, B, D)")
    return format_of(dtype).kv.nbytes(shape)


def encode_kv(block: np.ndarray, dtype: WireDtype) -> bytes:
    """float32 ``[Lp, 2, Hkv, B, D]`` -> its bytes in ``dtype`` (``common.wire.formats``); NaN and inf
    are carried, not warned about (the cloud refuses them).

    Raises:
        InvalidRequest: ``block`` is not a 5-D float32 array with 2 on axis 1, or ``dtype`` is not
            a ``WireDtype``.
    """
    if block.ndim != 5 or block.shape[1] != 2 or block.dtype != np.float32:
        raise InvalidRequest(f"KV block must be float32 [Lp, 2, Hkv, B, D], got {block.dtype} {block.shape}")
    fmt = format_of(dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        return fmt.kv.encode(np.ascontiguousarray(block, dtype="<f4"))


def decode_kv(raw: bytes, dtype: WireDtype, shape: BlockShape) -> np.ndarray:
    """Bytes of one block in ``dtype`` -> float32 ``shape = (Lp, 2, Hkv, B, D)`` (NaN and inf
    decode as such, without warnings: the caller checks the values).

    Raises:
        InvalidRequest: ``len(raw)`` is not ``kv_raw_nbytes(shape, dtype)``, or an unknown dtype.
    """
    want = kv_raw_nbytes(shape, dtype)
    fmt = format_of(dtype)
    if len(raw) != want:
        raise InvalidRequest(f"KV block holds {len(raw)} bytes, expected {want} for {shape} in {fmt.name}")
    with np.errstate(invalid="ignore", over="ignore"):
        return fmt.kv.decode(raw, shape)
