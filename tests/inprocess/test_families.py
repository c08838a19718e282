"""Every supported decoder family (``common.model.head_model.FAMILIES``) through ``tandem-model`` on a tiny
random-weight checkpoint (``tests.families``): the exported head at two split layers and
``edge-full.onnx`` against HF over a prompt that crosses the sliding windows and a LongRoPE
threshold, fed in five steps through the past-KV inputs; the checks recorded in the manifests; the
checkpoints whose behaviour switches with the length or the layer (``common.model.switches``): served
equal to HF across the switch or refused by name before anything is exported; and what else is
refused: an unsupported architecture (by name, with the supported list; ``--direct-only`` prepares
it for direct mode), an export that differs from HF (no bundle), a manifest without a passing check
(no bundle, no split in ``Negotiate``) and a whole-model graph without one (no local mode)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from tandem.common.model import onnx_export
from tandem.common.model import prepare as modelprep
from tandem.common.model.head_io import io_names
from tandem.common.model.head_model import FAMILIES, UnsupportedArchitecture
from tandem.common.model.switches import Unservable
from tandem.common.protocol.manifest import FULL_CHECK_NAME, FULL_ONNX, ExportCheck, SplitManifest
from tests.families import (
    FAMILY_NAMES,
    FAMILY_SPLITS,
    ORIGINAL_POSITIONS,
    TOKENIZER_DIR,
    VOCAB,
    build_checkpoint,
    gpt2_checkpoint,
)

SPLITS = FAMILY_SPLITS  # two split layers of the 4-layer checkpoints
# the prompt's slots fed per step: [0, 11), [11, 23), [23, 30), [30, 57), [57, 80): past the 8-token
# windows and the LongRoPE checkpoint's 64-token threshold
STEPS = (0, 11, 23, 30, 57, 80)
SERVED_SWITCHES = ("phi3-longrope", "llama-window")  # served, equal to HF across the switch
REFUSED_SWITCHES = {  # refused by tandem-model: checkpoint -> words of the one-line reason
    "qwen2-partial-window": "slides a window of 8 tokens on 2 of its 4 layers",
    "qwen2-head-dim": "sets head_dim 64, but vLLM 0.32's model of it ignores head_dim",
}
# the families whose split head ONNX Runtime GenAI's model builder computes as HF does (fp32, onnxruntime-genai
# 0.18.0), and what the manifest says for the others (docs/models.md)
BUILDER_HEADS = ("llama", "qwen2", "qwen3")
BUILDER_HEAD_REFUSALS = {
    "mistral": "differs from HF",  # its attention has no sliding window
    "gemma2": "differs from HF",
    "gemma3": "KeyError: 'rope_type'",
    "phi3": "KeyError: 'multi_cache'",
}
ARCH = {f.name.lower(): f.architecture for f in FAMILIES.values()}

pytestmark = pytest.mark.skipif(not TOKENIZER_DIR.is_dir(), reason="no models/smollm2-135m/tokenizer: make model")


@pytest.fixture(scope="module")
def prepared(prepared_families) -> dict[str, Path]:
    """Family name -> its prepared model directory (splits ``SPLITS``, edge-full, bundles)."""
    return {name: prepared_families(name) for name in FAMILY_NAMES}


def _hf(out: Path, k: int = FAMILY_SPLITS[0]):
    """HF as the prepared graphs compute it: with the manifest's export overrides (LongRoPE's factors)."""
    return onnx_export.load_hf(out / "hf", SplitManifest.load(out / f"split-k{k}").agreement.export_overrides)


def _run_steps(
    path: Path, n: int, ids: list[int], cfg, steps: tuple[int, ...] = STEPS
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The graph at ``path`` (``n`` layers of KV) over ``ids`` in the ``steps`` chunks: each step's
    first output ``[1, T, ...]`` and the final presents ``[1, Hkv, S, D]``."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    inputs, _ = io_names(n)
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    past = [np.zeros((1, cfg.num_key_value_heads, 0, d), np.float32) for _ in range(2 * n)]
    firsts = []
    for lo, hi in zip(steps, steps[1:], strict=False):
        feed = {
            "input_ids": np.array([ids[lo:hi]], np.int64),
            "position_ids": np.arange(lo, hi, dtype=np.int64)[None],
            "attention_mask": np.ones((1, hi), np.int64),
            **dict(zip(inputs[3:], past, strict=True)),
        }
        first, *past = session.run(None, feed)
        firsts.append(first)
    return firsts, past


def _hf_run(model, ids: list[int]):
    from transformers import DynamicCache

    with torch.no_grad():
        return model(torch.tensor([ids]), output_hidden_states=True, past_key_values=DynamicCache())


@pytest.mark.parametrize("name", FAMILY_NAMES + SERVED_SWITCHES)
def test_head_and_whole_model_match_hf_at_two_split_layers(prepared, prepared_families, name):
    out = prepared[name] if name in prepared else prepared_families(name)
    model = _hf(out)
    ids = np.random.default_rng(7).integers(0, VOCAB, STEPS[-1]).tolist()
    ref = _hf_run(model, ids)
    kv = [t[0].numpy() for layer in ref.past_key_values.layers for t in (layer.keys, layer.values)]
    for k in SPLITS:
        m = SplitManifest.load(out / f"split-k{k}")
        assert m.architecture == ARCH[name.split("-")[0]] and m.passed_check, m.head_check
        assert m.head_check is not None and m.head_check.max_abs_error <= m.head_check.tolerance
        firsts, presents = _run_steps(out / f"split-k{k}" / m.head_onnx, k, ids, model.config)
        want = ref.hidden_states[k][0].numpy()
        tol = onnx_export.CHECK_RTOL * max(1.0, float(np.abs(want).max()))
        assert np.abs(np.concatenate(firsts, axis=1)[0] - want).max() <= tol, (name, k)
        for got, w in zip(presents, kv[: 2 * k], strict=True):
            assert np.abs(got[0] - w).max() <= tol, (name, k)
    full = ExportCheck.load(out / FULL_CHECK_NAME)
    assert full.passed and full.architecture == ARCH[name.split("-")[0]]
    logits, _ = _run_steps(out / FULL_ONNX, model.config.num_hidden_layers, ids, model.config)
    for step_logits, hi in zip(logits, STEPS[1:], strict=True):
        want = ref.logits[0, hi - 1].numpy()
        assert np.abs(step_logits[0] - want).max() <= onnx_export.CHECK_RTOL * max(1.0, float(np.abs(want).max()))
        assert int(step_logits[0].argmax()) == int(want.argmax())
    edge = json.loads((out / "bundles" / "edge" / "bundle.json").read_text())
    assert set(edge["compatibility_keys"]) == {str(k) for k in SPLITS}
    assert FULL_CHECK_NAME in {f["path"] for f in edge["files"]}


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_the_builder_head_serves_where_it_equals_hf_and_the_manifest_says_why_not_elsewhere(prepared_families, name):
    """``tandem-model`` builds each split's head with ONNX Runtime GenAI's model builder: where the
    builder computes the family as HF does (``BUILDER_HEADS``) the manifest names it and it equals HF
    over the prompt fed in five calls through its past KV; elsewhere the manifest says why and the
    edge runs ``head.onnx``."""
    from tandem.common.model.builder_head import HEAD_BUILDER_DIR
    from tandem.edge.compute.builder_head import BuilderHead, open_head
    from tandem.edge.compute.head import HeadInput, OnnxHead

    out = prepared_families(name)
    model = _hf(out)
    ids = np.random.default_rng(7).integers(0, VOCAB, STEPS[-1]).tolist()
    ref = _hf_run(model, ids)
    edge = {f["path"] for f in json.loads((out / "bundles" / "edge" / "bundle.json").read_text())["files"]}
    for k in SPLITS:
        split = out / f"split-k{k}"
        m = SplitManifest.load(split)
        if name not in BUILDER_HEADS:
            assert not m.builder_head and BUILDER_HEAD_REFUSALS[name] in m.builder_head_note, m.builder_head_note
            assert isinstance(open_head(split), OnnxHead)
            continue
        assert m.builder_head == HEAD_BUILDER_DIR and not m.builder_head_note
        assert f"split-k{k}/{HEAD_BUILDER_DIR}/model.onnx" in edge
        head = BuilderHead(split)
        kv, hidden = None, []
        for lo, hi in zip(STEPS, STEPS[1:], strict=False):
            o = head.run([HeadInput(np.array(ids[lo:hi]), kv)])[0]
            hidden.append(o.hidden)
            kv = o.kv
        want = ref.hidden_states[k][0].numpy()
        want_kv = np.stack(
            [np.stack([lay.keys[0].numpy(), lay.values[0].numpy()]) for lay in ref.past_key_values.layers[:k]]
        )
        tol = onnx_export.CHECK_RTOL * max(1.0, float(np.abs(want).max()), float(np.abs(want_kv).max()))
        assert np.abs(np.concatenate(hidden) - want).max() <= tol, (name, k)
        assert kv is not None and np.abs(kv - want_kv).max() <= tol, (name, k)


def test_an_unsupported_architecture_is_refused_by_name_with_the_supported_list(tmp_path):
    ckpt = gpt2_checkpoint(tmp_path / "gpt2")
    out = tmp_path / "out"
    result = CliRunner().invoke(modelprep.app, ["--out", str(out), "--checkpoint", str(ckpt), "--split-layers", "1"])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())  # rich wraps long lines
    assert "GPT2LMHeadModel" in text and all(a in text for a in FAMILIES), text
    assert "--direct-only" in text
    assert not (out / "bundles").exists() and not list(out.glob("split-k*"))
    with pytest.raises(UnsupportedArchitecture, match="GPT2LMHeadModel"):
        modelprep.prepare_model(out, ckpt, "1")


def test_direct_only_prepares_any_architecture_without_heads(tmp_path):
    """``--direct-only``: a manifest at split layer 0 and bundles without ONNX or tail; a cloud on it
    serves no split (``Splits.layers`` empty) and negotiates direct mode."""
    from tandem.cloud.engines.memory import MemoryEngines
    from tandem.cloud.server import build_gateway
    from tandem.cloud.store.blocks import MemoryBlockStore
    from tandem.common.protocol.params import NegotiateOffer
    from tests.doubles import B, cloud_config

    out = tmp_path / "out"
    result = CliRunner().invoke(
        modelprep.app, ["--out", str(out), "--checkpoint", str(gpt2_checkpoint(tmp_path / "gpt2")), "--direct-only"]
    )
    assert result.exit_code == 0, result.output
    m = SplitManifest.load(out / "direct")
    assert (m.split_layer, m.architecture, m.head_onnx, m.tail_checkpoint) == (0, "GPT2LMHeadModel", "", "")
    assert (m.shape.num_layers, m.shape.hidden_size, m.shape.head_dim, m.shape.vocab_size) == (2, 128, 32, VOCAB)
    edge = json.loads((out / "bundles" / "edge" / "bundle.json").read_text())
    cloud = json.loads((out / "bundles" / "cloud" / "bundle.json").read_text())
    assert not any(f["path"].endswith(".onnx") for f in edge["files"] + cloud["files"])
    assert {f["path"] for f in edge["files"]} >= {"direct/manifest.json", "tokenizer/tokenizer.json"}
    assert {f["path"] for f in cloud["files"]} >= {"direct/manifest.json", "hf/model.safetensors", "hf/config.json"}
    store = MemoryBlockStore(1 << 20)
    gw = build_gateway(cloud_config(), m, MemoryEngines(store, B, VOCAB), store)
    assert gw.splits.layers == () and set(
        gw.negotiate(NegotiateOffer(edge_id="e", model_id=m.model_id, head_keys={}, edge_max_batch=4)).params_by_split
    ) == {0}


def test_an_export_that_differs_from_hf_stops_preparation_before_any_bundle(tmp_path, monkeypatch):
    """The head is exported from other weights than the checkpoint's (a scaled copy): the check
    sees the difference and ``tandem-model`` writes neither manifest nor bundle."""
    from safetensors.torch import load_file, save_file

    ckpt = build_checkpoint("qwen3", tmp_path / "ckpt")
    other = tmp_path / "other"
    shutil.copytree(ckpt, other)
    tensors = load_file(other / "model.safetensors")
    save_file({n: t * 1.01 if "q_norm" in n else t for n, t in tensors.items()}, str(other / "model.safetensors"))
    real_export = modelprep.export_head
    monkeypatch.setattr(
        modelprep, "export_head", lambda src, out, k, full=False, **kw: real_export(other, out, k, full, **kw)
    )
    out = tmp_path / "out"
    with pytest.raises(modelprep.ExportCheckFailed, match=r"Qwen3ForCausalLM.*max \|ONNX - HF\|"):
        modelprep.prepare_model(out, ckpt, "2")
    assert not (out / "split-k2" / "manifest.json").exists() and not (out / "bundles").exists()


def test_a_manifest_without_a_passing_check_is_not_bundled_nor_offered(prepared, tmp_path):
    from tandem.cloud.engines.memory import MemoryEngines
    from tandem.cloud.server import build_gateway
    from tandem.cloud.store.blocks import MemoryBlockStore
    from tandem.common.protocol.params import NegotiateOffer
    from tests.doubles import MANIFEST, B, K, cloud_config

    out = tmp_path / "llama"
    shutil.copytree(prepared["llama"], out, symlinks=True, ignore=shutil.ignore_patterns("bundles"))
    m = SplitManifest.load(out / "split-k1")
    m.model_copy(update={"head_check": None}).save(out / "split-k1")
    with pytest.raises(ValueError, match="no passing check"):
        modelprep.write_bundles(out)
    failed = m.head_check.model_copy(update={"passed": False, "max_abs_error": 1.0})  # type: ignore[union-attr]
    m.model_copy(update={"head_check": failed}).save(out / "split-k1")
    with pytest.raises(ValueError, match="no passing check"):
        modelprep.write_bundles(out)
    # the cloud: a split whose manifest records no passing check gets direct mode and a note
    store = MemoryBlockStore(1 << 20)
    unchecked = MANIFEST.model_copy(update={"head_check": None})
    gw = build_gateway(cloud_config(), unchecked, MemoryEngines(store, B, 1000), store)
    n = gw.negotiate(
        NegotiateOffer(edge_id="e", model_id="toy", head_keys={K: unchecked.compatibility_key()}, edge_max_batch=4)
    )
    assert set(n.params_by_split) == {0}
    assert "not checked against HF" in n.note and "direct mode only" in n.note
    checked = build_gateway(cloud_config(), MANIFEST, MemoryEngines(store, B, 1000), store)
    assert set(
        checked.negotiate(
            NegotiateOffer(edge_id="e", model_id="toy", head_keys={K: MANIFEST.compatibility_key()}, edge_max_batch=4)
        ).params_by_split
    ) == {
        0,
        K,
    }


def test_local_mode_needs_a_passing_check_of_the_whole_model(prepared, tmp_path):
    from tandem.edge.server import local_check_problem

    path = tmp_path / FULL_ONNX
    shutil.copy(prepared["gemma2"] / FULL_ONNX, path)
    assert "no check against HF" in local_check_problem(path)
    check = ExportCheck.load(prepared["gemma2"] / FULL_CHECK_NAME)
    check.model_copy(update={"passed": False}).save(tmp_path / FULL_CHECK_NAME)
    assert "failed its check" in local_check_problem(path)
    check.save(tmp_path / FULL_CHECK_NAME)
    assert local_check_problem(path) == ""


@pytest.fixture(scope="module")
def longrope_short(prepared_families, tmp_path_factory) -> Path:
    """The LongRoPE checkpoint prepared for engines of 64 tokens (its threshold: the short factors)."""
    out = tmp_path_factory.mktemp("longrope-short") / "out"
    ckpt = prepared_families("phi3-longrope") / "hf"
    modelprep.prepare_model(out, ckpt, "1", model_id="tiny-phi3-longrope", max_model_len_tokens=ORIGINAL_POSITIONS)
    return out


def test_longrope_graphs_equal_hf_past_the_threshold_and_pair_only_with_their_side(prepared_families, longrope_short):
    """The LongRoPE checkpoint prepared for engines of 512 tokens (past its 64-token threshold:
    vLLM uses the long factors at every position) computes what HF computes for a prompt past the
    threshold, at its first positions too; prepared for 64 it computes HF's short factors. Each
    manifest records its side, and the two do not pair (other compatibility keys)."""
    long_out = prepared_families("phi3-longrope")  # tandem-model's default: the model's 512 positions
    m = SplitManifest.load(long_out / "split-k1")
    a = m.agreement
    assert (a.max_model_len_min_tokens, a.max_model_len_max_tokens) == (ORIGINAL_POSITIONS + 1, 512)
    assert m.head_check is not None and m.head_check.tokens > a.check_tokens > ORIGINAL_POSITIONS  # a row past it
    # the model builder's graph serves local mode only when checked past the threshold under the same factors
    from tandem.common.model.builder_export import decoder_problem, load_build
    from tandem.common.protocol.manifest import FULL_DECODER

    if not decoder_problem(long_out / FULL_DECODER):
        build = load_build(long_out / FULL_DECODER)
        assert build.engine_agreement == a and build.checked_tokens >= a.check_tokens
    native = onnx_export.load_hf(long_out / "hf")  # HF's own switch: the long factors for a prompt past 64
    ids = np.random.default_rng(3).integers(0, VOCAB, STEPS[-1]).tolist()
    want = _hf_run(native, ids).logits[0].numpy()
    logits, _ = _run_steps(long_out / FULL_ONNX, 4, ids, native.config)
    for step_logits, hi in zip(logits, STEPS[1:], strict=True):
        assert np.abs(step_logits[0] - want[hi - 1]).max() <= onnx_export.CHECK_RTOL * max(1.0, np.abs(want).max())
    short_out = longrope_short
    short = SplitManifest.load(short_out / "split-k1")
    assert (short.agreement.max_model_len_max_tokens, short.agreement.export_overrides) == (ORIGINAL_POSITIONS, {})
    assert short.compatibility_key() != m.compatibility_key()
    assert "--max-model-len-tokens 512" in short.agreement.refusal(512)
    ids = ids[: ORIGINAL_POSITIONS - 8]  # within the short side: HF's short factors
    want = _hf_run(native, ids).hidden_states[1][0].numpy()
    firsts, _ = _run_steps(short_out / "split-k1" / short.head_onnx, 1, ids, native.config, (0, 11, 23, len(ids)))
    assert np.abs(np.concatenate(firsts, axis=1)[0] - want).max() <= onnx_export.CHECK_RTOL * max(
        1.0, np.abs(want).max()
    )


async def test_local_mode_serves_the_lengths_its_graph_was_prepared_for(prepared_families, longrope_short):
    """``edge-full.onnx`` with the short factors serves sequences up to the threshold only (past it
    HF switches to the long factors); the one with the long factors every position of the model."""
    from tandem.edge.config import EdgeConfig
    from tandem.edge.server import load_local

    for out, positions in ((longrope_short, ORIGINAL_POSITIONS), (prepared_families("phi3-longrope"), 512)):
        m = SplitManifest.load(out / "split-k1")
        cfg = EdgeConfig(split_dir=out / "split-k1", intra_op_threads=1)
        local = await load_local(cfg, m.shape, [2], m.agreement.max_model_len_max_tokens)
        assert local is not None and local.limits.max_model_len_tokens == positions


def test_a_head_exported_with_the_short_factors_fails_a_long_deployments_check(
    prepared_families, tmp_path, monkeypatch
):
    """The check runs HF as vLLM will compute the deployment (the long factors) on a row past the
    threshold: a head exported with the checkpoint's short factors is stopped, no bundle written."""
    real_export = modelprep.export_head
    monkeypatch.setattr(
        modelprep,
        "export_head",
        lambda src, out, k, full=False, **kw: real_export(src, out, k, full, kw["compute_dtype"]),
    )
    out = tmp_path / "out"
    with pytest.raises(modelprep.ExportCheckFailed, match="Phi3ForCausalLM"):
        modelprep.prepare_model(out, prepared_families("phi3-longrope") / "hf", "1")
    assert not (out / "split-k1" / "manifest.json").exists() and not (out / "bundles").exists()


def test_a_window_hf_ignores_is_dropped_from_the_engines(prepared_families):
    """A Llama whose config sets ``sliding_window``: HF's Llama (and the graphs) ignore it, so the
    manifest starts vLLM's engines without it."""
    out = prepared_families("llama-window")
    for k in FAMILY_SPLITS:
        a = SplitManifest.load(out / f"split-k{k}").agreement
        assert a.hf_overrides == {"sliding_window": None} and a.export_overrides == {}
        assert (a.max_model_len_min_tokens, a.max_model_len_max_tokens, a.check_tokens) == (2, 512, 0)


@pytest.mark.parametrize("name", sorted(REFUSED_SWITCHES))
def test_a_checkpoint_vllm_cannot_serve_as_hf_computes_it_is_refused_before_export(tmp_path, name):
    ckpt = build_checkpoint(name, tmp_path / "ckpt")
    for extra in ([], ["--direct-only"]):
        out = tmp_path / f"out{len(extra)}"
        argv = ["--out", str(out), "--checkpoint", str(ckpt), "--split-layers", "1", *extra]
        result = CliRunner().invoke(modelprep.app, argv)
        assert result.exit_code == 2, result.output
        text = " ".join(result.output.split())  # rich wraps long lines
        assert text.startswith("refused ") and REFUSED_SWITCHES[name] in text, text
        assert not out.exists() or [p.name for p in out.iterdir()] == []
    with pytest.raises(Unservable, match=REFUSED_SWITCHES[name]):
        modelprep.prepare_model(tmp_path / "again", ckpt, "1")
