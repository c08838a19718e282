"""Pooled split/cloud-only TTFT ratios of the hot-path runs beside this file (README, *Hot path*):
``python benchmarks/results/hotpath-async-save/pooled.py``. ``before*``/``after*``: session 10;
``s12-*``: session 12, at the code with the engines' fast exit and the restricted KV-usage read."""

import json
import statistics as st
from pathlib import Path

HERE = Path(__file__).parent
print("| prompt tok | code | runs | split-k4 TTFT mean ms | cloud-only TTFT mean ms | ratio of means | ratio per run |")
print("|---|---|---|---|---|---|---|")
for n in (64, 256, 1024):
    for label in ("before", "after", "s12"):
        runs = sorted(p for p in HERE.iterdir() if p.is_dir() and p.name.startswith(label))
        per_run, split_all, cloud_all = [], [], []
        for run in runs:
            recs = [json.loads(line) for line in (run / "records.jsonl").open()]
            split = [r["ttft_ms"] for r in recs if r["mode"] == "split-k4" and r["target_prompt_tokens"] == n]
            cloud = [r["ttft_ms"] for r in recs if r["mode"] == "cloud-only" and r["target_prompt_tokens"] == n]
            per_run.append(f"{st.mean(split) / st.mean(cloud):.2f}x")
            split_all += split
            cloud_all += cloud
        s, c = st.mean(split_all), st.mean(cloud_all)
        print(f"| {n} | {label} | {len(runs)} | {s:.0f} | {c:.0f} | {s / c:.2f}x | {', '.join(per_run)} |")
