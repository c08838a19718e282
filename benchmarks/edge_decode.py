"""The edge's own speed: time to first token and time per output token of the edge's runtimes on one
device, beside ONNX Runtime GenAI's ``Generator`` on the same graph, vLLM single-stream, and the
floor of reading the weights once per token.

``tandem-bench edge --hf DIR --out DIR`` builds the whole model of the checkpoint with ONNX Runtime
GenAI's model builder (``common.model.builder_export``; fp32 on the CPU build, fp16 or bf16 on CUDA), then
runs batch 1, ``--prompt-tokens`` random prompt ids, ``--new-tokens`` greedy tokens (EOS ignored),
``--repeats`` times per runtime:

* ``tandem``: ``edge.compute.decoder.DecoderGraph`` (preallocated KV bound as past and present, the token id
  read back, the decode step a CUDA graph on a GPU), and ``tandem-eager`` (no CUDA graph);
* ``genai``: the library's own ``Generator`` on the same graph (CUDA graph on where the device has
  one), the reference for what ONNX Runtime can do;
* ``legacy`` (``--legacy-onnx``): ``edge.compute.local.LocalGenerator`` on tandem's torch.onnx export
  (``edge-full.onnx``), one ``run`` per token with growing KV tensors;
* ``tandem-sampled`` and ``genai-sampled``: the same two at temperature 0.8, top-k 50, top-p 0.95
  (``SAMPLED_*``): tandem's graph samples on the device where the build has the sampler (CUDA builds;
  only the token id comes back; ``sampler_ms``: the median of the sampler's own runs;
  ``sampler_top_k_share``: the share of them the top-k sampler answered), on the host
  from the logits otherwise; the library with its own sampler; a sampled row's ``itl / genai`` is
  against ``genai-sampled``;
* ``vllm`` (``--vllm``): an in-process vLLM engine on the same checkpoint, one request at a time;
  ITL = (time of N tokens - time of 1 token) / (N - 1).

Batched decode (``--batch-sizes 1,4,16``), at each batch size ``B``, ``B`` turns of different
random prompts of ``--prompt-tokens`` each, started together:

* ``tandem-engine``: ``edge.compute.local.LocalEngine`` over ``DecoderGraph``, the turns' decode steps run as
  one batched step (continuous batching; the prefills one after the other, between steps);
* ``genai-batch``: the library's ``Generator`` with ``batch_size=B`` (``set_search_options``) and the
  ``[B, prompt]`` ids appended at once (equal lengths: no padding), one step for all rows.

Two rows of one turn through ``LocalEngine`` show what a served turn meets and a steady loop does
not: ``tandem-engine-idle``, each turn after the engine sat idle ``IDLE_GAP_S``;
``tandem-engine-new-length``, each turn's prompt one token longer than the last (a prefill length
the runtime has not run yet), with the decoder's default prefill plan (``edge.compute.prefill``:
bucketed on the CUDA provider) and ``tandem-engine-new-length-exact`` with every prefill at its own
length. Each engine row starts with the engine's own warm-up, as a served edge does.
``prefill_shapes.md`` (``PREFILL_SHAPES``) times single prefill runs of ``DecoderGraph`` the first
time their shape comes and again, per prefill plan (``prefill_plans``: exact, padded, bucketed): a
longer prompt each run, a shorter one than a run before, the same new tokens after different held
tokens, which tells what ONNX Runtime keys its per-shape first-run cost on and whether a plan's
fixed shapes take it away.

Columns: ``batch`` (turns decoding together), ``ttft_ms`` (median over turns and repeats, queueing
behind the other turns' prefills included), ``ttft: wait / run ms`` (the engine rows: the first
token's prefill, its wait for the model and its run, medians; the TTFT's rest is the engine's own:
the event loop, the stepper thread's hand-offs, sampling), ``itl_ms`` (median over every step of
every turn and repeat), ``tokens_per_s`` (one turn's, 1000 / itl), ``aggregate_tokens_per_s`` (all turns' output
tokens / the wall time from the start to the last token, prefills included), and ``floor_ms`` =
parameter bytes at the run's dtype / the device's memory bandwidth (NVIDIA's datasheets: H100 SXM
3.35 TB/s, H200 4.8 TB/s; ``--bandwidth-gbs`` for others). Writes ``edge_decode.json``,
``edge_decode.md``, ``edge_decode.png`` (time per output token at batch 1; aggregate tokens/s
against the batch size) and ``prefill_shapes.md``.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

from tandem.edge.compute.prefill import CHUNK_TOKENS, PrefillPlan
from tandem.edge.config import EdgeConfig

app = typer.Typer(add_completion=False, help=__doc__)

# bytes/s, from NVIDIA's datasheets (HBM3 of the H100 SXM 80GB, HBM3e of the H200)
BANDWIDTH_BPS = {"H100": 3.35e12, "H200": 4.8e12}
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int4": 0.5}
IDLE_GAP_S = 0.5  # tandem-engine-idle's pause before each turn: longer than an ended stepper thread's linger
EDGE_KV_BYTES: int = EdgeConfig.model_fields["local_kv_bytes"].default  # the engine's KV bound, as an edge's default


def gpu_name() -> str:
    """The first GPU's name from nvidia-smi, or "" without one."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
        return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else ""
    except FileNotFoundError:
        return ""


def parameter_count(hf: Path) -> int:
    """Parameters of the checkpoint, from its safetensors headers (tied embeddings counted once)."""
    n = 0
    for f in sorted(hf.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        n += sum(int(np.prod(v["shape"])) for k, v in header.items() if k != "__metadata__")
    return n


def genai_copy(build_dir: Path, out: Path, cuda_graph: bool) -> Path:
    """A folder for ONNX Runtime GenAI's ``Generator``: the build's files linked, its graph without the
    ``next_token_ids`` output tandem adds, the CUDA provider (graph capture on or off) in its config."""
    import onnx

    out.mkdir(parents=True, exist_ok=True)
    for f in build_dir.iterdir():
        if f.name not in ("model.onnx", "genai_config.json") and not (out / f.name).exists():
            try:  # ONNX Runtime refuses external weights behind a symbolic link: a hard link, else a copy
                os.link(f, out / f.name)
            except OSError:
                shutil.copy2(f, out / f.name)
    m = onnx.load(str(build_dir / "model.onnx"), load_external_data=False)
    keep = [n for n in m.graph.node if "next_token_ids" not in n.output]
    del m.graph.node[:]
    m.graph.node.extend(keep)
    outs = [o for o in m.graph.output if o.name != "next_token_ids"]
    del m.graph.output[:]
    m.graph.output.extend(outs)
    onnx.save(m, str(out / "model.onnx"))
    cfg = json.loads((build_dir / "genai_config.json").read_text())
    if gpu_name():
        opts = [{"cuda": {"enable_cuda_graph": "1" if cuda_graph else "0"}}]
        cfg["model"]["decoder"]["session_options"]["provider_options"] = opts
    (out / "genai_config.json").write_text(json.dumps(cfg, indent=2))
    return out


# the sampled rows' parameters: vLLM's temperature, top-k and top-p, as a chat client sets them
SAMPLED_TEMPERATURE, SAMPLED_TOP_K, SAMPLED_TOP_P = 0.8, 50, 0.95


def time_tandem(
    build_dir: Path, prompt: list[int], new_tokens: int, repeats: int, cuda_graph: bool, sampled: bool = False
) -> dict:
    """``DecoderGraph`` at batch 1: greedy, or (``sampled``) ``SAMPLED_*`` at one seeded draw per token,
    sampled by the graph's own sampler where the build has one (CUDA) and on the host from the
    logits otherwise (``edge.compute.local.sample_token``, the same rule)."""
    from tandem.common.protocol.params import Sampling
    from tandem.edge.compute.decoder import DecoderGraph
    from tandem.edge.compute.local import draw_uniform, next_token
    from tandem.edge.compute.localmodel import Draw

    g = DecoderGraph(build_dir, cuda_graph=cuda_graph)
    s = Sampling(temperature=SAMPLED_TEMPERATURE, top_k=SAMPLED_TOP_K, top_p=SAMPLED_TOP_P) if sampled else None
    sampler_ms: list[float] = []  # the device sampler's own runs, where it samples
    rng = np.random.default_rng(0)
    ttft, itl = [], []
    slot = g.new_slot(len(prompt) + new_tokens)

    def step(ids: list[int]) -> int:
        if s is None:
            tok, _, _ = g.run(slot, ids, greedy=True)
            return int(tok or 0)
        u = draw_uniform(rng)
        draw = Draw(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, uniform=u)
        runs = g.sampler.runs if g.sampler is not None else 0
        tok, logits, _ = g.run(slot, ids, greedy=False, draw=draw)
        if g.sampler is not None and g.sampler.runs > runs:
            sampler_ms.append(g.sampler.last_ms)
        return next_token(tok, logits, s, u)

    for _ in range(repeats + 1):  # the first repeat warms up (and captures the graph)
        g.truncate(slot, 0)
        t0 = time.perf_counter()
        tok = step(prompt)
        first = (time.perf_counter() - t0) * 1e3
        steps = []
        for _ in range(new_tokens - 1):
            t1 = time.perf_counter()
            tok = step([tok])
            steps.append((time.perf_counter() - t1) * 1e3)
        ttft.append(first)
        itl.append(steps)
    where = "device" if sampled and g.has_sampling else "host" if sampled else ""
    row = _summary(ttft[1:], itl[1:], providers=g.session.get_providers()[0]) | ({"sampler": where} if where else {})
    if sampler_ms:  # the warm-up repeat's runs left out
        row["sampler_ms"] = statistics.median(sampler_ms[len(sampler_ms) // (repeats + 1) :])
    if g.sampler is not None and g.sampler.runs:  # the share of sampled steps the top-k sampler answered
        row["sampler_top_k_share"] = g.sampler.top_runs / g.sampler.runs
    return row


# (label, held tokens, new tokens) per prefill run, in order; each on a fresh slot, its held tokens
# filled first by untimed runs of PREFILL_FILL_TOKENS (a run whose new tokens come after others)
PREFILL_FILL_TOKENS = 128
PREFILL_SHAPES: tuple[tuple[str, int, int], ...] = (
    ("longer each run", 0, 64),
    ("longer each run", 0, 65),
    ("longer each run", 0, 66),
    ("longest so far", 0, 512),
    ("shorter than one run before", 0, 400),
    ("shorter than one run before", 0, 300),
    ("same new tokens after held ones", 128, 64),
    ("same new tokens after held ones", 256, 64),
    ("same new tokens after held ones", 384, 64),
    ("new tokens of a length run before", 0, 65),
)
STEPPED_TOKENS = (8, 24)  # new tokens after 64 held, run as one-token decode steps (rows "as decode steps")


def prefill_plans(chunk_tokens: int) -> dict[str, PrefillPlan]:
    """The prefill plans ``prefill_shapes.md`` compares: every run at its own length; padded to the
    bucketed plan's lengths with the mask over the held and new tokens; the bucketed plan (the
    mask over the slot's capacity too: the CUDA provider's default)."""
    bucketed = PrefillPlan.bucketed(chunk_tokens)
    return {
        "exact": PrefillPlan.EXACT,
        "padded": PrefillPlan(chunk_tokens, bucketed.bucket_tokens, capacity_mask=False),
        "bucketed": bucketed,
    }


def time_prefill_shapes(
    build_dir: Path, vocab_size: int, plans: dict[str, PrefillPlan], cuda_graph: bool = True
) -> list[dict]:
    """Per plan (``DecoderGraph(prefill=plan)``, in a session of its own, its ``warm_prefills``
    first, timed as ``warm_ms``), each ``PREFILL_SHAPES`` run the first time its shape comes and once
    more on another fresh slot: ``first_ms`` and ``again_ms`` (the run's own time). What a served
    turn pays for a prefill shape ONNX Runtime has not run yet, whether it is the new tokens, the
    held ones or the longest run so far that sets it, and whether a plan's fixed shapes take it
    away; then ``STEPPED_TOKENS`` new tokens after 64 held run as one-token runs (decode steps,
    CUDA graphs where on), what a short catch-up costs that way. Two untimed 32-token runs first
    (the session's first runs). The slots' memory is bounded as the edge's default
    ``local_kv_bytes`` bounds it (which capacities the warm-up runs)."""
    from tandem.edge.compute.decoder import DecoderGraph

    ids = [int(x) for x in np.random.default_rng(7).integers(3, min(vocab_size, 32000), 2048)]
    rows = []
    for name, plan in plans.items():
        g = DecoderGraph(build_dir, cuda_graph=cuda_graph, max_kv_bytes=EDGE_KV_BYTES, prefill=plan)

        def run(held: int, new: int, stepped: bool = False, g: DecoderGraph = g) -> float:
            """ms of ``new`` tokens after ``held`` on a fresh slot of the capacity a served turn of
            them gets (``new_kv``: powers of two from 256, so the KV inputs' shape is a served one
            and the padding has room): one run, or (``stepped``) one per token."""
            slot = g.new_kv(held + new + 1)
            try:
                for lo in range(0, held, PREFILL_FILL_TOKENS):
                    g.run(slot, ids[lo : min(held, lo + PREFILL_FILL_TOKENS)], greedy=True)
                chunks = [[t] for t in ids[held : held + new]] if stepped else [ids[held : held + new]]
                t0 = time.perf_counter()
                for chunk in chunks:
                    g.run(slot, chunk, greedy=True)
                return (time.perf_counter() - t0) * 1e3
            finally:
                g.release(slot)

        t0 = time.perf_counter()
        warmed = g.warm_prefills()
        warm_ms = (time.perf_counter() - t0) * 1e3
        run(0, 32)
        run(0, 32)
        cases = [(label, held, new, False) for label, held, new in PREFILL_SHAPES]
        cases += [("as decode steps", 64, new, True) for new in STEPPED_TOKENS]  # a remote prefill's catch-up so
        for label, held, new, stepped in cases:
            first = run(held, new, stepped)
            again = run(held, new, stepped)
            rows.append(
                {"plan": name, "case": label, "held_tokens": held, "new_tokens": new, "first_ms": first}
                | {"again_ms": again, "warm_ms": warm_ms, "warmed_capacities": warmed}
            )
        del g
    return rows


def prefill_markdown(rows: list[dict]) -> str:
    """The plans' rows, then one line per plan with its warm-up."""
    lines = [
        "| plan | case | held tokens | new tokens | first run ms | same shape again ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['plan']} | {r['case']} | {r['held_tokens']} | {r['new_tokens']} | {r['first_ms']:.2f} "
            f"| {r['again_ms']:.2f} |"
        )
    warm = {r["plan"]: r for r in rows}
    lines.append("")
    for name, r in warm.items():
        caps = ", ".join(str(c) for c in r["warmed_capacities"]) or "none"
        lines.append(f"- {name}: warm-up {r['warm_ms']:.0f} ms (KV capacities {caps})")
    return "\n".join(lines) + "\n"


def time_genai(
    build_dir: Path,
    work: Path,
    prompt: list[int],
    new_tokens: int,
    repeats: int,
    cuda_graph: bool,
    sampled: bool = False,
) -> dict:
    """The library's ``Generator`` at batch 1: greedy, or (``sampled``) its own sampler at ``SAMPLED_*``."""
    import onnxruntime_genai as og

    model = og.Model(str(genai_copy(build_dir, work, cuda_graph)))
    ttft, itl = [], []
    for _ in range(repeats + 1):
        params = og.GeneratorParams(model)
        params.set_search_options(
            max_length=len(prompt) + new_tokens, do_sample=sampled, min_length=len(prompt) + new_tokens
        )
        if sampled:
            params.set_search_options(
                temperature=SAMPLED_TEMPERATURE, top_k=SAMPLED_TOP_K, top_p=SAMPLED_TOP_P, random_seed=0
            )
        gen = og.Generator(model, params)
        t0 = time.perf_counter()
        gen.append_tokens(np.asarray([prompt], np.int32))
        gen.generate_next_token()
        gen.get_next_tokens()
        first = (time.perf_counter() - t0) * 1e3
        steps = []
        while not gen.is_done():
            t1 = time.perf_counter()
            gen.generate_next_token()
            gen.get_next_tokens()
            steps.append((time.perf_counter() - t1) * 1e3)
        ttft.append(first)
        itl.append(steps)
        del gen
    return _summary(ttft[1:], itl[1:], providers="genai")


def batch_prompts(prompt_tokens: int, batch: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``batch`` random prompts of ``prompt_tokens`` ids each, all different."""
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(3, min(vocab_size, 32000), prompt_tokens)] for _ in range(batch)]


def time_engine(
    build_dir: Path,
    hf: Path,
    prompts: list[list[int]],
    new_tokens: int,
    repeats: int,
    gap_s: float = 0.0,
    new_lengths: bool = False,
    prefill: PrefillPlan | None = None,
) -> dict:
    """``len(prompts)`` turns through ``LocalEngine`` at once, every repeat, after the engine's own
    warm-up (``LocalEngine.warmup``, as a served edge starts) and one untimed repeat; ``gap_s``: the
    engine idle this long before each repeat; ``new_lengths``: each repeat's prompts one token
    longer than the last's (shapes the runtime has not run yet); ``prefill``: the decoder's plan
    (None: its default, ``PrefillPlan.bucketed`` on the CUDA provider)."""
    import asyncio

    from tandem.common.model.prepare import model_shape
    from tandem.common.protocol.params import Sampling
    from tandem.edge.compute.decoder import DecoderGraph
    from tandem.edge.compute.local import LocalEngine

    graph = DecoderGraph(build_dir, max_kv_bytes=EDGE_KV_BYTES, prefill=prefill)
    engine = LocalEngine(graph, model_shape(json.loads((hf / "config.json").read_text())), ())
    sampling = Sampling(max_new_tokens=new_tokens, ignore_eos=True)

    firsts: list[tuple[float, float]] = []  # each timed turn's first token: its model run's wait and run (ms)

    async def one(ids: list[int], timed: bool) -> list[float]:
        times = []
        async for tok in engine.generate(ids, sampling):
            times.append(time.perf_counter())
            if timed and len(times) == 1:
                firsts.append((tok.wait_ms, tok.run_ms))
        return times

    async def timed() -> list[tuple[float, list[list[float]]]]:
        await engine.warmup()
        out = []
        for r in range(repeats + 1):
            await asyncio.sleep(gap_s)
            turns = [p + p[: r + 1] for p in prompts] if new_lengths else prompts
            t0 = time.perf_counter()
            out.append((t0, list(await asyncio.gather(*(one(p, r > 0) for p in turns)))))
        return out[1:]

    row = _batch_summary(asyncio.run(timed()), providers=engine.providers[0])
    # the first token's time apart: its prefill's wait for the model and its run; the TTFT's rest is
    # the engine's own (the event loop, the stepper thread's hand-offs, sampling)
    row["ttft_wait_ms"] = statistics.median(w for w, _ in firsts)
    row["ttft_run_ms"] = statistics.median(r for _, r in firsts)
    return row


def time_genai_batch(build_dir: Path, work: Path, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict:
    """The ``Generator`` over ``len(prompts)`` rows of equal length, every repeat (one warm-up first)."""
    import onnxruntime_genai as og

    model = og.Model(str(genai_copy(build_dir, work, cuda_graph=True)))
    ids = np.asarray(prompts, np.int32)
    runs = []
    for _ in range(repeats + 1):
        params = og.GeneratorParams(model)
        total = ids.shape[1] + new_tokens
        params.set_search_options(batch_size=len(prompts), max_length=total, min_length=total, do_sample=False)
        gen = og.Generator(model, params)
        t0 = time.perf_counter()
        gen.append_tokens(ids)
        times = []
        while not gen.is_done():
            gen.generate_next_token()
            gen.get_next_tokens()
            times.append(time.perf_counter())
        runs.append((t0, [times] * len(prompts)))  # every row gets its token at each step
        del gen
    return _batch_summary(runs[1:], providers="genai")


def _batch_summary(runs: list[tuple[float, list[list[float]]]], providers: str) -> dict:
    """Per repeat, its start and every turn's token times (``perf_counter()`` s)."""
    ttft = [(times[0] - t0) * 1e3 for t0, turns in runs for times in turns]
    itl = [[(b - a) * 1e3 for a, b in zip(times, times[1:], strict=False)] for _, turns in runs for times in turns]
    agg = [sum(len(t) for t in turns) / (max(t[-1] for t in turns) - t0) for t0, turns in runs]
    row = _summary(ttft, itl, providers)
    row |= {"batch": len(runs[0][1]), "aggregate_tokens_per_s": statistics.median(agg)}
    return row


def time_legacy(onnx_path: Path, hf: Path, prompt: list[int], new_tokens: int, repeats: int) -> dict:
    from tandem.common.model.prepare import model_shape
    from tandem.edge.compute.local import LocalGenerator

    cfg = json.loads((hf / "config.json").read_text())
    gen = LocalGenerator(onnx_path, model_shape(cfg))
    ttft, itl = [], []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        times = [s.t_s for s in gen.generate(list(prompt), new_tokens)]
        ttft.append((times[0] - t0) * 1e3)
        itl.append([(b - a) * 1e3 for a, b in zip(times, times[1:], strict=False)])
    return _summary(ttft[1:], itl[1:], providers=gen.engine.providers[0])


def time_vllm(hf: Path, prompt: list[int], new_tokens: int, repeats: int) -> dict:
    """vLLM single-stream on ``hf`` (bf16): TTFT as one-token requests, ITL from whole replies.
    Its engine core is spawned, not forked: this process already holds a CUDA context (ONNX
    Runtime's), which a forked child cannot use (``CUDA error: initialization error``)."""
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(str(hf), dtype="bfloat16", max_model_len=len(prompt) + new_tokens + 16, gpu_memory_utilization=0.3)
    p = TokensPrompt(prompt_token_ids=list(prompt))

    def one(n: int) -> float:
        t0 = time.perf_counter()
        llm.generate([p], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
        return (time.perf_counter() - t0) * 1e3

    one(new_tokens)  # warm-up
    firsts = [one(1) for _ in range(repeats)]
    wholes = [one(new_tokens) for _ in range(repeats)]
    ttft = statistics.median(firsts)
    itl = (statistics.median(wholes) - ttft) / (new_tokens - 1)
    return {"ttft_ms": ttft, "itl_ms": itl, "itl_p90_ms": itl, "tokens_per_s": 1e3 / itl, "provider": "vllm"}


def _summary(ttft: list[float], itl: list[list[float]], providers: str) -> dict:
    steps = [x for r in itl for x in r]
    return {
        "ttft_ms": statistics.median(ttft),
        "itl_ms": statistics.median(steps),
        "itl_p90_ms": float(np.percentile(steps, 90)),
        "tokens_per_s": 1e3 / statistics.median(steps),
        "provider": providers,
    }


def to_markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "| model | runtime | dtype | device | batch | ttft_ms | ttft: wait / run ms | itl_ms | itl_p90_ms "
        "| tokens_per_s | aggregate_tokens_per_s | itl / genai | floor_ms |"
    )
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        first = f"| {r['model']} | {r['runtime']} | {r['dtype']} | {r['device']} | {r.get('batch', 1)} "
        if "error" in r:
            lines.append(first + f"| failed: {r['error'][:80]} ||||||||")
            continue
        ratio = f"{r['vs_genai']:.2f}" if r.get("vs_genai") else ""
        parts = f"{r['ttft_wait_ms']:.2f} / {r['ttft_run_ms']:.2f}" if "ttft_run_ms" in r else ""
        lines.append(
            first + f"| {r['ttft_ms']:.2f} | {parts} | {r['itl_ms']:.3f} | {r['itl_p90_ms']:.3f} "
            f"| {r['tokens_per_s']:.0f} "
            f"| {r.get('aggregate_tokens_per_s', r['tokens_per_s']):.0f} | {ratio} "
            f"| {r.get('floor_ms', float('nan')):.3f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    models = sorted({r["model"] for r in ok})
    fig, axes = plt.subplots(2, len(models), figsize=(5 * len(models), 8), squeeze=False)
    for ax, m in zip(axes[1], models, strict=True):
        for runtime in sorted({r["runtime"] for r in ok if r["model"] == m and r.get("batch_run")}):
            mine = sorted((r for r in ok if r["model"] == m and r["runtime"] == runtime), key=lambda r: r["batch"])
            ax.plot([r["batch"] for r in mine], [r["aggregate_tokens_per_s"] for r in mine], marker="o", label=runtime)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("turns decoding together (batch)")
        ax.set_ylabel("aggregate output tokens/s")
        ax.legend()
    for ax, m in zip(axes[0], models, strict=True):
        mine = [r for r in ok if r["model"] == m and not r.get("batch_run")]
        ax.bar([r["runtime"] for r in mine], [r["itl_ms"] for r in mine], color="tab:blue")
        floors = [r["floor_ms"] for r in mine if r.get("floor_ms")]
        if floors:
            ax.axhline(floors[0], color="black", ls="--", label="weights-read floor")
            ax.legend()
        ax.set_title(m)
        ax.set_ylabel("time per output token (ms), batch 1")
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@app.command()
def main(
    hf: Annotated[Path, typer.Option(help="HF checkpoint folder")] = Path("models/smollm2-135m/hf"),
    out: Annotated[Path, typer.Option(help="results folder")] = Path("bench-results/edge"),
    build_dir: Annotated[Path | None, typer.Option(help="built graph folder (default OUT/build-PRECISION)")] = None,
    precision: Annotated[str, typer.Option(help="fp32 (CPU), fp16 or bf16 (GPU), int4")] = "",
    legacy_onnx: Annotated[Path | None, typer.Option(help="tandem's torch.onnx edge-full.onnx to time too")] = None,
    vllm: Annotated[bool, typer.Option(help="time vLLM single-stream on the same checkpoint (GPU)")] = False,
    prompt_tokens: int = 64,
    new_tokens: int = 256,
    repeats: int = 3,
    bandwidth_gbs: Annotated[float, typer.Option(help="memory bandwidth for the floor (GB/s; 0: datasheet)")] = 0.0,
    name: Annotated[str, typer.Option(help="model name in the table (default: the folder's)")] = "",
    batch_sizes: Annotated[str, typer.Option(help="turns decoding together, comma-separated ('' for none)")] = "1",
    prefill_chunk_tokens: Annotated[
        int, typer.Option(help="prefill_shapes.md: the padded plans' chunk (their lengths: powers of two up to it)")
    ] = CHUNK_TOKENS,
) -> None:
    """Time the edge's runtimes on one checkpoint: ONNX Runtime (tandem's decoder and the GenAI
    Generator), optionally vLLM, unbatched and batched, and the prefill plans (docs/benchmarks.md,
    "The edge's runtimes")."""
    from tandem.common.model.builder_export import build_decoder

    gpu = gpu_name()
    device = gpu or "cpu"
    precision = precision or ("fp16" if gpu else "fp32")
    out.mkdir(parents=True, exist_ok=True)
    build_dir = build_dir or out / f"build-{precision}"
    if not (build_dir / "genai_config.json").is_file():
        t0 = time.perf_counter()
        build_decoder(hf, build_dir, precision, "cuda" if gpu else "cpu")
        print(f"built {precision} in {time.perf_counter() - t0:.1f} s -> {build_dir}", file=sys.stderr)
    work = build_dir.parent / f"{build_dir.name}-genai"  # the Generator's copies, beside the build
    cfg = json.loads((hf / "config.json").read_text())
    rng = np.random.default_rng(0)
    prompt = [int(x) for x in rng.integers(3, min(cfg["vocab_size"], 32000), prompt_tokens)]
    bw = bandwidth_gbs * 1e9 or next((v for k, v in BANDWIDTH_BPS.items() if k in gpu), 0.0)
    params = parameter_count(hf)
    model = name or (hf.resolve().parent.name if hf.name == "hf" else hf.name)
    runs: list[tuple[str, str, Any]] = [
        ("tandem", precision, lambda: time_tandem(build_dir, prompt, new_tokens, repeats, cuda_graph=True)),
        ("genai", precision, lambda: time_genai(build_dir, work / "genai", prompt, new_tokens, repeats, True)),
        ("tandem-sampled", precision, lambda: time_tandem(build_dir, prompt, new_tokens, repeats, True, sampled=True)),
        (
            "genai-sampled",
            precision,
            lambda: time_genai(build_dir, work / "genai-sampled", prompt, new_tokens, repeats, True, sampled=True),
        ),
    ]
    if gpu:
        runs.append(("tandem-eager", precision, lambda: time_tandem(build_dir, prompt, new_tokens, repeats, False)))
        runs.append(
            (
                "genai-eager",
                precision,
                lambda: time_genai(build_dir, work / "genai-eager", prompt, new_tokens, repeats, False),
            )
        )
    if legacy_onnx is not None:
        runs.append(("legacy", "fp32", lambda: time_legacy(legacy_onnx, hf, prompt, new_tokens, repeats)))
    if vllm:
        runs.append(("vllm", "bf16", lambda: time_vllm(hf, prompt, new_tokens, repeats)))
    # one turn after an idle gap, and one of a prompt length not run before, each repeat
    lone = batch_prompts(prompt_tokens, 1, cfg["vocab_size"], seed=1)
    idle = partial(time_engine, build_dir, hf, lone, new_tokens, repeats, IDLE_GAP_S)
    runs.append(("tandem-engine-idle", precision, idle))
    lengths = partial(time_engine, build_dir, hf, lone, new_tokens, repeats, new_lengths=True)
    runs.append(("tandem-engine-new-length", precision, lengths))
    exact = partial(lengths, prefill=PrefillPlan.EXACT)  # every prefill at its own length
    runs.append(("tandem-engine-new-length-exact", precision, exact))
    batches = [int(b) for b in batch_sizes.split(",") if b.strip()]
    batch_of: dict[int, int] = {}  # index in runs -> turns decoding together, for the batched runs
    if any(b < 1 for b in batches):
        raise typer.BadParameter(f"batch sizes must be >= 1: {batch_sizes}")
    for b in batches:
        turns = batch_prompts(prompt_tokens, b, cfg["vocab_size"], seed=b)
        runs.append(("tandem-engine", precision, partial(time_engine, build_dir, hf, turns, new_tokens, repeats)))
        batched = partial(time_genai_batch, build_dir, work / f"genai-b{b}", turns, new_tokens, repeats)
        runs.append(("genai-batch", precision, batched))
        batch_of[len(runs) - 2] = batch_of[len(runs) - 1] = b
    rows: list[dict[str, Any]] = []
    for i, (runtime, dtype, fn) in enumerate(runs):
        row: dict[str, Any] = {"model": model, "runtime": runtime, "dtype": dtype, "device": device}
        row |= {"batch": batch_of.get(i, 1), "batch_run": i in batch_of}
        print(f"timing {runtime} ({dtype}) on {device} ...", file=sys.stderr, flush=True)
        try:
            row.update(fn())
        except Exception as e:  # a runtime that fails is reported in the table; the others still run
            row["error"] = f"{type(e).__name__}: {e}"
        if bw and "error" not in row:
            row["floor_ms"] = params * DTYPE_BYTES.get(dtype, 2) / bw * 1e3
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    base = {r["runtime"]: r["itl_ms"] for r in rows if r["runtime"] in ("genai", "genai-sampled") and "error" not in r}
    for r in rows:  # a sampled row against the library's sampled Generator, the others against its greedy one
        genai = base.get("genai-sampled" if r["runtime"].endswith("-sampled") else "genai")
        if genai and "error" not in r:
            r["vs_genai"] = r["itl_ms"] / genai
    print("timing prefill shapes ...", file=sys.stderr, flush=True)
    try:
        shapes = time_prefill_shapes(build_dir, cfg["vocab_size"], prefill_plans(prefill_chunk_tokens))
    except Exception as e:  # reported like a failed runtime; the tables above still stand
        shapes = [{"error": f"{type(e).__name__}: {e}"}]
    meta = {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "repeats": repeats, "device": device}
    meta["batch_sizes"] = batches
    meta |= {"parameters": params, "bandwidth_bps": bw, "versions": _versions()}
    (out / "edge_decode.json").write_text(json.dumps({"meta": meta, "rows": rows, "prefill_shapes": shapes}, indent=2))
    (out / "edge_decode.md").write_text(to_markdown(rows))
    if "error" not in shapes[0]:
        (out / "prefill_shapes.md").write_text(prefill_markdown(shapes))
        print(prefill_markdown(shapes))
    else:
        print(f"prefill shapes: {shapes[0]['error']}")
    plot(rows, out / "edge_decode.png")
    print(to_markdown(rows))
    shutil.rmtree(work, ignore_errors=True)


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for p in ("onnxruntime", "onnxruntime-gpu", "onnxruntime-genai", "onnxruntime-genai-cuda", "vllm", "torch"):
        try:
            found[p] = version(p)
        except PackageNotFoundError:
            pass
    return found


if __name__ == "__main__":
    app()
