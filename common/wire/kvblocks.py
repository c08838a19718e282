"""KV block identity and layout, shared by the edge, the gateway and the vLLM connectors.

Identity: a block of ``B`` tokens is named by a chained hash over the token ids
of the prompt prefix that ends with it, as vLLM's prefix cache names its blocks
(``vllm/v1/core/kv_cache_utils.py``, ``hash_block_tokens``):
``h_i = BLAKE3(h_{i-1} || token_ids_i)``, seeded with the model's identity and the
sharing scope (the session, or the request if stateless), so a session's turns
share blocks but no session can plant KV that another session loads.

Store keys commit to what a block was computed from (``part_key``): the edge's
head part by its Merkle leaf (block identity, layer range and the verified bytes),
the tail part by ``activation_keys``, a chain over the activations ``h_k`` that the
tail layers were computed from. So KV from other inputs is never loaded, even in
the same session or after a restart that kept the store.

Layout on the wire and in the block store (canonical, ``KV_LAYOUT_VERSION``): float32
``[Lp, 2, Hkv, B, D]`` for the ``Lp`` layers of one *part* (a global layer range
``[lo, hi)``: the edge's head part ``[0, k)``, the tail engine's ``[k, L)``), K
before V, keys after RoPE. An engine's own paged layout never leaves its connector
(``cloud.engines.kv_layout``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import blake3
import numpy as np

HASH_BYTES = 32
KV_LAYOUT_VERSION = 1
"""Version of the canonical block layout (float32 ``[Lp, 2, Hkv, B, D]``, K after RoPE, then V).
Part of every block-store key (``part_key``) and of every KV block's Merkle leaf
(``common.wire.merkle.leaf_data``), so a block written under one canonical layout is never found, nor
verified, under another."""


@dataclass(frozen=True, kw_only=True)
class LayerRange:
    """Global decoder layers ``[lo, hi)``."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not 0 <= self.lo < self.hi:
            raise ValueError(f"bad layer range [{self.lo}, {self.hi})")

    @property
    def num_layers(self) -> int:
        return self.hi - self.lo

    def tag(self) -> str:
        return f"L{self.lo}-{self.hi}"


def hash_seed(model_key: str, block_size: int, scope: str = "") -> bytes:
    """Root of the chain: the model's identity, the block size and the sharing scope.

    ``scope`` (see ``kv_scope``) keeps one session's blocks out of every other session's
    reach: the cloud verifies that uploaded blocks arrived intact, not that their values
    are right, so blocks are shared only where one party uploaded them all.
    """
    return blake3.blake3(f"tandem-kv-v1|{model_key}|B={block_size}|{scope}".encode()).digest()


def kv_scope(session_id: str, request_id: str) -> str:
    """Sharing scope of a request's KV blocks: its session, or the request alone if stateless."""
    return f"session:{session_id}" if session_id else f"request:{request_id}"


def request_seed(model_key: str, block_size: int, session_id: str, request_id: str) -> bytes:
    """The chain seed of one request's block ids (edge and cloud both call this)."""
    return hash_seed(model_key, block_size, kv_scope(session_id, request_id))


def block_ids(
    token_ids: Sequence[int], block_size: int, model_key: str, session_id: str, request_id: str
) -> list[bytes]:
    """The ids of the full blocks of one request's ``token_ids`` (``block_hashes``), seeded with the
    model's key and the request's scope (``request_seed``): the ids both sides of a link compute
    for the KV blocks that travel, either way, and check every block's ``block_hash`` against."""
    return block_hashes(list(token_ids), block_size, request_seed(model_key, block_size, session_id, request_id))


def activation_keys(hidden: np.ndarray, block_size: int, seed: bytes, part: LayerRange) -> list[bytes]:
    """Content keys of the tail KV of the full blocks of ``hidden``: float32 ``[T, H]`` activations
    ``h_k`` the tail layers take as ``prompt_embeds``.

    ``a_j = BLAKE3(a_{j-1} || bytes(h[jB:(j+1)B]))`` with ``a_{-1} = BLAKE3(seed || part)``: block
    ``j``'s tail KV depends, through attention, on the activations of every token up to its end,
    and on nothing else the cloud is given. Returns ``T // B`` digests of 32 bytes.

    Raises:
        ValueError: ``hidden`` is not a 2-D float32 array.
    """
    if hidden.ndim != 2 or hidden.dtype != np.float32:
        raise ValueError(f"activations must be float32 [T, H], got {hidden.dtype} {hidden.shape}")
    h = np.ascontiguousarray(hidden)
    prev = blake3.blake3(seed + b"|tail|" + part.tag().encode()).digest()
    out: list[bytes] = []
    for j in range(h.shape[0] // block_size):
        prev = blake3.blake3(prev + h[j * block_size : (j + 1) * block_size].tobytes()).digest()
        out.append(prev)
    return out


def block_hashes(token_ids: list[int] | np.ndarray, block_size: int, seed: bytes) -> list[bytes]:
    """Chained hashes of the *full* blocks of ``token_ids`` (a partial last block has none).

    Returns ``len(token_ids) // block_size`` digests of 32 bytes.
    """
    ids = np.asarray(token_ids, dtype="<i8")
    out: list[bytes] = []
    prev = seed
    for j in range(len(ids) // block_size):
        prev = blake3.blake3(prev + ids[j * block_size : (j + 1) * block_size].tobytes()).digest()
        out.append(prev)
    return out


def part_key(content_key: bytes, part: LayerRange) -> str:
    """Block-store key of one block's KV for one layer range, from its content key
    (a Merkle leaf for head blocks, an ``activation_keys`` digest for tail blocks), in canonical
    layout ``KV_LAYOUT_VERSION``."""
    return f"{content_key.hex()}:{part.tag()}:kv{KV_LAYOUT_VERSION}"


def block_nbytes(part: LayerRange, num_kv_heads: int, block_size: int, head_dim: int) -> int:
    """Bytes of one canonical fp32 block of ``part``."""
    return part.num_layers * 2 * num_kv_heads * block_size * head_dim * 4


def split_blocks(kv: np.ndarray, block_size: int, first_block: int, last_block: int) -> list[np.ndarray]:
    """Cut session head KV ``[Lp, 2, Hkv, S, D]`` into canonical blocks ``[Lp, 2, Hkv, B, D]``.

    Returns blocks ``first_block .. last_block-1`` (each fully inside ``S``), C-contiguous.

    Raises:
        ValueError: a requested block extends past ``S``.
    """
    s = kv.shape[3]
    if last_block * block_size > s:
        raise ValueError(f"block {last_block - 1} ends at token {last_block * block_size} > {s} tokens")
    return [
        np.ascontiguousarray(kv[:, :, :, j * block_size : (j + 1) * block_size]) for j in range(first_block, last_block)
    ]
