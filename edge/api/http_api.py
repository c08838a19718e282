"""An OpenAI-compatible HTTP API on the edge, over ``EdgeNode.chat``: the FastAPI app, streaming
(server-sent events) and serving (uvicorn in the edge's event loop, ``serve_openai``).

Endpoints: ``GET /v1/models[/{id}]``, ``POST /v1/chat/completions``, ``POST /v1/completions``,
``DELETE /v1/conversations/{id}``, and, as vLLM's server, ``GET /health`` and ``GET /metrics``
(no API key). What each accepts and refuses, the response and stream shapes, the ``tandem`` field,
the error shapes and status codes, and how a conversation maps onto an edge session (the id rule
and its limits): docs/clients.md, "OpenAI-compatible HTTP API", "Ending a session" and "Errors and
status codes". API keys: docs/security.md.

The session id of a conversation (``request_models.conversation_session_id``, ``owner_tag``)::

    session_id = "oai:" + owner_tag(api key) + HMAC-SHA256(secret, json([endpoint, api key, user,
                                                    explicit session_id, opening]))[:24 hex]

``secret`` is random per app unless given (``session_secret``). Only the key whose ``owner_tag``
the id carries may delete it (else 404, as for one already ended).

Modules: ``edge.api.request_models`` (request models, request -> turn), ``edge.api.responses``
(response and chunk shapes), ``edge.api.errors`` (error shapes, domain error -> HTTP status), this
one (the app, streaming, serving).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hmac
import logging
import secrets
import socket
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from tandem.common.protocol import errors as e
from tandem.common.protocol.limits import check_session_id
from tandem.common.protocol.modes import Mode
from tandem.common.protocol.text import check_text
from tandem.common.runtime.logs import set_caller, set_ids
from tandem.common.runtime.security import Principal, key_name
from tandem.edge.api.errors import ApiError, BodyLimit, add_error_handlers, api_error_of
from tandem.edge.api.request_models import (
    ChatRequest,
    CompletionRequest,
    RequestBase,
    chat_messages,
    chat_opening,
    conversation_session_id,
    owned_by,
    prompt_of,
    refuse_unsupported,
    sampling,
    stops,
)
from tandem.edge.api.responses import Call, collect, finish_reason, sse, tandem_extra, usage_of
from tandem.edge.events import ChatTurn, TextOut, TurnDone
from tandem.edge.node import EdgeNode

log = logging.getLogger("tandem.edge.openai")

OPENING_CHARS = 64  # characters of a completion prompt that name its session
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions
MAX_BODY_BYTES = 4 << 20  # as the edge's gRPC message limit: a conversation of a few MB of text
T = TypeVar("T")


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
    call: Call, first: TextOut | TurnDone, events: AsyncGenerator[Any, None], ctx: contextvars.Context
) -> AsyncGenerator[str, None]:
    try:
        if call.chat:
            yield sse(call.chunk({"role": "assistant", "content": ""}))
        ev: TextOut | TurnDone | None = first
        while ev is not None:
            if isinstance(ev, TextOut):
                yield sse(call.chunk({"content": ev.text} if call.chat else ev.text))
            else:
                last = call.chunk({} if call.chat else "", finish_reason(ev))
                last["tandem"] = tandem_extra(ev, call.turn.session_id)
                yield sse(last)
                if call.include_usage:
                    yield sse({**call.base(chunk=True), "choices": [], "usage": usage_of(ev)})
                break
            ev = await asyncio.get_running_loop().create_task(anext(events, None), context=ctx)
    except e.TandemError as err:
        yield sse(api_error_of(err, call.renamed).body())
    except Exception:
        log.exception("OpenAI stream failed")
        yield sse(ApiError(500, "internal error in the edge (see its log)").body())
    finally:
        await events.aclose()
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------- the app


class _Api:
    def __init__(self, service: EdgeNode, model_id: str, session_secret: bytes) -> None:
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
        """Raises ApiError (404 ``model_not_found``) unless ``model`` is this edge's model."""
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

    def release(self, call: Call) -> None:
        self.busy.discard(call.turn.session_id)

    def chat_call(self, r: ChatRequest, key: str) -> Call:
        self.check_model(r.model)
        refuse_unsupported(r)
        messages = chat_messages(r)
        max_new = self.service.max_new_tokens
        max_tokens, param = (
            (r.max_completion_tokens, "max_completion_tokens")
            if r.max_completion_tokens is not None
            else (r.max_tokens, "max_tokens")
        )
        sp = sampling(r, max_tokens, max_new, max_new, param)
        opening = [""] * 2 if r.session_id else chat_opening(messages)
        stop = stops(r.stop)
        check_session_id(r.session_id or "")
        mode = Mode.from_name(r.mode)
        sid = self.session_for(["chat", key, r.user or "", r.session_id or "", *opening])
        turn = ChatTurn(
            messages=messages,
            prompt="",
            session_id=sid,
            sampling=sp,
            mode=mode,
            stop=stop,
            split_layer=r.split_layer,
            whole_reply=not r.stream,
        )
        return self._call(True, turn, r, param)

    def completion_call(self, r: CompletionRequest, key: str) -> Call:
        self.check_model(r.model)
        refuse_unsupported(r)
        prompt = prompt_of(r)
        max_new = self.service.max_new_tokens
        default_max = min(COMPLETIONS_DEFAULT_MAX_TOKENS, max_new)
        sp = sampling(r, r.max_tokens, default_max, max_new, "max_tokens")
        opening = "" if r.session_id else prompt[:OPENING_CHARS]
        stop = stops(r.stop)
        check_session_id(r.session_id or "")
        mode = Mode.from_name(r.mode)
        sid = self.session_for(["text", key, r.user or "", r.session_id or "", opening])
        turn = ChatTurn(
            messages=(),
            prompt=prompt,
            session_id=sid,
            sampling=sp,
            mode=mode,
            stop=stop,
            split_layer=r.split_layer,
            whole_reply=not r.stream,
        )
        return self._call(False, turn, r, "max_tokens")

    def _call(self, chat: bool, turn: ChatTurn, r: RequestBase, max_tokens_param: str) -> Call:
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        usage = bool(r.stream and r.stream_options and r.stream_options.include_usage)
        return Call(chat, rid, int(time.time()), self.model_id, turn, usage, max_tokens_param)

    async def end_conversation(self, conversation_id: str, key: str) -> dict[str, Any]:
        """``DELETE /v1/conversations/{id}``: end the conversation's session (``x-tandem-session``) on
        the edge and in the cloud, in OpenAI's ``conversation.deleted`` shape.

        Raises:
            InvalidRequest: an id ``check_session_id`` refuses (not text, over 128 bytes), as ``EndSession``.
            ApiError: 404 when it is not a conversation of this key or neither side held it.
        """
        check_session_id(conversation_id, "conversation_id")  # as EndSession checks a session id
        missing = ApiError(404, f"Conversation with id '{conversation_id}' not found.", param="conversation_id")
        if not owned_by(self.secret, conversation_id, key):
            raise missing
        if not await self.service.end_session(conversation_id):
            raise missing
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    async def answer(self, call: Call, stream: bool, request: Request) -> Response:
        """Run the turn (its session reserved until it ends) and answer in OpenAI's shape."""
        set_ids(call.id, call.turn.session_id)  # this request's own task: log lines carry the response's id
        try:
            return await self._answer(call, stream, request)
        except e.TandemError as err:  # the request's own names for the domain's fields
            raise api_error_of(err, call.renamed) from err

    async def _answer(self, call: Call, stream: bool, request: Request) -> Response:
        headers = {"x-tandem-session": call.turn.session_id}
        events = cast(AsyncGenerator[TextOut | TurnDone, None], self.service.chat(call.turn))
        if not stream:
            try:
                text, done = await unless_disconnected(request, collect(events))
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
            set_caller(Principal("key", key_name(presented)))  # the request's log lines name the key, never the key
        return presented

    return bearer


def create_openai_app(
    service: EdgeNode, model_id: str, api_keys: Sequence[str] = (), *, session_secret: bytes | None = None
) -> FastAPI:
    """The OpenAI-compatible API over ``service`` (see the module docstring). ``session_secret`` keys
    the derived session ids (random per app if not given)."""
    api = _Api(service, model_id, session_secret or secrets.token_bytes(32))
    app = FastAPI(title="tandem edge (OpenAI-compatible)", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.tandem = api
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
    auth = Depends(_bearer_check(api_keys))
    add_error_handlers(app)

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: nginx's "client closed request"

    @app.get("/health")
    async def health() -> JSONResponse:
        routes = service.routes()
        body = {
            "status": "SERVING" if routes else "NOT_SERVING",
            "modes": sorted({r.mode.value for r in routes}),
            "degraded": service.degraded(),
        }
        return JSONResponse(body, status_code=200 if routes else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models(key: str = auth) -> dict[str, Any]:
        return {"object": "list", "data": [api.model_card()]}

    @app.get("/v1/models/{model:path}")  # a model id may hold slashes (``org/name``)
    async def get_model(model: str, key: str = auth) -> dict[str, Any]:
        api.check_model(model)
        return api.model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request, key: str = auth) -> Response:
        return await api.answer(api.chat_call(body, key), bool(body.stream), request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request, key: str = auth) -> Response:
        return await api.answer(api.completion_call(body, key), bool(body.stream), request)

    @app.delete("/v1/conversations/{conversation_id}")
    async def delete_conversation(conversation_id: str, key: str = auth) -> dict[str, Any]:
        return await api.end_conversation(conversation_id, key)

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
        OSError: the address cannot be bound (the message names it).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot bind the HTTP API to {host}:{port}: {e.strerror or e}") from None
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
