"""The edge's whole model built by ONNX Runtime GenAI's model builder (``onnxruntime_genai.models.builder``).

The builder writes the field's decoder graph for ONNX Runtime: ``GroupQueryAttention`` with rotary
fused, past and present KV in one shared buffer, fused ``SkipSimplifiedLayerNormalization``,
``MatMulNBits`` for int4. tandem drives that graph itself (``edge.compute.decoder``), so preparation adds
one output to it: ``next_token_ids`` int64 ``[B, S]``, the argmax of the logits of each row, so a
greedy decode step returns a token id instead of ``V`` logits. A CUDA build gets the sampler of the
last row as a graph of its own, ``sampler.onnx`` (``write_sampler``): inputs ``logits`` (the
model's) and ``sampling`` float32 ``[B, 4]`` (per row the columns ``SAMPLING_COLUMNS``: temperature,
top-k (0: all), top-p (1: all) and the draw ``uniform`` in ``[0, 1)``), output ``sampled_ids``
int64 ``[B, 1]``, run on the step's device logits only where a row samples, so a sampled decode
step returns a token id too and a greedy one does not pay for the sort (ONNX Runtime runs every
node of a graph on every run; on the CPU the logits are host memory already and the host
samples). Every node runs on the execution provider's device and every shape is fixed by the
inputs' shapes, so ONNX Runtime can capture a run as a CUDA graph and replay it
(``edge.compute.decoder.DeviceSampler``).

``build_decoder(hf, out, precision, execution_provider)`` writes ``out/model.onnx`` (+ its external
weights), ``genai_config.json`` and the tokenizer files the builder copies, and records what it
built in ``out/tandem_build.json``. ``check_decoder`` runs the built graph against HF's logits.

Precisions (the builder's ``-p``): ``fp32`` (the CPU build: exact against the float32 references),
``fp16`` and ``bf16`` (the GPU paths: ONNX Runtime GenAI's fp32 CUDA graph does not load), ``int4``
(``MatMulNBits`` weights quantized by ``INT4_OPTIONS``; on the CPU the builder's default accuracy
level 4, int8 activations in the MatMuls, fp16 on the GPU), on the CPU or the GPU
(``execution_provider_for``). An int4 graph cannot match HF's logits within a rounding bound, so
its check bounds its loss instead (``QUANTIZED_MAX_MEAN_KL``, ``QUANTIZED_MAX_REL_ERROR``); its
structure (binding, positions, KV) is the one the same family's exact builds are checked with.
Needs the ``model`` extra plus ``onnxruntime-genai`` (or ``onnxruntime-genai-cuda``) and ``onnx_ir``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from tandem.common.protocol.manifest import EngineAgreement

BUILD_RECORD = "tandem_build.json"
GENAI_CONFIG = "genai_config.json"  # the builder's description of the graph
PRECISIONS = ("fp32", "fp16", "bf16", "int4")


def has_cuda_provider() -> bool:
    """Whether ONNX Runtime is installed with its CUDA execution provider."""
    try:
        import onnxruntime as ort
    except ImportError:
        return False
    return "CUDAExecutionProvider" in ort.get_available_providers()


def default_precision() -> str:
    """bf16 where ONNX Runtime has its CUDA provider (the dtype of the cloud's vLLM engines, and
    the range of fp32), else fp32 (the CPU build, exact against the float32 references)."""
    return "bf16" if has_cuda_provider() else "fp32"


EXECUTION_PROVIDERS = ("cpu", "cuda")
# The builder's int4 quantization (its --extra_options): k-quant for the body, int8 for the last
# MatMul (the LM head) and llama.cpp's sensitive layers (the first and last eighth of the layers and
# every third layer's qkv / v / down projections; the builder's own description of
# ``matmul_mixed_precision``). On SmolLM2-135M (CPU, 4 prompts teacher-forced against HF fp32) it
# gave mean KL 0.23 nats and top-1 agreement 0.80, against 0.68 and 0.53 for the builder's default
# round-to-nearest int4, at 117 MB of weights against 90 (fp32: 540); a decode step of 6.8 ms
# against fp32's 19.9 on this project's 2-core CPU.
INT4_OPTIONS = {"algo_config": "k_quant", "matmul_mixed_precision": "last_matmul:int8,mixed_layers:int8"}
QUANTIZED_PRECISIONS = ("int4",)
# An int4 build's check (``check_decoder``): the mean over each run's tokens (the check prompt's
# two halves, the second after the first's KV) of the teacher-forced KL(HF || ONNX) (nats) and of
# the relative logit error ||d - mean(d)|| / ||ref - mean(ref)|| (d the difference, each token's
# logits centred: a softmax ignores a shift), the larger of the two runs. ``INT4_OPTIONS`` on
# SmolLM2, CPU: 0.43 and 0.42 on the preparation's check prompt (32 pseudo-random ids; 0.36 and 0.37
# for its second run), 0.23 and 0.33 on natural text; on a random-weight SmolLM2 shape 0.009 and
# 0.28 (both runs together). The second run without the first's KV scores 1.28 and 0.77, logits of
# another position near 0.9 on the second. The bounds leave room for checkpoints that 4-bit weights cost
# more, and catch a quantization or graph that breaks the model; the graph's structure is checked
# exactly by the same family's fp32 and bf16 builds.
QUANTIZED_MAX_MEAN_KL = 1.0
QUANTIZED_MAX_REL_ERROR = 0.6
NEXT_TOKEN = "next_token_ids"
SAMPLED = "sampled_ids"
SAMPLING = "sampling"  # the sampler's per-row parameters, float32 [B, 4]
# its columns; top-k travels as a float32 (exact for any vocabulary below 2**24 tokens)
SAMPLING_COLUMNS = ("temperature", "top_k", "top_p", "uniform")
MIN_TEMPERATURE = 1e-5  # the sampler divides by at least this (vLLM's greedy bound; greedy rows read the argmax)


class BuilderFailed(RuntimeError):
    """The model builder exited with an error (its last line is in the message)."""


class DecoderBuild(BaseModel):
    """What ``build_decoder`` wrote: the builder's precision and execution provider, the builder's
    version, and the check against HF (largest absolute logit difference, its bound, tokens run)."""

    model_config = ConfigDict(frozen=True)

    precision: str
    execution_provider: str
    builder_version: str
    window_tokens: int = 0  # the largest sliding window of the graph's attention (0: none); a KV buffer holds more
    max_abs_error: float | None = None
    tolerance: float | None = None
    # a quantized build's check: the mean teacher-forced KL (nats) and relative logit error against HF
    mean_kl: float | None = None
    rel_logit_error: float | None = None
    checked_tokens: int = 0
    passed: bool | None = None
    # the agreement it was built and checked under (``common.model.switches``; None: before it was recorded)
    engine_agreement: EngineAgreement | None = None


def build_decoder(hf: Path, out: Path, precision: str = "fp32", execution_provider: str = "cpu") -> DecoderBuild:
    """Build the whole model of the HF checkpoint ``hf`` into ``out`` and add ``next_token_ids``,
    and for a CUDA build the sampler's graph (``write_sampler``).

    Raises:
        ValueError: an unknown ``precision`` or ``execution_provider``, or a pair the builder does
            not serve (fp32 on CUDA: ONNX Runtime GenAI's fp32 CUDA graph does not load).
        ImportError: onnxruntime-genai is not installed.
        BuilderFailed: the builder refused the checkpoint (an architecture it does not know, ...).
    """
    check_precision(precision, execution_provider)
    version = run_builder(hf, out, precision, execution_provider, builder_options(precision))
    add_next_token(out / "model.onnx")
    if execution_provider == "cuda":  # on the CPU the logits are host memory already: the host samples
        write_sampler(out)
    build = DecoderBuild(
        precision=precision,
        execution_provider=execution_provider,
        builder_version=version,
        window_tokens=attention_window(out / "model.onnx"),
    )
    save_build(out, build)
    return build


def builder_options(precision: str) -> dict[str, str]:
    """The builder's extra options a build at ``precision`` adds (``INT4_OPTIONS`` for int4)."""
    return dict(INT4_OPTIONS) if precision == "int4" else {}


def execution_provider_for(precision: str) -> str:
    """Where a build at ``precision`` runs: ``cpu`` for fp32, ``cuda`` for fp16 and bf16, and for
    int4 ``cuda`` where ONNX Runtime offers its CUDA provider, else ``cpu``."""
    if precision == "fp32":
        return "cpu"
    if precision == "int4":
        return "cuda" if has_cuda_provider() else "cpu"
    return "cuda"


def check_precision(precision: str, execution_provider: str) -> None:
    """Raises:
    ValueError: an unknown ``precision`` or ``execution_provider``, or fp32 on CUDA (ONNX Runtime
        GenAI's fp32 CUDA graph does not load)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: one of {', '.join(PRECISIONS)}")
    if execution_provider not in EXECUTION_PROVIDERS:
        raise ValueError(f"execution provider {execution_provider!r}: one of {', '.join(EXECUTION_PROVIDERS)}")
    if precision == "fp32" and execution_provider == "cuda":
        raise ValueError("fp32 on CUDA: the builder's fp32 CUDA graph does not load; use fp16 or bf16")


def run_builder(
    hf: Path, out: Path, precision: str, execution_provider: str, extra_options: dict[str, str] | None = None
) -> str:
    """Run the model builder's CLI (its stable interface) on ``hf`` into ``out`` with ``extra_options``
    (its ``--extra_options key=value``); returns the builder's version.

    Raises:
        ImportError: onnxruntime-genai is not installed.
        BuilderFailed: the builder exited with an error.
    """
    import onnxruntime_genai

    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out)]
    cmd += ["-p", precision, "-e", execution_provider, "-c", str(out / ".builder-cache")]
    if extra_options:
        cmd += ["--extra_options", *(f"{k}={v}" for k, v in extra_options.items())]
    r = subprocess.run(cmd, capture_output=True, text=True)
    shutil.rmtree(out / ".builder-cache", ignore_errors=True)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        raise BuilderFailed(
            f"onnxruntime_genai's model builder failed on {hf} ({precision}, {execution_provider}): {tail[0]}"
        )
    return str(getattr(onnxruntime_genai, "__version__", "unknown"))


def add_next_token(model_path: Path) -> None:
    """Append ``next_token_ids = ArgMax(logits, axis=-1)`` (int64 ``[B, S]``, the first index of
    a tie, as ``numpy.argmax``) to the graph at ``model_path``, once; the weights stay external."""
    import onnx
    from onnx import TensorProto, helper

    m = onnx.load(str(model_path), load_external_data=False)
    if any(o.name == NEXT_TOKEN for o in m.graph.output):
        return
    m.graph.node.append(helper.make_node("ArgMax", ["logits"], [NEXT_TOKEN], axis=-1, keepdims=0))
    m.graph.output.append(
        helper.make_tensor_value_info(NEXT_TOKEN, TensorProto.INT64, ["batch_size", "sequence_length"])
    )
    onnx.save(m, str(model_path))


SAMPLER_FILE = "sampler.onnx"
PREFIX_BLOCK = 256  # the sampler's prefix sums run per block of this many tokens, then over the blocks
# the top-k sampler (``sampling_nodes(top_cap=)``): sorts only the ``TOP_CAP`` largest logits, for
# rows whose top-k is at most that (20 to 64 are what clients send; HF's default is 50)
TOP_CAP = 64
TOP_SAMPLER_FILE = f"sampler-top{TOP_CAP}.onnx"


def write_sampler(build_dir: Path) -> Path:
    """Write ``build_dir/sampler.onnx``: the sampler (``sampling_nodes``) of the last row of the
    logits of the build's ``model.onnx`` as a graph of its own, input ``logits`` ``[B, S, V]`` in
    the model's logits dtype plus the sampler's ``sampling`` input, output ``sampled_ids`` int64
    ``[B, 1]``; and beside it ``TOP_SAMPLER_FILE``, the same rule over the ``TOP_CAP`` largest logits
    (``sampling_nodes(top_cap=TOP_CAP)``, for rows with ``1 <= top_k <= TOP_CAP``) where the
    vocabulary is larger than that. Returns the first's path.

    Raises:
        ValueError: the model has no ``logits`` output with a fixed vocabulary size.
    """
    import onnx

    m = onnx.load(str(build_dir / "model.onnx"), load_external_data=False)
    out = next((o for o in m.graph.output if o.name == "logits"), None)
    dims = [] if out is None else list(out.type.tensor_type.shape.dim)
    if out is None or len(dims) != 3 or not dims[-1].HasField("dim_value"):
        raise ValueError(f"{build_dir / 'model.onnx'}: no logits output [B, S, V] with a fixed V")
    vocab = int(dims[-1].dim_value)
    opset = max((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), default=17)
    path = build_dir / SAMPLER_FILE
    _save_sampler(path, out.type.tensor_type.elem_type, vocab, max(opset, 18), m.ir_version, None)
    top = build_dir / TOP_SAMPLER_FILE
    top.unlink(missing_ok=True)
    if vocab > TOP_CAP:
        _save_sampler(top, out.type.tensor_type.elem_type, vocab, max(opset, 18), m.ir_version, TOP_CAP)
    return path


def _save_sampler(path: Path, logits_type: int, vocab: int, opset: int, ir_version: int, top_cap: int | None) -> None:
    """Write the sampler graph (``sampling_nodes(top_cap=)``) for logits of ``logits_type`` over
    ``vocab`` tokens to ``path``, checked by ONNX's checker."""
    import onnx
    from onnx import helper

    nodes, inputs, output = sampling_nodes("logits", vocab, top_cap=top_cap)
    logits = helper.make_tensor_value_info("logits", logits_type, ["batch_size", "sequence_length", vocab])
    graph = helper.make_graph(nodes, "tandem_sampler", [logits, *inputs], [output])
    sampler = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    sampler.ir_version = ir_version
    onnx.checker.check_model(sampler)
    onnx.save(sampler, str(path))


def sampling_nodes(logits: str, vocab_size: int, top_cap: int | None = None) -> tuple[list[Any], list[Any], Any]:
    """The nodes, inputs and output of the sampler of the last row of ``logits`` ``[B, S, V]``
    (float32, float16 or bfloat16; ``V = vocab_size``), in standard ONNX ops (opset 18 and later),
    per row ``b``:

    ``z = float32(logits[b, -1]) / max(temperature[b], MIN_TEMPERATURE)``; sort ``z`` descending
    (``TopK`` over ``V``, ``K`` a constant; equal values in index order); keep the values ``>=``
    the ``top_k``-th (``top_k <= 0``: all); ``p = softmax`` of the kept; keep the tokens whose
    exclusive cumulative mass (of the more probable ones) is ``< top_p`` (``top_p >= 1``: all; the
    first always stays); ``q`` the kept ``p``, ``cdf = cumsum(q)``; the token is the sorted index
    ``i`` = the number of ``cdf <= uniform[b] * cdf[-1]``, clipped to the last ``q > 0``, i.e. the
    inverse CDF at ``uniform``, where ``temperature, top_k, top_p, uniform`` are the row's
    ``sampling`` columns (``SAMPLING_COLUMNS``). ``edge.compute.local.sample_token`` is the host's
    copy of the rule. Every value is computed on the execution provider's device (no ``Shape``
    node: TopK's ``K`` is a constant), ranks and counts in float32. The cumulative sums run in
    blocks of ``PREFIX_BLOCK`` (``blocked_prefix_sum``, the host's copy): ONNX Runtime's CUDA
    ``CumSum`` sums every output element's whole prefix on its own, ``V^2`` additions (about 8 ms a
    step at ``V`` = 128256 on an H100), blocks make it ``V * PREFIX_BLOCK``.

    ``top_cap`` (``C``, at most ``PREFIX_BLOCK`` and below ``V``): the top-k sampler, which sorts only
    the ``C`` largest ``z`` (``TopK`` with ``K = C``; the rest of the rule runs over those ``C``) and
    gives the same token as the whole sort for a row with ``1 <= top_k <= C`` and at most ``C``
    values ``>=`` its ``top_k``-th (the tokens top-k keeps are then among the ``C``, and so are
    those top-p keeps of them); any other row gets ``-1``, for the caller to sample with the whole
    sort.

    Returns ``(nodes, graph inputs, graph output)``; node and intermediate names start ``sample/``.

    Raises:
        ValueError: ``top_cap`` is not in ``[1, min(PREFIX_BLOCK, V - 1)]``.
    """
    width = vocab_size if top_cap is None else top_cap
    if top_cap is not None and not 1 <= top_cap <= min(PREFIX_BLOCK, vocab_size - 1):
        most = min(PREFIX_BLOCK, vocab_size - 1)
        raise ValueError(f"top_cap {top_cap}: 1 to {most} for a vocabulary of {vocab_size}")
    from onnx import TensorProto, helper

    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    nodes: list[Any] = []

    def const(name: str, value: Any, dtype: int, dims: list[int]) -> str:
        out = f"sample/{name}"
        t = helper.make_tensor(out + "_value", dtype, dims, value)
        nodes.append(helper.make_node("Constant", [], [out], value=t))
        return out

    def op(kind: str, ins: list[str], name: str, outs: int = 1, **attrs: Any) -> Any:
        names = [f"sample/{name}"] if outs == 1 else [f"sample/{name}_{j}" for j in range(outs)]
        nodes.append(helper.make_node(kind, ins, names, name=f"sample/{name}_node", **attrs))
        return names[0] if outs == 1 else names

    last, last1 = const("last", [-1], i64, []), const("last1", [-1], i64, [1])
    axis1, axis = const("axis1", [1], i64, [1]), const("axis", [1], i64, [])
    zero, one, min_t = const("zero", [0.0], f, []), const("one", [1.0], f, []), const("min_t", [MIN_TEMPERATURE], f, [])
    ninf, inf = const("ninf", [float("-inf")], f, []), const("inf", [float("inf")], f, [])

    def rows(name: str) -> str:  # a ``sampling`` column as ``[B, 1]``
        column = const(f"{name}_column", [SAMPLING_COLUMNS.index(name)], i64, [1])
        return op("Gather", [SAMPLING, column], f"{name}_b", axis=1)

    blocks = -(-width // PREFIX_BLOCK)
    padded = blocks * PREFIX_BLOCK
    if blocks > 1:
        pads = const("pads", [0, 0, 0, padded - width], i64, [4])
        as_blocks = const("as_blocks", [0, blocks, PREFIX_BLOCK], i64, [3])
        as_rows, axis2 = const("as_rows", [0, padded], i64, [2]), const("axis2", [2], i64, [])
        axes2 = const("axes2", [2], i64, [1])
        v_start, v_end = const("v_start", [0], i64, [1]), const("v_end", [width], i64, [1])
        block_last = const("block_last", [PREFIX_BLOCK - 1], i64, [1])

    def prefix(x: str, name: str, exclusive: bool = False) -> str:
        """``blocked_prefix_sum`` of ``x`` ``[B, W]``: in-block sums, plus the sums of the blocks before
        (one block: the plain sequential sum, the same order)."""
        if blocks == 1:
            return op("CumSum", [x, axis], name, exclusive=int(exclusive))
        x3 = op("Reshape", [op("Pad", [x, pads], f"{name}_pad"), as_blocks], f"{name}_blocks")  # [B, nb, blk]
        inner = op("CumSum", [x3, axis2], f"{name}_inner")
        totals = op("Squeeze", [op("Gather", [inner, block_last], f"{name}_tot1", axis=2), axes2], f"{name}_tot")
        offs = op("CumSum", [totals, axis], f"{name}_offs", exclusive=1)  # [B, nb]
        if exclusive:
            inner = op("CumSum", [x3, axis2], f"{name}_inner_ex", exclusive=1)
        whole = op("Add", [inner, op("Unsqueeze", [offs, axes2], f"{name}_offs3")], f"{name}_sum3")
        flat = op("Reshape", [whole, as_rows], f"{name}_flat")
        return op("Slice", [flat, v_start, v_end, axis1], name)

    x = op("Cast", [op("Gather", [logits, last], "row", axis=1)], "x", to=f)  # [B, V]
    z = op("Div", [x, op("Max", [rows("temperature"), min_t], "t")], "z")
    # the sort: the W = V (or top_cap) largest, descending, equal values in index order
    vals, idx = op("TopK", [z, const("v", [width], i64, [1])], "sorted", outs=2, axis=-1, largest=1, sorted=1)
    # ranks and counts in float32 (exact below 2**24): every op stays on the device's kernels
    rank = const("rank", [float(r) for r in range(width)], f, [width])
    k = rows("top_k")
    kth = op("ReduceMin", [op("Where", [op("Less", [rank, k], "in_k"), vals, inf], "top"), axis1], "kth", keepdims=1)
    keep_k = op("Or", [op("LessOrEqual", [k, zero], "k_off"), op("GreaterOrEqual", [vals, kth], "k_in")], "keep_k")
    p = op("Softmax", [op("Where", [keep_k, vals, ninf], "masked")], "p", axis=-1)
    before = prefix(p, "before", exclusive=True)  # the mass of the more probable tokens
    tp = rows("top_p")
    keep_p = op("Or", [op("GreaterOrEqual", [tp, one], "p_off"), op("Less", [before, tp], "p_in")], "keep_p")
    q = op("Where", [keep_p, p, zero], "q")
    cdf = prefix(q, "cdf")
    target = op("Mul", [rows("uniform"), op("Gather", [cdf, last1], "total", axis=1)], "target")  # [B, 1]
    count = op("ReduceSum", [op("Cast", [op("LessOrEqual", [cdf, target], "le")], "below", to=f), axis1], "count")
    kept = op("ReduceSum", [op("Cast", [op("Greater", [q, zero], "gt")], "positive", to=f), axis1], "kept")
    at = op("Max", [op("Min", [count, op("Sub", [kept, one], "last_kept")], "clip"), zero], "at_f")
    at = op("Cast", [at], "at", to=i64)  # [B, 1]
    if top_cap is None:
        nodes.append(helper.make_node("GatherElements", [idx, at], [SAMPLED], name="sample/token", axis=1))
    else:  # -1 where the C largest cannot hold what top-k keeps: top_k off or above C, or ties past C
        cap = const("cap", [float(top_cap)], f, [])
        ties = op("ReduceSum", [op("Cast", [op("GreaterOrEqual", [z, kth], "ge_kth")], "ge", to=f), axis1], "ties")
        beyond = op("Or", [op("Greater", [k, cap], "k_big"), op("Greater", [ties, cap], "tie_big")], "beyond")
        inexact = op("Or", [op("LessOrEqual", [k, zero], "k_none"), beyond], "inexact")
        token = op("GatherElements", [idx, at], "token", axis=1)
        nodes.append(
            helper.make_node("Where", [inexact, const("none", [-1], i64, []), token], [SAMPLED], name="sample/pick")
        )
    inputs = [helper.make_tensor_value_info(SAMPLING, f, ["batch_size", len(SAMPLING_COLUMNS)])]
    return nodes, inputs, helper.make_tensor_value_info(SAMPLED, i64, ["batch_size", 1])


def blocked_prefix_sum(x: Any, exclusive: bool = False) -> Any:
    """The cumulative sum of float32 ``x`` ``[V]`` in the sampler graph's order (``sampling_nodes``):
    sequential sums within blocks of ``PREFIX_BLOCK`` (the last padded with zeros), plus the
    sequential exclusive sum of the blocks' totals before each block, in float32. ``exclusive``:
    each element's sum leaves itself out."""
    import numpy as np

    v = x.shape[0]
    blocks = -(-v // PREFIX_BLOCK)
    padded = np.zeros(blocks * PREFIX_BLOCK, np.float32)
    padded[:v] = x
    x3 = padded.reshape(blocks, PREFIX_BLOCK)
    inner = np.cumsum(x3, axis=1, dtype=np.float32)
    offs = np.concatenate([np.zeros(1, np.float32), np.cumsum(inner[:, -1], dtype=np.float32)[:-1]])
    if exclusive:
        inner = np.concatenate([np.zeros((blocks, 1), np.float32), inner[:, :-1]], axis=1)
    return (inner + offs[:, None]).reshape(-1)[:v]


def neutral_sampling(rows: int) -> Any:
    """The sampler's ``sampling`` input, float32 ``[rows, 4]``, for rows whose sample is not read
    (temperature 1, no filter, draw 0): every row of a run is sampled, since ONNX Runtime runs every
    node on the whole batch."""
    import numpy as np

    return np.tile(np.asarray([[1.0, 0.0, 1.0, 0.0]], np.float32), (rows, 1))


def sampling_row(temperature: float, top_k: int, top_p: float, uniform: float) -> list[float]:
    """One row of the sampler's ``sampling`` input (``SAMPLING_COLUMNS``). A ``top_k`` beyond 2**24
    (where float32 stops being exact) is sent as 2**24: both keep every token of any vocabulary
    below that size."""
    return [temperature, float(min(top_k, 1 << 24)), top_p, uniform]


def attention_window(model_path: Path) -> int:
    """The largest ``local_window_size`` of the graph's ``GroupQueryAttention`` nodes (0 when none
    slides): ONNX Runtime refuses a KV buffer that holds fewer tokens."""
    import onnx

    m = onnx.load(str(model_path), load_external_data=False)
    sizes = [
        int(onnx.helper.get_attribute_value(a))
        for n in m.graph.node
        if n.op_type == "GroupQueryAttention"
        for a in n.attribute
        if a.name == "local_window_size"
    ]
    return max([0, *sizes])


def save_build(out: Path, build: DecoderBuild) -> None:
    (out / BUILD_RECORD).write_text(build.model_dump_json(indent=2))


def load_build(out: Path) -> DecoderBuild:
    """Raises: FileNotFoundError: ``out`` holds no build record."""
    return DecoderBuild.model_validate(json.loads((out / BUILD_RECORD).read_text()))


def decoder_problem(out: Path) -> str:
    """Why the built decoder at ``out`` must not serve (no graph, no record, never checked or failed
    its check), or "" when it may."""
    if not (out / GENAI_CONFIG).is_file():
        return f"{out} holds no built decoder ({GENAI_CONFIG})"
    try:
        build = load_build(out)
    except (FileNotFoundError, ValueError) as e:
        return f"{out}/{BUILD_RECORD} is missing or unreadable ({e.__class__.__name__}): run tandem-model again"
    return check_problem(out, build)


def check_problem(out: Path, build: DecoderBuild) -> str:
    """ "" when the build at ``out`` (a whole model or a head) passed its check against HF, else why
    not, as a start-up check reports it."""
    if build.passed:
        return ""
    err = "never checked" if build.passed is None else check_summary(build)
    return f"{out} failed its check against HF ({err}): run tandem-model again"


def check_summary(build: DecoderBuild) -> str:
    """The check's measure against its bound, as the preparation and a start-up check print it:
    a quantized build's mean KL and relative logit error, an exact one's largest logit difference."""
    if build.mean_kl is not None and build.rel_logit_error is not None:
        return (
            f"mean KL {build.mean_kl:.3f} nats (bound {QUANTIZED_MAX_MEAN_KL}), relative logit error "
            f"{build.rel_logit_error:.3f} (bound {QUANTIZED_MAX_REL_ERROR})"
        )
    if build.max_abs_error is None or build.tolerance is None:
        return "no measure recorded"
    rel = "<=" if build.max_abs_error <= build.tolerance else ">"
    return f"max |ONNX - HF| {build.max_abs_error:.2e} {rel} {build.tolerance:.2e}"


def build_verdict(what: str, path: Path, build_and_check: Callable[[], DecoderBuild]) -> str:
    """Run ``build_and_check`` (a build into ``path`` and its check against HF; returns the check's
    record). Returns "" when the build passed its check, else why not, ``path`` removed: the builder
    is not installed, refuses the checkpoint, the built ``what`` ("decoder", "head") does not run
    the check's prompt, or differs from HF beyond the check's tolerance."""
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument, RuntimeException

    try:
        checked = build_and_check()
    except ImportError as e:
        return f"the model builder is not installed ({e.name}): pip install tandem[builder]"
    except (BuilderFailed, ValueError) as e:
        shutil.rmtree(path, ignore_errors=True)
        return str(e)
    except (Fail, InvalidArgument, RuntimeException) as e:  # the built graph does not run the check's prompt
        shutil.rmtree(path, ignore_errors=True)
        return f"the built {what} does not run the check ({str(e).splitlines()[0][-200:]})"
    if not checked.passed:
        shutil.rmtree(path, ignore_errors=True)
        return f"the built {what} differs from HF: {check_summary(checked)}"
    return ""


def check_decoder(hf: Path, out: Path, prompt_ids: list[int], rtol: float = 1e-4) -> DecoderBuild:
    """Run ``prompt_ids`` through the built graph in two chunks (a prefill, then the rest after the
    first chunk's KV, as a later turn runs) and compare the logits of every token with HF's, in
    float32; the result is saved in the build record. The graph runs on ONNX Runtime's CPU provider
    for a CPU build, else on its CUDA provider.

    The bound is ``rtol * max(1, max |HF logit|)``; fp16/bf16 builds get the wider bounds of
    their arithmetic (``1e-4`` fp32: the builds of the families that pass differ by 2e-5 of the
    largest logit at most; ``5e-2`` fp16, ``1e-1`` bf16). A quantized build (int4) passes on its
    loss instead (``quantized_loss``, of each run alone, the larger recorded): mean KL within
    ``QUANTIZED_MAX_MEAN_KL`` and relative logit error within ``QUANTIZED_MAX_REL_ERROR``; its
    largest difference is recorded too.

    Raises:
        ValueError: fewer than 2 prompt ids.
    """
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    if len(prompt_ids) < 2:
        raise ValueError("the check needs at least 2 prompt ids")
    build = load_build(out)
    rtol = {"fp32": rtol, "fp16": 5e-2}.get(build.precision, 1e-1)
    half = len(prompt_ids) // 2
    kv = KVBuffers(out, build, max(len(prompt_ids), build.window_tokens + 1))
    first = kv.run(prompt_ids[:half])
    second = kv.run(prompt_ids[half:])
    got = np.concatenate([first, second])
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([prompt_ids])).logits[0].numpy()
    err = float(np.abs(got - ref).max())
    tol = rtol * max(1.0, float(np.abs(ref).max()))
    update: dict[str, Any] = {"max_abs_error": err, "tolerance": tol, "checked_tokens": len(prompt_ids)}
    if build.precision in QUANTIZED_PRECISIONS:  # each run on its own: the second is the KV path's
        losses = [quantized_loss(ref[:half], got[:half]), quantized_loss(ref[half:], got[half:])]
        kl, rel = max(x[0] for x in losses), max(x[1] for x in losses)
        update |= {"mean_kl": kl, "rel_logit_error": rel}
        update["passed"] = kl <= QUANTIZED_MAX_MEAN_KL and rel <= QUANTIZED_MAX_REL_ERROR
    else:
        update["passed"] = bool(np.isfinite(got).all()) and err <= tol
    checked = build.model_copy(update=update)
    save_build(out, checked)
    return checked


def quantized_loss(ref: Any, got: Any) -> tuple[float, float]:
    """A quantized graph's loss against the reference logits, both float ``[T, V]``: the mean over
    the ``T`` tokens of the teacher-forced KL(ref || got) in nats, and of the relative logit error
    ``||d - mean(d)|| / ||ref - mean(ref)||`` (``d = got - ref``; each row centred, as a softmax
    ignores a shift). Non-finite logits give ``inf`` for both."""
    import numpy as np

    ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    if not np.isfinite(got).all():
        return float("inf"), float("inf")
    lp = ref - ref.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    lq = got - got.max(-1, keepdims=True)
    lq -= np.log(np.exp(lq).sum(-1, keepdims=True))
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    r = ref - ref.mean(-1, keepdims=True)
    d = got - ref
    d -= d.mean(-1, keepdims=True)
    rel = np.sqrt((d * d).sum(-1) / np.maximum((r * r).sum(-1), 1e-30))
    return float(kl.mean()), float(rel.mean())


class KVBuffers:
    """The built graph run as the edge runs it (``edge.compute.decoder``): one KV buffer per layer input of
    ``capacity`` tokens bound as past and present, the mask over the tokens held and new; every
    other output bound to the host. The preparation's own copy of that binding (``common`` does not
    import the edge); the KV is held in its storage type (bfloat16 as uint16 bits) and bound by address."""

    def __init__(self, out: Path, build: DecoderBuild, capacity: int) -> None:
        import numpy as np
        import onnxruntime as ort

        dec = json.loads((out / GENAI_CONFIG).read_text())["model"]["decoder"]
        cuda = build.execution_provider == "cuda"
        names = ["CUDAExecutionProvider", "CPUExecutionProvider"] if cuda else ["CPUExecutionProvider"]
        self.sess = ort.InferenceSession(str(out / dec["filename"]), providers=names)
        self.device = "cuda" if "CUDAExecutionProvider" in self.sess.get_providers() else "cpu"
        self.shape = [1, dec["num_key_value_heads"], capacity, dec["head_size"]]
        past = [i for i in self.sess.get_inputs() if i.name.startswith("past_key_values.")]
        # by layer, key then value: past_key_values.{i}.key / .value
        past.sort(key=lambda i: (int(i.name.split(".")[1]), i.name.endswith(".value")))
        self.types = {i.name: i.type for i in past}
        storage = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(bfloat16)": np.uint16}
        self.kv = {
            i.name: ort.OrtValue.ortvalue_from_numpy(np.zeros(self.shape, storage[i.type]), self.device, 0)
            for i in past
        }
        self.held = 0

    def run(self, ids: list[int], output: str = "logits") -> Any:
        """The graph's ``output`` (``logits`` or a head's hidden state) of ``ids`` after the tokens
        held, float32 ``[S, X]``."""
        import numpy as np

        b = self.sess.io_binding()
        b.bind_cpu_input("input_ids", np.asarray([ids], np.int64))
        b.bind_cpu_input("attention_mask", np.ones((1, self.held + len(ids)), np.int64))
        for name, v in self.kv.items():
            element = ONNX_ELEMENT[self.types[name]]
            b.bind_input(name, self.device, 0, element, self.shape, v.data_ptr())
            present = name.replace("past_key_values.", "present.")
            b.bind_output(present, self.device, 0, element, self.shape, v.data_ptr())
        b.bind_output(output, "cpu")
        self.sess.run_with_iobinding(b)
        self.held += len(ids)
        return host_float32(b.get_outputs()[-1])[0]

    def read_kv(self) -> list[Any]:
        """The held KV: ``2L`` float32 host arrays ``[Hkv, T, D]``, key then value per layer."""
        import numpy as np

        out = []
        for v in self.kv.values():
            a = v.numpy()[0, :, : self.held]
            out.append((a.astype(np.uint32) << 16).view(np.float32) if a.dtype == np.uint16 else a.astype(np.float32))
        return out


ONNX_ELEMENT = {"tensor(float)": 1, "tensor(float16)": 10, "tensor(bfloat16)": 16}


def host_float32(v: Any) -> Any:
    """A host ``OrtValue`` of float32, float16 or bfloat16 as a float32 numpy array (bfloat16
    widened exactly from its bits, which numpy cannot hold as a dtype)."""
    import ctypes

    import numpy as np

    if v.data_type() != "tensor(bfloat16)":
        return np.asarray(v.numpy(), np.float32)
    n = int(np.prod(v.shape()))
    bits = np.ctypeslib.as_array((ctypes.c_uint16 * n).from_address(v.data_ptr())).copy()
    return (bits.astype(np.uint32) << 16).view(np.float32).reshape(v.shape())
