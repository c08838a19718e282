"""The fidelity benchmark's in-process split path (``benchmarks.teacher.SplitTeacher``) on the real
SmolLM2 split: the ONNX head, the format round trips and the tail and full checkpoints in
transformers, in float32 and in bfloat16 (a GPU cloud's compute dtype); and its edge row's
teacher-forced whole model (``benchmarks.edge_teacher.EdgeTeacher``) on the prepared fp32
``edge-decoder/``."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.benchmarks.edge_teacher import EdgeTeacher
from tandem.benchmarks.teacher import SplitTeacher
from tandem.common.protocol.manifest import FULL_DECODER
from tandem.common.protocol.params import WireDtype

FP32 = (WireDtype.FP32, WireDtype.FP32)
FP16 = (WireDtype.FP16, WireDtype.FP16)


@pytest.fixture(scope="module")
def teachers(split_dir):
    return {d: SplitTeacher(split_dir, 32, threads=2, dtype=d) for d in ("float32", "bfloat16")}


def test_the_split_path_in_bf16_stays_near_fp32_and_its_formats_differ_from_each_other(teachers, tokenizer):
    """Teacher-forced over a prompt past one KV block: every row a log-distribution over the
    vocabulary; bf16's rows near fp32's but not equal to them; within bf16 the fp16 wire pair is
    not bit-identical to the fp32 pair (the round trip reaches the tail)."""
    from tandem.common.protocol.chat import prompt_token_ids

    prompt = prompt_token_ids(tokenizer, [{"role": "user", "content": "Tell me about foxes. " * 6}])
    assert len(prompt) > 32
    reply = [int(t) for t in tokenizer.encode(" Foxes are small wild dogs.")]
    got = {}
    for dtype, t in teachers.items():
        got[dtype] = t.forced(t.head_pass(prompt), reply, [FP32, FP16])  # [2, n, V]
        assert got[dtype].shape == (2, len(reply), t.full.config.vocab_size)
        np.testing.assert_allclose(np.exp(got[dtype]).sum(-1), 1.0, atol=1e-3)
    p32, p16 = np.exp(got["float32"][0]), np.exp(got["bfloat16"][0])
    kl = (p32 * (got["float32"][0] - got["bfloat16"][0])).sum(-1)
    assert 0 < kl.max() < 0.5  # bf16 rounding moves the distributions a little, never far
    assert not np.array_equal(got["bfloat16"][0], got["bfloat16"][1])
    assert np.abs(p16 - p32).max() < 0.2


def test_a_teacher_dtype_other_than_fp32_or_bf16_is_refused(split_dir):
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        SplitTeacher(split_dir, dtype="float16")


@pytest.fixture(scope="module")
def edge_teacher(split_dir):
    return EdgeTeacher(split_dir.parent / FULL_DECODER, "cpu", threads=2)


def test_the_edge_whole_model_forced_along_its_own_greedy_reply_gives_it_back_and_matches_the_split(
    edge_teacher, teachers, tokenizer
):
    """Teacher-forced along the graph's own greedy reply (prefill, then greedy decode steps, as the
    edge runs a turn): every row a log-distribution whose top-1 is that reply's token, and the
    fp32 split path's distributions (the same model) within fp32 rounding."""
    from tandem.common.protocol.chat import prompt_token_ids

    prompt = prompt_token_ids(tokenizer, [{"role": "user", "content": "Tell me about foxes. " * 6}])
    g = edge_teacher.graph
    slot = g.new_kv(len(prompt) + 8)
    greedy = [g.run(slot, prompt, greedy=True)[0]]
    while len(greedy) < 8:
        greedy.append(g.run(slot, [greedy[-1]], greedy=True)[0])
    g.release(slot)
    lp = edge_teacher.forced(prompt, greedy)
    assert lp.shape == (8, g.spec.vocab_size) and edge_teacher.title.endswith("(builder graph, fp32 on cpu)")
    np.testing.assert_allclose(np.exp(lp).sum(-1), 1.0, atol=1e-4)
    assert lp.argmax(-1).tolist() == greedy
    t = teachers["float32"]
    split = t.forced(t.head_pass(prompt), greedy, [FP32])[0]
    assert 0 <= (np.exp(split) * (split - lp)).sum(-1).max() < 1e-4


def test_the_edge_teacher_refuses_a_graph_it_cannot_run_as_built(split_dir, tmp_path):
    """A graph built for another device than the run's, an unchecked build, and an unknown device
    are refused before anything runs."""
    import json

    src = split_dir.parent / FULL_DECODER
    for f in src.iterdir():
        (tmp_path / f.name).symlink_to(f)
    build = json.loads((src / "tandem_build.json").read_text())
    (tmp_path / "tandem_build.json").unlink()
    (tmp_path / "tandem_build.json").write_text(json.dumps(build | {"execution_provider": "cuda"}))
    with pytest.raises(ValueError, match="built for cuda"):
        EdgeTeacher(tmp_path, "cpu")
    with pytest.raises(ValueError, match="built for cpu"):
        EdgeTeacher(src, "cuda")
    with pytest.raises(ValueError, match="cpu or cuda"):
        EdgeTeacher(src, "tpu")
    (tmp_path / "tandem_build.json").write_text(json.dumps(build | {"passed": False}))
    with pytest.raises(ValueError, match="failed its check"):
        EdgeTeacher(tmp_path, "cpu")


def test_the_downlink_teacher_in_fp32_is_the_unsplit_model_and_a_lossy_format_moves_it(teachers, tokenizer, split_dir):
    """Remote prefill's downlink teacher: through fp32 the continuation on the KV that came down is
    the unsplit full model's own teacher-forced pass (the split teacher's fp32 row, same checkpoint);
    int4 moves the distributions past the first token (the cloud's, the same for every format)."""
    from tandem.benchmarks.teacher import RemotePrefillTeacher
    from tandem.common.protocol.chat import prompt_token_ids

    split = teachers["float32"]
    rp = RemotePrefillTeacher(split.manifest.resolve(split_dir, split.manifest.full_checkpoint), 32, 2)
    prompt = prompt_token_ids(tokenizer, [{"role": "user", "content": "Tell me about foxes. " * 6}])
    reply = [int(t) for t in tokenizer.encode(" Foxes are small wild dogs.")]
    got = rp.forced(prompt, reply, [WireDtype.FP32, WireDtype.INT4])  # [2, n, V]
    assert got.shape == (2, len(reply), rp.full.config.vocab_size)
    whole = split.forced(split.head_pass(prompt), reply, [FP32])[0]
    np.testing.assert_allclose(got[0], whole, atol=2e-3)
    np.testing.assert_array_equal(got[1, 0], got[0, 0])
    assert np.abs(got[1, 1:] - got[0, 1:]).max() > 1e-4
