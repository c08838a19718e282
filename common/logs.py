"""Logging of both daemons: text or one JSON object per line, every line of a request
carrying its ``request_id`` and ``session_id``.

The ids live in context variables bound at the start of a turn (``bind_request``: the
edge's ``EdgeNode.chat``, the cloud's ``Gateway.run_turn`` and servicer), so a log line
anywhere below, also in worker threads started with ``asyncio.to_thread`` (they copy the
context), carries them without passing them around. A turn logs its start (DEBUG), its end
(INFO: mode, tokens, time to first token) and a refusal (WARNING, with the error's kind);
no line carries a payload or prompt text.
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

from tandem.common.errors import TandemError

TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
MAX_ID_CHARS = 128  # ids come from the wire: bounded and printable before they reach a log line

_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("tandem_request_id", default="")
_session_id: contextvars.ContextVar[str] = contextvars.ContextVar("tandem_session_id", default="")


def _clean(value: str) -> str:
    value = value[:MAX_ID_CHARS]
    return value if value.isprintable() else "".join(c if c.isprintable() else "?" for c in value)


def new_request_id() -> str:
    return uuid.uuid4().hex


def current_request_id() -> str:
    """The request id bound in this context ("" when none)."""
    return _request_id.get()


def set_ids(request_id: str, session_id: str) -> None:
    """Bind the ids for the rest of this context (a gRPC handler's own task: it ends with the call)."""
    _request_id.set(_clean(request_id))
    _session_id.set(_clean(session_id))


@contextmanager
def bind_request(request_id: str, session_id: str) -> Iterator[None]:
    """Bind the ids for the ``with`` block (also across the yields of an async generator)."""
    tokens = (_request_id.set(_clean(request_id)), _session_id.set(_clean(session_id)))
    try:
        yield
    finally:
        for var, token in zip((_request_id, _session_id), tokens, strict=True):
            try:
                var.reset(token)
            except ValueError:  # an async generator closed from another context (e.g. by the GC)
                var.set(token.old_value if token.old_value is not contextvars.Token.MISSING else "")


class RequestIdsFilter(logging.Filter):
    """Adds ``request_id`` / ``session_id`` to a record when bound (never fails a record)."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid, sid = _request_id.get(), _session_id.get()
        if rid:
            record.request_id = rid
        if sid:
            record.session_id = sid
        return True


class TextFormatter(logging.Formatter):
    """The daemons' text format, with ``[request_id=... session_id=...]`` when bound."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        ids = [f"{k}={v}" for k in ("request_id", "session_id") if (v := getattr(record, k, ""))]
        if not ids:
            return super().format(record)
        saved = record.msg, record.args
        record.msg, record.args = f"[{' '.join(ids)}] {record.getMessage()}", None
        try:
            return super().format(record)
        finally:
            record.msg, record.args = saved


class _StdlibJsonFormatter(logging.Formatter):
    """``json_formatter`` where python-json-logger is not installed (an edge-only install):
    the same fields, ``extra`` values only when JSON can hold them."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        skip = _RECORD_ATTRS | factory_attrs()
        for k, v in record.__dict__.items():
            if k not in skip and isinstance(v, str | int | float | bool | None):
                out[k] = v
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
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
    ``request_id`` / ``session_id`` when bound, ``exc_info`` with a traceback, and any ``extra`` (not
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
def turn_log(log: logging.Logger, mode: str) -> Iterator[dict[str, Any]]:
    """Log a turn's start (DEBUG) and its end: INFO "turn done" with the fields the block put in
    the yielded dict (tokens, ttft_ms...), WARNING "turn refused" with the error's kind, INFO
    "turn cancelled". An unexpected exception is left to the servicer, which logs its traceback."""
    fields: dict[str, Any] = {}
    log.debug("turn start: mode=%s", mode)
    try:
        yield fields
    except BaseException as e:
        outcome = outcome_of(e)
        if isinstance(e, TandemError):
            log.warning("turn refused: mode=%s %s: %s", mode, outcome, e)
        elif outcome == "cancelled":
            log.info("turn cancelled: mode=%s", mode)
        raise
    log.info("turn done: mode=%s %s", mode, " ".join(f"{k}={v}" for k, v in fields.items()))
