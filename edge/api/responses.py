"""Responses of the edge's OpenAI-compatible API (``edge.api.http_api``): OpenAI's shapes of a
completion, a stream chunk and usage, with tandem's ``tandem`` field on the last one."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from tandem.common.protocol import errors as e
from tandem.edge.events import ChatTurn, TextOut, TurnDone
from tandem.stages import timings_to_wire


def usage_of(done: TurnDone) -> dict[str, int]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.output_tokens,
        "total_tokens": done.prompt_tokens + done.output_tokens,
    }


def finish_reason(done: TurnDone) -> str:
    return done.finish_reason if done.finish_reason in ("stop", "length") else "stop"


def tandem_extra(done: TurnDone, session_id: str) -> dict[str, Any]:
    return {
        "session_id": session_id,
        "mode": done.mode,
        "mode_reason": done.mode_reason,
        "predicted_ttft_ms": done.predicted_ttft_ms,
        "split_layer": done.split_layer,
        "head_tokens": done.head_tokens,
        "external_tokens": done.external_tokens,
        "timings_ms": timings_to_wire(done.timings),
        "sent_bytes": done.wire_sent_bytes(),
        "received_bytes": done.wire_received_bytes(),
        "edge_decoded_tokens": done.edge_decoded_tokens,
        "resumes": done.resumes,
        "session_expired": done.session_expired,
    }


@dataclass(frozen=True)
class Call:
    """One request, as the response builders need it."""

    chat: bool  # /v1/chat/completions, else /v1/completions
    id: str
    created: int
    model: str
    turn: ChatTurn
    include_usage: bool
    max_tokens_param: str = "max_tokens"  # the request's name for ``max_new_tokens`` (or max_completion_tokens)

    @property
    def renamed(self) -> dict[str, str]:
        """The domain's field names that this request names otherwise (``edge.api.errors.api_error_of``)."""
        return {"max_new_tokens": self.max_tokens_param}

    def base(self, chunk: bool = False) -> dict[str, Any]:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        out: dict[str, Any] = {"id": self.id, "object": obj, "created": self.created, "model": self.model}
        if self.chat:
            out["system_fingerprint"] = None
        return out

    def response(self, text: str, done: TurnDone) -> dict[str, Any]:
        reason = finish_reason(done)
        if self.chat:
            message = {"role": "assistant", "content": text, "refusal": None}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        extra = tandem_extra(done, self.turn.session_id)
        return {**self.base(), "choices": [choice], "usage": usage_of(done), "tandem": extra}

    def chunk(self, piece: dict[str, Any] | str, finish: str | None = None) -> dict[str, Any]:
        """A stream chunk: a chat ``delta`` dict or a completion's text."""
        if self.chat:
            choice = {"index": 0, "delta": piece, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": finish}
        out = {**self.base(chunk=True), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def collect(events: AsyncGenerator[TextOut | TurnDone, None]) -> tuple[str, TurnDone]:
    parts: list[str] = []
    done: TurnDone | None = None
    async with contextlib.aclosing(events):
        async for ev in events:
            if isinstance(ev, TextOut):
                parts.append(ev.text)
            else:
                done = ev
    if done is None:
        raise e.TandemError("the turn ended without a final event")
    return "".join(parts), done
