"""``tandem-bench batching``: the cloud engine's continuous batching against ``max_num_seqs``.

For each ``max_num_seqs`` a fresh vLLM ``AsyncLLM`` on the full checkpoint gets
the same burst of requests (all submitted at once, deterministic prompts); the
script reports throughput (requests/s, output tokens/s) and TTFT / end-to-end /
inter-token p50 and p99, as a markdown table, CSV, JSON and a PNG. This is the
measured version of the ``max-num-seqs`` table in the seed article
(``../shared/seed/``), whose numbers are claims, not measurements of ours.

The same script runs on a GPU host (``--dtype auto --kv-cache-bytes ...``);
here it runs vLLM's CPU build.
"""

from __future__ import annotations

import asyncio
import csv
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Annotated, Literal, get_args

import numpy as np
import typer

from tandem.benchmarks.workload import make_prompts
from tandem.common.protocol.chat import prompt_token_ids

app = typer.Typer(add_completion=False, help=__doc__)

ModelDType = Literal["auto", "half", "float16", "bfloat16", "float", "float32"]  # vLLM's ``dtype`` values
DTYPES: tuple[ModelDType, ...] = get_args(ModelDType)


async def burst(engine, prompts: list[list[int]], max_new_tokens: int) -> list[dict]:
    """Submit every prompt at once; per-request TTFT, e2e and inter-token gaps in ms."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sp = SamplingParams(max_tokens=max_new_tokens, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def one(ids: list[int]) -> dict:
        t0 = time.perf_counter()
        times: list[float] = []
        async for out in engine.generate({"prompt_token_ids": ids}, sp, uuid.uuid4().hex):
            times.extend([time.perf_counter()] * len(out.outputs[0].token_ids))
        return {
            "ttft_ms": (times[0] - t0) * 1e3,
            "e2e_ms": (times[-1] - t0) * 1e3,
            "tokens": len(times),
            "itl_ms": [(b - a) * 1e3 for a, b in zip(times, times[1:], strict=False)],
            "t0": t0,
            "t1": times[-1],
        }

    return await asyncio.gather(*(one(p) for p in prompts))


async def warm_then_burst(engine, prompts: list[list[int]], max_new_tokens: int) -> list[dict]:
    await burst(engine, prompts[:1], 2)  # warm-up, on the loop the engine's output handler will use
    return await burst(engine, prompts, max_new_tokens)


def row_of(max_num_seqs: int, kv_cache_bytes: int, res: list[dict]) -> dict:
    wall = max(r["t1"] for r in res) - min(r["t0"] for r in res)
    itl = [x for r in res for x in r["itl_ms"]]
    return {
        "max_num_seqs": max_num_seqs,
        "kv_cache_mib": kv_cache_bytes / 2**20,
        "requests": len(res),
        "throughput_rps": len(res) / wall,
        "output_tokens_per_s": sum(r["tokens"] for r in res) / wall,
        "ttft_p50_ms": float(np.percentile([r["ttft_ms"] for r in res], 50)),
        "ttft_p99_ms": float(np.percentile([r["ttft_ms"] for r in res], 99)),
        "e2e_p50_ms": float(np.percentile([r["e2e_ms"] for r in res], 50)),
        "e2e_p99_ms": float(np.percentile([r["e2e_ms"] for r in res], 99)),
        "itl_p50_ms": float(np.percentile(itl, 50)) if itl else float("nan"),
        "itl_p99_ms": float(np.percentile(itl, 99)) if itl else float("nan"),
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["max_num_seqs"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(x, [r["output_tokens_per_s"] for r in rows], marker="o", color="tab:blue", label="output tokens/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max_num_seqs")
    ax.set_ylabel("output tokens/s", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(x, [r["e2e_p99_ms"] for r in rows], marker="s", color="tab:red", label="e2e p99 ms")
    ax2.plot(x, [r["itl_p99_ms"] for r in rows], marker="^", color="tab:orange", label="ITL p99 ms")
    ax2.set_ylabel("latency p99 (ms)", color="tab:red")
    fig.legend(loc="upper center", ncol=3, fontsize=8)
    ax.set_title("vLLM continuous batching vs max_num_seqs", pad=22)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@app.command()
def main(
    model: Annotated[Path, typer.Option(help="HF checkpoint")] = Path("models/smollm2-135m/hf"),
    max_num_seqs: Annotated[str, typer.Option(help="values to sweep")] = "1,2,4,8,16",
    requests: int = 32,
    prompt_tokens: int = 128,
    max_new_tokens: int = 32,
    kv_cache_bytes: int = 1 << 30,
    dtype: Annotated[str, typer.Option(help="vLLM's dtype: " + ", ".join(DTYPES))] = "float32",
    out: Path = Path("bench-results/batching"),
) -> None:
    """Sweep max_num_seqs and write batching.md / .csv / .json / .png."""
    model_dtype = next((d for d in DTYPES if d == dtype), None)
    if model_dtype is None:
        raise typer.BadParameter(f"{dtype!r}: one of {', '.join(DTYPES)}", param_hint="--dtype")
    from tqdm import tqdm
    from transformers import AutoTokenizer
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from tandem.cloud.engines import vllm_plugin

    os.environ[vllm_plugin.FAST_EXIT_ENV] = "1"  # each engine of the sweep stops in about 2 s, not 9
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [prompt_token_ids(tok, p.as_messages()) for p in make_prompts(tok, prompt_tokens, requests, seed=1)]
    rows = []
    for n in tqdm([int(x) for x in max_num_seqs.split(",")], desc="max_num_seqs", unit="engine"):
        engine = AsyncLLM.from_engine_args(
            AsyncEngineArgs(
                model=str(model),
                dtype=model_dtype,
                max_model_len=2048,
                max_num_seqs=n,
                kv_cache_memory_bytes=kv_cache_bytes,
                enforce_eager=True,
                enable_prefix_caching=False,
                disable_log_stats=True,
            )
        )
        try:
            rows.append(row_of(n, kv_cache_bytes, asyncio.run(warm_then_burst(engine, prompts, max_new_tokens))))
        finally:
            engine.shutdown()
            del engine  # let it go now, not at interpreter exit
    out.mkdir(parents=True, exist_ok=True)
    (out / "batching.json").write_text(
        json.dumps(
            {
                "args": {
                    k: str(v)
                    for k, v in locals().items()
                    if k in ("model", "requests", "prompt_tokens", "max_new_tokens", "dtype")
                },
                "rows": rows,
            },
            indent=2,
        )
    )
    with (out / "batching.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    cols = list(rows[0])
    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += [
        "| " + " | ".join(f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |" for r in rows
    ]
    (out / "batching.md").write_text("\n".join(md) + "\n")
    plot(rows, out / "batching.png")
    print("\n".join(md))
    print(f"results in {out}", file=sys.stderr)


if __name__ == "__main__":
    app()
