"""A quantized build's check measure (``common.model.builder_export.quantized_loss``, on synthetic
logits) and its summary, the precision of an int4 decoder's heads, the edge's start-up line naming
the local model, and the preparation's refusal of a folder that is not a checkpoint."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from tandem.common.model.builder_export import (
    QUANTIZED_MAX_MEAN_KL,
    QUANTIZED_MAX_REL_ERROR,
    DecoderBuild,
    check_summary,
    quantized_loss,
)


@pytest.fixture
def ref() -> np.ndarray:
    """Logits of 16 tokens over a 512-token vocabulary, peaked as a trained model's are."""
    rng = np.random.default_rng(0)
    logits = rng.normal(0.0, 2.0, (16, 512))
    logits[np.arange(16), rng.integers(0, 512, 16)] += 8.0
    return logits


def test_equal_logits_lose_nothing_and_a_shift_of_a_row_changes_nothing(ref):
    assert quantized_loss(ref, ref) == pytest.approx((0.0, 0.0), abs=1e-12)
    shifted = ref + np.arange(16)[:, None] * 3.0  # a softmax ignores each row's shift
    assert quantized_loss(ref, shifted) == pytest.approx((0.0, 0.0), abs=1e-9)


def test_small_noise_stays_within_the_bounds_and_another_positions_logits_do_not(ref):
    rng = np.random.default_rng(1)
    kl, rel = quantized_loss(ref, ref + rng.normal(0.0, 0.3, ref.shape))
    assert 0 < kl <= QUANTIZED_MAX_MEAN_KL and 0 < rel <= QUANTIZED_MAX_REL_ERROR
    kl, rel = quantized_loss(ref, np.roll(ref, 1, axis=0))  # each token given its neighbour's logits
    assert kl > QUANTIZED_MAX_MEAN_KL and rel > QUANTIZED_MAX_REL_ERROR


def test_non_finite_logits_lose_everything(ref):
    bad = ref.copy()
    bad[3, 7] = np.nan
    assert quantized_loss(ref, bad) == (math.inf, math.inf)


def test_the_summary_names_the_measure_each_build_is_checked_on():
    exact = DecoderBuild(
        precision="fp32", execution_provider="cpu", builder_version="x", max_abs_error=2e-5, tolerance=1e-3
    )
    assert check_summary(exact) == "max |ONNX - HF| 2.00e-05 <= 1.00e-03"
    q = exact.model_copy(update={"precision": "int4", "mean_kl": 0.39, "rel_logit_error": 0.4})
    assert check_summary(q).startswith("mean KL 0.390 nats")
    assert check_summary(DecoderBuild(precision="int4", execution_provider="cpu", builder_version="x")) == (
        "no measure recorded"
    )


def test_the_heads_of_an_int4_decoder_are_built_at_the_hosts_exact_precision():
    from tandem.common.model.builder_export import default_precision
    from tandem.common.model.prepare import head_precision

    assert head_precision("int4") == default_precision() and head_precision("int4") in ("fp32", "bf16")
    assert [head_precision(p) for p in ("fp32", "fp16", "bf16")] == ["fp32", "fp16", "bf16"]


def test_the_edges_start_up_log_names_the_local_models_precision(tmp_path):
    from tandem.common.model.builder_export import save_build
    from tandem.edge.server import local_model_kind

    q, exact = tmp_path / "q", tmp_path / "exact"
    for d, precision in ((q, "int4"), (exact, "fp32")):
        d.mkdir()
        save_build(d, DecoderBuild(precision=precision, execution_provider="cpu", builder_version="x"))
    assert local_model_kind(q) == "builder graph, int4 on cpu, quantized: replies differ from the cloud's"
    assert local_model_kind(exact) == "builder graph, fp32 on cpu"
    assert local_model_kind(tmp_path / "edge-full.onnx") == "torch.onnx export"


def test_a_checkpoint_that_is_not_one_is_refused_before_the_output_folder_is_made(tmp_path):
    from tandem.common.model.prepare import prepare_model

    out = tmp_path / "out"
    with pytest.raises(FileNotFoundError, match="is not an HF checkpoint"):
        prepare_model(out, tmp_path / "missing")
    assert not out.exists()


@pytest.mark.parametrize("held, host", [("cpu", "cuda"), ("cuda", "cpu")])
def test_an_int4_decoder_built_for_another_execution_provider_is_built_again(tmp_path, monkeypatch, held, host):
    """int4's execution provider follows the host (``execution_provider_for``): a checked int4 build
    for the other one (made before ONNX Runtime's CUDA provider was installed, or on another host) is
    not kept, and the new build is for this host's; one for this host's is kept as it is."""
    from tandem.common.model import builder_export
    from tandem.common.model.prepare import prepare_decoder
    from tandem.common.protocol.manifest import FULL_DECODER, EngineAgreement

    agreement = EngineAgreement(max_model_len_max_tokens=8192)
    hf, path = tmp_path / "hf", tmp_path / FULL_DECODER
    hf.mkdir()
    (hf / "config.json").write_text('{"vocab_size": 512}')

    def write(out: Path, provider: str) -> DecoderBuild:
        out.mkdir(parents=True, exist_ok=True)
        (out / builder_export.GENAI_CONFIG).write_text("{}")
        b = DecoderBuild(
            precision="int4",
            execution_provider=provider,
            builder_version="x",
            passed=True,
            mean_kl=0.3,
            rel_logit_error=0.3,
            engine_agreement=agreement,
        )
        builder_export.save_build(out, b)
        return b

    built: list[str] = []

    def build_decoder(src, out, precision, provider):
        built.append(provider)
        return write(out, provider)

    monkeypatch.setattr(builder_export, "execution_provider_for", lambda precision: host)
    monkeypatch.setattr(builder_export, "build_decoder", build_decoder)
    monkeypatch.setattr(builder_export, "check_decoder", lambda src, out, ids: builder_export.load_build(out))
    write(path, held)
    assert prepare_decoder(tmp_path, hf, "int4", agreement) == ""
    assert built == [host] and builder_export.load_build(path).execution_provider == host
    assert prepare_decoder(tmp_path, hf, "int4", agreement) == "" and built == [host]  # this host's: kept
