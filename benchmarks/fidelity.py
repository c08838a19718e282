"""``tandem-bench-fidelity``: what each wire format does to greedy output, and what it saves.

One ``tandem-cloud`` (real vLLM engines) that allows every activation and KV block format, and
one ``tandem-edge`` per format pair under test (its offer names only that pair, so the link
negotiates it), all child processes on this machine. Every prompt of the fixed set
(``benchmarks/data/fidelity_prompts.jsonl``: 200 hand-written chats in 28 categories, 31 of them
multi-turn) runs in split mode at ``--split-layer`` with greedy decoding for
``--max-new-tokens`` tokens (EOS ends a reply, as in use). The first pair (default fp32/fp32) is
the reference; it also runs twice, so the table shows the run-to-run floor (vLLM's CPU kernels
are deterministic for a fixed batch, but requests in flight together batch differently).

Per pair: bytes per prompt token on the wire (activations + KV blocks, as sent), the share of
prompts whose whole reply (up to ``--max-new-tokens`` tokens) equals the reference's, and the
top-1 disagreement rate per position (the share of prompts whose token at position ``i``
differs from the reference's, among prompts where the reference has one; after a first
difference later positions usually differ too). The target (``BAR_*``): a format at or below 845
bytes per prompt token at k = 4 (10x below fp32) with at least 99% of prompts agreeing.

Writes into ``--out``: ``fidelity.md`` (the table), ``fidelity.json`` (every reply's tokens and
bytes per pair) and ``fidelity.png`` (bytes per token against agreement; disagreement by position).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import typer

from tandem.common.formats import FORMATS
from tandem.daemons import Daemons, cloud_command, edge_command, work_dir

app = typer.Typer(add_completion=False, help=__doc__)

PROMPTS = Path(__file__).parent / "data" / "fidelity_prompts.jsonl"
BAR_AGREEMENT = 0.99
BAR_BYTES_FACTOR = 10  # below fp32's bytes per prompt token
LINK_IDLE_S = 2.0


@dataclass
class PairResult:
    label: str  # "<activations>/<kv>"
    replies: dict[str, list[int]] = field(default_factory=dict)  # prompt id -> output token ids
    prompt_tokens: int = 0
    sent_bytes: int = 0  # activations + KV blocks
    wall_s: float = 0.0

    @property
    def bytes_per_token(self) -> float:
        return self.sent_bytes / max(1, self.prompt_tokens)


def load_prompts(path: Path, limit: int) -> list[dict]:
    """The prompt set: ``{"id", "category", "messages"}`` per line.

    Raises:
        typer.BadParameter: the file is missing or a line is not a chat ending with a user turn.
    """
    if not path.is_file():
        raise typer.BadParameter(f"no prompt set at {path}")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        p = json.loads(line)
        if not p.get("messages") or p["messages"][-1].get("role") != "user":
            raise typer.BadParameter(f"{path}:{n}: messages must end with a user turn")
        out.append(p)
    return out[:limit] if limit else out


async def run_pair(port: int, label: str, prompts: list[dict], split_layer: int, max_new: int, conc: int, bar):
    """Every prompt once through the edge at ``port`` in split mode; greedy."""
    from tandem import AsyncClient

    res, sem = PairResult(label), asyncio.Semaphore(conc)
    t0 = time.perf_counter()
    async with AsyncClient(f"127.0.0.1:{port}") as client:

        async def one(p: dict) -> None:
            from tandem import ResourceExhausted

            async with sem:
                for attempt in range(10):  # a full share answers RESOURCE_EXHAUSTED with a retry hint
                    s = client.chat(p["messages"], max_new_tokens=max_new, mode="split", split_layer=split_layer)
                    try:
                        async for _ in s:
                            pass
                        break
                    except ResourceExhausted as e:
                        if attempt == 9:
                            raise
                        await asyncio.sleep(e.retry_after_s or 1.0)
                r = s.result
                res.replies[p["id"]] = list(r.output_token_ids)
                res.prompt_tokens += r.head_tokens
                res.sent_bytes += r.sent_bytes.get("activations", 0) + r.sent_bytes.get("kv", 0)
                bar.update(1)

        await asyncio.gather(*(one(p) for p in prompts))
    res.wall_s = time.perf_counter() - t0
    return res


def compare(ref: PairResult, other: PairResult, max_new: int) -> tuple[float, list[float]]:
    """(share of prompts whose reply equals the reference's, disagreement rate per position)."""
    ids = sorted(ref.replies)
    same = sum(ref.replies[i] == other.replies.get(i) for i in ids) / len(ids)
    per_pos = []
    for pos in range(max_new):
        have = [i for i in ids if len(ref.replies[i]) > pos]
        if not have:
            break
        diff = sum(len(other.replies[i]) <= pos or other.replies[i][pos] != ref.replies[i][pos] for i in have)
        per_pos.append(diff / len(have))
    return same, per_pos


def plot(path: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in rows:
        a.scatter(r["bytes_per_token"], 100 * r["agreement"], s=40)
        a.annotate(r["label"], (r["bytes_per_token"], 100 * r["agreement"]), textcoords="offset points", xytext=(4, 4))
        b.plot(range(1, len(r["disagreement_by_position"]) + 1), r["disagreement_by_position"], label=r["label"])
    a.axhline(100 * BAR_AGREEMENT, color="grey", ls="--", lw=1)
    if rows:
        a.axvline(rows[0]["bytes_per_token"] / BAR_BYTES_FACTOR, color="grey", ls=":", lw=1)
    a.set_xscale("log")
    a.set_xlabel("bytes per prompt token on the wire (log)")
    a.set_ylabel("prompts whose reply equals the fp32 reference (%)")
    a.set_title("agreement vs bytes (dashed: 99% bar; dotted: 10x below the reference)")
    b.set_xlabel("output position")
    b.set_ylabel("top-1 disagreement rate")
    b.set_title("disagreement by position")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


@app.command()
def main(
    model_dir: Annotated[Path, typer.Option(help="prepared model directory")] = Path("models/smollm2-135m"),
    split_layer: Annotated[int, typer.Option(help="split layer k (an exported split-k<k> directory)")] = 4,
    pairs: Annotated[
        str, typer.Option(help="activation/KV format pairs, the reference first")
    ] = "fp32/fp32,fp16/fp16,bf16/bf16,int8_hadamard/int8_hadamard,fp16/int8_hadamard,int8_hadamard/int4",
    prompts_file: Annotated[Path, typer.Option(help="JSONL prompt set")] = PROMPTS,
    limit: Annotated[int, typer.Option(help="first N prompts only (0 = all)")] = 0,
    max_new_tokens: int = 32,
    concurrency: Annotated[int, typer.Option(help="requests in flight")] = 4,
    out: Annotated[Path, typer.Option(help="output directory")] = Path("bench-results/fidelity"),
    cloud: Annotated[
        str,
        typer.Option(
            help="host:port of a running plaintext tandem-cloud that allows every format in --pairs and "
            f"releases an idle link's share within {LINK_IDLE_S:g} s (--link-idle-s), so each pair gets the "
            "whole cloud (default: start one like that)"
        ),
    ] = "",
) -> None:
    """Run every prompt under every format pair and write the agreement table and plot."""
    from tqdm import tqdm

    labels = [p.strip().lower() for p in pairs.split(",") if p.strip()]
    for lab in labels:
        if lab.count("/") != 1:
            raise typer.BadParameter(f"--pairs: {lab!r} is not <activations>/<kv>, e.g. int8/int4")
    prompts = load_prompts(prompts_file, limit)
    out.mkdir(parents=True, exist_ok=True)
    w = work_dir("tandem-fidelity-")  # its block stores are removed at exit, its logs kept
    split_dir = model_dir / f"split-k{split_layer}"
    every = ",".join(f.name.lower() for f in FORMATS.values())
    runs = [*labels[:1], *labels]  # the reference twice: its run-to-run floor
    print(f"tandem-bench-fidelity: {len(prompts)} prompts x {len(runs)} runs; logs in {w}", file=sys.stderr)
    daemons = Daemons()
    results: list[PairResult] = []
    try:
        # one edge (link) per pair, one after the other: a finished edge's link stops holding a share
        # after --link-idle-s, so each pair gets the whole cloud
        extra = ["--wire-dtypes", every, "--kv-wire-dtypes", every, "--max-num-seqs", str(max(8, concurrency))]
        extra += ["--link-idle-s", str(LINK_IDLE_S)]
        if not cloud:
            c = daemons.spawn("tandem-cloud", cloud_command(split_dir, w / "kv", extra=extra), w / "cloud.log", w / "c")
            cloud = f"127.0.0.1:{c.wait_ready(900)}"
        with tqdm(total=len(prompts) * len(runs), desc="replies", unit="req") as bar:
            for n, lab in enumerate(runs):
                act, kv = lab.split("/")
                edge = daemons.spawn(
                    f"tandem-edge {lab}",
                    edge_command(split_dir, cloud, extra=["--wire-dtypes", act, "--kv-wire-dtypes", kv]),
                    w / f"edge-{n}.log",
                    w / f"edge-{n}.port",
                )
                port = edge.wait_ready(300)
                results.append(asyncio.run(run_pair(port, lab, prompts, split_layer, max_new_tokens, concurrency, bar)))
                edge.stop()
                time.sleep(LINK_IDLE_S + 1)
    finally:
        daemons.stop()
    ref = results[0]
    rows = []
    for n, r in enumerate(results[1:], 1):
        same, per_pos = compare(ref, r, max_new_tokens)
        rows.append(
            {
                "label": r.label + (" (again)" if n == 1 else ""),
                "bytes_per_token": r.bytes_per_token,
                "agreement": same,
                "disagreement_by_position": per_pos,
                "first_token_disagreement": per_pos[0] if per_pos else 0.0,
                "wall_s": r.wall_s,
            }
        )
    fp32_bytes = ref.bytes_per_token
    lines = [
        f"{len(prompts)} prompts, split at k={split_layer}, greedy, up to {max_new_tokens} tokens, "
        f"concurrency {concurrency}; reference {ref.label} ({fp32_bytes:.0f} B per prompt token)",
        "",
        "| activations/KV | B per prompt token | vs reference | replies equal to the reference | "
        "1st-token disagreement | mean disagreement per position | "
        f"meets the bar (>= {100 * BAR_AGREEMENT:.0f}% equal at <= 1/{BAR_BYTES_FACTOR:g} of the reference's bytes) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        meets = r["agreement"] >= BAR_AGREEMENT and r["bytes_per_token"] <= fp32_bytes / BAR_BYTES_FACTOR
        pos = r["disagreement_by_position"]
        lines.append(
            f"| {r['label']} | {r['bytes_per_token']:.0f} | {fp32_bytes / max(1.0, r['bytes_per_token']):.1f}x less | "
            f"{100 * r['agreement']:.1f}% | {100 * r['first_token_disagreement']:.1f}% | "
            f"{100 * sum(pos) / max(1, len(pos)):.1f}% | {'yes' if meets else 'no'} |"
        )
    (out / "fidelity.md").write_text("\n".join(lines) + "\n")
    (out / "fidelity.json").write_text(
        json.dumps({"rows": rows, "replies": {r.label: r.replies for r in results}, "prompts": len(prompts)})
    )
    plot(out / "fidelity.png", rows)
    print("\n".join(lines))
    print(f"results in {out}: fidelity.md, fidelity.json, fidelity.png", file=sys.stderr)


if __name__ == "__main__":
    app()
