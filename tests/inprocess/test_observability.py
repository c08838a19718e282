"""Observability with the in-memory doubles (no vLLM, no ONNX Runtime): Prometheus samples after
toy turns (a split turn with a corrupted chunk and KV block, a refused turn), the ``/metrics``
endpoint, JSON log lines carrying a turn's ids, and per-stage spans (on, and off)."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import sys
import urllib.request
from dataclasses import replace

import pytest
from prometheus_client import REGISTRY, Gauge

from tandem.cloud import metrics as cloud_metrics
from tandem.cloud.engines import vllm_metrics
from tandem.common.protocol.errors import InvalidRequest
from tandem.common.protocol.modes import Mode
from tandem.common.protocol.params import Sampling
from tandem.common.runtime import metrics, tracing
from tandem.common.runtime.logs import bind_request, setup_logging
from tandem.common.wire import chunks as wire
from tandem.common.wire.messages import KVBlock
from tandem.edge import metrics as edge_metrics
from tandem.edge.events import ChatTurn
from tests.doubles import TamperLink, toy_stack
from tests.helpers import LONG, run, turn

STAGES = {"tokenize", "edge_head", "encode", "uplink", "cloud_upload", "cloud_store_put", "cloud_tail_prefill"}


def corrupt_first_sends(item, attempt):
    """The first send of chunk 0 fails its CRC32C and of KV block 0 its leaf: one NACK, one repair."""
    if attempt == 1 and isinstance(item, wire.Chunk) and item.seq == 0:
        return replace(item, crc32c=item.crc32c ^ 1)
    if attempt == 1 and isinstance(item, KVBlock) and item.leaf_index == 0:
        return replace(item, payload=bytes([item.payload[0] ^ 1]) + item.payload[1:])
    return item


class Samples:
    """Reads samples of the default registry; ``delta`` is the change since construction."""

    def __init__(self, *keys: tuple[str, dict[str, str]]) -> None:
        self.before = {self._k(n, lb): self.value(n, **lb) for n, lb in keys}

    @staticmethod
    def _k(name: str, labels: dict[str, str]) -> tuple:
        return name, tuple(sorted(labels.items()))

    @staticmethod
    def value(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    def delta(self, name: str, **labels: str) -> float:
        return self.value(name, **labels) - self.before[self._k(name, labels)]


SPLIT, DIRECT = {"mode": "split"}, {"mode": "direct"}
WATCHED = [
    ("tandem:requests_total", {"mode": "split", "outcome": "ok"}),
    ("tandem:requests_total", {"mode": "split", "outcome": "InvalidRequest"}),
    ("tandem:time_to_first_token_seconds_count", SPLIT),
    ("tandem:inter_token_latency_seconds_count", SPLIT),
    ("tandem:e2e_request_latency_seconds_count", SPLIT),
    ("tandem:prompt_tokens_total", SPLIT),
    ("tandem:generation_tokens_total", SPLIT),
    ("tandem:edge_head_seconds_count", {}),
    ("tandem:uplink_seconds_count", {}),
    ("tandem:uplink_bytes_total", {"kind": "activations"}),
    ("tandem:uplink_bytes_total", {"kind": "kv"}),
    ("tandem:uplink_bytes_total", {"kind": "header"}),
    ("tandem:chunk_resends_total", {}),
    ("tandem:kv_block_repairs_total", {}),
    ("tandem:cloud_requests_total", {"mode": "split", "outcome": "ok"}),
    ("tandem:cloud_requests_total", {"mode": "split", "outcome": "InvalidRequest"}),
    ("tandem:upload_rejections_total", {"reason": "InvalidRequest"}),
    ("tandem:cloud_queue_time_seconds_count", SPLIT),
    ("tandem:cloud_store_put_seconds_count", {}),
    ("tandem:cloud_tail_prefill_seconds_count", {}),
    ("tandem:cloud_decode_seconds_count", SPLIT),
    ("tandem:received_bytes_total", {"kind": "activations"}),
    ("tandem:received_bytes_total", {"kind": "kv"}),
    ("tandem:crc_failures_total", {}),
    ("tandem:kv_block_repair_requests_total", {}),
    ("tandem:requests_total", {"mode": "direct", "outcome": "ok"}),
    ("tandem:cloud_queue_time_seconds_count", DIRECT),
]


async def test_a_split_turn_a_direct_turn_and_a_refused_turn_leave_their_samples():
    toy = await toy_stack(link_wrapper=lambda link: TamperLink(link, corrupt_first_sends))
    try:
        s = Samples(*WATCHED)
        done = await run(toy.edge, turn(LONG, "s1"))
        assert s.delta("tandem:requests_total", mode="split", outcome="ok") == 1
        for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "cloud_queue_time_seconds"):
            assert s.delta(f"tandem:{name}_count", mode="split") == 1
        # the tail's token, then one decode step per token: 8 arrivals, 7 gaps
        assert s.delta("tandem:inter_token_latency_seconds_count", mode="split") == 7
        assert s.delta("tandem:prompt_tokens_total", mode="split") == done.prompt_tokens
        assert s.delta("tandem:generation_tokens_total", mode="split") == 8
        for name in ("edge_head", "uplink", "cloud_store_put", "cloud_tail_prefill"):
            assert s.delta(f"tandem:{name}_seconds_count") == 1
        assert s.delta("tandem:cloud_decode_seconds_count", mode="split") == 1
        for kind in ("activations", "kv", "header"):
            assert s.delta("tandem:uplink_bytes_total", kind=kind) == done.sent_bytes.by_kind()[kind] > 0
        for kind in ("activations", "kv"):
            assert s.delta("tandem:received_bytes_total", kind=kind) > 0
        assert s.delta("tandem:crc_failures_total") == s.delta("tandem:chunk_resends_total") == 1
        assert s.delta("tandem:kv_block_repair_requests_total") == s.delta("tandem:kv_block_repairs_total") == 1
        assert s.delta("tandem:cloud_requests_total", mode="split", outcome="ok") == 1
        # gauges read the latest gateway and edge at scrape time
        assert Samples.value("tandem:sessions") == Samples.value("tandem:cloud_sessions") == 1
        assert Samples.value("tandem:session_bytes") == toy.edge.sessions.nbytes() > 0
        assert Samples.value("tandem:uploads_in_flight") == Samples.value("tandem:upload_bytes_reserved") == 0
        assert REGISTRY.get_sample_value("tandem:block_store_bytes") == toy.store.volume_bytes() > 0

        direct = ChatTurn(
            messages=(("user", "hi"),), prompt="", session_id="", sampling=Sampling(max_new_tokens=2), mode=Mode.DIRECT
        )
        await run(toy.edge, direct)
        assert s.delta("tandem:requests_total", mode="direct", outcome="ok") == 1
        assert s.delta("tandem:cloud_queue_time_seconds_count", mode="direct") == 1

        toy.edge.validate = lambda request, ids: None  # the edge's own check away: the cloud's verdict
        with pytest.raises(InvalidRequest):  # more new tokens than the link allows: the cloud refuses
            await run(toy.edge, turn(LONG, "s2", n=100_000))
        assert s.delta("tandem:requests_total", mode="split", outcome="InvalidRequest") == 1
        assert s.delta("tandem:cloud_requests_total", mode="split", outcome="InvalidRequest") == 1
        assert s.delta("tandem:upload_rejections_total", reason="InvalidRequest") == 1
        assert s.delta("tandem:cloud_queue_time_seconds_count", mode="split") == 1  # no engine ran for it
        assert Samples.value("tandem:uploads_in_flight") == 0
    finally:
        await toy.batcher.stop()


def test_the_metrics_endpoint_serves_tandem_metrics():
    edge_metrics.register()  # what an EdgeNode does
    port = metrics.start_metrics_server("127.0.0.1", 0)
    assert port > 0
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert "# TYPE tandem:time_to_first_token_seconds histogram" in text
    assert "tandem:uplink_bytes_total" in text or "# TYPE tandem:uplink_bytes counter" in text


def test_shared_vllm_metrics_survive_vllms_unregistering():
    shared = vllm_metrics._shared_metric(Gauge)
    a = shared(name="tandem_test:shared_gauge", documentation="d", labelnames=["model_name"])
    a.labels("tail").set(1)
    REGISTRY.unregister(a)  # what vLLM's PrometheusStatLogger does when the next engine starts
    b = shared(name="tandem_test:shared_gauge", documentation="d", labelnames=["model_name"])
    b.labels("decode").set(2)
    assert b is a
    assert REGISTRY.get_sample_value("tandem_test:shared_gauge", {"model_name": "tail"}) == 1
    assert REGISTRY.get_sample_value("tandem_test:shared_gauge", {"model_name": "decode"}) == 2


def test_a_stopped_engines_vllm_series_leave_the_shared_metrics():
    from prometheus_client import Counter, Histogram

    names = ("tandem_test:forget_gauge", "tandem_test:forget_requests", "tandem_test:forget_seconds")
    kinds = (Gauge, Counter, Histogram)
    made = [
        vllm_metrics._shared_metric(kind)(name=n, documentation="d", labelnames=["model_name", "engine"])
        for kind, n in zip(kinds, names, strict=True)
    ]
    for m in made:
        for model in ("/m/split-k4/tail", "/m/hf"):
            child = m.labels(model, "0")
            (child.set(0.5) if isinstance(m, Gauge) else child.inc() if isinstance(m, Counter) else child.observe(0.2))
    try:
        assert vllm_metrics.forget_vllm_engines({"/m/split-k4/tail"}) == 3
        assert REGISTRY.get_sample_value(names[0], {"model_name": "/m/split-k4/tail", "engine": "0"}) is None
        assert REGISTRY.get_sample_value(names[1] + "_total", {"model_name": "/m/split-k4/tail", "engine": "0"}) is None
        assert REGISTRY.get_sample_value(names[2] + "_count", {"model_name": "/m/split-k4/tail", "engine": "0"}) is None
        assert REGISTRY.get_sample_value(names[0], {"model_name": "/m/hf", "engine": "0"}) == 0.5  # the other stays
        assert vllm_metrics.forget_vllm_engines({"/m/split-k4/tail"}) == 0
    finally:
        for m, n in zip(made, names, strict=True):
            REGISTRY.unregister(m)
            vllm_metrics._VLLM_SHARED.pop(n)


def test_kv_cache_usage_is_the_highest_engines_gauge_and_reads_only_it():
    from prometheus_client import CollectorRegistry, Histogram

    reg = CollectorRegistry()
    assert vllm_metrics.vllm_kv_cache_usage(reg) == 0.0  # no engines
    g = Gauge("vllm:kv_cache_usage_perc", "d", ["model_name", "engine"], registry=reg)
    g.labels("tail", "0").set(0.25)
    g.labels("decode", "0").set(0.75)
    Gauge("vllm:other_perc", "d", registry=reg).set(0.9)

    class Refuses(Histogram):  # a metric the reader must not collect
        def collect(self):
            raise AssertionError("collected a metric other than the KV cache gauge")

    Refuses("vllm:e2e_seconds", "d", registry=reg)
    assert vllm_metrics.vllm_kv_cache_usage(reg) == 0.75


@pytest.fixture
def json_log():
    buf = io.StringIO()
    root = logging.getLogger()
    level = root.level
    handler = setup_logging("json", "DEBUG", stream=buf)
    try:
        yield buf
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


async def test_json_logs_of_a_turn_carry_its_ids_on_every_line(json_log):
    toy = await toy_stack(link_wrapper=lambda link: TamperLink(link, corrupt_first_sends))
    try:
        json_log.seek(0)
        json_log.truncate()
        await run(toy.edge, turn(LONG, "s-log"))
        with pytest.raises(InvalidRequest):
            await run(toy.edge, turn(LONG, "s-log2", n=100_000))
    finally:
        await toy.batcher.stop()
    lines = [json.loads(x) for x in json_log.getvalue().splitlines()]
    assert {"time", "level", "logger", "message"} <= set(lines[0])
    by_session: dict[str, list[dict]] = {}
    for line in lines:  # libraries' own lines (grpc's DEBUG "Loaded running loop") carry no turn
        if line["logger"].startswith("tandem."):
            by_session.setdefault(line.get("session_id", ""), []).append(line)
    assert set(by_session) == {"s-log", "s-log2"}  # no tandem line without ids
    ok, refused = by_session["s-log"], by_session["s-log2"]
    assert len({x["request_id"] for x in ok}) == 1 and len({x["request_id"] for x in refused}) == 1
    messages = [(x["logger"], x["level"], x["message"].split(":")[0]) for x in ok]
    for want in (
        ("tandem.edge", "DEBUG", "turn start"),
        ("tandem.cloud", "DEBUG", "turn start"),
        ("tandem.cloud", "INFO", "chunk 0 failed its CRC32C or did not decode"),
        ("tandem.edge", "INFO", "cloud NACKed chunk 0 (crc32c mismatch or payload does not decode)"),
        ("tandem.cloud", "INFO", "repair round 1"),
        ("tandem.cloud", "INFO", "turn done"),
        ("tandem.edge", "INFO", "turn done"),
    ):
        assert want in messages
    done = next(x["message"] for x in ok if x["logger"] == "tandem.edge" and x["message"].startswith("turn done"))
    assert "requested=split" in done and "output_tokens=8" in done and "ttft_ms=" in done
    assert any(x["level"] == "WARNING" and "turn refused" in x["message"] and "InvalidRequest" in x["message"]
               for x in refused)  # fmt: skip
    assert "quick brown fox" not in json_log.getvalue()  # no prompt text


async def test_the_turn_done_line_names_the_requested_and_the_serving_mode_once_each(caplog):
    """The edge's "turn done" line: ``requested=`` the client's mode, ``mode=`` the one that served
    it (the metrics' ``mode`` label), each key once; the cloud's names its one mode ``mode=``."""
    toy = await toy_stack()
    try:
        with caplog.at_level(logging.INFO):
            done = await run(toy.edge, turn(LONG, "s-auto", mode=Mode.AUTO))
    finally:
        await toy.batcher.stop()
    lines = {r.name: r.getMessage() for r in caplog.records if r.getMessage().startswith("turn done")}
    edge_keys = re.findall(r"(\w+)=", lines["tandem.edge"])
    assert edge_keys.count("mode") == 1 and edge_keys.count("requested") == 1
    assert "requested=auto " in lines["tandem.edge"] and f" mode={done.mode} " in lines["tandem.edge"]
    if "tandem.cloud" in lines:
        cloud_keys = re.findall(r"(\w+)=", lines["tandem.cloud"])
        assert cloud_keys.count("mode") == 1 and "requested" not in cloud_keys


@pytest.mark.parametrize("json_logger", ["python-json-logger", "stdlib"])
def test_json_log_lines_hold_the_fields_and_the_calls_extra_only(monkeypatch, json_logger):
    """Both formatters (python-json-logger's and the stdlib one of an edge-only install) write the
    same line; what a record factory adds to every record (vLLM's adds ``vllm_process_name``) is
    library metadata, not an ``extra`` of the call."""
    if json_logger == "stdlib":
        monkeypatch.setitem(sys.modules, "pythonjsonlogger.json", None)
    buf = io.StringIO()
    root = logging.getLogger()
    level = root.level
    plain = logging.getLogRecordFactory()

    def factory(*args, **kw):
        record = plain(*args, **kw)
        record.library_process_name = "MainProcess"
        return record

    logging.setLogRecordFactory(factory)
    handler = setup_logging("json", "INFO", stream=buf)
    try:
        with bind_request("r1", ""):
            logging.getLogger("tandem.test").info("hello %s", "world", extra={"tokens": 3})
    finally:
        logging.setLogRecordFactory(plain)
        root.removeHandler(handler)
        root.setLevel(level)
    line = json.loads(buf.getvalue())
    assert line.pop("time").endswith("+00:00")
    assert line == {"level": "INFO", "logger": "tandem.test", "message": "hello world", "request_id": "r1", "tokens": 3}


def test_text_logs_carry_the_ids_and_ids_are_printable():
    buf = io.StringIO()
    root = logging.getLogger()
    level = root.level
    handler = setup_logging("text", "INFO", stream=buf)
    try:
        with bind_request("r1\nforged line", "s1"):
            logging.getLogger("tandem.test").info("hello %s", "world")
        logging.getLogger("tandem.test").info("outside")
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    first, second = buf.getvalue().splitlines()
    assert first.endswith("tandem.test INFO [request_id=r1\\nforged line session_id=s1] hello world")
    assert second.endswith("tandem.test INFO outside")


async def test_a_turn_takes_the_request_id_its_caller_bound_unless_a_turn_in_flight_has_it():
    toy = await toy_stack()
    seen: list[str] = []
    run_turn = toy.gateway.run_turn

    def spy(header, *a, **k):
        seen.append(header.request_id)
        return run_turn(header, *a, **k)

    toy.gateway.run_turn = spy  # type: ignore[method-assign]
    try:
        with bind_request("call-1", ""):
            await run(toy.edge, turn("hi"))
            await asyncio.gather(run(toy.edge, turn("a")), run(toy.edge, turn("b")))
    finally:
        await toy.batcher.stop()
    assert seen[0] == "call-1" and len(set(seen[1:])) == 2 and "call-1" in seen[1:]


@pytest.fixture
def spans():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    assert tracing.setup_tracing(True, "tandem-test", exporter=exporter)
    try:
        yield exporter
    finally:
        tracing.setup_tracing(False, "tandem-test")


async def test_tracing_on_gives_one_span_per_stage(spans):
    toy = await toy_stack()
    try:
        await run(toy.edge, turn(LONG, "s-trace"))
    finally:
        await toy.batcher.stop()
    finished = spans.get_finished_spans()
    by_name = {s.name: s for s in finished}
    assert STAGES | {"edge_turn", "cloud_turn", "cloud_decode"} <= set(by_name)
    assert len({s.context.trace_id for s in finished}) == 1  # in process, the cloud's turn nests in the edge's
    root, cloud = by_name["edge_turn"], by_name["cloud_turn"]
    assert root.parent is None and cloud.parent.span_id == root.context.span_id
    for name in ("tokenize", "edge_head", "encode", "uplink"):
        assert by_name[name].parent.span_id == root.context.span_id
    for name in ("cloud_upload", "cloud_store_put", "cloud_tail_prefill", "cloud_decode"):
        assert by_name[name].parent.span_id == cloud.context.span_id
    assert root.attributes["mode"] == "split" and root.attributes["session_id"] == "s-trace"


async def test_tracing_off_creates_no_spans(monkeypatch):
    from opentelemetry.sdk.trace import Tracer

    def no_spans(*a, **k):
        raise AssertionError("a span was created with tracing off")

    monkeypatch.setattr(Tracer, "start_span", no_spans)
    monkeypatch.setattr(Tracer, "start_as_current_span", no_spans)
    tracing.setup_tracing(False, "tandem-test")
    assert tracing.span("x") is tracing.span("y")  # the shared no-op
    toy = await toy_stack()
    try:
        await run(toy.edge, turn(LONG, "s-off"))
    finally:
        await toy.batcher.stop()


# --- what a peer sends is printable and bounded wherever an operator reads it ---------------------

FORGED = "2026-12-06 05:00:00,000 tandem.cloud ERROR FORGED"
HOSTILE = {
    "LF": f"x\n{FORGED}",
    "CR": f"x\r{FORGED}",
    "NUL": "a\x00b",
    "ANSI": "\x1b[31mred\x1b[0m\x1b]0;title\x07",
    "lone surrogate": "a\ud800b\udfff",
    "line separators": f"a\u2028{FORGED}\x85{FORGED}",
    "very long": "y" * 200_000,
}
LOG_FORMATS = ["text", "json", "stdlib-json"]


def _readable(text: str) -> bool:
    """Printable (a line's own text) and encodable as UTF-8 (what a log stream writes)."""
    text.encode()
    return text.isprintable()


@pytest.mark.parametrize("fmt", LOG_FORMATS)
@pytest.mark.parametrize("value", list(HOSTILE.values()), ids=list(HOSTILE))
def test_peer_strings_reach_a_log_line_printable_and_bounded(monkeypatch, fmt, value):
    """A peer's string as a request id, a session id, a message argument, a call's ``extra`` and an
    exception's message: each record is one line (a text traceback's lines indented), every line
    printable, UTF-8 and bounded, in both formats (and the stdlib JSON one of an edge-only install)."""
    from tandem.common.runtime.logs import MAX_MESSAGE_CHARS, set_caller

    if fmt == "stdlib-json":
        monkeypatch.setitem(sys.modules, "pythonjsonlogger.json", None)
    buf = io.StringIO()
    root = logging.getLogger()
    level = root.level
    handler = setup_logging("text" if fmt == "text" else "json", "INFO", stream=buf)
    log = logging.getLogger("tandem.test")
    try:
        with bind_request(value, value):
            set_caller(value)
            log.warning("link %s: %r", value, value, extra={"edge_id": value})
            try:
                raise InvalidRequest(f"edge_id {value}")
            except InvalidRequest:
                log.exception("refused %s", value)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    lines = buf.getvalue().splitlines()
    assert all(_readable(x) and len(x) < 3 * MAX_MESSAGE_CHARS for x in lines)
    assert len(buf.getvalue()) < 12 * MAX_MESSAGE_CHARS  # the whole, traceback included, is bounded too
    assert not [x for x in lines if x.startswith(FORGED)]  # a traceback line is indented
    if fmt == "text":
        records = [x for x in lines if not x.startswith("  ")]
        assert len(records) == 2 and all(x.startswith(lines[0][:10]) for x in records)
        assert "ERROR" in records[1] and any(x.startswith("  ") and "InvalidRequest: edge_id" in x for x in lines)
    else:
        records = [json.loads(x) for x in lines]
        assert len(records) == 2
        for r in records:
            assert all(_readable(v) for v in r.values() if isinstance(v, str) and v is not r.get("exc_info"))
            assert r["request_id"] == r["session_id"] == r["caller"] and len(r["request_id"]) < 200
        assert "edge_id" in records[0] and len(records[0]["edge_id"]) < 2 * MAX_MESSAGE_CHARS
        assert all(_readable(x) for x in records[1]["exc_info"].splitlines())


@pytest.mark.parametrize("value", list(HOSTILE.values()), ids=list(HOSTILE))
def test_peer_strings_reach_a_metric_label_printable_and_bounded(value):
    """Every metric's ``labels`` takes its values printable and bounded, whoever calls it; the
    exposition stays parseable and one series per line."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    every = [*edge_metrics.EDGE.members, *cloud_metrics.CLOUD.members]
    # every metric's labels; the per-link collector builds its own, through the same label()
    assert every and all(isinstance(m, metrics._PrintableLabels | cloud_metrics.LinkShares) for m in every)
    reg = CollectorRegistry()
    reg.register(edge_metrics.MODE_FALLBACKS)
    edge_metrics.record_fallback(value)
    try:
        text = generate_latest(reg).decode()
        assert not [x for x in text.splitlines() if x.startswith(FORGED)]
        (family,) = [f for f in text_string_to_metric_families(text) if f.name == "tandem:mode_fallbacks"]
        # other tests of the run may have recorded fallbacks of their own: this value's series is one
        (sample,) = [
            x for x in family.samples if x.name.endswith("_total") and x.labels["reason"] == metrics.label(value)
        ]
        reason = sample.labels["reason"]
        assert sample.value >= 1 and _readable(reason)
        assert len(reason) <= metrics.MAX_LABEL_CHARS + len("...(200000 more characters)")
    finally:
        edge_metrics.MODE_FALLBACKS.remove(metrics.label(value))


@pytest.mark.parametrize("value", list(HOSTILE.values()), ids=list(HOSTILE))
def test_peer_strings_reach_a_span_printable_and_bounded(spans, value):
    """Span attributes and a recorded exception's message are printable and bounded."""
    with pytest.raises(InvalidRequest):
        with tracing.span("edge_turn", session_id=value, request_id=value):
            tracing.start_span("uplink", link_id=value).end()
            raise InvalidRequest(f"edge_id {value}")
    finished = spans.get_finished_spans()
    assert {s.name for s in finished} == {"edge_turn", "uplink"}
    for s in finished:
        texts = [v for v in s.attributes.values() if isinstance(v, str)]
        texts += [v for ev in s.events for v in ev.attributes.values() if isinstance(v, str)]
        texts = [v for v in texts if "Traceback" not in v]  # the stack trace: lines of the daemon's code
        assert texts and all(_readable(v) and len(v) <= tracing.MAX_ATTR_CHARS + 40 for v in texts)


async def test_a_turn_with_a_hostile_session_id_logs_and_traces_it_printable(spans):
    """A real turn whose session id holds a line break, an ANSI escape and a forged record: every log
    line of the turn and every span attribute carries it escaped."""
    buf = io.StringIO()
    root = logging.getLogger()
    level = root.level
    handler = setup_logging("text", "DEBUG", stream=buf)
    session = f"s\r\n{FORGED}\x1b[2J\u2028"
    toy = await toy_stack()
    try:
        await run(toy.edge, turn(LONG, session))
    finally:
        await toy.batcher.stop()
        root.removeHandler(handler)
        root.setLevel(level)
    lines = buf.getvalue().splitlines()
    assert not [x for x in lines if x.startswith(FORGED)]
    ours = [x for x in lines if " tandem." in x]
    assert ours and all(_readable(x) for x in ours)
    assert any("session_id=s\\r\\n2026-12-06" in x for x in ours)
    turn_spans = [s for s in spans.get_finished_spans() if s.name in ("edge_turn", "cloud_turn")]
    assert len(turn_spans) == 2
    assert all(s.attributes["session_id"] == "s\\r\\n" + FORGED + "\\x1b[2J\\u2028" for s in turn_spans)


def samples_of(name: str) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for fam in REGISTRY.collect() for s in fam.samples if s.name == name]


async def test_each_links_share_weight_and_objectives_and_the_replicas_are_exported():
    toy = await toy_stack(offer_kw={"ttft_slo_ms": 800.0, "itl_p99_slo_ms": 90.0})
    try:
        await run(toy.edge, turn(LONG, "shares"))
        link_id = toy.edge.conn.link_id
        table = toy.gateway.registry.links
        (share,) = [v for labels, v in samples_of("tandem:link_share_seqs") if labels["link"] == link_id]
        assert share == table.share(link_id)[0] >= 1
        assert Samples.value("tandem:max_num_seqs") == table.max_num_seqs
        (weight,) = [v for labels, v in samples_of("tandem:link_weight") if labels["link"] == link_id]
        assert weight == 1.0  # a new link's, before the controller moved it
        (ttft,) = [v for labels, v in samples_of("tandem:link_slo_ttft_seconds") if labels["link"] == link_id]
        (itl,) = [v for labels, v in samples_of("tandem:link_slo_itl_seconds") if labels["link"] == link_id]
        assert (ttft, itl) == (0.8, 0.09)
        assert Samples.value("tandem:cloud_replicas", state="answering") == 1
        assert Samples.value("tandem:cloud_replicas", state="down") == 0
    finally:
        await toy.batcher.stop()
