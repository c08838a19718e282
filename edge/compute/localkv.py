"""The local model's KV tensors (``edge.compute.local``): one float32 ``[1, Hkv, T, D]`` tensor per layer
and key/value (``2L`` of them, ``common.model.head_io.io_names`` order), held as numpy arrays on the host
or as ONNX Runtime ``OrtValue`` tensors on the device where the engine binds its KV there; and the
conversions to and from the canonical whole-model block layout ``[L, 2, Hkv, T, D]``
(``common.wire.kvblocks``) that remote prefill's download uses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeAlias

import numpy as np

from tandem.common.protocol.errors import InvalidRequest

if TYPE_CHECKING:
    import onnxruntime as ort

KV: TypeAlias = "np.ndarray | ort.OrtValue"  # float32 [1, Hkv, T, D]: host array or device tensor


def kv_tokens(a: KV) -> int:
    """``T`` of one KV tensor ``[1, Hkv, T, D]``, on the host or the device."""
    return int(a.shape[2]) if isinstance(a, np.ndarray) else int(a.shape()[2])


def kv_nbytes(a: KV) -> int:
    """Bytes of one float32 KV tensor, on the host or the device."""
    return int(a.nbytes) if isinstance(a, np.ndarray) else 4 * math.prod(a.shape())


def host_kv(a: KV) -> np.ndarray:
    """One KV tensor as a numpy array (a copy from the device for an ``OrtValue``)."""
    return a if isinstance(a, np.ndarray) else a.numpy()


def kv_prefix(past: Sequence[KV], c: int) -> list[KV]:
    """The KV of the first ``c`` tokens of ``past``: the same tensors when they hold exactly ``c``
    tokens (a turn that follows its session's last one: no copy on the device), else contiguous host
    copies of the prefix (moved back to the device by the next bound run)."""
    if all(kv_tokens(a) == c for a in past):
        return list(past)
    return [np.ascontiguousarray(host_kv(a)[:, :, :c]) for a in past]


def past_from_blocks(kv: np.ndarray) -> list[np.ndarray]:
    """Whole-model KV float32 ``[L, 2, Hkv, T, D]`` (the canonical block layout, ``common.wire.kvblocks``)
    as the engine's past: ``2L`` arrays ``[1, Hkv, T, D]``, key then value per layer (contiguous copies).

    Raises:
        InvalidRequest: ``kv`` is not 5-D float32 with 2 on axis 1.
    """
    if kv.ndim != 5 or kv.shape[1] != 2 or kv.dtype != np.float32:
        raise InvalidRequest(f"whole-model KV must be float32 [L, 2, Hkv, T, D], got {kv.dtype} {kv.shape}")
    return [np.ascontiguousarray(kv[layer, kind][None]) for layer in range(kv.shape[0]) for kind in (0, 1)]


def blocks_from_past(past: Sequence[KV]) -> np.ndarray:
    """The inverse of ``past_from_blocks``: ``2L`` tensors ``[1, Hkv, T, D]`` (host or device) ->
    a host array ``[L, 2, Hkv, T, D]``."""
    host = [host_kv(a) for a in past]
    return np.stack([np.concatenate([host[2 * i], host[2 * i + 1]]) for i in range(len(host) // 2)])
