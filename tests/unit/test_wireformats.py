"""The wire format registry (``common.wire.formats``) and the formats pinned to their bytes: every
activation and KV block format encodes fixed seeded tensors to bytes whose SHA-256 is written
here, and decodes them to pinned float32 values. Edges and clouds of different builds must agree
on these bytes, so a change to a pinned hash is a wire change."""

from __future__ import annotations

import hashlib
import itertools
import struct

import numpy as np
import pytest

from tandem.common.protocol.errors import InvalidRequest
from tandem.common.protocol.params import Codec, WireDtype
from tandem.common.wire import merkle
from tandem.common.wire.chunks import decode_dtype, encode_dtype, raw_nbytes_of
from tandem.common.wire.formats import FORMATS, Fidelity, common_formats, format_of, registry
from tandem.common.wire.kvwire import decode_kv, encode_kv, kv_raw_nbytes


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def activations(tokens: int, hidden: int, seed: int) -> np.ndarray:
    """float32 ``[T, H]``: normal values, a few outlier channels, one all-zero token and values
    beyond fp16's range (saturation and scale clipping are part of the format)."""
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((tokens, hidden)).astype(np.float32)
    h[:, 3 % hidden] *= 300.0  # an outlier channel, as SmolLM2's residual stream has
    h[1] = 0.0
    h[-1, -1] = 1e5  # above FP16_MAX
    return h


def kv_block(shape: tuple[int, int, int, int, int], seed: int) -> np.ndarray:
    """float32 ``[Lp, 2, Hkv, B, D]`` with an outlier key channel, a zero token and a large value."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * 2
    x[:, 0, :, :, 1 % shape[4]] += 15.0
    x[:, :, :, 0] = 0.0
    x[-1, 1, -1, -1, -1] = 1e5
    return x


ACT_CASES = {"t5-h96": (5, 96, 0), "t3-h64": (3, 64, 1), "t4-h37": (4, 37, 2)}

# (case, dtype) -> (SHA-256 of the encoded bytes, SHA-256 of the decoded float32 bytes)
ACT_PINNED: dict[tuple[str, WireDtype], tuple[str, str]] = {
    ("t5-h96", WireDtype.FP32): (
        "587139b323e4de4c642dda424f56e666226f9b588714c0cf9ff8ced512b81771",
        "587139b323e4de4c642dda424f56e666226f9b588714c0cf9ff8ced512b81771",
    ),
    ("t5-h96", WireDtype.FP16): (
        "6f5d8e164f87c7c0317ff29710af493d352b9b15eb45655a7f38fe040780cca3",
        "867e43c4b6a45122286c07bb94e7e7395fcd811f96189f4d50bedd5324edfe01",
    ),
    ("t5-h96", WireDtype.BF16): (
        "b75e62f70880cfb890060dd362695d03faa737178582157e2bd55c1be309aac7",
        "c37a5ac0faea1d11c1d906b48c745b0d5e6ef780c7264f3a0fb0e1f2097c7d46",
    ),
    ("t5-h96", WireDtype.INT8): (
        "6fd9dc36bb90c1a37b80df589b0cbc0eac147a377333eb992f82dfb8db34c41c",
        "474a50856ef72ff2cba0ac04b59d2ea48ea43a56d3aa9158500d26011c909eac",
    ),
    ("t5-h96", WireDtype.INT4): (
        "4738309d8d4259a42e0675dcd6fd4aa8a8f770c4c243fa18159d84eecbd10522",
        "2391d4d079be8acc640d217e64fa66ec474bc061e595c793d58a8f04841a6bd2",
    ),
    ("t5-h96", WireDtype.INT8_HADAMARD): (
        "92d2b3918aa988685e1e232ae8a6bc074571cc9c309a74f590898813164e2535",
        "cdef2070fa98cfd32fdd69bbcad985bc36e3aa3242ed06859c2fa1cbf302d1ee",
    ),
    ("t5-h96", WireDtype.INT4_HADAMARD): (
        "509dd966dd21c90236e5ba3ed62b20eb0414d8dd1eded126573853f7ea0eabb3",
        "d3b7e7d1b4a794e189e76ed75003dfc7ce7d2a12fa29f8ae94d3bcba43bc559d",
    ),
    ("t3-h64", WireDtype.FP32): (
        "4f04f5077eec90b1f04b2d51627f0208d79cc116f5e44ffa756e0fc21663ea47",
        "4f04f5077eec90b1f04b2d51627f0208d79cc116f5e44ffa756e0fc21663ea47",
    ),
    ("t3-h64", WireDtype.FP16): (
        "ec0088c300334f95ffd7e723d24a02cd31cd6e905673b063cd730cc1bbeeaa19",
        "052c7cc127c3ca4b70d3c7610814b96978c4676c929aa56c28ec7390a0f1fe39",
    ),
    ("t3-h64", WireDtype.BF16): (
        "c31345103b13f8fbdfdbbfb92a2710613cba372577ca4f52cc8277be84aebdae",
        "1b722bcd6d31fb36f8853d1df7b242a2456aed911dae0fb5a0d3f74928a318a4",
    ),
    ("t3-h64", WireDtype.INT8): (
        "d07c6b66c0eb34585c4c3d027065bd1321904e56f394244f7055a62d25af88d6",
        "cb0c57f58c2f7ad0ee8c0ad44288321096b9b4a52ec4d756144b228d0ce1bf28",
    ),
    ("t3-h64", WireDtype.INT4): (
        "3ce83e5dabb879a0c5a7c21daf931860681707c6e92394b6931caa23ee754586",
        "0c570cd07239c021528c17fec778d656abb23f3d8b9c59c460087397e01cefb6",
    ),
    ("t3-h64", WireDtype.INT8_HADAMARD): (
        "eb7c9d3ffce57583feacf6f8c1c8c8e3aa122d08bb94f0219994c2a7226a4e84",
        "35cc2f75cb8182ebd980eb0735946b8f8904119b2ca60e08d04a157b82fc5bb2",
    ),
    ("t3-h64", WireDtype.INT4_HADAMARD): (
        "836d3ed66b586e815e7f0d15389e94a3519ebe0d38171214dca29292c0252fa9",
        "afebbe730a84371b29472b6f326f471a956e8ae1841fabf8b5d73f97d4e1a824",
    ),
    ("t4-h37", WireDtype.FP32): (
        "c6f62ca048c2bb21cd7e717f89970bfa63a0e001b0e2cb1397d63307b6616d20",
        "c6f62ca048c2bb21cd7e717f89970bfa63a0e001b0e2cb1397d63307b6616d20",
    ),
    ("t4-h37", WireDtype.FP16): (
        "e7c0ff7b8582d61bbd4219e0cc7164802bd851a1b6e0843b5e14d81cb27e2df6",
        "f7bc0a03f5ec1221fc29b4371032ec44ec18a163eed9aee599a173dc292d822c",
    ),
    ("t4-h37", WireDtype.BF16): (
        "64e37ae901e9bff9aca0e4e38de5345c4a3804981dd8d46f257d05fea8f1da97",
        "7e581fd09a9c275ad7c565067914398d1bf2fe533b8166219ed2e31c3c69dcc3",
    ),
    ("t4-h37", WireDtype.INT8): (
        "6651ba4c9fdbcb8765a2405debc5a83758207ddf2cc67d71597e43d03ad4a264",
        "73d82865f701f752d108f5abb3b639654acdace17e7f981aaebe4ff21fc2ac99",
    ),
    ("t4-h37", WireDtype.INT4): (
        "710d80650667142c3d0e2410fc2dfb97514cda9aa9e5b26bf632225568e0525e",
        "997591fc933dac6d2e0ba753302742d3f6a7c42a99acfe54a71f067a335eb4a8",
    ),
    ("t4-h37", WireDtype.INT8_HADAMARD): (
        "495816a5385e29bb7f5cc3196f4990d6bd809995e513cd906cb4c7cb88a4c647",
        "8ab77a63005544055ace5af4ea9f826d3fab6f635dc6a8aedc70fde1d316177c",
    ),
    ("t4-h37", WireDtype.INT4_HADAMARD): (
        "63c458b9729588fcafc4083d0ac80c6f3a606d66c897fe6611503ea8b742b859",
        "aba5933eef64ca589a6ed4cc7a2f43bc4c93163cfa069399b54b51653869a6cb",
    ),
}

KV_CASES = {"lp2-hkv3-b8-d64": ((2, 2, 3, 8, 64), 3), "lp1-hkv2-b5-d7": ((1, 2, 2, 5, 7), 4)}

KV_PINNED: dict[tuple[str, WireDtype], tuple[str, str]] = {
    ("lp2-hkv3-b8-d64", WireDtype.FP32): (
        "d19246d2248f6f0eb0a0646a79d3e1d126dafc8903ae182281b788466572c736",
        "d19246d2248f6f0eb0a0646a79d3e1d126dafc8903ae182281b788466572c736",
    ),
    ("lp2-hkv3-b8-d64", WireDtype.FP16): (
        "c204415267339adb3c2cf71954c9c812a48db41cff3a150d28f2c2deb915b4b6",
        "fdce3c8b0e13b8410578f3be11a7179862a6b1e78c3b28aa89b5c6ca36a29eb7",
    ),
    ("lp2-hkv3-b8-d64", WireDtype.BF16): (
        "f5a1a11fea371716ba45d460b386c62a5b60003e146fcfc1d48b029630bf3f89",
        "2bdfbd83cfa72a975a44339c4bf515660f621a4f5c097b4a6db7c8c636c34e7a",
    ),
    ("lp2-hkv3-b8-d64", WireDtype.INT8): (
        "09a0718abffa9ad654a8bf9f467e74b5cba852183b82c3d115666279b3f35bcf",
        "a50f4e8fe838382f146387d9a5e913cb932d7e7d283df8c6039091328d0a4db4",
    ),
    ("lp2-hkv3-b8-d64", WireDtype.INT4): (
        "77ba5141ac13c5e577320e693fc6b3dbd2c7c825623f9552a19b2a3c95c4b796",
        "1b2e3a037b62547a72d88f05ddc2466c3ec99dca67694a92f4c1bc800b396816",
    ),
    ("lp2-hkv3-b8-d64", WireDtype.INT8_HADAMARD): (
        "3d1d994d77385dfc198fdd32a6728c0c5f700183815f46760198c74ce5e5e16a",
        "f20405e10f8e62130695903e6c43f6efe08810d45471b98d58deefa64c2e31d6",
    ),
    ("lp2-hkv3-b8-d64", WireDtype.INT4_HADAMARD): (
        "d4ef7393c5b264989f2d182afc3dccfe7b508f3badeaf6a3ed92b30814d0ba41",
        "8a1d7c4273f3eb7e2093bf62512af4f90f87f90bf4993166274ff05651954cd2",
    ),
    ("lp1-hkv2-b5-d7", WireDtype.FP32): (
        "4cf3e03782695c37def7c50cd0472713edda22ec0524ff99cbd62de009b6581f",
        "4cf3e03782695c37def7c50cd0472713edda22ec0524ff99cbd62de009b6581f",
    ),
    ("lp1-hkv2-b5-d7", WireDtype.FP16): (
        "d156fca33b4c7d98a77f9eb94125671ecb29603027a78ec35fce301d2b086bd2",
        "f700535381aceebec65aaad58d4d180bed38a913daf90cea4446e127c0c82656",
    ),
    ("lp1-hkv2-b5-d7", WireDtype.BF16): (
        "d899f409f604922c20ac71d2b7370f8b25121da2171a8a211a36063a8af5f57c",
        "d41325613d77ee9947620ed0b249a5e88abfeecffe7c8810ba47398201277094",
    ),
    ("lp1-hkv2-b5-d7", WireDtype.INT8): (
        "6adfbf05cc99f18ae0370584e0d46f38688350376f6466009ae01fb450e6fbf3",
        "1195d2f36ae7de658f3f6b71025eb6820054f65b2b749b8d78d441942fcfd965",
    ),
    ("lp1-hkv2-b5-d7", WireDtype.INT4): (
        "c9cf63f51629c2300cb6c17710dbd2c324a5bb177a92ff11f37ff5ce987664fb",
        "a67062e5024b997f56be835b7431732209eedac680a82646a817791ebca34531",
    ),
    ("lp1-hkv2-b5-d7", WireDtype.INT8_HADAMARD): (
        "6adfbf05cc99f18ae0370584e0d46f38688350376f6466009ae01fb450e6fbf3",
        "1195d2f36ae7de658f3f6b71025eb6820054f65b2b749b8d78d441942fcfd965",
    ),
    ("lp1-hkv2-b5-d7", WireDtype.INT4_HADAMARD): (
        "3657f93bf4573a355f3a3eb3afec787cb997f519f4e6702d59cb18faf9344f70",
        "20970e99f8c418bdc9a8ced1ace542d9c6d372ebe2f9ab1473ecbd366c6648a3",
    ),
}


@pytest.mark.parametrize("dtype", list(WireDtype), ids=lambda d: d.name)
@pytest.mark.parametrize("case", list(ACT_CASES))
def test_activation_bytes_are_pinned(case, dtype):
    t, hidden, seed = ACT_CASES[case]
    h = activations(t, hidden, seed)
    with np.errstate(over="ignore"):
        raw = encode_dtype(h, dtype)
    assert len(raw) == raw_nbytes_of(t, dtype, hidden)
    out = decode_dtype(raw, dtype, t, hidden)
    assert out.shape == (t, hidden) and out.dtype == np.float32
    assert (sha(raw), sha(out.tobytes())) == ACT_PINNED[case, dtype]


@pytest.mark.parametrize("dtype", list(WireDtype), ids=lambda d: d.name)
@pytest.mark.parametrize("case", list(KV_CASES))
def test_kv_block_bytes_are_pinned(case, dtype):
    shape, seed = KV_CASES[case]
    raw = encode_kv(kv_block(shape, seed), dtype)
    assert len(raw) == kv_raw_nbytes(shape, dtype)
    out = decode_kv(raw, dtype, shape)
    assert out.shape == shape and out.dtype == np.float32
    assert (sha(raw), sha(out.tobytes())) == KV_PINNED[case, dtype]


LEAF_PINNED: dict[WireDtype, str] = {
    WireDtype.FP32: "859de645fb91b7ffa7110a5dce12d740851116a3ac6fde59dbad7a4f1cd8dbc5",
    WireDtype.FP16: "c3c452e404a3a7f3edb51ae02f81a4154b44de52c9c1c3fbda1810bc6b9c1a81",
    WireDtype.BF16: "8da136007a2cefa0860515bb988e9700ea2961d3151a63ec3f0e3aef93570534",
    WireDtype.INT8: "68059db3b9b4d0aafaf2346741a850d07c1eb9ed91ef9af817ce3c8ed03a323d",
    WireDtype.INT4: "12d32633f1110bba0a3dfdaf1ad7025829a5c55b6da2f80a1ce90589efaedd39",
    WireDtype.INT8_HADAMARD: "680046505014ffa5431891458d33a094f6077090137a68d7c975def5f427df89",
    WireDtype.INT4_HADAMARD: "e0fda5e177cdcb28fe895620437d3839e613c890e188d5e443582cba1b0fa7c1",
}


@pytest.mark.parametrize("dtype", list(WireDtype), ids=lambda d: d.name)
def test_leaf_data_is_pinned(dtype):
    """A KV leaf commits to the block's bytes and its format (fp32 leaves carry no format byte)."""
    data = encode_kv(kv_block((1, 2, 1, 4, 8), 5), dtype)
    assert sha(merkle.leaf_data(b"\x11" * 32, 0, 1, dtype, data)) == LEAF_PINNED[dtype]


def test_registry_has_one_entry_per_dtype_in_enum_order():
    assert list(FORMATS) == list(WireDtype)
    assert all(f.dtype == d and f.name == d.name for d, f in FORMATS.items())
    assert format_of(4) is FORMATS[WireDtype.INT8]  # the enum's value, as messages carry it


def test_registry_refuses_a_second_entry_or_a_missing_one():
    entries = list(FORMATS.values())
    with pytest.raises(ValueError, match="two wire formats for INT4"):
        registry(*entries, FORMATS[WireDtype.INT4])
    with pytest.raises(ValueError, match="no wire format for \\['BF16'\\]"):
        registry(*(f for f in entries if f.dtype != WireDtype.BF16))


@pytest.mark.parametrize("bad", [0, 8, 99, -1])
def test_unknown_dtype_is_an_invalid_request(bad):
    with pytest.raises(InvalidRequest, match="unknown wire dtype"):
        format_of(bad)
    with pytest.raises(InvalidRequest, match="unknown wire dtype"):
        raw_nbytes_of(1, bad, 64)
    with pytest.raises(InvalidRequest, match="unknown wire dtype"):
        encode_kv(kv_block((1, 2, 1, 4, 8), 0), bad)


def test_fidelity_classes():
    """Each wire format belongs to its fidelity class: fp32 lossless, fp16 and bf16 half, the 8-bit and the
    4-bit formats their own."""
    assert {d.name: f.fidelity for d, f in FORMATS.items()} == {
        "FP32": Fidelity.LOSSLESS,
        "FP16": Fidelity.HALF,
        "BF16": Fidelity.HALF,
        "INT8": Fidelity.INT8,
        "INT4": Fidelity.INT4,
        "INT8_HADAMARD": Fidelity.INT8,
        "INT4_HADAMARD": Fidelity.INT4,
    }


def relative_error(dtype: WireDtype, kind: str) -> float:
    rng = np.random.default_rng(6)
    if kind == "activations":
        h = rng.standard_normal((16, 576)).astype(np.float32)
        y = decode_dtype(encode_dtype(h, dtype), dtype, *h.shape)
    else:
        h = rng.standard_normal((4, 2, 3, 32, 64)).astype(np.float32)
        y = decode_kv(encode_kv(h, dtype), dtype, h.shape)
    return float(np.linalg.norm(y - h) / np.linalg.norm(h))


@pytest.mark.parametrize("kind", ["activations", "kv"])
def test_fidelity_class_orders_the_measured_error(kind):
    """On normal values every format of a class loses less than any format of a coarser class."""
    err = {d: relative_error(d, kind) for d in WireDtype}
    assert err[WireDtype.FP32] == 0
    for better, worse in itertools.pairwise(Fidelity):
        worst_of_better = max(e for d, e in err.items() if FORMATS[d].fidelity == better)
        best_of_worse = min(e for d, e in err.items() if FORMATS[d].fidelity == worse)
        assert worst_of_better < best_of_worse, (better.name, worse.name, err)


def test_leaf_tag_names_every_format_but_fp32():
    assert FORMATS[WireDtype.FP32].leaf_tag == b""
    assert all(FORMATS[d].leaf_tag == bytes([d.value]) for d in WireDtype if d != WireDtype.FP32)
    assert merkle.leaf_data(b"h", 0, 1, 9, b"kv") == b"h" + struct.pack("<II", 0, 1) + b"\x09kv"  # no such format


@pytest.mark.parametrize("channels", [576, 64, 72, 8])
def test_widths_every_format_suits(channels):
    """Every format suits SmolLM2's hidden size and the usual head dims (576, 64, 72, 8 channels)."""
    assert all(f.suits(channels) for f in FORMATS.values())


@pytest.mark.parametrize("channels", [577, 6, 2])
def test_rotated_formats_need_a_rotation_block(channels):
    rotated = [WireDtype.INT8_HADAMARD, WireDtype.INT4_HADAMARD]
    assert [d for d, f in FORMATS.items() if not f.suits(channels)] == rotated


def test_common_formats_keep_the_offered_order():
    W = WireDtype
    offered = (W.INT8, W.FP16, W.INT8, W.INT4, W.FP32)
    assert common_formats(offered, (W.FP32, W.FP16, W.INT8)) == (W.INT8, W.FP16, W.FP32)
    assert common_formats(offered, (W.FP32, W.INT8), suits=lambda d: d != W.INT8) == (W.FP32,)
    assert common_formats(offered, (W.BF16,)) == ()
    assert common_formats((), (W.FP32,)) == ()
    assert common_formats((Codec.ZSTD, Codec.NONE), (Codec.NONE, Codec.ZSTD)) == (Codec.ZSTD, Codec.NONE)
