"""The edge's split head: prefill time of tandem's torch.onnx export (``head.onnx``, ``OnnxHead``)
against the head ONNX Runtime GenAI's model builder wrote (``head-builder/``, ``BuilderHead``).

``tandem-bench head --split-dir models/smollm2-135m/split-k4`` runs, per ``--prompt-tokens`` length
``T``, a random prompt of ``T`` ids through each head as one prefill (batch 1, no past KV),
``--repeats`` times after one warm-up run, each head with ``--threads`` intra-op threads, the runs
of the two heads alternated. The builder head is the split's own where its manifest names one,
else one built and checked into ``--out/head-builder`` (``common.model.builder_head``; fp32 on the
CPU build, bf16 where ONNX Runtime has CUDA).

Columns: ``head`` (``torch.onnx`` or ``builder``), ``prompt_tokens``, ``prefill_ms`` (median),
``prefill_ms_min``, ``ms_per_token`` (median / T), ``speedup`` (the torch.onnx head's median / this
head's). Writes ``edge_head.json`` and ``edge_head.md`` to ``--out``.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

app = typer.Typer(add_completion=False, help=__doc__)


def builder_split(split_dir: Path, out: Path) -> Path:
    """``split_dir`` when its manifest names a builder head, else a copy of it in ``out/split``
    (links to its parts) with one built, checked and named there.

    Raises:
        RuntimeError: the builder does not serve this model (the reason)."""
    from tandem.common.model.builder_export import default_precision
    from tandem.common.model.builder_head import HEAD_BUILDER_DIR, prepare_builder_head
    from tandem.common.protocol.manifest import SplitManifest

    m = SplitManifest.load(split_dir)
    if m.builder_head:
        return split_dir
    copy = out / "split"
    shutil.rmtree(copy, ignore_errors=True)
    copy.mkdir(parents=True)
    (copy / m.head_onnx).symlink_to(m.resolve(split_dir, m.head_onnx))
    hf = m.resolve(split_dir, m.full_checkpoint)
    precision = default_precision()
    why = prepare_builder_head(copy, hf, m.split_layer, precision, m.agreement, m.shape.vocab_size, m.checkpoint_blake3)
    if why:
        raise RuntimeError(f"no builder head for {split_dir}: {why}")
    m.model_copy(update={"builder_head": HEAD_BUILDER_DIR}).save(copy)
    return copy


def time_heads(heads: dict[str, Any], lengths: list[int], repeats: int, vocab: int) -> list[dict[str, Any]]:
    """Per length and head, the prefill times in ms (one warm-up run first; the heads alternated)."""
    from tandem.edge.compute.head import HeadInput

    rows = []
    for t in lengths:
        ids = np.random.default_rng(t).integers(0, vocab, t)
        times: dict[str, list[float]] = {name: [] for name in heads}
        for head in heads.values():
            head.run([HeadInput(ids)])  # warm-up
        for _ in range(repeats):
            for name, head in heads.items():
                t0 = time.perf_counter()
                head.run([HeadInput(ids)])
                times[name].append((time.perf_counter() - t0) * 1e3)
        base = statistics.median(times["torch.onnx"])
        for name, ms in times.items():
            med = statistics.median(ms)
            rows.append(
                {
                    "head": name,
                    "prompt_tokens": t,
                    "prefill_ms": med,
                    "prefill_ms_min": min(ms),
                    "ms_per_token": med / t,
                    "speedup": base / med,
                }
            )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    cols = ["head", "prompt_tokens", "prefill_ms", "prefill_ms_min", "ms_per_token", "speedup"]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


@app.command()
def main(
    split_dir: Annotated[Path, typer.Option(help="a prepared split directory")] = Path("models/smollm2-135m/split-k4"),
    out: Annotated[Path, typer.Option(help="results (and a builder head built here if the split has none)")] = Path(
        "benchmarks/results/edge_head"
    ),
    prompt_tokens: Annotated[str, typer.Option(help="comma-separated prompt lengths")] = "64,256",
    repeats: Annotated[int, typer.Option(help="timed runs per head and length")] = 20,
    threads: Annotated[int, typer.Option(help="ONNX Runtime intra-op threads (0: all cores)")] = 0,
) -> None:
    """Prefill time of the torch.onnx head against the model builder's head on one split."""
    from tandem.common.protocol.manifest import SplitManifest
    from tandem.edge.compute.builder_head import BuilderHead
    from tandem.edge.compute.head import OnnxHead

    out.mkdir(parents=True, exist_ok=True)
    built = builder_split(split_dir, out)
    m = SplitManifest.load(split_dir)
    heads: dict[str, Any] = {
        "torch.onnx": OnnxHead(split_dir, intra_op_threads=threads),
        "builder": BuilderHead(built, intra_op_threads=threads),
    }
    lengths = [int(x) for x in prompt_tokens.split(",") if x.strip()]
    rows = time_heads(heads, lengths, repeats, m.shape.vocab_size)
    meta = {"split_dir": str(split_dir), "k": m.split_layer, "repeats": repeats, "threads": threads}
    (out / "edge_head.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "edge_head.md").write_text(table(rows))
    typer.echo(table(rows))


if __name__ == "__main__":
    app()
