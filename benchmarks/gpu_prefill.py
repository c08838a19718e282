"""Prefill cost of the first ``k`` layers vs the whole model on a GPU, and what the split's
bytes cost on the link: the numbers behind "does splitting pay" on real cloud hardware.

PyTorch eager with HF ``LlamaModel`` (SDPA attention), random weights of the real shapes
(compute time does not depend on weight values), batch 1, bf16, CUDA-event timing
(median of ``--repeats`` after warm-up). Stands in for vLLM, which the lent GPU
machines do not have. For each model shape and prompt length it prints:

* ``head_ms``: layers [0, k) (what the split moves off the cloud), ``full_ms``: all L layers + norm;
* ``uplink_bytes``: ``T x (H + k x 2 x Hkv x D)`` x 2 bytes (bf16 activations + head KV);
* ``breakeven_mbps``: the uplink rate at which sending those bytes takes as long as the
  cloud compute they save (``uplink_bytes x 8 / head_ms``); below it, the split costs the
  request more link time than it saves cloud time.

Usage: ``python -m benchmarks.gpu_prefill --out DIR`` (writes gpu_prefill.md / .json).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

SHAPES = {
    # SmolLM2-135M-Instruct (the embedded default)
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
    ),
    # Llama-3-8B shapes (a typical cloud model)
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
}


def time_forward(model, ids, repeats: int) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    with torch.no_grad():
        for i in range(repeats + 2):
            start.record()
            model(input_ids=ids, use_cache=False)
            end.record()
            torch.cuda.synchronize()
            if i >= 2:
                out.append(start.elapsed_time(end))
    return statistics.median(out)


def main() -> None:
    import torch
    from transformers import LlamaConfig, LlamaModel

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lens", default="128,512,2048,8192")
    ap.add_argument("--splits", default="4,8")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path("bench-results/gpu"))
    a = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for name, shape in SHAPES.items():
        ks = [int(x) for x in a.splits.split(",")]
        models: dict[int, torch.nn.Module] = {}
        for n_layers in [*ks, shape["num_hidden_layers"]]:
            kw: dict[str, Any] = {**shape, "num_hidden_layers": n_layers, "max_position_embeddings": 16384}
            cfg = LlamaConfig(**kw)
            cfg._attn_implementation = "sdpa"
            model: torch.nn.Module = LlamaModel(cfg)
            models[n_layers] = model.to(dev, torch.bfloat16).eval()
        d = shape["hidden_size"] // shape["num_attention_heads"]
        for t in (int(x) for x in a.lens.split(",")):
            ids = torch.randint(0, shape["vocab_size"], (1, t), device=dev)
            full = time_forward(models[shape["num_hidden_layers"]], ids, a.repeats)
            for k in ks:
                head = time_forward(models[k], ids, a.repeats)
                nbytes = t * (shape["hidden_size"] + k * 2 * shape["num_key_value_heads"] * d) * 2
                rows.append(
                    {
                        "model": name,
                        "prompt_tokens": t,
                        "k": k,
                        "L": shape["num_hidden_layers"],
                        "head_ms": head,
                        "full_ms": full,
                        "head_share": head / full,
                        "uplink_bytes": nbytes,
                        "breakeven_mbps": nbytes * 8 / (head / 1e3) / 1e6,
                    }
                )
        del models
        torch.cuda.empty_cache()
    a.out.mkdir(parents=True, exist_ok=True)
    meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "dtype": "bfloat16"}
    (a.out / "gpu_prefill.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    cols = list(rows[0])
    md = [
        f"GPU: {meta['gpu']}, torch {meta['torch']}, bf16, batch 1, PyTorch eager + SDPA",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    md += [
        "| " + " | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |" for r in rows
    ]
    (a.out / "gpu_prefill.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
