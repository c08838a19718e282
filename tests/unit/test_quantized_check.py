"""A quantized build's check measure (``common.model.builder_export.quantized_loss``) and its summary,
on synthetic logits."""

from __future__ import annotations

import math

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
