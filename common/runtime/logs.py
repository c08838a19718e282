"""Logging of both daemons: text or one JSON object per line, every line of a request
carrying its ``request_id`` and ``session_id``.

The ids live in context variables bound at the start of a turn (``bind_request``: the
edge's ``EdgeNode.chat``, the cloud's ``Gateway.run_turn`` and servicer), so a log line
anywhere below, also in worker threads started with ``asyncio.to_thread`` (they copy the
context), carries them without passing them around. A turn logs its start (DEBUG), its end
(INFO: mode, tokens, time to first token) and a refusal (WARNING, with the error's kind);
no line carries a payload or prompt text. A servicer that authenticated its caller binds the
caller's identity (``set_caller``: ``key:edge-1``, ``cert:edge-1``), and every line of the call
carries it as ``caller``: the identity the credentials prove, whatever id the request claims.

Every line is one printable line in both formats: the formatters write the message, the ids and
every string ``extra`` through ``common.protocol.text.printable`` (controls, CR, LF, NUL, ANSI escapes and
lone surrogates escaped; each bounded), and the text format indents a traceback's lines, so no
string a peer sends (an id, a name, a header, a model name, an error message quoting it) can end
a line or start a forged one.
"""

from __future__ import annotations

import asyncio
import contextvars
import datetime
import json
import logging
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

from tandem.common.protocol.errors import TandemError
from tandem.common.protocol.text import printable

TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
MAX_ID_CHARS = 128  # ids come from the wire: bounded and printable before they reach a log line
MAX_MESSAGE_CHARS = 4096  # a log message (its arguments substituted), before the cut's marker
MAX_EXTRA_CHARS = 1024  # a string ``extra`` of a JSON line
MAX_TRACEBACK_CHARS = 16384  # a traceback (its exception's message included), before the cut's marker
TRACEBACK_INDENT = "  "  # the text format's traceback lines: none of them can look like a record

_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("tandem_request_id", default="")
_session_id: contextvars.ContextVar[str] = contextvars.ContextVar("tandem_session_id", default="")
_caller: contextvars.ContextVar[str] = contextvars.ContextVar("tandem_caller", default="")
_BOUND = ("request_id", "session_id", "caller")


def _clean(value: str) -> str:
    return printable(value, MAX_ID_CHARS)


def new_request_id() -> str:
    return uuid.uuid4().hex


def current_request_id() -> str:
    """The request id bound in this context ("" when none)."""
    return _request_id.get()


def set_ids(request_id: str, session_id: str) -> None:
    """Bind the ids for the rest of this context (a gRPC handler's own task: it ends with the call)."""
    _request_id.set(_clean(request_id))
    _session_id.set(_clean(session_id))


def set_caller(caller: object) -> None:
    """Bind the authenticated caller (a ``common.runtime.security.Principal``, as ``kind:name``) for the rest
    of this context: a servicer's call, right after ``identify``."""
    _caller.set(_clean(str(caller)))


def current_caller() -> str:
    """The caller bound in this context ("" when none)."""
    return _caller.get()


@contextmanager
def bind_request(request_id: str, session_id: str, caller: object | None = None) -> Iterator[None]:
    """Bind the ids (and ``caller``, when given: see ``set_caller``) for the ``with`` block (also
    across the yields of an async generator)."""
    pairs = [(_request_id, request_id), (_session_id, session_id)]
    if caller is not None:
        pairs.append((_caller, str(caller)))
    tokens = [(var, var.set(_clean(value))) for var, value in pairs]
    try:
        yield
    finally:
        for var, token in tokens:
            try:
                var.reset(token)
            except ValueError:  # an async generator closed from another context (e.g. by the GC)
                var.set(token.old_value if token.old_value is not contextvars.Token.MISSING else "")


class RequestIdsFilter(logging.Filter):
    """Adds ``request_id`` / ``session_id`` / ``caller`` to a record when bound (never fails a record)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name, var in zip(_BOUND, (_request_id, _session_id, _caller), strict=True):
            value = var.get()
            if value:
                setattr(record, name, value)
        return True


def message_of(record: logging.LogRecord) -> str:
    """The record's message, its arguments substituted, as one printable line (``printable``)."""
    return printable(record.getMessage(), MAX_MESSAGE_CHARS)


def _traceback_lines(text: str) -> list[str]:
    """A traceback's lines, each printable, the whole cut at ``MAX_TRACEBACK_CHARS``."""
    if len(text) > MAX_TRACEBACK_CHARS:
        text = f"{text[:MAX_TRACEBACK_CHARS]}\n...({len(text) - MAX_TRACEBACK_CHARS} more characters)"
    return [printable(line, MAX_MESSAGE_CHARS) for line in text.splitlines()]


def _indented(text: str) -> str:
    """A traceback as lines that each start with ``TRACEBACK_INDENT`` and are printable, bounded."""
    return "\n".join(TRACEBACK_INDENT + line for line in _traceback_lines(text))


class TextFormatter(logging.Formatter):
    """The daemons' text format, with ``[request_id=... session_id=... caller=...]`` when bound; one
    printable line per record (a traceback follows on indented lines)."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        ids = [f"{k}={_clean(str(v))}" for k in _BOUND if (v := getattr(record, k, ""))]
        message = message_of(record)
        saved = record.msg, record.args, record.exc_text
        # exc_text: another handler's formatter may have cached its own (unindented) traceback
        record.msg, record.args, record.exc_text = (f"[{' '.join(ids)}] {message}" if ids else message), None, None
        try:
            return super().format(record)
        finally:
            record.msg, record.args, record.exc_text = saved

    def formatException(self, ei: Any) -> str:
        return _indented(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return _indented(stack_info)


def _printable_fields(out: dict[str, Any]) -> None:
    """Every string field of a JSON line printable and bounded; ``exc_info`` and ``stack_info`` keep
    their lines (JSON escapes the breaks), each line made printable."""
    for k, v in out.items():
        if not isinstance(v, str):
            continue
        if k in ("exc_info", "stack_info"):
            out[k] = "\n".join(_traceback_lines(v))
        else:
            out[k] = printable(v, MAX_MESSAGE_CHARS if k == "message" else MAX_EXTRA_CHARS)


class _StdlibJsonFormatter(logging.Formatter):
    """``json_formatter`` where python-json-logger is not installed (an edge-only install):
    the same fields, ``extra`` values only when JSON can hold them."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": message_of(record),
        }
        skip = _RECORD_ATTRS | factory_attrs()
        for k, v in record.__dict__.items():
            if k not in skip and isinstance(v, str | int | float | bool | None):
                out[k] = v
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        _printable_fields(out)
        return json.dumps(out, ensure_ascii=False)


_RECORD_ATTRS = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime", "taskName"}
_FACTORY_ATTRS: tuple[Any, frozenset[str]] = (None, frozenset())


def factory_attrs() -> frozenset[str]:
    """The attributes the process's log record factory (``logging.getLogRecordFactory()``) puts on
    every record beyond a plain ``LogRecord``'s: library metadata, not a call's ``extra``, so the
    JSON formatters leave them out. vLLM installs such a factory when it is imported (it adds
    ``vllm_process_name`` for its own format). Cached per factory."""
    global _FACTORY_ATTRS
    factory = logging.getLogRecordFactory()
    if _FACTORY_ATTRS[0] is not factory:
        blank = factory("", logging.INFO, "", 0, "", None, None)
        _FACTORY_ATTRS = (factory, frozenset(blank.__dict__) - _RECORD_ATTRS)
    return _FACTORY_ATTRS[1]


def json_formatter() -> logging.Formatter:
    """One JSON object per line: ``time`` (ISO 8601, UTC), ``level``, ``logger``, ``message``,
    ``request_id`` / ``session_id`` / ``caller`` when bound, ``exc_info`` with a traceback, and any ``extra`` (not
    what the record factory adds to every record: ``factory_attrs``)."""
    try:
        from pythonjsonlogger.json import JsonFormatter
    except ImportError:
        return _StdlibJsonFormatter()

    class TandemJsonFormatter(JsonFormatter):
        def add_fields(self, log_data: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]) -> None:
            super().add_fields(log_data, record, message_dict)
            for name in factory_attrs():  # the record factory's metadata (``factory_attrs``)
                log_data.pop(name, None)
            _printable_fields(log_data)

    return TandemJsonFormatter(
        "{levelname}{name}{message}",
        style="{",
        rename_fields={"levelname": "level", "name": "logger"},
        timestamp="time",
    )


def setup_logging(fmt: str, level: str, stream: IO[str] | None = None) -> logging.Handler:
    """Configure the root logger: ``fmt`` "json" or "text", ``level`` a level name ("INFO").
    Replaces a handler an earlier call installed (idempotent); others are kept. Returns the handler.

    vLLM configures its own ``vllm`` logger (its own handler, not propagated): its lines stay in
    vLLM's text format.

    Raises:
        ValueError: unknown ``fmt`` or ``level``.
    """
    if fmt not in ("json", "text"):
        raise ValueError(f"log format {fmt!r}: json or text")
    lvl = logging.getLevelNamesMapping().get(level.upper())
    if lvl is None:
        raise ValueError(f"log level {level!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(json_formatter() if fmt == "json" else TextFormatter())
    handler.addFilter(RequestIdsFilter())
    handler.set_name("tandem")
    root = logging.getLogger()
    for h in [h for h in root.handlers if h.get_name() == "tandem"]:
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(lvl)
    return handler


def outcome_of(exc: BaseException | None) -> str:
    """How a turn ended, as a bounded label: "ok", the domain error's wire name, "cancelled"
    (the caller went away) or "internal" (a bug)."""
    if exc is None:
        return "ok"
    if isinstance(exc, TandemError):
        return exc.wire_name
    if isinstance(exc, GeneratorExit | asyncio.CancelledError):
        return "cancelled"
    return "internal"


@contextmanager
def turn_log(log: logging.Logger, mode: str, label: str = "mode") -> Iterator[dict[str, Any]]:
    """Log a turn's start (DEBUG) and its end: INFO "turn done" with the fields the block put in
    the yielded dict (tokens, ttft_ms...), WARNING "turn refused" with the error's kind, INFO
    "turn cancelled" (but "turn done" for a turn whose fields hold its ``finish`` reason: it
    completed, and the caller went away after its end). Every line starts with ``{label}={mode}``:
    the edge's is ``requested=`` (the mode the client asked for; the one that served it is the
    block's ``mode`` field, as the metrics' ``mode`` label), the cloud's ``mode=`` (it serves the
    mode asked). An unexpected exception is left to the servicer, which logs its traceback."""
    fields: dict[str, Any] = {}
    head = f"{label}={mode!s}"
    log.debug("turn start: %s", head)
    try:
        yield fields
    except BaseException as e:
        outcome = outcome_of(e)
        if isinstance(e, TandemError):
            log.warning("turn refused: %s %s: %s", head, outcome, e)
        elif outcome == "cancelled" and "finish" in fields:
            log.info("turn done: %s %s", head, " ".join(f"{k}={v}" for k, v in fields.items()))
        elif outcome == "cancelled":
            log.info("turn cancelled: %s", head)
        raise
    log.info("turn done: %s %s", head, " ".join(f"{k}={v}" for k, v in fields.items()))
