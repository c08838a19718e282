"""Fidelity: the measures of ``tandem-bench fidelity`` (``benchmarks.fidelity_stats``) on known
distributions, the format round trips of its teacher-forced pass, and the fidelity tables the
negotiation chooses format pairs by (``cloud.links.fidelity``, ``cloud.links.negotiation.link_params``)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from tandem.benchmarks import fidelity_stats as fs
from tandem.benchmarks.fidelity import greedy_from_forced
from tandem.benchmarks.teacher import round_trip_hidden, round_trip_kv
from tandem.cloud.links.fidelity import PACKAGED, FidelityTable, load_tables
from tandem.cloud.links.negotiation import LinkLimits, link_params
from tandem.common.protocol.params import Codec, NegotiateOffer, WireDtype
from tests.doubles import MANIFEST, K

W = WireDtype


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_topk_kl_is_a_lower_bound_of_the_full_kl_and_exact_with_the_whole_vocabulary():
    rng = np.random.default_rng(0)
    for _ in range(20):
        p = log_softmax(rng.standard_normal(300) * 3)
        q = log_softmax(np.log(np.exp(p)) + rng.standard_normal(300) * 0.3)
        full = float(fs.full_kl(p, q))
        for k in (8, 64):
            approx = fs.topk_kl(*fs.topk(p, k), *fs.topk(q, k))
            assert 0 <= approx <= full + 1e-9
        assert fs.topk_kl(*fs.topk(p, 299), *fs.topk(q, 299)) == pytest.approx(full, rel=1e-4, abs=1e-9)
    assert fs.topk_kl(*fs.topk(p, 8), *fs.topk(p, 8)) == pytest.approx(0, abs=1e-12)


def test_summary_splits_near_ties_from_decisive_positions():
    pos = fs.Positions()
    ids = np.array([[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3]])
    ref_lp = np.log(np.array([[0.5, 0.45, 0.05], [0.9, 0.05, 0.05], [0.9, 0.05, 0.05], [0.9, 0.05, 0.05]]))
    other_ids = np.array([[2, 1, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3]])  # a flip at the near-tie only
    other_lp = np.log(np.array([[0.5, 0.45, 0.05], [0.9, 0.05, 0.05], [0.8, 0.15, 0.05], [0.9, 0.05, 0.05]]))
    pos.add_turn((ids, ref_lp), (other_ids, other_lp), np.log([0.45, 0.9, 0.8, 0.9]), prompt_tokens=70)
    s = fs.summarize(pos)
    assert (s["positions"], s["near_ties"]) == (4, 1)
    assert (s["top1_decisive"], s["flip_near_tie"], s["flip_rate"]) == (1.0, 1.0, 0.25)
    assert s["ppl"] == pytest.approx(np.exp(-np.mean(np.log([0.45, 0.9, 0.8, 0.9]))))
    assert list(s["buckets"]) == ["64-127"] and s["buckets"]["64-127"]["positions"] == 4
    assert s["kl_mean"] > 0 and s["kl_full_mean"] is None


def test_greedy_agreement_follows_from_teacher_forcing():
    reply = np.array([5, 6, 7, 2])
    assert greedy_from_forced(reply, np.array([5, 6, 7, 2])) == [5, 6, 7, 2]
    assert greedy_from_forced(reply, np.array([5, 9, 7, 2])) == [5, 9]  # the greedy run parts at the flip
    g = fs.greedy_agreement({"a": [5, 6, 7, 2], "b": [1, 2]}, {"a": [5, 9], "b": [1, 2]})
    assert g == {"replies": 2, "identical": 0.5, "first_divergence_mean": 2.0}


def test_qualifying_needs_both_kl_and_flip_rate_within_the_factor():
    floor = {"kl_mean": 1e-3, "flip_rate": 0.01}
    assert fs.qualifies({"kl_mean": 2e-3, "flip_rate": 0.02}, floor)
    assert not fs.qualifies({"kl_mean": 2.1e-3, "flip_rate": 0.0}, floor)
    assert not fs.qualifies({"kl_mean": 0.0, "flip_rate": 0.021}, floor)
    assert [fs.varint_bytes(t) for t in (0, 127, 128, 16383, 16384, 49151)] == [1, 1, 2, 2, 3, 3]


def test_round_trips_send_only_full_blocks_each_in_the_format():
    rng = np.random.default_rng(1)
    kv = rng.standard_normal((2, 2, 3, 70, 64)).astype(np.float32)
    out = round_trip_kv(kv, W.INT4, 32)
    assert out.shape == (2, 2, 3, 64, 64)  # the partial block stays at the edge
    assert np.array_equal(round_trip_kv(kv, W.FP32, 32), kv[:, :, :, :64])
    assert 0 < np.abs(out - kv[:, :, :, :64]).max() < 1.0
    h = rng.standard_normal((5, 576)).astype(np.float32)
    assert round_trip_hidden(h, W.FP32) is h
    assert 0 < np.abs(round_trip_hidden(h, W.INT4_HADAMARD) - h).max() < 1.0


def table_json(weights: str = "w", k: int = K) -> dict:
    def e(a, v, b, ok):
        return {"activations": a, "kv": v, "bytes_per_token": b, "kl_mean": 0, "flip_rate": 0, "qualifies": ok}

    entries = [
        e("fp32", "fp32", 8000, False),
        e("fp16", "fp16", 4000, True),
        e("bf16", "bf16", 4000, True),
        e("int8_hadamard", "int8_hadamard", 2000, True),
        e("int8_hadamard", "int4", 1300, True),
        e("int4_hadamard", "int4_hadamard", 1000, False),
    ]
    return {"weights_blake3": weights, "splits": {str(k): entries}}


def test_a_table_keeps_the_qualifying_pairs_smaller_than_fp16_smallest_first():
    t = FidelityTable.from_json(table_json())
    assert t.pairs[K] == ((W.INT8_HADAMARD, W.INT4), (W.INT8_HADAMARD, W.INT8_HADAMARD))
    assert t.smallest(K, [W.FP16, W.INT8_HADAMARD], [W.FP16, W.INT8_HADAMARD, W.INT4]) == (W.INT8_HADAMARD, W.INT4)
    assert t.smallest(K, [W.INT8_HADAMARD], [W.INT8_HADAMARD]) == (W.INT8_HADAMARD, W.INT8_HADAMARD)
    assert t.smallest(K, [W.FP16], [W.INT4]) is None and t.smallest(K + 1, [W.INT8_HADAMARD], [W.INT4]) is None
    with pytest.raises(ValueError, match="not a fidelity table"):
        FidelityTable.from_json({"splits": {}})
    with pytest.raises(ValueError, match="not a fidelity table"):
        FidelityTable.from_json(table_json() | {"splits": {"4": [{"activations": "int3", "kv": "fp16"}]}})


def limits(**kw) -> LinkLimits:
    every = tuple(WireDtype)
    base = LinkLimits(64, 256, every, every, (Codec.NONE,), 3, 32, 1024, 64, 3)
    return replace(base, **kw)


def params(lim: LinkLimits, manifest=MANIFEST, acts=(W.FP16, W.FP32, W.INT8_HADAMARD), kvs=None):
    o = NegotiateOffer(edge_id="edge-a", model_id="toy", head_keys={K: manifest.compatibility_key()}, edge_max_batch=4)
    o = replace(o, wire_dtypes=tuple(acts), kv_wire_dtypes=tuple(kvs or (W.FP16, W.FP32, W.INT8_HADAMARD, W.INT4)))
    p = link_params(lim, manifest, K, o, (4, 4096), 1)
    return p.wire_dtype, p.kv_wire_dtype


def test_the_link_gets_the_smallest_qualifying_pair_both_sides_accept():
    m = MANIFEST.model_copy(update={"weights_blake3": "w"})
    lim = limits(fidelity={"w": FidelityTable.from_json(table_json())})
    assert params(lim, m) == (W.INT8_HADAMARD, W.INT4)
    assert params(lim, m, kvs=(W.FP16, W.INT8_HADAMARD)) == (W.INT8_HADAMARD, W.INT8_HADAMARD)
    # nothing smaller qualifies among what both accept: the edge's first preference (fp16)
    assert params(lim, m, acts=(W.FP16, W.FP32)) == (W.FP16, W.FP16)
    assert params(replace(lim, kv_wire_dtypes=(W.FP16, W.FP32)), m) == (W.FP16, W.FP16)
    # a table of other weights, or none, never applies
    assert params(lim, MANIFEST.model_copy(update={"weights_blake3": "other"})) == (W.FP16, W.FP16)
    assert params(limits(), m) == (W.FP16, W.FP16)


def test_remote_prefill_downlink_gets_the_engines_own_kv_dtype_where_both_sides_accept_it():
    """At k = 0 (remote prefill's downlink: every layer's KV) with a table that qualifies no downlink
    format, the KV format is the engines' compute dtype where both sides list it, whatever the
    table qualifies at k > 0; else the most faithful format both sides accept."""
    m = MANIFEST.model_copy(update={"weights_blake3": "w"})
    lim = limits(fidelity={"w": FidelityTable.from_json(table_json())})
    offer = NegotiateOffer(edge_id="edge-a", model_id="toy", head_keys={K: m.compatibility_key()}, edge_max_batch=4)

    def down(lim: LinkLimits, kvs: tuple[W, ...]) -> W:
        return link_params(lim, m, 0, replace(offer, kv_wire_dtypes=kvs), (4, 4096), 1).kv_wire_dtype

    every = (W.FP16, W.BF16, W.FP32, W.INT4, W.INT8_HADAMARD)
    assert down(replace(lim, engine_kv_dtype=W.BF16), every) == W.BF16
    assert down(replace(lim, engine_kv_dtype=W.FP32), every) == W.FP32
    assert down(replace(lim, engine_kv_dtype=W.BF16), (W.FP16, W.INT4)) == W.FP16  # the edge lacks bf16
    assert down(replace(lim, engine_kv_dtype=W.BF16, kv_wire_dtypes=(W.FP16,)), every) == W.FP16  # the cloud does
    assert down(lim, every) == W.FP32  # engine dtype unknown: the most faithful both accept
    # without the engines' dtype, a lossy first preference does not decide: the most faithful does
    assert down(replace(lim, engine_kv_dtype=W.BF16), (W.INT4, W.INT8_HADAMARD, W.FP16)) == W.FP16
    assert down(replace(lim, engine_kv_dtype=W.BF16), (W.INT4, W.INT8_HADAMARD)) == W.INT8_HADAMARD
    assert down(replace(lim, engine_kv_dtype=W.BF16), (W.FP16, W.BF16, W.INT4)) == W.BF16
    # the split links keep the table's pair
    assert link_params(replace(lim, engine_kv_dtype=W.BF16), m, K, offer, (4, 4096), 1).kv_wire_dtype == W.INT4


def downlink_json() -> list[dict]:
    def e(v, b, ok):
        return {"kv": v, "bytes_per_token": b, "kl_mean": 0, "flip_rate": 0, "qualifies": ok}

    return [e("bf16", 40000, True), e("fp16", 40000, True), e("int8_hadamard", 20600, True), e("int4", 11000, False)]


def test_a_tables_downlink_keeps_the_qualifying_formats_smaller_than_the_engines_own():
    bf16 = {"measured": {"dtype": "bfloat16"}}
    t = FidelityTable.from_json(table_json() | bf16 | {"remote_prefill": downlink_json()})
    assert t.downlink == (W.INT8_HADAMARD,)  # int4 does not qualify; fp16 is no smaller than bf16
    # measured with fp32 engines: fp16 and bf16 are smaller than the engines' own fp32 and qualify too
    fp32 = FidelityTable.from_json(table_json() | {"remote_prefill": downlink_json()})
    assert fp32.downlink[0] == W.INT8_HADAMARD and set(fp32.downlink) == {W.INT8_HADAMARD, W.BF16, W.FP16}
    assert t.smallest_downlink([W.FP16, W.INT8_HADAMARD, W.INT4]) == W.INT8_HADAMARD
    assert t.smallest_downlink([W.FP16, W.INT4]) is None
    assert FidelityTable.from_json(table_json()).downlink == ()  # a table measured without the downlink
    with pytest.raises(ValueError, match="not a fidelity table"):
        FidelityTable.from_json(table_json() | {"remote_prefill": [{"kv": "int3", "bytes_per_token": 1}]})


def test_remote_prefill_downlink_takes_the_smallest_format_the_table_qualifies_for_every_layer():
    """A table with downlink entries gives k = 0 its smallest qualifying format both sides accept,
    ahead of the engines' dtype; the split links keep their pairs."""
    m = MANIFEST.model_copy(update={"weights_blake3": "w"})
    bf16 = {"measured": {"dtype": "bfloat16"}}
    table = FidelityTable.from_json(table_json() | bf16 | {"remote_prefill": downlink_json()})
    lim = limits(fidelity={"w": table}, engine_kv_dtype=W.BF16)
    offer = NegotiateOffer(edge_id="edge-a", model_id="toy", head_keys={K: m.compatibility_key()}, edge_max_batch=4)

    def down(kvs: tuple[W, ...]) -> W:
        return link_params(lim, m, 0, replace(offer, kv_wire_dtypes=kvs), (4, 4096), 1).kv_wire_dtype

    assert down((W.FP16, W.BF16, W.FP32, W.INT4, W.INT8_HADAMARD)) == W.INT8_HADAMARD
    assert down((W.FP16, W.BF16, W.INT4)) == W.BF16  # the edge lacks it: the engines' own dtype
    assert link_params(lim, m, K, offer, (4, 4096), 1).kv_wire_dtype == W.INT4  # k = 4: the table's pair


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_engine_kv_formats_carry_each_compute_dtype_exactly(dtype):
    """KV an engine computed in ``dtype`` (widened to the store's float32) crosses the downlink in
    ``ENGINE_KV_FORMATS[dtype]`` bit for bit, extremes of that dtype included."""
    import torch

    from tandem.cloud.links.fidelity import ENGINE_KV_FORMATS
    from tandem.common.wire.kvwire import decode_kv, encode_kv

    t = getattr(torch, dtype)
    info = torch.finfo(t)
    kv = torch.randn(2, 2, 1, 16, 8, generator=torch.Generator().manual_seed(0)) * 40
    kv.view(-1)[:4] = torch.tensor([info.max, -info.max, info.tiny, 0.0])
    stored = kv.to(t).float().numpy()  # what the connector stores: the engine's values, float32
    fmt = ENGINE_KV_FORMATS[dtype]
    back = decode_kv(encode_kv(stored, fmt), fmt, stored.shape)
    assert np.array_equal(back.view(np.uint32), stored.view(np.uint32))


DTYPES = ("float32", "bfloat16")  # the compute dtypes the packaged tables are measured in


def test_the_packaged_tables_load_and_name_their_weights_and_dtype():
    paths = list(PACKAGED.glob("*.json"))
    assert sum(len(load_tables(dtype=d)) for d in DTYPES) == len(paths) >= 1
    for path in paths:
        data = json.loads(path.read_text())
        t = load_tables(dtype=data["measured"]["dtype"])[data["weights_blake3"]]
        assert t.pairs.keys() == {int(k) for k in data["splits"]} and t.dtype == data["measured"]["dtype"]
    assert not load_tables(dtype="float16")  # nothing measured in fp16: such a cloud keeps fp16 on the wire


def test_the_packaged_bf16_smollm2_table_qualifies_int8_hadamard_for_remote_prefills_downlink():
    """Measured on an H100 (200 chats, bf16 engines): int8_hadamard's KV of every layer is within
    the floor (half of bf16's bytes); the int4 formats are not."""
    data = json.loads((PACKAGED / "smollm2-135m-bf16.json").read_text())
    t = load_tables(dtype="bfloat16")[data["weights_blake3"]]
    assert t.downlink == (W.INT8_HADAMARD,)
    assert t.smallest_downlink((W.BF16, W.INT4, W.INT4_HADAMARD)) is None  # the engines' own bf16 then


def test_a_table_applies_to_the_engines_compute_dtype_only(tmp_path):
    """The tables a cloud negotiates by are those measured in the dtype its engines compute in
    (``EngineConfig.compute_dtype``): an fp32 table's verdicts say nothing of a bf16 cloud's floor."""
    fp32 = table_json() | {"measured": {"dtype": "float32"}}
    bf16 = table_json() | {"measured": {"dtype": "bfloat16"}}
    bf16["splits"][str(K)] = [e for e in bf16["splits"][str(K)] if e["kv"] != "int4"]
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, data in zip(paths, (fp32, bf16), strict=True):
        path.write_text(json.dumps(data))
    m = MANIFEST.model_copy(update={"weights_blake3": "w"})
    lim32, lim16 = (limits(fidelity=load_tables(paths, d)) for d in ("float32", "bfloat16"))
    assert lim32.fidelity["w"].dtype == "float32" and lim16.fidelity["w"].dtype == "bfloat16"
    assert params(lim32, m) == (W.INT8_HADAMARD, W.INT4)
    assert params(lim16, m) == (W.INT8_HADAMARD, W.INT8_HADAMARD)


def test_the_engines_compute_dtype_follows_vllms_auto_rule(tmp_path):
    """Set: as set; ``auto``: the dtype the checkpoint's config.json stores where it is 16-bit, the
    platform's first supported dtype for an fp32 (or unstated) one."""
    from vllm.platforms import current_platform

    from tandem.cloud.config import EngineConfig

    first = str(current_platform.supported_dtypes[0]).removeprefix("torch.")
    for name, cfg, want in (
        ("bf16", {"dtype": "bfloat16"}, "bfloat16"),
        ("fp16-old", {"torch_dtype": "float16"}, "float16"),
        ("fp32", {"dtype": "float32"}, first),
        ("unstated", {}, first),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        assert EngineConfig(dtype="auto").compute_dtype(tmp_path / name) == want, name
        assert EngineConfig(dtype="float32").compute_dtype(tmp_path / name) == "float32"  # set: as set
    assert EngineConfig(dtype="bfloat16").compute_dtype(tmp_path / "missing") == "bfloat16"  # nothing read


def test_the_benchmark_refuses_a_compute_dtype_it_cannot_run(tmp_path):
    from typer.testing import CliRunner

    from tandem.benchmarks.fidelity import app

    res = CliRunner().invoke(app, ["--dtype", "float16", "--out", str(tmp_path / "f")])
    assert res.exit_code == 2 and "float32 or bfloat16" in res.output
    assert not (tmp_path / "f").exists()  # refused before anything ran


def test_divergence_gaps_are_read_at_each_replys_first_divergence_only():
    """The first position whose top-1 parts from the reference reply gives the reference's and the
    system's own top-2 gaps; a reply that never parts adds nothing; near-ties counted at <= GAP_NATS."""
    reply = np.array([5, 6, 7])
    ref_lps = np.log(np.array([[0.9, 0.1], [0.5, 0.4], [0.6, 0.4]]))
    other_ids = np.array([[5, 1], [8, 6], [9, 7]])  # parts at 1 (a near-tie) and again at 2: 1 counts
    other_lps = np.log(np.array([[0.8, 0.2], [0.6, 0.3], [0.7, 0.3]]))
    assert fs.first_divergence(reply, other_ids[:, 0]) == 1 and fs.first_divergence(reply, reply) is None
    d = fs.Divergences()
    d.add_turn(reply, ref_lps, other_ids, other_lps)
    d.add_turn(reply, ref_lps, np.stack([reply, reply], 1), other_lps)  # identical greedy: nothing
    big = np.log(np.array([[0.95, 0.01], [0.5, 0.4], [0.6, 0.4]]))
    d.add_turn(reply, big, np.array([[4, 5], [6, 1], [7, 1]]), other_lps)  # parts at 0, a decisive gap
    s = fs.summarize_divergences(d)
    assert (s["divergences"], s["at_near_ties"]) == (2, 1) and d.position == [1, 0]
    assert s["ref_gap_min"] == pytest.approx(np.log(0.5 / 0.4))
    assert s["ref_gap_median"] == pytest.approx((np.log(0.5 / 0.4) + np.log(95)) / 2)
    assert s["own_gap_min"] == pytest.approx(np.log(2)) and len(s["own_gaps"]) == 2
    assert fs.summarize_divergences(fs.Divergences())["ref_gap_median"] is None


def test_the_edge_decoder_option_finds_the_model_dirs_graph_or_none(tmp_path):
    import typer

    from tandem.benchmarks.fidelity import edge_decoder_dir

    assert edge_decoder_dir("auto", tmp_path) is None  # no edge-decoder/: no edge row
    (tmp_path / "edge-decoder").mkdir()
    (tmp_path / "edge-decoder" / "genai_config.json").write_text("{}")
    assert edge_decoder_dir("auto", tmp_path) == tmp_path / "edge-decoder"
    assert edge_decoder_dir("none", tmp_path) is None
    assert edge_decoder_dir(str(tmp_path / "edge-decoder"), tmp_path / "x") == tmp_path / "edge-decoder"
    with pytest.raises(typer.BadParameter, match="no built graph"):
        edge_decoder_dir(str(tmp_path), tmp_path)


def fidelity_result(edge: bool) -> dict:
    """A ``fidelity.json`` of one floor pair, one split row and (``edge``) an edge row."""
    buckets = {"0-63": {"positions": 4, "kl_mean": 1e-4, "flip_rate": 0.0}}
    greedy = {"replies": 2, "identical": 0.5, "first_divergence_mean": 3.0}
    div = {"divergences": 1, "at_near_ties": 1, "ref_gap_median": 0.12, "ref_gap_min": 0.12}
    div |= {"own_gap_median": 0.05, "own_gap_min": 0.05, "ref_gaps": [0.12], "own_gaps": [0.05]}
    summary = {"positions": 4, "near_ties": 1, "kl_mean": 1e-4, "kl_p99": 2e-4, "kl_full_mean": None}
    summary |= {"top1_decisive": 1.0, "flip_near_tie": 0.5, "flip_rate": 0.25, "ppl": 1.5, "buckets": buckets}
    row = {"title": "t", "top_k": 8, **summary, "greedy": greedy, "divergence": div}
    floors = {key: row | {"title": key} for key in ("batching", "bf16", "in_process")}
    split = row | {"k": 4, "pair": "fp32/fp32", "bytes_per_token": 1e4, "vs_fp32": 1.0, "vs_bf16": 0.5}
    split |= {"vs_token_ids": 5000.0, "kl_full_mean": 0.0}
    meta = {"prompts": 2, "selection": "all", "max_new_tokens": 2, "top_k": 8, "positions": 4}
    edges = [row | {"title": "fp32 engine vs edge whole model (builder graph, fp32 on cpu)"}] if edge else []
    return {"meta": meta, "floors": floors, "edge": edges, "rows": [split]}


@pytest.mark.parametrize("edge", [True, False])
def test_the_tables_show_the_edge_row_beside_the_floors_and_every_rows_divergence_gaps(tmp_path, edge):
    """``fidelity.md`` from ``fidelity.json``: the edge row after the floor rows, judged by the floor
    rule; the divergence table with a line per floor, edge row and split row; a result without an
    edge row (or written before there was one) renders without it."""
    from tandem.benchmarks.fidelity import write_outputs

    data = fidelity_result(edge)
    if not edge:
        del data["edge"]
    (tmp_path / "fidelity.json").write_text(json.dumps(data))
    write_outputs(tmp_path, "w")
    md = (tmp_path / "fidelity.md").read_text().splitlines()
    edge_lines = [n for n, line in enumerate(md) if line.startswith("| edge: fp32 engine vs edge whole model")]
    assert len(edge_lines) == (3 if edge else 0)  # main table, buckets, divergences
    if edge:
        floor_bf16 = md.index(next(line for line in md if line.startswith("| floor: bf16 | |")))
        assert edge_lines[0] == floor_bf16 + 2 and md[edge_lines[0]].endswith("| yes |")
    div = md[md.index(next(line for line in md if line.startswith("At each reply's first greedy"))) :]
    assert "| k=4 fp32/fp32 | 1 of 2 | 1 | 0.120 | 0.120 | 0.050 | 0.050 |" in div
    assert sum(line.startswith("| floor: ") for line in div) == 3
    assert "edge" not in json.loads((tmp_path / "fidelity-table.json").read_text())["splits"]
