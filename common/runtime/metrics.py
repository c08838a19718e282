"""What both daemons' Prometheus metrics share: metrics named in vLLM's style
(``vllm:time_to_first_token_seconds``) with a ``tandem:`` prefix, latencies in seconds with vLLM's
bucket families, counters exported with ``_total``. Labels are bounded (mode, outcome, kind, reason,
state, and the cloud's per-link edge and link ids, at most ``max_links``), never request or session
ids; every label value goes through ``common.protocol.text.printable`` (escaped, at most
``MAX_LABEL_CHARS``: ``label``) in the metric objects' own ``labels`` and in the per-link collector,
whoever calls it.

Each daemon's metrics are a ``MetricSet`` kept by its role: the edge's in ``tandem.edge.metrics``
(``EdgeNode``), the cloud's in ``tandem.cloud.metrics`` (``Gateway``). Their metric objects are module
globals, created once per process outside any registry and put in the default registry by the first
``EdgeNode`` or ``Gateway`` (the role's ``watch_*``), so each daemon exports only its own; the gauges
read that daemon's state at scrape time (``reader``, the latest one ``watch_*``-ed). Here too: the
stage-time helpers of the turn recorders (``seconds``, ``observe``) and ``start_metrics_server``, which
serves the default registry, so in the cloud vLLM's own ``vllm:`` metrics (registered in-process by
``AsyncLLM`` when its stats are on, through ``tandem.cloud.engines.vllm_metrics``) come out of the same
port. Nothing here names a metric of either daemon.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server

from tandem.common.protocol.text import printable
from tandem.stages import Stage

# vLLM's bucket families (vllm/v1/metrics/buckets.py), copied: the edge does not install vLLM.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# the cost model's relative prediction errors
RATIO_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)

MAX_LABEL_CHARS = 64  # a label value, before the cut's marker


def label(value: object) -> str:
    """A label value as Prometheus gets it: printable and bounded (``common.protocol.text.printable``)."""
    return printable(value, MAX_LABEL_CHARS)


class _PrintableLabels:
    """Mixin of the metric classes: ``labels`` takes every value through ``label``."""

    def labels(self, *values: Any, **by_name: Any) -> Any:
        return super().labels(*map(label, values), **{k: label(v) for k, v in by_name.items()})  # type: ignore[misc]


_KINDS: dict[type, type] = {
    k: type(k.__name__, (_PrintableLabels, k), {"__module__": __name__}) for k in (Counter, Gauge, Histogram)
}


class ExportedCollector(Protocol):
    """A custom collector of a ``MetricSet`` (the cloud's per-link gauges): it takes its label values
    through ``label`` itself and names what it exports."""

    def describe(self) -> Iterable[Any]: ...

    def collect(self) -> Iterable[Any]: ...

    def exported_labels(self) -> dict[str, set[str]]: ...


C = TypeVar("C", bound=ExportedCollector)


class MetricSet:
    """One daemon's metrics: made outside any registry, each metric's label values printable and
    bounded (``label``); ``register`` puts them all in the default registry."""

    def __init__(self) -> None:
        self.members: list[Any] = []

    def _add(self, kind: type, name: str, doc: str, labels: Sequence[str], **kw: Any) -> Any:
        metric = _KINDS[kind](name, doc, labels, registry=None, **kw)
        self.members.append(metric)
        return metric

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        """A counter, exported as ``name`` + ``_total``."""
        return self._add(Counter, name, doc, labels)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return self._add(Gauge, name, doc, labels)

    def histogram(self, name: str, doc: str, buckets: Sequence[float], labels: Sequence[str] = ()) -> Histogram:
        return self._add(Histogram, name, doc, labels, buckets=buckets)

    def collector(self, collector: C) -> C:
        self.members.append(collector)
        return collector

    def register(self) -> None:
        """Put every metric of the set in the default registry (idempotent)."""
        for m in self.members:
            with contextlib.suppress(ValueError):  # registered already
                REGISTRY.register(m)

    def exported_labels(self) -> dict[str, set[str]]:
        """The sample names the set exports, each with its label names: counters with ``_total``,
        histograms with ``_bucket`` (and its ``le``), ``_sum`` and ``_count``, gauges as named. For
        dashboards and alerts to be checked against (tests/unit/test_dashboard.py)."""
        out: dict[str, set[str]] = {}
        for m in self.members:
            if isinstance(m, Counter):
                out[m._name + "_total"] = set(m._labelnames)
            elif isinstance(m, Histogram):
                out |= {m._name + x: set(m._labelnames) for x in ("_sum", "_count")}
                out[m._name + "_bucket"] = {*m._labelnames, "le"}
            elif isinstance(m, Gauge):
                out[m._name] = set(m._labelnames)
            else:
                out |= m.exported_labels()
        return out


def start_metrics_server(host: str, port: int) -> int:
    """Serve the default registry at ``http://host:port/metrics`` from a daemon thread; port 0 =
    any free one. Returns the bound port.

    Raises:
        OSError: the port could not be bound.
    """
    server, _thread = start_http_server(port, addr=host, registry=REGISTRY)
    return int(server.server_port)


def reader(obj: Any, read: Callable[[Any], float]) -> Callable[[], float]:
    """``read(obj)`` at scrape time, for a gauge's ``set_function``; NaN once ``obj`` is gone or
    while it is being changed (the scrape runs on the server's thread, the state on the event loop)."""
    ref = weakref.ref(obj)

    def value() -> float:
        o = ref()
        if o is None:
            return math.nan
        try:
            return float(read(o))
        except (RuntimeError, AttributeError):
            return math.nan

    return value


def seconds(timings: Mapping[Stage, float], stage: Stage) -> float | None:
    """A turn's time of ``stage`` in seconds (its timings are in ms); None where the stage did not run."""
    ms = timings.get(stage)
    return None if ms is None else ms / 1e3


def observe(h: Any, value: float | None) -> None:
    """``h.observe(value)`` unless ``value`` is None (a stage that did not run)."""
    if value is not None:
        h.observe(value)
