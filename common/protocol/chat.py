"""Prompt tokenization, in one place for the edge, the tests and the benchmarks.

A turn is either chat ``messages`` (the model's chat template, with the generation
prompt appended, as vLLM's ``/v1/chat/completions`` does) or a raw ``prompt``
(tokenized as is, BOS per the tokenizer's settings, as ``/v1/completions`` does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tandem.common.protocol.errors import InvalidRequest


def prompt_token_ids(
    tokenizer: Any, messages: Sequence[Mapping[str, str]] | None = None, prompt: str | None = None
) -> list[int]:
    """Token ids of a turn: exactly one of ``messages`` (``[{"role", "content"}]``) or ``prompt``.

    Raises:
        InvalidRequest: neither or both given, or an empty prompt.
    """
    if bool(messages) == bool(prompt):
        raise InvalidRequest("a turn needs exactly one of messages or a prompt")
    if messages:
        out = tokenizer.apply_chat_template(
            [{"role": m["role"], "content": m["content"]} for m in messages],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        return list(out["input_ids"] if isinstance(out, Mapping) else out)
    return list(tokenizer(prompt)["input_ids"])
