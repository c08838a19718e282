"""Unsplit references for equivalence tests: the HF model's and plain vLLM's greedy tokens with each
step's top-2 log-prob gap, the rule that two greedy outputs agree (equal, or parting only at a near-tie
of the reference), and the prompts the equivalence tests run."""

from __future__ import annotations

import uuid

import numpy as np
import torch

from tandem.common.protocol.chat import prompt_token_ids

NEAR_TIE = 1e-3  # top-1 minus top-2 log-prob below which a reference's greedy choice is a near-tie
MAX_NEW = 32

LONG = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based inks and a screw press adapted from wine making. Before that, books were "
    "copied by hand in monasteries and workshops, which made them rare and expensive. Within fifty years "
    "printing shops had spread to more than two hundred cities across Europe, and millions of volumes were in "
    "circulation. Scholars could compare identical copies, errors could be corrected in later editions, and "
    "new ideas travelled faster than ever. The Reformation, the scientific revolution and the growth of "
    "literacy all drew on this new technology. Newspapers, pamphlets and maps followed, and printers became "
    "important figures in the life of their towns. Governments soon tried to license presses and censor "
    "what they printed, while readers formed clubs and libraries to share the growing number of books. By the "
    "eighteenth century, cheap printed material had changed how people learned, worked and argued in public. "
)
PROMPTS = [
    {"prompt": "The capital of France is"},  # raw prompt, shorter than one KV block
    {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {
        "messages": [
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "Give me three tips for writing clear Python code, one line each."},
        ]
    },
    {"messages": [{"role": "user", "content": LONG + "Summarise this text in two sentences."}]},
    {"messages": [{"role": "user", "content": "Write a haiku about the sea and the colour blue."}]},
]


def prompt_ids(tokenizer, p: dict) -> list[int]:
    return prompt_token_ids(tokenizer, p.get("messages"), p.get("prompt"))


def hf_greedy(model, ids: list[int], n: int, use_cache: bool = True) -> tuple[list[int], list[float]]:
    """Reference tokens and, per step, the top-1 minus top-2 log-prob gap. ``use_cache=False``: each
    step a forward over the whole sequence (HF's generate builds its cache from the config, e.g.
    sliding-window layers from a ``sliding_window`` that the model's attention ignores)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            use_cache=use_cache,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=model.config.eos_token_id,
        )
    toks = out.sequences[0, len(ids) :].tolist()
    gaps = [float(g[0] - g[1]) for g in (torch.log_softmax(s[0], -1).topk(2).values for s in out.scores)]
    return toks, gaps


async def vllm_plain(engines, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """Plain vLLM on the full checkpoint (no connector params) with top-2 log-probs."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=n, temperature=0, logprobs=2)
    final = None
    async for out in engines.decode_engine.generate({"prompt_token_ids": ids}, sp, f"plain-{uuid.uuid4().hex}"):
        final = out
    c = final.outputs[0]
    gaps = [sorted((lp.logprob for lp in step.values()), reverse=True) for step in c.logprobs]
    return list(c.token_ids), [g[0] - g[1] if len(g) > 1 else float("inf") for g in gaps]


def assert_same_or_near_tie(
    got: list[int], ref: list[int], gaps: list[float], what: str, near: float = NEAR_TIE
) -> None:
    """``got`` equals ``ref``, or parts from it first where the reference's top-2 log-prob gap is
    below ``near`` (wider for arithmetic coarser than the reference's, such as fp16)."""
    for i, (a, b) in enumerate(zip(got, ref, strict=False)):
        if a != b:
            assert gaps[i] < near, (
                f"{what}: token {i} is {a}, reference {b}; reference top-2 gap {gaps[i]:.2e} is not a near-tie"
            )
            return
    assert len(got) == len(ref), f"{what}: {len(got)} tokens vs reference {len(ref)}"


HEAD_RTOL = 2e-5  # max |ort - hf| / max |hf| of an fp32 head; measured ~5e-6 for h_4 of SmolLM2 on CPU


def hf_head_run(model, ids: list[int], k: int) -> tuple[np.ndarray, np.ndarray]:
    """HF's reference of a head of ``k`` layers on ``ids``: the residual entering layer ``k``
    float32 ``[T, H]`` and the KV of layers ``[0, k)`` float32 ``[k, 2, Hkv, T, D]`` (keys after RoPE)."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True, use_cache=True)
    cache = out.past_key_values.layers
    kv = np.stack([np.stack([cache[i].keys[0].numpy(), cache[i].values[0].numpy()]) for i in range(k)])
    return out.hidden_states[k][0].numpy(), kv


def head_close(a: np.ndarray, b: np.ndarray, rtol: float = HEAD_RTOL) -> bool:
    """Whether ``a`` is within ``rtol`` of the reference ``b``'s largest magnitude everywhere."""
    return bool(np.abs(a - b).max() / np.abs(b).max() < rtol)
