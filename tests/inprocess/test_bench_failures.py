"""``tandem-bench modes`` keeps going past a request that fails: the failure is recorded (mode, link,
prompt length, error) and reported beside the tables, the other requests are measured, and a
warm-up that fails still stops the run; each row asks the edge what its ``ModeSpec`` says (auto's
whole-reply row ``whole_reply``), and the calibration pass runs the fixed modes only. Against an
edge double over real gRPC (one piece: the benchmark's request loop and report)."""

from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import pytest

from tandem import TandemClientError
from tandem.benchmarks import report
from tandem.benchmarks.bench import ModeSpec, Plan, _Null, calibrate, mode_specs, run_remote
from tandem.benchmarks.workload import BenchPrompt
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc


class RefusingEdge(pb_grpc.EdgeServicer):
    """Streams two tokens and ``ChatDone``, except for a conversation whose last message says
    "refuse": RESOURCE_EXHAUSTED, as an edge whose cloud is over its bound answers. Each request's
    ``(mode, split_layer, whole_reply)`` is appended to ``asked``."""

    asked: list[tuple[str, int, bool]] = []

    def Chat(self, request, context):
        self.asked.append((pb.Mode.Name(request.mode), request.split_layer, request.whole_reply))
        if request.messages[-1].content == "refuse":
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "a turn of 4096 tokens holds too much here")
        yield pb.ChatEvent(delta=pb.TextDelta(text="a", token_ids=[1]))
        yield pb.ChatEvent(delta=pb.TextDelta(text="b", token_ids=[2]))
        why = "auto: whole reply" if request.whole_reply else "requested"
        yield pb.ChatEvent(
            done=pb.ChatDone(finish_reason="length", output_tokens=2, prompt_tokens=3, mode="direct", mode_reason=why)
        )


@pytest.fixture(scope="module")
def edge_port():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_EdgeServicer_to_server(RefusingEdge(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port
    server.stop(None)


def _prompt(text: str) -> BenchPrompt:
    return BenchPrompt((("user", text),), 3)


def test_a_failed_request_is_recorded_and_the_others_are_measured(edge_port, tmp_path):
    failures: list[dict] = []
    prompts = [_prompt("hi"), _prompt("refuse"), _prompt("hello")]
    spec = ModeSpec("cloud-only", "direct")
    records = asyncio.run(run_remote(edge_port, prompts, spec, "loopback", 4096, 1, 2, _Null(), failures))
    assert len(records) == 2 and all(r.output_tokens == 2 for r in records)
    assert failures == [
        {
            "mode": "cloud-only",
            "link": "loopback",
            "target_prompt_tokens": 4096,
            "error": "ResourceExhausted: RESOURCE_EXHAUSTED: a turn of 4096 tokens holds too much here",
        }
    ]
    meta = {"platform": "p", "cpus": 2, "versions": {}, "shaper": "proxy", "links": [], "failed_requests": failures}
    report.write_all(tmp_path, records, meta)
    md = (tmp_path / "summary.md").read_text()
    assert "1 requests failed and are not in the tables above" in md
    assert "| cloud-only | loopback | 4096 | ResourceExhausted: RESOURCE_EXHAUSTED: a turn of 4096" in md


def test_without_a_failure_list_a_failed_request_raises(edge_port):
    """Warm-ups and calibration run without one: a mode that cannot serve stops the run there."""
    spec = ModeSpec("cloud-only", "direct")
    with pytest.raises(TandemClientError, match="RESOURCE_EXHAUSTED"):
        asyncio.run(run_remote(edge_port, [_prompt("refuse")], spec, "loopback", 16, 1, 2, _Null()))


def test_each_row_asks_what_its_spec_says_and_records_why_the_edge_served_it(edge_port):
    RefusingEdge.asked.clear()
    for spec in mode_specs([4], True, ["ttft", "whole"]):
        (rec,) = asyncio.run(run_remote(edge_port, [_prompt("hi")], spec, "loopback", 3, 1, 2, _Null()))
        assert rec.mode == spec.label and rec.mode_reason == ("auto: whole reply" if spec.whole_reply else "requested")
    assert RefusingEdge.asked == [
        ("MODE_SPLIT", 4, False),
        ("MODE_DIRECT", 0, False),
        ("MODE_LOCAL", 0, False),
        ("MODE_UNSPECIFIED", 0, False),  # the SDK sends auto as the unset mode (tandem.chat_request)
        ("MODE_UNSPECIFIED", 0, True),
    ]


def test_the_calibration_pass_runs_the_fixed_modes_only(edge_port):
    specs = mode_specs([4], False, ["ttft", "whole"], remote_prefill=True)
    prompts = {16: [_prompt("hi")], 64: [_prompt("hello")]}
    plan = Plan(specs, [16, 64], prompts, prompts, prompts, [_prompt("hi")], "interleaved", 1, 1, 2)
    RefusingEdge.asked.clear()
    calibrate(edge_port, plan, "loopback")
    fixed = [("MODE_SPLIT", 4, False), ("MODE_DIRECT", 0, False), ("MODE_REMOTE_PREFILL", 0, False)]
    assert RefusingEdge.asked == fixed * 2  # each fixed mode once per prompt length; neither auto row
