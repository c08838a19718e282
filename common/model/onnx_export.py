"""The ONNX export of an edge graph and its check against HF.

``export_head`` writes embedding + layers ``[0, k)`` (or the whole model, ``edge-full.onnx``) with
PyTorch's TorchScript ONNX exporter from the family's module in ``common.model.head_model``;
``check_export`` runs the graph in ONNX Runtime against the HF model on two rows (one left-padded)
in two steps, and on one row past every behaviour switch the deployment reaches (a sliding window,
a rope scaling threshold: ``common.model.switches``), and measures the largest difference over every
output. Both load HF with the config values the preparation's ``EngineAgreement`` sets in place of
the checkpoint's (``export_overrides``: the rope vLLM will use). ``common.model.prepare`` refuses a
graph whose check fails (``ExportCheckFailed``) before anything is bundled.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tandem.common.protocol.manifest import EngineAgreement, ExportCheck

ONNX_OPSET = 17
# An export passes its check when max |ONNX - HF| <= CHECK_RTOL * max(1, max |HF|) over all its outputs:
# fp32 graphs of the same function differ by reordered sums, measured at up to 3.6e-6 of the largest
# value on the families' test checkpoints (tests/families.py) and 5.5e-7 on SmolLM2-135M; a wrong
# layer (a missing q/k norm or soft-cap, another mask, other weights) is off by far more
CHECK_RTOL = 5e-5
# The same bound for a float16-compute graph (``head_model.Float16Compute``) against the float32 HF
# model: float16 rounds to 2^-11 (4.9e-4) of each value, and the difference grows through the layers;
# measured at up to 9.0e-4 of the largest value on SmolLM2-135M (heads at k = 4 and 8, the whole
# model) and up to 1.7e-2 on the families' random-weight test checkpoints (tests/families.py, the
# whole qwen2 model). A wrong layer is still off by the order of the values themselves
CHECK_RTOL_FLOAT16 = 5e-2
COMPUTE_DTYPES = ("float32", "float16")  # the arithmetic of an exported graph; its interface is float32
CHECK_TOKENS = (24, 20)  # check rows: the second left-padded to the first's length
CHECK_STEP_SLOTS = 16  # first step: slots [0, 16), second step: the rest (exercises the past KV inputs)


class ExportCheckFailed(ValueError):
    """An exported graph differs from HF beyond the tolerance; nothing is bundled."""


def load_hf(src: Path, overrides: dict[str, Any] | None = None) -> Any:
    """The HF causal LM at ``src`` in float32 with eager attention (the head's export source and
    the check's reference), in eval mode, its config's values replaced by ``overrides``
    (``EngineAgreement.export_overrides``).

    Raises:
        UnsupportedArchitecture: its architecture is not in ``common.model.head_model.FAMILIES``.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tandem.common.model.head_model import family_of

    family_of(json.loads((Path(src) / "config.json").read_text()))
    config = AutoConfig.from_pretrained(src)
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    return AutoModelForCausalLM.from_pretrained(
        src, config=config, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _compute_dtype(compute_dtype: str) -> str:
    """``compute_dtype`` if it is one of ``COMPUTE_DTYPES``.

    Raises:
        ValueError: it is not.
    """
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"ONNX compute dtype must be one of {', '.join(COMPUTE_DTYPES)}, not {compute_dtype!r}")
    return compute_dtype


def check_rtol(compute_dtype: str) -> float:
    """The check's relative bound for a graph computing in ``compute_dtype`` (``CHECK_RTOL`` or
    ``CHECK_RTOL_FLOAT16``).

    Raises:
        ValueError: not one of ``COMPUTE_DTYPES``.
    """
    return CHECK_RTOL_FLOAT16 if _compute_dtype(compute_dtype) == "float16" else CHECK_RTOL


def export_head(
    src: Path,
    out: Path,
    k: int,
    full: bool = False,
    compute_dtype: str = "float32",
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Export embedding + layers [0, k) to ONNX (TorchScript exporter, opset 17); with ``full``
    the whole model with final norm and lm_head (``EdgeFull``, edge-only baseline), ``k = L``.
    ``compute_dtype="float16"``: float16 weights and arithmetic behind the same float32 inputs and
    outputs (``head_model.Float16Compute``; half the file and memory, tensor cores on a GPU; ONNX
    Runtime's CPU provider runs it too, slower than float32).

    Dynamic axes: batch ``Bt``, new tokens ``T``, past ``P`` (see ``common.model.head_model.EdgeHead``).
    ``overrides``: config values the HF model is loaded with (``load_hf``).

    Raises:
        UnsupportedArchitecture: the checkpoint's architecture is not supported.
        ValueError: ``compute_dtype`` is not one of ``COMPUTE_DTYPES``.
    """
    import torch

    from tandem.common.model.head_io import io_names
    from tandem.common.model.head_model import EdgeFull, EdgeHead, Float16Compute

    _compute_dtype(compute_dtype)
    model = load_hf(src, overrides)
    head: torch.nn.Module = (EdgeFull(model) if full else EdgeHead(model, k)).eval()
    if compute_dtype == "float16":
        head = Float16Compute(head).eval()
    cfg = model.config
    hkv = cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    bt, t, p = 2, 5, 3
    ids = torch.randint(0, cfg.vocab_size, (bt, t))
    pos = torch.arange(p, p + t).repeat(bt, 1)
    mask = torch.ones(bt, p + t, dtype=torch.int64)
    past = [torch.randn(bt, hkv, p, d) for _ in range(2 * k)]
    inputs, outputs = io_names(k)
    if full:
        outputs[0] = "logits"  # [Bt, V]
    dyn = {
        "input_ids": {0: "batch", 1: "new"},
        "position_ids": {0: "batch", 1: "new"},
        "attention_mask": {0: "batch", 1: "total"},
        outputs[0]: {0: "batch"} if full else {0: "batch", 1: "new"},
    }
    for n in inputs[3:]:
        dyn[n] = {0: "batch", 2: "past"}
    for n in outputs[1:]:
        dyn[n] = {0: "batch", 2: "total"}
    tmp = out.with_name(out.name + ".tmp")
    with torch.no_grad():
        torch.onnx.export(
            head,
            (ids, pos, mask, *past),
            str(tmp),
            input_names=inputs,
            output_names=outputs,
            dynamic_axes=dyn,
            opset_version=ONNX_OPSET,
            dynamo=False,
        )
    tmp.rename(out)
    return out


def _check_rows(vocab_size: int, lengths: tuple[int, ...]) -> tuple[list[list[int]], np.ndarray, np.ndarray]:
    """Check prompts of ``lengths`` tokens (fixed token ids), their slot mask ``[R, S]`` (shorter rows
    left-padded) and positions ``[R, S]`` (0 on padding slots), ``S = max(lengths)``."""
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, vocab_size, n).tolist() for n in lengths]
    slots = max(lengths)
    mask = np.zeros((len(rows), slots), np.int64)
    pos = np.zeros((len(rows), slots), np.int64)
    for r, ids in enumerate(rows):
        mask[r, slots - len(ids) :] = 1
        pos[r, slots - len(ids) :] = np.arange(len(ids))
    return rows, mask, pos


def _check_batch(
    session: Any, model: Any, k: int, full: bool, lengths: tuple[int, ...], step_slots: int
) -> tuple[float, float]:
    """The largest |ONNX - HF| over every output on rows of ``lengths`` tokens fed in two steps
    (slots ``[0, step_slots)``, then the rest through the past-KV inputs), and the largest |HF|."""
    import torch
    from transformers import DynamicCache

    from tandem.common.model.head_io import io_names

    cfg = model.config
    n = cfg.num_hidden_layers if full else k
    rows, mask, pos = _check_rows(cfg.vocab_size, lengths)
    slots = mask.shape[1]
    ids = np.zeros_like(mask)
    refs: list[tuple[np.ndarray, list[np.ndarray]]] = []  # per row: output at its real slots, KV [Hkv, T, D]
    with torch.no_grad():
        for r, row in enumerate(rows):
            ids[r, slots - len(row) :] = row
            out = model(torch.tensor([row]), output_hidden_states=True, past_key_values=DynamicCache())
            main = out.logits[0] if full else out.hidden_states[k][0]
            kv = [t[0].numpy() for layer in out.past_key_values.layers[:n] for t in (layer.keys, layer.values)]
            refs.append((main.numpy(), kv))
    inputs, _ = io_names(n)
    hkv = cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    past = [np.zeros((len(rows), hkv, 0, d), np.float32) for _ in range(2 * n)]
    outs = []
    for lo, hi in ((0, step_slots), (step_slots, slots)):
        feed = {"input_ids": ids[:, lo:hi], "position_ids": pos[:, lo:hi], "attention_mask": mask[:, :hi]}
        feed.update(zip(inputs[3:], past, strict=True))
        main, *past = session.run(None, feed)
        outs.append(main)
    err, scale = 0.0, 1.0
    for r, row in enumerate(rows):
        first = slots - len(row)  # the row's first real slot
        ref_main, ref_kv = refs[r]
        if full:  # logits of each step's last slot, at the row's positions there
            got, want = [o[r] for o in outs], [ref_main[step_slots - 1 - first], ref_main[-1]]
        else:
            got, want = [np.concatenate(outs, axis=1)[r, first:]], [ref_main]
        got += [p[r][:, first:] for p in past]
        want += ref_kv
        for g, w in zip(got, want, strict=True):
            diff = float(np.abs(g - w).max()) if np.isfinite(g).all() else float("inf")
            err = max(err, diff)
            scale = max(scale, float(np.abs(w).max()))
    return err, scale


def check_export(
    src: Path,
    onnx_path: Path,
    k: int,
    full: bool = False,
    compute_dtype: str = "float32",
    agreement: EngineAgreement | None = None,
) -> ExportCheck:
    """Run the exported head (``full``: ``edge-full.onnx``) with ONNX Runtime against the HF model
    at ``src`` on the check prompts (``CHECK_TOKENS``, the second row left-padded, in two steps
    split at ``CHECK_STEP_SLOTS`` so the second feeds the first's presents back as past KV) and,
    when ``agreement.check_tokens`` is longer, on one row of that many tokens (past every behaviour
    switch the deployment reaches) in two halves. HF is loaded with ``agreement.export_overrides``.

    Compared: ``hidden`` against HF ``hidden_states[k]`` at every real slot (``full``: ``logits`` of
    each step's last slot against HF's logits there) and every ``present_key_i`` /
    ``present_value_i`` at the real slots against HF's cache (the keys after RoPE). Passes when the
    largest absolute difference is within ``check_rtol(compute_dtype) * max(1, max |HF|)``; an
    output that is not finite (a float16 overflow) fails it. The check records ``agreement``.

    Raises:
        UnsupportedArchitecture: the checkpoint's architecture is not supported.
        ValueError: ``compute_dtype`` is not one of ``COMPUTE_DTYPES``.
    """
    import onnxruntime as ort

    rtol = check_rtol(compute_dtype)
    model = load_hf(src, agreement.export_overrides if agreement else None)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    session = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
    err, scale = _check_batch(session, model, k, full, CHECK_TOKENS, CHECK_STEP_SLOTS)
    tokens = sum(CHECK_TOKENS)
    long_tokens = agreement.check_tokens if agreement else 0
    if long_tokens > max(CHECK_TOKENS):
        long_err, long_scale = _check_batch(session, model, k, full, (long_tokens,), long_tokens // 2)
        err, scale, tokens = max(err, long_err), max(scale, long_scale), tokens + long_tokens
    tol = rtol * scale
    return ExportCheck(
        architecture=model.config.architectures[0],
        max_abs_error=err,
        tolerance=tol,
        tokens=tokens,
        passed=err <= tol,
        compute_dtype=compute_dtype,
        engine_agreement=agreement,
    )
