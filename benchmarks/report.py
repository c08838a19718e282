"""Benchmark output: per-request records, summary table (CSV + markdown) and PNG plots.

The break-even map is *derived*: for each mode and prompt length it takes the
compute time measured on the loopback link (TTFT there) and the bytes each
request sent, and predicts ``TTFT = compute + uplink_bytes * 8 / rate + RTT``
(edge-only: compute alone) over a grid of uplink rates; the measured profiles
are drawn on it to check the prediction.
"""

from __future__ import annotations

import csv
import json
from collections import Counter, defaultdict
from dataclasses import asdict
from pathlib import Path

import numpy as np

from tandem.benchmarks import links as linkmod
from tandem.benchmarks.records import RequestRecord, auto_row, is_auto
from tandem.edge.link.connection import upload_receive_ms
from tandem.stages import TTFT_STAGES, Stage

STAGES = (*TTFT_STAGES, Stage.CLOUD_DECODE)  # mean of each per summary row, keyed by its wire name
MAP_RTT_MS = 30.0
MAP_RATE_MBPS = 40.0


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


PAYLOAD_KINDS = ("activations", "kv", "header")  # the uplink bytes a split request sends


def summarize(records) -> list[dict]:
    groups = defaultdict(list)
    for r in records:
        groups[(r.mode, r.link, r.target_prompt_tokens)].append(r)
    rows = []
    for (mode, link, _target), rs in sorted(groups.items()):
        ttft = [r.ttft_ms for r in rs]
        itl = [x for r in rs for x in r.itl_ms]
        wall_s = max(r.end_s for r in rs) - min(r.start_s for r in rs)
        prompt = sum(r.prompt_tokens for r in rs)
        sent: defaultdict[str, int] = defaultdict(int)
        for r in rs:
            for k in PAYLOAD_KINDS:
                sent[k] += r.sent_bytes.get(k, 0)
        row = {
            "mode": mode,
            "link": link,
            "prompt_tokens": round(prompt / len(rs)),
            "requests": len(rs),
            "ttft_mean_ms": float(np.mean(ttft)),
            "ttft_p50_ms": pct(ttft, 50),
            "ttft_p99_ms": pct(ttft, 99),
            "itl_mean_ms": float(np.mean(itl)) if itl else float("nan"),
            "itl_p50_ms": pct(itl, 50),
            "itl_p99_ms": pct(itl, 99),
            "e2e_mean_ms": float(np.mean([r.e2e_ms for r in rs])),
            "throughput_rps": len(rs) / wall_s if wall_s > 0 else float("nan"),
            "output_tokens_per_s": sum(r.output_tokens for r in rs) / wall_s if wall_s > 0 else float("nan"),
            "bytes_per_prompt_token": sum(sent.values()) / prompt,
            "activation_bytes_per_prompt_token": sent["activations"] / prompt,
            "kv_bytes_per_prompt_token": sent["kv"] / prompt,
            "header_bytes_per_prompt_token": sent["header"] / prompt,
            "uplink_bytes_mean": sum(sent.values()) / len(rs),
        }
        # goodput as the receiver sees it: payload over the cloud's receive interval (the header's
        # arrival to the last item verified, less admission queueing), the interval the edge's own
        # passive goodput samples use (edge.link.connection.observe_upload); the RTT is latency, not rate
        timed = [(r, ms) for r in rs if (ms := upload_receive_ms(r.timings_ms)) > 0]
        up_bytes = sum(sum(r.sent_bytes.get(k, 0) for k in PAYLOAD_KINDS) for r, _ in timed)
        up_ms = sum(ms for _, ms in timed)
        row["cloud_receive_ms"] = up_ms / len(timed) if timed else float("nan")
        row["uplink_goodput_mbps"] = up_bytes * 8 / (up_ms * 1e3) if up_ms else float("nan")
        for st in STAGES:
            vals = [r.timings_ms[st] for r in rs if st in r.timings_ms]
            row[st.value] = float(np.mean(vals)) if vals else float("nan")
        # what a request held the cloud's engines for: the tail prefill and the decode engine's
        # request (remote prefill: until the handover); 0 for edge-only
        row["cloud_engine_ms"] = float(np.mean([cloud_engine_ms(r.timings_ms) for r in rs]))
        floors = [f for r in rs if not np.isnan(f := ttft_floor_ms(r))]
        row["ttft_floor_ms"] = float(np.mean(floors)) if floors else float("nan")
        row["ttft_over_floor"] = row["ttft_mean_ms"] / row["ttft_floor_ms"] if floors else float("nan")
        rows.append(row)
    return rows


def ttft_floor_ms(r: RequestRecord) -> float:
    """The physical floor of one request's TTFT: its own measured compute before the first token and
    what its link cannot go below, the uplink's ``bytes * 8 / rate`` and one RTT (the profile's, see
    ``benchmarks.links``; an unshaped rate adds nothing). Queueing, encoding, verification, the
    proxy's jitter and stalls are left out: they are what the system adds above the floor.

    Per served mode, from ``timings_ms``: split: ``max(edge head, uplink wire time) + tail prefill
    with its first token + RTT`` (the head's chunks stream while later ones are computed, so the
    two overlap at best; the tail starts only when the last chunk has arrived); direct and remote
    prefill: the decode engine's prefill with its first token plus the header's wire time and the
    RTT; local: the whole model's prefill with its first token (no link). NaN when the stages or
    the link profile are unknown.
    """
    t = r.timings_ms
    if Stage.LOCAL_PREFILL in t:
        return float(t[Stage.LOCAL_PREFILL])
    prof = linkmod.PROFILES.get(r.link)
    if prof is None:
        return float("nan")
    up_bytes = sum(r.sent_bytes.get(k, 0) for k in PAYLOAD_KINDS)
    wire_ms = up_bytes * 8 / (prof.uplink_mbps * 1e3) if prof.uplink_mbps else 0.0
    if Stage.CLOUD_TAIL_PREFILL in t:
        return float(max(t.get(Stage.EDGE_HEAD, 0.0), wire_ms) + t[Stage.CLOUD_TAIL_PREFILL] + prof.rtt_ms)
    if Stage.CLOUD_DECODE_FIRST_TOKEN in t:
        return float(t[Stage.CLOUD_DECODE_FIRST_TOKEN] + wire_ms + prof.rtt_ms)
    return float("nan")


def cloud_engine_ms(timings: dict) -> float:
    """Engine milliseconds one request held the cloud for (its tail prefill and decode requests)."""
    return float(timings.get(Stage.CLOUD_TAIL_PREFILL, 0.0) + timings.get(Stage.CLOUD_DECODE, 0.0))


def to_markdown(rows: list[dict]) -> str:
    cols = [
        ("mode", "mode"),
        ("link", "link"),
        ("prompt_tokens", "prompt tok"),
        ("ttft_mean_ms", "TTFT mean ms"),
        ("ttft_p99_ms", "TTFT p99 ms"),
        ("ttft_floor_ms", "TTFT floor ms"),
        ("ttft_over_floor", "TTFT / floor"),
        ("itl_mean_ms", "ITL mean ms"),
        ("itl_p50_ms", "ITL p50 ms"),
        ("itl_p99_ms", "ITL p99 ms"),
        ("e2e_mean_ms", "e2e mean ms"),
        ("cloud_engine_ms", "cloud eng ms"),
        ("throughput_rps", "req/s"),
        ("output_tokens_per_s", "out tok/s"),
        ("bytes_per_prompt_token", "B/prompt tok"),
        ("kv_bytes_per_prompt_token", "KV B/tok"),
        ("activation_bytes_per_prompt_token", "act B/tok"),
        (Stage.EDGE_HEAD, "head ms"),
        (Stage.UPLINK, "uplink ms"),
        (Stage.CLOUD_TAIL_PREFILL, "tail ms"),
        (Stage.CLOUD_DECODE_FIRST_TOKEN, "handoff+1st ms"),
    ]
    lines = ["| " + " | ".join(c[1] for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for key, _ in cols:
            v = r[key]
            cells.append(
                f"{v:.1f}" if isinstance(v, float) and not np.isnan(v) else ("-" if isinstance(v, float) else str(v))
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


AUTO_TARGET = 1.10  # the target: each auto row within 10% of the best fixed mode of every cell, by its objective


def _cell(r: dict) -> tuple[str, int]:
    return r["link"], r["prompt_tokens"] // 8  # prompt lengths of one target differ by a few tokens


def best_fixed(rows: list[dict], metric: str = "ttft_mean_ms") -> dict[tuple[str, int], dict]:
    """Per cell (link, prompt length) the fixed-mode row (any row not ``records.is_auto``) with the
    lowest ``metric`` (a ``summarize`` column: ``ttft_mean_ms``, ``e2e_mean_ms``)."""
    best: dict[tuple[str, int], dict] = {}
    for r in rows:
        if not is_auto(r["mode"]) and (_cell(r) not in best or r[metric] < best[_cell(r)][metric]):
            best[_cell(r)] = r
    return best


def ratios_markdown(rows: list[dict]) -> str:
    """TTFT of each split row relative to cloud-only on the same link and prompt length."""
    base = {_cell(r): r["ttft_mean_ms"] for r in rows if r["mode"] == "cloud-only"}
    best = best_fixed(rows)
    out = ["| mode | link | prompt tok | TTFT / cloud-only | best fixed mode |", "|---|---|---|---|---|"]
    for r in rows:
        if r["mode"].startswith("split") and _cell(r) in base:
            out.append(
                f"| {r['mode']} | {r['link']} | {r['prompt_tokens']} | {r['ttft_mean_ms'] / base[_cell(r)]:.2f}x | "
                f"{best[_cell(r)]['mode']} |"
            )
    return "\n".join(out) + "\n"


def goodput_markdown(rows: list[dict], links: list[dict]) -> str:
    """Uplink goodput of each split row on a shaped link: payload bits over the cloud's receive
    interval (``edge.link.connection.upload_receive_ms``), against the link's shaped uplink rate.
    Empty when no split row ran on a shaped link."""
    rate = {lk["name"]: lk.get("uplink_mbps") for lk in links}
    out = [
        "| mode | link | prompt tok | uplink MB | cloud receive ms | goodput Mbit/s | shaped Mbit/s "
        "| goodput / shaped |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        shaped = rate.get(r["link"])
        if not r["mode"].startswith("split") or not shaped or np.isnan(r["uplink_goodput_mbps"]):
            continue
        out.append(
            f"| {r['mode']} | {r['link']} | {r['prompt_tokens']} | {r['uplink_bytes_mean'] / 1e6:.2f} | "
            f"{r['cloud_receive_ms']:.0f} | {r['uplink_goodput_mbps']:.1f} | {shaped:.0f} | "
            f"{r['uplink_goodput_mbps'] / shaped:.0%} |"
        )
    return "\n".join(out) + "\n" if len(out) > 2 else ""


def auto_cells(rows: list[dict], records) -> list[dict]:
    """Per auto row (``records.is_auto``) and cell: its mean by its objective (``records.auto_row``:
    ``auto`` TTFT, ``auto-whole`` end-to-end time) against the best fixed mode's by the same, the
    modes it served and its mean absolute TTFT prediction error. Keys: ``label``, ``metric_name``,
    ``link``, ``prompt_tokens``, ``best_mode``, ``best_ms``, ``auto_ms``, ``ratio``, ``served``
    (``{mode: requests}``), ``prediction_error``."""
    served: dict[tuple[str, str, int], list] = defaultdict(list)
    for rec in records:
        if is_auto(rec.mode):
            served[(rec.mode, rec.link, rec.prompt_tokens // 8)].append(rec)
    out = []
    for r in rows:
        if not is_auto(r["mode"]):
            continue
        objective = auto_row(r["mode"])
        b = best_fixed(rows, objective.metric).get(_cell(r))
        if b is None:
            continue
        recs = served.get((r["mode"], *_cell(r)), [])
        picks: defaultdict[str, int] = defaultdict(int)
        for rec in recs:
            picks[rec.served_mode + (f"-k{rec.served_split_layer}" if rec.served_mode == "split" else "")] += 1
        errs = [abs(rec.ttft_ms - rec.predicted_ttft_ms) / rec.ttft_ms for rec in recs if rec.predicted_ttft_ms > 0]
        out.append(
            {
                "label": r["mode"],
                "metric_name": objective.metric_name,
                "link": r["link"],
                "prompt_tokens": r["prompt_tokens"],
                "best_mode": b["mode"],
                "best_ms": b[objective.metric],
                "auto_ms": r[objective.metric],
                "ratio": r[objective.metric] / b[objective.metric],
                "served": dict(picks),
                "prediction_error": float(np.mean(errs)) if errs else float("nan"),
            }
        )
    return out


def auto_markdown(cells: list[dict]) -> str:
    """A table per auto row of ``auto_cells``, each by its own objective, with the count of its
    cells within ``AUTO_TARGET`` of the best fixed mode."""
    sections = []
    for label in dict.fromkeys(c["label"] for c in cells):
        mine = [c for c in cells if c["label"] == label]
        m = mine[0]["metric_name"]
        lines = [
            f"| link | prompt tok | best fixed mode ({m}) | its {m} ms | {label} {m} ms | {label} / best | "
            f"{label} served | mean abs TTFT pred. error |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for c in mine:
            mark = "" if c["ratio"] <= AUTO_TARGET else " **over**"
            served = ", ".join(f"{mode} x{n}" for mode, n in sorted(c["served"].items()))
            lines.append(
                f"| {c['link']} | {c['prompt_tokens']} | {c['best_mode']} | {c['best_ms']:.1f} | "
                f"{c['auto_ms']:.1f} | {c['ratio']:.2f}x{mark} | {served} | {c['prediction_error']:.0%} |"
            )
        within = sum(c["ratio"] <= AUTO_TARGET for c in mine)
        lines.append(
            f"\n{label} within {AUTO_TARGET - 1:.0%} of the best fixed mode's {m} in {within} of {len(mine)} cells\n"
        )
        sections.append("\n".join(lines) + "\n")
    return "\n".join(sections)


AUTO_STYLES: dict[str, dict] = {  # auto's rows stand out of the fixed modes' lines, and from each other
    "auto": {"linewidth": 2.5, "color": "black", "marker": "*"},
    "auto-whole": {"linewidth": 2.5, "color": "black", "marker": "P", "linestyle": "--"},
}


def line_style(label: str) -> dict:
    """Matplotlib keywords of a row's line: each auto row its own bold black style (``AUTO_STYLES``;
    another ``auto-*`` row dotted grey), a fixed mode the colour cycle's next with round markers."""
    if is_auto(label):
        return AUTO_STYLES.get(label, {"linewidth": 2.5, "color": "dimgray", "marker": "*", "linestyle": ":"})
    return {"marker": "o"}


def plot_ttft(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    link_names = [lk for lk in dict.fromkeys(r["link"] for r in rows) if lk != "none"]
    ncols = min(3, max(1, len(link_names)))
    nrows = -(-max(1, len(link_names)) // ncols)
    fig, grid = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.6 * nrows), squeeze=False)
    axes = [list(grid.flat)]
    edge = sorted(  # records where edge-only was measured once, without a link
        (r["prompt_tokens"], r["ttft_mean_ms"]) for r in rows if r["mode"] == "edge-only" and r["link"] == "none"
    )
    for ax, link in zip(axes[0], link_names, strict=False):
        for mode in dict.fromkeys(r["mode"] for r in rows if r["link"] == link):
            pts = sorted(
                (r["prompt_tokens"], r["ttft_mean_ms"]) for r in rows if r["mode"] == mode and r["link"] == link
            )
            ax.plot(*zip(*pts, strict=True), label=mode, **line_style(mode))
        if edge:
            ax.plot(*zip(*edge, strict=True), marker="s", linestyle="--", color="gray", label="edge-only")
        ax.set_title(f"link: {link}")
        ax.set_xlabel("prompt length (tokens)")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("TTFT mean (ms)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Time to first token vs prompt length")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _best_modes(loop: list[dict], modes: list[str], lens: list[int], net_ms) -> np.ndarray:
    """Index of the lowest predicted TTFT per (grid point, prompt length).

    ``net_ms(nbytes)`` gives the link time in ms for each grid point (shape ``[G, len(lens)]``);
    edge-only pays none. Returns int ``[G, len(lens)]``.
    """
    grid_shape = np.shape(net_ms(np.zeros(len(lens))))
    preds = []
    for m in modes:
        pts = sorted((r["prompt_tokens"], r["ttft_mean_ms"], r["uplink_bytes_mean"]) for r in loop if r["mode"] == m)
        t, c, b = (np.array(x, float) for x in zip(*pts, strict=True))
        comp, nbytes = np.interp(lens, t, c), np.interp(lens, t, b)
        preds.append(np.broadcast_to(comp + (0.0 if m == "edge-only" else net_ms(nbytes)), grid_shape))
    return np.argmin(np.stack(preds), axis=0)


def _draw_map(
    ax,
    best: np.ndarray,
    y_edges: np.ndarray,
    lens: list[int],
    cmap,
    n_modes: int,
    ylabel: str,
    links: list[dict],
    link_key: str,
    title: str,
) -> None:
    ax.pcolormesh(np.arange(len(lens) + 1), y_edges, best, cmap=cmap, vmin=-0.5, vmax=n_modes - 0.5, shading="flat")
    ax.set_yscale("log")
    ax.set_xticks(np.arange(len(lens)) + 0.5, [str(x) for x in lens])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel(ylabel)
    for p in links:
        if p.get(link_key):
            ax.axhline(p[link_key], color="k", lw=0.6, ls=":")
            ax.text(len(lens) - 0.05, p[link_key], p["name"], ha="right", va="bottom", fontsize=8)
    ax.set_title(title)


def plot_breakeven(rows: list[dict], path: Path, links: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    loop = [r for r in rows if r["link"] in ("loopback", "none") and not is_auto(r["mode"])]
    modes = sorted({r["mode"] for r in loop})
    if not loop or not modes:
        return
    lens = sorted({r["prompt_tokens"] for r in loop if r["mode"] == modes[0]})
    cmap = ListedColormap(plt.get_cmap("tab10")(np.arange(len(modes))))  # tab10's first colours
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    # left: uplink rate x prompt length at a fixed RTT
    rate_edges = np.logspace(np.log10(0.5), np.log10(1000), 61)
    rates = np.sqrt(rate_edges[:-1] * rate_edges[1:])[:, None]  # [G, 1] Mbit/s
    best = _best_modes(loop, modes, lens, lambda nbytes: nbytes * 8 / (rates * 1e6) * 1e3 + MAP_RTT_MS)
    _draw_map(
        ax,
        best,
        rate_edges,
        lens,
        cmap,
        len(modes),
        "uplink rate (Mbit/s)",
        links,
        "uplink_mbps",
        f"rate x prompt length (RTT {MAP_RTT_MS:.0f} ms)",
    )
    # right: RTT x prompt length at a fixed rate
    rtt_edges = np.logspace(0, np.log10(400), 61)
    rtts = np.sqrt(rtt_edges[:-1] * rtt_edges[1:])[:, None]  # [G, 1] ms
    best = _best_modes(loop, modes, lens, lambda nbytes: nbytes * 8 / (MAP_RATE_MBPS * 1e6) * 1e3 + rtts)
    _draw_map(
        ax2,
        best,
        rtt_edges,
        lens,
        cmap,
        len(modes),
        "RTT (ms)",
        links,
        "rtt_ms",
        f"RTT x prompt length (uplink {MAP_RATE_MBPS:.0f} Mbit/s)",
    )
    handles = [plt.Rectangle((0, 0), 1, 1, color=cmap(i)) for i in range(len(modes))]
    ax.legend(handles, modes, loc="upper left", fontsize=8, title="lowest TTFT")
    fig.suptitle("Break-even maps, derived from measured loopback compute time and bytes per request")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_records(path: Path) -> list:
    """Records from a ``records.jsonl`` (to re-render a report)."""
    return [RequestRecord(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def failed_markdown(failed: list[dict]) -> str:
    """The requests that failed (``meta["failed_requests"]``: mode, link, target_prompt_tokens,
    error), counted per cell and error; "" for none."""
    if not failed:
        return ""
    counts = Counter((f["mode"], f["link"], f["target_prompt_tokens"], f["error"]) for f in failed)
    lines = [
        f"\n{len(failed)} requests failed and are not in the tables above:\n",
        "| mode | link | prompt tok | error | requests |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {m} | {link} | {n} | {err} | {c} |" for (m, link, n, err), c in counts.items()]
    return "\n".join(lines) + "\n"


def write_all(out: Path, records, meta: dict) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "records.jsonl").write_text("".join(json.dumps(asdict(r)) + "\n" for r in records))
    rows = summarize(records)
    with (out / "summary.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    md = (
        f"Machine: {meta['platform']}, {meta['cpus']} CPUs; shaper: {meta['shaper']}; "
        f"versions: {meta['versions']}\n\n" + to_markdown(rows) + "\n" + ratios_markdown(rows)
    )
    md += failed_markdown(meta.get("failed_requests", []))
    goodput = goodput_markdown(rows, meta.get("links", []))
    if goodput:
        md += (
            "\nUplink goodput (payload over the cloud's receive interval: the header's arrival to the "
            "last item verified; requests queued for admission left out; a pipelined upload, on by default, also "
            "holds the edge head's compute where the head is slower than the link):\n\n" + goodput
        )
    cells = auto_cells(rows, records)
    if cells:
        md += "\n" + auto_markdown(cells)
        (out / "auto.md").write_text(auto_markdown(cells))
    (out / "summary.md").write_text(md)
    plot_ttft(rows, out / "ttft_vs_prompt.png")
    plot_breakeven(rows, out / "breakeven.png", meta.get("links", []))
    return rows


def output_matrix_markdown(rows_by_output: dict[int, list[dict]]) -> str:
    """One row per (link, prompt length, output length, mode): TTFT, ITL, end to end and the cloud's
    engine time per request; then per (link, prompt, output) the fixed mode with the lowest end-to-end
    time, the one holding the cloud's engines least (cloud engine ms; edge-only holds none) and each
    auto row's end-to-end time over that lowest one (``records.is_auto``: never a fixed mode)."""
    autos = list(dict.fromkeys(r["mode"] for rows in rows_by_output.values() for r in rows if is_auto(r["mode"])))
    lines = [
        "| link | prompt tok | output tok | mode | TTFT mean ms | ITL mean ms | e2e mean ms | cloud engine ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    cells: dict[tuple[str, int, int], list[dict]] = defaultdict(list)
    for n_out, rows in sorted(rows_by_output.items()):
        for r in rows:
            cells[(*_cell(r), n_out)].append(r)
    for (link, _, n_out), rs in sorted(cells.items()):
        for r in sorted(rs, key=lambda r: r["mode"]):
            lines.append(
                f"| {link} | {r['prompt_tokens']} | {n_out} | {r['mode']} | {r['ttft_mean_ms']:.0f} | "
                f"{r['itl_mean_ms']:.1f} | {r['e2e_mean_ms']:.0f} | {r['cloud_engine_ms']:.0f} |"
            )
    heads = ["link", "prompt tok", "output tok", "lowest e2e (ms)", "least cloud engine time among cloud modes (ms)"]
    heads += [f"{a} e2e / lowest" for a in autos]
    lines += ["", "| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for (link, _, n_out), rs in sorted(cells.items()):
        fixed = [r for r in rs if not is_auto(r["mode"])]
        if not fixed:
            continue
        fastest = min(fixed, key=lambda r: r["e2e_mean_ms"])
        cloud = [r for r in fixed if r["mode"] != "edge-only"]  # edge-only holds no cloud engine
        lightest = min(cloud, key=lambda r: r["cloud_engine_ms"]) if cloud else None
        light = f"{lightest['mode']} ({lightest['cloud_engine_ms']:.0f})" if lightest else "-"
        here = {r["mode"]: r["e2e_mean_ms"] for r in rs}
        vs = [f"{here[a] / fastest['e2e_mean_ms']:.2f}x" if a in here else "-" for a in autos]
        lines.append(
            f"| {link} | {rs[0]['prompt_tokens']} | {n_out} | {fastest['mode']} ({fastest['e2e_mean_ms']:.0f}) | "
            + " | ".join([light, *vs])
            + " |"
        )
    return "\n".join(lines) + "\n"


def plot_output_matrix(rows_by_output: dict[int, list[dict]], path: Path) -> None:
    """End-to-end time against output length, a panel per (link, prompt length), a line per mode
    (each auto row in its own style, ``line_style``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    flat = [(n, r) for n, rows in rows_by_output.items() for r in rows]
    links = list(dict.fromkeys(r["link"] for _, r in flat))
    prompts = sorted({_cell(r)[1] for _, r in flat})
    fig, grid = plt.subplots(
        len(links), len(prompts), figsize=(4.2 * len(prompts), 3.3 * len(links)), squeeze=False, sharex=True
    )
    for i, link in enumerate(links):
        for j, p in enumerate(prompts):
            ax = grid[i][j]
            here = [(n, r) for n, r in flat if _cell(r) == (link, p)]
            for mode in sorted({r["mode"] for _, r in here}):
                pts = sorted((n, r["e2e_mean_ms"]) for n, r in here if r["mode"] == mode)
                ax.plot(*zip(*pts, strict=True), label=mode, **line_style(mode))
            ax.set_title(f"{link}, ~{p * 8} prompt tokens", fontsize=9)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(alpha=0.3)
            if i == len(links) - 1:
                ax.set_xlabel("output tokens")
            if j == 0:
                ax.set_ylabel("end to end, mean ms")
    grid[0][0].legend(fontsize=7)
    fig.suptitle("End-to-end time vs output length")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_output_matrix(out: Path, rows_by_output: dict[int, list[dict]]) -> None:
    """``outputs.md`` and ``outputs.png`` across the runs of ``tandem-bench modes --output-lens``."""
    (out / "outputs.md").write_text(output_matrix_markdown(rows_by_output))
    plot_output_matrix(rows_by_output, out / "outputs.png")
