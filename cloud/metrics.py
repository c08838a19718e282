"""The cloud daemon's Prometheus metrics (``Gateway``), in ``CLOUD``; the conventions they keep (names,
units, buckets, bounded printable labels, one registry per daemon) and the helpers they are made with:
``common.runtime.metrics``. vLLM's own ``vllm:`` metrics: ``cloud.engines.vllm_metrics``.

``tandem:cloud_queue_time_seconds{mode}`` (header to the first engine
request: upload, store put and session commit in split mode), ``tandem:cloud_store_put_seconds``,
``tandem:cloud_tail_prefill_seconds``, ``tandem:cloud_decode_first_token_seconds{mode}``,
``tandem:cloud_decode_seconds{mode}``, ``tandem:cloud_requests_total{mode,outcome}``,
``tandem:upload_rejections_total{reason}`` (turns refused before any engine ran, by error
class), ``tandem:received_bytes_total{kind=activations|kv}``, ``tandem:crc_failures_total``
(chunks NACKed: CRC32C mismatch or payload not decodable), ``tandem:kv_block_repair_requests_total``
(KV blocks asked again), ``tandem:engine_restarts_total``,
``tandem:cloud_sessions_ended_total{reason=ended|expired|evicted}``, gauges ``tandem:uploads_in_flight``,
``tandem:upload_bytes_reserved``, ``tandem:cloud_sessions``, ``tandem:cloud_session_bytes``,
``tandem:block_store_bytes``, ``tandem:links_active``, ``tandem:requests_running``, ``tandem:requests_waiting``,
``tandem:max_num_seqs``, and per link (bounded by ``max_links``; ``edge`` is the edge's id):
``tandem:link_share_seqs{edge,link}`` (its guaranteed share of ``max_num_seqs``),
``tandem:link_weight{edge,link}`` (the SLO controller's weight), ``tandem:link_slo_ttft_seconds`` and
``tandem:link_slo_itl_seconds`` (the p99 objectives its edge declared; 0 = none) and
``tandem:link_p99_ttft_seconds`` / ``tandem:link_p99_itl_seconds`` (the controller's last measurement).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from prometheus_client.core import GaugeMetricFamily

from tandem.common.runtime.logs import outcome_of
from tandem.common.runtime.metrics import (
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    MetricSet,
    label,
    observe,
    reader,
    seconds,
)
from tandem.stages import Stage

CLOUD = MetricSet()

SESSION_LOADS = CLOUD.counter(
    "tandem:session_loads",
    "Sessions loaded from the block store (a restarted node, another replica's): whole or partial.",
    ["outcome"],
)
CLOUD_QUEUE = CLOUD.histogram(
    "tandem:cloud_queue_time_seconds",
    "Header to the turn's first engine request (split: upload, store put, session commit), in seconds.",
    TTFT_BUCKETS,
    ["mode"],
)
CLOUD_STORE_PUT = CLOUD.histogram(
    "tandem:cloud_store_put_seconds", "Putting a turn's head KV blocks in the store, in seconds.", TTFT_BUCKETS
)
CLOUD_TAIL = CLOUD.histogram(
    "tandem:cloud_tail_prefill_seconds", "Tail prefill and first token (vLLM), in seconds.", TTFT_BUCKETS
)
CLOUD_TAIL_SAVE_WAIT = CLOUD.histogram(
    "tandem:cloud_tail_save_wait_seconds",
    "Split turns: wait after the first token for the tail engine's KV writes before the decode, in seconds.",
    TTFT_BUCKETS,
)
TAIL_SAVE_MISSING = CLOUD.counter(
    "tandem:cloud_tail_save_missing_blocks",
    "Tail KV blocks not in the store when the wait for them ended (the decode engine recomputed them).",
)
CLOUD_DECODE_FIRST = CLOUD.histogram(
    "tandem:cloud_decode_first_token_seconds",
    "Decode engine: request to its first step (KV handoff in split mode), in seconds.",
    TTFT_BUCKETS,
    ["mode"],
)
CLOUD_DECODE = CLOUD.histogram(
    "tandem:cloud_decode_seconds", "Decode engine, whole stream, in seconds.", REQUEST_LATENCY_BUCKETS, ["mode"]
)
CLOUD_REQUESTS = CLOUD.counter("tandem:cloud_requests", "Cloud turns by mode and outcome.", ["mode", "outcome"])
UPLOAD_REJECTIONS = CLOUD.counter(
    "tandem:upload_rejections", "Turns refused before any engine ran, by domain error.", ["reason"]
)
RECEIVED_BYTES = CLOUD.counter("tandem:received_bytes", "Upload payload bytes received, resends included.", ["kind"])
CRC_FAILURES = CLOUD.counter(
    "tandem:crc_failures", "Activation chunks NACKed (CRC32C mismatch or payload not decodable)."
)
REPAIR_REQUESTS = CLOUD.counter("tandem:kv_block_repair_requests", "KV blocks the cloud asked for again.")
ENGINE_RESTARTS = CLOUD.counter("tandem:engine_restarts", "vLLM engine restarts after an engine died.")
UPLOADS_IN_FLIGHT = CLOUD.gauge("tandem:uploads_in_flight", "Split uploads holding upload budget.")
UPLOAD_BYTES_RESERVED = CLOUD.gauge(
    "tandem:upload_bytes_reserved", "Upload budget bytes reserved by uploads in flight."
)
CLOUD_SESSIONS = CLOUD.gauge("tandem:cloud_sessions", "Sessions the cloud holds.")
CLOUD_SESSION_BYTES = CLOUD.gauge(
    "tandem:cloud_session_bytes", "Bytes the cloud's sessions hold (activations, leaves)."
)
CLOUD_SESSIONS_ENDED = CLOUD.counter(
    "tandem:cloud_sessions_ended",
    "Cloud sessions dropped from memory, by reason: ended (EndSession), expired (idle), evicted "
    "(a bound: per edge or in total); the block store keeps the expired and evicted ones' records.",
    ["reason"],
)
BLOCK_STORE_BYTES = CLOUD.gauge("tandem:block_store_bytes", "Bytes in the KV block store (NaN when it cannot tell).")
LINKS_ACTIVE = CLOUD.gauge("tandem:links_active", "Edge links holding a share of the engines.")
REQUESTS_RUNNING = CLOUD.gauge("tandem:requests_running", "Requests admitted into the engines.")
REQUESTS_WAITING = CLOUD.gauge("tandem:requests_waiting", "Requests waiting for an engine slot.")


class LinkShares:
    """Per-link gauges read from a ``cloud.links.table.LinkTable`` at scrape time (see module doc); one
    collector per process, reading the table ``watch_links`` named last. Its label values go through
    ``label`` as every metric's do."""

    LINK = ("edge", "link")
    FAMILIES = (
        ("tandem:max_num_seqs", "Sequences the engines batch at most (the links' shares add up to it).", ()),
        ("tandem:link_share_seqs", "A link's share of max_num_seqs: its priority when every slot is taken.", LINK),
        ("tandem:link_weight", "A link's weight, which the SLO controller moves.", LINK),
        ("tandem:link_slo_ttft_seconds", "The p99 TTFT objective the link's edge declared (0 = none).", LINK),
        ("tandem:link_slo_itl_seconds", "The p99 ITL objective the link's edge declared (0 = none).", LINK),
        ("tandem:link_p99_ttft_seconds", "The link's p99 TTFT at the controller's last step.", LINK),
        ("tandem:link_p99_itl_seconds", "The link's p99 ITL at the controller's last step.", LINK),
    )

    def __init__(self) -> None:
        self.table: Callable[[], Any] = lambda: None

    def describe(self) -> list[Any]:
        return [GaugeMetricFamily(name, doc, labels=list(labels)) for name, doc, labels in self.FAMILIES]

    def exported_labels(self) -> dict[str, set[str]]:
        return {name: set(labels) for name, _, labels in self.FAMILIES}

    def collect(self) -> Iterator[Any]:
        fams = {name: GaugeMetricFamily(name, doc, labels=list(labels)) for name, doc, labels in self.FAMILIES}
        table = self.table()
        if table is not None:
            try:
                self._read(table, fams)
            except (RuntimeError, AttributeError):  # changed by the event loop meanwhile: this scrape has none
                fams = {name: GaugeMetricFamily(name, doc, labels=list(lb)) for name, doc, lb in self.FAMILIES}
        yield from fams.values()

    @staticmethod
    def _read(table: Any, fams: dict[str, Any]) -> None:
        fams["tandem:max_num_seqs"].add_metric([], table.max_num_seqs)
        last: dict[str, Any] = {}
        for point in list(table.trace)[-4 * max(1, len(table.links())) :]:
            last[point.link_id] = point
        for lk in table.links():
            ids = [label(lk.edge_id), label(lk.link_id)]
            fams["tandem:link_share_seqs"].add_metric(ids, lk.share[0])
            fams["tandem:link_weight"].add_metric(ids, lk.weight)
            fams["tandem:link_slo_ttft_seconds"].add_metric(ids, lk.slo.ttft_ms / 1e3)
            fams["tandem:link_slo_itl_seconds"].add_metric(ids, lk.slo.itl_p99_ms / 1e3)
            p = last.get(lk.link_id)
            if p is not None and p.p99_ttft_ms is not None:
                fams["tandem:link_p99_ttft_seconds"].add_metric(ids, p.p99_ttft_ms / 1e3)
            if p is not None and p.p99_itl_ms is not None:
                fams["tandem:link_p99_itl_seconds"].add_metric(ids, p.p99_itl_ms / 1e3)


LINK_SHARES = CLOUD.collector(LinkShares())


def register() -> None:
    """Put the cloud's metrics in the default registry (idempotent); ``Gateway``'s start does, through
    ``watch_*``."""
    CLOUD.register()


def exported_labels() -> dict[str, set[str]]:
    """The sample names the cloud exports, each with its label names (``MetricSet.exported_labels``)."""
    return CLOUD.exported_labels()


# ------------------------------------------------------------------ scrape-time gauges


def watch_cloud(sessions: Any, budget: Any, store: Any) -> None:
    """Export the cloud's metrics; report a gateway's sessions, upload budget and block store in its gauges."""
    register()
    UPLOADS_IN_FLIGHT.set_function(reader(budget, lambda b: b.uploads))
    UPLOAD_BYTES_RESERVED.set_function(reader(budget, lambda b: b.nbytes))
    CLOUD_SESSIONS.set_function(reader(sessions, len))
    CLOUD_SESSION_BYTES.set_function(reader(sessions, lambda s: s.nbytes()))
    BLOCK_STORE_BYTES.set_function(reader(store, lambda s: s.volume_bytes()))


def watch_links(table: Any) -> None:
    """Export a ``cloud.links.table.LinkTable``'s counts at scrape time."""
    register()
    LINKS_ACTIVE.set_function(reader(table, lambda t: len(t.active())))
    REQUESTS_RUNNING.set_function(reader(table, lambda t: t.running))
    REQUESTS_WAITING.set_function(reader(table, lambda t: t.waiting))
    LINK_SHARES.table = weakref.ref(table)


# ------------------------------------------------------------------ events


def record_cloud_session_end(reason: str) -> None:
    """``reason``: ``ended``, ``expired`` or ``evicted``."""
    CLOUD_SESSIONS_ENDED.labels(reason).inc()


def record_session_load(whole: bool) -> None:
    SESSION_LOADS.labels("whole" if whole else "partial").inc()


def record_received(received_bytes: Mapping[str, int], crc_failures: int) -> None:
    """One upload's receiving, at its end (refused uploads too)."""
    for kind, n in received_bytes.items():
        if n:
            RECEIVED_BYTES.labels(kind).inc(n)
    if crc_failures:
        CRC_FAILURES.inc(crc_failures)


def record_repair_request(blocks: int) -> None:
    REPAIR_REQUESTS.inc(blocks)


def record_tail_save_missing(blocks: int) -> None:
    TAIL_SAVE_MISSING.inc(blocks)


def record_engine_restart() -> None:
    ENGINE_RESTARTS.inc()


class CloudTurnTimes(Protocol):
    @property
    def t_start(self) -> float: ...

    @property
    def t_engine(self) -> float | None: ...  # perf_counter at the first engine request, None if none ran

    @property
    def timings(self) -> Mapping[Stage, float]: ...

    @property
    def final_sent(self) -> bool: ...  # its final went to the caller: the turn completed


@contextlib.contextmanager
def cloud_turn(mode: str, turn: CloudTurnTimes) -> Iterator[None]:
    """Record one cloud turn's metrics when the ``with`` block ends, however it ends: a turn whose
    final went to the caller is ``ok`` even when the caller's cancel ends the block (an edge ends a
    remote-prefill call as soon as it has the final)."""
    exc: BaseException | None = None
    try:
        yield
    except BaseException as e:
        exc = e
        raise
    finally:
        outcome = outcome_of(exc)
        if outcome == "cancelled" and turn.final_sent:
            outcome = "ok"
        CLOUD_REQUESTS.labels(mode, outcome).inc()
        if turn.t_engine is None:
            if outcome not in ("ok", "cancelled", "internal"):
                UPLOAD_REJECTIONS.labels(outcome).inc()
        else:
            CLOUD_QUEUE.labels(mode).observe(turn.t_engine - turn.t_start)
        t = turn.timings
        observe(CLOUD_STORE_PUT, seconds(t, Stage.CLOUD_STORE_PUT))
        observe(CLOUD_TAIL, seconds(t, Stage.CLOUD_TAIL_PREFILL))
        observe(CLOUD_TAIL_SAVE_WAIT, seconds(t, Stage.CLOUD_TAIL_SAVE_WAIT))
        observe(CLOUD_DECODE_FIRST.labels(mode), seconds(t, Stage.CLOUD_DECODE_FIRST_TOKEN))
        observe(CLOUD_DECODE.labels(mode), seconds(t, Stage.CLOUD_DECODE))
