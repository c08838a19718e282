"""Append-only Merkle tree over KV block leaves, following RFC 6962 section 2.1
(Certificate Transparency) with BLAKE3 as the hash:

    leaf hash  MTH({d}) = BLAKE3(0x00 || d)
    node hash           = BLAKE3(0x01 || left || right)
    MTH(D[n]) = MTH(D[0:k]) and MTH(D[k:n]) joined, k the largest power of two < n

Inclusion (audit) paths and consistency proofs are RFC 6962 sections 2.1.1 and
2.1.2; their verifiers are RFC 9162 sections 2.1.3.2 and 2.1.4.2.
The empty tree's root is BLAKE3 of the empty string.

Leaf data for a KV block is ``leaf_data(block_hash, layer_lo, layer_hi, payload)``,
so a leaf commits to the block's identity, layer range and bytes.
"""

from __future__ import annotations

import struct

import blake3


def _h(data: bytes) -> bytes:
    return blake3.blake3(data).digest()


def leaf_hash(data: bytes) -> bytes:
    """RFC 6962 leaf hash of ``data``."""
    return _h(b"\x00" + data)


def node_hash(left: bytes, right: bytes) -> bytes:
    return _h(b"\x01" + left + right)


def leaf_data(block_hash: bytes, layer_lo: int, layer_hi: int, payload: bytes) -> bytes:
    """What a KV block's leaf commits to: identity, layer range, bytes."""
    return block_hash + struct.pack("<II", layer_lo, layer_hi) + payload


def _split_point(n: int) -> int:
    k = 1
    while k << 1 < n:
        k <<= 1
    return k


def root(leaves: list[bytes]) -> bytes:
    """MTH over leaf *hashes* (already ``leaf_hash``-ed)."""
    n = len(leaves)
    if n == 0:
        return _h(b"")
    if n == 1:
        return leaves[0]
    k = _split_point(n)
    return node_hash(root(leaves[:k]), root(leaves[k:]))


def inclusion_proof(leaves: list[bytes], index: int) -> list[bytes]:
    """Audit path for leaf ``index`` in the tree of ``leaves`` (RFC 6962 2.1.1)."""
    n = len(leaves)
    if not 0 <= index < n:
        raise IndexError(f"leaf {index} outside tree of {n}")
    if n == 1:
        return []
    k = _split_point(n)
    if index < k:
        return inclusion_proof(leaves[:k], index) + [root(leaves[k:])]
    return inclusion_proof(leaves[k:], index - k) + [root(leaves[:k])]


def verify_inclusion(leaf: bytes, index: int, size: int, proof: list[bytes], expected_root: bytes) -> bool:
    """RFC 9162 2.1.3.2: does ``leaf`` sit at ``index`` of the tree of ``size`` with ``expected_root``?"""
    if not 0 <= index < size:
        return False
    fn, sn, r = index, size - 1, leaf
    for p in proof:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            if not fn & 1:
                while fn and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    return sn == 0 and r == expected_root


def consistency_proof(leaves: list[bytes], m: int) -> list[bytes]:
    """Proof that the tree of the first ``m`` leaves is a prefix of the tree of ``leaves``
    (RFC 6962 2.1.2, SUBPROOF)."""
    n = len(leaves)
    if not 0 < m <= n:
        raise ValueError(f"consistency proof needs 0 < m={m} <= n={n}")

    def sub(m: int, d: list[bytes], b: bool) -> list[bytes]:
        n = len(d)
        if m == n:
            return [] if b else [root(d)]
        k = _split_point(n)
        if m <= k:
            return sub(m, d[:k], b) + [root(d[k:])]
        return sub(m - k, d[k:], False) + [root(d[:k])]

    return sub(m, leaves, True)


def verify_consistency(
    first_size: int, second_size: int, first_root: bytes, second_root: bytes, proof: list[bytes]
) -> bool:
    """RFC 9162 2.1.4.2: is the tree (first_size, first_root) a prefix of (second_size, second_root)?"""
    if first_size == second_size:
        return not proof and first_root == second_root
    if not 0 < first_size < second_size:
        return False
    path = list(proof)
    if first_size & (first_size - 1) == 0:  # power of two: first_root is a subtree root
        path.insert(0, first_root)
    if not path:
        return False
    fn, sn = first_size - 1, second_size - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            if not fn & 1:
                while fn and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    return sn == 0 and fr == first_root and sr == second_root
