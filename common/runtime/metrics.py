"""Prometheus metrics of both daemons, named in vLLM's style (``vllm:time_to_first_token_seconds``)
with a ``tandem:`` prefix: latencies in seconds with vLLM's buckets, counters exported with
``_total``. Labels are bounded (mode, outcome, kind, reason, state, and the cloud's per-link edge and
link ids, at most ``max_links``), never request or session ids; every label value goes through
``common.protocol.text.printable`` (escaped, at most ``MAX_LABEL_CHARS``) in the metric objects' own
``labels`` and in the per-link collector, whoever calls it.

Edge (``EdgeNode``): ``tandem:time_to_first_token_seconds{mode}``,
``tandem:inter_token_latency_seconds{mode}`` (one sample per arrival of new tokens, as vLLM),
``tandem:e2e_request_latency_seconds{mode}``, ``tandem:edge_head_seconds``,
``tandem:uplink_seconds`` (send until the cloud verified the upload),
``tandem:requests_total{mode,outcome}`` (outcome "ok", the domain error's class name,
"cancelled" or "internal"), ``tandem:prompt_tokens_total{mode}``,
``tandem:generation_tokens_total{mode}``, ``tandem:edge_head_tokens_total``,
``tandem:uplink_bytes_total{kind=activations|kv|header}`` (resends included),
``tandem:chunk_resends_total``, ``tandem:kv_block_repairs_total``,
``tandem:session_resyncs_total`` (resends from token 0), ``tandem:ttft_prediction_error_ratio{mode}``
(the cost model's relative error; ``tandem:prediction_error_ratio{mode,quantity}`` for its
end-to-end and cloud engine times), ``tandem:mode_fallbacks_total{reason}`` (auto turns served locally
because the cloud refused), ``tandem:sessions_ended_total{reason=ended|expired|evicted}``, gauges
``tandem:sessions``, ``tandem:session_bytes``, ``tandem:link_rtt_ms``, ``tandem:link_goodput_mbps``,
``tandem:cloud_connected`` and ``tandem:cloud_replicas{state=answering|down}`` (the replicas known
now, by DNS or by list).

Cloud (``Gateway``): ``tandem:cloud_queue_time_seconds{mode}`` (header to the first engine
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

The metric objects are module globals, created once per process and put in the default
registry by the first ``EdgeNode`` or ``Gateway`` (``watch_*``), so each daemon exports only
its own; the gauges read that daemon's state at scrape time (the latest one ``watch_*``-ed).
``start_metrics_server`` serves the default registry, so in the cloud vLLM's own ``vllm:``
metrics (registered in-process by ``AsyncLLM`` when its stats are on, through
``tandem.cloud.engines.vllm_metrics``) come out of the same port.
"""

from __future__ import annotations

import contextlib
import math
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from tandem.common.protocol.text import printable
from tandem.common.runtime.logs import outcome_of
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

_BY_ROLE: dict[str, list[Any]] = {"edge": [], "cloud": []}
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


def _metric(role: str, kind: type, name: str, doc: str, labels: Sequence[str] = (), **kw: Any) -> Any:
    """A metric of ``role`` ("edge" or "cloud"), put in the default registry by ``register(role)``;
    its label values printable and bounded (``label``)."""
    metric = _KINDS[kind](name, doc, labels, registry=None, **kw)
    _BY_ROLE[role].append(metric)
    return metric


def _histogram(role: str, name: str, doc: str, buckets: Sequence[float], labels: Sequence[str] = ()) -> Histogram:
    return _metric(role, Histogram, name, doc, labels, buckets=buckets)


# ------------------------------------------------------------------ edge

TTFT = _histogram(
    "edge",
    "tandem:time_to_first_token_seconds",
    "Time to first token at the edge (tokenize, head, uplink, cloud's tail prefill), in seconds.",
    TTFT_BUCKETS,
    ["mode"],
)
ITL = _histogram(
    "edge",
    "tandem:inter_token_latency_seconds",
    "Time between arrivals of new output tokens at the edge, in seconds.",
    ITL_BUCKETS,
    ["mode"],
)
E2E = _histogram(
    "edge",
    "tandem:e2e_request_latency_seconds",
    "Edge turn latency, start to the final event, of turns that completed, in seconds.",
    REQUEST_LATENCY_BUCKETS,
    ["mode"],
)
EDGE_HEAD = _histogram(
    "edge", "tandem:edge_head_seconds", "ONNX head over a turn's new tokens, in seconds.", TTFT_BUCKETS
)
UPLINK_TIME = _histogram(
    "edge", "tandem:uplink_seconds", "Sending a split upload until the cloud verified it, in seconds.", TTFT_BUCKETS
)
REQUESTS = _metric("edge", Counter, "tandem:requests", "Edge turns by mode and outcome.", ["mode", "outcome"])
PROMPT_TOKENS = _metric("edge", Counter, "tandem:prompt_tokens", "Prompt tokens of completed edge turns.", ["mode"])
GENERATION_TOKENS = _metric(
    "edge", Counter, "tandem:generation_tokens", "Output tokens of completed edge turns.", ["mode"]
)
HEAD_TOKENS = _metric("edge", Counter, "tandem:edge_head_tokens", "Tokens run through the edge's head.")
UPLINK_BYTES = _metric("edge", Counter, "tandem:uplink_bytes", "Bytes sent to the cloud, resends included.", ["kind"])
CHUNK_RESENDS = _metric("edge", Counter, "tandem:chunk_resends", "Activation chunks sent again after a NACK.")
KV_REPAIRS = _metric("edge", Counter, "tandem:kv_block_repairs", "KV blocks sent again on the cloud's request.")
SESSION_RESYNCS = _metric(
    "edge", Counter, "tandem:session_resyncs", "Turns resent from token 0 because the cloud lost the session."
)
TURN_RESUMES = _metric(
    "edge", Counter, "tandem:turn_resumes", "Turns continued after their cloud failed mid-stream (no token repeated)."
)
UPLOAD_KEPT_TOKENS = _metric(
    "edge",
    Counter,
    "tandem:upload_kept_tokens",
    "Prompt tokens of cut uploads that the cloud had acknowledged keeping (WindowAck.held_tokens): "
    "a resumed upload does not send them again.",
)
SESSION_SYNCS = _metric(
    "edge",
    Counter,
    "tandem:session_syncs",
    "SyncSession calls, by outcome: in_sync, partial (the cloud lacked some), lost (it held nothing usable).",
    ["outcome"],
)
SESSION_LOADS = _metric(
    "cloud",
    Counter,
    "tandem:session_loads",
    "Sessions loaded from the block store (a restarted node, another replica's): whole or partial.",
    ["outcome"],
)
PREDICTION_ERROR = _histogram(
    "edge",
    "tandem:ttft_prediction_error_ratio",
    "|measured - predicted| / measured TTFT of the cost model, per served mode.",
    (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0),
    ["mode"],
)
OTHER_PREDICTION_ERROR = _histogram(
    "edge",
    "tandem:prediction_error_ratio",
    "|measured - predicted| / measured of the cost model's end-to-end time and cloud engine time, per mode.",
    (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0),
    ["mode", "quantity"],
)
MODE_FALLBACKS = _metric(
    "edge", Counter, "tandem:mode_fallbacks", "Turns the cloud refused and local mode served instead.", ["reason"]
)
LINK_RTT = _metric("edge", Gauge, "tandem:link_rtt_ms", "Smoothed round-trip time edge <-> cloud, in ms.")
LINK_GOODPUT = _metric("edge", Gauge, "tandem:link_goodput_mbps", "Smoothed uplink goodput, in Mbit/s.")
CLOUD_CONNECTED = _metric("edge", Gauge, "tandem:cloud_connected", "1 while the link is negotiated and answering.")
CLOUD_REPLICAS = _metric(
    "edge",
    Gauge,
    "tandem:cloud_replicas",
    "Cloud replicas the edge knows now (by DNS or by list), answering or down.",
    ["state"],
)
SESSIONS = _metric("edge", Gauge, "tandem:sessions", "Chat sessions the edge holds.")
SESSIONS_ENDED = _metric(
    "edge",
    Counter,
    "tandem:sessions_ended",
    "Edge sessions ended, by reason: ended (EndSession), expired (idle), evicted (the edge's bound).",
    ["reason"],
)
SESSION_BYTES = _metric("edge", Gauge, "tandem:session_bytes", "Head KV and activation bytes of the edge's sessions.")

# ------------------------------------------------------------------ cloud

CLOUD_QUEUE = _histogram(
    "cloud",
    "tandem:cloud_queue_time_seconds",
    "Header to the turn's first engine request (split: upload, store put, session commit), in seconds.",
    TTFT_BUCKETS,
    ["mode"],
)
CLOUD_STORE_PUT = _histogram(
    "cloud", "tandem:cloud_store_put_seconds", "Putting a turn's head KV blocks in the store, in seconds.", TTFT_BUCKETS
)
CLOUD_TAIL = _histogram(
    "cloud", "tandem:cloud_tail_prefill_seconds", "Tail prefill and first token (vLLM), in seconds.", TTFT_BUCKETS
)
CLOUD_TAIL_SAVE_WAIT = _histogram(
    "cloud",
    "tandem:cloud_tail_save_wait_seconds",
    "Split turns: wait after the first token for the tail engine's KV writes before the decode, in seconds.",
    TTFT_BUCKETS,
)
TAIL_SAVE_MISSING = _metric(
    "cloud",
    Counter,
    "tandem:cloud_tail_save_missing_blocks",
    "Tail KV blocks not in the store when the wait for them ended (the decode engine recomputed them).",
)
CLOUD_DECODE_FIRST = _histogram(
    "cloud",
    "tandem:cloud_decode_first_token_seconds",
    "Decode engine: request to its first step (KV handoff in split mode), in seconds.",
    TTFT_BUCKETS,
    ["mode"],
)
CLOUD_DECODE = _histogram(
    "cloud",
    "tandem:cloud_decode_seconds",
    "Decode engine, whole stream, in seconds.",
    REQUEST_LATENCY_BUCKETS,
    ["mode"],
)
CLOUD_REQUESTS = _metric(
    "cloud", Counter, "tandem:cloud_requests", "Cloud turns by mode and outcome.", ["mode", "outcome"]
)
UPLOAD_REJECTIONS = _metric(
    "cloud", Counter, "tandem:upload_rejections", "Turns refused before any engine ran, by domain error.", ["reason"]
)
RECEIVED_BYTES = _metric(
    "cloud", Counter, "tandem:received_bytes", "Upload payload bytes received, resends included.", ["kind"]
)
CRC_FAILURES = _metric(
    "cloud", Counter, "tandem:crc_failures", "Activation chunks NACKed (CRC32C mismatch or payload not decodable)."
)
REPAIR_REQUESTS = _metric("cloud", Counter, "tandem:kv_block_repair_requests", "KV blocks the cloud asked for again.")
ENGINE_RESTARTS = _metric("cloud", Counter, "tandem:engine_restarts", "vLLM engine restarts after an engine died.")
UPLOADS_IN_FLIGHT = _metric("cloud", Gauge, "tandem:uploads_in_flight", "Split uploads holding upload budget.")
UPLOAD_BYTES_RESERVED = _metric(
    "cloud", Gauge, "tandem:upload_bytes_reserved", "Upload budget bytes reserved by uploads in flight."
)
CLOUD_SESSIONS = _metric("cloud", Gauge, "tandem:cloud_sessions", "Sessions the cloud holds.")
CLOUD_SESSION_BYTES = _metric(
    "cloud", Gauge, "tandem:cloud_session_bytes", "Bytes the cloud's sessions hold (activations, leaves)."
)
CLOUD_SESSIONS_ENDED = _metric(
    "cloud",
    Counter,
    "tandem:cloud_sessions_ended",
    "Cloud sessions dropped from memory, by reason: ended (EndSession), expired (idle), evicted "
    "(a bound: per edge or in total); the block store keeps the expired and evicted ones' records.",
    ["reason"],
)
BLOCK_STORE_BYTES = _metric(
    "cloud", Gauge, "tandem:block_store_bytes", "Bytes in the KV block store (NaN when it cannot tell)."
)
LINKS_ACTIVE = _metric("cloud", Gauge, "tandem:links_active", "Edge links holding a share of the engines.")
REQUESTS_RUNNING = _metric("cloud", Gauge, "tandem:requests_running", "Requests admitted into the engines.")
REQUESTS_WAITING = _metric("cloud", Gauge, "tandem:requests_waiting", "Requests waiting for an engine slot.")


class _LinkShares:
    """Per-link gauges read from a ``cloud.links.table.LinkTable`` at scrape time (see module doc); one
    collector per process, reading the table ``watch_links`` named last."""

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
            ids = [printable(lk.edge_id, MAX_LABEL_CHARS), printable(lk.link_id, MAX_LABEL_CHARS)]
            fams["tandem:link_share_seqs"].add_metric(ids, lk.share[0])
            fams["tandem:link_weight"].add_metric(ids, lk.weight)
            fams["tandem:link_slo_ttft_seconds"].add_metric(ids, lk.slo.ttft_ms / 1e3)
            fams["tandem:link_slo_itl_seconds"].add_metric(ids, lk.slo.itl_p99_ms / 1e3)
            p = last.get(lk.link_id)
            if p is not None and p.p99_ttft_ms is not None:
                fams["tandem:link_p99_ttft_seconds"].add_metric(ids, p.p99_ttft_ms / 1e3)
            if p is not None and p.p99_itl_ms is not None:
                fams["tandem:link_p99_itl_seconds"].add_metric(ids, p.p99_itl_ms / 1e3)


LINK_SHARES = _LinkShares()
_BY_ROLE["cloud"].append(LINK_SHARES)


def exported_labels(role: str) -> dict[str, set[str]]:
    """The sample names ``role``'s daemon exports ("edge" or "cloud"), each with its label names:
    counters with ``_total``, histograms with ``_bucket`` (and its ``le``), ``_sum`` and ``_count``,
    gauges as named. For dashboards and alerts to be checked against (tests/unit/test_dashboard.py)."""
    out: dict[str, set[str]] = {}
    for m in _BY_ROLE[role]:
        if isinstance(m, _LinkShares):
            out |= {name: set(labels) for name, _, labels in m.FAMILIES}
        elif isinstance(m, Counter):
            out[m._name + "_total"] = set(m._labelnames)
        elif isinstance(m, Histogram):
            out |= {m._name + x: set(m._labelnames) for x in ("_sum", "_count")}
            out[m._name + "_bucket"] = {*m._labelnames, "le"}
        else:
            out[m._name] = set(m._labelnames)
    return out


def register(role: str) -> None:
    """Put the metrics of ``role`` ("edge" or "cloud") in the default registry (idempotent), so
    each daemon exports its own only; ``EdgeNode`` and ``Gateway`` call it."""
    for m in _BY_ROLE[role]:
        with contextlib.suppress(ValueError):  # registered already
            REGISTRY.register(m)


def start_metrics_server(host: str, port: int) -> int:
    """Serve the default registry at ``http://host:port/metrics`` from a daemon thread; port 0 =
    any free one. Returns the bound port.

    Raises:
        OSError: the port could not be bound.
    """
    server, _thread = start_http_server(port, addr=host, registry=REGISTRY)
    return int(server.server_port)


# ------------------------------------------------------------------ scrape-time gauges


def _reader(obj: Any, read: Callable[[Any], float]) -> Callable[[], float]:
    """``read(obj)`` at scrape time; NaN once ``obj`` is gone or while it is being changed
    (the scrape runs on the server's thread, the state on the event loop)."""
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


def watch_edge_sessions(sessions: Any) -> None:
    """Export the edge's metrics; report ``sessions`` (an ``EdgeSessions``) in its session gauges."""
    register("edge")
    SESSIONS.set_function(_reader(sessions, len))
    SESSION_BYTES.set_function(_reader(sessions, lambda s: s.nbytes()))


def watch_cloud(sessions: Any, budget: Any, store: Any) -> None:
    """Export the cloud's metrics; report a gateway's sessions, upload budget and block store in its gauges."""
    register("cloud")
    UPLOADS_IN_FLIGHT.set_function(_reader(budget, lambda b: b.uploads))
    UPLOAD_BYTES_RESERVED.set_function(_reader(budget, lambda b: b.nbytes))
    CLOUD_SESSIONS.set_function(_reader(sessions, len))
    CLOUD_SESSION_BYTES.set_function(_reader(sessions, lambda s: s.nbytes()))
    BLOCK_STORE_BYTES.set_function(_reader(store, lambda s: s.volume_bytes()))


# ------------------------------------------------------------------ events


def record_uplink(sent_bytes: Mapping[str, int], resent_chunks: int, repaired_blocks: int) -> None:
    """One Generate call's sending, at its end (failed calls too: the bytes went out)."""
    for kind, n in sent_bytes.items():
        if n:
            UPLINK_BYTES.labels(kind).inc(n)
    if resent_chunks:
        CHUNK_RESENDS.inc(resent_chunks)
    if repaired_blocks:
        KV_REPAIRS.inc(repaired_blocks)


def record_session_resync() -> None:
    SESSION_RESYNCS.inc()


def record_resume() -> None:
    TURN_RESUMES.inc()


def record_upload_kept(tokens: int) -> None:
    UPLOAD_KEPT_TOKENS.inc(tokens)


def record_session_sync(outcome: str) -> None:
    """``outcome``: ``in_sync``, ``partial`` or ``lost``."""
    SESSION_SYNCS.labels(outcome).inc()


def record_edge_session_end(reason: str) -> None:
    """``reason``: ``ended``, ``expired`` or ``evicted``."""
    SESSIONS_ENDED.labels(reason).inc()


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


class EdgeTurnTimes(Protocol):
    @property
    def mode(self) -> str: ...  # "local" | "split" | "direct", or the requested mode if none ran

    @property
    def t_start(self) -> float: ...  # perf_counter at the turn's start

    @property
    def token_times(self) -> Sequence[float]: ...  # perf_counter at each arrival of new tokens

    @property
    def timings(self) -> Mapping[Stage, float]: ...  # stage -> ms


class CloudTurnTimes(Protocol):
    @property
    def t_start(self) -> float: ...

    @property
    def t_engine(self) -> float | None: ...  # perf_counter at the first engine request, None if none ran

    @property
    def timings(self) -> Mapping[Stage, float]: ...

    @property
    def final_sent(self) -> bool: ...  # its final went to the caller: the turn completed


def _seconds(timings: Mapping[Stage, float], stage: Stage) -> float | None:
    ms = timings.get(stage)
    return None if ms is None else ms / 1e3


def _observe(h: Any, value: float | None) -> None:
    if value is not None:
        h.observe(value)


def _token_latencies(mode: str, t_start: float, token_times: Sequence[float]) -> None:
    if token_times:
        TTFT.labels(mode).observe(token_times[0] - t_start)
    itl = ITL.labels(mode)
    for a, b in zip(token_times, token_times[1:], strict=False):
        itl.observe(b - a)


@contextlib.contextmanager
def edge_turn(clock: EdgeTurnTimes) -> Iterator[dict[str, int]]:
    """Record one edge turn's metrics when the ``with`` block ends, however it ends, under the mode
    that served it (``clock.mode``, known only once the turn chose it). The block puts
    ``prompt_tokens``, ``output_tokens`` and ``head_tokens`` in the yielded dict when it completes."""
    counts: dict[str, int] = {}
    exc: BaseException | None = None
    try:
        yield counts
    except BaseException as e:
        exc = e
        raise
    finally:
        mode = clock.mode
        outcome = outcome_of(exc)
        REQUESTS.labels(mode, outcome).inc()
        _token_latencies(mode, clock.t_start, clock.token_times)
        _observe(EDGE_HEAD, _seconds(clock.timings, Stage.EDGE_HEAD))
        _observe(UPLINK_TIME, _seconds(clock.timings, Stage.UPLINK))
        if outcome == "ok":
            E2E.labels(mode).observe(time.perf_counter() - clock.t_start)
            PROMPT_TOKENS.labels(mode).inc(counts.get("prompt_tokens", 0))
            GENERATION_TOKENS.labels(mode).inc(counts.get("output_tokens", 0))
        if counts.get("head_tokens"):
            HEAD_TOKENS.inc(counts["head_tokens"])


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
        _observe(CLOUD_STORE_PUT, _seconds(t, Stage.CLOUD_STORE_PUT))
        _observe(CLOUD_TAIL, _seconds(t, Stage.CLOUD_TAIL_PREFILL))
        _observe(CLOUD_TAIL_SAVE_WAIT, _seconds(t, Stage.CLOUD_TAIL_SAVE_WAIT))
        _observe(CLOUD_DECODE_FIRST.labels(mode), _seconds(t, Stage.CLOUD_DECODE_FIRST_TOKEN))
        _observe(CLOUD_DECODE.labels(mode), _seconds(t, Stage.CLOUD_DECODE))


def record_prediction(mode: str, predicted_ms: float, measured_ms: float) -> None:
    """One cost-model prediction against the TTFT measured for the mode that ran."""
    if measured_ms > 0 and predicted_ms > 0:
        PREDICTION_ERROR.labels(mode).observe(abs(measured_ms - predicted_ms) / measured_ms)


def record_prediction_of(mode: str, quantity: str, predicted_ms: float, measured_ms: float) -> None:
    """One cost-model prediction of ``quantity`` ("e2e": end-to-end time, "cloud_engine": cloud
    engine time) against the one measured for the mode that ran."""
    if measured_ms > 0 and predicted_ms > 0:
        OTHER_PREDICTION_ERROR.labels(mode, quantity).observe(abs(measured_ms - predicted_ms) / measured_ms)


def record_fallback(reason: str) -> None:
    MODE_FALLBACKS.labels(reason).inc()


def watch_link(cloud: Any) -> None:
    """Export the estimates of an ``edge.link.connection.CloudTarget``'s current connection at scrape time."""
    register("edge")
    LINK_RTT.set_function(_reader(cloud, lambda c: c.current().rtt_ms.value))
    LINK_GOODPUT.set_function(_reader(cloud, lambda c: c.current().goodput_mbps.value))
    CLOUD_CONNECTED.set_function(_reader(cloud, lambda c: float(c.current().connected.is_set())))
    members = lambda c: getattr(c, "members", [c])  # noqa: E731 (a ReplicaSet, or one connection)
    CLOUD_REPLICAS.labels("answering").set_function(_reader(cloud, lambda c: sum(m.healthy for m in members(c))))
    CLOUD_REPLICAS.labels("down").set_function(_reader(cloud, lambda c: sum(not m.healthy for m in members(c))))


def watch_links(table: Any) -> None:
    """Export a ``cloud.links.table.LinkTable``'s counts at scrape time."""
    register("cloud")
    LINKS_ACTIVE.set_function(_reader(table, lambda t: len(t.active())))
    REQUESTS_RUNNING.set_function(_reader(table, lambda t: t.running))
    REQUESTS_WAITING.set_function(_reader(table, lambda t: t.waiting))
    LINK_SHARES.table = weakref.ref(table)
