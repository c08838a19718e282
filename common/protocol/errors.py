"""Typed domain errors. Mapped to gRPC status codes in one place
(``common.protocol.grpc_errors``); domain code raises these and never imports grpc.

Each error class declares its ``wire_name``: how the error is named between processes (the
``Kind: message`` details of a gRPC status, ``Error.kind`` and ``Error.base_kinds`` of a refused
turn). It is fixed, so renaming or moving a class leaves the wire as it is; a class defined without
one, or with one another class has, fails at its definition (``TypeError``). ``ERRORS_BY_NAME``
indexes every class defined so far by it.

An error about one field of a request names it: ``param`` is the field's path as OpenAI writes it
(``temperature``, ``messages.[1].role``, ``stop_token_ids.[0]``) and ``code`` OpenAI's code for the
case (one of ``OPENAI_CODES``); a class may give defaults (``InvalidRequest``'s code is
``invalid_value``). Every surface answers them the same way: the HTTP API in its error body, gRPC
in the trailing metadata ``tandem-error-param`` / ``tandem-error-code`` (``common.protocol.grpc_errors``),
the SDK as ``TandemClientError.param`` / ``.error_code``.
"""

from __future__ import annotations

from typing import Any, ClassVar

ERRORS_BY_NAME: dict[str, type[TandemError]] = {}

# OpenAI's error codes for a field of a request (``error.code`` of its API, as its client reads them)
OPENAI_CODES = frozenset(
    {
        "missing_required_parameter",
        "unknown_parameter",
        "invalid_type",
        "invalid_value",
        "unsupported_parameter",
        "unsupported_value",
        "integer_above_max_value",
        "integer_below_min_value",
        "decimal_above_max_value",
        "decimal_below_min_value",
        "string_above_max_length",
        "string_below_min_length",
        "array_above_max_length",
        "array_below_min_length",
        "empty_array",
        "context_length_exceeded",
        "model_not_found",
        "invalid_api_key",
    }
)


def _register(cls: type[TandemError]) -> None:
    """Index ``cls`` by its own ``wire_name`` (the same class defined again, as by a module reload,
    takes its place).

    Raises:
        TypeError: ``cls`` declares no ``wire_name`` of its own, or another class has it.
    """
    name = cls.__dict__.get("wire_name")
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls.__module__}.{cls.__qualname__} must declare its wire_name (a non-empty str)")
    prior = ERRORS_BY_NAME.get(name)
    if prior is not None and (prior.__module__, prior.__qualname__) != (cls.__module__, cls.__qualname__):
        raise TypeError(
            f"wire name {name!r} of {cls.__module__}.{cls.__qualname__} is "
            f"{prior.__module__}.{prior.__qualname__}'s already"
        )
    ERRORS_BY_NAME[name] = cls


class TandemError(Exception):
    """Base of tandem's domain errors. ``param``: the request's field at fault (OpenAI's path, None
    when no one field is); ``code``: OpenAI's code for the case (None: none applies, the error is
    not about a field)."""

    wire_name: ClassVar[str] = "TandemError"
    default_param: ClassVar[str | None] = None
    default_code: ClassVar[str | None] = None

    def __init__(self, *args: object, param: str | None = None, code: str | None = None) -> None:
        super().__init__(*args)
        self.param = param if param is not None else self.default_param
        self.code = code if code is not None else self.default_code

    def __reduce__(self) -> tuple[Any, ...]:  # picklable with its field, code and other attributes
        return (_rebuild, (type(self), self.args, self.param, self.code), dict(self.__dict__))

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _register(cls)


_register(TandemError)


def _rebuild(cls: type[TandemError], args: tuple[object, ...], param: str | None, code: str | None) -> TandemError:
    return cls(*args, param=param, code=code)


class InvalidRequest(TandemError):
    """A field, length, index, shape or dtype is out of the negotiated limits."""

    wire_name = "InvalidRequest"
    default_code = "invalid_value"


class ChecksumMismatch(TandemError):
    """A chunk's CRC32C does not match its bytes (after the allowed resends)."""

    wire_name = "ChecksumMismatch"


class MerkleMismatch(TandemError):
    """KV block leaves or the committed Merkle root do not verify."""

    wire_name = "MerkleMismatch"


class SessionOutOfSync(TandemError):
    """The peer's view of a session (token count, root) differs from ours; resync needed."""

    wire_name = "SessionOutOfSync"


class SessionNotFound(SessionOutOfSync):
    """The session is unknown to this side (never seen, evicted, or another principal's: ids are
    scoped by identity). A kind of ``SessionOutOfSync``: the edge resends from token 0."""

    wire_name = "SessionNotFound"


class QuotaExceeded(TandemError):
    """The link's concurrency or token quota, or the edge's memory for local sessions' KV, is used up."""

    wire_name = "QuotaExceeded"


class ParamsVersionMismatch(TandemError):
    """A message was made with link params other than the agreed version."""

    wire_name = "ParamsVersionMismatch"


class ModeUnavailable(TandemError):
    """The requested serving mode (or split layer) cannot run on this edge (no model for it)."""

    wire_name = "ModeUnavailable"
    default_param = "mode"
    default_code = "unsupported_value"


class TurnTooLarge(TandemError):
    """A turn larger than the whole of a bound it must fit in: its own KV slot (prompt +
    ``max_new_tokens`` rounded up to a slot size) beyond the edge's ``local_kv_bytes`` (local mode,
    remote prefill), or a split turn beyond one of the cloud's state or upload bounds alone
    (``edge_max_stored_bytes``, ``session_bytes``, ``max_upload_bytes[_per_peer]``). It can never
    run there, however long the client waits or whatever else is freed, unlike ``QuotaExceeded``:
    not worth retrying as it is; fewer tokens, another mode or a larger bound would fit
    (FAILED_PRECONDITION, HTTP 400).
    ``param``: the field to lower (``max_new_tokens``, or the prompt's when it alone is too large);
    code ``context_length_exceeded``, as OpenAI's for a request longer than its model takes."""

    wire_name = "TurnTooLarge"
    default_param = "max_new_tokens"
    default_code = "context_length_exceeded"


class IncompatibleModel(TandemError):
    """Edge head and cloud tail were not cut from the same model at the same split layer."""

    wire_name = "IncompatibleModel"


class UploadTimeout(TandemError):
    """The uplink did not complete the upload within the allowed time."""

    wire_name = "UploadTimeout"


class EngineError(TandemError):
    """A vLLM engine failed or is not running."""

    wire_name = "EngineError"


class LinkLost(EngineError):
    """The connection to the cloud broke under a call (the cloud process died, the link dropped),
    with no verdict from the cloud: what the edge retries once a cloud answers again."""

    wire_name = "LinkLost"


class Unauthenticated(TandemError):
    """The call carries no valid credentials (API key, client certificate)."""

    wire_name = "Unauthenticated"


class PermissionDenied(TandemError):
    """The caller is authenticated but the object it names (a link) belongs to another principal."""

    wire_name = "PermissionDenied"


class DeadlineExceeded(UploadTimeout):
    """The request's deadline passed (waiting for the session, the upload or the engines)."""

    wire_name = "DeadlineExceeded"


class CorruptPayload(InvalidRequest):
    """A payload passed its checksum but does not decode: not exactly one complete zstd frame
    of the announced raw size, or a size beyond the negotiated limits. Treated like a CRC
    failure (NACK / repair, then INVALID_ARGUMENT)."""

    wire_name = "CorruptPayload"


def error_from_name(name: str, message: str, base_names: tuple[str, ...] = (), retry_after_ms: int = 0) -> TandemError:
    """The domain error whose wire name is ``name``, else the first of ``base_names`` (its
    ancestors' wire names, most specific first) this process knows, else ``TandemError``; with
    ``retry_after_ms`` (> 0) as its retry hint."""
    cls = next((ERRORS_BY_NAME[n] for n in (name, *base_names) if n in ERRORS_BY_NAME), TandemError)
    err = cls(message)
    if retry_after_ms > 0:
        err.retry_after_ms = retry_after_ms  # type: ignore[attr-defined]
    return err


def base_names(err: TandemError) -> tuple[str, ...]:
    """Wire names of ``err``'s tandem ancestors, most specific first (``TandemError`` last)."""
    return tuple(c.wire_name for c in type(err).__mro__[1:] if issubclass(c, TandemError))
