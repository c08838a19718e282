"""An OpenAI-compatible HTTP API on the edge, over ``EdgeService.chat``.

Endpoints (FastAPI, served by uvicorn in the edge's event loop; see ``serve_openai``):

- ``GET /v1/models``, ``GET /v1/models/{id}``: the one model this edge serves, ``owned_by: "tandem"``.
- ``POST /v1/chat/completions``: ``messages`` (roles system/developer/user/assistant; content a string or a
  list of ``{"type": "text"}`` parts), ``max_completion_tokens`` / ``max_tokens`` (default: the link's
  ``max_new_tokens``), ``temperature`` (default 1, OpenAI's), ``top_p``, ``seed``, ``stop``, ``stream``,
  ``stream_options.include_usage``, ``user``; ``n`` must be 1.
- ``POST /v1/completions``: ``prompt`` a string (or a list of one string); same sampling (``max_tokens``
  defaults to 16, OpenAI's); ``echo``, ``logprobs``, ``best_of`` > 1 and ``suffix`` are refused.

vLLM-style extras (``extra_body`` in the openai client): ``top_k``, ``ignore_eos``, ``stop_token_ids``,
and ``session_id`` (names the conversation explicitly, see below). Fields this API does not know are
ignored; fields it knows but cannot honour (tools, logprobs, penalties, logit_bias, non-text
response formats or content parts) are refused with 400 rather than silently ignored.

Responses have OpenAI's shapes (``chat.completion``, ``chat.completion.chunk``, ``text_completion``,
``usage``, ``finish_reason`` stop|length). Streams are server-sent events ``data: {json}`` ending with
``data: [DONE]``; the first chat chunk carries ``delta.role``; with ``include_usage`` every chunk has
``usage: null`` and a last chunk with no choices carries the usage. An error after the stream began
is sent as ``data: {"error": ...}`` (the openai client raises ``APIError``). A client that goes away
ends the turn: the edge's turn generator is closed, which cancels the call to the cloud (streaming or
not). The last response / chunk with a ``finish_reason`` has a non-standard field ``tandem``
(``session_id``, ``mode``, ``predicted_ttft_ms``, ``split_layer``, ``head_tokens``, ``external_tokens``,
``timings_ms``, ``sent_bytes``);
OpenAI clients ignore it (``response.model_extra["tandem"]``). Every response has the header
``x-tandem-session``.

Errors: ``{"error": {"message", "type", "param", "code"}}``. Tandem's domain errors map to statuses
(``InvalidRequest`` 400, ``QuotaExceeded`` 429, ``EngineError`` 503, ``UploadTimeout`` /
``DeadlineExceeded`` 504, the rest 500; ``code`` is the error's class name); request validation errors
are 400 (not FastAPI's 422); an unknown model is 404; with ``api_keys`` set, a missing or wrong
``Authorization: Bearer`` key is 401 (keys compared in constant time).

Sessions map onto the conversation. OpenAI clients resend the whole conversation every turn and name
no session, so the edge derives one from the conversation's opening:

    session_id = "oai:" + HMAC-SHA256(secret, json([endpoint, api key, user, explicit session_id,
                                                    opening]))[:32 hex]

where, for chat, ``opening`` is the first system (or developer) message and the first user message,
and for completions the first 64 characters of the prompt; an explicit ``session_id`` (extra field)
replaces the opening. The next turn of the same conversation (same opening, more messages) lands in
the same edge session, whose common-prefix logic runs the head only over the new tokens and sends the
cloud only what it lacks; ``user`` and the API key scope sessions, so different users or keys never
share one. ``secret`` is random per app unless given (``session_secret``), so the ids the cloud sees
reveal nothing about keys or text, and sessions do not outlive the edge process (edge sessions are in
memory anyway).

Limits of the rule, none of which can give a wrong answer (the edge compares token ids and recomputes
from the longest common prefix; the cloud's copy is resent from token 0 when it no longer matches):

- Two conversations with the same opening share a session: when they alternate, each turn finds the
  other's tokens past the common opening and recomputes (a resend, as a first turn would cost).
- A turn of a session that another turn is using right now runs stateless (full head, nothing kept)
  instead of waiting for it, so identical concurrent requests do not serialize.
- A completion prompt shorter than 64 characters that later grows changes its opening (a missed reuse).
- A changed system prompt starts a new session; the old one ages out of the edge's LRU.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import hmac
import json
import logging
import secrets
import socket
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, cast

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from tandem.common import errors as e
from tandem.common.logs import set_ids
from tandem.common.params import MAX_STOP_TOKENS, Sampling
from tandem.common.text import check_text, find_non_text
from tandem.edge.detok import MAX_STOP_CHARS, MAX_STOP_STRINGS
from tandem.edge.events import ChatTurn, TextOut, TurnDone
from tandem.edge.service import EdgeService
from tandem.stages import timings_to_wire

log = logging.getLogger("tandem.edge.openai")

OPENING_CHARS = 64  # characters of a completion prompt that name its session
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions
ROLE_OF = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
T = TypeVar("T")


# ---------------------------------------------------------------- errors


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# most specific first: the first class in an error's MRO found here decides
STATUS_OF: dict[type[e.TandemError], tuple[int, str]] = {
    e.CorruptPayload: (500, "server_error"),  # the edge's own payload, not the client's request
    e.InvalidRequest: (400, "invalid_request_error"),
    e.QuotaExceeded: (429, "rate_limit_error"),
    e.EngineError: (503, "service_unavailable_error"),
    e.UploadTimeout: (504, "timeout_error"),  # DeadlineExceeded too
}


def api_error_of(err: e.TandemError) -> ApiError:
    """The HTTP status and OpenAI error type of a domain error (500 server_error if unmapped)."""
    status, type_ = next((STATUS_OF[c] for c in type(err).__mro__ if c in STATUS_OF), (500, "server_error"))
    return ApiError(status, str(err) or type(err).__name__, type_, None, type(err).__name__)


MAX_BODY_BYTES = 4 << 20  # as the edge's gRPC message limit: a conversation of a few MB of text


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` (announced or streamed) is answered 413 in
    OpenAI's shape before it is buffered, so request size never sets the edge's memory."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self._too_large(scope, receive, send)
        seen = 0

        async def limited() -> Any:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise ApiError(413, f"request body over {self.max_bytes} bytes")
            return message

        await self.app(scope, limited, send)

    async def _too_large(self, scope: Any, receive: Any, send: Any) -> None:
        err = ApiError(413, f"request body over {self.max_bytes} bytes")
        await _error_response(err)(scope, receive, send)


def _error_response(err: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def _validation_error(exc: RequestValidationError) -> ApiError:
    errs = list(exc.errors())
    if not errs:
        return ApiError(400, "invalid request")
    first = errs[0]
    loc = [str(x) for x in first.get("loc", ())]
    if first.get("type") == "not_text":  # found anywhere in the body: its own path
        loc = ["body", *(str(x) for x in first["ctx"]["path"])]
    param = ".".join(loc[1:] if loc and loc[0] == "body" else loc) or None
    more = f" (and {len(errs) - 1} more errors)" if len(errs) > 1 else ""
    msg = first.get("msg", "invalid value")
    return ApiError(400, f"{param}: {msg}{more}" if param else f"{msg}{more}", param=param, code="invalid_value")


# ---------------------------------------------------------------- request models


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # fields this API does not know are ignored


class StreamOptions(_Open):
    include_usage: bool = False


class ChatMessage(_Open):
    role: str
    content: str | list[dict[str, Any]] | None = None


class _Common(_Open):
    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        """Every string of the body (keys, extra fields, content parts) is text (``common.text``)."""
        found = find_non_text(data)
        if found is not None:
            path, problem = found
            raise PydanticCustomError("not_text", "not valid text: {problem}", {"path": path, "problem": problem})
        return data

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    user: str | None = Field(None, max_length=256)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM-style extras
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0, le=2**32 - 1)]] | None = Field(None, max_length=MAX_STOP_TOKENS)
    session_id: str | None = Field(None, max_length=128)
    # tandem's serving mode (``ChatRequest.mode`` of the gRPC API); "auto" lets the edge choose
    mode: Literal["auto", "local", "split", "direct"] = "auto"


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Common):
    prompt: Any
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


# ---------------------------------------------------------------- request -> turn


def conversation_session_id(secret: bytes, parts: Sequence[str]) -> str:
    """The edge session of a conversation named by ``parts`` (see the module docstring)."""
    digest = hmac.new(secret, json.dumps(list(parts)).encode(), hashlib.sha256).hexdigest()
    return "oai:" + digest[:32]


def _refuse_unsupported(r: _Common) -> None:
    if r.n not in (None, 1):
        raise ApiError(400, "n must be 1: this server returns one choice per request", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(r, name):
            raise ApiError(400, f"{name} is not supported (only 0)", param=name)
    if r.logit_bias:
        raise ApiError(400, "logit_bias is not supported", param="logit_bias")


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(
            400, f"stop: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters", param="stop"
        )
    return tuple(s for s in stops if s)


def _sampling(r: _Common, max_tokens: int | None, default_max: int, limit: int, param: str) -> Sampling:
    n = default_max if max_tokens is None else max_tokens
    if n > limit:
        raise ApiError(400, f"{param} is {n}; this edge allows at most {limit}", param=param)
    return Sampling(
        max_new_tokens=n,
        temperature=1.0 if r.temperature is None else r.temperature,
        top_p=1.0 if r.top_p is None else r.top_p,
        top_k=max(0, r.top_k or 0),  # vLLM's -1 and tandem's 0 both mean off
        seed=r.seed,
        stop_token_ids=tuple(r.stop_token_ids or ()),
        ignore_eos=r.ignore_eos,
    )


def _text_of(i: int, m: ChatMessage) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    texts = []
    for j, part in enumerate(m.content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError(400, "only text content parts are supported", param=f"messages.{i}.content.{j}")
        texts.append(part["text"])
    return "\n".join(texts)  # vLLM's join of text parts


def chat_messages(r: ChatRequest) -> tuple[tuple[str, str], ...]:
    """(role, text) pairs; developer messages are system messages. Raises ApiError for other roles,
    tool calls, or non-text content."""
    out = []
    for i, m in enumerate(r.messages):
        if m.role not in ROLE_OF:
            raise ApiError(400, f"message role {m.role!r} is not supported (system, user, assistant)", f"messages.{i}")
        if (m.model_extra or {}).get("tool_calls"):
            raise ApiError(400, "tool calls are not supported", param=f"messages.{i}.tool_calls")
        out.append((ROLE_OF[m.role], _text_of(i, m)))
    return tuple(out)


def _chat_opening(messages: Sequence[tuple[str, str]]) -> list[str]:
    system = next((c for r, c in messages if r == "system"), "")
    user = next((c for r, c in messages if r == "user"), "")
    return [system, user]


def _prompt_of(r: CompletionRequest) -> str:
    p = r.prompt
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if not isinstance(p, str):
        raise ApiError(400, "prompt must be a string (token ids and batches of prompts are not supported)", "prompt")
    return p


# ---------------------------------------------------------------- responses


def usage_of(done: TurnDone) -> dict[str, int]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.output_tokens,
        "total_tokens": done.prompt_tokens + done.output_tokens,
    }


def _finish_reason(done: TurnDone) -> str:
    return done.finish_reason if done.finish_reason in ("stop", "length") else "stop"


def tandem_extra(done: TurnDone, session_id: str) -> dict[str, Any]:
    return {
        "session_id": session_id,
        "mode": done.mode,
        "predicted_ttft_ms": done.predicted_ttft_ms,
        "split_layer": done.split_layer,
        "head_tokens": done.head_tokens,
        "external_tokens": done.external_tokens,
        "timings_ms": timings_to_wire(done.timings),
        "sent_bytes": dict(done.sent_bytes),
    }


@dataclass(frozen=True)
class _Call:
    """One request, as the response builders need it."""

    chat: bool  # /v1/chat/completions, else /v1/completions
    id: str
    created: int
    model: str
    turn: ChatTurn
    include_usage: bool

    def base(self, chunk: bool = False) -> dict[str, Any]:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        out: dict[str, Any] = {"id": self.id, "object": obj, "created": self.created, "model": self.model}
        if self.chat:
            out["system_fingerprint"] = None
        return out

    def response(self, text: str, done: TurnDone) -> dict[str, Any]:
        reason = _finish_reason(done)
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


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


# ---------------------------------------------------------------- streaming and disconnects


class ClientGone(Exception):
    """The client closed the connection before the answer was ready."""


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, aw: Awaitable[T], ctx: contextvars.Context | None = None) -> T:
    """``aw``'s result, or ``ClientGone`` (``aw`` cancelled) if the client disconnects first. ``aw``
    runs in ``ctx`` when given (a turn's steps share one context: its log ids, its cloud replica)."""
    task: asyncio.Task[T] = asyncio.get_running_loop().create_task(aw, context=ctx)  # type: ignore[arg-type]
    watch = asyncio.create_task(_until_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this request is cancelled (server shutting down): stop the turn too
        watch.cancel()
        task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(task, return_exceptions=True)
        raise
    watch.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise ClientGone
    return task.result()


class EventStream(StreamingResponse):
    """SSE response that closes its generators when the response ends, however it ends (a client that
    disconnects cancels the sending task, leaving the generators suspended otherwise)."""

    def __init__(
        self,
        body: AsyncGenerator[str, None],
        events: AsyncGenerator[Any, None],
        headers: dict[str, str],
        on_close: Callable[[], None],
    ) -> None:
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self._body, self._events, self._on_close = body, events, on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._body.aclose()
                await self._events.aclose()
            finally:
                self._on_close()


async def _sse_body(
    call: _Call, first: TextOut | TurnDone, events: AsyncGenerator[Any, None], ctx: contextvars.Context
) -> AsyncGenerator[str, None]:
    try:
        if call.chat:
            yield _sse(call.chunk({"role": "assistant", "content": ""}))
        ev: TextOut | TurnDone | None = first
        while ev is not None:
            if isinstance(ev, TextOut):
                yield _sse(call.chunk({"content": ev.text} if call.chat else ev.text))
            else:
                last = call.chunk({} if call.chat else "", _finish_reason(ev))
                last["tandem"] = tandem_extra(ev, call.turn.session_id)
                yield _sse(last)
                if call.include_usage:
                    yield _sse({**call.base(chunk=True), "choices": [], "usage": usage_of(ev)})
                break
            ev = await asyncio.get_running_loop().create_task(anext(events, None), context=ctx)
    except e.TandemError as err:
        yield _sse(api_error_of(err).body())
    except Exception:
        log.exception("OpenAI stream failed")
        yield _sse(ApiError(500, "internal error in the edge (see its log)", "server_error").body())
    finally:
        await events.aclose()
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------- the app


class _Api:
    def __init__(self, service: EdgeService, model_id: str, session_secret: bytes) -> None:
        self.service, self.model_id, self.secret = service, model_id, session_secret
        self.created = int(time.time())
        self.busy: set[str] = set()  # sessions a turn of this API is using

    def model_card(self) -> dict[str, Any]:
        svc = self.service
        return {
            "id": self.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "tandem",
            "tandem": {
                "split_layer": max(svc.split_layers, default=0),
                "split_layers": list(svc.split_layers),
                "modes": sorted({r.mode for r in svc.routes()}),
                "max_prompt_tokens": svc.max_prompt_tokens,
                "max_new_tokens": svc.max_new_tokens,
            },
        }

    def check_model(self, model: str) -> None:
        check_text(model, "model")
        if model != self.model_id:
            raise ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    def session_for(self, parts: list[str]) -> str:
        """The conversation's session, reserved for this turn until ``release``; "" (stateless) while
        another turn of it is running, so identical concurrent requests do not queue for the session."""
        sid = conversation_session_id(self.secret, parts)
        s = self.service.sessions.peek(sid)
        if sid in self.busy or (s is not None and s.lock.locked()):
            return ""
        self.busy.add(sid)
        return sid

    def release(self, call: _Call) -> None:
        self.busy.discard(call.turn.session_id)

    def chat_call(self, r: ChatRequest, key: str) -> _Call:
        self.check_model(r.model)
        _refuse_unsupported(r)
        if r.logprobs or r.top_logprobs:
            raise ApiError(400, "logprobs are not supported", param="logprobs")
        if r.tools or r.functions:
            raise ApiError(400, "tools and functions are not supported", param="tools")
        if r.response_format and r.response_format.get("type", "text") != "text":
            raise ApiError(400, "only the text response format is supported", param="response_format")
        messages = chat_messages(r)
        max_new = self.service.max_new_tokens
        max_tokens, param = (
            (r.max_completion_tokens, "max_completion_tokens")
            if r.max_completion_tokens is not None
            else (r.max_tokens, "max_tokens")
        )
        sampling = _sampling(r, max_tokens, max_new, max_new, param)
        opening = [""] * 2 if r.session_id else _chat_opening(messages)
        stop = _stops(r.stop)
        sid = self.session_for(["chat", key, r.user or "", r.session_id or "", *opening])
        turn = ChatTurn(messages, "", sid, sampling, mode=r.mode, stop=stop)
        return self._call(True, turn, r)

    def completion_call(self, r: CompletionRequest, key: str) -> _Call:
        self.check_model(r.model)
        _refuse_unsupported(r)
        for name, bad in (
            ("echo", bool(r.echo)),
            ("logprobs", r.logprobs is not None),
            ("best_of", r.best_of not in (None, 1)),
            ("suffix", bool(r.suffix)),
        ):
            if bad:
                raise ApiError(400, f"{name} is not supported by this server", param=name)
        prompt = _prompt_of(r)
        if not prompt:
            raise ApiError(400, "prompt is empty", param="prompt")
        max_new = self.service.max_new_tokens
        default_max = min(COMPLETIONS_DEFAULT_MAX_TOKENS, max_new)
        sampling = _sampling(r, r.max_tokens, default_max, max_new, "max_tokens")
        opening = "" if r.session_id else prompt[:OPENING_CHARS]
        stop = _stops(r.stop)
        sid = self.session_for(["text", key, r.user or "", r.session_id or "", opening])
        turn = ChatTurn((), prompt, sid, sampling, mode=r.mode, stop=stop)
        return self._call(False, turn, r)

    def _call(self, chat: bool, turn: ChatTurn, r: _Common) -> _Call:
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        usage = bool(r.stream and r.stream_options and r.stream_options.include_usage)
        return _Call(chat, rid, int(time.time()), self.model_id, turn, usage)

    async def answer(self, call: _Call, stream: bool, request: Request) -> Response:
        """Run the turn (its session reserved until it ends) and answer in OpenAI's shape."""
        set_ids(call.id, call.turn.session_id)  # this request's own task: log lines carry the response's id
        headers = {"x-tandem-session": call.turn.session_id}
        events = cast(AsyncGenerator[TextOut | TurnDone, None], self.service.chat(call.turn))
        if not stream:
            try:
                text, done = await unless_disconnected(request, _collect(events))
            finally:
                await events.aclose()
                self.release(call)
            return JSONResponse(call.response(text, done), headers=headers)
        ctx = contextvars.copy_context()  # every step of the turn runs in it, whichever task drives it
        try:  # the first event before the headers: errors before any output get their HTTP status
            first = await unless_disconnected(request, anext(events), ctx)
        except BaseException:
            await events.aclose()
            self.release(call)
            raise
        headers |= {"cache-control": "no-cache", "x-accel-buffering": "no"}
        return EventStream(_sse_body(call, first, events, ctx), events, headers, lambda: self.release(call))


async def _collect(events: AsyncGenerator[TextOut | TurnDone, None]) -> tuple[str, TurnDone]:
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


def _bearer_check(api_keys: Sequence[str]):
    keys = [k.encode() for k in api_keys]

    async def bearer(request: Request) -> str:
        """The presented API key ("" if none); 401 if keys are configured and it is not one of them."""
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        presented = token.strip() if scheme.lower() == "bearer" else ""
        if keys:
            ok = False
            for k in keys:  # every key, constant time each: the match's position does not leak
                ok |= hmac.compare_digest(presented.encode(), k)
            if not ok:
                raise ApiError(
                    401, "Incorrect or missing API key (Authorization: Bearer <key>)", code="invalid_api_key"
                )
        return presented

    return bearer


def create_openai_app(
    service: EdgeService, model_id: str, api_keys: Sequence[str] = (), *, session_secret: bytes | None = None
) -> FastAPI:
    """The OpenAI-compatible API over ``service`` (see the module docstring). ``session_secret`` keys
    the derived session ids (random per app if not given)."""
    api = _Api(service, model_id, session_secret or secrets.token_bytes(32))
    app = FastAPI(title="tandem edge (OpenAI-compatible)", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.tandem = api
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
    auth = Depends(_bearer_check(api_keys))

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        headers = {"www-authenticate": "Bearer"} if exc.status == 401 else None
        return _error_response(exc, headers)

    @app.exception_handler(e.TandemError)
    async def _tandem_error(request: Request, exc: e.TandemError) -> Response:
        return _error_response(api_error_of(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        return _error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error_response(ApiError(exc.status_code, str(exc.detail), type_), dict(exc.headers or {}))

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: nginx's "client closed request"

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        log.exception("OpenAI API request failed", exc_info=exc)
        return _error_response(ApiError(500, "internal error in the edge (see its log)", "server_error"))

    @app.get("/v1/models")
    async def list_models(key: str = auth) -> dict[str, Any]:
        return {"object": "list", "data": [api.model_card()]}

    @app.get("/v1/models/{model}")
    async def get_model(model: str, key: str = auth) -> dict[str, Any]:
        api.check_model(model)
        return api.model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request, key: str = auth) -> Response:
        return await api.answer(api.chat_call(body, key), bool(body.stream), request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request, key: str = auth) -> Response:
        return await api.answer(api.completion_call(body, key), bool(body.stream), request)

    return app


# ---------------------------------------------------------------- serving


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the process hosting it (the edge daemon) owns SIGINT/SIGTERM
    and calls ``stop_openai``."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve_openai(
    app: FastAPI, host: str, port: int, *, log_level: str = "warning", tls: tuple[Path, Path] | None = None
) -> tuple[uvicorn.Server, asyncio.Task[None], int]:
    """Serve ``app`` with uvicorn in the running event loop; returns (server, its task, bound port).
    ``port`` 0 = any free port; ``tls`` = (certificate chain file, key file) serves HTTPS. Stop with
    ``stop_openai``.

    Raises:
        OSError: the address cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    bound = int(sock.getsockname()[1])
    config = uvicorn.Config(
        app,
        lifespan="off",
        log_config=None,
        log_level=log_level,
        access_log=False,
        ssl_certfile=str(tls[0]) if tls else None,
        ssl_keyfile=str(tls[1]) if tls else None,
    )
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name=f"openai-api:{bound}")
    while not server.started:
        if task.done():
            sock.close()
            task.result()  # raises what stopped it
            raise RuntimeError("the OpenAI API server stopped while starting")
        await asyncio.sleep(0.01)
    return server, task, bound


async def stop_openai(server: uvicorn.Server, task: asyncio.Task[None], grace_s: float = 5.0) -> None:
    """Stop accepting connections, let requests in flight finish for up to ``grace_s``, then cancel them."""
    server.config.timeout_graceful_shutdown = int(max(1, grace_s))
    server.should_exit = True
    try:
        await asyncio.wait_for(asyncio.shield(task), grace_s + 2.0)
    except TimeoutError:
        server.force_exit = True
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


__all__ = [
    "ApiError",
    "create_openai_app",
    "conversation_session_id",
    "serve_openai",
    "stop_openai",
]
