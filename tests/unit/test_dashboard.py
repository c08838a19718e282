"""The Grafana dashboard (docs/deploy/grafana/tandem-dashboard.json) against Grafana's dashboard
model and against the metrics the code exports: every ``tandem:`` name it queries is one the edge
or the cloud exports (``exported_labels`` of ``edge.metrics`` and ``cloud.metrics``), every label it
groups or filters by is one of that metric's, the one vLLM metric is the one tandem re-exports, and
it shows what operators watch (per-link shares and weights, TTFT/ITL per mode against objectives,
modes and prediction error, KV cache use, transfers, resumes and resyncs, replica health)."""

from __future__ import annotations

import json
import re

from tandem.cloud import metrics as cloud_metrics
from tandem.cloud.engines import vllm_metrics
from tandem.edge import metrics as edge_metrics
from tests.helpers import ROOT

DASHBOARD = ROOT / "docs" / "deploy" / "grafana" / "tandem-dashboard.json"
NAME = re.compile(r"\b((?:tandem|vllm):[A-Za-z0-9_:]+)")
BY = re.compile(r"\bby \(([^)]*)\)")
SELECTOR = re.compile(r"\{([^}]*)\}")


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def exprs() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]


def test_the_dashboard_is_a_grafana_dashboard_model():
    d = dashboard()
    assert d["uid"] and d["title"] and isinstance(d["schemaVersion"], int)
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0
        if p["type"] == "row":
            continue
        assert p["type"] == "timeseries" and p["datasource"]["uid"] == "${datasource}"
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)) and all(t["expr"].strip() for t in p["targets"])
    cells = [(p["gridPos"]["y"] + dy, p["gridPos"]["x"] + dx) for p in d["panels"] for dy in range(p["gridPos"]["h"])
             for dx in range(p["gridPos"]["w"])]  # fmt: skip
    assert len(cells) == len(set(cells)), "panels overlap"


def test_every_query_names_exported_metrics_and_their_labels():
    exported = edge_metrics.exported_labels() | cloud_metrics.exported_labels()
    vllm = {vllm_metrics._KV_USAGE}
    for expr in exprs():
        names = set(NAME.findall(expr))
        assert names, expr
        unknown = {n for n in names if n not in exported and n not in vllm}
        assert not unknown, f"{expr}: not exported by tandem: {unknown}"
        labels = set().union(*(exported.get(n, set()) for n in names)) | {"le"}
        used = {x.strip() for g in BY.findall(expr) for x in g.split(",")}
        used |= {kv.split("=")[0].strip() for g in SELECTOR.findall(expr) for kv in g.split(",") if "=" in kv}
        assert used <= labels, f"{expr}: labels {used - labels} not on {names}"


def test_a_query_of_a_metric_that_does_not_exist_is_caught():
    exported = edge_metrics.exported_labels() | cloud_metrics.exported_labels()
    assert "tandem:time_to_first_token_seconds_bucket" in exported
    assert "tandem:time_to_first_token_seconds" not in exported  # a histogram is queried by its samples
    assert "tandem:requests" not in exported and "tandem:requests_total" in exported


def test_the_dashboard_shows_what_operators_watch():
    queried = {n for e in exprs() for n in NAME.findall(e)}
    assert {
        "tandem:link_share_seqs",
        "tandem:max_num_seqs",
        "tandem:link_weight",
        "tandem:link_p99_ttft_seconds",
        "tandem:link_slo_ttft_seconds",
        "tandem:link_slo_itl_seconds",
        "tandem:time_to_first_token_seconds_bucket",
        "tandem:inter_token_latency_seconds_bucket",
        "tandem:requests_total",
        "tandem:generation_tokens_total",
        "tandem:ttft_prediction_error_ratio_bucket",
        "vllm:kv_cache_usage_perc",
        "tandem:uplink_bytes_total",
        "tandem:received_bytes_total",
        "tandem:turn_resumes_total",
        "tandem:session_resyncs_total",
        "tandem:session_syncs_total",
        "tandem:cloud_replicas",
    } <= queried
