"""``tandem-bench fidelity``: what each wire format pair does to the model's next-token
distributions, against the noise of the unquantized system, and what it saves on the wire.

Over the fixed chat set (``benchmarks/data/fidelity_prompts.jsonl``; ``--sample N`` takes every
``200 / N``-th chat) it runs five stages: fp32 reference replies from a real vLLM engine
(``benchmarks.engine_logprobs``), the engines' noise floor (concurrency 4, bf16), each format pair
teacher-forced in-process (``benchmarks.teacher``), remote prefill's downlink in each KV format
(``--downlink-kvs``: every layer's KV of the prompt's full blocks, ``RemotePrefillTeacher``), and
the edge's whole-model graph (``benchmarks.edge_teacher``). The stages, ``--dtype bfloat16``, the
measures and the results: docs/benchmarks.md, "Wire formats and fidelity"; why teacher forcing and why this floor:
docs/design-decisions.md, "Wire formats".

Measures per row are ``benchmarks.fidelity_stats``'s; a pair (and the edge row) qualifies
(``fidelity_stats.qualifies``) where its mean KL and its flip rate are each within
``FLOOR_FACTOR`` of the fp32-vs-bf16 engines' floor. Writes into ``--out``: ``fidelity.md`` (the
tables), ``fidelity.json`` (every row and its buckets, the edge row under ``edge``),
``fidelity.png`` (KL vs bytes per prompt token, one point per pair, the floor as a band) and
``fidelity-table.json`` (the qualifying pairs per split layer and the downlink's formats, the form
``cloud.links.fidelity`` reads).
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

from tandem.benchmarks import fidelity_stats as fs
from tandem.benchmarks.children import run_child
from tandem.common.protocol.manifest import SplitManifest
from tandem.common.protocol.params import WireDtype
from tandem.common.wire.chunks import raw_nbytes_of
from tandem.common.wire.kvwire import kv_raw_nbytes

app = typer.Typer(add_completion=False, help=__doc__)

PROMPTS = Path(__file__).parent / "data" / "fidelity_prompts.jsonl"
BLOCK_TOKENS = 32  # the cloud's KV block size (EngineConfig.block_size_tokens)
FP32_PAIR = (WireDtype.FP32, WireDtype.FP32)
SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16"}  # --dtype's values as the tables name them
DEFAULT_DOWNLINK_KVS = "fp32,bf16,fp16,int8_hadamard,int4_hadamard,int4"
DEFAULT_PAIRS = (
    "fp32/fp32,fp16/fp16,bf16/bf16,int8_hadamard/int8_hadamard,int8_hadamard/int4,"
    "int4_hadamard/int4_hadamard,int4_hadamard/int4"
)


def load_prompts(path: Path, limit: int = 0, sample: int = 0) -> list[dict]:
    """The prompt set: ``{"id", "category", "messages"}`` per line; the first ``limit`` (0: all),
    then every ``len / sample``-th of them (0: all).

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
    out = out[:limit] if limit else out
    if sample and sample < len(out):
        step = len(out) / sample
        out = [out[int(i * step)] for i in range(sample)]
    return out


def parse_pairs(pairs: str) -> list[tuple[WireDtype, WireDtype]]:
    """``"act/kv,..."`` -> format pairs, fp32/fp32 (the reference) first whether listed or not.

    Raises:
        typer.BadParameter: an item is not ``<activations>/<kv>`` of known format names.
    """
    out = [FP32_PAIR]
    for lab in (p.strip() for p in pairs.split(",") if p.strip()):
        try:
            a, k = lab.split("/")
            pair = (WireDtype[a.strip().upper()], WireDtype[k.strip().upper()])
        except (ValueError, KeyError):
            raise typer.BadParameter(f"--pairs: {lab!r} is not <activations>/<kv>, e.g. int8_hadamard/int4") from None
        if pair not in out:
            out.append(pair)
    return out


def parse_kvs(kvs: str) -> list[WireDtype]:
    """``fp32,bf16,...`` -> formats, fp32 first (the reference) and each once; [] for ''.

    Raises:
        typer.BadParameter: an unknown format name."""
    names = [n.strip() for n in kvs.split(",") if n.strip()]
    if not names:
        return []
    try:
        found = [WireDtype[n.upper()] for n in names]
    except KeyError as e:
        raise typer.BadParameter(f"unknown KV format {e.args[0].lower()!r} in {kvs!r}") from None
    return list(dict.fromkeys([WireDtype.FP32, *found]))


def downlink_bytes_per_prompt_token(kv: WireDtype, m: SplitManifest, lengths: list[int]) -> float:
    """Remote prefill's downlink: the full KV blocks of every layer, over all prompts, per prompt token."""
    s = m.shape
    blk = kv_raw_nbytes((s.num_layers, 2, s.num_kv_heads, BLOCK_TOKENS, s.head_dim), kv)
    return sum((t // BLOCK_TOKENS) * blk for t in lengths) / sum(lengths)


def label(pair: tuple[WireDtype, WireDtype]) -> str:
    return f"{pair[0].name.lower()}/{pair[1].name.lower()}"


def bytes_per_prompt_token(pair: tuple[WireDtype, WireDtype], m: SplitManifest, lengths: list[int]) -> float:
    """Activations of every prompt token plus the full KV blocks, over all prompts, per prompt token."""
    s = m.shape
    act = raw_nbytes_of(1, pair[0], s.hidden_size)
    blk = kv_raw_nbytes((m.split_layer, 2, s.num_kv_heads, BLOCK_TOKENS, s.head_dim), pair[1])
    return sum(t * act + (t // BLOCK_TOKENS) * blk for t in lengths) / sum(lengths)


def run_engine(
    model: Path, requests: list[dict], outs: list[tuple[Path, int]], dtype: str, top_k: int, max_new: int
) -> list[dict]:
    """``benchmarks.engine_logprobs`` in a child process, one engine, a pass per ``(out.npz,
    concurrency)`` of ``outs``: per pass {id: {reply, ids, lps, own}}. A child that exits non-zero
    (vLLM may abort at interpreter exit) after writing every pass is accepted (``children.run_child``).

    Raises:
        ChildFailed: a pass is missing or incomplete (the status and the log's error lines in the message).
    """
    first = outs[0][0]
    req = first.with_suffix(".json")
    req.write_text(json.dumps(requests))
    cmd = [sys.executable, "-m", "tandem.benchmarks.engine_logprobs", "--model", str(model), "--requests", str(req)]
    for path, concurrency in outs:
        cmd += ["--out", str(path), "--concurrency", str(concurrency)]
    cmd += ["--dtype", dtype, "--top-k", str(top_k), "--max-new-tokens", str(max_new), "--no-greedy"]

    def load(path: Path) -> dict:
        with np.load(path) as z:
            return {r["id"]: {f: z[f"{r['id']}/{f}"] for f in ("reply", "ids", "lps", "own")} for r in requests}

    name = f"engine run {dtype} c={[c for _, c in outs]}"
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1"}
    return run_child(name, cmd, first.with_suffix(".log"), [p for p, _ in outs], load, env)


def greedy_from_forced(reply: np.ndarray, top1: np.ndarray) -> list[int]:
    """The greedy reply of a system whose teacher-forced top-1 along ``reply`` is ``top1``: equal
    to ``reply`` up to and including the first position where they differ."""
    diff = np.flatnonzero(top1 != reply)
    return [int(x) for x in reply] if not diff.size else [*map(int, reply[: diff[0]]), int(top1[diff[0]])]


def compare_engines(ref: dict, other: dict, lengths: dict[str, int]) -> dict:
    """Engine run ``other`` against engine run ``ref``: the summary, with its greedy agreement
    (``greedy``) and the gaps at its first divergences (``divergence``)."""
    pos, div = fs.Positions(), fs.Divergences()
    greedy_ref, greedy_other = {}, {}
    for i, r in ref.items():
        o = other[i]
        pos.add_turn((r["ids"], r["lps"]), (o["ids"], o["lps"]), o["own"], lengths[i])
        div.add_turn(r["reply"], r["lps"], o["ids"], o["lps"])
        greedy_ref[i], greedy_other[i] = list(map(int, r["reply"])), greedy_from_forced(r["reply"], o["ids"][:, 0])
    g = fs.greedy_agreement(greedy_ref, greedy_other)
    return {**fs.summarize(pos), "greedy": g, "divergence": fs.summarize_divergences(div)}


def edge_decoder_dir(option: str, model_dir: Path) -> Path | None:
    """``--edge-decoder``: ``auto`` -> the model directory's ``edge-decoder/`` where it holds a built
    graph (else None: no edge row), ``none`` -> None, else that directory.

    Raises:
        typer.BadParameter: a named directory holds no built graph.
    """
    from tandem.common.model.builder_export import GENAI_CONFIG
    from tandem.common.protocol.manifest import FULL_DECODER

    if option in ("auto", "none"):
        found = model_dir / FULL_DECODER
        return found if option == "auto" and (found / GENAI_CONFIG).is_file() else None
    if not (Path(option) / GENAI_CONFIG).is_file():
        raise typer.BadParameter(f"--edge-decoder {option}: no built graph there ({GENAI_CONFIG})")
    return Path(option)


def edge_row(teacher: Any, reqs: list[dict], ref: dict, top_k: int, ref_dtype: str) -> dict:
    """The edge whole model (``edge_teacher.EdgeTeacher``) teacher-forced over every chat's
    reference reply and compared with the reference engine ``ref`` as the floor rows are: the
    summary, ``greedy`` and ``divergence``, and the row's ``title``."""
    from tqdm import tqdm

    pos, div, greedy = fs.Positions(), fs.Divergences(), {}
    for r in tqdm(reqs, desc="teacher-forced edge", unit="chat"):
        reply, e = np.asarray(r["reply"]), ref[r["id"]]
        lp = teacher.forced(r["prompt"], r["reply"])  # [n, V]
        top = fs.topk(lp, top_k)
        pos.add_turn((e["ids"], e["lps"]), top, lp[np.arange(len(reply)), reply], len(r["prompt"]))
        div.add_turn(reply, e["lps"], *top)
        greedy[r["id"]] = greedy_from_forced(reply, top[0][:, 0])
    return {
        "title": f"{SHORT_DTYPE[ref_dtype]} engine vs {teacher.title}",
        "decoder_dir": str(teacher.decoder_dir),
        "precision": teacher.precision,
        "device": teacher.device,
        "top_k": top_k,
        **fs.summarize(pos),
        "greedy": fs.greedy_agreement({r["id"]: r["reply"] for r in reqs}, greedy),
        "divergence": fs.summarize_divergences(div),
    }


def plot(path: Path, rows: list[dict], floors: dict[str, dict]) -> None:
    """KL vs bytes per prompt token, one point per pair; the floor (batching to fp32-vs-bf16) as a
    band, the qualifying limit (``FLOOR_FACTOR`` x the bf16 floor) dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lo = 1e-9
    fig, ax = plt.subplots(figsize=(8, 5))
    batching, bf16 = floors["batching"]["kl_mean"], floors["bf16"]["kl_mean"]
    ax.axhspan(max(batching, lo), max(bf16, lo), color="tab:green", alpha=0.2, label="noise floor (batching .. bf16)")
    ax.axhline(
        fs.FLOOR_FACTOR * max(bf16, lo), color="tab:green", ls="--", lw=1, label=f"{fs.FLOOR_FACTOR:g}x the floor"
    )
    shown = sorted((r for r in rows if r["pair"] != "fp32/fp32"), key=lambda r: r["bytes_per_token"])
    for i, r in enumerate(shown):  # labels alternate above and below, so neighbours in bytes do not overlap
        y = max(r["kl_mean"], lo)
        ax.scatter(r["bytes_per_token"], y, s=40, color="tab:blue" if r["qualifies"] else "tab:red")
        ax.annotate(
            f"{r['pair']} k={r['k']}",
            (r["bytes_per_token"], y),
            textcoords="offset points",
            xytext=(4, 4 if i % 2 == 0 else -11),
            fontsize=8,
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes per prompt token on the wire (log)")
    ax.set_ylabel(f"mean next-token KL from fp32, nats (top-{floors['bf16'].get('top_k', '')} coarsened, log)")
    ax.set_title("teacher-forced KL vs bytes (blue: within the floor rule, red: not)")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table_lines(rows: list[dict], floors: dict[str, dict], meta: dict, edge: Sequence[dict] = ()) -> list[str]:
    """The markdown tables: one row per floor, per edge whole model and per (k, pair), then KL by
    prompt-length bucket, then the gaps at the first greedy divergences."""
    head = (
        "| row | B per prompt token | fp32 B / this | bf16 B / this | this / token-id B | "
        "KL mean | KL p99 | KL mean (full) | "
        f"top-1 agree (gap > {fs.GAP_NATS:g}) | flips at near-ties | flip rate | PPL | "
        "greedy: identical | greedy: 1st divergence | within the floor |"
    )
    ref = SHORT_DTYPE[meta.get("dtype", "float32")]
    lines = [
        f"{meta['prompts']} chats ({meta['selection']}), greedy {ref} reference replies of up to "
        f"{meta['max_new_tokens']} tokens ({meta['positions']} teacher-forced positions); KL in nats, "
        f"top-{meta['top_k']} coarsened unless marked full; near-tie: reference top-2 gap <= {fs.GAP_NATS:g} nats; "
        f"within the floor: KL mean and flip rate <= {fs.FLOOR_FACTOR:g}x the fp32-vs-bf16 engines'.",
        "",
        head,
        "|" + "---|" * 15,
    ]

    def cells(s: dict, g: dict) -> str:
        full = "" if s.get("kl_full_mean") is None else f"{s['kl_full_mean']:.2e}"
        first = "-" if g["first_divergence_mean"] is None else f"{g['first_divergence_mean']:.1f}"
        return (
            f"{s['kl_mean']:.2e} | {s['kl_p99']:.2e} | {full} | {100 * s['top1_decisive']:.2f}% | "
            f"{100 * s['flip_near_tie']:.1f}% | {100 * s['flip_rate']:.2f}% | {s['ppl']:.3f} | "
            f"{100 * g['identical']:.1f}% | {first}"
        )

    for f in floors.values():
        lines.append(f"| floor: {f['title']} | | | | | {cells(f, f['greedy'])} | |")
    for e in edge:
        lines.append(f"| edge: {e['title']} | | | | | {cells(e, e['greedy'])} | {'yes' if e['qualifies'] else 'no'} |")
    for r in rows:
        lines.append(
            f"| k={r['k']} {r['pair']} | {r['bytes_per_token']:.0f} | {r['vs_fp32']:.1f}x | "
            f"{r['vs_bf16']:.1f}x | {r['vs_token_ids']:.0f}x | {cells(r, r['greedy'])} | "
            f"{'reference' if r['pair'] == 'fp32/fp32' else 'yes' if r['qualifies'] else 'no'} |"
        )
    buckets = sorted({b for r in rows for b in r["buckets"]}, key=lambda s: int(s.split("-")[0].lstrip(">=")))
    lines += ["", "KL mean / flip rate by prompt length (tokens; positions in the reference row):", ""]
    lines.append("| row | " + " | ".join(buckets) + " |")
    lines.append("|" + "---|" * (len(buckets) + 1))
    ref_b = floors["bf16"]["buckets"]
    lines.append("| positions | " + " | ".join(str(ref_b.get(b, {}).get("positions", 0)) for b in buckets) + " |")
    for f in floors.values():
        cols = [
            f"{f['buckets'][b]['kl_mean']:.1e} / {100 * f['buckets'][b]['flip_rate']:.1f}%" if b in f["buckets"] else ""
            for b in buckets
        ]
        lines.append(f"| floor: {f['title']} | " + " | ".join(cols) + " |")
    for e in edge:
        cols = [
            f"{e['buckets'][b]['kl_mean']:.1e} / {100 * e['buckets'][b]['flip_rate']:.1f}%" if b in e["buckets"] else ""
            for b in buckets
        ]
        lines.append(f"| edge: {e['title']} | " + " | ".join(cols) + " |")
    for r in rows:
        cols = [
            f"{r['buckets'][b]['kl_mean']:.1e} / {100 * r['buckets'][b]['flip_rate']:.1f}%" if b in r["buckets"] else ""
            for b in buckets
        ]
        lines.append(f"| k={r['k']} {r['pair']} | " + " | ".join(cols) + " |")
    named = [(f"floor: {f['title']}", f) for f in floors.values()] + [(f"edge: {e['title']}", e) for e in edge]
    return lines + divergence_lines(named + [(f"k={r['k']} {r['pair']}", r) for r in rows])


def divergence_lines(named: list[tuple[str, dict]]) -> list[str]:
    """The table of the gaps at the first greedy divergences, one line per ``(name, row)`` (rows
    measured without them are left out)."""
    lines = [
        "",
        f"At each reply's first greedy divergence from the reference: the reference's top-2 gap (nats; "
        f"a near-tie at <= {fs.GAP_NATS:g}) and the row's own:",
        "",
        "| row | replies diverging | at near-ties | reference gap: median | reference gap: min | "
        "own gap: median | own gap: min |",
        "|" + "---|" * 7,
    ]

    def gap(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    for name, r in named:
        d = r.get("divergence")
        if d is None:
            continue
        lines.append(
            f"| {name} | {d['divergences']} of {r['greedy']['replies']} | {d['at_near_ties']} | "
            f"{gap(d['ref_gap_median'])} | {gap(d['ref_gap_min'])} | {gap(d['own_gap_median'])} | "
            f"{gap(d['own_gap_min'])} |"
        )
    return lines


@dataclass
class Tally:
    """One row's measures as its chats come (``benchmarks.fidelity_stats``): teacher-forced
    positions against the reference row, the first greedy divergences, the greedy replies."""

    positions: fs.Positions = field(default_factory=fs.Positions)
    divergences: fs.Divergences = field(default_factory=fs.Divergences)
    greedy: dict[str, list[int]] = field(default_factory=dict)

    def measures(self, refs: dict[str, list[int]]) -> dict:
        """The row's summary, greedy agreement with ``refs`` and divergence gaps."""
        greedy = fs.greedy_agreement(refs, self.greedy)
        return fs.summarize(self.positions) | {
            "greedy": greedy,
            "divergence": fs.summarize_divergences(self.divergences),
        }


def tally_chat(
    tallies: list[Tally], dists: np.ndarray, r: dict, ref_lps: np.ndarray, top_k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Add chat ``r`` (its ``id``, ``prompt`` and reference ``reply``) to one tally per row of
    ``dists`` (float32 ``[rows, n, V]``, row 0 the reference): each row's top-``top_k`` against
    row 0's, the log-probability of the reply's tokens, full KL, the divergences against the
    reference engine's ``ref_lps``, the greedy reply. Returns row 0's top-``top_k``."""
    reply = np.asarray(r["reply"])
    ref_top = fs.topk(dists[0], top_k)
    for n, t in enumerate(tallies):
        top = ref_top if n == 0 else fs.topk(dists[n], top_k)
        own = dists[n][np.arange(len(reply)), reply]  # log-probability of the reference reply's token
        t.positions.add_turn(ref_top, top, own, len(r["prompt"]), kl_full=fs.full_kl(dists[0], dists[n]))
        t.divergences.add_turn(reply, ref_lps, *top)
        t.greedy[r["id"]] = greedy_from_forced(reply, top[0][:, 0])
    return ref_top


def downlink_rows(
    hf: Path,
    reqs: list[dict],
    ref: dict,
    kvs: list[WireDtype],
    m: SplitManifest,
    threads: int,
    device: str,
    dtype: str,
    top_k: int,
) -> list[dict]:
    """Remote prefill's downlink in each of ``kvs`` (``kvs[0]`` fp32, the reference), teacher-forced
    over every chat (``benchmarks.teacher.RemotePrefillTeacher``): one row per format with the
    split rows' measures and its bytes per prompt token."""
    from tqdm import tqdm

    from tandem.benchmarks.teacher import RemotePrefillTeacher

    teacher = RemotePrefillTeacher(hf, BLOCK_TOKENS, threads, device, dtype)
    tallies = [Tally() for _ in kvs]
    for r in tqdm(reqs, desc="remote prefill downlink", unit="chat"):
        dists = teacher.forced(r["prompt"], r["reply"], kvs)  # [F, n, V]
        tally_chat(tallies, dists, r, ref[r["id"]]["lps"], top_k)
    lens = [len(r["prompt"]) for r in reqs]
    bf16_b = downlink_bytes_per_prompt_token(WireDtype.BF16, m, lens)
    refs = {r["id"]: r["reply"] for r in reqs}
    rows = []
    for f, t in zip(kvs, tallies, strict=True):
        b = downlink_bytes_per_prompt_token(f, m, lens)
        row = {"kv": f.name.lower(), "bytes_per_token": b, "vs_bf16": bf16_b / b if b else 0.0}
        rows.append(row | t.measures(refs))
    return rows


def downlink_lines(downlink: list[dict]) -> list[str]:
    """The markdown table of remote prefill's downlink formats (empty where none was measured)."""
    if not downlink:
        return []
    lines = [
        "",
        "Remote prefill's downlink: the KV of every layer of the prompt's full blocks through each format, "
        "the continuation teacher-forced on it (fp32 the reference):",
        "",
        "| KV format | B per prompt token | bf16 B / this | KL mean | KL p99 | flip rate | greedy: identical | "
        "within the floor |",
        "|" + "---|" * 8,
    ]
    for r in downlink:
        verdict = "reference" if r["kv"] == "fp32" else "yes" if r["qualifies"] else "no"
        lines.append(
            f"| {r['kv']} | {r['bytes_per_token']:.0f} | {r['vs_bf16']:.2f}x | {r['kl_mean']:.2e} | "
            f"{r['kl_p99']:.2e} | {100 * r['flip_rate']:.2f}% | {100 * r['greedy']['identical']:.1f}% | {verdict} |"
        )
    return lines


def default_table(rows: list[dict], floors: dict[str, dict], meta: dict, weights_blake3: str) -> dict:
    """The qualifying pairs per split layer, smallest first (``cloud.links.fidelity.FidelityTable``'s form)."""
    splits: dict[str, list[dict]] = {}
    for r in sorted(rows, key=lambda r: (r["k"], r["bytes_per_token"])):
        a, k = r["pair"].split("/")
        entry = {"activations": a, "kv": k, "bytes_per_token": round(r["bytes_per_token"], 1)}
        entry |= {"kl_mean": r["kl_mean"], "flip_rate": r["flip_rate"], "qualifies": r["qualifies"]}
        splits.setdefault(str(r["k"]), []).append(entry)
    bf = floors["bf16"]
    return {
        "weights_blake3": weights_blake3,
        "measured": meta,
        "rule": f"kl_mean and flip_rate each <= {fs.FLOOR_FACTOR:g}x the fp32-vs-bf16 engines' floor",
        "floor": {"kl_mean": bf["kl_mean"], "flip_rate": bf["flip_rate"]},
        "splits": splits,
    }


def downlink_table(downlink: list[dict]) -> list[dict]:
    """The downlink rows as ``cloud.links.fidelity.FidelityTable`` reads them (``remote_prefill``),
    smallest first, the fp32 reference left out."""
    keep = ("kv", "bytes_per_token", "kl_mean", "flip_rate", "qualifies")
    rows = sorted((r for r in downlink if r["kv"] != "fp32"), key=lambda r: r["bytes_per_token"])
    return [{k: round(r[k], 1) if k == "bytes_per_token" else r[k] for k in keep} for r in rows]


@app.command()
def main(
    model_dir: Annotated[Path, typer.Option(help="prepared model directory")] = Path("models/smollm2-135m"),
    split_layers: Annotated[str, typer.Option(help="split layers k (exported split-k<k> directories)")] = "4",
    pairs: Annotated[
        str, typer.Option(help="activation/KV format pairs (fp32/fp32 is always the reference)")
    ] = DEFAULT_PAIRS,
    prompts_file: Annotated[Path, typer.Option(help="JSONL prompt set")] = PROMPTS,
    limit: Annotated[int, typer.Option(help="first N prompts only (0 = all)")] = 0,
    sample: Annotated[int, typer.Option(help="every (prompts / N)-th prompt, N in all (0 = all)")] = 0,
    max_new_tokens: int = 32,
    top_k: Annotated[int, typer.Option(help="engine prompt_logprobs per position (vLLM max_logprobs)")] = 64,
    threads: Annotated[int, typer.Option(help="torch and ONNX Runtime threads in this process (0 = default)")] = 0,
    dtype: Annotated[
        str,
        typer.Option(
            help="compute dtype of the reference engine and the in-process tail and full model: float32 "
            "(the wire formats' reference) or bfloat16 (a GPU cloud's: the split against direct in bf16)"
        ),
    ] = "float32",
    device: Annotated[str, typer.Option(help="torch device of the in-process tail and full model: cpu or cuda")] = (
        "cpu"
    ),
    edge_decoder: Annotated[
        str,
        typer.Option(
            help="the edge's whole model for the edge row: a built decoder directory (tandem-model's "
            "edge-decoder/, built for --device), auto (the model directory's edge-decoder/ where it holds "
            "one) or none"
        ),
    ] = "auto",
    downlink_kvs: Annotated[
        str,
        typer.Option(
            help="KV formats of remote prefill's downlink to measure (every layer's KV of the prompt's full "
            "blocks; fp32 is always the reference; '' for none)"
        ),
    ] = DEFAULT_DOWNLINK_KVS,
    out: Annotated[Path, typer.Option(help="output directory")] = Path("bench-results/fidelity"),
    render: Annotated[bool, typer.Option(help="only write the tables, plot and table again from out/fidelity.json")] = (
        False
    ),
) -> None:
    """Measure every pair at every split layer against the engines' noise floor; write the tables and plot."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    if render:
        k0 = int(split_layers.split(",")[0])
        write_outputs(out, SplitManifest.load(model_dir / f"split-k{k0}").weights_blake3)
        return

    from tandem.benchmarks.edge_teacher import EdgeTeacher
    from tandem.benchmarks.teacher import SplitTeacher
    from tandem.common.protocol.chat import prompt_token_ids

    if dtype not in SHORT_DTYPE:
        raise typer.BadParameter(f"--dtype {dtype!r}: float32 or bfloat16")
    edge_dir = edge_decoder_dir(edge_decoder, model_dir)
    try:  # loaded first: a graph that cannot run on --device is refused before the engines run
        edge_teacher = None if edge_dir is None else EdgeTeacher(edge_dir, device, threads)
    except ValueError as refused:
        raise typer.BadParameter(f"--edge-decoder: {refused}") from None
    other = "bfloat16" if dtype == "float32" else "float32"  # the second engine: the precision floor
    ks = [int(k) for k in split_layers.split(",") if k.strip()]
    plist = parse_pairs(pairs)
    prompts = load_prompts(prompts_file, limit, sample)
    out.mkdir(parents=True, exist_ok=True)
    manifests = {k: SplitManifest.load(model_dir / f"split-k{k}") for k in ks}
    m0 = manifests[ks[0]]
    hf = m0.resolve(model_dir / f"split-k{ks[0]}", m0.full_checkpoint)
    tok = AutoTokenizer.from_pretrained(
        str(m0.resolve(model_dir / f"split-k{ks[0]}", m0.tokenizer or m0.full_checkpoint))
    )
    reqs = [{"id": p["id"], "prompt": prompt_token_ids(tok, p["messages"]), "reply": None} for p in prompts]
    lengths = {r["id"]: len(r["prompt"]) for r in reqs}
    w = Path(tempfile.mkdtemp(prefix="tandem-fidelity-"))
    t0 = time.perf_counter()
    edge_note = "no edge row" if edge_teacher is None else f"edge row: {edge_teacher.title} from {edge_dir}"
    print(
        f"tandem-bench fidelity: {len(reqs)} chats, k={ks}, {len(plist)} pairs, {edge_note}; engine logs in {w}",
        file=sys.stderr,
    )

    # one engine in the compute dtype: the reference (its greedy replies, one request at a time),
    # then the same replies four at a time (the batching floor)
    engines: dict[str, dict] = {}
    ref, engines["batching"] = run_engine(
        hf, reqs, [(w / f"{dtype}-c1.npz", 1), (w / f"{dtype}-c4.npz", 4)], dtype, top_k, max_new_tokens
    )
    for r in reqs:
        r["reply"] = [int(x) for x in ref[r["id"]]["reply"]]
    failed: list[BaseException] = []

    def floor_runs() -> None:  # beside the in-process pass: the engine is a child process
        try:
            (engines["bf16"],) = run_engine(hf, reqs, [(w / f"{other}-c1.npz", 1)], other, top_k, max_new_tokens)
        except BaseException as e:  # re-raised in the main thread
            failed.append(e)

    floor_thread = threading.Thread(target=floor_runs, name="fidelity-floor")
    floor_thread.start()

    rows: list[dict] = []
    check, check_div = fs.Positions(), fs.Divergences()  # in-process fp32 against the fp32 engine
    check_greedy: dict[str, list[int]] = {}
    for k in ks:
        teacher = SplitTeacher(model_dir / f"split-k{k}", BLOCK_TOKENS, threads, device, dtype)
        tallies = [Tally() for _ in plist]
        for r in tqdm(reqs, desc=f"teacher-forced k={k}", unit="chat"):
            reply = np.asarray(r["reply"])
            dists = teacher.forced(teacher.head_pass(r["prompt"]), r["reply"], plist)  # [P, n, V]
            ref_lp = dists[0]
            e = ref[r["id"]]  # the reference engine's: its top-2 gaps at the divergences
            ref_top = tally_chat(tallies, dists, r, e["lps"], top_k)
            if k == ks[0]:
                check.add_turn((e["ids"], e["lps"]), ref_top, ref_lp[np.arange(len(reply)), reply], len(r["prompt"]))
                check_div.add_turn(reply, e["lps"], *ref_top)
                check_greedy[r["id"]] = greedy_from_forced(reply, ref_top[0][:, 0])
        lens = [len(r["prompt"]) for r in reqs]
        fp32_b = bytes_per_prompt_token(FP32_PAIR, manifests[k], lens)
        bf16_b = bytes_per_prompt_token((WireDtype.BF16, WireDtype.BF16), manifests[k], lens)
        ids_b = sum(fs.varint_bytes(t) for r in reqs for t in r["prompt"]) / sum(lens)
        refs = {r["id"]: r["reply"] for r in reqs}
        for p, t in zip(plist, tallies, strict=True):
            b = bytes_per_prompt_token(p, manifests[k], lens)
            row = {"k": k, "pair": label(p), "bytes_per_token": b, "vs_fp32": fp32_b / b, "vs_bf16": bf16_b / b}
            rows.append(row | {"vs_token_ids": b / ids_b} | t.measures(refs))
        del teacher
    dkvs = parse_kvs(downlink_kvs)
    downlink = downlink_rows(hf, reqs, ref, dkvs, m0, threads, device, dtype, top_k) if dkvs else []
    edge = [] if edge_teacher is None else [edge_row(edge_teacher, reqs, ref, top_k, dtype)]
    del edge_teacher

    floor_thread.join()
    if failed:
        raise failed[0]
    with open(w / "state.pkl", "wb") as f:  # everything measured, for reading again without a rerun
        state = {"rows": rows, "edge": edge, "downlink": downlink, "check": check, "check_greedy": check_greedy}
        state["check_div"] = check_div
        pickle.dump(state | {"ref": ref, "engines": engines}, f)
    floors = {}
    titles = (
        ("batching", f"{SHORT_DTYPE[dtype]} engine, concurrency 1 vs 4"),
        ("bf16", f"{SHORT_DTYPE[dtype]} vs {SHORT_DTYPE[other]} engines"),
    )
    for key, title in titles:
        floors[key] = {"title": title, "top_k": top_k, **compare_engines(ref, engines[key], lengths)}
    floors["in_process"] = {  # in bf16: direct mode (the engine) against the split (fp32 head, fp32 wire, bf16 tail)
        "title": "fp32 engine vs in-process fp32"
        if dtype == "float32"
        else f"bf16 engine (direct) vs in-process split (fp32 wire, bf16 tail on {device})",
        "top_k": top_k,
        **fs.summarize(check),
        "greedy": fs.greedy_agreement({r["id"]: r["reply"] for r in reqs}, check_greedy),
        "divergence": fs.summarize_divergences(check_div),
    }
    for r in rows:
        r["qualifies"] = r["pair"] != "fp32/fp32" and fs.qualifies(r, floors["bf16"])
    meta = {
        "prompts": len(reqs),
        "selection": f"every {200 // max(1, len(reqs))}th of 200"
        if sample
        else ("first " + str(len(reqs)) if limit else "all"),
        "max_new_tokens": max_new_tokens,
        "top_k": top_k,
        "dtype": dtype,
        "device": device,
        "positions": floors["bf16"]["positions"],
        "split_layers": ks,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    data = {"meta": meta, "floors": floors, "edge": edge, "rows": rows, "downlink": downlink}
    (out / "fidelity.json").write_text(json.dumps(data, indent=1))
    write_outputs(out, m0.weights_blake3)


def write_outputs(out: Path, weights_blake3: str) -> None:
    """From ``out/fidelity.json``: ``fidelity.md``, ``fidelity.png`` and ``fidelity-table.json``
    (qualifying again by the current rule), and the tables on stdout."""
    data = json.loads((out / "fidelity.json").read_text())
    rows, floors, meta, edge = data["rows"], data["floors"], data["meta"], data.get("edge", [])
    for r in rows:
        r["qualifies"] = r["pair"] != "fp32/fp32" and fs.qualifies(r, floors["bf16"])
    for e in edge:  # the edge's whole model against direct mode, by the same rule
        e["qualifies"] = fs.qualifies(e, floors["bf16"])
    downlink = data.get("downlink", [])
    for d in downlink:
        d["qualifies"] = d["kv"] != "fp32" and fs.qualifies(d, floors["bf16"])
    lines = table_lines(rows, floors, meta, edge) + downlink_lines(downlink)
    (out / "fidelity.md").write_text("\n".join(lines) + "\n")
    table = default_table(rows, floors, meta, weights_blake3)
    if downlink:
        table["remote_prefill"] = downlink_table(downlink)
    (out / "fidelity-table.json").write_text(json.dumps(table, indent=1) + "\n")
    plot(out / "fidelity.png", rows, floors)
    print("\n".join(lines))
    print(f"results in {out}: fidelity.md, fidelity.json, fidelity.png, fidelity-table.json", file=sys.stderr)


if __name__ == "__main__":
    app()
