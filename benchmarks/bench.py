"""``tandem-bench modes``: TTFT, inter-token latency, throughput and bytes on the wire of

* tandem split at each exported split layer ``k`` (edge head + cloud tail/decode),
* cloud-only: plain vLLM on the full checkpoint behind the same link (direct mode, token ids up),
* edge-only: the whole model in ONNX Runtime on the edge (the edge daemon's local mode), no network,
* remote-prefill: token ids up, the cloud prefills and streams the first tokens while the prompt's
  KV comes down, the edge decodes the rest (its cloud engine time is the ``cloud eng ms`` column),
* auto: the edge's per-request choice among those (``edge.routing.costmodel``, ``edge.routing.occupancy``)
  for each objective of ``--auto-objectives``: ``auto`` the lowest predicted TTFT (a streamed reply),
  ``auto-whole`` the lowest predicted end-to-end time (a client that uses the reply only whole),

over emulated links, through ONE cloud (a tail engine per split layer) and ONE edge (every head
and the whole model), all in one run so ratios hold on a noisy machine. Every mode is asked of
the same edge daemon, so auto's cost model sees the link and every mode's stage timings, as a
live edge that serves mixed traffic does; a calibration pass (each fixed mode once per prompt
length, not recorded) precedes the matrix.

Order (``--order``): ``interleaved`` (default), per (link, prompt length) a warm-up round, then
round ``i`` runs every mode once on prompt ``i`` in the order of a row of a Williams square
(``round_order``); ``blocks``, one mode at a time (needed for ``--concurrency`` > 1), each (mode,
length) block after ``--warmup`` unrecorded requests. Why interleaved, and the results:
docs/benchmarks.md, "Modes over links". Writes ``records.jsonl`` (one line per request),
``summary.csv``, ``summary.md``, ``auto.md`` (each auto row against the best fixed mode per cell by its
objective: ``auto`` by TTFT, ``auto-whole`` by end-to-end time),
``meta.json`` and PNG plots into ``--out``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any

import typer

from tandem.benchmarks import links as linkmod
from tandem.benchmarks.records import AUTO_ROWS, RequestRecord, is_auto
from tandem.benchmarks.stack import Stack, local_rows, machine_meta, parse_host_port
from tandem.benchmarks.workload import BenchPrompt, make_prompts
from tandem.daemons import work_dir

app = typer.Typer(add_completion=False, help=__doc__)


@dataclass(frozen=True)
class ModeSpec:
    """One row of the matrix: the label it is reported under and what the SDK asks the edge
    (``whole_reply``: the client uses the reply only whole, so auto minimises end-to-end time)."""

    label: str  # split-k{k} | cloud-only | edge-only | remote-prefill | auto | auto-whole
    mode: str
    split_layer: int = 0
    whole_reply: bool = False


def parse_auto_objectives(option: str) -> list[str]:
    """``--auto-objectives``: the comma-separated objectives of ``records.AUTO_ROWS`` (``ttft``,
    ``whole``), in their order there.

    Raises: typer.BadParameter for an unknown, repeated or missing objective."""
    names = [x.strip() for x in option.split(",") if x.strip()]
    known = [a.objective for a in AUTO_ROWS]
    if not names or len(set(names)) != len(names) or not set(names) <= set(known):
        raise typer.BadParameter(f"--auto-objectives {option!r}: distinct names among {','.join(known)}")
    return [o for o in known if o in names]


def mode_specs(ks: list[int], edge_only: bool, objectives: list[str], remote_prefill: bool = False) -> list[ModeSpec]:
    """The fixed modes first (they also calibrate the edge's cost model on the current link), then an
    auto row per objective (``records.AUTO_ROWS``: ``ttft`` -> ``auto``, ``whole`` -> ``auto-whole``);
    ``objectives`` empty: no auto row."""
    out = [ModeSpec(f"split-k{k}", "split", k) for k in ks] + [ModeSpec("cloud-only", "direct")]
    out += [ModeSpec("edge-only", "local")] if edge_only else []
    out += [ModeSpec("remote-prefill", "remote_prefill")] if remote_prefill else []
    return out + [ModeSpec(a.label, "auto", whole_reply=a.whole_reply) for a in AUTO_ROWS if a.objective in objectives]


async def run_remote(
    edge_port: int,
    prompts: list[BenchPrompt],
    spec: ModeSpec,
    link: str,
    target: int,
    concurrency: int,
    max_new_tokens: int,
    progress,
    failures: list[dict] | None = None,
) -> list[RequestRecord]:
    """Send ``prompts`` through the edge daemon with at most ``concurrency`` in flight. With
    ``failures``, a request the SDK reports failed (``TandemClientError``: refused, timed out, an
    engine error) is appended there and said on stderr, and the others go on; without, it raises."""
    from tandem import AsyncClient, TandemClientError

    sem = asyncio.Semaphore(concurrency)
    records: list[RequestRecord] = []
    async with AsyncClient(f"127.0.0.1:{edge_port}") as client:

        async def one(p: BenchPrompt) -> None:
            async with sem:
                t0 = time.perf_counter()
                arrivals: list[tuple[float, int]] = []
                s = client.chat(
                    p.as_messages(),
                    max_new_tokens=max_new_tokens,
                    mode=spec.mode,
                    split_layer=spec.split_layer,
                    ignore_eos=True,
                    whole_reply=spec.whole_reply,
                )
                try:
                    async for d in s:
                        arrivals.append((time.perf_counter(), max(1, len(d.token_ids))))
                except TandemClientError as e:
                    if failures is None:
                        raise
                    failures.append(
                        {
                            "mode": spec.label,
                            "link": link,
                            "target_prompt_tokens": target,
                            "error": f"{type(e).__name__}: {e}",
                        }
                    )
                    print(f"tandem-bench modes: {spec.label} on {link} at {target} tokens failed: {e}", file=sys.stderr)
                    progress.update(1)
                    return
                t1 = time.perf_counter()
                r = s.result
                ttft = (arrivals[0][0] - t0) * 1e3 if arrivals else (t1 - t0) * 1e3
                itl = [(b[0] - a[0]) * 1e3 / b[1] for a, b in zip(arrivals, arrivals[1:], strict=False)]
                records.append(
                    RequestRecord(
                        spec.label,
                        link,
                        target,
                        r.prompt_tokens,
                        r.output_tokens,
                        ttft,
                        (t1 - t0) * 1e3,
                        itl,
                        t0,
                        t1,
                        r.external_tokens,
                        r.head_tokens,
                        dict(r.sent_bytes),
                        dict(r.timings_ms),
                        r.mode,
                        r.split_layer,
                        r.predicted_ttft_ms,
                        r.mode_reason,
                    )
                )
                progress.update(1)

        await asyncio.gather(*(one(p) for p in prompts))
    return records


def checked_shaper(order: str, concurrency: int, cloud: str, shaper: str) -> str:
    """The link shaper to use (``auto`` resolved: netns where available and no ``--cloud``, else proxy).

    Raises:
        typer.BadParameter: options that do not go together, or a ``--cloud`` that is no host:port.
    """
    from tandem.benchmarks import netns

    if order not in ("interleaved", "blocks"):
        raise typer.BadParameter(f"--order {order!r}: interleaved or blocks")
    if order == "interleaved" and concurrency != 1:
        raise typer.BadParameter("--concurrency > 1 needs --order blocks")
    if cloud and shaper == "netns":
        raise typer.BadParameter("--cloud: a running cloud is reached through --shaper proxy, not netns")
    if cloud:
        try:
            parse_host_port(cloud)
        except ValueError as e:
            raise typer.BadParameter(f"--cloud: {e}") from None
    if shaper == "auto":
        shaper = "netns" if netns.available() and not cloud else "proxy"
    return shaper


@dataclass(frozen=True)
class Plan:
    """What one run of the matrix sends on each link: the modes, prompt lengths and prompts (recorded,
    warm-ups, the calibration pass's, the link's warm-up), the order and the requests' shape."""

    specs: list[ModeSpec]
    lens: list[int]
    prompts: dict[int, list[BenchPrompt]]
    warmups: dict[int, list[BenchPrompt]]
    calibration: dict[int, list[BenchPrompt]]
    link_warmup: list[BenchPrompt]
    order: str
    warmup: int
    concurrency: int
    max_new_tokens: int


def calibrate(eport: int, plan: Plan, link: str) -> None:
    """The calibration pass (not recorded): each fixed mode once per prompt length, so the edge's cost
    model has seen every compute stage at every length, as a live edge has; auto's rows are not run."""
    for n in plan.lens:
        for spec in plan.specs:
            if not is_auto(spec.label):
                asyncio.run(run_remote(eport, plan.calibration[n], spec, link, n, 1, 2, _Null()))


def run_link(eport: int, plan: Plan, link: str, bar: Any, failures: list[dict]) -> list[RequestRecord]:
    """Every mode and prompt length on the link now set: ``blocks`` runs one mode at a time (what
    ``--concurrency > 1`` needs); ``interleaved`` runs, in round i, every mode once on prompt i in the
    Williams order of ``round_order``. Warm-ups (2 tokens, not recorded) before each block or round set.
    A recorded request that fails goes to ``failures`` (``run_remote``); a failed warm-up raises."""
    records: list[RequestRecord] = []
    for spec in plan.specs:
        asyncio.run(run_remote(eport, plan.link_warmup, spec, link, 16, 1, 2, _Null()))
    if plan.order == "blocks":
        for spec in plan.specs:
            for n in plan.lens:
                if plan.warmup:  # the switch from the previous block is not charged to this one
                    asyncio.run(run_remote(eport, plan.warmups[n][: plan.warmup], spec, link, n, 1, 2, _Null()))
                prompts = plan.prompts[n]
                records += asyncio.run(
                    run_remote(eport, prompts, spec, link, n, plan.concurrency, plan.max_new_tokens, bar, failures)
                )
        return records
    for n in plan.lens:
        for spec in plan.specs if plan.warmup else ():
            asyncio.run(run_remote(eport, plan.warmups[n][: plan.warmup], spec, link, n, 1, 2, _Null()))
        for i, p in enumerate(plan.prompts[n]):
            for spec in round_order(plan.specs, i):
                records += asyncio.run(run_remote(eport, [p], spec, link, n, 1, plan.max_new_tokens, bar, failures))
    return records


@app.command()
def main(
    model_dir: Annotated[Path, typer.Option(help="prepared model directory")] = Path("models/smollm2-135m"),
    split_layers: Annotated[str, typer.Option(help="split layers to run (exported ones)")] = "4,8",
    links: Annotated[
        str, typer.Option(help=f"link profiles: {','.join(linkmod.PROFILES)}")
    ] = "loopback,lan,wifi6,5g,4g,wan",
    prompt_lens: Annotated[str, typer.Option(help="target prompt lengths in tokens")] = "64,256,1024",
    requests: Annotated[int, typer.Option(help="requests per (mode, link, prompt length)")] = 4,
    order: Annotated[
        str,
        typer.Option(help="interleaved (round i: every mode once on prompt i, Williams order) | blocks (mode by mode)"),
    ] = "interleaved",
    warmup: Annotated[
        int, typer.Option(help="unrecorded requests (2 output tokens) before each (mode, prompt length) block")
    ] = 1,
    concurrency: Annotated[int, typer.Option(help="requests in flight")] = 1,
    max_new_tokens: int = 16,
    output_lens: Annotated[
        str,
        typer.Option(
            help="output lengths in tokens, e.g. 16,128,512: the whole matrix once per length on one stack, "
            "each under OUT/out-<n>, with OUT/outputs.md and outputs.png across them ('' = --max-new-tokens)"
        ),
    ] = "",
    max_num_seqs: int = 8,
    shaper: Annotated[
        str, typer.Option(help="auto | netns (tc tbf rate + proxy delay) | proxy (all in proxy)")
    ] = "auto",
    seed: int = 0,
    out: Annotated[Path, typer.Option(help="output directory")] = Path("bench-results/latest"),
    edge_only: Annotated[bool, typer.Option(help="also the edge-only row (the edge's local mode)")] = True,
    auto: Annotated[bool, typer.Option(help="also the auto rows (the edge chooses per request)")] = True,
    auto_objectives: Annotated[
        str,
        typer.Option(
            help="auto's rows, one per objective: ttft (row 'auto': lowest predicted TTFT, a streamed reply), "
            "whole (row 'auto-whole': lowest predicted end-to-end time, whole_reply=True)",
        ),
    ] = "ttft,whole",
    remote_prefill: Annotated[
        bool, typer.Option(help="also the remote-prefill row (the cloud prefills, the edge decodes)")
    ] = True,
    pipeline_tokens: Annotated[
        int, typer.Option(help="the edge's --pipeline-tokens (-1: its default; 0: the head runs whole first)")
    ] = -1,
    cloud: Annotated[
        str,
        typer.Option(
            help="host:port of a running plaintext tandem-cloud to use instead of starting one (it must "
            "serve these split layers; the shaper is then proxy)"
        ),
    ] = "",
    render: Annotated[
        bool,
        typer.Option(
            help="only write the tables and plots again from OUT's records.jsonl and meta.json (or those of "
            "each OUT/out-<n> of an --output-lens run)"
        ),
    ] = False,
) -> None:
    """Run the benchmark matrix and write records, tables and plots."""
    args = {k: str(v) if isinstance(v, Path) else v for k, v in locals().items()}
    from tandem.benchmarks import report

    if render:
        rerender(out)
        return
    from tqdm import tqdm
    from transformers import AutoTokenizer

    shaper = checked_shaper(order, concurrency, cloud, shaper)
    objectives = parse_auto_objectives(auto_objectives) if auto else []
    out.mkdir(parents=True, exist_ok=True)
    ks = [int(x) for x in split_layers.split(",") if x.strip()]
    profiles = linkmod.get(links)
    lens = [int(x) for x in prompt_lens.split(",") if x.strip()]
    outs = [int(x) for x in output_lens.split(",") if x.strip()] or [max_new_tokens]
    if any(n < 1 for n in outs) or len(set(outs)) != len(outs):
        raise typer.BadParameter(f"--output-lens {output_lens!r}: distinct positive token counts")
    tokenizer = AutoTokenizer.from_pretrained(model_dir / "hf")
    edge_only, remote_prefill = local_rows(model_dir, edge_only, remote_prefill)
    plan = Plan(
        specs=mode_specs(ks, edge_only, objectives, remote_prefill),
        lens=lens,
        prompts={n: make_prompts(tokenizer, n, requests, seed) for n in lens},
        warmups={n: make_prompts(tokenizer, n, max(1, warmup), seed + 13) for n in lens},
        calibration={n: make_prompts(tokenizer, n, 1, seed + 7) for n in lens},
        link_warmup=make_prompts(tokenizer, 16, 1, seed + 99),
        order=order,
        warmup=warmup,
        concurrency=concurrency,
        max_new_tokens=max_new_tokens,
    )
    workdir = work_dir("tandem-bench-")  # its block stores are removed at exit, its logs kept
    print(f"tandem-bench modes: shaper={shaper}, logs in {workdir}", file=sys.stderr)
    pipeline = ["--pipeline-tokens", str(pipeline_tokens)] if pipeline_tokens >= 0 else []
    longest = max(
        p.prompt_tokens
        for ps in [*plan.prompts.values(), *plan.warmups.values(), *plan.calibration.values()]
        for p in ps
    )
    stack = Stack(
        [model_dir / f"split-k{k}" for k in ks],
        shaper,
        workdir,
        max_num_seqs,
        edge_extra=pipeline,
        cloud_target=cloud,
        max_prompt_tokens=longest,
    )
    by_output: dict[int, list[RequestRecord]] = {n: [] for n in outs}
    failures: dict[int, list[dict]] = {n: [] for n in outs}
    total = len(lens) * requests * len(profiles) * len(plan.specs) * len(outs)
    with tqdm(total=total, desc="requests", unit="req") as bar:
        try:
            eport = stack.start()
            stack.set_link(profiles[0])
            calibrate(eport, plan, profiles[0].name)
            for n_out in outs:
                for prof in profiles:
                    stack.set_link(prof)
                    plan_n = replace(plan, max_new_tokens=n_out)
                    by_output[n_out] += run_link(eport, plan_n, prof.name, bar, failures[n_out])
        finally:
            stack.stop()
    meta = machine_meta(args) | {"shaper": shaper, "links": [p.as_dict() for p in profiles]}
    failed = sum(len(f) for f in failures.values())
    if failed:
        print(
            f"tandem-bench modes: {failed} requests failed, left out of the tables (meta.json: failed_requests)",
            file=sys.stderr,
        )
    if not all(by_output.values()):
        print("tandem-bench modes: no request was served: nothing to tabulate", file=sys.stderr)
        raise typer.Exit(1)
    if not output_lens:
        report.write_all(out, by_output[max_new_tokens], meta | {"failed_requests": failures[max_new_tokens]})
        print(f"results in {out}: summary.md, summary.csv, records.jsonl, *.png", file=sys.stderr)
        print((out / "summary.md").read_text())
        return
    rows = {
        n: report.write_all(out / f"out-{n}", recs, meta | {"max_new_tokens": n, "failed_requests": failures[n]})
        for n, recs in by_output.items()
    }
    report.write_output_matrix(out, rows)
    print(f"results in {out}: outputs.md, outputs.png, out-<n>/ per output length", file=sys.stderr)
    print((out / "outputs.md").read_text())


def rerender(out: Path) -> None:
    """``summary.md``, ``summary.csv``, ``auto.md`` and the plots again from a run's ``records.jsonl``
    and ``meta.json`` (the ``out-<n>`` folders and ``outputs.md`` of an ``--output-lens`` run).

    Raises: typer.BadParameter when ``out`` holds neither.
    """
    from tandem.benchmarks import report

    def one(d: Path) -> list[dict]:
        meta = json.loads((d / "meta.json").read_text())
        return report.write_all(d, report.load_records(d / "records.jsonl"), meta)

    if (out / "records.jsonl").is_file():
        one(out)
        print((out / "summary.md").read_text())
        return
    runs = {int(d.name.removeprefix("out-")): d for d in out.glob("out-*") if (d / "records.jsonl").is_file()}
    if not runs:
        raise typer.BadParameter(f"{out}: no records.jsonl (nor out-<n>/records.jsonl) to render", param_hint="--out")
    report.write_output_matrix(out, {n: one(d) for n, d in sorted(runs.items())})
    print((out / "outputs.md").read_text())


def williams_base(n: int) -> list[int]:
    """``0, 1, n-1, 2, n-2, ...``: the first row of a Williams square (Williams, "Experimental designs
    balanced for the estimation of residual effects of treatments", Aust. J. Sci. Res. 2, 1949)."""
    out, lo, hi = [0], 1, n - 1
    while len(out) < n:
        out.append(lo)
        lo += 1
        if len(out) < n:
            out.append(hi)
            hi -= 1
    return out


def round_order(specs: list[ModeSpec], i: int) -> list[ModeSpec]:
    """The order of round ``i``: a row of a Williams square, so that over the rounds every mode
    follows every other about equally often (exactly, after ``n`` rounds for an even number of modes
    and ``2n`` for an odd one: rows alternate with their mirror images). On these shared cores the
    request before matters (a direct request right after a local one took 484 ms against 401 to
    435 ms after a cloud one; see the module doc), and a cyclic rotation
    keeps every mode behind the same neighbour."""
    n = len(specs)
    row = i if n % 2 == 0 else i // 2
    order = [specs[(x + row) % n] for x in williams_base(n)]
    return order[::-1] if n % 2 and i % 2 else order


class _Null:
    def update(self, n: int) -> None:
        pass


if __name__ == "__main__":
    app()
