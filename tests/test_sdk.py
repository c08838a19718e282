"""The client SDK without the daemons: request building, the event accumulator, both clients
against a tiny in-process ``Edge`` server (streaming, errors, cancellation when a stream is
left early), and the daemon helpers of ``tandem.daemons`` on toy child processes."""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import pytest

from tandem import AsyncClient, ChatResult, Client, Delta, TandemClientError
from tandem.client import _Accumulator, build_request
from tandem.daemons import Daemon, Daemons, stop_all
from tandem.stages import Stage
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

HI = [{"role": "user", "content": "hi"}]
DELAY_S = 0.02


# --- request building -----------------------------------------------------------------------


def test_build_request_defaults_and_fields():
    r = build_request(HI)
    assert [(m.role, m.content) for m in r.messages] == [("user", "hi")]
    assert r.prompt == "" and r.session_id == "" and r.mode == pb.MODE_UNSPECIFIED
    assert r.sampling.max_new_tokens == 128 and r.sampling.temperature == 0.0 and r.sampling.top_p == 1.0
    assert not r.sampling.HasField("seed") and not r.sampling.ignore_eos
    r = build_request(
        prompt="raw",
        max_new_tokens=5,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        seed=0,
        session_id="s1",
        mode="direct",
        ignore_eos=True,
    )
    assert r.prompt == "raw" and not r.messages and r.session_id == "s1" and r.mode == pb.MODE_DIRECT
    sp = r.sampling
    assert (sp.max_new_tokens, sp.top_k, sp.ignore_eos) == (5, 40, True)
    assert sp.temperature == pytest.approx(0.7) and sp.top_p == pytest.approx(0.9)
    assert sp.HasField("seed") and sp.seed == 0  # 0 is a seed, not "unset"
    assert build_request(HI, mode="split").mode == pb.MODE_SPLIT


@pytest.mark.parametrize(
    "kw", [{}, {"messages": HI, "prompt": "x"}, {"messages": HI, "mode": "fast"}], ids=["neither", "both", "mode"]
)
def test_build_request_rejects(kw):
    with pytest.raises(ValueError):
        build_request(**kw)


# --- the accumulator ------------------------------------------------------------------------


def delta(text: str, *ids: int) -> pb.ChatEvent:
    return pb.ChatEvent(delta=pb.TextDelta(text=text, token_ids=ids))


def done(**kw) -> pb.ChatEvent:
    return pb.ChatEvent(done=pb.ChatDone(**kw))


def test_accumulator_turns_events_into_deltas_and_result():
    acc = _Accumulator()
    assert acc.feed(delta("Hel", 1, 2)) == Delta("Hel", (1, 2))
    assert acc.feed(pb.ChatEvent()) is None  # an event this version does not know: skipped
    assert acc.feed(delta("lo", 3)) == Delta("lo", (3,))
    assert acc.result is None
    final = done(
        finish_reason="length",
        prompt_tokens=7,
        output_tokens=3,
        head_tokens=7,
        external_tokens=4,
        split_layer=4,
        output_token_ids=[1, 2, 3],
        timings_ms={"ttft_ms": 12.5, "cloud_decode_ms": 3.0},
        sent_bytes={"kv": 10, "activations": 20},
    )
    assert acc.feed(final) is None
    acc.finish()
    r = acc.result
    assert r == ChatResult("Hello", "length", 7, 3, 7, 4, 4, (1, 2, 3), {"ttft_ms": 12.5, "cloud_decode_ms": 3.0},
                           {"kv": 10, "activations": 20})  # fmt: skip
    assert all(type(k) is str for k in r.timings_ms)  # the wire's keys; a Stage looks them up too
    assert r.timings_ms[Stage.TTFT] == 12.5 and r.timings_ms.get(Stage.CLOUD_DECODE) == 3.0


def test_accumulator_stream_without_final_event():
    acc = _Accumulator()
    acc.feed(delta("x", 1))
    with pytest.raises(TandemClientError, match="without a final event"):
        acc.finish()


# --- both clients against an in-process Edge ------------------------------------------------


@dataclass
class CallRecord:
    ended: threading.Event = field(default_factory=threading.Event)  # the server saw the RPC terminate
    sent: int = 0
    completed: bool = False  # the handler streamed everything, ChatDone included


class FakeEdge(pb_grpc.EdgeServicer):
    """Streams one delta per ``max_new_tokens`` every DELAY_S, then ``ChatDone``; records each call
    by session id. Prompt ``"fail"`` is refused with INVALID_ARGUMENT."""

    def __init__(self) -> None:
        self.calls: dict[str, CallRecord] = {}

    def Chat(self, request, context):
        rec = self.calls[request.session_id] = CallRecord()
        context.add_callback(rec.ended.set)
        if request.prompt == "fail":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no such prompt")
        n = request.sampling.max_new_tokens
        for i in range(n):
            yield delta(f"t{i} ", i)
            rec.sent += 1
            time.sleep(DELAY_S)
        rec.completed = True
        yield done(finish_reason="length", output_tokens=n, output_token_ids=range(n), timings_ms={"ttft_ms": 1.5})


@pytest.fixture(scope="module")
def edge():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    fake = FakeEdge()
    pb_grpc.add_EdgeServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield fake, f"127.0.0.1:{port}"
    server.stop(None)


def test_sync_stream_and_complete(edge):
    fake, target = edge
    with Client(target) as c:
        s = c.chat(HI, max_new_tokens=3, session_id="sync-full")
        with pytest.raises(RuntimeError, match="to its end"):
            _ = s.result
        assert [d.text for d in s] == ["t0 ", "t1 ", "t2 "]
        assert s.result.text == "t0 t1 t2 " and s.result.output_token_ids == (0, 1, 2)
        assert s.result.timings_ms == {"ttft_ms": 1.5}
        r = c.complete(HI, max_new_tokens=2, session_id="sync-complete")
        assert r.output_tokens == 2 and r.finish_reason == "length"
    assert fake.calls["sync-full"].completed


def test_sync_error_carries_status(edge):
    _, target = edge
    with Client(target) as c, pytest.raises(TandemClientError) as ei:
        list(c.chat(prompt="fail", session_id="sync-fail"))
    assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT and ei.value.details == "no such prompt"


@pytest.mark.parametrize("how", ["break", "close"])
def test_leaving_sync_stream_early_cancels_the_call(edge, how):
    fake, target = edge
    sid = f"sync-{how}"
    with Client(target) as c:  # checked before the channel closes (which would end the call anyway)
        s = c.chat(HI, max_new_tokens=200, session_id=sid)  # 4 s if not cancelled
        if how == "break":
            for i, _ in enumerate(s):
                if i == 1:
                    break
        else:
            it = iter(s)
            next(it)
            it.close()
        t0 = time.monotonic()
        assert fake.calls[sid].ended.wait(2.0), "the server did not see the call end"
        assert time.monotonic() - t0 < 1.0
        rec = fake.calls[sid]
        assert not rec.completed and rec.sent < 50


async def test_async_stream_error_and_complete(edge):
    fake, target = edge
    async with AsyncClient(target) as c:
        s = c.chat(HI, max_new_tokens=3, session_id="async-full")
        assert [d.text async for d in s] == ["t0 ", "t1 ", "t2 "]
        assert s.result.text == "t0 t1 t2 " and s.result.timings_ms == {"ttft_ms": 1.5}
        assert (await c.complete(HI, max_new_tokens=2, session_id="async-complete")).output_tokens == 2
        with pytest.raises(TandemClientError) as ei:
            await c.complete(prompt="fail", session_id="async-fail")
        assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT and ei.value.details == "no such prompt"
    assert fake.calls["async-full"].completed


async def test_leaving_async_stream_early_cancels_the_call(edge):
    fake, target = edge
    async with AsyncClient(target) as c:
        n = 0
        async for _ in c.chat(HI, max_new_tokens=200, session_id="async-break"):
            n += 1
            if n == 2:
                break
        assert await asyncio.to_thread(fake.calls["async-break"].ended.wait, 2.0)
        rec = fake.calls["async-break"]
        assert not rec.completed and rec.sent < 50


# --- tandem.daemons -------------------------------------------------------------------------

# A toy daemon: prints, optionally ignores SIGTERM, writes a port to its --ready-file, sleeps.
TOY = """
import signal, sys, time
print("toy starting", flush=True)
if "ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if "fail" in sys.argv:
    print("toy: bad config", flush=True)
    sys.exit(3)
if "slow" not in sys.argv:
    open(sys.argv[sys.argv.index("--ready-file") + 1], "w").write("4242")
time.sleep(60)
"""


def toy(tmp_path, *args: str, ds: Daemons | None = None) -> Daemon:
    cmd = [sys.executable, "-c", TOY, *args]
    name = "toy-" + "-".join(args)
    if ds is not None:
        return ds.spawn(name, cmd, tmp_path / f"{name}.log", tmp_path / f"{name}.port")
    return Daemon(name, cmd, tmp_path / f"{name}.log", tmp_path / f"{name}.port")


def test_daemon_ready_then_stopped_by_sigterm(tmp_path):
    (tmp_path / "toy-.port").write_text("1")  # stale: removed before the start
    d = toy(tmp_path)
    assert d.wait_ready(20, poll_s=0.05) == 4242
    d.stop(grace_s=10)
    assert d.proc.returncode == -signal.SIGTERM
    assert "toy starting" in d.tail()


def test_daemon_that_exits_raises_with_log_tail(tmp_path):
    d = toy(tmp_path, "fail")
    with pytest.raises(RuntimeError, match=r"exited with 3(.|\n)*toy: bad config"):
        d.wait_ready(20, poll_s=0.05)


def test_daemon_not_ready_in_time(tmp_path):
    d = toy(tmp_path, "slow")
    try:
        with pytest.raises(RuntimeError, match="not ready after"):
            d.wait_ready(0.3, poll_s=0.05)
    finally:
        stop_all([d], grace_s=5)


def test_daemons_stop_all_and_kill_after_grace(tmp_path):
    with Daemons(grace_s=0.5) as ds:
        a = toy(tmp_path, ds=ds)
        b = toy(tmp_path, "ignore-term", ds=ds)
        a.wait_ready(20, poll_s=0.05), b.wait_ready(20, poll_s=0.05)
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 5
    assert a.proc.returncode == -signal.SIGTERM and b.proc.returncode == -signal.SIGKILL
    assert not ds.daemons
