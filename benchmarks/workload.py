"""Deterministic benchmark prompts: chat messages of a target token length.

No chat data set ships in a PyPI package that fits offline use here, so prompts
are generated from a fixed vocabulary with ``random.Random(seed)``: the same
seed and lengths give the same prompts on every machine.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tandem.common.protocol.chat import prompt_token_ids

WORDS = (
    "network model layer token cache block edge cloud latency request batch stream river mountain city "
    "history science music garden kitchen travel weather market energy health language school water "
    "design number system signal memory paper light sound table window story planet forest engine"
).split()
TASKS = [
    "Summarise these notes in two sentences:",
    "List the three most important points in these notes:",
    "Write a short title for these notes:",
    "Explain these notes to a child:",
]


@dataclass(frozen=True)
class BenchPrompt:
    messages: tuple[tuple[str, str], ...]
    prompt_tokens: int

    def as_messages(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.messages]


def make_prompts(tokenizer, target_tokens: int, count: int, seed: int = 0) -> list[BenchPrompt]:
    """``count`` chat prompts whose templated length is ``target_tokens`` (within a few tokens)."""
    rng = random.Random(seed * 1_000_003 + target_tokens)
    out = []
    for _ in range(count):
        task = rng.choice(TASKS)
        words: list[str] = []
        while True:
            text = task + " " + " ".join(words)
            n = len(prompt_token_ids(tokenizer, [{"role": "user", "content": text}]))
            if n >= target_tokens or len(words) > 4 * target_tokens:
                break
            words.extend(rng.choice(WORDS) for _ in range(max(1, (target_tokens - n) // 2)))
        out.append(BenchPrompt((("user", text),), n))
    return out
