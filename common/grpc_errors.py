"""The one place where domain errors become gRPC status codes."""

from __future__ import annotations

import grpc

from tandem.common import errors as e

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


def status_details(err: e.TandemError) -> str:
    """The details of the status that carries ``err``: ``"<wire name>: <message>"``."""
    return f"{err.wire_name}: {err}"


async def abort(context: grpc.aio.ServicerContext, err: e.TandemError) -> None:
    """Abort the RPC with the status mapped from ``err`` and its message (raises AbortError); a
    retryable error carries a ``retry-after-ms`` hint in the trailing metadata (the error's own
    ``retry_after_ms`` when it has one, e.g. ``cloud.links.LinkBusy``)."""
    retry_ms = getattr(err, "retry_after_ms", None) or next(
        (ms for cls, ms in RETRY_AFTER_MS.items() if isinstance(err, cls)), None
    )
    if retry_ms is not None:
        # also as gRPC's own retry pushback (gRFC A6), which channels with a retry policy honour
        context.set_trailing_metadata((("retry-after-ms", str(retry_ms)), ("grpc-retry-pushback-ms", str(retry_ms))))
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
