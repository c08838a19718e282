"""Errors of the client SDK: one class per gRPC status, mapped in one place (``ERROR_OF``).

Every error the SDK raises for a failed call is a ``TandemClientError`` carrying the status
(``.code``), the server's message (``.details``), ``.retry_after_s`` when the server sent a hint in
its trailing metadata (``retry-after-ms`` or ``retry-after-s``), and, for a refusal of one field,
``.param`` and ``.error_code`` as OpenAI names them. A bad argument the SDK catches before sending
is ``BadArgument`` (an ``InvalidArgument`` and a ``ValueError``) or ``BadArgumentType`` (a
``TypeError`` too). Catch the base class for "the call failed", or a subclass for one status.
Which status the edge answers when, and the codes per field: docs/clients.md, "Errors and status
codes". Statuses the transport or a proxy may add have their classes too (``Unauthenticated``,
``PermissionDenied``, ``Unimplemented`` from an edge older than an RPC, ...). Only grpcio is needed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, ClassVar

import grpc

RETRY_AFTER_KEYS = {"retry-after-ms": 1000.0, "retry-after-s": 1.0}  # trailing metadata key -> units per second
PARAM_KEY, CODE_KEY = "tandem-error-param", "tandem-error-code"  # trailing metadata: the field at fault, its code


class TandemClientError(Exception):
    """A call to the edge failed. ``code``: the gRPC status; ``details``: the server's message;
    ``retry_after_s``: the server's hint of when to retry in seconds (``None``: no hint);
    ``param``: the request's field at fault, as OpenAI writes it (``None``: no one field);
    ``error_code``: OpenAI's code for it (``invalid_value``...; ``None``: none).

    ``tandem.errors.ERROR_OF`` gives the subclass raised for each status (every status other than
    ``OK`` has one; this class is the fallback).
    """

    status: ClassVar[grpc.StatusCode | None] = None  # the status this class stands for

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str = "",
        *,
        retry_after_s: float | None = None,
        param: str | None = None,
        error_code: str | None = None,
    ) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details, self.retry_after_s = code, details, retry_after_s
        self.param, self.error_code = param, error_code

    def __reduce__(self) -> tuple[Any, ...]:  # picklable although __init__ takes more than a message
        return (_rebuild, (type(self), self.code, self.details, self.retry_after_s, self.param, self.error_code))


def _rebuild(
    cls: type[TandemClientError],
    code: grpc.StatusCode,
    details: str,
    retry_after_s: float | None,
    param: str | None = None,
    error_code: str | None = None,
) -> Any:
    if issubclass(cls, BadArgument):
        return cls(details, param=param, error_code=error_code or "invalid_value")
    return cls(code, details, retry_after_s=retry_after_s, param=param, error_code=error_code)


class Cancelled(TandemClientError):
    """The call was cancelled: by ``ChatStream.cancel()`` / ``AsyncChatStream.cancel()``, or by the server."""

    status = grpc.StatusCode.CANCELLED


class Unknown(TandemClientError):
    """An error without a known status, or a stream that ended without its final event."""

    status = grpc.StatusCode.UNKNOWN


class InvalidArgument(TandemClientError):
    """The edge refused the request as invalid; sending it again will fail again."""

    status = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(TandemClientError):
    """The call's deadline passed before the turn finished."""

    status = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(TandemClientError):
    status = grpc.StatusCode.NOT_FOUND


class AlreadyExists(TandemClientError):
    status = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(TandemClientError):
    status = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(TandemClientError):
    """A quota or capacity limit was hit; ``retry_after_s`` says when to retry if the server said."""

    status = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(TandemClientError):
    """The system is not in a state to run the request (e.g. the edge and the cloud disagree)."""

    status = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(TandemClientError):
    status = grpc.StatusCode.ABORTED


class OutOfRange(TandemClientError):
    status = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(TandemClientError):
    """The server does not implement the RPC (e.g. an edge older than ``GetInfo``)."""

    status = grpc.StatusCode.UNIMPLEMENTED


class Internal(TandemClientError):
    """A bug in the edge or the cloud (their logs say more)."""

    status = grpc.StatusCode.INTERNAL


class Unavailable(TandemClientError):
    """The edge or the cloud is down, unreachable or draining; a retry (later, or elsewhere) may work."""

    status = grpc.StatusCode.UNAVAILABLE


class DataLoss(TandemClientError):
    """Data was corrupted on the edge-cloud link beyond repair."""

    status = grpc.StatusCode.DATA_LOSS


class Unauthenticated(TandemClientError):
    status = grpc.StatusCode.UNAUTHENTICATED


class BadArgument(InvalidArgument, ValueError):
    """An argument the SDK refused before sending anything, as the edge would have (``param``, ``error_code``)."""

    def __init__(self, details: str, *, param: str | None = None, error_code: str = "invalid_value") -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, details, param=param, error_code=error_code)

    def __str__(self) -> str:
        return self.details


class BadArgumentType(BadArgument, TypeError):
    """An argument of the wrong type, refused before sending anything (``error_code`` ``invalid_type``)."""

    def __init__(self, details: str, *, param: str | None = None, error_code: str = "invalid_type") -> None:
        super().__init__(details, param=param, error_code=error_code)


# The one mapping: status -> error class.
ERROR_OF: dict[grpc.StatusCode, type[TandemClientError]] = {
    c.status: c
    for c in (
        Cancelled,
        Unknown,
        InvalidArgument,
        DeadlineExceeded,
        NotFound,
        AlreadyExists,
        PermissionDenied,
        ResourceExhausted,
        FailedPrecondition,
        Aborted,
        OutOfRange,
        Unimplemented,
        Internal,
        Unavailable,
        DataLoss,
        Unauthenticated,
    )
    if c.status is not None
}


def retry_after_s(metadata: Iterable[tuple[str, Any]] | None) -> float | None:
    """The retry hint in seconds from trailing metadata (``retry-after-ms`` or ``retry-after-s``,
    decimal numbers); ``None`` if absent or not a finite number >= 0."""
    for key, value in metadata or ():
        per_s = RETRY_AFTER_KEYS.get(key.lower())
        if per_s is None:
            continue
        try:  # divided, not multiplied by 1e-3: 479 ms reads 0.479 s, not 0.47900000000000004
            v = float(value.decode() if isinstance(value, bytes) else value) / per_s
        except (TypeError, ValueError, UnicodeDecodeError):
            continue
        if math.isfinite(v) and v >= 0:
            return v
    return None


def _metadata_value(metadata: Iterable[tuple[str, Any]] | None, key: str) -> str | None:
    for k, v in metadata or ():
        if k.lower() == key:
            return v.decode(errors="replace") if isinstance(v, bytes) else str(v)
    return None


def error_from_status(
    code: grpc.StatusCode, details: str = "", trailing_metadata: Iterable[tuple[str, Any]] | None = None
) -> TandemClientError:
    """The error for a status: its class from ``ERROR_OF`` (else ``TandemClientError``), with the
    retry hint, the field and the code of the trailing metadata."""
    cls = ERROR_OF.get(code, TandemClientError)
    md = list(trailing_metadata or ())
    return cls(
        code,
        details,
        retry_after_s=retry_after_s(md),
        param=_metadata_value(md, PARAM_KEY),
        error_code=_metadata_value(md, CODE_KEY),
    )


def error_from_rpc(e: Any) -> TandemClientError:
    """The error for a failed call: a ``grpc.RpcError`` that is a ``grpc.Call`` (sync) or a
    ``grpc.aio.AioRpcError``."""
    try:
        md = e.trailing_metadata()
    except Exception:  # an RpcError without a call (e.g. raised by an interceptor)
        md = None
    code = e.code() if callable(getattr(e, "code", None)) else grpc.StatusCode.UNKNOWN
    details = e.details() if callable(getattr(e, "details", None)) else str(e)
    return error_from_status(code, details or "", md)
