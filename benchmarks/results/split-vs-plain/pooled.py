"""Pooled split/cloud-only TTFT of the runs beside this file (docs/benchmarks.md, "Split against plain
vLLM on loopback"): ``python benchmarks/results/split-vs-plain/pooled.py``. Each ``run-*`` folder is
one ``tandem-bench --split-layers 4 --links loopback --prompt-lens 64,256,1024 --requests 8
--no-edge-only --no-auto`` run; the second table gives the split's stage medians over all runs."""

import json
import statistics as st
from pathlib import Path

HERE = Path(__file__).parent
RUNS = sorted(p for p in HERE.iterdir() if p.is_dir() and p.name.startswith("run-"))
RECORDS = {run.name: [json.loads(line) for line in (run / "records.jsonl").open()] for run in RUNS}


def ttfts(recs: list[dict], mode: str, n: int) -> list[float]:
    return [r["ttft_ms"] for r in recs if r["mode"] == mode and r["target_prompt_tokens"] == n]


print("| prompt tok | runs | split-k4 TTFT mean ms | cloud-only TTFT mean ms | ratio of means | ratio per run |")
print("|---|---|---|---|---|---|")
for n in (64, 256, 1024):
    per_run, split_all, cloud_all = [], [], []
    for recs in RECORDS.values():
        split, cloud = ttfts(recs, "split-k4", n), ttfts(recs, "cloud-only", n)
        per_run.append(f"{st.mean(split) / st.mean(cloud):.2f}x")
        split_all += split
        cloud_all += cloud
    s, c = st.mean(split_all), st.mean(cloud_all)
    print(f"| {n} | {len(RUNS)} | {s:.0f} | {c:.0f} | {s / c:.2f}x | {', '.join(per_run)} |")

STAGES = ("edge_head_ms", "encode_ms", "uplink_ms", "cloud_store_put_ms", "cloud_tail_prefill_ms")
print()
print("| prompt tok | " + " | ".join(f"split {s} median" for s in STAGES) + " | cloud-only prefill + 1st ms median |")
print("|---|" + "---|" * (len(STAGES) + 1))
for n in (64, 256, 1024):
    recs = [r for rs in RECORDS.values() for r in rs if r["target_prompt_tokens"] == n]
    split = [r["timings_ms"] for r in recs if r["mode"] == "split-k4"]
    direct = [r["timings_ms"]["cloud_decode_first_token_ms"] for r in recs if r["mode"] == "cloud-only"]
    cells = [f"{st.median(t[s] for t in split):.0f}" for s in STAGES]
    print(f"| {n} | " + " | ".join(cells) + f" | {st.median(direct):.0f} |")
