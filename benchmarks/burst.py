"""``tandem-bench burst``: two edges on one cloud, one flooding it; does the quiet one keep its SLO?

One ``tandem-cloud`` (real vLLM engines) and two ``tandem-edge`` daemons, all child processes on
this machine. The *quiet* edge sends split requests with Poisson arrivals (``--quiet-rps``) the
whole run and declares a p99 TTFT objective (``--quiet-ttft-slo-ms``); after ``--alone-s`` seconds
the *flood* edge starts ``--flood-concurrency`` closed-loop clients (each sends its next request as
soon as one ends) for ``--burst-s`` seconds. The cloud runs its per-link shares and the p99 SLO
controller (``cloud.links.table``) and writes the controller's trace (``--slo-trace-file``). With
``--cloud HOST:PORT`` the edges use a running cloud instead (its own configuration; with
``--cloud-trace-file`` its controller trace of the run is kept); ``make bench`` starts its own.

With ``--compare`` the same run is repeated with the controller frozen (every weight stays 1; the
shares and the admission queue still apply), so the controller's own effect shows.

Writes into ``--out``: ``burst.md`` (quiet p50/p99 TTFT alone and under the flood, against the SLO;
flood requests served and refused), ``burst.json`` (every request), ``trace-*.jsonl`` (the
controller's trace) and ``burst_trace.png`` (per link: share and p99 TTFT over time; the quiet
edge's TTFTs).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from tandem.benchmarks.workload import BenchPrompt, make_prompts
from tandem.daemons import Daemons, cloud_command, edge_command, work_dir

app = typer.Typer(add_completion=False, help=__doc__)


@dataclass
class Sample:
    edge: str  # "quiet" | "flood"
    controller: str  # "on" | "off"
    start_s: float  # since the run started
    ttft_ms: float
    outcome: str  # "ok" or the error class


def p(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


async def one(client, prompt: BenchPrompt, max_new_tokens: int) -> tuple[float, str]:
    """One split turn: (TTFT ms, outcome)."""
    from tandem import TandemClientError

    t0 = time.perf_counter()
    ttft = float("nan")
    try:
        s = client.chat(prompt.as_messages(), max_new_tokens=max_new_tokens, mode="split", ignore_eos=True)
        async for _ in s:
            if ttft != ttft:
                ttft = (time.perf_counter() - t0) * 1e3
        return ttft, "ok"
    except TandemClientError as e:
        return ttft, type(e).__name__


async def drive(
    quiet_port: int,
    flood_port: int,
    prompts: list[BenchPrompt],
    controller: str,
    quiet_rps: float,
    alone_s: float,
    burst_s: float,
    flood_concurrency: int,
    max_new_tokens: int,
    seed: int,
) -> list[Sample]:
    from tandem import AsyncClient

    rng = random.Random(seed)
    samples: list[Sample] = []
    t_run = time.perf_counter()
    end = t_run + alone_s + burst_s
    async with AsyncClient(f"127.0.0.1:{quiet_port}") as quiet, AsyncClient(f"127.0.0.1:{flood_port}") as flood:
        for client in (quiet, flood, quiet, flood):  # warm-up, not recorded: vLLM's first requests are slow
            await one(client, prompts[0], 2)
        t_run = time.perf_counter()
        end = t_run + alone_s + burst_s

        async def quiet_one(i: int) -> None:
            t = time.perf_counter() - t_run
            ttft, outcome = await one(quiet, prompts[i % len(prompts)], max_new_tokens)
            samples.append(Sample("quiet", controller, t, ttft, outcome))

        async def quiet_loop() -> None:
            tasks, i = [], 0
            while time.perf_counter() < end:
                tasks.append(asyncio.create_task(quiet_one(i)))
                i += 1
                await asyncio.sleep(rng.expovariate(quiet_rps))
            await asyncio.gather(*tasks)

        async def flood_client(j: int) -> None:
            await asyncio.sleep(alone_s)
            i = j
            while time.perf_counter() < end:
                t = time.perf_counter() - t_run
                ttft, outcome = await one(flood, prompts[i % len(prompts)], max_new_tokens)
                samples.append(Sample("flood", controller, t, ttft, outcome))
                if outcome != "ok":
                    await asyncio.sleep(0.2)  # a refused client backs off a little, as a real one would
                i += flood_concurrency

        await asyncio.gather(quiet_loop(), *(flood_client(j) for j in range(flood_concurrency)))
    return samples


def start_cloud(ds: Daemons, controller: str, args: dict, split: Path, workdir: Path, trace: Path) -> str:
    """A ``tandem-cloud`` of this benchmark's configuration (``--max-num-seqs``, the controller stepping
    every second or, ``off``, never); its ``host:port``."""
    interval = "1" if controller == "on" else "1000000"  # off: the controller never steps
    cloud_extra = [
        *("--max-num-seqs", str(args["max_num_seqs"]), "--slo-interval-s", interval, "--slo-window-s", "10"),
        *("--slo-trace-file", str(trace), "--max-queue-wait-s", "5"),
    ]
    cloud = ds.spawn(
        "tandem-cloud",
        cloud_command(split, workdir / f"kv-{controller}", extra=cloud_extra),
        workdir / f"cloud-{controller}.log",
        workdir / f"cloud-{controller}.port",
    )
    return f"127.0.0.1:{cloud.wait_ready(900)}"


def start_edges(ds: Daemons, controller: str, args: dict, split: Path, workdir: Path, target: str) -> dict[str, int]:
    """The quiet and the flood ``tandem-edge`` in front of ``target``, each with its TTFT objective;
    their gRPC ports by name."""
    ports = {}
    for name, slo in (("quiet", args["quiet_ttft_slo_ms"]), ("flood", args["flood_ttft_slo_ms"])):
        extra = ["--edge-id", name, "--ttft-slo-ms", str(slo), "--no-local", "--poll-s", "1"]
        d = ds.spawn(
            f"tandem-edge {name}",
            edge_command(split, target, extra=extra),
            workdir / f"edge-{name}-{controller}.log",
            workdir / f"edge-{name}-{controller}.port",
        )
        ports[name] = d.wait_ready(300)
    return ports


def copy_trace(source: Path, offset_bytes: int, trace: Path) -> None:
    """The quiet and flood edges' lines of a running cloud's controller trace (``--slo-trace-file``)
    written past ``offset_bytes``, into ``trace``."""
    if not source.is_file():
        return
    with source.open("rb") as f:
        f.seek(offset_bytes)
        lines = f.read().decode().splitlines()
    ours = [x for x in lines if x.strip() and json.loads(x).get("edge_id") in ("quiet", "flood")]
    trace.write_text("".join(x + "\n" for x in ours))


def run_once(
    controller: str, args: dict, prompts: list[BenchPrompt], workdir: Path, model_dir: Path, out: Path
) -> list[Sample]:
    """One run: the cloud (this benchmark's, or the running one of ``--cloud``), both edges, the load."""
    split = model_dir / f"split-k{args['split_layer']}"
    trace = out / f"trace-{controller}.jsonl"
    trace.unlink(missing_ok=True)
    source = Path(args["cloud_trace_file"]) if args["cloud_trace_file"] else None
    offset_bytes = source.stat().st_size if source is not None and source.is_file() else 0
    with Daemons(grace_s=10) as ds:
        target = args["cloud"] or start_cloud(ds, controller, args, split, workdir, trace)
        ports = start_edges(ds, controller, args, split, workdir, target)
        samples = asyncio.run(
            drive(
                ports["quiet"],
                ports["flood"],
                prompts,
                controller,
                args["quiet_rps"],
                args["alone_s"],
                args["burst_s"],
                args["flood_concurrency"],
                args["max_new_tokens"],
                args["seed"],
            )
        )
    if source is not None:
        copy_trace(source, offset_bytes, trace)
    return samples


def summary(samples: list[Sample], args: dict) -> str:
    slo = args["quiet_ttft_slo_ms"]
    out = [
        f"quiet edge: p99 TTFT objective {slo:.0f} ms; flood: {args['flood_concurrency']} closed-loop clients "
        f"from t={args['alone_s']:.0f} s for {args['burst_s']:.0f} s; max_num_seqs {args['max_num_seqs']}\n",
        "| controller | phase | quiet requests | quiet TTFT p50 ms | quiet TTFT p99 ms | within SLO | "
        "flood served | flood refused | flood TTFT p50 ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for ctl in dict.fromkeys(s.controller for s in samples):
        for phase, lo, hi in (("alone", 0.0, args["alone_s"]), ("burst", args["alone_s"], float("inf"))):
            q = [s for s in samples if s.controller == ctl and s.edge == "quiet" and lo <= s.start_s < hi]
            f = [s for s in samples if s.controller == ctl and s.edge == "flood" and lo <= s.start_s < hi]
            qt = [s.ttft_ms for s in q if s.outcome == "ok"]
            ft = [s.ttft_ms for s in f if s.outcome == "ok"]
            refused = sum(s.outcome != "ok" for s in f)
            ok = "yes" if qt and p(qt, 99) <= slo and all(s.outcome == "ok" for s in q) else "**no**"
            out.append(
                f"| {ctl} | {phase} | {len(q)} | {p(qt, 50):.0f} | {p(qt, 99):.0f} | {ok} | {len(ft)} | {refused} | "
                f"{p(ft, 50):.0f} |"
            )
    return "\n".join(out) + "\n"


def plot(samples: list[Sample], out: Path, args: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctls = list(dict.fromkeys(s.controller for s in samples))
    fig, axes = plt.subplots(2, len(ctls), figsize=(6.5 * len(ctls), 7), squeeze=False, sharex=True)
    for col, ctl in enumerate(ctls):
        top, bottom = axes[0][col], axes[1][col]
        rows = (
            [json.loads(x) for x in (out / f"trace-{ctl}.jsonl").read_text().splitlines()]
            if (out / f"trace-{ctl}.jsonl").is_file()
            else []
        )
        t0 = min((r["time"] for r in rows), default=0.0)
        for edge in ("quiet", "flood"):
            pts = [r for r in rows if r["edge_id"] == edge]
            if pts:
                ts = [r["time"] - t0 for r in pts]
                top.step(ts, [r["max_concurrent_requests"] for r in pts], where="post", label=f"{edge}: share")
                bottom.plot(ts, [r["p99_ttft_ms"] or np.nan for r in pts], label=f"{edge}: p99 TTFT (cloud)")
        q = [s for s in samples if s.controller == ctl and s.edge == "quiet" and s.outcome == "ok"]
        bottom.scatter([s.start_s for s in q], [s.ttft_ms for s in q], s=8, color="black", label="quiet: TTFT")
        bottom.axhline(args["quiet_ttft_slo_ms"], color="red", linestyle="--", label="quiet SLO")
        for ax in (top, bottom):
            ax.axvline(args["alone_s"], color="gray", linestyle=":")
            ax.grid(alpha=0.3)
        top.set_title(f"controller {ctl}")
        top.set_ylabel("max_concurrent_requests")
        bottom.set_ylabel("TTFT (ms)")
        bottom.set_yscale("log")
        bottom.set_xlabel("time (s); dotted: the flood starts")
        top.legend(fontsize=8)
        bottom.legend(fontsize=8)
    fig.suptitle("Two edges, one flooding: per-link share and p99 TTFT (SLO controller trace)")
    fig.tight_layout()
    fig.savefig(out / "burst_trace.png", dpi=110)
    plt.close(fig)


@app.command()
def main(
    model_dir: Annotated[Path, typer.Option(help="prepared model directory")] = Path("models/smollm2-135m"),
    split_layer: int = 4,
    max_num_seqs: int = 4,
    quiet_rps: Annotated[float, typer.Option(help="quiet edge: Poisson arrival rate, requests/s")] = 0.5,
    quiet_ttft_slo_ms: Annotated[float, typer.Option(help="quiet edge: p99 TTFT objective, ms")] = 2000.0,
    flood_ttft_slo_ms: Annotated[float, typer.Option(help="flood edge: p99 TTFT objective, ms")] = 2000.0,
    flood_concurrency: Annotated[int, typer.Option(help="flood edge: closed-loop clients")] = 12,
    alone_s: Annotated[float, typer.Option(help="seconds of the quiet edge alone")] = 15.0,
    burst_s: Annotated[float, typer.Option(help="seconds of the flood")] = 45.0,
    prompt_tokens: int = 64,
    max_new_tokens: int = 16,
    compare: Annotated[bool, typer.Option(help="repeat with the controller frozen")] = True,
    cloud: Annotated[
        str,
        typer.Option(help="host:port of a running tandem-cloud to use instead of starting one (no --compare)"),
    ] = "",
    cloud_trace_file: Annotated[
        str, typer.Option(help="with --cloud: that cloud's --slo-trace-file, whose lines of this run are kept")
    ] = "",
    seed: int = 0,
    out: Annotated[Path, typer.Option(help="output directory")] = Path("bench-results/burst"),
) -> None:
    """Run the burst (and its frozen-controller twin) and write the table, trace and plot."""
    args = {k: str(v) if isinstance(v, Path) else v for k, v in locals().items()}
    if cloud and compare:
        raise typer.BadParameter("--compare starts its own cloud twice (controller on, then off): drop --cloud")
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir / "tokenizer")
    prompts = make_prompts(tokenizer, prompt_tokens, 32, seed)
    workdir = work_dir("tandem-burst-")  # its block stores are removed at exit, its logs kept
    print(f"tandem-bench burst: logs in {workdir}", file=sys.stderr)
    samples: list[Sample] = []
    for controller in ("on", "off") if compare else ("on",):
        print(f"run with the controller {controller} ({alone_s + burst_s:.0f} s) ...", file=sys.stderr)
        samples += run_once(controller, args, prompts, workdir, model_dir, out)
    (out / "burst.json").write_text(
        json.dumps({"args": args, "samples": [asdict(s) for s in samples]}, indent=1, default=str)
    )
    md = summary(samples, args)
    (out / "burst.md").write_text(md)
    plot(samples, out, args)
    print(md)
    print(f"results in {out}: burst.md, burst.json, trace-*.jsonl, burst_trace.png", file=sys.stderr)


if __name__ == "__main__":
    app()
