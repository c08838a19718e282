"""The builder graph's sampler (``common.model.builder_export.sampling_nodes``) run by ONNX Runtime's CPU
provider on random logits, against the host's copy of its rule (``edge.compute.local.sample_token``) and
against vLLM's filters computed in float64: same token for the same draw, only tokens of the
top-k / top-p set, the edge cases that reduce to the argmax, and the draw's distribution."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.common.model.builder_export import (
    PREFIX_BLOCK,
    SAMPLED,
    SAMPLER_FILE,
    SAMPLING,
    TOP_CAP,
    TOP_SAMPLER_FILE,
    blocked_prefix_sum,
    sampling_nodes,
    sampling_row,
    write_sampler,
)
from tandem.common.protocol.params import Sampling
from tandem.edge.compute.local import draw_uniform, sample_token, sampling_rng

V = 4096


def sampler(logits_type: int = 1, vocab: int = V, top_cap: int | None = None):
    """An ONNX Runtime session of the sampler alone (``top_cap``: the top-k sampler): ``logits``
    ``[B, S, vocab]`` of ``logits_type``."""
    import onnxruntime as ort
    from onnx import checker, helper

    nodes, inputs, output = sampling_nodes("logits", vocab, top_cap=top_cap)
    logits = helper.make_tensor_value_info("logits", logits_type, ["batch_size", "sequence_length", vocab])
    graph = helper.make_graph(nodes, "sampler", [logits, *inputs], [output])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)], ir_version=10)
    checker.check_model(model)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def params(rows: int, t, k, p, u) -> np.ndarray:
    """The sampler's ``sampling`` input ``[rows, 4]``: ``t, k, p`` for every row, ``u`` per row."""
    u = np.asarray(u, np.float32).reshape(rows)
    return np.asarray([sampling_row(t, k, p, float(u[r])) for r in range(rows)], np.float32)


@pytest.fixture(scope="module")
def run():
    """Run the sampler (one session per vocabulary size) on ``logits`` ``[B, S, V]``."""
    sessions: dict[int, object] = {}

    def go(logits: np.ndarray, t, k, p, u) -> np.ndarray:
        b, vocab = logits.shape[0], logits.shape[-1]
        sess = sessions.setdefault(vocab, sampler(vocab=vocab))
        return sess.run([SAMPLED], {"logits": logits, SAMPLING: params(b, t, k, p, u)})[0][:, 0]

    return go


def kept_set(row: np.ndarray, s: Sampling) -> set[int]:
    """vLLM's filters in float64: the top-k logits (ties with the k-th kept), then the smallest set of
    most probable tokens whose mass reaches top-p (a token stays while the mass before it is < top_p)."""
    z = row.astype(np.float64) / s.temperature
    if 0 < s.top_k < z.shape[0]:
        z[z < np.sort(z)[-s.top_k]] = -np.inf
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    keep = order[(before < s.top_p) | (np.arange(len(p)) == 0)] if s.top_p < 1 else order
    return {int(i) for i in keep if p[i] > 0}


SETTINGS = [
    Sampling(temperature=1.0),
    Sampling(temperature=0.7, top_k=50),
    Sampling(temperature=1.3, top_p=0.9),
    Sampling(temperature=0.8, top_k=40, top_p=0.95),
    Sampling(temperature=2.0, top_k=V + 10),  # top_k past the vocabulary: off
    Sampling(temperature=1e-3),
    Sampling(temperature=100.0, top_p=0.5),
]


@pytest.mark.parametrize("s", SETTINGS, ids=lambda s: f"t{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_the_graph_picks_the_host_token_within_vllm_filters(run, s):
    rng = np.random.default_rng(11)
    draws = sampling_rng(5)
    logits = (rng.standard_normal((64, 2, V)) * 4).astype(np.float32)
    u = np.asarray([draw_uniform(draws) for _ in range(64)], np.float32)
    got = run(logits, s.temperature, s.top_k, s.top_p, u)
    host = [sample_token(logits[b, -1], s, float(u[b])) for b in range(64)]
    assert [int(g) for g in got] == host  # same float32 rule, same draw
    for b in range(64):
        assert int(got[b]) in kept_set(logits[b, -1], s)


def test_the_edge_settings_reduce_to_the_argmax(run):
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((32, 1, V)) * 2).astype(np.float32)
    argmax = logits[:, -1].argmax(-1)
    u = rng.random(32, dtype=np.float32)
    assert (run(logits, 1.0, 1, 1.0, u) == argmax).all()  # top_k = 1
    assert (run(logits, 1.0, 0, 1e-6, u) == argmax).all()  # a tiny nucleus: the most probable token alone
    assert (run(logits, 1.0, 0, 1.0, np.zeros(32)) == argmax).all()  # the draw 0 is the first sorted token
    hot = run(np.repeat(logits[:1], 32, 0), 1e4, 0, 1.0, u)  # a very high temperature: nearly uniform
    assert len(set(hot.tolist())) > 28


def test_ties_break_to_the_lower_index_as_the_host_does(run):
    logits = np.zeros((4, 1, 16), np.float32)
    logits[:, 0, [3, 7, 11]] = 5.0
    u = np.asarray([0.0, 0.34, 0.67, 0.999], np.float32)
    got = run(logits, 1e-3, 0, 1.0, u)  # the three tied maxima share the mass, in index order
    assert got.tolist() == [3, 7, 11, 11]
    assert got.tolist() == [sample_token(logits[b, 0], Sampling(temperature=1e-3), float(u[b])) for b in range(4)]


def test_the_draws_follow_the_filtered_distribution(run):
    p = np.asarray([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = np.repeat(np.log(p).astype(np.float32)[None, None], 4000, 0)
    u = np.random.default_rng(9).random(4000, dtype=np.float32)
    freq = np.bincount(run(logits, 1.0, 0, 0.75, u), minlength=6) / 4000  # keeps 0, 1, 2 (0.65 before 3)
    assert freq[3:].sum() == 0
    np.testing.assert_allclose(freq[:3], p[:3] / p[:3].sum(), atol=0.03)


def test_half_precision_logits_are_widened_first(run):
    from onnx import TensorProto

    half = sampler(TensorProto.FLOAT16)
    logits = (np.random.default_rng(2).standard_normal((8, 1, V)) * 3).astype(np.float16)
    u = np.linspace(0, 0.99, 8).astype(np.float32)
    got = half.run([SAMPLED], {"logits": logits, SAMPLING: params(8, 0.9, 100, 0.9, u)})[0][:, 0]
    s = Sampling(temperature=0.9, top_k=100, top_p=0.9)
    host = [sample_token(logits[b, 0].astype(np.float32), s, float(u[b])) for b in range(8)]
    assert got.tolist() == host


def _model_with_logits(path, vocab) -> None:
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["batch_size", "sequence_length", vocab])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT16, ["batch_size", "sequence_length", vocab])
    g = helper.make_graph([helper.make_node("Identity", ["x"], ["logits"])], "m", [x], [y])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10), str(path))


def test_write_sampler_writes_the_sampler_beside_the_model_and_leaves_the_model_alone(tmp_path):
    import onnx

    _model_with_logits(tmp_path / "model.onnx", 1000)
    before = (tmp_path / "model.onnx").read_bytes()
    path = write_sampler(tmp_path)
    assert path == tmp_path / SAMPLER_FILE and (tmp_path / "model.onnx").read_bytes() == before
    m = onnx.load(str(path))
    onnx.checker.check_model(m)
    assert [i.name for i in m.graph.input] == ["logits", SAMPLING]
    assert not [n for n in m.graph.node if n.op_type == "Shape"]  # every shape fixed: a CUDA graph can replay it
    assert [o.name for o in m.graph.output] == [SAMPLED]
    assert m.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16  # the model's logits dtype
    top = onnx.load(str(tmp_path / TOP_SAMPLER_FILE))  # the top-k sampler beside it
    onnx.checker.check_model(top)
    assert [i.name for i in top.graph.input] == ["logits", SAMPLING] and [o.name for o in top.graph.output] == [SAMPLED]
    k = next(n for n in top.graph.node if n.output[0] == "sample/v")
    assert onnx.numpy_helper.to_array(k.attribute[0].t).tolist() == [TOP_CAP]


def test_a_vocabulary_within_the_cap_gets_no_top_k_sampler(tmp_path):
    _model_with_logits(tmp_path / "model.onnx", TOP_CAP)
    write_sampler(tmp_path)
    assert (tmp_path / SAMPLER_FILE).is_file() and not (tmp_path / TOP_SAMPLER_FILE).exists()


def test_write_sampler_refuses_a_model_without_a_fixed_vocabulary(tmp_path):
    _model_with_logits(tmp_path / "model.onnx", "vocab")
    with pytest.raises(ValueError, match="fixed V"):
        write_sampler(tmp_path)


def test_the_cumulative_sums_run_over_blocks_not_the_vocabulary(tmp_path):
    """ONNX Runtime's CUDA ``CumSum`` sums each element's whole prefix alone (``n^2`` over an axis of
    ``n``): every cumulative sum of the sampler runs over at most ``PREFIX_BLOCK`` or the block count."""
    import onnx

    vocab = 128256
    _model_with_logits(tmp_path / "model.onnx", vocab)
    m = onnx.shape_inference.infer_shapes(onnx.load(str(write_sampler(tmp_path))))
    shapes = {v.name: [d.dim_value or None for d in v.type.tensor_type.shape.dim] for v in m.graph.value_info}
    sums = [n for n in m.graph.node if n.op_type == "CumSum"]
    assert sums
    for n in sums:
        axis_len = shapes[n.input[0]][-1]
        assert axis_len is not None and axis_len <= max(PREFIX_BLOCK, -(-vocab // PREFIX_BLOCK)), (n.name, axis_len)


@pytest.mark.parametrize("vocab", [1, 7, PREFIX_BLOCK, PREFIX_BLOCK + 1, 5000])
def test_the_blocked_prefix_sum_is_the_cumulative_sum(vocab):
    x = np.random.default_rng(vocab).random(vocab, dtype=np.float32)
    np.testing.assert_allclose(blocked_prefix_sum(x), np.cumsum(x, dtype=np.float64), rtol=1e-5)
    np.testing.assert_allclose(
        blocked_prefix_sum(x, exclusive=True), np.cumsum(x, dtype=np.float64) - x, rtol=1e-5, atol=1e-6
    )


def test_a_vocabulary_off_the_block_size_samples_the_host_token():
    vocab = 1000
    sess = sampler(vocab=vocab)
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((16, 1, vocab)) * 2).astype(np.float32)
    u = rng.random(16, dtype=np.float32)
    for t, k, p in [(1.0, 0, 1.0), (0.7, 40, 1.0), (1.2, 0, 0.9), (0.8, 50, 0.95)]:
        got = sess.run([SAMPLED], {"logits": logits, SAMPLING: params(16, t, k, p, u)})[0][:, 0]
        s = Sampling(temperature=t, top_k=k, top_p=p)
        assert got.tolist() == [sample_token(logits[b, 0], s, float(u[b])) for b in range(16)]


def test_a_top_k_beyond_float32s_exact_integers_keeps_every_token(run):
    """The largest top-k a request may carry (2**31 - 1) travels as 2**24 and keeps the whole
    vocabulary, as top-k 0 does and as the host's rule does."""
    logits = (np.random.default_rng(4).standard_normal((4, 1, V)) * 2).astype(np.float32)
    u = np.asarray([0.1, 0.4, 0.7, 0.95], np.float32)
    big, off = run(logits, 0.9, (1 << 31) - 1, 1.0, u), run(logits, 0.9, 0, 1.0, u)
    s = Sampling(temperature=0.9, top_k=(1 << 31) - 1)
    assert big.tolist() == off.tolist() == [sample_token(logits[b, 0], s, float(u[b])) for b in range(4)]


def test_a_sampler_graph_of_another_layout_is_refused_at_load(tmp_path):
    """A sampler with other inputs (a build of another tandem-model) fails when the decoder loads,
    with what to do, not at the first sampled token."""
    import onnx
    from onnx import TensorProto, helper

    from tandem.edge.compute.decoder import DeviceSampler

    x = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", 8])
    t = helper.make_tensor_value_info("temperature", TensorProto.FLOAT, ["b"])
    y = helper.make_tensor_value_info(SAMPLED, TensorProto.FLOAT, ["b"])
    g = helper.make_graph([helper.make_node("Identity", ["temperature"], [SAMPLED])], "old", [x, t], [y])
    old = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    onnx.save(old, str(tmp_path / "s.onnx"))
    with pytest.raises(ValueError, match="prepare the model again"):
        DeviceSampler(tmp_path / "s.onnx", ["CPUExecutionProvider"], "cpu")


@pytest.mark.parametrize(
    "t, k, p", [(1.0, 1, 1.0), (0.7, 5, 1.0), (0.8, 50, 0.95), (1.3, TOP_CAP, 0.9), (0.5, 20, 0.5)]
)
def test_the_top_k_sampler_gives_the_whole_sorts_token(t, k, p):
    """For rows with ``1 <= top_k <= TOP_CAP`` the sampler over the ``TOP_CAP`` largest logits gives
    the token of the sampler over the whole sort and of the host's rule, at every draw."""
    rng = np.random.default_rng(k)
    logits = (rng.standard_normal((16, 1, V)) * 3).astype(np.float32)
    u = rng.random(16, dtype=np.float32)
    feeds = {"logits": logits, SAMPLING: params(16, t, k, p, u)}
    top = sampler(top_cap=TOP_CAP).run([SAMPLED], feeds)[0][:, 0]
    whole = sampler().run([SAMPLED], feeds)[0][:, 0]
    s = Sampling(temperature=t, top_k=k, top_p=p)
    assert top.tolist() == whole.tolist() == [sample_token(logits[b, 0], s, float(u[b])) for b in range(16)]


def test_the_top_k_sampler_refuses_the_rows_it_cannot_sample_exactly():
    """-1 for a row without top-k, with top-k above the cap, or whose top-k-th value ties with
    values past the cap (top-k keeps them all, the cap cannot hold them); the row beside, exact."""
    logits = (np.random.default_rng(3).standard_normal((4, 1, V)) * 3).astype(np.float32)
    logits[3, 0, : TOP_CAP + 10] = 20.0  # TOP_CAP + 10 equal largest values
    rows = np.asarray(
        [
            sampling_row(1.0, 0, 0.9, 0.5),
            sampling_row(1.0, TOP_CAP + 1, 1.0, 0.5),
            sampling_row(1.0, 10, 1.0, 0.5),
            sampling_row(1.0, 10, 1.0, 0.5),
        ],
        np.float32,
    )
    got = sampler(top_cap=TOP_CAP).run([SAMPLED], {"logits": logits, SAMPLING: rows})[0][:, 0]
    assert got[[0, 1, 3]].tolist() == [-1, -1, -1]
    assert got[2] == sample_token(logits[2, 0], Sampling(temperature=1.0, top_k=10), 0.5)


@pytest.mark.parametrize("cap", [0, PREFIX_BLOCK + 1, V])
def test_a_cap_outside_the_block_and_the_vocabulary_is_refused(cap):
    with pytest.raises(ValueError, match="top_cap"):
        sampling_nodes("logits", V, top_cap=cap)


def test_the_device_sampler_takes_the_top_k_sampler_and_falls_back_to_the_whole_sort(tmp_path):
    """A step whose read rows all have ``1 <= top_k <= TOP_CAP`` runs the top-k sampler; a row it
    answers -1 for (ties past the cap) sends the step to the whole sort; top-k off goes there at
    once. Every read row gets the host's token."""
    import onnxruntime as ort

    from tandem.edge.compute.decoder import DeviceSampler

    _model_with_logits(tmp_path / "model.onnx", V)
    write_sampler(tmp_path)
    dev = DeviceSampler(tmp_path / SAMPLER_FILE, ["CPUExecutionProvider"], "cpu", top_path=tmp_path / TOP_SAMPLER_FILE)
    assert dev.top_cap == TOP_CAP and not dev.captured
    logits = (np.random.default_rng(8).standard_normal((2, 1, V)) * 3).astype(np.float16)
    tied = logits.copy()
    tied[1, 0, : TOP_CAP + 5] = 20.0  # row 1: its 10th value ties with values past the cap

    def host(x: np.ndarray, row: int, k: int) -> int:
        return sample_token(x[row, 0].astype(np.float32), Sampling(temperature=0.9, top_k=k), 0.3)

    def sample(x: np.ndarray, k: int, read: list[int]) -> list[int]:
        value = ort.OrtValue.ortvalue_from_numpy(x)
        params = np.asarray([sampling_row(0.9, k, 1.0, 0.3)] * 2, np.float32)
        return dev.sample(value, 2, "tensor(float16)", params, fixed=True, read=read).tolist()

    assert sample(logits, 10, [0, 1]) == [host(logits, 0, 10), host(logits, 1, 10)]
    assert (dev.runs, dev.top_runs) == (1, 1)
    assert sample(tied, 10, [0])[0] == host(tied, 0, 10)  # row 1's -1 is not read
    assert (dev.runs, dev.top_runs) == (2, 2)
    assert sample(tied, 10, [0, 1]) == [host(tied, 0, 10), host(tied, 1, 10)]  # the whole sort
    assert (dev.runs, dev.top_runs) == (3, 2)
    assert sample(logits, 0, [0, 1]) == [host(logits, 0, 0), host(logits, 1, 0)]
    assert (dev.runs, dev.top_runs) == (4, 2)
