"""The edge daemon's Prometheus metrics (``EdgeNode``), in ``EDGE``; the conventions they keep (names,
units, buckets, bounded printable labels, one registry per daemon) and the helpers they are made with:
``common.runtime.metrics``.

``tandem:time_to_first_token_seconds{mode}``,
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
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

from tandem.common.runtime.logs import outcome_of
from tandem.common.runtime.metrics import (
    ITL_BUCKETS,
    RATIO_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    MetricSet,
    observe,
    reader,
    seconds,
)
from tandem.stages import Stage

EDGE = MetricSet()

TTFT = EDGE.histogram(
    "tandem:time_to_first_token_seconds",
    "Time to first token at the edge (tokenize, head, uplink, cloud's tail prefill), in seconds.",
    TTFT_BUCKETS,
    ["mode"],
)
ITL = EDGE.histogram(
    "tandem:inter_token_latency_seconds",
    "Time between arrivals of new output tokens at the edge, in seconds.",
    ITL_BUCKETS,
    ["mode"],
)
E2E = EDGE.histogram(
    "tandem:e2e_request_latency_seconds",
    "Edge turn latency, start to the final event, of turns that completed, in seconds.",
    REQUEST_LATENCY_BUCKETS,
    ["mode"],
)
EDGE_HEAD = EDGE.histogram("tandem:edge_head_seconds", "ONNX head over a turn's new tokens, in seconds.", TTFT_BUCKETS)
UPLINK_TIME = EDGE.histogram(
    "tandem:uplink_seconds", "Sending a split upload until the cloud verified it, in seconds.", TTFT_BUCKETS
)
REQUESTS = EDGE.counter("tandem:requests", "Edge turns by mode and outcome.", ["mode", "outcome"])
PROMPT_TOKENS = EDGE.counter("tandem:prompt_tokens", "Prompt tokens of completed edge turns.", ["mode"])
GENERATION_TOKENS = EDGE.counter("tandem:generation_tokens", "Output tokens of completed edge turns.", ["mode"])
HEAD_TOKENS = EDGE.counter("tandem:edge_head_tokens", "Tokens run through the edge's head.")
UPLINK_BYTES = EDGE.counter("tandem:uplink_bytes", "Bytes sent to the cloud, resends included.", ["kind"])
CHUNK_RESENDS = EDGE.counter("tandem:chunk_resends", "Activation chunks sent again after a NACK.")
KV_REPAIRS = EDGE.counter("tandem:kv_block_repairs", "KV blocks sent again on the cloud's request.")
SESSION_RESYNCS = EDGE.counter(
    "tandem:session_resyncs", "Turns resent from token 0 because the cloud lost the session."
)
TURN_RESUMES = EDGE.counter(
    "tandem:turn_resumes", "Turns continued after their cloud failed mid-stream (no token repeated)."
)
UPLOAD_KEPT_TOKENS = EDGE.counter(
    "tandem:upload_kept_tokens",
    "Prompt tokens of cut uploads that the cloud had acknowledged keeping (WindowAck.held_tokens): "
    "a resumed upload does not send them again.",
)
SESSION_SYNCS = EDGE.counter(
    "tandem:session_syncs",
    "SyncSession calls, by outcome: in_sync, partial (the cloud lacked some), lost (it held nothing usable).",
    ["outcome"],
)
PREDICTION_ERROR = EDGE.histogram(
    "tandem:ttft_prediction_error_ratio",
    "|measured - predicted| / measured TTFT of the cost model, per served mode.",
    RATIO_BUCKETS,
    ["mode"],
)
OTHER_PREDICTION_ERROR = EDGE.histogram(
    "tandem:prediction_error_ratio",
    "|measured - predicted| / measured of the cost model's end-to-end time and cloud engine time, per mode.",
    RATIO_BUCKETS,
    ["mode", "quantity"],
)
MODE_FALLBACKS = EDGE.counter(
    "tandem:mode_fallbacks",
    "Auto-mode turns served by another mode than chosen: the cloud refused and local mode served, or the edge's "
    "KV memory was full (or too small for the turn) and direct mode served, or a split turn passed a whole bound of "
    "the cloud's and direct (else local) mode served.",
    ["reason"],
)
LINK_RTT = EDGE.gauge("tandem:link_rtt_ms", "Smoothed round-trip time edge <-> cloud, in ms.")
LINK_GOODPUT = EDGE.gauge("tandem:link_goodput_mbps", "Smoothed uplink goodput, in Mbit/s.")
CLOUD_CONNECTED = EDGE.gauge("tandem:cloud_connected", "1 while the link is negotiated and answering.")
CLOUD_REPLICAS = EDGE.gauge(
    "tandem:cloud_replicas", "Cloud replicas the edge knows now (by DNS or by list), answering or down.", ["state"]
)
SESSIONS = EDGE.gauge("tandem:sessions", "Chat sessions the edge holds.")
SESSIONS_ENDED = EDGE.counter(
    "tandem:sessions_ended",
    "Edge sessions ended, by reason: ended (EndSession), expired (idle), evicted (the edge's bound).",
    ["reason"],
)
SESSION_BYTES = EDGE.gauge("tandem:session_bytes", "Head KV and activation bytes of the edge's sessions.")


def register() -> None:
    """Put the edge's metrics in the default registry (idempotent); ``EdgeNode`` does, through ``watch_*``."""
    EDGE.register()


def exported_labels() -> dict[str, set[str]]:
    """The sample names the edge exports, each with its label names (``MetricSet.exported_labels``)."""
    return EDGE.exported_labels()


# ------------------------------------------------------------------ scrape-time gauges


def watch_edge_sessions(sessions: Any) -> None:
    """Export the edge's metrics; report ``sessions`` (an ``EdgeSessions``) in its session gauges."""
    register()
    SESSIONS.set_function(reader(sessions, len))
    SESSION_BYTES.set_function(reader(sessions, lambda s: s.nbytes()))


def watch_link(cloud: Any) -> None:
    """Export the estimates of an ``edge.link.connection.CloudTarget``'s current connection at scrape time."""
    register()
    LINK_RTT.set_function(reader(cloud, lambda c: c.current().rtt_ms.value))
    LINK_GOODPUT.set_function(reader(cloud, lambda c: c.current().goodput_mbps.value))
    CLOUD_CONNECTED.set_function(reader(cloud, lambda c: float(c.current().connected.is_set())))
    members = lambda c: getattr(c, "members", [c])  # noqa: E731 (a ReplicaSet, or one connection)
    CLOUD_REPLICAS.labels("answering").set_function(reader(cloud, lambda c: sum(m.healthy for m in members(c))))
    CLOUD_REPLICAS.labels("down").set_function(reader(cloud, lambda c: sum(not m.healthy for m in members(c))))


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


class EdgeTurnTimes(Protocol):
    @property
    def mode(self) -> str: ...  # "local" | "split" | "direct", or the requested mode if none ran

    @property
    def t_start(self) -> float: ...  # perf_counter at the turn's start

    @property
    def token_times(self) -> Sequence[float]: ...  # perf_counter at each arrival of new tokens

    @property
    def timings(self) -> Mapping[Stage, float]: ...  # stage -> ms


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
        observe(EDGE_HEAD, seconds(clock.timings, Stage.EDGE_HEAD))
        observe(UPLINK_TIME, seconds(clock.timings, Stage.UPLINK))
        if outcome == "ok":
            E2E.labels(mode).observe(time.perf_counter() - clock.t_start)
            PROMPT_TOKENS.labels(mode).inc(counts.get("prompt_tokens", 0))
            GENERATION_TOKENS.labels(mode).inc(counts.get("output_tokens", 0))
        if counts.get("head_tokens"):
            HEAD_TOKENS.inc(counts["head_tokens"])
