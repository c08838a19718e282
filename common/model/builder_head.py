"""The edge's split head built by ONNX Runtime GenAI's model builder: embedding + layers ``[0, k)``.

The builder (``common.model.builder_export.run_builder``) is run with ``num_hidden_layers=k`` and
``exclude_lm_head=true``: its graph then ends in the final norm, whose output it names
``hidden_states``. The split's tail takes the residual stream entering layer ``k`` (HF's
``hidden_states[k]``), not its norm, so ``residual_output`` rewires the graph: the final
``Skip[Simplified]LayerNormalization`` (input + skip, then the norm) becomes the ``Add`` of its
input and skip (its ``input_skip_bias_sum``, the residual), and the output is named ``hidden``
(``HIDDEN``); the norm and its weights are dropped. The rest is the builder's graph as the edge's
decoder runs it: ``GroupQueryAttention`` with rotary fused (keys cached after RoPE, as HF and vLLM
cache them), past and present KV in one buffer per layer.

``build_head(hf, out, k, precision, execution_provider)`` writes ``out/model.onnx`` (+ its external
weights), ``genai_config.json`` (``num_hidden_layers = k``) and a build record (``HeadBuild`` in
``tandem_build.json``); ``check_head`` runs it against HF (the hidden state entering layer ``k`` and
every layer's KV, prefill and a second call after it) and records the result; ``head_problem``
says why a built head must not serve. ``prepare_builder_head`` is the preparation's step per split
(``common.model.prepare``): build, check, keep or remove, and say why not.

Not served by it (the check fails or the builder refuses; preparation then keeps only tandem's
torch.onnx head, ``head.onnx``): families whose builder graph does not compute HF's function
(docs/models.md, "The split heads through the model builder").
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tandem.common.model.builder_export import (
    BUILD_RECORD,
    GENAI_CONFIG,
    BuilderFailed,
    DecoderBuild,
    KVBuffers,
    attention_window,
    build_verdict,
    builder_options,
    check_precision,
    check_problem,
    execution_provider_for,
    run_builder,
    save_build,
)
from tandem.common.model.onnx_export import CHECK_RTOL
from tandem.common.protocol.manifest import EngineAgreement

HEAD_BUILDER_DIR = "head-builder"  # in a split directory: the builder's head (``SplitManifest.builder_head``)
HIDDEN = "hidden"  # the rewired graph's output: the residual entering layer k, [B, S, H]
BUILDER_HIDDEN = "hidden_states"  # the builder's output with ``exclude_lm_head``: the final norm's
SKIP_NORMS = ("SkipSimplifiedLayerNormalization", "SkipLayerNormalization")
HEAD_CHECK_TOKENS = 32  # the check prompt: a prefill of half, then the rest after its KV


class HeadBuild(DecoderBuild):
    """What ``build_head`` wrote (``DecoderBuild``'s fields) and its split layer; the check compares
    the hidden state entering layer ``k`` and the KV of layers ``[0, k)`` (``max_abs_error`` over
    all of them)."""

    split_layer: int
    checkpoint_blake3: str = ""  # what it was built from (``manifest.part_blake3`` of the checkpoint)


def build_head(hf: Path, out: Path, k: int, precision: str = "fp32", execution_provider: str = "cpu") -> HeadBuild:
    """Build embedding + layers ``[0, k)`` of the HF checkpoint ``hf`` into ``out`` with the model
    builder and rewire its output to the residual entering layer ``k`` (``residual_output``).

    Raises:
        ValueError: ``k`` < 1, or a precision / execution provider the builder does not serve
            (``builder_export.check_precision``).
        ImportError: onnxruntime-genai is not installed.
        BuilderFailed: the builder refused the checkpoint, or its graph does not end in a skip norm.
    """
    if k < 1:
        raise ValueError(f"split layer k={k}: at least 1")
    check_precision(precision, execution_provider)
    options = builder_options(precision) | {"num_hidden_layers": str(k), "exclude_lm_head": "true"}
    version = run_builder(hf, out, precision, execution_provider, options)
    residual_output(out / "model.onnx", k)
    build = HeadBuild(
        precision=precision,
        execution_provider=execution_provider,
        builder_version=version,
        window_tokens=attention_window(out / "model.onnx"),
        split_layer=k,
    )
    save_build(out, build)
    return build


def residual_output(model_path: Path, k: int) -> None:
    """Make the graph at ``model_path`` output the residual entering layer ``k`` as ``HIDDEN``, in
    place of the builder's final norm (``BUILDER_HIDDEN``): the final skip norm (found behind any
    ``Cast`` of its output) becomes the ``Add`` of its input, skip and bias inputs, and its weights
    leave the graph (their bytes stay in the external data file). Idempotent.

    Raises:
        BuilderFailed: the graph has neither output, or ``BUILDER_HIDDEN`` does not come from a skip norm.
    """
    import onnx
    from onnx import helper

    m = onnx.load(str(model_path), load_external_data=False)
    outputs = {o.name for o in m.graph.output}
    if HIDDEN in outputs:
        return
    if BUILDER_HIDDEN not in outputs:
        raise BuilderFailed(f"{model_path}: the builder's head has no {BUILDER_HIDDEN!r} output (k={k})")
    producer = {o: n for n in m.graph.node for o in n.output}
    node = producer.get(BUILDER_HIDDEN)
    while node is not None and node.op_type == "Cast":  # a norm computed in float32, cast back
        node = producer.get(node.input[0])
    if node is None or node.op_type not in SKIP_NORMS:
        found = "a graph input" if node is None else node.op_type
        raise BuilderFailed(f"{model_path}: {BUILDER_HIDDEN!r} comes from {found}, not a skip norm (k={k})")
    summands = [node.input[0], node.input[1]] + [x for x in node.input[4:5] if x]  # input, skip, bias
    adds = []
    total = summands[0]
    for j, x in enumerate(summands[1:]):
        name = node.output[0] if j == len(summands) - 2 else f"{node.name}/residual_{j}"
        adds.append(helper.make_node("Add", [total, x], [name], name=f"{node.name}/residual_add_{j}"))
        total = name
    at = list(m.graph.node).index(node)
    weights = set(node.input[2:4]) - {""}  # gamma, beta
    del m.graph.node[at]
    for j, a in enumerate(adds):
        m.graph.node.insert(at + j, a)
    used = {x for n in m.graph.node for x in n.input}
    kept = [t for t in m.graph.initializer if t.name not in weights or t.name in used]
    del m.graph.initializer[:]
    m.graph.initializer.extend(kept)
    for n in m.graph.node:
        for j, o in enumerate(n.output):
            if o == BUILDER_HIDDEN:
                n.output[j] = HIDDEN
    for o in m.graph.output:
        if o.name == BUILDER_HIDDEN:
            o.name = HIDDEN
    onnx.save(m, str(model_path))


def final_norms(model_path: Path) -> list[str]:
    """The names of the graph's norm nodes after its last decoder layer (the builder names them
    ``/model/layers.{L}/final_norm_layernorm/...``); empty for a rewired head."""
    import onnx

    m = onnx.load(str(model_path), load_external_data=False)
    return [n.name for n in m.graph.node if "final_norm" in n.name and "LayerNorm" in n.op_type]


def load_head_build(out: Path) -> HeadBuild:
    """Raises: FileNotFoundError: ``out`` holds no build record; ValueError: not a head's record."""
    return HeadBuild.model_validate(json.loads((out / BUILD_RECORD).read_text()))


def head_problem(out: Path, k: int | None = None) -> str:
    """Why the builder head at ``out`` must not serve (no graph, no record, another split layer,
    never checked or failed its check), or "" when it may."""
    if not (out / GENAI_CONFIG).is_file():
        return f"{out} holds no built head ({GENAI_CONFIG})"
    try:
        build = load_head_build(out)
    except (FileNotFoundError, ValueError) as e:
        return f"{out}/{BUILD_RECORD} is missing or unreadable ({e.__class__.__name__}): run tandem-model again"
    if k is not None and build.split_layer != k:
        return f"{out} is a head of {build.split_layer} layers, not {k}: run tandem-model again"
    return check_problem(out, build)


def head_rtol(precision: str) -> float:
    """The check's relative bound for a head built at ``precision``: ``onnx_export.CHECK_RTOL`` in
    fp32 (the torch.onnx head's bound), the decoder check's ``5e-2`` fp16 and ``1e-1`` bf16 / int4."""
    return {"fp32": CHECK_RTOL, "fp16": 5e-2}.get(precision, 1e-1)


def check_head(hf: Path, out: Path, prompt_ids: list[int], agreement: EngineAgreement | None = None) -> HeadBuild:
    """Run ``prompt_ids`` through the built head in two calls (a prefill of the first half, then
    the rest after its KV, both KV bound as one buffer per layer as the edge binds it) and compare
    with HF (loaded in float32 with ``agreement.export_overrides``): ``hidden`` of every token
    against ``hidden_states[k]``, and every layer's key and value of every token against HF's cache
    (keys after RoPE). Passes when the largest absolute difference is within ``head_rtol(precision)
    * max(1, max |HF|)`` and every value is finite; the result is saved in the build record.

    Raises:
        ValueError: fewer than 2 prompt ids.
        FileNotFoundError: ``out`` holds no build record.
    """
    import numpy as np
    import torch
    from transformers import DynamicCache

    from tandem.common.model.onnx_export import load_hf

    if len(prompt_ids) < 2:
        raise ValueError("the check needs at least 2 prompt ids")
    build = load_head_build(out)
    k = build.split_layer
    half = len(prompt_ids) // 2
    kv = KVBuffers(out, build, max(len(prompt_ids), build.window_tokens + 1))
    got_hidden = np.concatenate([kv.run(prompt_ids[:half], HIDDEN), kv.run(prompt_ids[half:], HIDDEN)])
    got = [got_hidden, *kv.read_kv()]
    model = load_hf(hf, agreement.export_overrides if agreement else None)
    with torch.no_grad():
        ref = model(torch.tensor([prompt_ids]), output_hidden_states=True, past_key_values=DynamicCache())
    want = [ref.hidden_states[k][0].numpy()]
    want += [t[0].numpy() for layer in ref.past_key_values.layers[:k] for t in (layer.keys, layer.values)]
    err = max(_max_diff(g, w) for g, w in zip(got, want, strict=True))
    tol = head_rtol(build.precision) * max(1.0, *(float(np.abs(w).max()) for w in want))
    checked = build.model_copy(
        update={
            "max_abs_error": err,
            "tolerance": tol,
            "checked_tokens": len(prompt_ids),
            "passed": err <= tol,
            "engine_agreement": agreement,
        }
    )
    save_build(out, checked)
    return checked


def _max_diff(got: Any, want: Any) -> float:
    """max |got - want| (infinite where ``got`` is not finite or the shapes differ)."""
    import numpy as np

    if got.shape != want.shape or not np.isfinite(got).all():
        return float("inf")
    return float(np.abs(got - want).max())


def prepare_builder_head(
    split_dir: Path,
    hf: Path,
    k: int,
    precision: str,
    agreement: EngineAgreement,
    vocab_size: int,
    checkpoint_blake3: str,
) -> str:
    """Build and check ``split_dir/head-builder`` (kept when already built from ``checkpoint_blake3``
    at ``precision`` under an agreement as strict, and checked). Returns "" when it is ready, else why the split keeps
    tandem's torch.onnx head alone: the builder is not installed, refuses the checkpoint, or its
    head does not run or fails the check (then the folder is removed). The check prompt runs past
    every switch the deployment reaches (``agreement.check_tokens``); ``hf`` is the checkpoint with
    ``agreement.export_overrides`` in its config (what the builder reads).
    """
    path = split_dir / HEAD_BUILDER_DIR
    if not head_problem(path, k):
        build = load_head_build(path)
        prior = build.engine_agreement
        if (
            build.precision == precision
            and build.checkpoint_blake3 == checkpoint_blake3
            and prior is not None
            and prior.export_overrides == agreement.export_overrides
            and prior.check_tokens >= agreement.check_tokens
        ):
            return ""
    shutil.rmtree(path, ignore_errors=True)
    provider = execution_provider_for(precision)

    def build_and_check() -> HeadBuild:
        build = build_head(hf, path, k, precision, provider)
        save_build(path, build.model_copy(update={"checkpoint_blake3": checkpoint_blake3}))
        ids = [(1 + 7919 * i) % vocab_size for i in range(max(HEAD_CHECK_TOKENS, agreement.check_tokens))]
        return check_head(hf, path, ids, agreement)

    return build_verdict("head", path, build_and_check)
