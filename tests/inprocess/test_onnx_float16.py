"""ONNX graphs in float16 arithmetic (``tandem-model --onnx-dtype float16``): the head and the whole
model run behind the float32 interface every edge path uses, within the float16 check's bound of the
float32 graphs, at about half their size; the dtype is recorded in the checks and a change of it
exports again; an export that overflows float16 is refused; any other dtype is refused before
anything is written."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from tandem.common.model import onnx_export
from tandem.common.model import prepare as modelprep
from tandem.common.protocol.manifest import FULL_CHECK_NAME, FULL_ONNX, ExportCheck, SplitManifest
from tandem.edge.compute.head import HeadInput, OnnxHead
from tests.families import TOKENIZER_DIR, VOCAB, build_checkpoint

pytestmark = pytest.mark.skipif(not TOKENIZER_DIR.is_dir(), reason="no models/smollm2-135m/tokenizer: make model")

K = 3


def _head_hidden(out: Path, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Hidden ``[T, H]`` and head KV ``[K, 2, Hkv, T, D]`` of ``ids`` through ``out``'s head at ``K``
    (two calls: the first half, then the rest on its past KV)."""
    head = OnnxHead(out / f"split-k{K}", providers=["CPUExecutionProvider"])
    first = head.run([HeadInput(ids[:10])])[0]
    second = head.run([HeadInput(ids[10:], first.kv)])[0]
    assert first.hidden.dtype == second.kv.dtype == np.float32
    return np.concatenate([first.hidden, second.hidden]), second.kv


def test_a_float16_head_and_whole_model_run_behind_the_float32_interface(tmp_path):
    ckpt = build_checkpoint("llama", tmp_path / "ckpt")
    m16, m32 = tmp_path / "m16", tmp_path / "m32"
    modelprep.prepare_model(m16, ckpt, str(K), bundles=False, onnx_dtype="float16")
    modelprep.prepare_model(m32, ckpt, str(K), bundles=False)

    manifest = SplitManifest.load(m16 / f"split-k{K}")
    assert manifest.passed_check and manifest.head_check.compute_dtype == "float16"
    assert ExportCheck.load(m16 / FULL_CHECK_NAME).compute_dtype == "float16"
    assert SplitManifest.load(m32 / f"split-k{K}").head_check.compute_dtype == "float32"
    for name in (f"split-k{K}/head.onnx", FULL_ONNX):  # float16 weights: about half the file
        assert (m16 / name).stat().st_size < 0.6 * (m32 / name).stat().st_size

    ids = np.random.default_rng(3).integers(0, VOCAB, 24)
    (h16, kv16), (h32, kv32) = _head_hidden(m16, ids), _head_hidden(m32, ids)
    assert h16.shape == h32.shape and kv16.shape == kv32.shape
    rtol = onnx_export.check_rtol("float16")
    for got, want in ((h16, h32), (kv16, kv32)):
        scale = max(1.0, float(np.abs(want).max()))
        assert 0 < float(np.abs(got - want).max()) <= rtol * scale  # float16 rounding, within the bound

    # the same directory prepared again in float32: both graphs exported again, in float32
    modelprep.prepare_model(m16, ckpt, str(K), bundles=False)
    assert SplitManifest.load(m16 / f"split-k{K}").head_check.compute_dtype == "float32"
    assert ExportCheck.load(m16 / FULL_CHECK_NAME).compute_dtype == "float32"
    np.testing.assert_allclose(_head_hidden(m16, ids)[0], h32, rtol=0, atol=1e-4 * float(np.abs(h32).max()))


def test_a_float16_export_that_overflows_is_refused_with_nothing_prepared(tmp_path):
    """Embeddings of about 1e5 are finite in float32 and infinite in float16 (largest 65504)."""
    import torch
    from transformers import AutoModelForCausalLM

    ckpt = build_checkpoint("llama", tmp_path / "ckpt")
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(1e7)
    model.save_pretrained(ckpt)
    out = tmp_path / "m"
    with pytest.raises(onnx_export.ExportCheckFailed, match="does not compute the HF model"):
        modelprep.prepare_model(out, ckpt, str(K), edge_full=False, onnx_dtype="float16")
    assert not (out / f"split-k{K}" / "manifest.json").exists() and not (out / "bundles").exists()
    modelprep.prepare_model(out, ckpt, str(K), edge_full=False, bundles=False)  # float32 holds it
    assert SplitManifest.load(out / f"split-k{K}").passed_check


def test_an_onnx_dtype_other_than_float32_or_float16_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="float32, float16"):
        modelprep.prepare_model(tmp_path / "m", None, "4", onnx_dtype="bfloat16")
    assert not (tmp_path / "m").exists()
    run = CliRunner().invoke(
        modelprep.app, ["--out", str(tmp_path / "c"), "--onnx-dtype", "int8"], env={"COLUMNS": "200"}
    )
    assert run.exit_code == 2 and "float32, float16" in run.output
    assert not (tmp_path / "c").exists()
