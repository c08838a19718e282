"""Requests of the edge's OpenAI-compatible API (``edge.api.http_api``): their pydantic models and
their conversion into a ``ChatTurn``.

The models accept the fields of OpenAI's API for ``/v1/chat/completions`` and ``/v1/completions``,
vLLM's extras tandem honours and tandem's own (``mode``, ``split_layer``, ``session_id``); a field
they do not know is refused (400 ``unknown_parameter`` naming it), except the OpenAI fields that
change nothing tandem does and are accepted and ignored by design (``IGNORED_FIELDS``, listed in
docs/clients.md). Every string of a body is text (``common.protocol.text``), checked before any other
validation. Conversion refuses what the edge cannot honour (``ApiError``, OpenAI's shape: ``param``
names the parameter, ``code`` is OpenAI's, see ``edge.api.errors``); the checks a field shares
with the gRPC API (roles, stop strings, session ids, sampling, limits) are the same functions
(``edge.events``, ``common.protocol.limits``), so both give one verdict.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from tandem.common.protocol.limits import DecimalRange, IntegerRange, check_range
from tandem.common.protocol.params import MAX_STOP_TOKENS, Sampling
from tandem.common.protocol.text import find_non_text
from tandem.edge.api.errors import ApiError, param_path
from tandem.edge.events import chat_role, check_stops
from tandem.ranges import MAX_NEW_TOKENS, carried_top_k

Ignored = Any  # an OpenAI field accepted and ignored by design: it changes nothing tandem does
PENALTY_RANGE = DecimalRange(-2.0, 2.0)  # presence_penalty, frequency_penalty: OpenAI's and vLLM's range
CHOICES = IntegerRange(1, 128)  # n: OpenAI's range (this server returns one choice: more is refused as unsupported)

# the OpenAI fields accepted and ignored by design, per object (docs/clients.md lists them)
IGNORED_FIELDS = {
    "request": ("metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "parallel_tool_calls"),
    "message": ("name",),
    "stream_options": ("include_obfuscation",),
}


class _Closed(BaseModel):
    # a field this API does not know is refused (unknown_parameter); a value of another JSON type is
    # refused too (invalid_type: "5" is not an integer, 1 not a boolean), as OpenAI's API and the SDK do
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Closed):
    include_usage: bool = False
    include_obfuscation: Ignored = None


class ChatMessage(_Closed):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: Ignored = None
    tool_calls: list[Any] | None = None  # refused when present (``chat_messages``)
    tool_call_id: str | None = None  # a tool message's: its role is refused


class RequestBase(_Closed):
    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        """Every string of the body (keys, extra fields, content parts) is text (``common.protocol.text``)."""
        found = find_non_text(data)
        if found is not None:
            path, problem = found
            raise PydanticCustomError("not_text", "not valid text: {problem}", {"path": path, "problem": problem})
        return data

    model: str
    # numbers: their ranges are checked as over gRPC and by the SDK (``tandem.ranges``), so NaN, +/-inf
    # and values out of range get one message and code on every surface
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1  # at least 1 (``check_range``, as every integer), and only 1 is served
    user: str | None = Field(None, max_length=256)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM-style extras
    top_k: int | None = None  # -1 and 0: off
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKENS)
    session_id: str | None = None  # at most 128 bytes (``check_session_id``, as over gRPC)
    # tandem's serving mode (``ChatRequest.mode`` of the gRPC API); "auto" lets the edge choose
    mode: Literal["auto", "local", "split", "direct", "remote_prefill"] = "auto"
    split_layer: int = 0  # with mode split: the k to use (0: the edge's choice); checked as over gRPC
    # OpenAI's fields accepted and ignored by design (``IGNORED_FIELDS``)
    metadata: Ignored = None
    store: Ignored = None
    service_tier: Ignored = None
    prompt_cache_key: Ignored = None
    safety_identifier: Ignored = None
    parallel_tool_calls: Ignored = None


# OpenAI's chat fields tandem cannot honour: refused when given (400 ``unsupported_parameter``)
UNSUPPORTED_CHAT_FIELDS = (
    "tool_choice",
    "function_call",
    "audio",
    "modalities",
    "prediction",
    "reasoning_effort",
    "verbosity",
    "web_search_options",
)


class ChatRequest(RequestBase):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    tool_choice: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None


class CompletionRequest(RequestBase):
    prompt: Any
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


# --- request -> turn ------------------------------------------------------------------------------


def owner_tag(secret: bytes, api_key: str) -> str:
    """8 hex digits naming an API key among a conversation id's 32 (who may end it)."""
    return hmac.new(secret, b"owner\x00" + api_key.encode(), hashlib.sha256).hexdigest()[:8]


def conversation_session_id(secret: bytes, parts: Sequence[str]) -> str:
    """The edge session of a conversation named by ``parts`` (see ``edge.api.http_api``; ``parts[1]``
    is the API key): ``oai:``, the key's ``owner_tag``, then 24 hex digits of the conversation's HMAC."""
    digest = hmac.new(secret, json.dumps(list(parts)).encode(), hashlib.sha256).hexdigest()
    return "oai:" + owner_tag(secret, parts[1] if len(parts) > 1 else "") + digest[:24]


def owned_by(secret: bytes, session_id: str, api_key: str) -> bool:
    """Whether ``session_id`` is a conversation of ``api_key`` (``conversation_session_id``)."""
    return (
        len(session_id) == 36
        and session_id.startswith("oai:")
        and hmac.compare_digest(session_id[4:12], owner_tag(secret, api_key))
    )


def _at(*loc: str | int) -> str:
    return param_path(loc) or ""


def _refuse(param: str, message: str, code: str = "unsupported_parameter") -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code=code)


def refuse_unsupported(r: RequestBase) -> None:
    """Raises ApiError for what both endpoints know but cannot honour, InvalidRequest for a penalty
    outside ``PENALTY_RANGE`` (NaN, +/-inf among them; checked before "only 0") or an ``n`` outside
    ``CHOICES`` (checked before "only 1")."""
    if r.n is not None:
        check_range(CHOICES, "n", r.n)
    if r.n not in (None, 1):
        raise _refuse("n", "must be 1: this server returns one choice per request", "unsupported_value")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(r, name)
        if value is not None:
            check_range(PENALTY_RANGE, name, value)
        if value:
            raise _refuse(name, "is not supported (only 0)", "unsupported_value")
    if r.logit_bias:
        raise _refuse("logit_bias", "is not supported")
    if isinstance(r, ChatRequest):
        if r.logprobs or r.top_logprobs:
            raise _refuse("logprobs" if r.logprobs else "top_logprobs", "log probabilities are not supported")
        if r.tools or r.functions:
            raise _refuse("tools" if r.tools else "functions", "tools and functions are not supported")
        for name in UNSUPPORTED_CHAT_FIELDS:
            if getattr(r, name) is not None:
                raise _refuse(name, "is not supported by this server")
        if r.response_format and r.response_format.get("type", "text") != "text":
            raise _refuse("response_format.type", "only the text response format is supported", "unsupported_value")
    elif isinstance(r, CompletionRequest):
        for name, bad in (
            ("echo", bool(r.echo)),
            ("logprobs", r.logprobs is not None),
            ("best_of", r.best_of not in (None, 1)),
            ("suffix", bool(r.suffix)),
        ):
            if bad:
                raise _refuse(name, "is not supported by this server")


def stops(stop: str | list[str] | None) -> tuple[str, ...]:
    """The stop strings (``edge.events.check_stops``, as over gRPC). Raises InvalidRequest."""
    return check_stops((stop,) if isinstance(stop, str) else tuple(stop or ()), one=isinstance(stop, str))


def sampling(r: RequestBase, max_tokens: int | None, default_max: int, limit: int, param: str) -> Sampling:
    """The turn's sampling; its values are checked with the turn (``edge.validation``), as over gRPC.

    Raises:
        InvalidRequest: ``max_tokens`` (named ``param``) outside ``[1, limit]``, worded as the gRPC
            API words ``max_new_tokens`` (``tandem.ranges``).
    """
    n = default_max if max_tokens is None else max_tokens
    check_range(MAX_NEW_TOKENS.below(limit), param, n)
    return Sampling(
        max_new_tokens=n,
        temperature=1.0 if r.temperature is None else r.temperature,
        top_p=1.0 if r.top_p is None else r.top_p,
        top_k=carried_top_k(r.top_k or 0),  # vLLM's -1 and tandem's 0 both mean off
        seed=r.seed,
        stop_token_ids=tuple(r.stop_token_ids or ()),
        ignore_eos=r.ignore_eos,
    )


def _text_of(i: int, m: ChatMessage) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    texts = []
    for j, part in enumerate(m.content):
        if part.get("type") != "text":
            where = _at("messages", i, "content", j, "type")
            raise _refuse(where, "only text content parts are supported", "unsupported_value")
        if not isinstance(part.get("text"), str):
            where = _at("messages", i, "content", j, "text")
            raise _refuse(where, "a text content part needs its text, a string", "invalid_type")
        texts.append(part["text"])
    return "\n".join(texts)  # vLLM's join of text parts


def chat_messages(r: ChatRequest) -> tuple[tuple[str, str], ...]:
    """(role, text) pairs; developer messages are system messages (``edge.events.chat_role``, as over
    gRPC). Raises InvalidRequest for other roles, ApiError for tool calls or non-text content."""
    out = []
    for i, m in enumerate(r.messages):
        role = chat_role(m.role, i)
        if m.tool_calls:
            raise _refuse(_at("messages", i, "tool_calls"), "tool calls are not supported")
        out.append((role, _text_of(i, m)))
    return tuple(out)


def chat_opening(messages: Sequence[tuple[str, str]]) -> list[str]:
    system = next((c for r, c in messages if r == "system"), "")
    user = next((c for r, c in messages if r == "user"), "")
    return [system, user]


def prompt_of(r: CompletionRequest) -> str:
    """The prompt: a string, or a list of one string. Raises ApiError otherwise, or if it is empty."""
    p = r.prompt
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if not isinstance(p, str):
        raise _refuse("prompt", "must be a string (token ids and batches of prompts are not supported)", "invalid_type")
    if not p:
        raise _refuse("prompt", "is empty", "invalid_value")
    return p
