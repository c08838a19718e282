"""Property-based fuzzing (hypothesis) of the cloud's uplink verification and of raw protobuf messages into the
``Cloud`` and ``Edge`` gRPC services. Shared by ``tests/fuzz/test_fuzz.py`` (thousands of cases,
fixed seed, fast tier) and ``python -m tests.fuzz`` (``tests/fuzz/cli.py``: longer runs, random seed). The
cases live in ``tests/fuzz/uploads.py`` (valid uploads and their mutations) and ``tests/fuzz/strategies.py``;
this module runs them and checks the properties.

Everything runs against the in-memory doubles (``MemoryEngines``, ``MemoryBlockStore``, ``MemoryHead``, a toy
tokenizer and model shape mirroring ``tests/doubles.py``), no vLLM and no ONNX Runtime, in one event loop on a
background thread (``LoopThread``), so that a hang is seen from the outside (``hang_s``) and reported.

Targets (``TARGETS``), each a strategy of cases and a property (``Harness.check``):

* ``uplink``: a valid split upload (header, chunks, KV blocks, commit: framed by the same functions as the edge's)
  mutated by ``uplink_plans`` (fields, payload bytes, CRC, values, enums, order, duplicates, stalls, the sender's
  answer to NACKs and repair requests), decoded as the servicer decodes it (``uplink_from_pb``,
  ``cloud.service.uplink_body``) and fed to ``Gateway.run_turn`` while a good session runs beside it.
  Property: the turn completes or raises a ``TandemError`` whose status (``status_of``) is allowed (with one
  mutation: the status that mutation calls for), never another exception, within ``hang_s``; the good
  session's tokens equal those of a fresh gateway; a session the turn failed on is unchanged; the upload budget
  and the link table are back to idle.
* ``cloud-typed`` / ``edge-typed``: well-typed adversarial messages (huge and unknown values, long strings,
  empty oneofs; for ``Generate`` the plans above) into the services over grpc.aio on loopback.
* ``cloud-raw`` / ``edge-raw``: arbitrary or damaged bytes as serialized requests, known and unknown methods.
  Property (gRPC): every call ends within ``hang_s`` with a status in ``ALLOWED`` (``UNIMPLEMENTED`` for unknown
  methods), never ``INTERNAL`` or ``UNKNOWN``; a ``Downlink.error`` verdict matches the call's status; the
  servers stay idle afterwards and good requests still return the reference results.

Open product bugs are listed in ``KNOWN_BUGS``; a case that hits one is counted (``Stats.known``) and, unless
``strict``, not a failure (tests/fuzz/test_fuzz.py keeps a strict xfail reproducer for each).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import grpc

from tandem.cloud.gateway import Gateway
from tandem.cloud.service import CloudServicer, uplink_body
from tandem.cloud.sessions.table import CloudSession
from tandem.cloud.turn import as_principal
from tandem.common.protocol.errors import TandemError, error_from_name
from tandem.common.protocol.grpc_errors import status_of
from tandem.common.protocol.params import LinkParams, NegotiateOffer, Sampling
from tandem.common.runtime.grpc_setup import add_service, start_server
from tandem.common.runtime.security import scoped
from tandem.common.wire.messages import (
    Nack,
    Repair,
    TokensOut,
    TurnFinal,
    TurnHeader,
    UploadAck,
    uplink_from_pb,
    uplink_to_pb,
)
from tandem.edge.api.grpc_service import EdgeServicer
from tandem.edge.compute.batcher import HeadBatcher
from tandem.edge.compute.head import MemoryHead
from tandem.edge.link.base import InProcessLink
from tandem.edge.link.connection import CloudConnection
from tandem.edge.modes.split_head import Head
from tandem.edge.node import EdgeNode
from tandem.v1 import tandem_pb2 as pb
from tests.doubles import toy_node
from tests.fuzz.strategies import CLOUD_METHODS, EDGE_METHODS, UNKNOWN_METHODS, RawCall, TypedCall, overridden
from tests.fuzz.uploads import (
    ALLOWED,
    DEADLINE,
    FLAVORS,
    FUZZ_EDGE,
    GOOD_EDGE,
    GOOD_SESSION,
    GRPC_GOOD_SESSION,
    INVALID,
    OK,
    OTHER_LINK,
    TARGETS,
    CloudStack,
    Expect,
    S,
    Stall,
    UplinkPlan,
    Upload,
    Work,
    _key,
    busy_bookkeeping,
    make_upload,
    token_ids,
)
from tests.toy import HKV, MANIFEST, D, H, K

T = TypeVar("T")

# ------------------------------------------------------------------ known product bugs


@dataclass(frozen=True)
class KnownBug:
    """An open product bug: ``matches(method, messages, outcome, server_errors)`` says whether a call's
    ending is this bug's signature."""

    key: str
    where: str
    summary: str
    matches: Callable[[str, Sequence[bytes | Stall], Outcome, Sequence[str]], bool]


# tests/fuzz/test_fuzz.py keeps a reproducer of each case this fuzzing guards against: undecodable requests (answered by
# common.runtime.grpc_setup.add_service), an undecodable message after a verdict (cloud.service.drain), Negotiate with
# infinite or NaN measurements (NegotiateOffer.from_pb), the anonymous link evicted by max_links negotiations
# (LinkTable.register). An open bug goes here, keyed by ``KnownBug.key``; none is open.
KNOWN_BUGS: dict[str, KnownBug] = {}


def known_bug(method: str, messages: Sequence[bytes | Stall], out: Outcome, server_errors: Sequence[str]) -> str | None:
    """The ``KNOWN_BUGS`` key this call's ending matches, if any (``messages``: the request messages sent;
    ``server_errors``: exception type names the servers logged during the call)."""
    return next((b.key for b in KNOWN_BUGS.values() if b.matches(method, messages, out, server_errors)), None)


# ------------------------------------------------------------------ running


class PropertyFailure(AssertionError):
    """A case broke a property (the message says which and how)."""


class LoopThread:
    """An event loop on a daemon thread; ``run`` waits for a coroutine at most ``timeout_s``."""

    def __init__(self, name: str = "tests.fuzz") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """The coroutine's result. Raises PropertyFailure (a hang) if it runs past ``timeout_s``; it is cancelled."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError:
            if fut.done():
                raise
            fut.cancel()
            with contextlib.suppress(BaseException):
                fut.result(5.0)
            raise PropertyFailure(f"hang: the case did not end within {timeout_s:.0f} s") from None

    def close(self) -> None:
        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(BaseException):
            asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(10.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10.0)
        if not self._thread.is_alive():
            self.loop.close()


class ServerErrors(logging.Handler):
    """Collects the exception types logged (with a traceback) by the ``tandem`` loggers."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.types: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[0] is not None:
            self.types.append(record.exc_info[0].__name__)


@dataclass
class Stats:
    """Cases run and how they ended, per target."""

    cases: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    known: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0


@dataclass
class Outcome:
    """How one turn or call ended: its status, the error (uplink target) or details, and what came back."""

    status: grpc.StatusCode
    detail: str = ""
    events: list[Any] = field(default_factory=list)


async def _drive(
    gw: Gateway,
    w: Work,
    peer: str,
    deadline: float | None,
) -> Outcome:
    """Send the mutated upload into ``gw.run_turn`` the way the servicer decodes it, answering NACKs and repair
    requests per ``w.policy``. Returns the outcome; any exception but a ``TandemError`` propagates."""
    queue: deque[pb.Uplink | Stall] = deque(w.items)
    last: dict[tuple[str, int], pb.Uplink] = {_key(m): m for m in w.items if isinstance(m, pb.Uplink)}
    resends = 0

    async def body() -> AsyncIterator[pb.Uplink]:
        while queue:  # every answer to what the gateway said about earlier items is queued by now
            m = queue.popleft()
            if isinstance(m, Stall):
                await asyncio.Event().wait()
            else:
                yield m

    def resend(keys: list[tuple[str, int]]) -> None:
        nonlocal resends
        for key in keys:
            m = w.originals.get(key) if w.policy == "honest" else last.get(key)
            if key == ("commit", 0):
                m = w.commit if w.policy == "honest" else last.get(key)
            if m is not None and resends < 64:
                resends += 1
                queue.append(m)

    events: list[Any] = []
    try:
        header = uplink_from_pb(pb.Uplink(header=w.header))
        assert isinstance(header, TurnHeader)
        turn = cast(AsyncGenerator[Any, None], gw.run_turn(header, uplink_body(body()), peer, deadline))
        async with contextlib.aclosing(turn):
            async for ev in turn:
                events.append(ev)
                if w.policy == "mute":
                    continue
                if isinstance(ev, Nack):
                    resend([("chunk", ev.seq)])
                elif isinstance(ev, Repair):
                    resend([*(("kv_block", j) for j in ev.leaf_indices), ("commit", 0)])
    except TandemError as e:
        return Outcome(status_of(e), f"{type(e).__name__}: {e}", events)
    return Outcome(OK, "", events)


def _check_final(events: Sequence[Any], what: str) -> None:
    finals = [e for e in events if isinstance(e, TurnFinal)]
    if len(finals) != 1 or events[-1] is not finals[0]:
        raise PropertyFailure(f"{what}: completed without exactly one final event last: {events[-4:]}")
    n = sum(len(e.token_ids) for e in events if isinstance(e, TokensOut))
    if n != finals[0].output_tokens:
        raise PropertyFailure(f"{what}: {n} tokens streamed, the final says {finals[0].output_tokens}")


def _tokens(events: Sequence[Any]) -> tuple[int, ...]:
    return tuple(t for e in events if isinstance(e, TokensOut) for t in e.token_ids)


GOOD_A = token_ids(99, 70)  # the good session's first prompt; its second extends it
GOOD_AB = token_ids(99, 101)


def good_uploads(params: LinkParams, session_id: str = GOOD_SESSION) -> tuple[Upload, Upload]:
    """The good session's two turns (the second sends only what the first did not)."""
    s = Sampling(max_new_tokens=6)
    first = make_upload(params, GOOD_A, session_id, "good-1", values_seed=99, sampling=s)
    second = make_upload(params, GOOD_AB, session_id, "good-2", cached_tokens=len(GOOD_A), values_seed=99, sampling=s)
    return first, second


async def run_good(gw: Gateway, u: Upload, what: str, caller: str = GOOD_EDGE) -> tuple[int, ...]:
    """Run a good upload honestly from ``caller``; its tokens. Raises PropertyFailure if it does not complete."""
    out = await _drive(gw, Work.of(u, gw.params, "honest"), caller, None)
    if out.status != OK:
        raise PropertyFailure(f"{what}: a good turn failed on the fuzzed gateway: {out.status.name} {out.detail}")
    _check_final(out.events, what)
    return _tokens(out.events)


@dataclass
class ServiceStack:
    """The ``Cloud`` and ``Edge`` gRPC servers on loopback (the edge's link to the cloud's gateway in process),
    client channels to both, and the reference results of good requests."""

    cloud: CloudStack
    cloud_servicer: CloudServicer
    cloud_server: grpc.aio.Server
    edge: EdgeNode
    edge_servicer: EdgeServicer
    edge_server: grpc.aio.Server
    batcher: HeadBatcher
    cloud_channel: grpc.aio.Channel
    edge_channel: grpc.aio.Channel
    reference: dict[str, Any] = field(default_factory=dict)

    @classmethod
    async def start(cls) -> ServiceStack:
        cloud = CloudStack.create(upload_timeout_s=5.0, drain_timeout_s=0.25)
        gw = cloud.gateway
        cloud_servicer = CloudServicer(gw, "toy-cloud")
        cloud_server, cloud_port, _ = await start_server(
            [lambda s: add_service(s, cloud_servicer, "Cloud")],
            ["tandem.v1.Cloud"],
            "127.0.0.1",
            0,
            gw.registry.max_message_bytes(),
        )
        key = MANIFEST.compatibility_key()
        conn = CloudConnection(
            InProcessLink(gw),
            NegotiateOffer(edge_id="e", model_id="toy", head_keys={K: key}, edge_max_batch=4),
            probe_bytes=0,
        )
        await conn.connect()
        batcher = HeadBatcher(MemoryHead(K, H, HKV, D), 4)
        batcher.start()
        edge = toy_node([Head(batcher, key)], conn)
        edge_servicer = EdgeServicer(edge, "toy")
        edge_server, edge_port, _ = await start_server(
            [lambda s: add_service(s, edge_servicer, "Edge")],
            ["tandem.v1.Edge"],
            "127.0.0.1",
            0,
            4 << 20,
        )
        opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
        stack = cls(
            cloud,
            cloud_servicer,
            cloud_server,
            edge,
            edge_servicer,
            edge_server,
            batcher,
            grpc.aio.insecure_channel(f"127.0.0.1:{cloud_port}", options=opts),
            grpc.aio.insecure_channel(f"127.0.0.1:{edge_port}", options=opts),
        )
        await stack._take_reference()
        return stack

    def edge_link(self) -> str:
        """The edge's link to the cloud: another principal's than the gRPC callers'."""
        return self.edge.conn.current().link_id if self.edge.conn is not None else ""

    async def stop(self) -> None:
        await self.cloud_channel.close()
        await self.edge_channel.close()
        await self.cloud_server.stop(0)
        await self.edge_server.stop(0)
        await self.batcher.stop()

    # --- good requests

    def _good_generate(self) -> list[bytes]:
        return _serialized(make_upload(self.cloud.gateway.params, GOOD_A, "", "good-g", values_seed=5))

    def _good_session(self) -> tuple[list[bytes], list[bytes]]:
        first, second = good_uploads(self.cloud.gateway.params, GRPC_GOOD_SESSION)
        return _serialized(first), _serialized(second)

    def _good_chat(self, turn: int) -> bytes:
        convo = [pb.ChatMessage(role="user", content="hello there, fuzz")]
        if turn == 2:
            convo += [
                pb.ChatMessage(role="assistant", content="ok"),
                pb.ChatMessage(role="user", content="and a longer second question, to make a new KV block or two"),
            ]
        sid = "good-edge-session" if turn else ""
        return pb.ChatRequest(
            session_id=sid, messages=convo, sampling=pb.SamplingParams(max_new_tokens=5), mode=pb.MODE_SPLIT
        ).SerializeToString()

    async def _generate_tokens(self, msgs: list[bytes], what: str) -> tuple[int, ...]:
        out = await call(self.cloud_channel, "/tandem.v1.Cloud/Generate", "ss", msgs, None)
        if out.status != OK:
            raise PropertyFailure(f"{what}: {out.status.name} {out.detail}")
        downs = [pb.Downlink.FromString(m) for m in out.events]
        return tuple(t for m in downs if m.WhichOneof("msg") == "tokens" for t in m.tokens.token_ids)

    async def _chat_tokens(self, msg: bytes, what: str) -> tuple[int, ...]:
        out = await call(self.edge_channel, "/tandem.v1.Edge/Chat", "us", [msg], None)
        if out.status != OK:
            raise PropertyFailure(f"{what}: {out.status.name} {out.detail}")
        done = pb.ChatEvent.FromString(out.events[-1])
        if done.WhichOneof("event") != "done":
            raise PropertyFailure(f"{what}: the stream did not end with ChatDone")
        return tuple(done.done.output_token_ids)

    async def _take_reference(self) -> None:
        r = self.reference
        r["generate"] = await self._generate_tokens(self._good_generate(), "reference Generate")
        first, second = self._good_session()
        r["session"] = (
            await self._generate_tokens(first, "reference session turn 1"),
            await self._generate_tokens(second, "reference session turn 2"),
        )
        r["chat"] = await self._chat_tokens(self._good_chat(0), "reference Chat")
        r["edge-session"] = (
            await self._chat_tokens(self._good_chat(1), "reference edge session turn 1"),
            await self._chat_tokens(self._good_chat(2), "reference edge session turn 2"),
        )
        r["get-info"] = await self._get_info()
        # the sessions are left at turn 1: each health check runs turn 2 (their state lived through the cases
        # since the last check), then turn 1 again
        await self._generate_tokens(first, "reference session turn 1")
        await self._chat_tokens(self._good_chat(1), "reference edge session turn 1")

    async def _get_info(self) -> pb.EdgeInfo:
        out = await call(self.edge_channel, "/tandem.v1.Edge/GetInfo", "uu", [b""], None)
        if out.status != OK:
            raise PropertyFailure(f"GetInfo failed: {out.status.name} {out.detail}")
        return pb.EdgeInfo.FromString(out.events[0])

    async def wait_idle(self, timeout_s: float = 5.0) -> None:
        """Raises PropertyFailure if the servers' bookkeeping is not idle within ``timeout_s``."""
        t_end = time.monotonic() + timeout_s
        while True:
            busy = busy_bookkeeping(self.cloud.gateway)
            if self.cloud_servicer.in_flight:
                busy.append(f"{self.cloud_servicer.in_flight} Generate calls still in flight")
            in_cloud, in_flight = self.edge.turns_in_flight
            if in_cloud or in_flight:
                busy.append(f"edge turns in flight: {in_cloud} / {in_flight}")
            if not busy:
                return
            if time.monotonic() > t_end:
                raise PropertyFailure(f"not idle {timeout_s:.0f} s after the case: {'; '.join(busy)}")
            await asyncio.sleep(0.005)

    async def check_cloud(self) -> None:
        """The cloud still answers good requests with the reference results, its good session included."""
        r = self.reference
        first, second = self._good_session()
        got = await self._generate_tokens(second, "good session turn 2")
        if got != r["session"][1]:
            raise PropertyFailure(f"good session turn 2 gave {got}, reference {r['session'][1]}")
        got = await self._generate_tokens(first, "good session turn 1")
        if got != r["session"][0]:
            raise PropertyFailure(f"good session turn 1 gave {got}, reference {r['session'][0]}")
        got = await self._generate_tokens(self._good_generate(), "good Generate")
        if got != r["generate"]:
            raise PropertyFailure(f"good Generate gave {got}, reference {r['generate']}")
        info = await call(self.cloud_channel, "/tandem.v1.Cloud/GetServerInfo", "uu", [b""], None)
        if info.status != OK or not pb.ServerInfo.FromString(info.events[0]).serving:
            raise PropertyFailure(f"GetServerInfo after the case: {info.status.name} {info.detail}")

    async def check_edge(self) -> None:
        """The edge still answers good requests with the reference results, its good session included."""
        r = self.reference
        got = await self._chat_tokens(self._good_chat(2), "good edge session turn 2")
        if got != r["edge-session"][1]:
            raise PropertyFailure(f"good edge session turn 2 gave {got}, reference {r['edge-session'][1]}")
        got = await self._chat_tokens(self._good_chat(1), "good edge session turn 1")
        if got != r["edge-session"][0]:
            raise PropertyFailure(f"good edge session turn 1 gave {got}, reference {r['edge-session'][0]}")
        got = await self._chat_tokens(self._good_chat(0), "good Chat")
        if got != r["chat"]:
            raise PropertyFailure(f"good Chat gave {got}, reference {r['chat']}")
        if await self._get_info() != r["get-info"]:
            raise PropertyFailure("GetInfo changed")


def _serialized(u: Upload) -> list[bytes]:
    return [uplink_to_pb(x).SerializeToString() for x in (u.header, *u.items)]


def _identity(b: bytes) -> bytes:
    return b


async def call(
    channel: grpc.aio.Channel,
    method: str,
    arity: str,
    messages: Sequence[bytes | Stall],
    timeout_s: float | None,
) -> Outcome:
    """One call of raw request bytes; the outcome with the raw responses as ``events``."""
    responses: list[bytes] = []
    if arity == "uu":
        try:
            m = messages[0]
            assert isinstance(m, bytes)
            responses.append(
                await channel.unary_unary(method, request_serializer=_identity, response_deserializer=_identity)(
                    m, timeout=timeout_s
                )
            )
            return Outcome(OK, "", responses)
        except grpc.aio.AioRpcError as e:
            return Outcome(e.code(), e.details() or "", responses)

    released = asyncio.Event()  # a stalled request stream ends once the call has

    async def requests() -> AsyncIterator[bytes]:
        for m in messages:
            if isinstance(m, Stall):
                await released.wait()
                return
            yield m

    if arity == "us":
        assert isinstance(messages[0], bytes)
        c: Any = channel.unary_stream(method, request_serializer=_identity, response_deserializer=_identity)(
            messages[0], timeout=timeout_s
        )
    else:
        c = channel.stream_stream(method, request_serializer=_identity, response_deserializer=_identity)(
            requests(), timeout=timeout_s
        )
    try:
        with contextlib.suppress(grpc.aio.AioRpcError):
            async for r in c:
                responses.append(r)
        return Outcome(await c.code(), await c.details() or "", responses)
    finally:
        released.set()
        c.cancel()


class Harness:
    """The stacks every property runs against, in one event loop on a background thread (``LoopThread``).

    ``check(target, case)`` runs one case and raises ``PropertyFailure`` (or the unexpected exception) when it
    breaks its target's property; ``stats`` counts cases and outcomes. ``strict``: a case that hits one of
    ``KNOWN_BUGS`` fails too. ``check_every``: the gRPC targets check the good requests after every so many cases
    (and ``final_check`` at the end)."""

    def __init__(self, *, hang_s: float = 30.0, strict: bool = False, check_every: int = 5) -> None:
        self.hang_s, self.strict, self.check_every = hang_s, strict, check_every
        self.stats = {t: Stats() for t in TARGETS}
        self.errors = ServerErrors()
        self._log = logging.getLogger("tandem")
        self._log.addHandler(self.errors)
        self._n = itertools.count()  # names sessions and requests of the cases apart
        self._grpc_cases = itertools.count()
        self.loop = LoopThread()
        self.loop.run(self._start(), 120.0)

    async def _start(self) -> None:
        self.gateways = {f: CloudStack.create(**cfg) for f, cfg in FLAVORS.items()}
        offer = NegotiateOffer(
            edge_id="good", model_id="toy", head_keys={K: MANIFEST.compatibility_key()}, edge_max_batch=4
        )
        self.other_links = {f: s.gateway.negotiate(offer, GOOD_EDGE).link_id for f, s in self.gateways.items()}
        self.reference: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        for f, cfg in FLAVORS.items():  # the good session on a fresh gateway of each flavor
            fresh = CloudStack.create(**cfg).gateway
            first, second = good_uploads(fresh.params)
            self.reference[f] = (await run_good(fresh, first, "reference"), await run_good(fresh, second, "reference"))
        self.services = await ServiceStack.start()

    def close(self) -> None:
        """Stop the servers and the loop."""
        with contextlib.suppress(BaseException):
            self.loop.run(self.services.stop(), 30.0)
        self.loop.close()
        self._log.removeHandler(self.errors)

    def check(self, target: str, case: Any) -> None:
        """Run one case of ``target`` against its property."""
        runners: dict[str, Callable[[Any], Coroutine[Any, Any, str]]] = {
            "uplink": self._uplink,
            "cloud-typed": self._cloud_typed,
            "cloud-raw": self._cloud_raw,
            "edge-typed": self._edge_typed,
            "edge-raw": self._edge_raw,
        }
        run = runners[target]
        st_ = self.stats[target]
        st_.cases += 1
        t0 = time.perf_counter()
        try:
            outcome = self.loop.run(run(case), self.hang_s)
        finally:
            st_.seconds += time.perf_counter() - t0
        st_.outcomes[outcome] += 1

    def final_check(self) -> None:
        """The servers are idle and still answer good requests with the reference results."""
        self.loop.run(self._final(), self.hang_s)

    async def _final(self) -> None:
        for stack in self.gateways.values():
            if busy := busy_bookkeeping(stack.gateway):
                raise PropertyFailure("; ".join(busy))
        await self.services.wait_idle()
        await self.services.check_cloud()
        await self.services.check_edge()
        await self.services.wait_idle()

    # --- uplink

    async def _uplink(self, plan: UplinkPlan) -> str:
        stack = self.gateways[plan.flavor]
        gw = stack.gateway
        n = next(self._n)
        sid = "" if plan.scenario == "stateless" else f"fz-{n}"
        base = plan.base_tokens if plan.scenario == "next" else 0
        ids = token_ids(plan.values_seed, base + plan.new_tokens)
        params = gw.params
        if base:  # the session's earlier turn
            first = make_upload(params, ids[:base], sid, f"fz-{n}-0", values_seed=plan.values_seed)
            await run_good(gw, first, "the victim session's first turn", FUZZ_EDGE)
        upload = make_upload(params, ids, sid, f"fz-{n}-1", cached_tokens=base, values_seed=plan.values_seed)
        w = Work.of(upload, params, plan.policy, self.other_links[plan.flavor])
        expect = frozenset({OK})
        for m in plan.mutations:
            expect = m.apply(w)
        strict = len(plan.mutations) <= 1
        loop = asyncio.get_running_loop()
        deadline = None
        if plan.deadline == "past":
            deadline, expect = loop.time() - 1.0, (expect - {OK}) | {DEADLINE}
        elif w.stall:
            deadline = loop.time() + 0.05
        victim = cloud_session(gw, FUZZ_EDGE, sid)
        before = _snapshot(victim)
        good_first, good_second = good_uploads(params)
        want = self.reference[plan.flavor]
        got1 = await run_good(gw, good_first, "good session turn 1")
        out, got2 = await asyncio.gather(
            _drive(gw, w, FUZZ_EDGE, deadline), run_good(gw, good_second, "good session turn 2")
        )
        what = f"{out.status.name} ({out.detail[:300]})"
        if out.status not in ALLOWED:
            raise PropertyFailure(f"the fuzzed turn ended {what}")
        if strict and out.status not in expect:
            raise PropertyFailure(f"the fuzzed turn ended {what}; expected {sorted(s.name for s in expect)}")
        if out.status == OK:
            _check_final(out.events, "the fuzzed turn")
        if (got1, got2) != want:
            raise PropertyFailure(f"good session gave {(got1, got2)} beside the fuzzed turn; a fresh gateway {want}")
        if victim is not None and before is not None:
            # the session moves on exactly when the cloud acknowledged the upload (the edge keeps its own state
            # then, even if the turn fails later, e.g. past its deadline in the tail prefill)
            after = _snapshot(cloud_session(gw, FUZZ_EDGE, sid))
            acked = w.header.session_id == sid and any(isinstance(e, UploadAck) for e in out.events)
            if not acked and after != before:
                raise PropertyFailure(f"session {sid!r} changed although the turn on it ended {what} unacknowledged")
            if acked and (after is None or after[0] != before[0] + 1 or after[1] != list(w.header.prompt_token_ids)):
                raise PropertyFailure(f"session {sid!r} does not hold the acknowledged turn ({what})")
        if busy := busy_bookkeeping(gw):
            raise PropertyFailure(f"after the fuzzed turn ({what}): {'; '.join(busy)}")
        return out.status.name

    # --- gRPC

    async def _grpc_case(
        self, channel: grpc.aio.Channel, method: str, arity: str, msgs: Sequence[bytes | Stall], timeout_s: float | None
    ) -> tuple[Outcome, str | None]:
        self.errors.types.clear()
        out = await call(channel, method, arity, msgs, timeout_s)
        await self.services.wait_idle()
        bug = known_bug(method, msgs, out, self.errors.types)
        return out, bug

    def _judge(
        self,
        target: str,
        method: str,
        out: Outcome,
        bug: str | None,
        expect: Expect | None = None,
        client_deadline: bool = False,
    ) -> str:
        allowed = ALLOWED | ({S.UNIMPLEMENTED} if method in UNKNOWN_METHODS else frozenset())
        if method in UNKNOWN_METHODS and out.status != S.UNIMPLEMENTED:
            raise PropertyFailure(f"unknown method {method} ended {out.status.name}: {out.detail[:200]}")
        if bug is not None and out.status not in allowed:
            self.stats[target].known[bug] += 1
            if self.strict:
                raise PropertyFailure(f"known bug {bug}: {method} ended {out.status.name}: {out.detail[:200]}")
            return f"known:{bug}"
        if out.status not in allowed:
            raise PropertyFailure(
                f"{method} ended {out.status.name}: {out.detail[:300]} (server errors: {self.errors.types})"
            )
        if expect is not None and out.status not in expect:
            raise PropertyFailure(
                f"{method} ended {out.status.name} ({out.detail[:300]}); expected {sorted(s.name for s in expect)}"
            )
        if method.endswith("/Generate"):
            _check_verdict(out, client_deadline)
        return out.status.name

    async def _periodic(self, check: Callable[[], Coroutine[Any, Any, None]]) -> None:
        if next(self._grpc_cases) % self.check_every == self.check_every - 1:
            await check()
            await self.services.wait_idle()

    async def _cloud_raw(self, case: RawCall) -> str:
        arity = {**CLOUD_METHODS, **UNKNOWN_METHODS}[case.method]
        if arity != "ss" and not case.messages:
            return "skipped"
        out, bug = await self._grpc_case(self.services.cloud_channel, case.method, arity, case.messages, None)
        verdict = self._judge("cloud-raw", case.method, out, bug)
        await self._periodic(self.services.check_cloud)
        return verdict

    async def _edge_raw(self, case: RawCall) -> str:
        arity = {**EDGE_METHODS, **UNKNOWN_METHODS}[case.method]
        out, bug = await self._grpc_case(self.services.edge_channel, case.method, arity, case.messages, None)
        verdict = self._judge("edge-raw", case.method, out, bug)
        await self._periodic(self.services.check_edge)
        return verdict

    async def _cloud_typed(self, case: TypedCall) -> str:
        arity = CLOUD_METHODS[case.method]
        expect: Expect | None = None
        timeout_s: float | None = None
        m: Any = case.message
        other = self.services.edge_link()
        if isinstance(case.message, UplinkPlan):
            msgs, expect, stall = self._plan_messages(case.message)
            timeout_s = 0.6 if stall else None  # past the drain after a verdict (0.25 s): its status comes first
        elif isinstance(case.message, tuple):  # no header first: INVALID_ARGUMENT
            msgs = [m.SerializeToString() for m in case.message]
            expect = None if case.message and case.message[0].HasField("header") else frozenset({INVALID})
        else:  # NegotiateRequest, ServerInfoRequest
            if m.link_id == OTHER_LINK:
                m = overridden(m, {"link_id": other})
            msgs = [m.SerializeToString()]
        out, bug = await self._grpc_case(self.services.cloud_channel, case.method, arity, msgs, timeout_s)
        verdict = self._judge("cloud-typed", case.method, out, bug, expect, timeout_s is not None)
        if out.status == OK and case.method.endswith("/Negotiate"):
            r = pb.NegotiateResponse.FromString(out.events[0])
            if not r.link_id or 0 not in r.params_by_split:
                raise PropertyFailure(f"Negotiate answered OK without a link id or direct-mode params: {r}")
            if r.link_id == other:
                raise PropertyFailure("Negotiate handed another edge's link to this caller")
        if out.status == OK and case.method.endswith("/GetServerInfo"):
            if pb.ServerInfo.FromString(out.events[0]).link_known and m.link_id == other:
                raise PropertyFailure("GetServerInfo told this caller about another edge's link")
        await self._periodic(self.services.check_cloud)
        return verdict

    def _plan_messages(self, plan: UplinkPlan) -> tuple[list[bytes | Stall], Expect | None, bool]:
        """An uplink plan as Generate's request messages (stateless or a new session: no earlier turn)."""
        gw = self.services.cloud.gateway
        n = next(self._n)
        sid = "" if plan.scenario == "stateless" else f"fzg-{n}"
        ids = token_ids(plan.values_seed, plan.new_tokens)
        u = make_upload(gw.params, ids, sid, f"fzg-{n}", values_seed=plan.values_seed)
        w = Work.of(u, gw.params, "mute", self.services.edge_link())
        expect = frozenset({OK})
        for m in plan.mutations:
            expect = m.apply(w)
        msgs: list[bytes | Stall] = [pb.Uplink(header=w.header).SerializeToString()]
        msgs += [m if isinstance(m, Stall) else m.SerializeToString() for m in w.items]
        return msgs, (expect if len(plan.mutations) <= 1 else None), w.stall

    async def _edge_typed(self, case: TypedCall) -> str:
        arity = EDGE_METHODS[case.method]
        msg = case.message.SerializeToString()
        out, bug = await self._grpc_case(self.services.edge_channel, case.method, arity, [msg], None)
        verdict = self._judge("edge-typed", case.method, out, bug)
        if out.status == OK and case.method.endswith("/Chat"):
            evs = [pb.ChatEvent.FromString(m) for m in out.events]
            if not evs or evs[-1].WhichOneof("event") != "done" or sum(e.HasField("done") for e in evs) != 1:
                raise PropertyFailure("Chat answered OK without exactly one ChatDone, last")
        await self._periodic(self.services.check_edge)
        return verdict


def _check_verdict(out: Outcome, client_deadline: bool) -> None:
    """A Generate call's Downlink.error (the verdict, last) names an error of the call's status (unless the
    client's own deadline ended the call while the server waited for it to stop sending, ``drain``)."""
    downs = []
    for m in out.events:
        try:
            downs.append(pb.Downlink.FromString(m))
        except Exception as e:
            raise PropertyFailure(f"Generate sent a Downlink that does not parse: {e}") from None
    errors = [d for d in downs if d.WhichOneof("msg") == "error"]
    if out.status == OK:
        if errors or not downs or downs[-1].WhichOneof("msg") != "final":
            raise PropertyFailure("Generate ended OK without its final message last, or with an error message")
        return
    if len(errors) > 1 or (errors and downs[-1] is not errors[0]):
        raise PropertyFailure("Generate sent more than one verdict, or not as its last message")
    if errors and not (client_deadline and out.status == DEADLINE):
        err = error_from_name(errors[0].error.kind, errors[0].error.message)
        if status_of(err) != out.status:
            raise PropertyFailure(
                f"Generate's verdict {errors[0].error.kind} is {status_of(err).name}, the call ended {out.status.name}"
            )


def cloud_session(gw: Gateway, caller: str, session_id: str) -> CloudSession | None:
    """The gateway's session ``session_id`` of edge ``caller`` (sessions live in their edge's namespace)."""
    return gw.sessions.get(scoped(as_principal(caller), session_id))


def _snapshot(s: CloudSession | None) -> tuple[Any, ...] | None:
    if s is None:
        return None
    hidden = None if s.hidden is None else s.hidden.tobytes()
    return (s.version, list(s.token_ids), list(s.leaves), hidden)


def describe(stats: dict[str, Stats]) -> str:
    """One line per target: cases, seconds, outcomes, known bugs hit."""
    lines = []
    for t, s in stats.items():
        if not s.cases:
            continue
        outcomes = ", ".join(f"{k} {v}" for k, v in s.outcomes.most_common())
        known = f"; known bugs hit: {dict(s.known)}" if s.known else ""
        lines.append(f"{t:12s} {s.cases:6d} cases in {s.seconds:6.1f} s: {outcomes}{known}")
    total = sum(s.cases for s in stats.values())
    lines.append(f"{'total':12s} {total:6d} cases")
    return "\n".join(lines)
