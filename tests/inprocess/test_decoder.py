"""The builder-graph runtime (``edge.compute.decoder.DecoderGraph``) on SmolLM2 built by ONNX Runtime GenAI's
model builder in fp32 for the CPU (``common.model.builder_export``), against HF float32: greedy tokens,
logits of a prefill split in two runs, KV written into and read out of a slot, truncation, chunked
and padded runs against exact ones (alone, in a batch pool row, on a sliding-window model), the
slot's bounds, the bfloat16 storage conversions, the preparation's check and the edge benchmark's
smoke run. One build per module (about 10 s)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tandem.common.model.builder_export import BuilderFailed, add_next_token, build_decoder, check_decoder, load_build
from tandem.common.protocol.chat import prompt_token_ids
from tandem.common.protocol.errors import InvalidRequest
from tandem.edge.compute.decoder import NEXT_TOKEN, DecoderGraph, _as_float32, _held
from tandem.edge.compute.prefill import PrefillPlan

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]
MAX_NEW = 16


@pytest.fixture(scope="module")
def build(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("decoder") / "build-fp32"
    build_decoder(hf_dir, out, "fp32", "cpu")
    return out


@pytest.fixture(scope="module")
def graph(build):
    return DecoderGraph(build, providers=["CPUExecutionProvider"], intra_op_threads=2)


@pytest.fixture(scope="module")
def planned(build):
    """The same build with prefills cut into runs of 16 tokens, padded to 4, 8 or 16, the mask over
    the capacity: the CUDA provider's plan (``PrefillPlan.bucketed``) at a size these prompts cross."""
    plan = PrefillPlan(chunk_tokens=16, bucket_tokens=(4, 8, 16), capacity_mask=True)
    return DecoderGraph(build, providers=["CPUExecutionProvider"], intra_op_threads=2, prefill=plan)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [prompt_token_ids(tokenizer, m) for m in CHATS]


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids) :].tolist()


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def test_the_build_adds_the_argmax_output_once(build, graph):
    import onnx

    m = onnx.load(str(build / "model.onnx"), load_external_data=False)
    add_next_token(build / "model.onnx")
    again = onnx.load(str(build / "model.onnx"), load_external_data=False)
    assert [o.name for o in again.graph.output].count(NEXT_TOKEN) == 1
    assert len(again.graph.node) == len(m.graph.node)
    assert graph.has_next_token and graph.kv_type == "tensor(float)"
    assert not graph.has_sampling  # a CPU build samples on the host (its logits are host memory)
    assert load_build(build).precision == "fp32"


def test_no_capacity_is_warmed_without_cuda_graphs(graph):
    """The CPU provider captures nothing: the warm-up names no capacity (nothing to set up)."""
    assert not graph.cuda_graph and graph.warm_capacities() == []


@pytest.mark.parametrize("which", [0, 1])
def test_greedy_tokens_equal_hf(graph, hf_model, prompts, which):
    ids = prompts[which]
    slot = graph.new_slot(len(ids) + MAX_NEW)
    got, new = [], ids
    for _ in range(MAX_NEW):
        tok, logits, _ = graph.run(slot, new, greedy=True)
        assert logits is None and tok is not None
        got.append(tok)
        new = [tok]
    assert got == hf_greedy(hf_model, ids, MAX_NEW)
    assert slot.tokens == len(ids) + MAX_NEW - 1  # the last token sampled is not run yet


def test_the_logits_path_samples_what_the_argmax_path_returns(graph, prompts):
    ids = prompts[0]
    a, b = graph.new_slot(len(ids) + 4), graph.new_slot(len(ids) + 4)
    tok, _, _ = graph.run(a, ids, greedy=True)
    none, logits, _ = graph.run(b, ids, greedy=False)
    assert none is None and logits.shape == (graph.spec.vocab_size,) and logits.dtype == np.float32
    assert tok == int(np.argmax(logits))


def test_a_prefill_in_two_runs_gives_hf_logits(graph, hf_model, prompts):
    ids = prompts[1]
    slot = graph.new_slot(len(ids))
    half = len(ids) // 2
    rows = np.concatenate([graph.run_rows(slot, ids[:half]), graph.run_rows(slot, ids[half:])])
    ref = hf_logits(hf_model, ids)
    assert rows.shape == ref.shape
    assert np.abs(rows - ref).max() <= 1e-3 * max(1.0, np.abs(ref).max())


def test_kv_written_into_a_slot_continues_as_computed_kv(graph, hf_model, prompts):
    ids = prompts[0]
    src = graph.new_slot(len(ids))
    graph.run_rows(src, ids[:-1])
    past = graph.read_kv(src)
    assert len(past) == 2 * graph.spec.num_layers
    assert past[0].shape == (1, graph.spec.num_kv_heads, len(ids) - 1, graph.spec.head_dim)
    dst = graph.new_slot(len(ids) + 8)
    graph.write_kv(dst, past)
    assert dst.tokens == len(ids) - 1
    _, logits, _ = graph.run(dst, ids[-1:], greedy=False)
    ref = hf_logits(hf_model, ids)[-1]
    assert np.abs(logits - ref).max() <= 1e-3 * max(1.0, np.abs(ref).max())
    np.testing.assert_array_equal(graph.read_kv(dst, len(ids) - 1)[5], past[5])
    # in two parts, the second after the first's tokens (which stay as written)
    half = (len(ids) - 1) // 2
    two = graph.new_slot(len(ids) + 8)
    graph.write_kv(two, [a[:, :, :half] for a in past])
    graph.write_kv(two, [a[:, :, half:] for a in past], start=half)
    assert two.tokens == len(ids) - 1
    for got, want in zip(graph.read_kv(two, len(ids) - 1), past, strict=True):
        np.testing.assert_array_equal(got, want)
    graph.write_kv(two, [a[:, :, :0] for a in past], start=len(ids) - 1)  # no tokens: nothing changes
    assert two.tokens == len(ids) - 1
    _, logits, _ = graph.run(two, ids[-1:], greedy=False)
    assert np.abs(logits - ref).max() <= 1e-3 * max(1.0, np.abs(ref).max())


def test_truncation_recomputes_from_the_kept_prefix(graph, hf_model, prompts):
    ids = prompts[1]
    slot = graph.new_slot(len(ids) + 4)
    graph.run(slot, ids, greedy=True)
    graph.truncate(slot, 5)
    assert slot.tokens == 5 and slot.mask_host[0, 5:].sum() == 0
    _, logits, _ = graph.run(slot, ids[5:], greedy=False)
    ref = hf_logits(hf_model, ids)[-1]
    assert np.abs(logits - ref).max() <= 1e-3 * max(1.0, np.abs(ref).max())


def test_a_slot_grows_keeping_its_kv_and_refuses_past_the_model(graph, hf_model, prompts):
    ids = prompts[0]
    slot = graph.new_slot(4)
    graph.run(slot, ids[:3], greedy=True)
    first = slot.graph_id
    _, logits, _ = graph.run(slot, ids[3:], greedy=False)  # past the 4 tokens: new buffers, KV copied over
    assert slot.capacity_tokens >= len(ids) and slot.tokens == len(ids) and slot.graph_id != first
    ref = hf_logits(hf_model, ids)[-1]
    assert np.abs(logits - ref).max() <= 1e-3 * max(1.0, np.abs(ref).max())
    with pytest.raises(InvalidRequest, match="exceed the model's"):
        graph.run(slot, [1] * (graph.spec.context_tokens - slot.tokens + 1), greedy=True)
    assert slot.tokens == len(ids)
    with pytest.raises(InvalidRequest, match="past must be"):
        graph.write_kv(slot, [np.zeros((1, 3, 2, 64), np.float32)])
    with pytest.raises(InvalidRequest, match="after token 99"):
        graph.write_kv(slot, graph.read_kv(slot, 2), start=99)
    with pytest.raises(ValueError, match="capacity_tokens 0"):
        graph.new_slot(0)


def test_released_slots_serve_the_next_session_with_their_graph(graph):
    a = graph.new_kv(300)
    assert a.capacity_tokens == 512
    graph.run(a, [1, 2, 3], greedy=True)
    kv, gid = a.kv, a.graph_id
    graph.release(a)
    assert a.kv == [] and a.tokens == 0
    b = graph.new_kv(400)
    assert b.kv is kv and b.graph_id == gid and b.tokens == 0 and b.mask_host.sum() == 0
    graph.release(b)
    graph.release(b)  # twice: nothing more


def test_the_cpu_build_runs_every_prefill_at_its_own_length(graph):
    assert graph.prefill == PrefillPlan.EXACT and graph.warm_prefills() == []


@pytest.mark.parametrize("which", [0, 1])
def test_chunked_padded_prefills_equal_hf_and_hold_only_the_real_tokens(planned, hf_model, prompts, which):
    """A prompt cut into 16-token runs, its last run padded, then tokens decoded: the greedy tokens
    are HF's; the slot holds the real tokens only (its mask and ``tokens``), and the KV of every
    held token is what an exact run computes."""
    ids = prompts[which]
    assert len(ids) > 16 and len(ids) % 16 not in (0, 4, 8)  # a chunk and a padded last run
    slot = planned.new_slot(len(ids) + MAX_NEW)
    got, new = [], ids
    for _ in range(MAX_NEW):
        tok, _, _ = planned.run(slot, new, greedy=True)
        got.append(tok)
        new = [tok]
    assert got == hf_greedy(hf_model, ids, MAX_NEW)
    held = len(ids) + MAX_NEW - 1
    assert slot.tokens == held and slot.mask_host[0, :held].all() and not slot.mask_host[0, held:].any()
    exact = DecoderGraph(planned.spec.path.parent, providers=["CPUExecutionProvider"], intra_op_threads=2)
    ref = exact.new_slot(held)
    exact.run(ref, [*ids, *got[:-1]], greedy=True)
    for a, b in zip(planned.read_kv(slot), exact.read_kv(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_padded_runs_after_held_tokens_give_hf_logits_rows_and_samples(planned, hf_model, prompts):
    """Runs of 2, 5 and 11 tokens after held ones (a remote prefill's catch-ups), each padded: the
    logits path, the rows path and the argmax path read the last real row, as HF computes it."""
    ids = prompts[1]
    ref = hf_logits(hf_model, ids)
    tol = 1e-3 * max(1.0, np.abs(ref).max())
    slot = planned.new_slot(len(ids))
    at = len(ids) - 18
    planned.run(slot, ids[:at], greedy=True)
    for n, path in ((2, "logits"), (5, "rows"), (11, "argmax")):
        piece = ids[at : at + n]
        if path == "logits":
            none, logits, _ = planned.run(slot, piece, greedy=False)
            assert none is None and np.abs(logits - ref[at + n - 1]).max() <= tol
        elif path == "rows":
            rows = planned.run_rows(slot, piece)
            assert rows.shape == (n, planned.spec.vocab_size) and np.abs(rows - ref[at : at + n]).max() <= tol
        else:
            tok, _, _ = planned.run(slot, piece, greedy=True)
            assert tok == int(np.argmax(ref[at + n - 1]))
        at += n
        assert slot.tokens == at and not slot.mask_host[0, at:].any()


def test_a_run_without_room_for_its_padding_runs_at_its_own_length(planned, hf_model, prompts):
    """A slot of 256 tokens holding 251: the next 3 tokens would pad to 4 past its end, so they
    run at their own length; the logits are HF's."""
    ids = (prompts[0] * 30)[:254]
    slot = planned.new_slot(256)
    assert slot.capacity_tokens == 256
    planned.run(slot, ids[:251], greedy=True)
    _, logits, _ = planned.run(slot, ids[251:], greedy=False)
    ref = hf_logits(hf_model, ids)[-1]
    assert slot.capacity_tokens == 256 and slot.tokens == 254
    assert np.abs(logits - ref).max() <= 1e-3 * max(1.0, np.abs(ref).max())


def test_a_padded_run_that_fills_the_slot_to_its_capacity_gives_hf_rows(planned, hf_model, prompts):
    """A slot of 256 tokens holding 248: 5 tokens pad to 8, the padding's KV in its last 3
    positions; then 3 tokens (no room for 4: their own length) write over that padding, the slot
    full. Every row is HF's."""
    ids = (prompts[1] * 30)[:256]
    slot = planned.new_slot(256)
    planned.run(slot, ids[:248], greedy=True)
    rows = np.concatenate([planned.run_rows(slot, ids[248:253]), planned.run_rows(slot, ids[253:])])
    ref = hf_logits(hf_model, ids)[248:]
    assert slot.capacity_tokens == 256 and slot.tokens == 256 and slot.mask_host.all()
    assert rows.shape == ref.shape and np.abs(rows - ref).max() <= 1e-3 * max(1.0, np.abs(ref).max())


def test_a_padded_run_in_a_pool_row_then_batched_steps_equal_exact_runs(planned, graph, prompts):
    """Two sessions step together (their KV in a batch pool's rows); one then runs 5 tokens in its
    row (padded to 8: the padding's KV lands in that row past its held tokens), a truncation and a
    padded run after it, and both step on together: every token and the held KV are what exact runs
    of each session alone compute."""
    a, b = planned.new_slot(100), planned.new_slot(100)
    ra, rb = graph.new_slot(100), graph.new_slot(100)
    try:
        ta, tb = planned.run(a, prompts[0], True)[0], planned.run(b, prompts[1], True)[0]
        assert (ta, tb) == (graph.run(ra, prompts[0], True)[0], graph.run(rb, prompts[1], True)[0])

        def steps(n: int) -> None:
            nonlocal ta, tb
            for _ in range(n):
                toks, _, _ = planned.run_batch([a, b], [ta, tb], [True, True])
                want = [graph.run(ra, [ta], True)[0], graph.run(rb, [tb], True)[0]]
                assert toks == want
                ta, tb = toks
            assert a.pool is not None and b.pool is a.pool

        steps(3)
        extra = [ta, *prompts[1][3:7]]  # 5 tokens, padded to 8
        ta = planned.run(a, extra, True)[0]
        assert ta == graph.run(ra, extra, True)[0] and a.pool is not None  # it ran in its row
        assert a.tokens == ra.tokens and not a.mask_host[0, a.tokens :].any()
        steps(3)
        keep = a.tokens - 4  # back 4 tokens, then 6 (padded to 8) over them and the padding's KV
        planned.truncate(a, keep)
        graph.truncate(ra, keep)
        extra = prompts[0][5:11]
        ta = planned.run(a, extra, True)[0]
        assert ta == graph.run(ra, extra, True)[0] and a.pool is not None
        steps(2)
        for got, ref in ((a, ra), (b, rb)):
            assert got.tokens == ref.tokens
            for x, y in zip(planned.read_kv(got), graph.read_kv(ref), strict=True):
                np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)
    finally:
        planned.release(a)
        planned.release(b)
        graph.release(ra)
        graph.release(rb)


@pytest.fixture(scope="module")
def window_build(tmp_path_factory):
    """A tiny Gemma2 (``tests.families``: 4 layers, every other one sliding over 8 tokens) built like
    SmolLM2."""
    from tests.families import build_checkpoint

    root = tmp_path_factory.mktemp("window")
    out = root / "build-fp32"
    build_decoder(build_checkpoint("gemma2", root / "ckpt"), out, "fp32", "cpu")
    return out


def test_padded_runs_of_a_sliding_window_model_equal_exact_runs(window_build):
    """Runs padded past the model's 8-token window (4, 8 or 16 tokens, cut at 16) attend only
    inside each real token's window: the rows and the held KV are an exact run's, and a decode step
    after them computes the exact run's token."""
    plan = PrefillPlan(16, (4, 8, 16), capacity_mask=True)
    planned = DecoderGraph(window_build, providers=["CPUExecutionProvider"], intra_op_threads=2, prefill=plan)
    exact = DecoderGraph(window_build, providers=["CPUExecutionProvider"], intra_op_threads=2)
    assert load_build(window_build).window_tokens == 8 and exact.prefill == PrefillPlan.EXACT
    ids = np.random.default_rng(7).integers(3, 49152, 60).tolist()
    a, b = planned.new_slot(64), exact.new_slot(64)
    for lo, hi in ((0, 21), (21, 24), (24, 37), (37, 59)):  # runs of 16+5, 3, 13, 16+6
        got, want = planned.run_rows(a, ids[lo:hi]), exact.run_rows(b, ids[lo:hi])
        assert got.shape == want.shape and np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
    assert a.tokens == b.tokens == 59 and not a.mask_host[0, 59:].any()
    for x, y in zip(planned.read_kv(a), exact.read_kv(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)
    assert planned.run(a, ids[59:], True)[0] == exact.run(b, ids[59:], True)[0]


def test_the_warm_up_runs_each_padded_length_on_each_capacity_and_holds_nothing(build):
    plan = PrefillPlan(chunk_tokens=8, bucket_tokens=(4, 8), capacity_mask=True)
    g = DecoderGraph(
        build, providers=["CPUExecutionProvider"], intra_op_threads=2, prefill=plan, max_kv_bytes=256 << 20
    )
    caps = g.warm_prefills()
    assert caps[0] == 256 and caps == [256, *g._planned_capacities()] and len(caps) > 1
    assert all(s.tokens == 0 for spares in g._free.values() for s in spares)
    held = sum(s.own_nbytes() for spares in g._free.values() for s in spares)
    assert g.memory.held_bytes == held  # only spares: no session holds anything
    narrow = DecoderGraph(build, providers=["CPUExecutionProvider"], prefill=PrefillPlan(4, (4,), capacity_mask=False))
    assert narrow.warm_prefills() == [256, *narrow._planned_capacities()]  # the KV inputs' shapes name C
    assert narrow.warm_prefills(max_tokens=300) == [256, 512]  # none past what a served turn can hold


def test_bfloat16_storage_round_trips_and_rounds_to_nearest_even():
    import onnxruntime as ort

    exact = np.array([1.0, -2.5, 0.0, 3.140625, 2.0**100], np.float32)  # representable in bfloat16
    v = ort.OrtValue.ortvalue_from_numpy(np.zeros(5, np.uint16))
    v.update_inplace(_held(exact, "tensor(bfloat16)"))
    np.testing.assert_array_equal(_as_float32(v), exact)
    # 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: it rounds to the even neighbour, 1.0;
    # 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: it rounds up to the even one
    halfway = np.array([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-12], np.float32)
    v.update_inplace(_held(np.concatenate([halfway, [0, 0]]).astype(np.float32), "tensor(bfloat16)"))
    np.testing.assert_array_equal(_as_float32(v)[:3], np.array([1.0, 1 + 2**-6, 1 + 2**-7], np.float32))


def test_the_preparation_check_passes_and_is_recorded(build, hf_dir, prompts):
    checked = check_decoder(hf_dir, build, prompts[0])
    assert checked.passed and checked.max_abs_error <= checked.tolerance
    assert load_build(build).checked_tokens == len(prompts[0])


def test_the_builder_refuses_what_it_cannot_build(hf_dir, tmp_path):
    with pytest.raises(ValueError, match="fp32 on CUDA"):
        build_decoder(hf_dir, tmp_path / "x", "fp32", "cuda")
    with pytest.raises(ValueError, match="precision 'fp8'"):
        build_decoder(hf_dir, tmp_path / "x", "fp8", "cpu")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"], "model_type": "nosuch"}))
    with pytest.raises(BuilderFailed, match="model builder failed"):
        build_decoder(bad, tmp_path / "y", "fp32", "cpu")


def test_edge_benchmark_smoke(build, hf_dir, tmp_path):
    from typer.testing import CliRunner

    from tandem.benchmarks.edge_decode import PREFILL_SHAPES, STEPPED_TOKENS, app

    out = tmp_path / "edge"
    args = ["--hf", str(hf_dir), "--out", str(out), "--build-dir", str(build)]
    small = ["--prompt-tokens", "8", "--new-tokens", "3", "--repeats", "1", "--batch-sizes", "1,3"]
    small += ["--prefill-chunk-tokens", "16"]
    r = CliRunner().invoke(app, [*args, *small])
    assert r.exit_code == 0, r.output
    rows = json.loads((out / "edge_decode.json").read_text())["rows"]
    assert {(r["runtime"], r["batch"]) for r in rows} == {
        ("tandem", 1),
        ("genai", 1),
        ("tandem-sampled", 1),
        ("genai-sampled", 1),
        ("tandem-engine-idle", 1),
        ("tandem-engine-new-length", 1),
        ("tandem-engine-new-length-exact", 1),
        *((runtime, b) for runtime in ("tandem-engine", "genai-batch") for b in (1, 3)),
    }
    assert all("error" not in r and r["itl_ms"] > 0 and r["ttft_ms"] > 0 for r in rows), rows
    three = [r for r in rows if r["batch"] == 3]
    assert len(three) == 2 and all(r["aggregate_tokens_per_s"] > 0 for r in three), three
    # the engine rows take the first token apart: its prefill's wait and run, within the TTFT
    engine_rows = [r for r in rows if r["runtime"].startswith("tandem-engine")]
    assert all(0 < r["ttft_run_ms"] and r["ttft_wait_ms"] + r["ttft_run_ms"] <= 2 * r["ttft_ms"] for r in engine_rows)
    sampled = next(r for r in rows if r["runtime"] == "tandem-sampled")
    assert sampled["sampler"] == "host" and sampled["vs_genai"] > 0, sampled  # a CPU build samples on the host
    assert (out / "edge_decode.md").read_text().count("| smollm2-135m |") == 11
    assert (out / "edge_decode.png").stat().st_size > 0
    shapes = json.loads((out / "edge_decode.json").read_text())["prefill_shapes"]
    want = [(h, n) for _, h, n in PREFILL_SHAPES] + [(64, n) for n in STEPPED_TOKENS]
    plans = ["exact", "padded", "bucketed"]
    assert [(r["plan"], r["held_tokens"], r["new_tokens"]) for r in shapes] == [(p, *w) for p in plans for w in want]
    assert all(r["first_ms"] > 0 and r["again_ms"] > 0 for r in shapes), shapes
    warmed = {r["plan"]: r["warmed_capacities"] for r in shapes}
    assert warmed["exact"] == [] and warmed["padded"] == warmed["bucketed"] and len(warmed["bucketed"]) > 1, warmed
    assert (out / "prefill_shapes.md").read_text().count("\n") == 3 * len(want) + 2 + 1 + 3
