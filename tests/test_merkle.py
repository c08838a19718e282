"""Unit tests: RFC 6962 Merkle tree with BLAKE3 (roots, inclusion and consistency proofs)."""

import blake3
import pytest

from common import merkle


def leaves(n):
    return [merkle.leaf_hash(f"block-{i}".encode()) for i in range(n)]


def test_domain_separation_and_small_trees():
    assert merkle.root([]) == blake3.blake3(b"").digest()
    a, b, c = leaves(3)
    assert merkle.leaf_hash(b"x") == blake3.blake3(b"\x00x").digest()
    assert merkle.root([a]) == a
    assert merkle.root([a, b]) == blake3.blake3(b"\x01" + a + b).digest()
    # RFC 6962: n=3 splits at k=2 -> node(node(a,b), c)
    assert merkle.root([a, b, c]) == merkle.node_hash(merkle.node_hash(a, b), c)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13])
def test_inclusion_proofs(n):
    ls = leaves(n)
    r = merkle.root(ls)
    for i in range(n):
        proof = merkle.inclusion_proof(ls, i)
        assert merkle.verify_inclusion(ls[i], i, n, proof, r)
        assert not merkle.verify_inclusion(merkle.leaf_hash(b"evil"), i, n, proof, r)
        if n > 1:
            assert not merkle.verify_inclusion(ls[i], (i + 1) % n, n, proof, r)


@pytest.mark.parametrize("n", [2, 3, 7, 8, 9, 16])
def test_consistency_proofs(n):
    ls = leaves(n)
    for m in range(1, n):
        proof = merkle.consistency_proof(ls, m)
        assert merkle.verify_consistency(m, n, merkle.root(ls[:m]), merkle.root(ls), proof)
        tampered = ls[: m - 1] + [merkle.leaf_hash(b"evil")] + ls[m:]
        assert not merkle.verify_consistency(m, n, merkle.root(ls[:m]), merkle.root(tampered), proof)


def test_leaf_data_commits_to_identity_and_layers():
    h = bytes(32)
    assert merkle.leaf_data(h, 0, 4, b"kv") != merkle.leaf_data(h, 0, 5, b"kv")
    assert merkle.leaf_data(h, 0, 4, b"kv") != merkle.leaf_data(b"\x01" * 32, 0, 4, b"kv")
