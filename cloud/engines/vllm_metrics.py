"""vLLM's own ``vllm:`` metrics of every engine in this process, in the default registry beside
tandem's (``vllm_stat_loggers``: one shared metric per name, whichever engine started last), and the
highest KV cache usage among them (``vllm_kv_cache_usage``); a stopped engine's series leave with it
(``forget_vllm_engines``)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Collection
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

_VLLM_SHARED: dict[str, Any] = {}


_VLLM_LOGGER_LOCK = threading.Lock()


def _shared_metric(cls: Any) -> Any:
    """A stand-in for a prometheus_client metric class that creates each metric name once per
    process and returns that one again (re-registered if vLLM unregistered it meanwhile)."""

    class Shared:
        def __new__(cls_, *args: Any, **kw: Any) -> Any:
            name = kw["name"] if "name" in kw else args[0]
            metric = _VLLM_SHARED.get(name)
            if metric is None:
                metric = _VLLM_SHARED[name] = cls(*args, **kw)
            else:
                with contextlib.suppress(ValueError):  # still registered
                    REGISTRY.register(metric)
            return metric

    Shared.__name__ = f"Shared{cls.__name__}"
    return Shared


def vllm_stat_loggers() -> list[Any]:
    """Stat logger factories for ``AsyncLLM.from_engine_args(..., stat_loggers=...)`` so that every
    engine of this process exports its ``vllm:`` metrics, told apart by their ``model_name`` label
    (the engine's checkpoint). vLLM's own ``PrometheusStatLogger`` unregisters every ``vllm:``
    collector when an engine starts, so of the tail and decode engines only the one started last
    would be seen. With this list and ``disable_log_stats=True`` vLLM logs no periodic stats."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    class SharedPrometheusStatLogger(PrometheusStatLogger):
        _gauge_cls = _shared_metric(Gauge)
        _counter_cls = _shared_metric(Counter)
        _histogram_cls = _shared_metric(Histogram)

        def __init__(self, *args: Any, **kw: Any) -> None:
            # engines start in parallel threads (cloud.engines.vllm_engines.VllmEngines.start): two loggers must
            # not create the same shared metric at once (prometheus_client refuses the second as a
            # duplicated timeseries), nor one unregister every vllm: collector amid another's creations
            with _VLLM_LOGGER_LOCK:
                super().__init__(*args, **kw)

    return [SharedPrometheusStatLogger]


def forget_vllm_engines(model_names: Collection[str]) -> int:
    """Remove the series of the engines labelled ``model_name`` in ``model_names`` from every shared
    ``vllm:`` metric: a stopped engine's last values are no longer exported nor counted by
    ``vllm_kv_cache_usage``; an engine started again on the same checkpoint creates its series anew.
    Returns the number of series removed.

    A series' label values are read back from its samples (their labels in the metric's label
    order, without a histogram bucket's ``le``), so only prometheus_client's public API is used."""
    names = set(model_names)
    removed = 0
    for metric in list(_VLLM_SHARED.values()):
        series = {
            tuple(v for n, v in s.labels.items() if n != "le")
            for family in metric.collect()
            for s in family.samples
            if s.labels.get("model_name") in names
        }
        for values in series:
            with contextlib.suppress(KeyError):  # removed meanwhile (another thread's shutdown)
                metric.remove(*values)
                removed += 1
    return removed


_KV_USAGE = "vllm:kv_cache_usage_perc"


def vllm_kv_cache_usage(registry: CollectorRegistry | None = None) -> float:
    """The highest ``vllm:kv_cache_usage_perc`` (0..1) among this process's engines; 0.0 without
    engines (vLLM's gauge, exported by ``vllm_stat_loggers``). ``registry``: this process's
    (``REGISTRY``) unless given."""
    best = 0.0
    # only the gauge's own collector: REGISTRY.collect() would walk every metric (vLLM's histograms
    # too), about 9 ms of the event loop per call on this machine
    for family in (REGISTRY if registry is None else registry).restricted_registry([_KV_USAGE]).collect():
        best = max([best, *(s.value for s in family.samples)])  # the restricted registry keeps only its samples
    return best
