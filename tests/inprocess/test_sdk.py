"""The client SDK without the daemons: request building (stop strings, stop token ids, argument
checks), the event accumulator, the error classes, both clients against a tiny in-process
``Edge`` server (streaming, one error class per status, the default deadline, cancellation
when a stream is left early or by ``cancel()`` from another thread or task, ``info()``, one
connection's terms on every call of either client), and the daemon helpers of ``tandem.daemons``
on toy child processes."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import pickle
import signal
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import pytest

import tandem
from tandem import AsyncClient, Cancelled, ChatResult, Client, Delta, EdgeInfo, TandemClientError
from tandem.client import DEFAULT_TIMEOUT_S, build_request
from tandem.connection import SERVICE_CONFIG, Connection
from tandem.daemons import Daemon, Daemons, edge_command, stop_all
from tandem.errors import ERROR_OF, InvalidArgument, ResourceExhausted, error_from_status, retry_after_s
from tandem.stages import Stage
from tandem.streams import _Accumulator
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
    assert not r.stop and not sp.stop_token_ids
    assert not r.whole_reply and build_request(HI, whole_reply=True).whole_reply


def test_build_request_stop_strings_and_ids():
    r = build_request(HI, stop="\n\n", stop_token_ids=[2, 0, 2**32 - 1])
    assert list(r.stop) == ["\n\n"]  # one string is one stop string, not its characters
    assert list(r.sampling.stop_token_ids) == [2, 0, 2**32 - 1]
    r = build_request(HI, stop=("User:", "###"), stop_token_ids=())
    assert list(r.stop) == ["User:", "###"] and not r.sampling.stop_token_ids
    r2 = pb.ChatRequest.FromString(r.SerializeToString())  # survives the wire
    assert list(r2.stop) == ["User:", "###"]


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"messages": HI, "prompt": "x"},
        {"messages": HI, "mode": "fast"},
        {"messages": [{"content": "x"}]},
        {"messages": HI, "stop": ""},
        {"messages": HI, "stop": ["ok", ""]},
        {"messages": HI, "stop_token_ids": [1, -1]},
        {"messages": HI, "stop_token_ids": [2**32]},
        {"messages": HI, "max_new_tokens": 0},
        {"messages": HI, "temperature": -0.1},
        {"messages": HI, "temperature": math.nan},
        {"messages": HI, "top_p": 0.0},
        {"messages": HI, "top_p": 1.5},
        {"messages": HI, "top_k": -2},
        {"messages": HI, "seed": 2**63},
    ],
    ids=["neither", "both", "mode", "message", "empty-stop", "empty-in-list", "negative-id", "id-over-uint32",
         "zero-tokens", "temperature", "temperature-nan", "top_p-0", "top_p-1.5", "top_k", "seed"],
)  # fmt: skip
def test_build_request_rejects(kw):
    """build_request raises ValueError, before anything is sent, for neither or both of messages and prompt,
    an unknown mode, a message without a role, empty stop strings, stop ids outside uint32, zero tokens and
    sampling values out of range."""
    with pytest.raises(ValueError):
        build_request(**kw)


@pytest.mark.parametrize(
    "kw",
    [{"stop": [b"x"]}, {"stop": [1]}, {"stop_token_ids": [1.0]}, {"stop_token_ids": [True]}, {"whole_reply": 1}],
    ids=["bytes-stop", "int-stop", "float-id", "bool-id", "int-whole-reply"],
)  # fmt: skip
def test_build_request_rejects_wrong_types(kw):
    with pytest.raises(TypeError):
        build_request(HI, **kw)


@pytest.mark.parametrize("t", [0, -1, math.nan, "5"])
def test_bad_timeouts_rejected_before_sending(t):
    with pytest.raises(ValueError, match="timeout_s"):
        Client("127.0.0.1:1", timeout_s=t)
    with Client("127.0.0.1:1") as c, pytest.raises(ValueError, match="timeout_s"):
        c.chat(HI, timeout_s=t)


# --- errors -----------------------------------------------------------------------------------


def test_one_error_class_per_status():
    codes = [c for c in grpc.StatusCode if c != grpc.StatusCode.OK]
    assert set(ERROR_OF) == set(codes)
    for c in codes:
        e = error_from_status(c, "why")
        assert type(e) is ERROR_OF[c] and type(e).status == c and isinstance(e, TandemClientError)
        assert (e.code, e.details, e.retry_after_s, str(e)) == (c, "why", None, f"{c.name}: why")
        assert getattr(tandem, type(e).__name__) is type(e)  # exported from the package
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is type(e) and (back.code, back.details) == (c, "why")


@pytest.mark.parametrize(
    "md,want",
    [
        ((("retry-after-ms", "1500"),), 1.5),
        ((("retry-after-ms", "479"),), 0.479),  # the seconds as written, no binary noise (0.47900000000000004)
        ((("retry-after-s", "2"),), 2.0),
        ((("Retry-After-S", b"0.25"),), 0.25),
        ((("x", "1"), ("retry-after-ms", "nope"), ("retry-after-s", "3")), 3.0),
        ((("retry-after-ms", "-5"),), None),
        ((("retry-after-s", "inf"),), None),
        ((), None),
        (None, None),
    ],
)
def test_retry_after_from_trailing_metadata(md, want):
    assert retry_after_s(md) == want
    e = error_from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", md)
    assert isinstance(e, ResourceExhausted) and e.retry_after_s == want


# --- the edge's limits ------------------------------------------------------------------------

INFO = EdgeInfo("smollm2-135m", 4, 2048, 512, 16, 64, 120.0, "1.2.3")


def test_edge_info_check():
    """EdgeInfo.check accepts what is within the edge's limits, names every limit exceeded in one ValueError,
    treats 0 as no limit, and refuses a mode the edge does not serve now with the reason."""
    INFO.check(max_new_tokens=512, stop=["a"] * 16, stop_token_ids=range(64), prompt_tokens=2048, mode="split")
    INFO.check()  # nothing to check
    with pytest.raises(ValueError) as ei:
        INFO.check(max_new_tokens=513, stop=["a"] * 17, stop_token_ids=range(65), prompt_tokens=2049)
    msg = str(ei.value)
    assert all(w in msg for w in ("max_new_tokens: 513 > 512", "stop strings: 17 > 16", "stop token ids: 65 > 64",
                                  "prompt tokens: 2049 > 2048"))  # fmt: skip
    assert INFO.problems(stop="one long stop string") == []  # one string, not its characters
    with pytest.raises(ValueError, match="empty"):
        INFO.check(stop=[""])
    unknown = EdgeInfo("m", 0, 0, 0, 0, 0, 0.0, "")  # an edge that says no limits (0 = unknown)
    unknown.check(max_new_tokens=10**6, stop=["a"] * 100, mode="split")
    local_only = EdgeInfo("m", 0, 0, 0, 0, 0, 0.0, "", ("local",), (), False, "cloud not connected")
    local_only.check(mode="local")
    local_only.check(mode="auto")
    with pytest.raises(ValueError, match="mode 'split': this edge serves \\['local'\\] now \\(cloud not connected\\)"):
        local_only.check(mode="split")


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
    request: pb.ChatRequest
    time_remaining_s: float  # the deadline the server saw (huge: none)
    authorization: str = ""  # the call's authorization metadata
    ended: threading.Event = field(default_factory=threading.Event)  # the server saw the RPC terminate
    sent: int = 0
    completed: bool = False  # the handler streamed everything, ChatDone included


class FakeEdge(pb_grpc.EdgeServicer):
    """Streams one delta per ``max_new_tokens`` every DELAY_S, then ``ChatDone``; records each call
    by session id. Prompt ``"fail"`` is refused with INVALID_ARGUMENT, ``"abort:<CODE>"`` with that
    status (RESOURCE_EXHAUSTED with a retry hint of 1.5 s). ``GetInfo`` answers ``INFO`` after
    refusing the next ``info_refusals`` calls as UNAVAILABLE; ``info_calls`` records each (the
    deadline and authorization it saw). ``EndSession`` records its call under ``"end:<id>"``."""

    def __init__(self) -> None:
        self.calls: dict[str, CallRecord] = {}
        self.info_refusals = 0
        self.info_calls: list[CallRecord] = []

    @staticmethod
    def _record(request, context) -> CallRecord:
        auth = dict(context.invocation_metadata()).get("authorization", "")
        return CallRecord(request, context.time_remaining(), authorization=auth)

    def Chat(self, request, context):
        rec = self.calls[request.session_id] = self._record(request, context)
        context.add_callback(rec.ended.set)
        if request.prompt == "fail":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no such prompt")
        if request.prompt.startswith("abort:"):
            code = grpc.StatusCode[request.prompt.removeprefix("abort:")]
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                context.set_trailing_metadata((("retry-after-ms", "1500"),))
            context.abort(code, f"aborted with {code.name}")
        n = request.sampling.max_new_tokens
        for i in range(n):
            yield delta(f"t{i} ", i)
            rec.sent += 1
            time.sleep(DELAY_S)
        rec.completed = True
        yield done(finish_reason="length", output_tokens=n, output_token_ids=range(n), timings_ms={"ttft_ms": 1.5})

    def GetInfo(self, request, context):
        self.info_calls.append(self._record(request, context))
        if self.info_refusals > 0:
            self.info_refusals -= 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "edge restarting")
        return pb.EdgeInfo(**dataclasses.asdict(INFO))

    def EndSession(self, request, context):
        self.calls[f"end:{request.session_id}"] = self._record(request, context)
        return pb.EndSessionReply(found=True)


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


def test_stop_strings_and_ids_reach_the_edge(edge):
    fake, target = edge
    with Client(target) as c:
        c.complete(HI, max_new_tokens=1, session_id="stops", stop=["\n\n", "User:"], stop_token_ids=[2, 7])
    r = fake.calls["stops"].request
    assert list(r.stop) == ["\n\n", "User:"] and list(r.sampling.stop_token_ids) == [2, 7]


NON_OK = [c for c in grpc.StatusCode if c != grpc.StatusCode.OK]


@pytest.mark.parametrize("code", NON_OK, ids=lambda c: c.name)
def test_each_status_raises_its_error_class(edge, code):
    _, target = edge
    with Client(target) as c, pytest.raises(TandemClientError) as ei:
        list(c.chat(prompt=f"abort:{code.name}", session_id=f"sync-abort-{code.name}"))
    e = ei.value
    assert type(e) is ERROR_OF[code] and e.code == code and e.details == f"aborted with {code.name}"
    assert e.retry_after_s == (1.5 if code == grpc.StatusCode.RESOURCE_EXHAUSTED else None)


async def test_each_status_raises_its_error_class_async(edge):
    _, target = edge
    async with AsyncClient(target) as c:
        for code in NON_OK:
            with pytest.raises(TandemClientError) as ei:
                await c.complete(prompt=f"abort:{code.name}", session_id=f"async-abort-{code.name}")
            e = ei.value
            assert type(e) is ERROR_OF[code] and e.code == code and e.details == f"aborted with {code.name}"
            assert e.retry_after_s == (1.5 if code == grpc.StatusCode.RESOURCE_EXHAUSTED else None)


def test_default_deadline_and_overrides(edge):
    fake, target = edge

    def remaining(sid: str) -> float:
        return fake.calls[sid].time_remaining_s

    with Client(target) as c:
        assert c.timeout_s == DEFAULT_TIMEOUT_S == 300.0
        c.complete(HI, max_new_tokens=1, session_id="dl-default")
        c.complete(HI, max_new_tokens=1, session_id="dl-call", timeout_s=7)
        c.complete(HI, max_new_tokens=1, session_id="dl-call-inf", timeout_s=math.inf)
    with Client(target, timeout_s=30) as c:
        c.complete(HI, max_new_tokens=1, session_id="dl-client")
        c.complete(HI, max_new_tokens=1, session_id="dl-client-none", timeout_s=None)  # None: the client's
    with Client(target, timeout_s=None) as c:
        assert c.timeout_s is None
        c.complete(HI, max_new_tokens=1, session_id="dl-off")
    # the server sees the deadline rounded by the wire's grpc-timeout header (up to about a second up)
    assert 280 < remaining("dl-default") <= 302
    assert 5 < remaining("dl-call") <= 9
    assert 20 < remaining("dl-client") <= 32 and 20 < remaining("dl-client-none") <= 32
    assert remaining("dl-off") > 1e6 and remaining("dl-call-inf") > 1e6  # no deadline


async def test_async_default_deadline(edge):
    fake, target = edge
    async with AsyncClient(target) as c:
        await c.complete(HI, max_new_tokens=1, session_id="adl-default")
    async with AsyncClient(target, timeout_s=30) as c:
        await c.complete(HI, max_new_tokens=1, session_id="adl-client")
        await c.complete(HI, max_new_tokens=1, session_id="adl-call", timeout_s=7)
    assert 280 < fake.calls["adl-default"].time_remaining_s <= 302
    assert 20 < fake.calls["adl-client"].time_remaining_s <= 32
    assert 5 < fake.calls["adl-call"].time_remaining_s <= 9


def test_deadline_passing_raises_deadline_exceeded(edge):
    fake, target = edge
    with Client(target, timeout_s=0.3) as c, pytest.raises(tandem.DeadlineExceeded):
        list(c.chat(HI, max_new_tokens=200, session_id="dl-passes"))  # 4 s of deltas
    assert fake.calls["dl-passes"].ended.wait(2.0) and not fake.calls["dl-passes"].completed


def test_cancel_from_another_thread_ends_the_call(edge):
    fake, target = edge
    sid = "sync-cancel"
    got: list[Delta] = []
    two = threading.Event()
    raised: list[BaseException] = []

    def consume(s) -> None:
        try:
            for d in s:
                got.append(d)
                if len(got) == 2:
                    two.set()
        except BaseException as e:
            raised.append(e)

    with Client(target) as c:
        s = c.chat(HI, max_new_tokens=200, session_id=sid)  # 4 s if not cancelled
        t = threading.Thread(target=consume, args=(s,))
        t.start()
        assert two.wait(5.0)
        s.cancel()  # the consumer is blocked waiting for the next delta
        t.join(2.0)
        assert not t.is_alive() and len(raised) == 1 and type(raised[0]) is Cancelled, raised
        assert raised[0].code == grpc.StatusCode.CANCELLED and s.cancelled
        assert fake.calls[sid].ended.wait(2.0), "the server did not see the call end"
        assert not fake.calls[sid].completed and fake.calls[sid].sent < 50
        with pytest.raises(Cancelled):  # iterating after cancel()
            next(iter(s))
        s.cancel()  # idempotent
        s2 = c.chat(HI, max_new_tokens=200, session_id="sync-cancel-first")
        s2.cancel()  # before iterating at all
        with pytest.raises(Cancelled):
            list(s2)


def test_result_without_a_final_event_says_why(edge):
    """``result`` of a turn that has none raises RuntimeError naming why: not iterated to its end
    yet, cancelled, or failed (with the error the stream raised)."""
    _, target = edge
    with Client(target) as c:
        s = c.chat(HI, max_new_tokens=200, session_id="sync-no-result")
        with pytest.raises(RuntimeError, match="iterate the stream to its end first"):
            s.result  # noqa: B018
        next(iter(s))
        s.cancel()
        with pytest.raises(Cancelled):
            list(s)
        with pytest.raises(RuntimeError, match=r"no result: its stream (was cancelled|raised Cancelled)"):
            s.result  # noqa: B018
        failed = c.chat(prompt="fail", session_id="sync-fail-result")
        with pytest.raises(InvalidArgument):
            list(failed)
        with pytest.raises(RuntimeError, match="no result: its stream raised InvalidArgument: .*no such prompt"):
            failed.result  # noqa: B018


async def test_async_result_without_a_final_event_says_why(edge):
    _, target = edge
    async with AsyncClient(target) as c:
        failed = c.chat(prompt="fail", session_id="async-fail-result")
        with pytest.raises(InvalidArgument):
            [d async for d in failed]
        with pytest.raises(RuntimeError, match="no result: its stream raised InvalidArgument"):
            failed.result  # noqa: B018
        s = c.chat(HI, max_new_tokens=200, session_id="async-no-result")
        s.cancel()
        with pytest.raises(Cancelled):
            [d async for d in s]
        with pytest.raises(RuntimeError, match="no result: its stream"):
            s.result  # noqa: B018


def test_cancel_after_the_end_keeps_the_result(edge):
    _, target = edge
    with Client(target) as c:
        s = c.chat(HI, max_new_tokens=2, session_id="sync-cancel-late")
        assert len(list(s)) == 2
        s.cancel()
        assert s.result.output_tokens == 2


@pytest.mark.parametrize("where", ["task", "thread"])
async def test_async_cancel_from_another_task_or_thread(edge, where):
    fake, target = edge
    sid = f"async-cancel-{where}"
    async with AsyncClient(target) as c:
        s = c.chat(HI, max_new_tokens=200, session_id=sid)
        two = asyncio.Event()

        async def consume() -> int:
            n = 0
            async for _ in s:
                n += 1
                if n == 2:
                    two.set()
            return n

        task = asyncio.create_task(consume())
        await asyncio.wait_for(two.wait(), 5.0)
        if where == "task":
            s.cancel()  # this test's task; the consumer's awaits the next delta
        else:
            await asyncio.to_thread(s.cancel)
        with pytest.raises(Cancelled):  # not asyncio.CancelledError: the consumer was not cancelled
            await asyncio.wait_for(task, 2.0)
        assert await asyncio.to_thread(fake.calls[sid].ended.wait, 2.0)
        assert not fake.calls[sid].completed and fake.calls[sid].sent < 50
        with pytest.raises(Cancelled):
            async for _ in s:
                pass


async def test_cancelling_the_consuming_task_still_raises_cancelled_error(edge):
    fake, target = edge
    async with AsyncClient(target) as c:
        s = c.chat(HI, max_new_tokens=200, session_id="async-task-cancel")

        async def consume() -> None:
            async for _ in s:
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await asyncio.to_thread(fake.calls["async-task-cancel"].ended.wait, 2.0)


def test_info_round_trip(edge):
    _, target = edge
    with Client(target) as c:
        info = c.info()
    assert info == INFO and isinstance(info.default_timeout_s, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.max_new_tokens = 1  # type: ignore[misc]
    with Client("127.0.0.1:1") as c, pytest.raises(tandem.Unavailable):  # nothing listens there
        c.info(timeout_s=5)


async def test_async_info_round_trip(edge):
    _, target = edge
    async with AsyncClient(target) as c:
        assert await c.info() == INFO


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


async def test_the_stop_event_names_the_first_stop_signal():
    """``install_stop_signals``: SIGINT or SIGTERM sets the event, which names the first one (the
    daemons' drain log line says it)."""
    from tandem.common.runtime.grpc_setup import install_stop_signals

    loop = asyncio.get_running_loop()
    stop = install_stop_signals(loop)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.wait_for(stop.wait(), 5)
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(0.1)
        assert stop.name == "SIGINT"
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def test_a_real_edge_logs_its_drain_and_its_stop_on_sigterm(split_dir, tmp_path):
    """``tandem-edge`` (no cloud up, no local mode: it starts degraded at once) logs at INFO that it
    drains, naming the signal, the turns in flight and the grace period, then that it stopped, and
    exits 0."""
    sig = signal.SIGTERM
    extra = ["--no-local", "--connect-timeout-s", "0.5", "--drain-grace-s", "2.5"]
    d = Daemon("tandem-edge", edge_command(split_dir, "127.0.0.1:1", extra=extra), tmp_path / "e.log", tmp_path / "p")
    try:
        d.wait_ready(120, poll_s=0.1)
        d.proc.send_signal(sig)
        assert d.proc.wait(60) == 0, d.tail()
    finally:
        stop_all([d], grace_s=5)
    lines = [x for x in d.log.read_text().splitlines() if " tandem.edge INFO tandem-edge " in x]
    assert any(f"tandem-edge draining ({sig.name}): 0 turns in flight, grace 2.5 s" in x for x in lines), d.tail()
    assert "tandem-edge stopped" in lines[-1], d.tail()


# --- one connection: both clients call on the same terms ----------------------------------------------


def test_a_connection_refuses_what_a_client_would_before_any_channel():
    with pytest.raises(ValueError, match="not a loopback address"):
        Connection.of("edge.example.com:50061")
    with pytest.raises(ValueError, match="both cert_file and key_file"):
        Connection.of("localhost:1", cert_file="c.pem")
    with pytest.raises(ValueError, match="timeout_s"):
        Connection.of("localhost:1", timeout_s=0)
    conn = Connection.of("10.0.0.7:50061", insecure=True, api_key="k" * 16, timeout_s=12)
    assert conn.call_options() == {"timeout": 12.0, "metadata": (("authorization", "Bearer " + "k" * 16),)}
    assert conn.call_options(math.inf) == {"timeout": None, "metadata": (("authorization", "Bearer " + "k" * 16),)}
    options = dict(conn.options)
    assert json.loads(options["grpc.service_config"]) == SERVICE_CONFIG and options["grpc.enable_retries"] == 1
    assert options["grpc.keepalive_time_ms"] == 5000


async def _async_calls(target: str, sid: str, **kw) -> bool:
    async with AsyncClient(target, **kw) as c:
        await c.complete(HI, max_new_tokens=1, session_id=sid)
        await c.info()
        return await c.end_session(sid)


def test_both_clients_send_every_call_with_the_same_key_and_deadline(edge):
    fake, target = edge
    key = "app-key-" + "x" * 16
    with Client(target, api_key=key, timeout_s=40) as c:
        c.complete(HI, max_new_tokens=1, session_id="conn-sync")
        c.info()
        assert c.end_session("conn-sync")
    assert asyncio.run(_async_calls(target, "conn-async", api_key=key, timeout_s=40))
    recs = [fake.calls[s] for s in ("conn-sync", "end:conn-sync", "conn-async", "end:conn-async")]
    recs += fake.info_calls[-2:]
    for rec in recs:
        assert rec.authorization == f"Bearer {key}"
        assert 30 < rec.time_remaining_s <= 42


def test_both_clients_retry_info_while_the_edge_is_unavailable(edge):
    """gRPC's retry policy from the connection's service config: up to 3 attempts of ``GetInfo``."""
    fake, target = edge
    fake.info_refusals, before = 2, len(fake.info_calls)
    with Client(target) as c:
        assert c.info() == INFO
    fake.info_refusals = 2

    async def ask() -> EdgeInfo:
        async with AsyncClient(target) as c:
            return await c.info()

    assert asyncio.run(ask()) == INFO
    assert len(fake.info_calls) - before == 6
    fake.info_refusals = 3
    with Client(target) as c, pytest.raises(tandem.Unavailable, match="edge restarting"):
        c.info()
    fake.info_refusals = 0
