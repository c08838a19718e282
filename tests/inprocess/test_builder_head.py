"""The split head built by ONNX Runtime GenAI's model builder (``common.model.builder_head``) and run
by ``edge.compute.builder_head.BuilderHead``, on the real SmolLM2-135M at k = 4 in fp32 on the CPU:
the rewired graph outputs the residual entering layer k (no final norm), its hidden state and KV
equal HF's for a prefill and for a second call after it (its runs exact, or chunked and padded), the
warm-up runs its padded lengths (alone and at the edge's start-up), it returns what ``OnnxHead``
returns, bad rows are refused, and the edge falls back to ``head.onnx`` (logged) where no checked
builder head is."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest

from tandem.common.model.builder_export import save_build
from tandem.common.model.builder_head import (
    BUILDER_HIDDEN,
    HEAD_BUILDER_DIR,
    HIDDEN,
    final_norms,
    head_problem,
    load_head_build,
    prepare_builder_head,
)
from tandem.common.protocol.errors import InvalidRequest
from tandem.common.protocol.manifest import EngineAgreement, SplitManifest
from tandem.edge.compute.builder_head import BuilderHead, open_head
from tandem.edge.compute.head import HeadInput, OnnxHead
from tandem.edge.compute.prefill import PrefillPlan
from tests.references import head_close as close
from tests.references import hf_head_run as hf_run

K = 4


@pytest.fixture(scope="module")
def built_split(split_dir, manifest, tmp_path_factory):
    """A copy of the prepared split k=4 (links to its parts) with its builder head built, checked and
    named in its manifest, as ``tandem-model`` writes it."""
    root = tmp_path_factory.mktemp("builder-head")
    for name in ("hf", "tokenizer"):
        (root / name).symlink_to((split_dir.parent / name).resolve())
    d = root / f"split-k{K}"
    d.mkdir()
    for name in ("head.onnx", "tail"):
        (d / name).symlink_to((split_dir / name).resolve())
    agreement = manifest.agreement
    why = prepare_builder_head(
        d, root / "hf", K, "fp32", agreement, manifest.shape.vocab_size, manifest.checkpoint_blake3
    )
    assert why == ""
    manifest.model_copy(update={"builder_head": HEAD_BUILDER_DIR}).save(d)
    return d


@pytest.fixture(scope="module")
def head(built_split):
    return BuilderHead(built_split)


def test_the_build_is_checked_against_hf_and_recorded(built_split):
    build = load_head_build(built_split / HEAD_BUILDER_DIR)
    assert build.passed and build.split_layer == K and build.precision == "fp32"
    assert build.max_abs_error is not None and build.max_abs_error <= build.tolerance
    assert build.checked_tokens >= 32 and build.engine_agreement is not None
    assert head_problem(built_split / HEAD_BUILDER_DIR, K) == ""
    assert "not 8" in head_problem(built_split / HEAD_BUILDER_DIR, 8)


def test_the_rewired_graph_outputs_the_residual_without_the_final_norm(built_split):
    import onnx

    path = built_split / HEAD_BUILDER_DIR / "model.onnx"
    m = onnx.load(str(path), load_external_data=False)
    outputs = [o.name for o in m.graph.output]
    assert HIDDEN in outputs and BUILDER_HIDDEN not in outputs
    assert final_norms(path) == []
    assert not [t.name for t in m.graph.initializer if "final_norm" in t.name]
    producer = next(n for n in m.graph.node if HIDDEN in n.output)
    assert producer.op_type == "Add"
    cfg = json.loads((built_split / HEAD_BUILDER_DIR / "genai_config.json").read_text())["model"]["decoder"]
    assert cfg["num_hidden_layers"] == K


@pytest.fixture(scope="module")
def planned_head(built_split):
    """The head with its runs cut into 16 tokens and padded to 4, 8 or 16, the mask over the slot
    (the CUDA provider's ``PrefillPlan.bucketed`` at a size these rows cross)."""
    return BuilderHead(built_split, prefill=PrefillPlan(16, (4, 8, 16), capacity_mask=True))


@pytest.mark.parametrize("which", ["exact", "chunked and padded"])
def test_prefill_and_a_second_call_with_past_equal_hf(head, planned_head, hf_model, which):
    """40 new tokens, then 9 after them (with the plan: runs of 16, 16 and 8, then 9 padded to 16):
    the hidden state and the KV of the real tokens are HF's."""
    head = head if which == "exact" else planned_head
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, 49152, 40).tolist(), rng.integers(0, 49152, 9).tolist()
    first = head.run([HeadInput(np.array(a))])[0]
    ref_h, ref_kv = hf_run(hf_model, a, K)
    assert first.hidden.dtype == first.kv.dtype == np.float32
    assert first.hidden.shape == ref_h.shape and first.kv.shape == ref_kv.shape
    assert close(first.hidden, ref_h), np.abs(first.hidden - ref_h).max()
    assert close(first.kv, ref_kv), np.abs(first.kv - ref_kv).max()
    second = head.run([HeadInput(np.array(b), first.kv)])[0]
    ref_h, ref_kv = hf_run(hf_model, a + b, K)
    assert second.kv.shape == ref_kv.shape
    assert close(second.hidden, ref_h[len(a) :]), np.abs(second.hidden - ref_h[len(a) :]).max()
    assert close(second.kv, ref_kv)


def test_the_warm_up_runs_the_heads_padded_lengths_and_it_serves_on(built_split, hf_model):
    """A head has no logits: the warm-up runs each padded length through its ``hidden`` rows on
    every capacity it warms and frees its slots after (a head's graph has no memory bound), and the
    head then computes HF's hidden state."""
    head = BuilderHead(built_split, prefill=PrefillPlan(8, (4, 8), capacity_mask=True))
    g = head.graph
    caps = head.warm_prefills()
    assert caps[0] == 256 and caps == [256, *g._planned_capacities()] and len(caps) > 1
    assert g.memory.held_bytes == 0 and not any(g._free.values())
    ids = np.random.default_rng(5).integers(0, 49152, 11).tolist()
    out = head.run([HeadInput(np.array(ids))])[0]
    ref_h, ref_kv = hf_run(hf_model, ids, K)
    assert close(out.hidden, ref_h) and close(out.kv, ref_kv)


def test_a_ragged_batch_returns_what_the_torch_onnx_head_returns(head, built_split):
    """Rows of different new and past lengths in one call: each as ``OnnxHead`` computes it."""
    onnx_head = OnnxHead(built_split)
    rng = np.random.default_rng(4)
    firsts = onnx_head.run([HeadInput(rng.integers(0, 49152, n)) for n in (30, 3)])
    rows = [
        HeadInput(rng.integers(0, 49152, 17)),
        HeadInput(rng.integers(0, 49152, 1), firsts[0].kv),
        HeadInput(rng.integers(0, 49152, 12), firsts[1].kv),
    ]
    got, want = head.run(rows), onnx_head.run(rows)
    for g, w in zip(got, want, strict=True):
        assert g.hidden.shape == w.hidden.shape and g.kv.shape == w.kv.shape
        assert close(g.hidden, w.hidden) and close(g.kv, w.kv)
    assert head.run([]) == []


@pytest.mark.parametrize(
    "row, message",
    [
        (HeadInput(np.zeros((2, 3), np.int64)), "1-D"),
        (HeadInput(np.zeros(0, np.int64)), "non-empty"),
        (HeadInput(np.array([1.0, 2.0])), "integers"),
        (HeadInput(np.array([1, 49152])), "outside the vocabulary"),
        (HeadInput(np.array([-1, 2])), "outside the vocabulary"),
        (HeadInput(np.array([1]), np.zeros((K, 2, 3, 5, 32), np.float32)), "past_kv"),
        (HeadInput(np.array([1]), np.zeros((K, 2, 3, 5, 64), np.float64)), "past_kv"),
        (HeadInput(np.array([1]), np.zeros((K - 1, 2, 3, 5, 64), np.float32)), "past_kv"),
    ],
)
def test_a_bad_row_is_refused_and_fails_only_its_batch(head, row, message):
    good = HeadInput(np.array([5, 6, 7]))
    with pytest.raises(InvalidRequest, match=message):
        head.run([good, row])
    assert head.run([good])[0].kv.shape == (K, 2, 3, 3, 64)  # the head serves on


def test_more_tokens_than_the_graph_has_positions_are_refused(head):
    past = np.zeros((K, 2, 3, head.graph.spec.context_tokens, 64), np.float32)
    with pytest.raises(InvalidRequest, match="positions"):
        head.run([HeadInput(np.array([1]), past)])


def test_the_edge_falls_back_to_head_onnx_and_says_why(built_split, tmp_path, caplog):
    assert isinstance(open_head(built_split), BuilderHead)
    with caplog.at_level(logging.INFO):
        assert isinstance(open_head(built_split, builder=False), OnnxHead)
    assert "builder_head is off" in caplog.text
    # a split whose builder head failed its check
    d = tmp_path / f"split-k{K}"
    shutil.copytree(built_split, d, symlinks=True)
    build = load_head_build(d / HEAD_BUILDER_DIR)
    save_build(d / HEAD_BUILDER_DIR, build.model_copy(update={"passed": False, "max_abs_error": 9.0}))
    with pytest.raises(ValueError, match="failed its check"):
        BuilderHead(d)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert isinstance(open_head(d), OnnxHead)
    assert "failed its check" in caplog.text
    # a split whose preparation could not build one: the manifest's note is the reason logged
    note = "onnxruntime_genai's model builder failed on hf (fp32, cpu): KeyError: 'rope_type'"
    SplitManifest.load(d).model_copy(update={"builder_head": "", "builder_head_note": note}).save(d)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert isinstance(open_head(d), OnnxHead)
    assert "rope_type" in caplog.text
    # a split prepared before builder heads: none named, none tried
    SplitManifest.load(d).model_copy(update={"builder_head_note": ""}).save(d)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert isinstance(open_head(d), OnnxHead)
    assert "no builder head was prepared" in caplog.text


def test_preparation_keeps_a_checked_head_and_rebuilds_for_other_weights(built_split, manifest):
    path = built_split / HEAD_BUILDER_DIR
    stamp = (path / "model.onnx").stat().st_mtime_ns
    hf = built_split.parent / "hf"
    vocab = manifest.shape.vocab_size
    agreement = manifest.agreement
    assert prepare_builder_head(built_split, hf, K, "fp32", agreement, vocab, manifest.checkpoint_blake3) == ""
    assert (path / "model.onnx").stat().st_mtime_ns == stamp  # kept
    stricter = EngineAgreement(**{**agreement.model_dump(), "check_tokens": 48})
    assert prepare_builder_head(built_split, hf, K, "fp32", stricter, vocab, manifest.checkpoint_blake3) == ""
    assert load_head_build(path).checked_tokens == 48  # built and checked again, past the longer switch


def test_the_head_benchmark_times_both_heads(built_split, tmp_path):
    """``tandem-bench head`` with tiny arguments: a row per head and length, units in the columns."""
    from tandem.benchmarks import edge_head

    edge_head.main(split_dir=built_split, out=tmp_path, prompt_tokens="8,16", repeats=1, threads=1)
    rows = json.loads((tmp_path / "edge_head.json").read_text())["rows"]
    assert [(r["head"], r["prompt_tokens"]) for r in rows] == [
        ("torch.onnx", 8),
        ("builder", 8),
        ("torch.onnx", 16),
        ("builder", 16),
    ]
    assert all(r["prefill_ms"] > 0 and r["ms_per_token"] > 0 for r in rows)
    assert "| head | prompt_tokens | prefill_ms |" in (tmp_path / "edge_head.md").read_text()


async def test_the_edge_starts_a_builder_head_with_bucketed_prefill_shapes(built_split, caplog):
    """``prefill_shapes: bucketed`` (the CUDA provider's default) on a split with a builder head: the
    edge's start-up runs the head's padded lengths on each warmed capacity, then serves and times it."""
    from tandem.edge.config import EdgeConfig
    from tandem.edge.routing.costmodel import CostModel
    from tandem.edge.server import load_heads

    cfg = EdgeConfig(split_dir=built_split, prefill_shapes="bucketed", intra_op_threads=2)
    with caplog.at_level(logging.INFO, logger="tandem.edge"):
        heads, sample = await load_heads(cfg, [SplitManifest.load(built_split)], CostModel())
    try:
        runner = heads[0].batcher.head
        assert isinstance(runner, BuilderHead) and runner.graph.prefill == PrefillPlan.bucketed() and sample
        assert f"split {built_split}: prefill shapes run on KV capacities [256, 512" in caplog.text
    finally:
        for h in heads:
            await h.batcher.stop()
