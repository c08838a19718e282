"""The model builder's int4 build of SmolLM2 on the CPU (``common.model.builder_export``: ``MatMulNBits``
weights quantized by ``INT4_OPTIONS``) as the edge runs it (``edge.compute.decoder.DecoderGraph``):
the preparation's check passes on its loss against HF and records it, the graph's KV path equals its
own one-run prefill, its greedy and logits paths agree, and the local model loader runs it on the CPU
provider. One build per module (about 35 s)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tandem.common.model.builder_export import (
    QUANTIZED_MAX_MEAN_KL,
    QUANTIZED_MAX_REL_ERROR,
    build_decoder,
    check_decoder,
    check_problem,
    check_summary,
    execution_provider_for,
    load_build,
    save_build,
)
from tandem.common.protocol.chat import prompt_token_ids
from tandem.edge.compute.decoder import DecoderGraph

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def build(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("decoder") / "build-int4"
    build_decoder(hf_dir, out, "int4", "cpu")
    return out


@pytest.fixture(scope="module")
def graph(build):
    return DecoderGraph(build, providers=["CPUExecutionProvider"], intra_op_threads=2)


@pytest.fixture(scope="module")
def ids(tokenizer) -> list[int]:
    return prompt_token_ids(tokenizer, CHAT)


def test_int4_runs_on_the_cpu_where_onnx_runtime_has_no_cuda_provider():
    import onnxruntime as ort

    cuda = "CUDAExecutionProvider" in ort.get_available_providers()
    assert execution_provider_for("int4") == ("cuda" if cuda else "cpu")
    assert execution_provider_for("fp32") == "cpu" and execution_provider_for("bf16") == "cuda"


def test_the_build_holds_4_bit_weights(build):
    import onnx

    m = onnx.load(str(build / "model.onnx"), load_external_data=False)
    bits = {a.i for n in m.graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"}
    assert 4 in bits  # the body in 4 bits (the LM head and the sensitive layers in 8: INT4_OPTIONS)
    assert load_build(build).precision == "int4" and load_build(build).execution_provider == "cpu"


def test_the_preparation_check_passes_on_its_loss_and_records_it(build, hf_dir):
    vocab = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    prompt = [(1 + 7919 * i) % vocab for i in range(32)]  # the preparation's check prompt
    checked = check_decoder(hf_dir, build, prompt)
    assert checked.passed, check_summary(checked)
    assert 0 < checked.mean_kl <= QUANTIZED_MAX_MEAN_KL and 0 < checked.rel_logit_error <= QUANTIZED_MAX_REL_ERROR
    # 4-bit weights: far outside the logits bound an exact build meets
    assert checked.max_abs_error > checked.tolerance
    assert "mean KL" in check_summary(checked) and check_problem(build, load_build(build)) == ""


def test_the_check_fails_a_graph_whose_second_run_loses_the_first_runs_kv(build, hf_dir, monkeypatch, tmp_path):
    """The check judges each run alone: the check prompt's second half run as if nothing were held
    (its positions and KV from 0, as a KV path that drops what it holds would) fails it, while the
    average over both halves would not tell it from 4-bit rounding."""
    import shutil

    from tandem.common.model import builder_export

    copy = tmp_path / "build-int4"
    shutil.copytree(build, copy)
    run, calls = builder_export.KVBuffers.run, []

    def forgetful(self, ids, output="logits"):
        calls.append(len(ids))
        if len(calls) == 2:
            self.held = 0
        return run(self, ids, output)

    monkeypatch.setattr(builder_export.KVBuffers, "run", forgetful)
    vocab = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    checked = check_decoder(hf_dir, copy, [(1 + 7919 * i) % vocab for i in range(32)])
    assert len(calls) == 2 and not checked.passed
    assert checked.mean_kl > QUANTIZED_MAX_MEAN_KL and checked.rel_logit_error > QUANTIZED_MAX_REL_ERROR


def test_a_failed_int4_check_is_reported_with_its_loss(build, tmp_path):
    bad = load_build(build).model_copy(update={"passed": False, "mean_kl": 3.2, "rel_logit_error": 0.9})
    save_build(tmp_path, bad)
    problem = check_problem(tmp_path, bad)
    assert "mean KL 3.200 nats" in problem and "relative logit error 0.900" in problem


def test_a_prefill_in_two_runs_equals_one_run_of_the_same_graph(graph, ids):
    """The quantized graph's KV path: the prompt run in two pieces gives the logits rows one run
    gives (the same weights either way; the MatMuls' int8 activations are quantized per row)."""
    one = graph.run_rows(graph.new_slot(len(ids)), ids)
    slot = graph.new_slot(len(ids))
    half = len(ids) // 2
    two = np.concatenate([graph.run_rows(slot, ids[:half]), graph.run_rows(slot, ids[half:])])
    assert np.abs(two - one).max() <= 1e-3 * max(1.0, np.abs(one).max())


def test_greedy_decode_steps_take_the_argmax_of_the_logits_path(graph, ids):
    a, b = graph.new_slot(len(ids) + 8), graph.new_slot(len(ids) + 8)
    new_a = new_b = ids
    for _ in range(8):
        tok, _, _ = graph.run(a, new_a, greedy=True)
        none, logits, _ = graph.run(b, new_b, greedy=False)
        assert none is None and tok == int(np.argmax(logits))
        new_a = new_b = [tok]


def test_the_local_model_loader_runs_the_int4_build_on_the_cpu(build, manifest):
    from tandem.edge.compute.local import load_local_model

    model = load_local_model(build, manifest.shape, intra_op_threads=2)
    assert isinstance(model, DecoderGraph) and model.session.get_providers() == ["CPUExecutionProvider"]
