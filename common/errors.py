"""Typed domain errors. Mapped to gRPC status codes in one place
(``common.grpc_errors``); domain code raises these and never imports grpc."""

from __future__ import annotations


class TandemError(Exception):
    """Base of tandem's domain errors."""


class InvalidRequest(TandemError):
    """A field, length, index, shape or dtype is out of the negotiated limits."""


class ChecksumMismatch(TandemError):
    """A chunk's CRC32C does not match its bytes (after the allowed resends)."""


class MerkleMismatch(TandemError):
    """KV block leaves or the committed Merkle root do not verify."""


class SessionOutOfSync(TandemError):
    """The peer's view of a session (token count, root) differs from ours; resync needed."""


class SessionNotFound(SessionOutOfSync):
    """The session is unknown to this side (never seen, evicted, or another principal's: ids are
    scoped by identity). A kind of ``SessionOutOfSync``: the edge resends from token 0."""


class QuotaExceeded(TandemError):
    """The link's concurrency or token quota is used up."""


class ParamsVersionMismatch(TandemError):
    """A message was made with link params other than the agreed version."""


class ModeUnavailable(TandemError):
    """The requested serving mode (or split layer) cannot run on this edge (no model for it)."""


class IncompatibleModel(TandemError):
    """Edge head and cloud tail were not cut from the same model at the same split layer."""


class UploadTimeout(TandemError):
    """The uplink did not complete the upload within the allowed time."""


class EngineError(TandemError):
    """A vLLM engine failed or is not running."""


class LinkLost(EngineError):
    """The connection to the cloud broke under a call (the cloud process died, the link dropped),
    with no verdict from the cloud: what the edge retries once a cloud answers again."""


class Unauthenticated(TandemError):
    """The call carries no valid credentials (API key, client certificate)."""


class PermissionDenied(TandemError):
    """The caller is authenticated but the object it names (a link) belongs to another principal."""


class DeadlineExceeded(UploadTimeout):
    """The request's deadline passed (waiting for the session, the upload or the engines)."""


class CorruptPayload(InvalidRequest):
    """A payload passed its checksum but does not decode: not exactly one complete zstd frame
    of the announced raw size, or a size beyond the negotiated limits. Treated like a CRC
    failure (NACK / repair, then INVALID_ARGUMENT)."""


ERRORS_BY_NAME: dict[str, type[TandemError]] = {}


def register_errors() -> None:
    """Index every ``TandemError`` subclass by name (for errors carried in messages)."""
    stack: list[type[TandemError]] = [TandemError]
    while stack:
        cls = stack.pop()
        ERRORS_BY_NAME[cls.__name__] = cls
        stack.extend(cls.__subclasses__())


def error_from_name(name: str, message: str, base_names: tuple[str, ...] = (), retry_after_ms: int = 0) -> TandemError:
    """The domain error called ``name``, else the first of ``base_names`` (its ancestors, most
    specific first) this process knows, else ``TandemError``; with ``retry_after_ms`` (> 0) as its
    retry hint."""
    if not ERRORS_BY_NAME:
        register_errors()
    cls = next((ERRORS_BY_NAME[n] for n in (name, *base_names) if n in ERRORS_BY_NAME), TandemError)
    err = cls(message)
    if retry_after_ms > 0:
        err.retry_after_ms = retry_after_ms  # type: ignore[attr-defined]
    return err


def base_names(err: TandemError) -> tuple[str, ...]:
    """Names of ``err``'s tandem ancestors, most specific first (``TandemError`` last)."""
    return tuple(c.__name__ for c in type(err).__mro__[1:] if issubclass(c, TandemError))
