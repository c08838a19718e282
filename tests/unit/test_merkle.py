"""Unit tests: RFC 6962 Merkle tree (roots, inclusion and consistency proofs).

The algorithms are hash-agnostic (``merkle.MerkleHasher``); the ``SHA256`` instance is checked against the
published Certificate Transparency reference vectors, the ``BLAKE3`` instance (the project default, behind
the module-level functions) against its defining formulas, and both against a naive RFC 6962 reference.
"""

import hashlib
import random
import struct

import blake3
import pytest

from tandem.common.wire import merkle

HASHERS = [merkle.BLAKE3, merkle.SHA256]


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
    assert merkle.leaf_data(h, 0, 4, 1, b"kv") != merkle.leaf_data(h, 0, 5, 1, b"kv")
    assert merkle.leaf_data(h, 0, 4, 1, b"kv") != merkle.leaf_data(b"\x01" * 32, 0, 4, 1, b"kv")


# --- The hash is a parameter; BLAKE3 stays the default ---------------------------------------------------------


def test_module_functions_are_the_blake3_instance():
    ls = leaves(11)
    b3 = merkle.BLAKE3
    assert merkle.leaf_hash(b"x") == b3.leaf_hash(b"x")
    assert merkle.node_hash(ls[0], ls[1]) == b3.node_hash(ls[0], ls[1])
    assert merkle.root(ls) == b3.root(ls)
    assert merkle.root([]) == b3.empty_root() == blake3.blake3(b"").digest()
    assert merkle.inclusion_proof(ls, 6) == b3.inclusion_proof(ls, 6)
    assert merkle.consistency_proof(ls, 5) == b3.consistency_proof(ls, 5)
    assert merkle.SHA256.empty_root() == hashlib.sha256(b"").digest()
    assert merkle.SHA256.root(ls) != merkle.BLAKE3.root(ls)


def test_custom_hasher_and_frozen():
    h = merkle.MerkleHasher(digest=lambda b: hashlib.sha512(b).digest(), name="sha512")
    assert h.leaf_hash(b"") == hashlib.sha512(b"\x00").digest()
    assert h.empty_root() == hashlib.sha512(b"").digest()
    assert "sha512" in repr(h)
    with pytest.raises(AttributeError):
        h.name = "other"  # type: ignore[misc]


@pytest.mark.parametrize("hasher", HASHERS, ids=lambda h: h.name)
def test_proof_argument_errors(hasher):
    ls = [hasher.leaf_hash(bytes([i])) for i in range(4)]
    for bad in (-1, 4):
        with pytest.raises(IndexError):
            hasher.inclusion_proof(ls, bad)
    for bad in (0, 5):
        with pytest.raises(ValueError):
            hasher.consistency_proof(ls, bad)
    assert hasher.consistency_proof(ls, 4) == []
    with pytest.raises(IndexError):
        hasher.inclusion_proof([], 0)


# --- SHA-256 against the published RFC 6962 / Certificate Transparency reference vectors --------------------------
#
# Copied verbatim (hex) from:
#   [CT]   google/certificate-transparency, cpp/merkletree/merkle_tree_test.cc
#          (kSHA256EmptyTreeHash, kInputs, kSHA256Roots, kSHA256Paths, kSHA256Proofs), commit c25edc2c
#   [TD]   transparency-dev/merkle, testonly/constants.go (LeafInputs, NodeHashes, RootHashes, EmptyRootHash),
#          commit 582a6ad1; proof/verify_test.go (inclusionProofs, consistencyProofs, roots), commit 02194e9a
#   [HASH] transparency-dev/merkle, rfc6962/rfc6962_test.go (TestRFC6962Hasher), commit 78493b07
# [CT] and [TD] carry the same eight leaves, roots and proofs; [TD] adds the (6, 7) consistency proof and the
# node hashes of every complete subtree. Leaf indices below are 0-based ([CT]/[TD] paths use 1-based leaves).

CT_EMPTY_ROOT = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"

CT_INPUTS = [
    bytes.fromhex(x)
    for x in ["", "00", "10", "2021", "3031", "40414243", "5051525354555657", "606162636465666768696a6b6c6d6e6f"]
]

# kSHA256Roots / RootHashes()[1:]: root of the tree of the first i+1 inputs.
CT_ROOTS = [
    "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
    "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
    "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
    "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
    "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
    "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
]

# [TD] NodeHashes(): level -> node hashes of the complete subtrees of the size-8 tree, left to right.
TD_NODE_HASHES = [
    [
        "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
        "96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
        "0298d122906dcfc10892cb53a73992fc5b9f493ea4c9badb27b791b4127a7fe7",
        "07506a85fd9dd2f120eb694f86011e5bb4662e5c415a62917033d4a9624487e7",
        "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
        "4271a26be0d8a84f0bd54c8c302e7cb3a3b5d1fa6780a40bcce2873477dab658",
        "b08693ec2e721597130641e8211e7eedccb4c26413963eee6c1e2ed16ffb1a5f",
        "46f6ffadd3d06a09ff3c5860d2755c8b9819db7df44251788c7d8e3180de8eb1",
    ],
    [
        "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
        "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
        "0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
        "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
    ],
    [
        "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
        "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4",
    ],
    ["5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328"],
]

# kSHA256Paths (the non-trivial ones): (0-based leaf index, tree size, audit path).
CT_INCLUSION = [
    (0, 1, []),
    (
        0,
        8,
        [
            "96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4",
        ],
    ),
    (
        5,
        8,
        [
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
            "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
        ],
    ),
    (2, 3, ["fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125"]),
    (
        1,
        5,
        [
            "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
        ],
    ),
]

# kSHA256Proofs, plus (6, 7) from [TD] consistencyProofs: (first size, second size, proof).
CT_CONSISTENCY = [
    (1, 1, []),
    (
        1,
        8,
        [
            "96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4",
        ],
    ),
    (
        6,
        8,
        [
            "0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
            "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
        ],
    ),
    (
        2,
        5,
        [
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
        ],
    ),
    (
        6,
        7,
        [
            "0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
            "b08693ec2e721597130641e8211e7eedccb4c26413963eee6c1e2ed16ffb1a5f",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
        ],
    ),
]

SHA = merkle.SHA256
CT_LEAVES = [SHA.leaf_hash(d) for d in CT_INPUTS]
EMPTY = bytes.fromhex(CT_EMPTY_ROOT)
SOME_HASH = bytes.fromhex("abacaba000000000000000000000000000000000000000000060061e00123456")  # [TD] sha256SomeHash


def hx(xs):
    return [bytes.fromhex(x) for x in xs]


def test_sha256_hasher_vectors():
    # [HASH] TestRFC6962Hasher
    assert SHA.empty_root().hex() == CT_EMPTY_ROOT
    assert SHA.leaf_hash(b"").hex() == "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d"
    assert SHA.leaf_hash(b"L123456").hex() == "395aa064aa4c29f7010acfe3f25db9485bbd4b91897b6ad7ad547639252b4d56"
    assert SHA.node_hash(b"N123", b"N456").hex() == "aa217fe888e47007fa15edab33c2b492a722cb106c64667fc2b044444de66bbb"


def test_sha256_empty_tree_root():
    assert SHA.root([]).hex() == CT_EMPTY_ROOT


@pytest.mark.parametrize("size", range(1, 9))
def test_sha256_roots(size):
    assert SHA.root(CT_LEAVES[:size]).hex() == CT_ROOTS[size - 1]


def test_sha256_complete_subtree_node_hashes():
    for level, row in enumerate(TD_NODE_HASHES):
        w = 1 << level
        for i, want in enumerate(row):
            assert SHA.root(CT_LEAVES[i * w : (i + 1) * w]).hex() == want, (level, i)


@pytest.mark.parametrize(("index", "size", "path"), CT_INCLUSION)
def test_sha256_inclusion_vectors(index, size, path):
    ls, r, proof = CT_LEAVES[:size], bytes.fromhex(CT_ROOTS[size - 1]), hx(path)
    leaf = ls[index]
    assert SHA.inclusion_proof(ls, index) == proof
    assert SHA.verify_inclusion(leaf, index, size, proof, r)
    # Tampering probes ported from [CT] MerkleVerifierTest::VerifierCheck / [TD] corruptInclusionProof.
    bad = [
        (leaf, index - 1, size, proof, r),
        (leaf, index + 1, size, proof, r),
        (leaf, index ^ 2, size, proof, r),
        (leaf, index, size * 2, proof, r),
        (leaf, index, size // 2, proof, r),
        (SHA.leaf_hash(b"WrongLeaf"), index, size, proof, r),
        (leaf, index, size, proof, EMPTY),
        (leaf, index, size, proof, SOME_HASH),
        (leaf, index, size, [*proof, b""], r),
        (leaf, index, size, [*proof, r], r),
        (leaf, index, size, [b"", *proof], r),
        (leaf, index, size, [r, *proof], r),
    ]
    for j in range(len(proof)):
        flipped = list(proof)
        flipped[j] = bytes([flipped[j][0] ^ 8]) + flipped[j][1:]
        bad.append((leaf, index, size, flipped, r))
        replaced = list(proof)
        replaced[j] = EMPTY
        bad.append((leaf, index, size, replaced, r))
    if proof:
        bad.append((leaf, index, size, proof[:-1], r))
    if len(proof) > 1:
        bad.append((leaf, index, size, [proof[0], SOME_HASH, *proof[1:]], r))
    for args in bad:
        assert not SHA.verify_inclusion(*args), args[1:3]


@pytest.mark.parametrize("index", range(8))
def test_sha256_inclusion_paths_in_full_tree(index):
    # The audit path of leaf i in the size-8 tree is its sibling at each level of [TD] NodeHashes.
    want = [TD_NODE_HASHES[level][(index >> level) ^ 1] for level in range(3)]
    assert [h.hex() for h in SHA.inclusion_proof(CT_LEAVES, index)] == want


@pytest.mark.parametrize(("index", "size"), [(0, 0), (0, 1), (1, 0), (2, 1)])
def test_sha256_inclusion_rejects_degenerate(index, size):
    # [TD] TestVerifyInclusion probes (and [CT] MerkleVerifierTest.VerifyPath): none of these may verify.
    assert not SHA.verify_inclusion(SOME_HASH, index, size, [], b"")
    assert not SHA.verify_inclusion(b"", index, size, [], EMPTY)
    assert not SHA.verify_inclusion(SOME_HASH, index, size, [], EMPTY)


@pytest.mark.parametrize(("m", "n", "path"), CT_CONSISTENCY)
def test_sha256_consistency_vectors(m, n, path):
    r1, r2, proof = bytes.fromhex(CT_ROOTS[m - 1]), bytes.fromhex(CT_ROOTS[n - 1]), hx(path)
    assert SHA.consistency_proof(CT_LEAVES[:n], m) == proof
    assert SHA.verify_consistency(m, n, r1, r2, proof)
    if not proof:
        return
    # Tampering probes ported from [CT] VerifierConsistencyCheck / [TD] corruptConsistencyProof.
    bad = [
        (m - 1, n, r1, r2, proof),
        (m + 1, n, r1, r2, proof),
        (m ^ 2, n, r1, r2, proof),
        (m, n * 2, r1, r2, proof),
        (m, n // 2, r1, r2, proof),
        (m, n, b"WrongRoot", r2, proof),
        (m, n, r1, b"WrongRoot", proof),
        (m, n, r2, r1, proof),
        (m, n, r1, r2, []),
        (m, n, r1, r2, [*proof, b""]),
        (m, n, r1, r2, [*proof, r1]),
        (m, n, r1, r2, [*proof, r2]),
        (m, n, r1, r2, [b"", *proof]),
        (m, n, r1, r2, [r1, *proof]),
        (m, n, r1, r2, [r2, *proof]),
        (m, n, r1, r2, [proof[0], *proof]),
        (m, n, r1, r2, proof[:-1]),
    ]
    for j in range(len(proof)):
        flipped = list(proof)
        flipped[j] = bytes([flipped[j][0] ^ 16]) + flipped[j][1:]
        bad.append((m, n, r1, r2, flipped))
        replaced = list(proof)
        replaced[j] = EMPTY
        bad.append((m, n, r1, r2, replaced))
    for args in bad:
        assert not SHA.verify_consistency(*args), args[:2]


def test_sha256_consistency_edge_cases():
    # The rows of [TD] TestVerifyConsistency whose expectation this module shares. (Unlike [TD], a first tree of
    # size 0 is rejected against a non-empty second tree: there is no RFC 9162 proof for it.)
    r1, r2 = b"don't care 1", b"don't care 2"
    assert not SHA.verify_consistency(0, 0, r1, r2, [])
    assert not SHA.verify_consistency(1, 1, r1, r2, [])
    assert SHA.verify_consistency(0, 0, r1, r1, [])
    assert SHA.verify_consistency(1, 1, r2, r2, [])
    assert not SHA.verify_consistency(1, 0, r1, r2, [])
    assert not SHA.verify_consistency(2, 1, r1, r2, [])
    assert not SHA.verify_consistency(1, 2, r1, r2, [])
    assert not SHA.verify_consistency(0, 0, EMPTY, r2, [])
    assert not SHA.verify_consistency(1, 1, EMPTY, r2, [])
    assert not SHA.verify_consistency(0, 0, EMPTY, EMPTY, [EMPTY])
    assert not SHA.verify_consistency(0, 1, EMPTY, EMPTY, [EMPTY])
    assert not SHA.verify_consistency(1, 1, EMPTY, EMPTY, [EMPTY])


# --- Both instances: agreement with a naive RFC 6962 reference and verify(prove(x)) ------------------------------


def ref_root(h, d):
    """RFC 6962 2.1 MTH, written as literally as possible."""
    if not d:
        return h.empty_root()
    if len(d) == 1:
        return d[0]
    k = 1
    while k * 2 < len(d):
        k *= 2
    return h.node_hash(ref_root(h, d[:k]), ref_root(h, d[k:]))


def ref_path(h, m, d):
    """RFC 6962 2.1.1 PATH(m, D[n])."""
    if len(d) == 1:
        return []
    k = 1
    while k * 2 < len(d):
        k *= 2
    if m < k:
        return ref_path(h, m, d[:k]) + [ref_root(h, d[k:])]
    return ref_path(h, m - k, d[k:]) + [ref_root(h, d[:k])]


def ref_subproof(h, m, d, b):
    """RFC 6962 2.1.2 SUBPROOF(m, D[n], b)."""
    if m == len(d):
        return [] if b else [ref_root(h, d)]
    k = 1
    while k * 2 < len(d):
        k *= 2
    if m <= k:
        return ref_subproof(h, m, d[:k], b) + [ref_root(h, d[k:])]
    return ref_subproof(h, m - k, d[k:], False) + [ref_root(h, d[:k])]


@pytest.mark.parametrize("hasher", HASHERS, ids=lambda h: h.name)
@pytest.mark.parametrize("seed", range(6))
def test_prove_then_verify_random_sizes(hasher, seed):
    rng = random.Random(seed)
    n = rng.randint(1, 70)
    ls = [hasher.leaf_hash(rng.randbytes(rng.randint(0, 40))) for _ in range(n)]
    r = hasher.root(ls)
    assert r == ref_root(hasher, ls)
    evil = hasher.leaf_hash(b"evil")
    for i in range(n):
        proof = hasher.inclusion_proof(ls, i)
        assert proof == ref_path(hasher, i, ls)
        assert hasher.verify_inclusion(ls[i], i, n, proof, r)
        assert not hasher.verify_inclusion(evil, i, n, proof, r)
        if n > 1:
            assert not hasher.verify_inclusion(ls[i], (i + 1) % n, n, proof, r)
            assert not hasher.verify_inclusion(ls[i], i, n, proof[:-1], r)
    for m in range(1, n + 1):
        proof = hasher.consistency_proof(ls, m)
        assert proof == ref_subproof(hasher, m, ls, True)
        r1 = hasher.root(ls[:m])
        assert hasher.verify_consistency(m, n, r1, r, proof)
        if m < n:
            tampered = ls[: m - 1] + [evil] + ls[m:]
            assert not hasher.verify_consistency(m, n, r1, hasher.root(tampered), proof)
            assert not hasher.verify_consistency(m, n, r1, r, proof[:-1])
            assert not hasher.verify_consistency(m, n, r, r1, proof)


@pytest.mark.parametrize("hasher", HASHERS, ids=lambda h: h.name)
def test_every_size_up_to_33_against_reference(hasher):
    ls = [hasher.leaf_hash(i.to_bytes(2, "big")) for i in range(33)]
    for n in range(1, 34):
        d = ls[:n]
        assert hasher.root(d) == ref_root(hasher, d)
        assert all(hasher.inclusion_proof(d, i) == ref_path(hasher, i, d) for i in range(n))
        assert all(hasher.consistency_proof(d, m) == ref_subproof(hasher, m, d, True) for m in range(1, n + 1))


def test_a_leaf_commits_to_the_canonical_kv_layout():
    """Layout 1 adds nothing to a leaf (the leaves edges and clouds have always computed); any later
    layout adds its tag, so the same bytes under another layout give another leaf, never the same."""
    from tandem.common.wire.kvblocks import KV_LAYOUT_VERSION

    h = b"\x07" * 32
    v1 = merkle.leaf_data(h, 0, 4, 1, b"kv", layout_version=1)
    assert KV_LAYOUT_VERSION == 1 and merkle.leaf_data(h, 0, 4, 1, b"kv") == v1
    assert v1 == h + struct.pack("<II", 0, 4) + merkle.format_of(1).leaf_tag + b"kv"
    v2 = merkle.leaf_data(h, 0, 4, 1, b"kv", layout_version=2)
    assert v2 != v1 and merkle.leaf_hash(v2) != merkle.leaf_hash(v1)
    assert merkle.leaf_data(h, 0, 4, 1, b"kv", layout_version=3) not in (v1, v2)
    for bad in (0, 256):
        with pytest.raises(ValueError, match="outside 1..255"):
            merkle.layout_tag(bad)
