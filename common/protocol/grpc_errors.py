"""The one place where domain errors become gRPC status codes."""

from __future__ import annotations

import grpc

from tandem.common.protocol import errors as e
from tandem.common.protocol.text import printable

MAX_PARAM_CHARS = 256  # a field's path in the trailing metadata (printable ASCII, as gRPC requires)

STATUS_OF: dict[type[e.TandemError], grpc.StatusCode] = {
    e.InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    e.ChecksumMismatch: grpc.StatusCode.DATA_LOSS,
    e.MerkleMismatch: grpc.StatusCode.DATA_LOSS,
    e.SessionNotFound: grpc.StatusCode.NOT_FOUND,
    e.SessionOutOfSync: grpc.StatusCode.FAILED_PRECONDITION,
    e.QuotaExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    e.ParamsVersionMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    e.IncompatibleModel: grpc.StatusCode.FAILED_PRECONDITION,
    e.ModeUnavailable: grpc.StatusCode.FAILED_PRECONDITION,
    e.TurnTooLarge: grpc.StatusCode.FAILED_PRECONDITION,  # never fits as it is: not retried (unlike QuotaExceeded)
    e.UploadTimeout: grpc.StatusCode.DEADLINE_EXCEEDED,
    e.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    e.CorruptPayload: grpc.StatusCode.INVALID_ARGUMENT,
    e.EngineError: grpc.StatusCode.UNAVAILABLE,
    e.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    e.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
}


def status_of(err: e.TandemError) -> grpc.StatusCode:
    for cls in type(err).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]
    return grpc.StatusCode.INTERNAL


# Errors worth retrying later, and after how long: sent as trailing metadata ``retry-after-ms``
# (the SDK's ``TandemClientError.retry_after_s``), as HTTP's Retry-After does.
RETRY_AFTER_MS: dict[type[e.TandemError], int] = {e.QuotaExceeded: 1000, e.EngineError: 2000}


# Trailing metadata naming the request's field at fault and OpenAI's code for it (``TandemError.param``
# / ``.code``): the SDK's ``TandemClientError.param`` / ``.error_code``.
PARAM_KEY, CODE_KEY = "tandem-error-param", "tandem-error-code"


def retry_after_ms(err: e.TandemError) -> int | None:
    """How long a client should wait before retrying ``err`` (ms): the error's own hint, else its
    class's (``RETRY_AFTER_MS``); None for an error not worth retrying."""
    return getattr(err, "retry_after_ms", None) or next(
        (ms for cls, ms in RETRY_AFTER_MS.items() if isinstance(err, cls)), None
    )


def error_metadata(err: e.TandemError) -> tuple[tuple[str, str], ...]:
    """The trailing metadata of a status that carries ``err``: its retry hint (``retry-after-ms``, as
    gRPC's own ``grpc-retry-pushback-ms`` too), its field and its code, where it has them."""
    retry_ms = retry_after_ms(err)
    md: list[tuple[str, str]] = []
    if retry_ms is not None:
        # also as gRPC's own retry pushback (gRFC A6), which channels with a retry policy honour
        md += [("retry-after-ms", str(retry_ms)), ("grpc-retry-pushback-ms", str(retry_ms))]
    if err.param:
        md.append((PARAM_KEY, printable(err.param, MAX_PARAM_CHARS).encode("ascii", "backslashreplace").decode()))
    if err.code:
        md.append((CODE_KEY, err.code))
    return tuple(md)


def status_details(err: e.TandemError) -> str:
    """The details of the status that carries ``err``: ``"<wire name>: <message>"``."""
    return f"{err.wire_name}: {err}"


async def abort(context: grpc.aio.ServicerContext, err: e.TandemError) -> None:
    """Abort the RPC with the status mapped from ``err`` and its message (raises AbortError); the
    trailing metadata (``error_metadata``) carries a retryable error's ``retry-after-ms`` hint (the
    error's own ``retry_after_ms`` when it has one, e.g. ``cloud.links.table.LinkBusy``) and the field at
    fault with OpenAI's code for it."""
    md = error_metadata(err)
    if md:
        context.set_trailing_metadata(md)
    await context.abort(status_of(err), status_details(err))


# A status that names no tandem error (the transport's own: deadline, unreachable peer...).
DEFAULT_OF_STATUS: dict[grpc.StatusCode, type[e.TandemError]] = {
    grpc.StatusCode.UNAVAILABLE: e.EngineError,
    grpc.StatusCode.CANCELLED: e.EngineError,  # received by a client that did not cancel: the server went away
    grpc.StatusCode.DEADLINE_EXCEEDED: e.DeadlineExceeded,
    grpc.StatusCode.RESOURCE_EXHAUSTED: e.QuotaExceeded,
    grpc.StatusCode.INVALID_ARGUMENT: e.InvalidRequest,
    grpc.StatusCode.UNAUTHENTICATED: e.Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: e.PermissionDenied,
}


# The errors a status names by their wire name (``status_details``) and that come back as themselves.
_NAMED: dict[str, type[e.TandemError]] = {cls.wire_name: cls for cls in STATUS_OF}


def error_from_status(code: grpc.StatusCode, details: str) -> e.TandemError:
    """Inverse mapping for clients: a status back to the domain error it came from (one of
    ``STATUS_OF`` named by its wire name, with that status), else the status's default error."""
    name, _, message = details.partition(": ")
    cls = _NAMED.get(name)
    if cls is not None and STATUS_OF[cls] == code:
        return cls(message)
    return DEFAULT_OF_STATUS.get(code, e.TandemError)(f"{code.name}: {details}")
