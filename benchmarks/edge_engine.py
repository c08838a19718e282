"""The edge's local engine's own cost per decode step: ``edge.compute.local.LocalEngine`` over
``edge.compute.localmodel.MemoryModel``, a model whose run costs next to nothing (``--step-ms 0``) or a
fixed sleep (``--step-ms 1``: about SmolLM2-135M's decode step on an H100; the GIL is released while
it sleeps, as ONNX Runtime releases it while it runs).

``tandem-bench edge-engine --out DIR`` starts, per model kind (``batched``: one ``run_batch`` per step,
as ``DecoderGraph``; ``unbatched``: one ``run`` per turn and step, as ``OnnxForward``), per
``--step-ms`` and per number of turns (``--turns 1,8,16``), that many turns of ``--prompt-tokens``
random ids together, each decoding ``--new-tokens`` greedy tokens, ``--repeats`` times after one
warm-up. The consumer only notes each token's time.

Columns: ``turns`` (decoding together), ``step_ms`` (the model's set run time), ``model_ms`` (the
model's own time per decode step, alone: as many sessions decoding in a plain loop, one
``run_batch`` per step, or for ``unbatched`` one ``run`` per session and step), ``itl_ms``
(median gap between a turn's tokens), ``itl_mean_ms`` (the mean gap of a repeat, all turns'
gaps), ``overhead_ms`` (``itl_mean_ms - model_ms``: what the engine adds per step),
``tokens_per_s`` (all turns' output tokens per second of wall time); ``model_ms``,
``itl_mean_ms`` and ``tokens_per_s`` are medians over the repeats (a repeat the host stalled
stays out). Writes ``edge_engine.json`` and ``edge_engine.md``.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

from tandem.common.protocol.manifest import ModelShape
from tandem.common.protocol.params import Sampling
from tandem.edge.compute.local import LocalEngine
from tandem.edge.compute.localmodel import MemoryModel

app = typer.Typer(add_completion=False, help=__doc__)

SHAPE = ModelShape(
    num_layers=2,
    hidden_size=64,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    vocab_size=49152,
    max_position_embeddings=1 << 20,
)


def model_alone_ms(batched: bool, step_ms: float, prompts: list[list[int]], new_tokens: int) -> float:
    """The model's own time per decode step with no engine: every prompt's session decoding
    ``new_tokens - 1`` greedy steps in a plain loop (one ``run_batch`` per step, or one ``run`` per
    session and step), in ms per step."""
    model = MemoryModel(SHAPE, batched_decode=batched, step_ms=step_ms)
    kvs = [model.new_kv(len(p) + new_tokens) for p in prompts]
    toks: list[Any] = [model.run(kv, p, True)[0] for kv, p in zip(kvs, prompts, strict=True)]
    greedy = [True] * len(kvs)
    t0 = time.perf_counter()
    for _ in range(new_tokens - 1):
        if batched:
            toks = model.run_batch(kvs, toks, greedy)[0]
        else:
            toks = [model.run(kv, [t], True)[0] for kv, t in zip(kvs, toks, strict=True)]
    return (time.perf_counter() - t0) * 1e3 / (new_tokens - 1)


async def time_turns(engine: LocalEngine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[float]]]:
    """All ``prompts`` as turns together: the start and every turn's token times (``perf_counter()`` s)."""
    sampling = Sampling(max_new_tokens=new_tokens, ignore_eos=True)

    async def one(ids: list[int]) -> list[float]:
        return [time.perf_counter() async for _ in engine.generate(ids, sampling)]

    t0 = time.perf_counter()
    return t0, list(await asyncio.gather(*(one(p) for p in prompts)))


def measure(batched: bool, step_ms: float, turns: int, prompt_tokens: int, new_tokens: int, repeats: int) -> dict:
    """One row: ``turns`` turns together over a fresh engine, ``repeats`` times after one warm-up,
    beside the model alone over as many sessions."""
    engine = LocalEngine(MemoryModel(SHAPE, batched_decode=batched, step_ms=step_ms), SHAPE, ())
    rng = np.random.default_rng(turns)
    prompts = [[int(x) for x in rng.integers(3, 32000, prompt_tokens)] for _ in range(turns)]

    async def runs() -> list[tuple[float, list[list[float]]]]:
        await time_turns(engine, prompts, min(new_tokens, 8))  # warm-up
        return [await time_turns(engine, prompts, new_tokens) for _ in range(repeats)]

    done = asyncio.run(runs())
    alone = statistics.median(model_alone_ms(batched, step_ms, prompts, new_tokens) for _ in range(repeats))
    gaps = [[(b - a) * 1e3 for t in turns_ for a, b in zip(t, t[1:], strict=False)] for _, turns_ in done]
    walls = [max(t[-1] for t in turns_) - t0 for t0, turns_ in done]
    itl_mean = statistics.median(statistics.mean(g) for g in gaps)  # a repeat that the host stalled stays out
    return {
        "model": "batched" if batched else "unbatched",
        "step_ms": step_ms,
        "turns": turns,
        "model_ms": alone,
        "itl_ms": statistics.median(x for g in gaps for x in g),
        "itl_mean_ms": itl_mean,
        "overhead_ms": itl_mean - alone,
        "tokens_per_s": statistics.median(turns * new_tokens / w for w in walls),
    }


def to_markdown(rows: list[dict[str, Any]]) -> str:
    head = "| model | step_ms | turns | model_ms | itl_ms | itl_mean_ms | overhead_ms | tokens_per_s |"
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['step_ms']:g} | {r['turns']} | {r['model_ms']:.4f} | {r['itl_ms']:.4f} "
            f"| {r['itl_mean_ms']:.4f} | {r['overhead_ms']:.4f} | {r['tokens_per_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def _floats(text: str, what: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise typer.BadParameter(f"{what}: comma-separated numbers, got {text!r}") from e
    if not values or any(v < 0 for v in values):
        raise typer.BadParameter(f"{what}: at least one value, none negative, got {text!r}")
    return values


@app.command()
def main(
    out: Annotated[Path, typer.Option(help="results folder")] = Path("bench-results/edge-engine"),
    turns: Annotated[str, typer.Option(help="turns decoding together, comma-separated")] = "1,8,16",
    step_ms: Annotated[str, typer.Option(help="the model's decode run time (ms), comma-separated")] = "0,1",
    models: Annotated[str, typer.Option(help="batched, unbatched or both, comma-separated")] = "batched,unbatched",
    prompt_tokens: Annotated[int, typer.Option(min=1)] = 16,
    new_tokens: Annotated[int, typer.Option(min=2)] = 256,
    repeats: Annotated[int, typer.Option(min=1)] = 3,
) -> None:
    """Time the local engine's own cost per decode step, over an in-memory model (docs/benchmarks.md,
    "The local engine's own cost per step")."""
    counts = [int(t) for t in _floats(turns, "--turns")]
    kinds = [m.strip() for m in models.split(",") if m.strip()]
    if not kinds or any(k not in ("batched", "unbatched") for k in kinds) or min(counts) < 1:
        raise typer.BadParameter(f"--models batched,unbatched and --turns >= 1: got {models!r}, {turns!r}")
    rows = []
    for kind in kinds:
        for ms in _floats(step_ms, "--step-ms"):
            for n in counts:
                row = measure(kind == "batched", ms, n, prompt_tokens, new_tokens, repeats)
                print(json.dumps(row), file=sys.stderr, flush=True)
                rows.append(row)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "repeats": repeats, "python": sys.version}
    (out / "edge_engine.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    (out / "edge_engine.md").write_text(to_markdown(rows))
    print(to_markdown(rows))


if __name__ == "__main__":
    app()
