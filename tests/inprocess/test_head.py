"""ONNX Runtime head vs the PyTorch (HF) model: h_k and head KV, batch 1 and ragged
batches, with and without past KV. fp32; tolerance relative to the activation scale."""

import numpy as np
import pytest

from tandem.edge.compute.head import HeadInput, OnnxHead
from tests.references import head_close as close
from tests.references import hf_head_run as hf_run


@pytest.fixture(scope="module")
def head(split_dir):
    return OnnxHead(split_dir)


def test_shapes_are_gqa(head, manifest):
    s = manifest.shape
    assert (s.num_heads, s.num_kv_heads, s.head_dim, s.hidden_size) == (9, 3, 64, 576)
    out = head.run([HeadInput(np.array([1, 2, 3]))])[0]
    assert out.hidden.shape == (3, 576) and out.kv.shape == (manifest.split_layer, 2, 3, 3, 64)


def test_batch_of_ragged_prompts_matches_hf(head, hf_model):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 49152, n).tolist() for n in (37, 5, 120, 1)]
    outs = head.run([HeadInput(np.array(p)) for p in prompts])
    for p, o in zip(prompts, outs, strict=True):
        ref_h, ref_kv = hf_run(hf_model, p, head.k)
        assert o.hidden.shape == ref_h.shape and o.kv.shape == ref_kv.shape
        assert close(o.hidden, ref_h), np.abs(o.hidden - ref_h).max()
        assert close(o.kv, ref_kv)


def test_second_turn_with_past_kv_matches_hf(head, hf_model):
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 49152, 40).tolist(), rng.integers(0, 49152, 9).tolist()
    c, d = rng.integers(0, 49152, 3).tolist(), rng.integers(0, 49152, 30).tolist()
    first = head.run([HeadInput(np.array(a)), HeadInput(np.array(c))])
    second = head.run([HeadInput(np.array(b), first[0].kv), HeadInput(np.array(d), first[1].kv)])
    for x, y, o in ((a, b, second[0]), (c, d, second[1])):
        ref_h, ref_kv = hf_run(hf_model, x + y, head.k)
        assert close(o.hidden, ref_h[len(x) :])
        assert close(o.kv, ref_kv)


def test_one_row_equals_that_row_in_a_batch_and_takes_a_truncated_past(head, hf_model):
    """A row run alone (no batch padding; the past KV passed as views) gives what it gives inside a
    ragged batch, and a past that is a view of a longer KV (a session truncated to its common
    prefix) gives what a fresh run of those tokens gives."""
    rng = np.random.default_rng(2)
    a, b, c = (rng.integers(0, 49152, n).tolist() for n in (50, 17, 8))
    whole = head.run([HeadInput(np.array(a + b))])[0]
    past = whole.kv[:, :, :, : len(a)]  # non-contiguous: the first len(a) tokens of a longer KV
    assert not past.flags.c_contiguous
    alone = head.run([HeadInput(np.array(c), past)])[0]
    batched = head.run([HeadInput(np.array(c), np.ascontiguousarray(past)), HeadInput(np.array(b))])[0]
    assert np.abs(alone.hidden - batched.hidden).max() <= 1e-5 * np.abs(batched.hidden).max()
    assert np.abs(alone.kv - batched.kv).max() <= 1e-5 * np.abs(batched.kv).max()
    ref_h, ref_kv = hf_run(hf_model, a + c, head.k)
    assert close(alone.hidden, ref_h[len(a) :]) and close(alone.kv, ref_kv)


def test_bad_past_shape_is_rejected(head):
    from tandem.common.protocol.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="past_kv"):
        head.run([HeadInput(np.array([1, 2]), np.zeros((head.k, 2, 3, 4, 32), np.float32))])
    with pytest.raises(InvalidRequest, match="token_ids"):
        head.run([HeadInput(np.array([], np.int64))])
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        head.run([HeadInput(np.array([1, head.manifest.shape.vocab_size]))])
    with pytest.raises(InvalidRequest, match="integers"):
        head.run([HeadInput(np.array([1.5]))])
