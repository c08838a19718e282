"""Smoke runs of the benchmark scripts on real vLLM engines, with tiny arguments (results
meaningless): each script runs end to end and writes its tables and plots, so none rots. The link
emulator, the report and the benchmarks' arithmetic are unit-tested in ``tests/unit/test_benchmarks.py``."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.helpers import ROOT, TANDEM_BENCH


@pytest.fixture(scope="class")
def bench_cloud(split_dir, tmp_path_factory):
    """A plain ``tandem-cloud`` allowing every wire format, releasing an idle link's share after 2 s
    and stepping its SLO controller every second (its trace in ``trace.jsonl`` beside its log), for
    ``TestSmokeRunsOnOneCloud`` (class-scoped: down before the batching smoke starts its engine).
    Yields ``(host:port, trace file)``."""
    from tandem.common.protocol.params import WireDtype
    from tandem.daemons import Daemons, cloud_command

    w = tmp_path_factory.mktemp("bench-cloud")
    every = ",".join(d.name.lower() for d in WireDtype)
    extra = ["--wire-dtypes", every, "--kv-wire-dtypes", every, "--link-idle-s", "2"]
    extra += ["--slo-interval-s", "1", "--slo-trace-file", str(w / "trace.jsonl"), "--max-queue-wait-s", "5"]
    with Daemons() as daemons:
        cloud = daemons.spawn("tandem-cloud", cloud_command(split_dir, w / "kv", extra=extra), w / "cloud.log", w / "c")
        yield f"127.0.0.1:{cloud.wait_ready(900)}", w / "trace.jsonl"


class TestSmokeRunsOnOneCloud:
    """``tandem-bench modes``, ``multiturn`` and ``burst`` run end to end with tiny
    arguments against one shared ``tandem-cloud`` (``--cloud``) and write every output file; each would
    otherwise start its own, a minute apiece on 2 cores. Their own start of a cloud (with the engine
    configuration of each) is what ``make bench`` runs."""

    def test_bench_smoke(self, tmp_path, bench_cloud, split_dir):
        target, _ = bench_cloud
        out = tmp_path / "bench"
        cmd = [
            TANDEM_BENCH,
            "modes",
            "--split-layers",
            "4",
            "--links",
            "loopback,4g",
            "--prompt-lens",
            "16",
            "--requests",
            "1",
            "--output-lens",
            "2,3",
            "--cloud",
            target,
            "--model-dir",
            str(split_dir.parent),
            "--out",
            str(out),
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
        assert res.returncode == 0, res.stderr[-3000:]
        for n in (2, 3):  # the matrix once per output length, on one stack
            run = out / f"out-{n}"
            rows = list(open(run / "summary.csv"))
            # header + split-k4, cloud-only, edge-only, remote-prefill, auto, auto-whole on 2 links
            assert len(rows) == 1 + 2 * 6
            auto = (run / "auto.md").read_text()
            assert "auto / best" in auto and "| auto-whole e2e ms | auto-whole / best |" in auto
            records = [json.loads(x) for x in open(run / "records.jsonl")]
            whole = [r["mode_reason"] for r in records if r["mode"] == "auto-whole"]  # why the edge chose
            assert len(whole) == 2 and all("whole reply" in x for x in whole)
            assert not any("whole reply" in r["mode_reason"] for r in records if r["mode"] == "auto")
            meta = json.loads((run / "meta.json").read_text())
            assert meta["shaper"] == "proxy" and meta["max_new_tokens"] == n  # a running cloud: through the proxy
            assert (run / "breakeven.png").stat().st_size > 0
            assert all(r["output_tokens"] == n for r in records)
        outputs = (out / "outputs.md").read_text()
        assert "| 4g | " in outputs and "| auto-whole |" in outputs and "| auto-whole e2e / lowest |" in outputs
        assert (out / "outputs.png").stat().st_size > 0

    def test_multiturn_smoke(self, tmp_path, bench_cloud, split_dir):
        target, _ = bench_cloud
        out = tmp_path / "multiturn"
        cmd = [TANDEM_BENCH, "multiturn", "--conversations", "1", "--turns", "3"]
        cmd += ["--cloud", target, "--model-dir", str(split_dir.parent)]
        cmd += ["--max-new-tokens", "4", "--out", str(out)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
        assert res.returncode == 0, res.stderr[-3000:]
        per_turn = json.loads((out / "multiturn.json").read_text())["per_turn"]
        assert len(per_turn) == 3 and all(r["same_replies"] for r in per_turn)
        assert per_turn[0]["delta_bytes"] == pytest.approx(per_turn[0]["naive_bytes"], rel=0.05)  # first turn: all
        assert per_turn[2]["delta_bytes"] < per_turn[2]["naive_bytes"] / 2  # later turns: only what is new
        assert (out / "multiturn.png").stat().st_size > 0 and "saved" in (out / "multiturn.md").read_text()

    def test_burst_smoke(self, tmp_path, bench_cloud, split_dir):
        """Two edges on the shared cloud, one flooding it: the table, every request and the
        controller's trace of the run (the cloud's lines of the quiet and flood links) are written."""
        target, trace = bench_cloud
        out = tmp_path / "burst"
        cmd = [
            TANDEM_BENCH, "burst", "--alone-s", "2", "--burst-s", "4",
            "--flood-concurrency", "2", "--no-compare", "--max-new-tokens", "2", "--out", str(out),
            "--cloud", target, "--cloud-trace-file", str(trace), "--model-dir", str(split_dir.parent),
        ]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
        assert res.returncode == 0, res.stderr[-3000:]
        assert "| on | alone |" in (out / "burst.md").read_text()
        lines = (out / "trace-on.jsonl").read_text().splitlines()
        assert lines and {json.loads(x)["edge_id"] for x in lines} <= {"quiet", "flood"}
        assert (out / "burst_trace.png").stat().st_size > 0


def test_batching_smoke(tmp_path):
    """``tandem-bench batching`` runs end to end with tiny arguments and writes its table and plot.
    It measures vLLM's ``AsyncLLM`` itself at each ``max_num_seqs`` (one engine per setting, no
    tandem cloud), so it cannot use the shared cloud."""
    out = tmp_path / "batching"
    cmd = [
        TANDEM_BENCH,
        "batching",
        "--max-num-seqs",
        "2",
        "--requests",
        "2",
        "--max-new-tokens",
        "2",
        "--prompt-tokens",
        "16",
        "--out",
        str(out),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads((out / "batching.json").read_text())
    assert [r["max_num_seqs"] for r in data["rows"]] == [2]
    assert (out / "batching.png").stat().st_size > 0


def test_fidelity_smoke(tmp_path, split_dir):
    """``tandem-bench fidelity`` with three chats and three tokens: the engine references and floors
    (two vLLM engines, none of them the shared cloud: fp32 one request at a time then four at a
    time, and bf16), the in-process teacher-forced pass, remote prefill's downlink rows, the edge row
    of the prepared fp32 builder graph (``edge-decoder/``), the divergence gaps of every row, the
    tables, the plot and the fidelity table."""
    out = tmp_path / "fidelity"
    cmd = [TANDEM_BENCH, "fidelity", "--limit", "3", "--max-new-tokens", "3"]
    cmd += ["--model-dir", str(split_dir.parent), "--pairs", "int8_hadamard/int4", "--out", str(out)]
    cmd += ["--downlink-kvs", "int4"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads((out / "fidelity.json").read_text())
    assert [r["pair"] for r in data["rows"]] == ["fp32/fp32", "int8_hadamard/int4"]
    fp32, small = data["rows"]
    assert fp32["kl_full_mean"] == 0 and fp32["flip_rate"] == 0  # the reference against itself
    assert small["kl_full_mean"] > 0 and small["bytes_per_token"] < fp32["bytes_per_token"] / 5
    assert set(data["floors"]) == {"batching", "bf16", "in_process"}
    assert data["floors"]["in_process"]["kl_mean"] < 1e-3  # in-process fp32 computes what the engine does
    (edge,) = data["edge"]  # the model directory's edge-decoder/, found by default
    assert edge["title"] == "fp32 engine vs edge whole model (builder graph, fp32 on cpu)"
    assert edge["kl_mean"] < 1e-3 and edge["positions"] == data["floors"]["bf16"]["positions"]
    assert all(r["divergence"]["divergences"] <= 3 for r in [edge, *data["rows"], *data["floors"].values()])
    md = (out / "fidelity.md").read_text()
    assert (out / "fidelity.png").stat().st_size > 0 and "within the floor" in md
    assert f"| edge: {edge['title']} |" in md and "At each reply's first greedy divergence" in md
    table = json.loads((out / "fidelity-table.json").read_text())
    assert [e["kv"] for e in table["splits"]["4"]] == ["int4", "fp32"]  # smallest first
    # remote prefill's downlink: fp32 the reference (against itself: nothing), int4 measured and tabled
    assert [d["kv"] for d in data["downlink"]] == ["fp32", "int4"]
    ref_row, int4 = data["downlink"]
    assert ref_row["kl_full_mean"] == 0 and int4["bytes_per_token"] < ref_row["bytes_per_token"] / 5
    assert [e["kv"] for e in table["remote_prefill"]] == ["int4"] and "Remote prefill's downlink" in md
