"""OpenTelemetry spans per stage of a turn, off by default.

Edge: ``edge_turn`` > ``tokenize``, ``edge_head``, ``encode``, ``uplink`` (send until the cloud
verified the upload). Cloud: ``cloud_turn`` > ``cloud_upload``, ``cloud_store_put``,
``cloud_tail_prefill``, ``cloud_decode``. With the in-process link (tests) the cloud's turn
nests in the edge's; over gRPC each daemon exports its own trace, and the spans share the
``request_id`` attribute.

``setup_tracing(True, ...)`` turns it on once per process; until then (or when the
OpenTelemetry SDK is not installed) ``span`` returns a shared no-op context manager and
``traced`` calls the function itself, so instrumented code pays one global lookup.

The span in progress is kept in this module's own context variable, not in OpenTelemetry's
current context, so a span that lives across the yields of an async generator never leaves
another task's context attached (a generator may be closed from another context).

Every string attribute, and the message of a recorded exception, is written through
``common.protocol.text.printable`` (escaped, at most ``MAX_ATTR_CHARS``): span attributes carry ids and
names a peer chose.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar, cast

from tandem.common.protocol.text import printable

log = logging.getLogger("tandem.tracing")
MAX_ATTR_CHARS = 256  # a string span attribute, before the cut's marker

F = TypeVar("F", bound=Callable[..., Any])
AttrValue = str | bool | int | float

_tracer: Any = None  # opentelemetry.trace.Tracer while enabled
_provider: Any = None
_current: contextvars.ContextVar[Any] = contextvars.ContextVar("tandem_span", default=None)
_NOOP = contextlib.nullcontext()
OTLP_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def setup_tracing(enabled: bool, service_name: str, endpoint: str | None = None, exporter: Any = None) -> bool:
    """Turn tracing on or off for this process (an earlier provider is shut down, flushing it).

    Spans go to ``exporter`` if given (an OpenTelemetry ``SpanExporter``, e.g. the SDK's
    ``InMemorySpanExporter`` in tests, exported synchronously); else to the console (one JSON
    object per span on stdout) for ``endpoint`` "console"; else over OTLP/gRPC to ``endpoint``
    ("http://collector:4317") or, when None, to where the ``OTEL_EXPORTER_OTLP_*`` variables
    say; with neither, to the console. Returns whether tracing is on (False also when the
    SDK or the OTLP exporter is not installed).
    """
    global _tracer, _provider
    if _provider is not None:
        _tracer, provider, _provider = None, _provider, None
        provider.shutdown()
    if not enabled:
        return False
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor
    except ImportError:
        log.warning("tracing requested but opentelemetry-sdk is not installed: tracing stays off")
        return False
    if endpoint is None and any(os.environ.get(v) for v in OTLP_ENDPOINT_VARS):
        endpoint = ""  # the OTLP exporter reads them
    if exporter is not None:
        processor: Any = SimpleSpanProcessor(exporter)
    elif endpoint is None or endpoint == "console":
        exporter, processor = ConsoleSpanExporter(), None
    else:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.warning("tracing requested but opentelemetry-exporter-otlp is not installed: tracing stays off")
            return False
        exporter, processor = OTLPSpanExporter(endpoint=endpoint or None), None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}), shutdown_on_exit=True)
    provider.add_span_processor(processor or BatchSpanProcessor(exporter))
    _provider, _tracer = provider, provider.get_tracer("tandem")
    log.info("tracing on: service %s, spans to %s %s", service_name, type(exporter).__name__, endpoint or "")
    return True


def enabled() -> bool:
    return _tracer is not None


def _printable(attrs: dict[str, AttrValue]) -> dict[str, AttrValue] | None:
    """Span attributes with every string printable and bounded (None for none)."""
    return {k: printable(v, MAX_ATTR_CHARS) if isinstance(v, str) else v for k, v in attrs.items()} or None


@contextlib.contextmanager
def _span(name: str, attrs: dict[str, AttrValue]) -> Iterator[Any]:
    from opentelemetry import trace
    from opentelemetry.trace import Status, StatusCode

    parent = _current.get()
    ctx = trace.set_span_in_context(parent) if parent is not None else None
    s = _tracer.start_span(name, context=ctx, attributes=_printable(attrs))
    token = _current.set(s)
    try:
        yield s
    except BaseException as e:
        if not isinstance(e, GeneratorExit | asyncio.CancelledError):
            s.record_exception(e, attributes={"exception.message": printable(e, MAX_ATTR_CHARS)})
            s.set_status(Status(StatusCode.ERROR, type(e).__name__))
        raise
    finally:
        s.end()
        try:
            _current.reset(token)
        except ValueError:  # closed from another context
            _current.set(parent)


def span(name: str, **attrs: AttrValue) -> contextlib.AbstractContextManager[Any]:
    """A span around the ``with`` block, child of the span in progress; a no-op while tracing is off."""
    if _tracer is None:
        return _NOOP
    return _span(name, attrs)


class _Handle:
    """A span ended explicitly (idempotent ``end``), for a stage that ends mid-function."""

    def __init__(self, s: Any) -> None:
        self._s = s

    def end(self) -> None:
        if self._s is not None:
            self._s.end()
            self._s = None


_NOOP_HANDLE = _Handle(None)


def start_span(name: str, **attrs: AttrValue) -> _Handle:
    """A span, child of the span in progress, that lasts until ``.end()`` (never current itself)."""
    if _tracer is None:
        return _NOOP_HANDLE
    from opentelemetry import trace

    parent = _current.get()
    ctx = trace.set_span_in_context(parent) if parent is not None else None
    return _Handle(_tracer.start_span(name, context=ctx, attributes=_printable(attrs)))


async def _traced_agen(name: str, gen: AsyncIterator[Any]) -> AsyncIterator[Any]:
    with span(name):
        async with contextlib.aclosing(gen) as g:  # type: ignore[type-var]
            async for item in g:
                yield item


async def _traced_coro(name: str, coro: Any) -> Any:
    with span(name):
        return await coro


def traced(name: str) -> Callable[[F], F]:
    """Decorator: each call of a function, coroutine function or async generator function runs
    in a span ``name``. While tracing is off the call goes straight to the function."""

    def wrap(f: F) -> F:
        if inspect.isasyncgenfunction(f):

            @functools.wraps(f)
            def agen(*a: Any, **k: Any) -> Any:
                return f(*a, **k) if _tracer is None else _traced_agen(name, f(*a, **k))

            return cast(F, agen)
        if inspect.iscoroutinefunction(f):

            @functools.wraps(f)
            def coro(*a: Any, **k: Any) -> Any:
                return f(*a, **k) if _tracer is None else _traced_coro(name, f(*a, **k))

            return cast(F, coro)

        @functools.wraps(f)
        def sync(*a: Any, **k: Any) -> Any:
            if _tracer is None:
                return f(*a, **k)
            with span(name):
                return f(*a, **k)

        return cast(F, sync)

    return wrap
