"""Benchmarks: the link emulator and report as units, and a smoke run of each script with
tiny arguments (results meaningless) so none rots."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tandem.benchmarks.linkproxy import LinkProxy
from tandem.benchmarks.links import PROFILES, LinkProfile, get
from tandem.benchmarks.records import RequestRecord
from tandem.stages import Stage


async def echo_server():
    async def handle(r, w):
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
        w.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


async def test_proxy_adds_rtt_and_serialisation_delay():
    echo = await echo_server()
    proxy = LinkProxy("127.0.0.1", echo.sockets[0].getsockname()[1])
    server = await asyncio.start_server(proxy.handle, "127.0.0.1", 0)
    r, w = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
    proxy.set_profile(LinkProfile("t", rtt_ms=40.0, uplink_mbps=8.0, downlink_mbps=None))
    t0 = time.perf_counter()
    w.write(b"x")
    await w.drain()
    assert await r.readexactly(1) == b"x"
    rtt_ms = (time.perf_counter() - t0) * 1e3
    payload = bytes(100_000)  # 0.1 s at 8 Mbit/s uplink
    t0 = time.perf_counter()
    w.write(payload)
    await w.drain()
    assert await r.readexactly(len(payload)) == payload
    bulk_ms = (time.perf_counter() - t0) * 1e3
    w.close()
    server.close()
    echo.close()
    assert rtt_ms >= 40.0  # one-way delay each way: a lower bound the emulator must honour
    assert bulk_ms >= 100.0 + 40.0
    assert proxy.up.bytes == 100_001


async def test_proxy_taps_grpc_messages_changes_them_and_cuts_the_link():
    """A real grpc.aio server (the Health service) behind the proxy reading HTTP/2: the tap sees
    the request go up and the answer and the stream's end come down; a byte it changes arrives
    changed (an unknown service's name); ``CutLink`` resets the connection (UNAVAILABLE) and the
    next call connects again."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from tandem.benchmarks.linkproxy import CutLink, Tap

    class Watch(Tap):
        def __init__(self) -> None:
            self.seen: list[tuple[bool, int, int, bytes]] = []
            self.ends: list[bool] = []
            self.flip = self.cut = False

        def data(self, up, msg, offset, body):
            self.seen.append((up, msg.tag, msg.length, bytes(body)))
            if up and self.flip:
                body[-1] ^= 0x20  # "tandem" -> "tandeM"
            if not up and self.cut:
                raise CutLink

        def end_stream(self, up, stream_id):
            self.ends.append(up)

    server = grpc.aio.server()
    hs = health.aio.HealthServicer()
    await hs.set("tandem", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    upstream = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    proxy = LinkProxy("127.0.0.1", upstream, h2=True)
    link = await asyncio.start_server(proxy.handle, "127.0.0.1", 0)
    proxy.tap = tap = Watch()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{link.sockets[0].getsockname()[1]}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            req = health_pb2.HealthCheckRequest(service="tandem")
            assert (await stub.Check(req, timeout=5)).status == health_pb2.HealthCheckResponse.SERVING
            answer = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING).SerializeToString()
            assert (True, 0x0A, len(req.SerializeToString()), req.SerializeToString()) in tap.seen
            assert (False, 0x08, len(answer), answer) in tap.seen and tap.ends == [True, False]
            tap.flip = True
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Check(req, timeout=5)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND  # the server got "tandeM"
            tap.flip, tap.cut = False, True
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Check(req, timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            tap.cut = False
            # the cut leaves the channel's transport broken; gRPC may notice it on the next call
            # (UNAVAILABLE "Stream removed") before it reconnects, so allow that once
            for attempt in range(2):
                try:
                    reply = await stub.Check(req, timeout=5, wait_for_ready=True)
                    break
                except grpc.aio.AioRpcError as again:
                    if again.code() != grpc.StatusCode.UNAVAILABLE or attempt:
                        raise
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        link.close()
        await server.stop(0)


def test_proxy_process_reports_its_port_and_takes_profiles(tmp_path):
    import socket

    from tandem.daemons import Daemons

    with Daemons(grace_s=5) as ds:
        cmd = [sys.executable, "-m", "tandem.benchmarks.linkproxy", "0", "127.0.0.1:9", "no-rate"]
        proxy = ds.spawn("link proxy", cmd, tmp_path / "proxy.log", tmp_path / "proxy.port", stdin=subprocess.PIPE)
        port = proxy.wait_ready(30, poll_s=0.05)
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        assert proxy.proc.stdin is not None
        proxy.proc.stdin.write((json.dumps(PROFILES["4g"].as_dict()) + "\n").encode())
        proxy.proc.stdin.flush()
        deadline = time.monotonic() + 10
        while "ok" not in proxy.tail() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proxy.tail().splitlines() == [str(port), "ok"]


def test_console_scripts_are_found_beside_the_interpreter_or_on_path(tmp_path, monkeypatch):
    """An install with ``pip --target`` keeps its scripts off the interpreter's ``bin/``: the
    daemons' commands then come from ``PATH``, and a script in neither place is named in the error."""
    from tandem import daemons

    venv_bin, other_bin = tmp_path / "venv" / "bin", tmp_path / "site" / "bin"
    for d in (venv_bin, other_bin):
        d.mkdir(parents=True)
    monkeypatch.setattr(sys, "executable", str(venv_bin / "python3"))
    monkeypatch.setenv("PATH", str(other_bin))
    with pytest.raises(FileNotFoundError, match="tandem-cloud.*neither beside.*nor on PATH"):
        daemons.console_script("tandem-cloud")
    on_path = other_bin / "tandem-cloud"
    on_path.write_text("#!/bin/sh\n")
    on_path.chmod(0o755)
    assert daemons.console_script("tandem-cloud") == str(on_path)
    beside = venv_bin / "tandem-cloud"
    beside.write_text("#!/bin/sh\n")
    beside.chmod(0o755)
    assert daemons.console_script("tandem-cloud") == str(beside)


def test_a_run_with_longer_prompts_raises_both_daemons_limits():
    from tandem.benchmarks.stack import prompt_limit_args
    from tandem.edge.config import EdgeConfig

    default = EdgeConfig.model_fields["max_prompt_tokens"].default
    assert prompt_limit_args(default) == []
    assert prompt_limit_args(4100) == ["--max-prompt-tokens", "4100"]


def test_cloud_targets_parse_with_clear_errors():
    from tandem.benchmarks.stack import parse_host_port

    assert parse_host_port("127.0.0.1:50051") == ("127.0.0.1", 50051)
    assert parse_host_port("[::1]:7000") == ("::1", 7000)
    for bad in ("localhost", ":80", "host:http", "host:0", "host:70000", "[::1]"):
        with pytest.raises(ValueError, match="not host:port"):
            parse_host_port(bad)


def test_profiles_are_complete():
    assert {"loopback", "lan", "wifi6", "5g", "4g", "wan"} <= set(PROFILES)
    with pytest.raises(KeyError, match="unknown link profile"):
        get("loopback,moon")


def test_report_writes_tables_and_plots(tmp_path):
    from tandem.benchmarks import report

    recs = []
    for mode, link, ttft in [
        ("split-k4", "loopback", 300.0),
        ("cloud-only", "loopback", 100.0),
        ("edge-only", "none", 200.0),
        ("split-k4", "4g", 600.0),
        ("cloud-only", "4g", 160.0),
        ("auto", "4g", 170.0),
    ]:
        for n in (32, 128):
            recs.append(
                RequestRecord(
                    mode,
                    link,
                    n,
                    n,
                    4,
                    ttft * n / 32,
                    ttft * 2,
                    [10.0, 12.0],
                    0.0,
                    1.0,
                    sent_bytes={"activations": 2304 * n, "kv": 6144 * n, "header": 100}
                    if mode.startswith("split")
                    else {"header": 100},
                    # payload received at 9 Mbit/s on the cloud's clock (header included), after 5 ms
                    # queued for admission; the edge's uplink stage adds an RTT
                    timings_ms={
                        "edge_head_ms": 2.0,
                        "cloud_decode_ms": 9.0,
                        "uplink_ms": (8448 * n + 100) * 8 / 9e3 + 55.0,
                        "cloud_upload_wait_ms": (8448 * n + 100) * 8 / 9e3 + 5.0,
                        "cloud_queue_ms": 5.0,
                    }
                    if mode.startswith("split")
                    else {},
                    served_mode="direct" if mode in ("auto", "cloud-only") else mode.split("-")[0],
                    predicted_ttft_ms=ttft * n / 32 * 0.9,
                )
            )
    rows = report.write_all(
        tmp_path,
        recs,
        {"platform": "p", "cpus": 2, "versions": {}, "shaper": "proxy", "links": [PROFILES["4g"].as_dict()]},
    )
    split = next(r for r in rows if r["mode"] == "split-k4" and r["link"] == "4g" and r["prompt_tokens"] == 32)
    assert split["bytes_per_prompt_token"] == pytest.approx((2304 + 6144) + 100 / 32)
    assert split["ttft_mean_ms"] == 600.0
    assert split[Stage.EDGE_HEAD] == 2.0 and split[Stage.CLOUD_DECODE] == 9.0  # columns named by the wire keys
    assert all(type(k) is str for k in split)
    md = (tmp_path / "summary.md").read_text()
    assert "| split-k4 | 4g | 32 | 3.75x | cloud-only |" in md
    assert "| split-k4 | 4g | 128 | 1.08 | 961 | 9.0 | 10 | 90% |" in md  # uplink goodput on the shaped link
    assert "| split-k4 | loopback |" not in md.split("Uplink goodput")[1]  # no shaped rate to compare with
    auto = (tmp_path / "auto.md").read_text()
    assert "| 4g | 32 | cloud-only | 160.0 | 170.0 | 1.06x | direct x1 | 10% |" in auto
    assert "auto within 10% of the best fixed mode's TTFT in 2 of 2 cells" in auto
    for f in ("summary.csv", "records.jsonl", "ttft_vs_prompt.png", "breakeven.png", "meta.json"):
        assert (tmp_path / f).stat().st_size > 0
    assert len(report.load_records(tmp_path / "records.jsonl")) == len(recs)

    from tandem.benchmarks.bench import rerender

    (tmp_path / "summary.md").write_text("stale")
    (tmp_path / "auto.md").unlink()
    rerender(tmp_path)  # tandem-bench modes --render: the same report from records.jsonl and meta.json
    assert (tmp_path / "summary.md").read_text() == md and (tmp_path / "auto.md").read_text() == auto


def _rec(mode: str, ttft: float, e2e: float, served: str, n: int = 32) -> RequestRecord:
    return RequestRecord(
        mode, "4g", n, n, 16, ttft, e2e, [10.0], 0.0, 1.0, served_mode=served, predicted_ttft_ms=ttft * 0.8
    )


def test_auto_whole_is_judged_by_end_to_end_time_and_is_never_a_fixed_mode(tmp_path):
    """``auto-whole`` (auto with ``whole_reply``) faster than every fixed mode by TTFT and by end to
    end: it is never the best fixed mode, and its ratio is against the best fixed mode's end-to-end
    time (edge-only here), while ``auto``'s is against the best TTFT (cloud-only)."""
    from tandem.benchmarks import report

    recs = [_rec("cloud-only", 100.0, 1000.0, "direct"), _rec("edge-only", 150.0, 600.0, "local")]
    recs += [_rec("split-k4", 300.0, 1200.0, "split"), _rec("auto", 105.0, 990.0, "direct")]
    recs += [_rec("auto-whole", 90.0, 540.0, "local"), _rec("auto-whole", 90.0, 720.0, "local")]
    rows = report.write_all(tmp_path, recs, {"platform": "p", "cpus": 2, "versions": {}, "shaper": "proxy"})
    assert report.best_fixed(rows)[("4g", 4)]["mode"] == "cloud-only"
    assert report.best_fixed(rows, "e2e_mean_ms")[("4g", 4)]["mode"] == "edge-only"
    cells = {c["label"]: c for c in report.auto_cells(rows, recs)}
    assert cells["auto"]["best_mode"] == "cloud-only" and cells["auto"]["ratio"] == pytest.approx(1.05)
    whole = cells["auto-whole"]
    assert whole["best_mode"] == "edge-only" and whole["metric_name"] == "e2e"
    assert whole["auto_ms"] == 630.0 and whole["ratio"] == pytest.approx(630.0 / 600.0)
    assert whole["served"] == {"local": 2}
    auto = (tmp_path / "auto.md").read_text()
    assert "| 4g | 32 | cloud-only | 100.0 | 105.0 | 1.05x | direct x1 | 20% |" in auto
    assert "| link | prompt tok | best fixed mode (e2e) | its e2e ms | auto-whole e2e ms | auto-whole / best |" in auto
    assert "| 4g | 32 | edge-only | 600.0 | 630.0 | 1.05x | local x2 | 20% |" in auto
    assert "auto-whole within 10% of the best fixed mode's e2e in 1 of 1 cells" in auto
    assert "| split-k4 | 4g | 32 | 3.00x | cloud-only |" in (tmp_path / "summary.md").read_text()


def test_an_auto_row_over_the_target_is_marked_and_counted_by_its_own_objective():
    from tandem.benchmarks import report

    recs = [_rec("cloud-only", 100.0, 1000.0, "direct"), _rec("edge-only", 150.0, 600.0, "local")]
    recs += [_rec("auto", 150.0, 600.0, "local"), _rec("auto-whole", 100.0, 1000.0, "direct")]
    md = report.auto_markdown(report.auto_cells(report.summarize(recs), recs))
    assert "| 1.50x **over** | local x1 |" in md and "| 1.67x **over** | direct x1 |" in md
    assert "auto within 10% of the best fixed mode's TTFT in 0 of 1 cells" in md
    assert "auto-whole within 10% of the best fixed mode's e2e in 0 of 1 cells" in md


def test_auto_rows_are_the_auto_labels_and_the_objectives_choose_them():
    import typer

    from tandem.benchmarks.bench import mode_specs, parse_auto_objectives
    from tandem.benchmarks.records import is_auto

    assert [is_auto(x) for x in ("auto", "auto-whole", "auto-x", "split-k4", "cloud-only", "automatic")] == [
        True,
        True,
        True,
        False,
        False,
        False,
    ]
    assert parse_auto_objectives("whole, ttft") == ["ttft", "whole"]
    for bad in ("", "ttft,ttft", "e2e"):
        with pytest.raises(typer.BadParameter, match="auto-objectives"):
            parse_auto_objectives(bad)
    specs = mode_specs([4], True, ["ttft", "whole"])
    assert [(s.label, s.mode, s.whole_reply) for s in specs[-2:]] == [
        ("auto", "auto", False),
        ("auto-whole", "auto", True),
    ]
    assert not any(s.whole_reply for s in specs[:-1])
    assert [s.label for s in mode_specs([4], False, ["whole"])] == ["split-k4", "cloud-only", "auto-whole"]
    assert [s.label for s in mode_specs([4], False, [])] == ["split-k4", "cloud-only"]


def test_render_refuses_a_folder_without_records(tmp_path):
    """``tandem-bench modes --render`` on a folder with no run in it names the folder (exit 2)."""
    from typer.testing import CliRunner

    from tandem.benchmarks.cli import app

    run = CliRunner().invoke(app, ["modes", "--render", "--out", str(tmp_path)], env={"COLUMNS": "300"})
    assert run.exit_code == 2 and "no records.jsonl" in run.output, run.output


def test_batching_rows_table_and_plot(tmp_path):
    """The sweep's per-engine row and its plot over several rows, on made-up timings (the smoke
    below runs one real engine)."""
    from tandem.benchmarks.batching import plot, row_of

    def res(n: int, step_ms: float) -> list[dict]:
        out = []
        for i in range(n):
            t0 = i * 0.01
            out.append({"ttft_ms": 50.0 + i, "e2e_ms": 50.0 + 3 * step_ms, "tokens": 4, "itl_ms": [step_ms] * 3,
                        "t0": t0, "t1": t0 + (50.0 + 3 * step_ms) / 1e3})  # fmt: skip
        return out

    rows = [row_of(n, 1 << 30, res(4, 10.0 * n)) for n in (1, 2, 4)]
    assert [r["max_num_seqs"] for r in rows] == [1, 2, 4]
    assert rows[0]["output_tokens_per_s"] == pytest.approx(16 / (0.03 + 0.08))
    assert rows[2]["itl_p99_ms"] == pytest.approx(40.0) and rows[0]["kv_cache_mib"] == 1024
    plot(rows, tmp_path / "batching.png")
    assert (tmp_path / "batching.png").stat().st_size > 0


def test_burst_summary_and_plot(tmp_path):
    from tandem.benchmarks.burst import Sample, plot, summary

    args = {"quiet_ttft_slo_ms": 500.0, "flood_concurrency": 4, "alone_s": 10.0, "burst_s": 20.0, "max_num_seqs": 4}
    samples = [Sample("quiet", "on", t, 100.0 + t, "ok") for t in range(0, 30, 2)]
    samples += [Sample("flood", "on", 10.0 + t, 900.0, "ok" if t % 3 else "ResourceExhausted") for t in range(20)]
    trace = [
        {"time": 100.0 + t, "edge_id": e, "max_concurrent_requests": 1 + (e == "quiet") * (t > 5), "p99_ttft_ms": 300.0}
        for t in range(30)
        for e in ("quiet", "flood")
    ]
    (tmp_path / "trace-on.jsonl").write_text("".join(json.dumps(r) + "\n" for r in trace))
    md = summary(samples, args)
    assert "| on | alone | 5 | 104 | 108 | yes | 0 | 0 | nan |" in md
    assert "| on | burst | 10 |" in md and "| 13 | 7 |" in md  # flood: 13 served, 7 refused
    plot(samples, tmp_path, args)
    assert (tmp_path / "burst_trace.png").stat().st_size > 0


def test_fidelity_prompt_set_sample_and_pairs():
    import typer

    from tandem.benchmarks.fidelity import PROMPTS, load_prompts, parse_pairs
    from tandem.common.protocol.params import WireDtype as W

    prompts = load_prompts(PROMPTS, 0)
    assert len(prompts) >= 200 and len({p["id"] for p in prompts}) == len(prompts)
    assert len({p["category"] for p in prompts}) >= 15
    assert len({p["messages"][-1]["content"] for p in prompts}) == len(prompts)  # no prompt twice
    sample = load_prompts(PROMPTS, 0, 40)
    assert [p["id"] for p in sample] == [p["id"] for p in prompts[::5]]
    assert parse_pairs("int8_hadamard/int4, fp16/fp16") == [
        (W.FP32, W.FP32),
        (W.INT8_HADAMARD, W.INT4),
        (W.FP16, W.FP16),
    ]
    with pytest.raises(typer.BadParameter, match="int3"):
        parse_pairs("int3/fp16")


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_round_orders_balance_what_runs_before_each_mode(n):
    """Over n rounds (n even) or 2n (n odd) every mode directly follows every other equally often."""
    from tandem.benchmarks.bench import ModeSpec, round_order

    specs = [ModeSpec(str(i), "direct") for i in range(n)]
    follows: dict[tuple[str, str], int] = {}
    for i in range(n if n % 2 == 0 else 2 * n):
        order = [s.label for s in round_order(specs, i)]
        assert sorted(order) == sorted(s.label for s in specs)  # every mode once per round
        for a, b in zip(order, order[1:], strict=False):
            follows[(a, b)] = follows.get((a, b), 0) + 1
    assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1


def test_multiturn_summary_is_cumulative_per_conversation():
    from tandem.benchmarks.multiturn import summarise

    rows = [
        {
            "conversation": c,
            "turn": t,
            "prompt_tokens": 100 * t,
            "delta_bytes": d,
            "naive_bytes": 1000 * t,
            "same_reply": True,
        }
        for c in range(2)
        for t, d in ((1, 1000), (2, 300))
    ]
    per_turn = summarise(rows, 2)
    assert [r["cum_naive_bytes"] for r in per_turn] == [1000, 3000]
    assert [r["cum_delta_bytes"] for r in per_turn] == [1000, 1300]
    assert per_turn[0]["saved"] == 0 and per_turn[1]["saved"] == pytest.approx(1 - 1300 / 3000)


def test_a_runs_block_stores_are_removed_at_exit_and_its_logs_kept():
    """Benchmarks leave gigabytes of KV in their work folder's stores: removed when the process
    exits (after its daemons stopped), the logs kept for reading."""
    import subprocess
    import sys

    code = (
        "from tandem.daemons import work_dir\n"
        "w = work_dir('tandem-test-')\n"
        "for d in ('kv', 'kv-on'):\n"
        "    (w / d).mkdir(); (w / d / 'cache.db').write_bytes(bytes(1000))\n"
        "(w / 'cloud.log').write_text('log')\n"
        "print(w)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout

    w = Path(out.strip())
    try:
        assert (w / "cloud.log").read_text() == "log"
        assert not (w / "kv").exists() and not (w / "kv-on").exists()
    finally:
        import shutil

        shutil.rmtree(w, ignore_errors=True)


def test_poisson_arrivals_are_seeded_and_have_the_offered_rate():
    from tandem.benchmarks.capacity import poisson_arrivals_s

    a = poisson_arrivals_s(4.0, 4000, seed=3)
    assert a == poisson_arrivals_s(4.0, 4000, seed=3) and a != poisson_arrivals_s(4.0, 4000, seed=4)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:], strict=False))
    gaps = np.diff(a)
    assert abs(gaps.mean() - 0.25) < 0.02  # mean inter-arrival 1 / rate
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.1  # exponential: coefficient of variation 1
    with pytest.raises(ValueError):
        poisson_arrivals_s(0.0, 3, 0)


def test_capacity_goodput_attainment_and_table(tmp_path):
    from tandem.benchmarks.capacity import Sample, capacity_rps, plot, rate_result, summary_md

    def cell(mode: str, rate: float, ttfts: list[float], failed: int = 0) -> list[Sample]:
        out = [Sample(mode, rate, i / rate, t, t + 100.0, "ok") for i, t in enumerate(ttfts)]
        return out + [Sample(mode, rate, len(ttfts) / rate, float("nan"), 50.0, "ResourceExhausted")] * failed

    r = rate_result(cell("cloud-only", 1.0, [100.0, 200.0, 900.0, 3000.0]), slo_ms=1000.0)
    assert (r.sent, r.served, r.met_slo) == (4, 4, 3) and r.attainment == 0.75
    assert r.span_s == pytest.approx(3.0 + 3.1)  # first arrival at 0, the last ends at 3 s + 3.1 s
    assert r.served_rps == pytest.approx(4 / 6.1)  # served over first arrival .. last completion
    assert r.goodput_rps == 0.75 * 1.0  # attainment x the offered rate
    # the same schedule and attainment with a slower drain: the same goodput, a lower served rate
    slow = rate_result(
        [
            Sample("auto", 1.0, x.arrival_s, x.ttft_ms, x.e2e_ms + 2000.0, "ok")
            for x in cell("auto", 1.0, [100.0, 200.0, 900.0, 3000.0])
        ],
        slo_ms=1000.0,
    )
    assert slow.goodput_rps == r.goodput_rps and slow.served_rps < r.served_rps
    # an ITL objective too: mean ITL 50, 100, 150, 200 ms over 8 tokens each; 120 ms admits two
    itl = [Sample("auto", 1.0, float(i), 100.0, 100.0 + 50.0 * (i + 1) * 7, "ok", output_tokens=8) for i in range(4)]
    assert [x.mean_itl_ms(0) for x in itl] == pytest.approx([50.0, 100.0, 150.0, 200.0])
    by_itl = rate_result(itl, 1000.0, itl_slo_ms=120.0)
    assert by_itl.met_slo == 2 and by_itl.goodput_rps == 0.5 and by_itl.p99_itl_ms == pytest.approx(200.0)
    assert rate_result(itl, 1000.0).met_slo == 4  # TTFT alone
    assert Sample("a", 1.0, 0.0, 100.0, 800.0, "ok").mean_itl_ms(8) == 100.0  # tokens not recorded: the run's
    assert Sample("a", 1.0, 0.0, float("nan"), 5.0, "Unavailable").mean_itl_ms(8) == float("inf")
    failed = rate_result(cell("split-k4", 2.0, [100.0], failed=1), slo_ms=1000.0)
    assert failed.met_slo == 1 and failed.p99_ttft_ms == float("inf")  # a refusal is a miss, not a fast answer
    with pytest.raises(ValueError):
        rate_result(cell("a", 1.0, [1.0]) + cell("b", 1.0, [1.0]), 1000.0)
    results = [
        rate_result(cell("cloud-only", 1.0, [100.0] * 10), 1000.0),
        rate_result(cell("cloud-only", 2.0, [100.0] * 9 + [5000.0]), 1000.0),
        rate_result(cell("split-k15", 1.0, [100.0] * 10), 1000.0),
        rate_result(cell("split-k15", 2.0, [100.0] * 10), 1000.0),
    ]
    assert capacity_rps(results[:2], 0.99) == 1.0 and capacity_rps(results[2:], 0.99) == 2.0
    assert capacity_rps(results[1:2], 0.99) == 0.0
    lucky = [results[1], rate_result(cell("cloud-only", 3.0, [100.0] * 10), 1000.0)]
    assert capacity_rps(lucky + results[:1], 0.99) == 1.0  # a pass above a failed rate does not count
    args = dict(ttft_slo_ms=1000.0, attainment=0.99, requests=10, prompt_tokens=256, max_new_tokens=8)
    md = summary_md(results, args | dict(link="lan", cloud_cpus="1", edge_cpus="0"))
    assert "| split-k15 | 2 | 2.00x | " in md and md.rstrip().endswith("| yes |")
    assert "| cloud-only | 2 | 10 | 10 | 100 | 5000 | 0.0 | 90% |" in md  # nearest-rank p99 of 10: the largest
    plot(results, tmp_path, 1000.0)
    assert (tmp_path / "capacity.png").stat().st_size > 0


def test_capacity_render_summarises_a_runs_samples_again(tmp_path):
    """``--render`` on a capacity.json: the same cells from its samples, the cloud's work kept."""
    from dataclasses import asdict

    from typer.testing import CliRunner

    from tandem.benchmarks.capacity import Sample, app, rate_result
    from tandem.benchmarks.cloudwork import CloudWork

    args = dict(
        ttft_slo_ms=1000.0,
        attainment=0.99,
        requests=3,
        prompt_tokens=256,
        max_new_tokens=8,
        link="lan",
        cloud_cpus="1",
        edge_cpus="0",
    )
    samples = [
        Sample(m, 1.0, float(i), 100.0 * (i + 1), 400.0, "ok", "direct")
        for m in ("cloud-only", "auto")
        for i in range(3)
    ]
    cells = [rate_result(samples[:3], 1000.0, CloudWork(30.0, 300.0, 6.0)), rate_result(samples[3:], 1000.0)]
    (tmp_path / "capacity.json").write_text(
        json.dumps(
            {"meta": {"args": args}, "cells": [asdict(c) for c in cells], "samples": [asdict(s) for s in samples]}
        )
    )
    run = CliRunner().invoke(app, ["--render", "--out", str(tmp_path)], env={"COLUMNS": "300"})
    assert run.exit_code == 0, run.output
    again = json.loads((tmp_path / "capacity.json").read_text())["cells"]
    assert [(c["mode"], c["goodput_rps"], c["gateway_cpu_ms"], c["gpu_ms"]) for c in again] == [
        ("cloud-only", 1.0, 10.0, 2.0),
        ("auto", 1.0, pytest.approx(float("nan"), nan_ok=True), None),
    ]
    md = (tmp_path / "capacity.md").read_text()
    # mean ITL (400 - TTFT) / 7 with the run's 8 output tokens: p99 of 42.9, 28.6 and 14.3 ms
    assert "| cloud-only | 1 | 3 | 3 | 200 | 300 | 42.9 | 100% | 1.00 | 1.25 |" in md
    assert (tmp_path / "capacity.png").stat().st_size > 0
    missing = CliRunner().invoke(app, ["--render", "--out", str(tmp_path / "none")], env={"COLUMNS": "300"})
    assert missing.exit_code == 2 and "nothing to render" in missing.output


def test_capacity_sets_auto_beside_the_best_fixed_mode_at_each_rate():
    from tandem.benchmarks.capacity import RateResult, auto_vs_best, summary_md

    def res(mode: str, rate: float, goodput: float) -> RateResult:
        return RateResult(mode, rate, 10, 10, 10, 100.0, 200.0, goodput, 10.0)

    results = [
        res("cloud-only", 1.0, 0.9),
        res("cloud-only", 2.0, 1.5),
        res("split-k4", 1.0, 0.95),  # stopped after 1 req/s: not a candidate at 2
        res("auto", 1.0, 0.95),
        res("auto", 2.0, 1.2),
    ]
    assert auto_vs_best(results) == [(1.0, "split-k4", 0.95, 0.95), (2.0, "cloud-only", 1.5, 1.2)]
    assert auto_vs_best(results[:3]) == []
    args = dict(ttft_slo_ms=1000.0, attainment=0.99, requests=10, prompt_tokens=256, max_new_tokens=8)
    md = summary_md(results, args | dict(link="lan", cloud_cpus="1", edge_cpus="0"))
    assert "| 2 | cloud-only | 1.50 | 1.20 | 0.80x **under** |" in md
    assert md.rstrip().endswith("auto at least the best fixed mode's goodput at 1 of 2 rates")


def test_cloud_work_is_per_served_request_and_set_beside_cloud_onlys():
    from tandem.benchmarks.capacity import Sample, rate_result, summary_md
    from tandem.benchmarks.cloudwork import CloudWork

    def cell(mode: str, work: CloudWork, served: int = 4) -> object:
        ok = [Sample(mode, 1.0, float(i), 100.0, 200.0, "ok") for i in range(served)]
        return rate_result(ok + [Sample(mode, 1.0, 9.0, float("nan"), 10.0, "ResourceExhausted")], 1000.0, work)

    before, after = CloudWork(1000.0, 5000.0, 20.0), CloudWork(1400.0, 9000.0, 60.0)
    assert after.minus(before) == CloudWork(400.0, 4000.0, 40.0)
    assert after.minus(CloudWork(0.0, 0.0, None)).gpu_ms is None  # no GPU time on one side: none
    direct = cell("cloud-only", CloudWork(400.0, 4000.0, 40.0))
    assert (direct.gateway_cpu_ms, direct.engines_cpu_ms, direct.gpu_ms) == (100.0, 1000.0, 10.0)  # 4 served
    split = cell("split-k4", CloudWork(1200.0, 4400.0, 36.0))
    assert math.isnan(cell("edge-only", CloudWork(0.0, 0.0, 0.0), served=0).gateway_cpu_ms)
    args = dict(ttft_slo_ms=1000.0, attainment=0.99, requests=5, prompt_tokens=256, max_new_tokens=8)
    args |= dict(link="lan", cloud_cpus="1", edge_cpus="0")
    md = summary_md([direct, split], args)
    assert "| cloud-only | 1 | 100.0 | 1000.0 | 10.0 | - | - |" in md
    assert "| split-k4 | 1 | 300.0 | 1100.0 | 9.0 | +300.0 | -1.0 |" in md
    unmetered = summary_md([rate_result([Sample("cloud-only", 1.0, 0.0, 1.0, 2.0, "ok")], 1000.0)], args)
    assert "work per served request" not in unmetered  # a running edge's cloud is not measured


def test_capacity_reports_autos_prediction_error_per_rate_and_served_mode():
    from tandem.benchmarks.capacity import Sample, prediction_lines

    def auto(rate: float, mode: str, k: int, ttft: float, predicted: float, outcome: str = "ok") -> Sample:
        return Sample("auto", rate, 0.0, ttft, ttft + 10, outcome, mode, k, 8, predicted)

    samples = [
        auto(1.0, "local", 0, 300.0, 200.0),
        auto(1.0, "local", 0, 500.0, 250.0),
        auto(1.0, "split", 4, 2000.0, 500.0),
        auto(1.0, "split", 4, 900.0, 0.0),  # no prediction made: not counted
        auto(1.0, "direct", 0, float("nan"), 100.0, "ResourceExhausted"),  # failed: not counted
        Sample("cloud-only", 1.0, 0.0, 100.0, 110.0, "ok", "direct", 0, 8, 90.0),  # a fixed mode's row
    ]
    lines = prediction_lines(samples)
    assert "| 1 | local | 2 | 400 | 225 | 1.75 |" in lines  # ratios 1.5 and 2.0
    assert "| 1 | split-k4 | 1 | 2000 | 500 | 4.00 |" in lines
    assert not any("direct" in line for line in lines[4:])
    assert prediction_lines(samples[-1:]) == []


def test_integrated_gpu_samples_count_only_the_clouds_processes_over_their_periods():
    from tandem.benchmarks.cloudwork import integrate_sm_samples

    last: dict[int, int] = {}
    # pid 7 (the cloud) first seen at t=0 (its clock starts), then 50% over 100 ms and 100% over 200 ms;
    # pid 9 (an edge on the same GPU) is not counted; a repeated sample is skipped
    samples = [(7, 0, 80), (9, 50_000, 100), (7, 100_000, 50), (7, 300_000, 100), (7, 300_000, 100)]
    assert integrate_sm_samples(samples, {7}, last) == pytest.approx(50.0 + 200.0)
    assert last == {7: 300_000}
    assert integrate_sm_samples([(7, 400_000, 250)], {7}, last) == pytest.approx(100.0)  # clamped to 100%


def test_the_cloud_meter_integrates_nvml_samples_of_the_cloud_and_reports_none_where_nvml_refuses(monkeypatch):
    """An NVML-shaped double: samples of this process (the cloud) and of another (an edge); a driver
    that refuses per-process samples gives no GPU time (None), never 0."""
    pytest.importorskip("psutil")
    import types

    from tandem.benchmarks import cloudwork

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(f"NVML error {value}")
            self.value = value

    def fake_nvml(refuse: int | None) -> types.SimpleNamespace:
        me, t = os.getpid(), [0]

        def utilisation(handle: object, since_us: int) -> list[types.SimpleNamespace]:
            if refuse is not None:
                raise NVMLError(refuse)
            t[0] += 100_000  # 100 ms per poll: the cloud 50% busy, the edge 100%
            if t[0] % 300_000 == 0:
                raise NVMLError(6)  # NOT_FOUND: no sample since the last call
            return [
                types.SimpleNamespace(pid=me, timeStamp=t[0], smUtil=50),
                types.SimpleNamespace(pid=me + 10**6, timeStamp=t[0], smUtil=100),
            ]

        return types.SimpleNamespace(
            NVML_ERROR_NOT_FOUND=6,
            nvmlDeviceGetCount=lambda: 1,
            nvmlDeviceGetHandleByIndex=lambda i: i,
            nvmlDeviceGetProcessUtilization=utilisation,
        )

    monkeypatch.setattr(cloudwork, "_nvml", lambda: fake_nvml(None))
    meter = cloudwork.CloudMeter(os.getpid(), poll_s=0.01)
    t0 = time.monotonic()
    while (meter.read().gpu_ms or 0.0) < 200.0:
        assert time.monotonic() - t0 < 30
        time.sleep(0.02)
    meter.close()
    report = meter.gpu_report()
    assert report["error"] == "" and report["cloud_pids"] == [os.getpid()]
    assert set(report["sampled_pids"]) == {os.getpid(), os.getpid() + 10**6}
    assert meter.read().gpu_ms % 50.0 == pytest.approx(0.0)  # whole 100 ms periods at 50%, the edge's none

    monkeypatch.setattr(cloudwork, "_nvml", lambda: fake_nvml(3))  # NVML_ERROR_NOT_SUPPORTED
    meter = cloudwork.CloudMeter(os.getpid(), poll_s=0.01)
    t0 = time.monotonic()
    while not meter.gpu_report()["error"]:
        assert time.monotonic() - t0 < 30
        time.sleep(0.02)
    meter.close()
    assert meter.read().gpu_ms is None and "NVML error 3" in meter.gpu_report()["error"]


def test_the_cloud_meter_reads_the_cpu_time_of_the_process_and_its_descendants():
    """A real process tree: a parent that sleeps and a grandchild that burns CPU for about 0.4 s."""
    pytest.importorskip("psutil")
    from tandem.benchmarks.cloudwork import CloudMeter

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\ntime.sleep(30)"
    parent = "import subprocess, sys, time\np = subprocess.Popen([sys.executable, '-c', sys.argv[1]])\ntime.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", parent, burn])
    try:
        meter = CloudMeter(proc.pid)
        t0 = time.monotonic()
        while (w := meter.read()).engines_cpu_ms < 350.0:
            assert time.monotonic() - t0 < 60, w
            time.sleep(0.1)
        assert w.gateway_cpu_ms < w.engines_cpu_ms  # the parent only sleeps
        assert w.gpu_ms is None or w.gpu_ms >= 0.0
        meter.close()
    finally:
        import psutil

        for c in psutil.Process(proc.pid).children(recursive=True):
            c.kill()
        proc.kill()
        proc.wait()


def test_capacity_refuses_a_split_layer_not_exported_and_bad_rates(tmp_path):
    from typer.testing import CliRunner

    from tandem.benchmarks.capacity import app

    run = CliRunner().invoke(app, ["--model-dir", str(tmp_path), "--split-layers", "15"], env={"COLUMNS": "300"})
    assert run.exit_code == 2 and "not exported" in run.output and "--split-layers 15" in run.output, run.output
    bad = CliRunner().invoke(app, ["--edge-target", "x:1", "--rates", "2,1"], env={"COLUMNS": "300"})
    assert bad.exit_code == 2 and "ascending" in bad.output, bad.output


def test_ttft_floor_is_the_measured_compute_plus_bytes_over_the_rate_plus_the_rtt():
    """The floor beside each row: split = max(head, uplink bytes at the profile's rate) + tail
    prefill + RTT (the pipelined upload overlaps the head); direct = the decode engine's first
    token + its header's bytes + RTT; local = its prefill; an unknown link or missing stages give
    NaN, never a number."""
    from tandem.benchmarks.report import ttft_floor_ms

    g4 = PROFILES["4g"]
    split = RequestRecord("split-k4", "4g", 64, 64, 4, 900.0, 1000.0, [], 0.0, 1.0)
    split.sent_bytes = {"activations": 10_000, "kv": 30_000, "header": 200, "resent_chunks": 3}
    split.timings_ms = {"edge_head_ms": 20.0, "cloud_tail_prefill_ms": 50.0, "uplink_ms": 99.0}
    wire_ms = 40_200 * 8 / (g4.uplink_mbps * 1e3)
    assert wire_ms > 20.0 and ttft_floor_ms(split) == pytest.approx(wire_ms + 50.0 + g4.rtt_ms)
    split.timings_ms["edge_head_ms"] = wire_ms + 30.0  # a head slower than the link
    assert ttft_floor_ms(split) == pytest.approx(wire_ms + 30.0 + 50.0 + g4.rtt_ms)
    direct = RequestRecord("cloud-only", "loopback", 64, 64, 4, 30.0, 100.0, [], 0.0, 1.0)
    direct.sent_bytes, direct.timings_ms = {"header": 200}, {"cloud_decode_first_token_ms": 25.0}
    assert ttft_floor_ms(direct) == pytest.approx(25.0)  # loopback: unshaped, no RTT
    local = RequestRecord("edge-only", "4g", 64, 64, 4, 90.0, 100.0, [], 0.0, 1.0)
    local.timings_ms = {"local_prefill_ms": 80.0}
    assert ttft_floor_ms(local) == 80.0  # no link
    assert math.isnan(ttft_floor_ms(RequestRecord("auto", "4g", 64, 64, 4, 1.0, 1.0, [], 0.0, 1.0)))
    direct.link = "no-such-link"
    assert math.isnan(ttft_floor_ms(direct))


def test_the_output_length_matrix_names_the_fastest_mode_and_the_lightest_on_the_cloud(tmp_path):
    from tandem.benchmarks.report import write_output_matrix

    def row(mode: str, prompt: int, ttft: float, e2e: float, engine: float) -> dict:
        head = {"mode": mode, "link": "wifi6", "prompt_tokens": prompt, "ttft_mean_ms": ttft}
        return head | {"itl_mean_ms": 20.0, "e2e_mean_ms": e2e, "cloud_engine_ms": engine}

    rows = {
        16: [row("cloud-only", 257, 100, 400, 390), row("remote-prefill", 258, 110, 500, 200)]
        + [row("edge-only", 257, 300, 450, 0.0), row("auto", 257, 100, 390, 380)],
        128: [row("cloud-only", 257, 100, 2600, 2590), row("remote-prefill", 258, 110, 2000, 300)]
        + [row("edge-only", 257, 300, 2200, 0.0), row("auto", 257, 110, 2100, 290)]
        + [row("auto-whole", 257, 90, 1900, 280)],
    }
    write_output_matrix(tmp_path, rows)
    md = (tmp_path / "outputs.md").read_text()
    assert "| wifi6 | 257 | 16 | cloud-only | 100 | 20.0 | 400 | 390 |" in md
    assert "| wifi6 | 257 | 16 | cloud-only (400) | remote-prefill (200) |" in md  # auto is not a fixed mode
    assert "| wifi6 | 257 | 128 | remote-prefill (2000) | remote-prefill (300) | 1.05x | 0.95x |" in md
    assert "| wifi6 | 257 | 128 | auto-whole | 90 | 20.0 | 1900 | 280 |" in md  # its row, not the lowest fixed
    assert "| wifi6 | 257 | 16 | cloud-only (400) | remote-prefill (200) | 0.97x | - |" in md  # not run there
    assert (tmp_path / "outputs.png").stat().st_size > 0
    from tandem.benchmarks.report import line_style

    styles = [line_style(x) for x in ("auto", "auto-whole", "auto-other", "cloud-only")]
    assert len({tuple(sorted(x.items())) for x in styles}) == 4  # each auto row its own line in the PNGs


def test_exactness_resume_reads_back_what_a_run_saved(tmp_path):
    """``tandem-bench exactness --resume`` keeps the chats and sessions its ``exactness.json``
    holds (the form ``save`` writes), starts afresh without one, and refuses another file."""
    from tandem.benchmarks.exactness import Reply, count, load_results

    chats = {"c1": {m: Reply([1, 2], 0, 0) for m in ("remote_prefill", "direct", "local")}}
    chats["c1"]["remote_prefill"] = Reply([1, 2], 1, 640)
    sessions = {"c1": {m: [Reply([3]), Reply([4, 5])] for m in ("remote_prefill", "direct", "local")}}
    path = tmp_path / "exactness.json"
    path.write_text(
        json.dumps(
            {
                "counts": {},
                "chats": {k: {m: r.__dict__ for m, r in v.items()} for k, v in chats.items()},
                "sessions": {k: {m: [r.__dict__ for r in rs] for m, rs in v.items()} for k, v in sessions.items()},
            }
        )
    )
    got_chats, got_sessions = load_results(path)
    assert got_chats == chats and got_sessions == sessions
    assert count(got_chats, got_sessions).as_dict() == count(chats, sessions).as_dict()
    assert load_results(tmp_path / "none.json") == ({}, {})
    path.write_text('{"chats": 3}')
    with pytest.raises(ValueError, match="not a tandem-bench exactness result"):
        load_results(path)


def test_local_rows_need_a_checked_whole_model(tmp_path, capsys):
    """edge-only and remote prefill decode with the edge's whole model: without a checked
    ``edge-full.onnx`` the benchmarks leave their rows out and say so."""
    from tandem.benchmarks.stack import local_rows
    from tandem.common.protocol.manifest import FULL_CHECK_NAME, FULL_ONNX, ExportCheck

    assert local_rows(tmp_path, True, True) == (False, False)
    assert "no checked whole model" in capsys.readouterr().err
    assert local_rows(tmp_path, False, False) == (False, False) and capsys.readouterr().err == ""
    (tmp_path / FULL_ONNX).write_bytes(b"onnx")
    check = dict(architecture="LlamaForCausalLM", max_abs_error=1.0, tolerance=0.1, tokens=44, passed=False)
    ExportCheck(**check).save(tmp_path / FULL_CHECK_NAME)
    assert local_rows(tmp_path, True, False) == (False, False)  # its check failed
    ExportCheck(**check | dict(max_abs_error=0.01, passed=True)).save(tmp_path / FULL_CHECK_NAME)
    assert local_rows(tmp_path, True, True) == (True, True) and local_rows(tmp_path, False, True) == (False, True)


def test_capacity_lists_failed_requests_with_their_server_message():
    from tandem.benchmarks.capacity import Sample, failure_lines

    def failed(mode: str, outcome: str, error: str = "") -> Sample:
        return Sample(mode, 8.0, 0.0, float("nan"), 5.0, outcome, error=error)

    samples = [Sample("auto", 8.0, 0.0, 100.0, 200.0, "ok")] * 3
    assert failure_lines(samples) == []
    samples += [failed("split-k8", "Internal", "tail engine died | restarting\nretry")] * 2
    samples += [failed("split-k8", "ResourceExhausted", "upload bound")] + [failed("auto", "Unavailable")]
    lines = failure_lines(samples)
    assert "| split-k8 | 8 | Internal | 2 | tail engine died / restarting retry |" in lines
    assert "| split-k8 | 8 | ResourceExhausted | 1 | upload bound |" in lines
    assert "| auto | 8 | Unavailable | 1 | - |" in lines  # recorded without a message


SUBCOMMANDS = (
    "modes",
    "capacity",
    "burst",
    "fidelity",
    "exactness",
    "multiturn",
    "batching",
    "edge",
    "edge-engine",
    "head",
)


def test_edge_engine_smoke(tmp_path):
    """``tandem-bench edge-engine`` with tiny arguments: one row per model kind, step time and number
    of turns, each with the engine's overhead beside the model's own time."""
    from typer.testing import CliRunner

    from tandem.benchmarks.cli import app

    args = ["edge-engine", "--out", str(tmp_path), "--turns", "1,3", "--step-ms", "0,0.5", "--new-tokens", "6"]
    run = CliRunner().invoke(app, [*args, "--repeats", "1", "--prompt-tokens", "4"], env={"COLUMNS": "300"})
    assert run.exit_code == 0, run.output
    rows = json.loads((tmp_path / "edge_engine.json").read_text())["rows"]
    assert [(r["model"], r["step_ms"], r["turns"]) for r in rows] == [
        (m, ms, n) for m in ("batched", "unbatched") for ms in (0.0, 0.5) for n in (1, 3)
    ]
    for r in rows:
        assert r["model_ms"] >= r["step_ms"] * (1 if r["model"] == "batched" else r["turns"]) and r["itl_mean_ms"] > 0
        assert r["overhead_ms"] == pytest.approx(r["itl_mean_ms"] - r["model_ms"]) and r["tokens_per_s"] > 0
    assert "| overhead_ms |" in (tmp_path / "edge_engine.md").read_text()
    bad = CliRunner().invoke(app, ["edge-engine", "--out", str(tmp_path), "--models", "gpu"], env={"COLUMNS": "300"})
    assert bad.exit_code == 2


def test_tandem_bench_lists_every_benchmark_and_is_the_one_benchmark_script():
    """The installed ``tandem-bench`` lists every subcommand; pyproject installs no other benchmark
    script; an unknown subcommand is a usage error (exit 2)."""
    import tomllib

    from tandem.benchmarks.cli import BENCHMARKS
    from tests.helpers import ROOT, TANDEM_BENCH

    listed = subprocess.run([TANDEM_BENCH, "--help"], capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    for name in SUBCOMMANDS:
        assert name in BENCHMARKS and f" {name} " in listed.stdout, listed.stdout
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert [s for s in scripts if s.startswith("tandem-bench")] == ["tandem-bench"]
    unknown = subprocess.run([TANDEM_BENCH, "nope"], capture_output=True, text=True, timeout=120)
    assert unknown.returncode == 2 and "No such command" in unknown.stderr


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_each_subcommand_is_its_benchmarks_command_with_its_flags(name):
    """``tandem-bench NAME`` is the module's own command: the same help and the same flags, its usage
    line naming the subcommand."""
    import importlib

    import typer
    from typer.testing import CliRunner

    from tandem.benchmarks.cli import BENCHMARKS, app

    module = importlib.import_module(f"tandem.benchmarks.{BENCHMARKS[name].module}")
    own = typer.main.get_command(module.app)
    group = typer.main.get_command(app)
    sub = group.get_command(None, name)  # type: ignore[attr-defined]
    assert sub.help == own.help
    assert [p.opts for p in sub.params] == [p.opts for p in own.params]
    shown = CliRunner().invoke(app, [name, "--help"], prog_name="tandem-bench", terminal_width=200)
    assert shown.exit_code == 0 and f"tandem-bench {name} [OPTIONS]" in shown.output, shown.output
    assert all(o in shown.output for p in own.params for o in p.opts if o.startswith("--")), shown.output
