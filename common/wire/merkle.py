"""Append-only Merkle tree over KV block leaves, following RFC 6962 section 2.1
(Certificate Transparency) with the hash as a parameter:

    leaf hash  MTH({d}) = H(0x00 || d)
    node hash           = H(0x01 || left || right)
    MTH(D[n]) = node hash of MTH(D[0:k]) and MTH(D[k:n]), k the largest power of two < n
    MTH({})   = H("")   (the empty tree's root is the hash of the empty string)

Inclusion (audit) paths and consistency proofs are RFC 6962 sections 2.1.1 and
2.1.2; their verifiers are RFC 9162 sections 2.1.3.2 and 2.1.4.2.

``MerkleHasher`` binds all of this to one hash function ``H``. Two instances ship:
``BLAKE3`` (the project's choice and the default) and ``SHA256`` (RFC 6962's own
hash, used to check the algorithms against the Certificate Transparency reference
vectors in tests/unit/test_merkle.py). The module-level functions below delegate to
``BLAKE3``; they are what the edge (edge/link/framing.py builds a turn's leaves and
root) and the cloud (cloud/uploads/upload.py re-hashes received KV blocks and checks the
committed root) call.

Leaf data for a KV block is ``leaf_data(block_hash, layer_lo, layer_hi, wire_dtype, data)``,
so a leaf commits to the block's identity, layer range, wire format, canonical KV layout and its
bytes in that format before any codec (``common.wire.kvwire``): exactly what the cloud decodes and stores.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import blake3

from tandem.common.protocol.errors import InvalidRequest
from tandem.common.wire.formats import format_of
from tandem.common.wire.kvblocks import KV_LAYOUT_VERSION

_LEAF_PREFIX = b"\x00"
_NODE_PREFIX = b"\x01"


def _split_point(n: int) -> int:
    """Largest power of two strictly below ``n`` (RFC 6962's k); needs ``n >= 2``."""
    return 1 << ((n - 1).bit_length() - 1)


@dataclass(frozen=True, kw_only=True)
class MerkleHasher:
    """RFC 6962 Merkle tree algorithms over one hash function.

    ``digest`` maps a byte string to its digest (e.g. ``lambda b: hashlib.sha256(b).digest()``);
    ``name`` labels the instance in reprs and test ids. Every ``leaves`` argument is a sequence of
    leaf *hashes* (outputs of ``leaf_hash``), in tree order; sizes and indices count leaves, and
    indices are 0-based. The instance holds no tree state, so one instance serves every tree.
    """

    digest: Callable[[bytes], bytes] = field(repr=False)
    name: str = "custom"

    def leaf_hash(self, data: bytes) -> bytes:
        """RFC 6962 leaf hash ``H(0x00 || data)`` of a leaf's data (any length)."""
        return self.digest(_LEAF_PREFIX + data)

    def node_hash(self, left: bytes, right: bytes) -> bytes:
        """RFC 6962 interior node hash ``H(0x01 || left || right)`` of two subtree roots."""
        return self.digest(_NODE_PREFIX + left + right)

    def empty_root(self) -> bytes:
        """Root of the tree with no leaves: the hash of the empty string (RFC 6962 2.1)."""
        return self.digest(b"")

    def _mth(self, leaves: Sequence[bytes], lo: int, hi: int) -> bytes:
        """MTH of the non-empty range ``leaves[lo:hi]``; recursion depth is log2(hi - lo)."""
        n = hi - lo
        if n == 1:
            return leaves[lo]
        k = _split_point(n)
        return self.node_hash(self._mth(leaves, lo, lo + k), self._mth(leaves, lo + k, hi))

    def root(self, leaves: Sequence[bytes]) -> bytes:
        """MTH over ``leaves`` (leaf hashes); ``empty_root()`` when there are none."""
        if not leaves:
            return self.empty_root()
        return self._mth(leaves, 0, len(leaves))

    def inclusion_proof(self, leaves: Sequence[bytes], index: int) -> list[bytes]:
        """Audit path PATH(index, D[n]) for leaf ``index`` of the tree of ``leaves`` (RFC 6962 2.1.1).

        Returns sibling subtree roots ordered from the leaf up (about log2(n) hashes).

        Raises:
            IndexError: ``index`` is not in ``[0, len(leaves))``.
        """
        n = len(leaves)
        if not 0 <= index < n:
            raise IndexError(f"leaf {index} outside tree of {n}")
        path: list[bytes] = []
        lo, hi, m = 0, n, index
        while hi - lo > 1:  # walk down from the root, collecting the sibling at each split
            k = _split_point(hi - lo)
            if m < k:
                path.append(self._mth(leaves, lo + k, hi))
                hi = lo + k
            else:
                path.append(self._mth(leaves, lo, lo + k))
                lo, m = lo + k, m - k
        path.reverse()  # RFC order is leaf-to-root
        return path

    def verify_inclusion(
        self, leaf: bytes, index: int, size: int, proof: Sequence[bytes], expected_root: bytes
    ) -> bool:
        """RFC 9162 2.1.3.2: does leaf hash ``leaf`` sit at ``index`` of the tree of ``size`` leaves
        whose root is ``expected_root``, given audit path ``proof``? Never raises on bad input."""
        if not 0 <= index < size:
            return False
        fn, sn, r = index, size - 1, leaf
        for p in proof:
            if sn == 0:
                return False
            if fn & 1 or fn == sn:
                r = self.node_hash(p, r)
                if not fn & 1:
                    while fn and not fn & 1:
                        fn >>= 1
                        sn >>= 1
            else:
                r = self.node_hash(r, p)
            fn >>= 1
            sn >>= 1
        return sn == 0 and r == expected_root

    def consistency_proof(self, leaves: Sequence[bytes], m: int) -> list[bytes]:
        """Proof PROOF(m, D[n]) that the tree of the first ``m`` leaves is a prefix of the tree of
        ``leaves`` (RFC 6962 2.1.2, SUBPROOF). Empty when ``m == len(leaves)``.

        Raises:
            ValueError: ``m`` is not in ``[1, len(leaves)]``.
        """
        n = len(leaves)
        if not 0 < m <= n:
            raise ValueError(f"consistency proof needs 0 < m={m} <= n={n}")
        # SUBPROOF(m, D[lo:hi], b) unrolled: each step appends one sibling root, so the RFC's
        # "subproof + [sibling]" order is the reverse of the order in which we descend.
        out: list[bytes] = []
        lo, hi, b = 0, n, True
        while m != hi - lo:
            k = _split_point(hi - lo)
            if m <= k:
                out.append(self._mth(leaves, lo + k, hi))
                hi = lo + k
            else:
                out.append(self._mth(leaves, lo, lo + k))
                lo, m, b = lo + k, m - k, False
        if not b:
            out.append(self._mth(leaves, lo, hi))
        out.reverse()
        return out

    def verify_consistency(
        self, first_size: int, second_size: int, first_root: bytes, second_root: bytes, proof: Sequence[bytes]
    ) -> bool:
        """RFC 9162 2.1.4.2: is the tree (``first_size`` leaves, ``first_root``) a prefix of the tree
        (``second_size`` leaves, ``second_root``), given ``proof``? Equal sizes need an empty proof and
        equal roots; ``first_size == 0`` is rejected otherwise. Never raises on bad input."""
        if first_size == second_size:
            return not proof and first_root == second_root
        if not 0 < first_size < second_size or not proof:
            return False
        path = list(proof)
        if first_size & (first_size - 1) == 0:  # power of two: first_root is a subtree root
            path.insert(0, first_root)
        fn, sn = first_size - 1, second_size - 1
        while fn & 1:
            fn >>= 1
            sn >>= 1
        fr = sr = path[0]
        for c in path[1:]:
            if sn == 0:
                return False
            if fn & 1 or fn == sn:
                fr = self.node_hash(c, fr)
                sr = self.node_hash(c, sr)
                if not fn & 1:
                    while fn and not fn & 1:
                        fn >>= 1
                        sn >>= 1
            else:
                sr = self.node_hash(sr, c)
            fn >>= 1
            sn >>= 1
        return sn == 0 and fr == first_root and sr == second_root


def _blake3(data: bytes) -> bytes:
    return blake3.blake3(data).digest()


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


BLAKE3 = MerkleHasher(digest=_blake3, name="blake3")
"""The project's tree hash (32-byte BLAKE3); the default behind the module-level functions."""

SHA256 = MerkleHasher(digest=_sha256, name="sha256")
"""RFC 6962's own tree hash (SHA-256); matches Certificate Transparency logs and their test vectors."""

DEFAULT = BLAKE3


def layout_tag(layout_version: int) -> bytes:
    """The canonical KV layout's part of a leaf (``common.wire.kvblocks.KV_LAYOUT_VERSION``): nothing for
    layout 1, ``0xFF`` and the version as one byte for any later one. Layout 1's leaves are the ones
    edges and clouds have always computed; a later layout's leaf is longer than layout 1's for the
    same block, so the two can never verify each other's blocks.

    Raises:
        ValueError: a version outside 1..255."""
    if not 1 <= layout_version <= 255:
        raise ValueError(f"KV layout version {layout_version} outside 1..255")
    return b"" if layout_version == 1 else struct.pack("<BB", 0xFF, layout_version)


def leaf_data(
    block_hash: bytes,
    layer_lo: int,
    layer_hi: int,
    wire_dtype: int,
    data: bytes,
    layout_version: int = KV_LAYOUT_VERSION,
) -> bytes:
    """What a KV block's leaf commits to: ``block_hash`` (the block's identity hash), layers
    ``[layer_lo, layer_hi)`` as two little-endian u32, the format's ``leaf_tag`` (``common.wire.formats``:
    the ``WireDtype`` value as one byte, nothing for fp32; a value no format has, as one byte), the
    canonical layout's ``layout_tag`` (nothing for layout 1), then the block's bytes in that dtype
    (``common.wire.kvwire.encode_kv``; before the codec). Fp32 leaves of layout 1 keep the bytes they had
    before KV formats existed, so edges and clouds of either version agree on them; other formats'
    data lengths differ from fp32's for any block shape the manifest allows. Hash-independent;
    callers pass the result to ``leaf_hash``.

    Raises:
        ValueError: see ``layout_tag``."""
    try:
        tag = format_of(wire_dtype).leaf_tag
    except InvalidRequest:  # the cloud refuses a block of such a dtype before it hashes one
        tag = struct.pack("<B", wire_dtype)
    return block_hash + struct.pack("<II", layer_lo, layer_hi) + tag + layout_tag(layout_version) + data


def leaf_hash(data: bytes) -> bytes:
    """RFC 6962 leaf hash of ``data`` with ``BLAKE3`` (edge/link/framing.py, cloud/uploads/upload.py)."""
    return DEFAULT.leaf_hash(data)


def node_hash(left: bytes, right: bytes) -> bytes:
    """RFC 6962 node hash of two subtree roots with ``BLAKE3``."""
    return DEFAULT.node_hash(left, right)


def root(leaves: list[bytes]) -> bytes:
    """MTH over leaf *hashes* (already ``leaf_hash``-ed) with ``BLAKE3``; the edge sends it in
    ``Commit.merkle_root`` and the cloud recomputes it over the blocks it received."""
    return DEFAULT.root(leaves)


def inclusion_proof(leaves: list[bytes], index: int) -> list[bytes]:
    """Audit path for leaf ``index`` in the tree of ``leaves`` (RFC 6962 2.1.1), ``BLAKE3``.
    Not on the wire yet; tests call it."""
    return DEFAULT.inclusion_proof(leaves, index)


def verify_inclusion(leaf: bytes, index: int, size: int, proof: list[bytes], expected_root: bytes) -> bool:
    """RFC 9162 2.1.3.2: does ``leaf`` sit at ``index`` of the tree of ``size`` with ``expected_root``? ``BLAKE3``."""
    return DEFAULT.verify_inclusion(leaf, index, size, proof, expected_root)


def consistency_proof(leaves: list[bytes], m: int) -> list[bytes]:
    """Proof that the tree of the first ``m`` leaves is a prefix of the tree of ``leaves``
    (RFC 6962 2.1.2, SUBPROOF), ``BLAKE3``. Not on the wire yet; tests call it."""
    return DEFAULT.consistency_proof(leaves, m)


def verify_consistency(
    first_size: int, second_size: int, first_root: bytes, second_root: bytes, proof: list[bytes]
) -> bool:
    """RFC 9162 2.1.4.2: is the tree (first_size, first_root) a prefix of (second_size, second_root)? ``BLAKE3``."""
    return DEFAULT.verify_consistency(first_size, second_size, first_root, second_root, proof)
