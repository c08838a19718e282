"""``tandem-bench capacity``: goodput under an offered-load sweep, cloud-only against each split and auto.

A split at layer ``k`` takes ``k/L`` of every prompt's prefill off the cloud onto the edge's own
processor, so a cloud that is the bottleneck should serve more requests within its latency
objective. The setup (cloud and edge pinned apart with ``taskset``, Poisson arrivals, open loop,
the modes swept), the cloud work per request (``benchmarks.cloudwork``) and the results:
docs/benchmarks.md, "Capacity".

Definitions. A request *meets the SLO* when it completes with TTFT at most ``--ttft-slo-ms``;
refused (``RESOURCE_EXHAUSTED``), failed or timed-out requests do not. *Goodput* at an offered rate
is SLO attainment times that rate (every mode at a rate gets the same seeded schedule). *Served
req/s* is the requests served over the first arrival to the last completion (vLLM's benchmark's
request throughput), so it counts how long the last requests drain. A mode's *capacity* is the
highest offered rate at which at least ``--attainment`` of requests met the SLO: the goodput of
DistServe (Zhong et al., "DistServe: Disaggregating Prefill and Decoding for Goodput-optimized
Large Language Model Serving", OSDI 2024, section 2). A mode stops its sweep after the first rate
whose attainment is below half the target. With an auto row, a third table sets auto's goodput at
each rate beside the best fixed mode's at that rate.

Writes into ``--out``: ``capacity.md`` (the table and the verdict per mode), ``capacity.json``
(every cell and every request), ``capacity.png`` (p99 TTFT and goodput against offered rate, with
the SLO). A split layer must be exported first (``make bench-capacity`` exports ``k = 15``).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from tandem.benchmarks import links as linkmod
from tandem.benchmarks.bench import ModeSpec
from tandem.benchmarks.cloudwork import CloudMeter, CloudWork
from tandem.benchmarks.records import is_auto
from tandem.benchmarks.stack import Stack, local_rows, machine_meta
from tandem.benchmarks.workload import BenchPrompt, make_prompts
from tandem.daemons import work_dir

app = typer.Typer(add_completion=False, help=__doc__)
MAX_ERROR_CHARS = 300  # of a failed request's message kept in its sample


@dataclass
class Sample:
    mode: str  # cloud-only | split-k{k} | auto
    offered_rps: float
    arrival_s: float  # since the rate's first arrival
    ttft_ms: float  # NaN if no token came
    e2e_ms: float
    outcome: str  # "ok" or the error class
    served_mode: str = ""
    served_split_layer: int = 0
    output_tokens: int = 0  # tokens streamed (0 in runs recorded before it was)
    predicted_ttft_ms: float = 0.0  # the edge's cost-model prediction for the mode served (0 = none made)
    timings_ms: dict[str, float] = field(default_factory=dict)  # ChatDone's stage timings (ms)
    error: str = ""  # a failed request's server message (``TandemClientError.details``, its first ``MAX_ERROR_CHARS``)

    def mean_itl_ms(self, max_new_tokens: int) -> float:
        """The request's mean inter-token latency (TPOT): ``(e2e - TTFT) / (tokens - 1)``, with
        ``max_new_tokens`` where the tokens were not recorded (every request runs to it,
        ``ignore_eos``); 0 for one token; inf for a request that failed."""
        if self.outcome != "ok":
            return float("inf")
        n = self.output_tokens or max_new_tokens
        return (self.e2e_ms - self.ttft_ms) / (n - 1) if n > 1 else 0.0


def poisson_arrivals_s(rate_rps: float, n: int, seed: int) -> list[float]:
    """``n`` arrival times (s, from 0) of a Poisson process of ``rate_rps``: cumulative sums of
    exponential inter-arrival times with mean ``1 / rate_rps``, the first at 0.

    Raises:
        ValueError: ``rate_rps`` is not positive.
    """
    if rate_rps <= 0:
        raise ValueError(f"rate must be positive, got {rate_rps}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate_rps)
    return out


def percentile(xs: list[float], q: float) -> float:
    """The ``q``-th percentile of ``xs`` by the nearest-rank definition (numpy's ``inverted_cdf``:
    always one of the values, so a failed request's ``inf`` stays ``inf``); NaN for no values."""
    return float(np.percentile(xs, q, method="inverted_cdf")) if xs else float("nan")


@dataclass(frozen=True)
class RateResult:
    mode: str
    offered_rps: float
    sent: int
    served: int
    met_slo: int
    p50_ttft_ms: float
    p99_ttft_ms: float
    goodput_rps: float  # requests within the SLO(s) per second of offered load (``rate_result``)
    span_s: float  # first arrival to last completion
    # the cloud's work per served request (``benchmarks.cloudwork``): NaN / None where not measured
    gateway_cpu_ms: float = float("nan")
    engines_cpu_ms: float = float("nan")
    gpu_ms: float | None = None
    p99_itl_ms: float = float("nan")  # p99 over the requests of their mean ITL (``Sample.mean_itl_ms``)

    @property
    def attainment(self) -> float:
        return self.met_slo / self.sent if self.sent else 0.0

    @property
    def served_rps(self) -> float:
        """Requests served per second over ``span_s`` (vLLM's benchmark's request throughput)."""
        return self.served / self.span_s if self.span_s > 0 else 0.0


def rate_result(
    samples: list[Sample],
    slo_ms: float,
    work: CloudWork | None = None,
    itl_slo_ms: float = 0.0,
    max_new_tokens: int = 0,
) -> RateResult:
    """Summarise one (mode, rate). A request meets the SLO when it completed with TTFT <= ``slo_ms``
    and, with ``itl_slo_ms`` > 0, a mean ITL (``Sample.mean_itl_ms``; ``max_new_tokens`` where its
    tokens were not recorded) <= ``itl_slo_ms`` (DistServe's TTFT and TPOT objectives). Goodput =
    SLO attainment x the offered rate: requests within the SLO per second of offered load,
    independent of how long the last ones drain. A request that failed counts with an infinite TTFT
    and ITL in the percentiles. ``work``: the cloud's work over the cell (``CloudMeter`` reads after
    minus before), reported per served request.

    Raises:
        ValueError: ``samples`` is empty or mixes modes or rates.
    """
    if not samples or len({(s.mode, s.offered_rps) for s in samples}) != 1:
        raise ValueError("rate_result takes the samples of one (mode, rate)")
    ok = [s for s in samples if s.outcome == "ok"]
    itls = [s.mean_itl_ms(max_new_tokens) for s in samples]
    met = [
        s
        for s, itl in zip(samples, itls, strict=True)
        if s.outcome == "ok" and s.ttft_ms <= slo_ms and (itl_slo_ms <= 0 or itl <= itl_slo_ms)
    ]
    ttfts = [s.ttft_ms if s.outcome == "ok" else float("inf") for s in samples]
    span_s = max(s.arrival_s + s.e2e_ms / 1e3 for s in samples) - min(s.arrival_s for s in samples)
    per = work.per_request(len(ok)) if work is not None else CloudWork(float("nan"), float("nan"), None)
    return RateResult(
        samples[0].mode,
        samples[0].offered_rps,
        len(samples),
        len(ok),
        len(met),
        percentile(ttfts, 50),
        percentile(ttfts, 99),
        len(met) / len(samples) * samples[0].offered_rps,
        span_s,
        per.gateway_cpu_ms,
        per.engines_cpu_ms,
        per.gpu_ms,
        percentile(itls, 99),
    )


def capacity_rps(results: list[RateResult], attainment: float) -> float:
    """The highest offered rate of one mode at which at least ``attainment`` of requests met the
    SLO, and at every lower rate too (DistServe's goodput; a lucky pass above a failed rate is
    noise, not capacity); 0 if the lowest rate failed."""
    cap = 0.0
    for r in sorted(results, key=lambda r: r.offered_rps):
        if r.attainment < attainment:
            break
        cap = r.offered_rps
    return cap


@dataclass(frozen=True)
class EdgeTarget:
    """Where the edge daemon listens, and how to reach it (``tandem.AsyncClient``'s arguments)."""

    target: str  # host:port
    ca_file: str | None = None
    api_key: str | None = None

    def client(self):
        from tandem import AsyncClient

        return AsyncClient(self.target, ca_file=self.ca_file, api_key=self.api_key)


async def run_rate(
    edge: EdgeTarget,
    spec: ModeSpec,
    prompts: list[BenchPrompt],
    arrivals_s: list[float],
    rate: float,
    max_new_tokens: int,
    timeout_s: float,
) -> list[Sample]:
    """Send ``prompts[i]`` at ``arrivals_s[i]`` (open loop) through the edge in ``spec``'s mode."""
    from tandem import TandemClientError

    samples: list[Sample] = []
    async with edge.client() as client:
        t_start = time.perf_counter()

        async def one(p: BenchPrompt, at_s: float) -> None:
            await asyncio.sleep(max(0.0, t_start + at_s - time.perf_counter()))
            t0 = time.perf_counter()
            ttft, outcome, mode, k, tokens = float("nan"), "ok", "", 0, 0
            predicted, timings, error = 0.0, {}, ""
            try:
                s = client.chat(
                    p.as_messages(),
                    max_new_tokens=max_new_tokens,
                    mode=spec.mode,
                    split_layer=spec.split_layer,
                    ignore_eos=True,
                    timeout_s=timeout_s,
                    whole_reply=spec.whole_reply,
                )
                async for d in s:
                    if ttft != ttft:
                        ttft = (time.perf_counter() - t0) * 1e3
                    tokens += len(d.token_ids)
                mode, k = s.result.mode, s.result.split_layer
                predicted, timings = s.result.predicted_ttft_ms, dict(s.result.timings_ms)
            except TandemClientError as e:
                outcome, error = type(e).__name__, e.details[:MAX_ERROR_CHARS]
            e2e_ms = (time.perf_counter() - t0) * 1e3
            samples.append(
                Sample(
                    spec.label, rate, t0 - t_start, ttft, e2e_ms, outcome, mode, k, tokens, predicted, timings, error
                )
            )

        await asyncio.gather(*(one(p, a) for p, a in zip(prompts, arrivals_s, strict=True)))
    return samples


def summary_md(results: list[RateResult], args: dict, samples: list[Sample] | None = None) -> str:
    """The table per (mode, rate), the capacity per mode against cloud-only, and with ``samples``
    auto's prediction error per rate (``prediction_lines``)."""
    slo, att, itl_slo = args["ttft_slo_ms"], args["attainment"], args.get("itl_slo_ms", 0.0)
    objective = f"TTFT <= {slo:.0f} ms" + (f" and mean ITL <= {itl_slo:g} ms" if itl_slo > 0 else "")
    lines = [
        f"Offered-load sweep: {args['requests']} requests per rate with Poisson arrivals, prompt "
        f"{args['prompt_tokens']} tokens, {args['max_new_tokens']} output tokens, link {args['link']}; cloud on "
        f"CPUs {args['cloud_cpus']!r}, edge on CPUs {args['edge_cpus']!r} (taskset). SLO: {objective}; "
        f"capacity = the highest offered rate with >= {att:.0%} of requests within it (DistServe's goodput). "
        "Goodput: requests within the SLO per second of offered load (attainment x the offered rate); "
        "served req/s: requests served over the first arrival to the last completion.",
        "",
        "| mode | offered req/s | sent | served | p50 TTFT ms | p99 TTFT ms | p99 mean ITL ms | within SLO "
        "| goodput req/s | served req/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.mode} | {r.offered_rps:g} | {r.sent} | {r.served} | {r.p50_ttft_ms:.0f} | {r.p99_ttft_ms:.0f} | "
            f"{r.p99_itl_ms:.1f} | {r.attainment:.0%} | {r.goodput_rps:.2f} | {r.served_rps:.2f} |"
        )
    modes = list(dict.fromkeys(r.mode for r in results))
    caps = {m: capacity_rps([r for r in results if r.mode == m], att) for m in modes}
    best_goodput = {m: max(r.goodput_rps for r in results if r.mode == m) for m in modes}
    base = caps.get("cloud-only", 0.0)
    lines += [
        "",
        "| mode | capacity req/s (SLO met) | vs cloud-only | best goodput req/s | pays? |",
        "|---|---|---|---|---|",
    ]
    for m in modes:
        vs_base = f"{caps[m] / base:.2f}x" if base else "-"  # cloud-only met the SLO at no rate run
        pays = "-" if m == "cloud-only" else "yes" if caps[m] > base else "no" if caps[m] < base else "equal"
        lines.append(f"| {m} | {caps[m]:g} | {vs_base} | {best_goodput[m]:.2f} | {pays} |")
    lines += work_lines(results)
    versus = auto_vs_best(results)
    if versus:
        lines += [
            "",
            "Auto against the best fixed mode measured at each offered rate (goodput within the SLO):",
            "",
            "| offered req/s | best fixed mode | its goodput req/s | auto goodput req/s | auto / best |",
            "|---|---|---|---|---|",
        ]
        for rate, best, best_rps, auto_rps in versus:
            ratio = auto_rps / best_rps if best_rps else float("nan")
            flag = " **under**" if auto_rps < best_rps else ""
            lines.append(f"| {rate:g} | {best} | {best_rps:.2f} | {auto_rps:.2f} | {ratio:.2f}x{flag} |")
        under = sum(a < b for _, _, b, a in versus)
        lines += ["", f"auto at least the best fixed mode's goodput at {len(versus) - under} of {len(versus)} rates"]
    lines += prediction_lines(samples or [])
    lines += failure_lines(samples or [])
    return "\n".join(lines) + "\n"


def failure_lines(samples: list[Sample]) -> list[str]:
    """The failed requests per mode, offered rate, error class and server message, with their
    count; [] where every request was served. Samples recorded without a message show "-"."""
    counts: dict[tuple[str, float, str, str], int] = {}
    for s in samples:
        if s.outcome != "ok":
            key = (s.mode, s.offered_rps, s.outcome, s.error.replace("|", "/").replace("\n", " ") or "-")
            counts[key] = counts.get(key, 0) + 1
    if not counts:
        return []
    lines = ["", "Failed requests:", "", "| mode | offered req/s | error | requests | message |"]
    lines.append("|---|---|---|---|---|")
    for (mode, rate, outcome, message), n in counts.items():
        lines.append(f"| {mode} | {rate:g} | {outcome} | {n} | {message} |")
    return lines


def prediction_lines(samples: list[Sample]) -> list[str]:
    """Auto's TTFT predictions against the measured TTFT, per offered rate and mode served: the
    requests, their median measured and predicted TTFT (ms) and the median of measured / predicted
    (the cost model's error under that load: 1.0 is exact, 2.0 a TTFT twice the prediction);
    [] where no auto request carried a prediction."""
    cells: dict[tuple[float, str], list[Sample]] = {}
    for s in samples:
        if s.mode == "auto" and s.outcome == "ok" and s.predicted_ttft_ms > 0:
            served = f"split-k{s.served_split_layer}" if s.served_mode == "split" else s.served_mode
            cells.setdefault((s.offered_rps, served), []).append(s)
    if not cells:
        return []
    lines = [
        "",
        "Auto's predictions under load: per offered rate and mode served, the median measured and "
        "predicted TTFT and the median of their ratio (measured / predicted).",
        "",
        "| offered req/s | served mode | requests | median TTFT ms | median predicted ms | measured / predicted |",
        "|---|---|---|---|---|---|",
    ]
    for (rate, served), got in sorted(cells.items()):
        ratio = float(np.median([s.ttft_ms / s.predicted_ttft_ms for s in got]))
        measured = float(np.median([s.ttft_ms for s in got]))
        predicted = float(np.median([s.predicted_ttft_ms for s in got]))
        lines.append(f"| {rate:g} | {served} | {len(got)} | {measured:.0f} | {predicted:.0f} | {ratio:.2f} |")
    return lines


def work_lines(results: list[RateResult]) -> list[str]:
    """The cloud's work per served request per (mode, rate), and its difference from cloud-only's
    at the same rate (what the mode adds to, or takes off, the cloud); [] where none was measured."""
    if all(r.gateway_cpu_ms != r.gateway_cpu_ms for r in results):  # NaN: a running edge, no meter
        return []
    gpu = any(r.gpu_ms is not None for r in results)

    def ms(x: float | None, signed: bool = False) -> str:
        return "-" if x is None or x != x else f"{x:+.1f}" if signed else f"{x:.1f}"

    def cpu(r: RateResult) -> float:
        return r.gateway_cpu_ms + r.engines_cpu_ms

    base = {r.offered_rps: r for r in results if r.mode == "cloud-only"}
    heads = ["mode", "offered req/s", "gateway CPU", "engines CPU"] + ["GPU"] * gpu + ["CPU vs cloud-only"]
    heads += ["GPU vs cloud-only"] * gpu
    lines = [
        "",
        "The cloud's work per served request, ms (`benchmarks/cloudwork.py`): CPU time of the "
        "`tandem-cloud` process (receive and verify, framing, block-store writes and reads) and of its "
        "vLLM engine processes"
        + (", and the GPU busy time of the cloud's processes (NVML per-process SM samples)" if gpu else "")
        + "; beside it, the difference from cloud-only's at the same offered rate.",
        "",
        "| " + " | ".join(heads) + " |",
        "|" + "---|" * len(heads),
    ]
    for r in results:
        b = None if r.mode == "cloud-only" else base.get(r.offered_rps)
        d_gpu = None if b is None or r.gpu_ms is None or b.gpu_ms is None else r.gpu_ms - b.gpu_ms
        cells = [r.mode, f"{r.offered_rps:g}", ms(r.gateway_cpu_ms), ms(r.engines_cpu_ms)] + [ms(r.gpu_ms)] * gpu
        cells += [ms(None if b is None else cpu(r) - cpu(b), signed=True)] + [ms(d_gpu, signed=True)] * gpu
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def auto_vs_best(results: list[RateResult]) -> list[tuple[float, str, float, float]]:
    """Per offered rate at which auto ran: ``(rate, best fixed mode, its goodput, auto's goodput)``,
    the best among the fixed modes measured at that rate (a mode that stopped its sweep below it,
    saturated, is not counted there). [] without an auto row."""
    auto = {r.offered_rps: r.goodput_rps for r in results if r.mode == "auto"}
    out = []
    for rate, auto_rps in auto.items():
        fixed = [r for r in results if not is_auto(r.mode) and r.offered_rps == rate]
        if fixed:
            best = max(fixed, key=lambda r: r.goodput_rps)
            out.append((rate, best.mode, best.goodput_rps, auto_rps))
    return out


def plot(results: list[RateResult], out: Path, slo_ms: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    for m in dict.fromkeys(r.mode for r in results):
        rs = [r for r in results if r.mode == m]
        x = [r.offered_rps for r in rs]
        top.plot(x, [min(r.p99_ttft_ms, 1e6) for r in rs], marker="o", label=m)
        bottom.plot(x, [r.goodput_rps for r in rs], marker="o", label=m)
    top.axhline(slo_ms, color="black", linestyle="--", label="TTFT SLO")
    top.set_yscale("log")
    top.set_ylabel("p99 TTFT, ms")
    top.legend(fontsize=8)
    bottom.set_ylabel("goodput, req/s within the SLO")
    bottom.set_xlabel("offered load, req/s (Poisson)")
    top.set_title("tandem capacity: cloud and edge on separate cores")
    fig.tight_layout()
    fig.savefig(out / "capacity.png", dpi=120)
    plt.close(fig)


@app.command()
def main(
    model_dir: Annotated[Path, typer.Option(help="prepared model directory")] = Path("models/smollm2-135m"),
    split_layers: Annotated[str, typer.Option(help="exported split layers to run")] = "4,8,15",
    rates: Annotated[str, typer.Option(help="offered loads, requests/s, ascending")] = "0.5,1,1.5,2,3",
    requests: Annotated[int, typer.Option(help="requests per (mode, rate)")] = 30,
    prompt_tokens: int = 256,
    max_new_tokens: int = 8,
    ttft_slo_ms: Annotated[float, typer.Option(help="TTFT objective, ms")] = 1500.0,
    itl_slo_ms: Annotated[
        float,
        typer.Option(help="mean inter-token latency objective per request (TPOT), ms; 0 = TTFT only"),
    ] = 0.0,
    attainment: Annotated[float, typer.Option(help="share of requests within the SLO for a rate to count")] = 0.99,
    link: Annotated[str, typer.Option(help=f"link profile: {', '.join(linkmod.PROFILES)}")] = "lan",
    edge_target: Annotated[
        str,
        typer.Option(
            help="measure a running edge at host:port instead of starting a cloud and an edge here "
            "(then --link, --cloud-cpus and --edge-cpus do not apply: the deployment is what it is)"
        ),
    ] = "",
    ca_file: Annotated[str, typer.Option(help="with --edge-target: CA (PEM) of the edge's TLS certificate")] = "",
    api_key: Annotated[str, typer.Option(help="with --edge-target: the edge's API key")] = "",
    cloud_cpus: Annotated[str, typer.Option(help="taskset CPU list of the cloud; '' = unpinned")] = "1",
    edge_cpus: Annotated[str, typer.Option(help="taskset CPU list of the edge, proxy and driver; '' = unpinned")] = "0",
    max_num_seqs: int = 8,
    edge_only: Annotated[bool, typer.Option(help="also the edge-only row (local mode: the edge's whole model)")] = True,
    remote_prefill: Annotated[
        bool, typer.Option(help="also the remote-prefill row (the cloud prefills, the edge decodes)")
    ] = True,
    auto: Annotated[bool, typer.Option(help="also the auto row")] = True,
    timeout_s: Annotated[float, typer.Option(help="deadline of one request")] = 60.0,
    seed: int = 0,
    out: Annotated[Path, typer.Option(help="output directory")] = Path("bench-results/capacity"),
    render: Annotated[
        bool, typer.Option(help="only write the tables and plot again from OUT/capacity.json (its samples and meta)")
    ] = False,
) -> None:
    """Run the sweep and write the table, samples and plot."""
    args = {k: str(v) if isinstance(v, Path) else v for k, v in locals().items()}
    if render:
        rerender(out)
        return
    ks = [int(x) for x in split_layers.split(",") if x.strip()]
    dirs = [model_dir / f"split-k{k}" for k in ks]
    missing = [d for d in dirs if not (d / "manifest.json").is_file()]
    if missing and not edge_target:
        raise typer.BadParameter(
            f"{', '.join(map(str, missing))} not exported: "
            f"run tandem-model --out {model_dir} --split-layers {split_layers}"
        )
    offered = [float(x) for x in rates.split(",") if x.strip()]
    if not offered or any(r <= 0 for r in offered) or offered != sorted(offered):
        raise typer.BadParameter(f"--rates {rates!r}: positive and ascending")
    profile = linkmod.get(link)[0]
    from tqdm import tqdm  # after the arguments are checked: a bad one fails at once
    from transformers import AutoTokenizer

    if edge_target:
        link, cloud_cpus, edge_cpus = f"{link} (not applied: a running edge)", "n/a", "n/a"
        args.update(link=link, cloud_cpus=cloud_cpus, edge_cpus=edge_cpus)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir / "tokenizer")
    prompts = make_prompts(tokenizer, prompt_tokens, requests, seed)
    if not edge_target:
        edge_only, remote_prefill = local_rows(model_dir, edge_only, remote_prefill)
    specs = [ModeSpec("cloud-only", "direct")] + [ModeSpec(f"split-k{k}", "split", k) for k in ks]
    specs += [ModeSpec("edge-only", "local")] if edge_only else []
    specs += [ModeSpec("remote-prefill", "remote_prefill")] if remote_prefill else []
    specs += [ModeSpec("auto", "auto")] if auto else []
    workdir = work_dir("tandem-capacity-")  # its block stores are removed at exit, its logs kept
    print(f"tandem-bench capacity: logs in {workdir}", file=sys.stderr)
    stack = (
        None
        if edge_target
        else Stack(
            dirs,
            "proxy",
            workdir,
            max_num_seqs,
            cloud_cpus,
            edge_cpus,
            max_prompt_tokens=max(p.prompt_tokens for p in prompts),
        )
    )
    samples: list[Sample] = []
    results: list[RateResult] = []
    meter: CloudMeter | None = None
    try:
        if stack is not None:
            edge = EdgeTarget(f"127.0.0.1:{stack.start()}")
            stack.set_link(profile)
            if stack.cloud is not None:  # the tandem-cloud process this run started
                meter = CloudMeter(stack.cloud.proc.pid)
            if edge_cpus:  # this driver runs beside the edge, off the cloud's cores (pinned after the
                # daemons started: they would inherit it)
                os.sched_setaffinity(0, {int(c) for part in edge_cpus.split(",") for c in _cpu_range(part)})
        else:
            edge = EdgeTarget(edge_target, ca_file or None, api_key or None)
        warm = make_prompts(tokenizer, prompt_tokens, 2, seed + 99)
        for spec in specs:  # warm-up and calibration, not recorded: every mode twice, one at a time
            for p in warm:
                asyncio.run(run_rate(edge, spec, [p], [0.0], 1.0, 2, timeout_s))
        with tqdm(total=len(specs) * len(offered), desc="(mode, rate)", unit="cell") as bar:
            for spec in specs:
                for i, rate in enumerate(offered):
                    arrivals = poisson_arrivals_s(rate, requests, seed * 1000 + i)
                    before = meter.read() if meter is not None else None
                    got = asyncio.run(run_rate(edge, spec, prompts, arrivals, rate, max_new_tokens, timeout_s))
                    work = meter.read().minus(before) if meter is not None and before is not None else None
                    samples += got
                    r = rate_result(got, ttft_slo_ms, work, itl_slo_ms, max_new_tokens)
                    results.append(r)
                    bar.set_postfix_str(f"{spec.label} {rate:g} req/s: p99 {r.p99_ttft_ms:.0f} ms, {r.attainment:.0%}")
                    bar.update(1)
                    if r.attainment < attainment / 2:  # saturated: higher rates only queue longer
                        bar.update(len(offered) - i - 1)
                        break
    finally:
        if meter is not None:
            meter.close()
        if stack is not None:
            stack.stop()
    meta = machine_meta(args) | {"link": None if edge_target else profile.as_dict()}
    if meter is not None:
        meta["gpu_work"] = meter.gpu_report()
    write_results(out, meta, results, samples)


def write_results(out: Path, meta: dict, results: list[RateResult], samples: list[Sample]) -> None:
    """``capacity.json`` (meta, cells, samples), ``capacity.md`` and ``capacity.png`` under ``out``."""
    (out / "capacity.json").write_text(
        json.dumps(
            {"meta": meta, "cells": [asdict(r) for r in results], "samples": [asdict(s) for s in samples]},
            indent=1,
            default=str,
        )
    )
    md = summary_md(results, meta["args"], samples)
    (out / "capacity.md").write_text(md)
    plot(results, out, meta["args"]["ttft_slo_ms"])
    print(md)
    print(f"results in {out}: capacity.md, capacity.json, capacity.png", file=sys.stderr)


def rerender(out: Path) -> None:
    """Summarise ``out/capacity.json`` again (``--render``): every (mode, rate) cell from its samples,
    in the order they ran, with the cloud's work of the cell where the file has it.

    Raises:
        typer.BadParameter: ``out`` has no ``capacity.json``.
    """
    path = out / "capacity.json"
    if not path.is_file():
        raise typer.BadParameter(f"{path} not found: nothing to render")
    data = json.loads(path.read_text())
    samples = [Sample(**s) for s in data["samples"]]
    work = {(c["mode"], c["offered_rps"]): c for c in data.get("cells", [])}
    args = data["meta"]["args"]
    results = []
    for mode, rate in dict.fromkeys((s.mode, s.offered_rps) for s in samples):
        c = work.get((mode, rate))
        w = None
        if c is not None:  # per served request in the file: back to the cell's totals
            n = max(c["served"], 1)
            gpu = None if c.get("gpu_ms") is None else c["gpu_ms"] * n
            w = CloudWork(c["gateway_cpu_ms"] * n, c["engines_cpu_ms"] * n, gpu)
        cell = [s for s in samples if (s.mode, s.offered_rps) == (mode, rate)]
        results.append(rate_result(cell, args["ttft_slo_ms"], w, args.get("itl_slo_ms", 0.0), args["max_new_tokens"]))
    write_results(out, data["meta"], results, samples)


def _cpu_range(part: str) -> range:
    """``"3"`` or ``"2-5"`` (a ``taskset -c`` list item) -> the CPUs it names."""
    lo, _, hi = part.strip().partition("-")
    return range(int(lo), int(hi or lo) + 1)


if __name__ == "__main__":
    app()
