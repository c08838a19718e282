"""Greedy replies and teacher-forced next-token distributions from one real vLLM engine, for the
noise floor of ``tandem-bench fidelity``. Run as a child process (vLLM spawns its own; one
engine per process): ``python -m tandem.benchmarks.engine_logprobs --model HF_DIR --dtype float32
--concurrency 1 --out C1.npz [--concurrency 4 --out C4.npz ...] --requests IN.json``: one pass over
the requests per ``--concurrency``, each written to its ``--out``, on the same engine (prefix
caching off, so a later pass computes every position again, as a fresh engine would). Each
``--out`` is written whole or not at all (``children.write_npz``).

The engine is the decode engine's: the full checkpoint, ``enforce_eager``, ``block_size`` 32,
prefix caching off and a 1 GiB KV cache (``cloud.config.EngineConfig``'s CPU defaults), at the
given dtype. Requests go in groups of ``--concurrency``, each group in one ``LLM.generate`` call,
so they batch as that many requests in flight do. The first pass generates the replies that are
null; later passes force the same replies.

``IN.json``: ``[{"id", "prompt": [token ids], "reply": [token ids] | null}]``. A null reply is
first generated greedily (up to ``--max-new-tokens``, EOS included and last). Then every request
runs teacher-forced (``prompt + reply`` as the prompt, one output token) with
``prompt_logprobs = --top-k``: vLLM returns, per prompt position, the top ``K`` tokens by
log-probability and the given token's, computed over the whole vocabulary (so each is an exact
log-probability; only the tokens outside the top ``K`` are missing).

``OUT.npz``, per request id ``r``: ``r/reply`` int32 ``[n]`` (the reply used), ``r/ids`` int32
``[n, K]`` and ``r/lps`` float32 ``[n, K]`` (the top ``K`` of the distribution ``reply[j]`` is
sampled from, best first), ``r/own`` float32 ``[n]`` (the log-probability of ``reply[j]``) and
``r/greedy`` int32 (this engine's own greedy reply, when ``--greedy``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

from tandem.benchmarks.children import write_npz

app = typer.Typer(add_completion=False, help=__doc__)


@app.command()
def main(
    model: Annotated[Path, typer.Option(help="HF checkpoint directory (the full model)")],
    requests: Annotated[Path, typer.Option(help="JSON list of {id, prompt, reply}")],
    out: Annotated[list[Path], typer.Option(help="output .npz, one per --concurrency")],
    dtype: Annotated[str, typer.Option(help="engine dtype: float32 or bfloat16")] = "float32",
    concurrency: Annotated[
        list[int], typer.Option(help="requests per engine call (in flight together), one pass each")
    ] = [1],  # noqa: B006 - typer reads the default, never mutated
    top_k: Annotated[int, typer.Option(help="prompt_logprobs: top tokens per position")] = 64,
    max_new_tokens: int = 32,
    greedy: Annotated[bool, typer.Option(help="also generate this engine's own greedy replies")] = True,
) -> None:
    """Write the greedy replies and teacher-forced top-K log-probabilities of every request."""
    from vllm import LLM

    if len(out) != len(concurrency):
        raise typer.BadParameter(f"{len(out)} --out for {len(concurrency)} --concurrency: one each")
    reqs = json.loads(requests.read_text())
    llm = LLM(
        model=str(model),
        dtype=dtype,  # type: ignore[arg-type]
        enforce_eager=True,
        max_logprobs=top_k,
        max_model_len=2048,
        block_size=32,
        max_num_seqs=8,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=1 << 30,
        seed=0,
    )
    for path, n in zip(out, concurrency, strict=True):
        write_npz(path, one_pass(llm, reqs, n, top_k, max_new_tokens, greedy))


def one_pass(llm: Any, reqs: list[dict], concurrency: int, top_k: int, max_new_tokens: int, greedy: bool) -> dict:
    """Every request in groups of ``concurrency``: the arrays of ``OUT.npz`` (module doc). Fills a
    null ``reply`` in ``reqs`` with the greedy one."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sample = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
    forced = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top_k)
    arrays: dict[str, np.ndarray] = {}

    def gen(batch: list[dict]) -> list[list[int]]:
        outs = llm.generate([TokensPrompt(prompt_token_ids=r["prompt"]) for r in batch], sample, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    for i in range(0, len(reqs), concurrency):
        batch = reqs[i : i + concurrency]
        own = gen(batch) if greedy else [None] * len(batch)
        for r, g in zip(batch, own, strict=True):
            if g is not None:
                arrays[f"{r['id']}/greedy"] = np.asarray(g, np.int32)
            if r.get("reply") is None:
                r["reply"] = g if g is not None else gen([r])[0]
        prompts = [TokensPrompt(prompt_token_ids=r["prompt"] + r["reply"]) for r in batch]
        for r, o in zip(batch, llm.generate(prompts, forced, use_tqdm=False), strict=True):
            t, n = len(r["prompt"]), len(r["reply"])
            ids, lps = np.zeros((n, top_k), np.int32), np.full((n, top_k), -np.inf, np.float32)
            mine = np.zeros(n, np.float32)
            for j, tok in enumerate(r["reply"]):
                d = o.prompt_logprobs[t + j]
                assert d is not None  # every position past the first has its log-probabilities
                top = sorted((v.rank, tid, v.logprob) for tid, v in d.items() if v.rank is not None and v.rank <= top_k)
                for m, (_, tid, lp) in enumerate(top[:top_k]):
                    ids[j, m], lps[j, m] = tid, lp
                mine[j] = d[tok].logprob
            arrays |= {f"{r['id']}/reply": np.asarray(r["reply"], np.int32), f"{r['id']}/ids": ids}
            arrays |= {f"{r['id']}/lps": lps, f"{r['id']}/own": mine}
    return arrays


if __name__ == "__main__":
    app()
