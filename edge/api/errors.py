"""Errors of the edge's OpenAI-compatible API (``edge.api.http_api``), in OpenAI's shape, in one place.

Every error is ``{"error": {"message", "type", "param", "code"}}`` with the status OpenAI gives, as
the official API writes it and the ``openai`` client reads it (``BadRequestError.param``, ``.code``,
``.type``). A domain error about a field (``InvalidRequest``, ``ModeUnavailable``) brings its own
``param`` and ``code`` (``common.protocol.errors``), the same the gRPC API sends; tandem's other
domain errors (``EngineError``, ``QuotaExceeded``...) have the error's class name as ``code``. The
statuses, types, params and codes per case: docs/clients.md, "Errors and status codes".

``ApiError`` is raised by the API's own refusals; ``api_error_of`` maps domain errors, ``of_validation``
pydantic's (FastAPI's ``RequestValidationError``: 400, not FastAPI's 422), ``of_http`` Starlette's
(unknown URL, method); ``BodyLimit`` answers 413 before a body is buffered.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.common.protocol import errors as e
from tandem.common.protocol.grpc_errors import retry_after_ms

log = logging.getLogger("tandem.edge.openai")

INVALID_REQUEST = "invalid_request_error"


def type_of_status(status: int) -> str:
    """OpenAI's error ``type`` for an HTTP status."""
    if status == 429:
        return "rate_limit_error"
    return INVALID_REQUEST if status < 500 else "server_error"


def param_path(loc: Sequence[str | int]) -> str | None:
    """A parameter's path as OpenAI writes it: ``("messages", 1, "role")`` -> ``messages.[1].role``."""
    return ".".join(f"[{x}]" if isinstance(x, int) else str(x) for x in loc) or None


class ApiError(Exception):
    """An error answered in OpenAI's shape (see the module docstring); ``type_`` defaults to the status's."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or type_of_status(status)
        self.retry_after_s = retry_after_s  # HTTP's ``Retry-After`` (whole seconds), where worth retrying

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"www-authenticate": "Bearer"} if self.status == 401 else {}
        if self.retry_after_s is not None:
            headers["retry-after"] = str(self.retry_after_s)
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


# most specific first: the first class in an error's MRO found here decides
STATUS_OF: dict[type[e.TandemError], tuple[int, str]] = {
    e.CorruptPayload: (500, "server_error"),  # the edge's own payload, not the client's request
    e.InvalidRequest: (400, INVALID_REQUEST),
    e.ModeUnavailable: (400, INVALID_REQUEST),  # a mode (or split layer) this edge does not have
    e.TurnTooLarge: (400, INVALID_REQUEST),  # larger than the edge's whole KV bound: no Retry-After
    e.Unauthenticated: (401, INVALID_REQUEST),
    e.PermissionDenied: (403, INVALID_REQUEST),
    e.QuotaExceeded: (429, "rate_limit_error"),
    e.EngineError: (503, "service_unavailable_error"),
    e.UploadTimeout: (504, "timeout_error"),  # DeadlineExceeded too
}


def renamed_fields(text: str, renamed: dict[str, str]) -> str:
    """``text`` with every domain field name of ``renamed`` (a whole word: ``max_new_tokens``, not a
    part of a longer name) written as this request names it, wherever the message says it (the
    field at fault or another: "prompt (9 tokens) + max_new_tokens (600) exceeds ...")."""
    if not renamed:
        return text
    words = re.compile(r"\b(" + "|".join(re.escape(k) for k in sorted(renamed, key=len, reverse=True)) + r")\b")
    return words.sub(lambda m: renamed[m.group(1)], text)


def api_error_of(err: e.TandemError, renamed: dict[str, str] | None = None) -> ApiError:
    """The HTTP status and OpenAI error type of a domain error (500 ``server_error`` if unmapped);
    ``param`` and ``code`` the error's own (``code`` its class name where it has none), and the
    retry hint the gRPC API sends (``retry-after-ms``) as ``Retry-After`` in whole seconds, rounded
    up. ``renamed`` maps a domain field to this request's name for it (``max_new_tokens`` ->
    ``max_tokens``): the ``param`` and every mention in the message (``renamed_fields``) use the
    request's names."""
    mro = type(err).__mro__
    status, type_ = next((STATUS_OF[c] for c in mro if c in STATUS_OF), (500, "server_error"))
    param, message = err.param, str(err) or err.wire_name
    if renamed:
        message = renamed_fields(message, renamed)
        param = renamed.get(param, param) if param is not None else None
    retry_ms = retry_after_ms(err)
    retry_s = None if retry_ms is None else max(1, math.ceil(retry_ms / 1000))
    return ApiError(status, message, param=param, code=err.code or err.wire_name, type_=type_, retry_after_s=retry_s)


# --- pydantic's validation errors -----------------------------------------------------------------

_TYPE_ERRORS = ("_type", "_parsing", "is_instance_of", "union_tag_invalid", "union_tag_not_found")
_BOUNDS = {
    "greater_than": "below_min_value",
    "greater_than_equal": "below_min_value",
    "less_than": "above_max_value",
    "less_than_equal": "above_max_value",
}


def _code_of(err: dict[str, Any]) -> str:
    """OpenAI's code for one pydantic error."""
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind == "missing":
        return "missing_required_parameter"
    if kind == "extra_forbidden":
        return "unknown_parameter"
    if kind in _BOUNDS:
        limit = next(iter(ctx.values()), 0)
        return f"{'decimal' if isinstance(limit, float) else 'integer'}_{_BOUNDS[kind]}"
    if kind in ("string_too_long", "string_too_short"):
        return f"string_{'above_max' if kind == 'string_too_long' else 'below_min'}_length"
    if kind in ("too_long", "too_short"):
        if kind == "too_short" and not ctx.get("actual_length"):
            return "empty_array"
        return f"array_{'above_max' if kind == 'too_long' else 'below_min'}_length"
    if kind.endswith(_TYPE_ERRORS):
        return "invalid_type"
    return "invalid_value"


def _where(loc: Sequence[str | int], body: Any, missing: bool) -> list[str | int]:
    """The parts of pydantic's ``loc`` that name parameters of ``body``: union members' tags
    (``content.str``, ``content.list[...]``) do not, and are left out."""
    out: list[str | int] = []
    node = body
    for i, part in enumerate(loc):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif missing and i == len(loc) - 1 and isinstance(node, dict):
            pass  # the absent parameter itself
        else:
            continue
        out.append(part)
    return out


def of_validation(errors: Sequence[Any], body: Any) -> ApiError:
    """A 400 for FastAPI's validation errors of the request ``body``: the first error's parameter,
    message and code, and how many other parameters are wrong."""
    errs = [dict(x) for x in errors]
    if not errs:
        return ApiError(400, "invalid request", code="invalid_value")
    first = errs[0]
    if first["type"] == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return ApiError(400, f"We could not parse the JSON body of your request ({detail}).")
    loc = [x for x in first.get("loc", ()) if x != "body"]
    if first["type"] == "not_text":  # found anywhere in the body: the path of the string at fault
        where: list[str | int] = list(first["ctx"]["path"])
    else:
        where = _where(loc, body, first["type"] == "missing")
        # a union's members each report: the one that reached deepest into the value names the part at
        # fault (``stop: ["ok", 5]`` is ``stop.[1]``, not ``stop``)
        for err in errs[1:]:
            deeper = _where([x for x in err.get("loc", ()) if x != "body"], body, False)
            if len(deeper) > len(where) and deeper[: len(where)] == where:
                first, where = err, deeper
    param = param_path(where)
    if param is None and first["type"] == "missing":
        return ApiError(400, "a JSON object body is required", code="missing_required_parameter")
    params = {param_path(_where([x for x in err.get("loc", ()) if x != "body"], body, False)) for err in errs}
    more = f" (and {len(params) - 1} more parameters)" if len(params) > 1 else ""
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        msg = "Unrecognized request argument supplied (see docs/clients.md for the fields this server takes)"
    text = f"{param}: {msg}{more}" if param else f"{msg}{more}"
    return ApiError(400, text, param=param, code=_code_of(first))


def of_http(status: int, detail: str, method: str, path: str) -> ApiError:
    """Starlette's own errors: an unknown URL (404) or method (405), in OpenAI's words."""
    if status in (404, 405):
        return ApiError(status, f"Invalid URL ({method} {path})" if status == 404 else f"{detail} ({method} {path})")
    return ApiError(status, detail)


def add_error_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` in OpenAI's shape: ours, domain errors, validation, Starlette's,
    and anything else as a 500 (logged)."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(e.TandemError)
    async def _tandem_error(request: Request, exc: e.TandemError) -> Response:
        return api_error_of(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        return of_validation(exc.errors(), exc.body).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        err = of_http(exc.status_code, str(exc.detail), request.method, request.url.path)
        return JSONResponse(err.body(), status_code=err.status, headers=dict(exc.headers or {}))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        log.exception("OpenAI API request failed", exc_info=exc)
        return ApiError(500, "internal error in the edge (see its log)").response()


# --- bodies too large -----------------------------------------------------------------------------


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` (announced or streamed) is answered 413 in
    OpenAI's shape before it is buffered, so request size never sets the edge's memory. A streamed
    (chunked) body is cut where it passes the limit; whatever the app makes of the cut body (FastAPI
    answers 400 to a body it could not read) gives way to the 413, unless the app had already begun
    its response."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def error(self) -> ApiError:
        return ApiError(413, f"request body over {self.max_bytes} bytes")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self.error().response()(scope, receive, send)
        seen, too_large, app_started, answered = 0, False, False, False

        async def limited() -> Any:
            nonlocal seen, too_large
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                too_large = True
                raise self.error()
            return message

        async def answer_413() -> None:
            nonlocal answered
            if not answered:
                answered = True
                await self.error().response()(scope, receive, send)

        async def guarded(message: Any) -> None:
            nonlocal app_started
            if too_large and not app_started:
                return await answer_413()
            app_started = app_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited, guarded)
        except ApiError:
            if not (too_large and not app_started):
                raise
            await answer_413()
