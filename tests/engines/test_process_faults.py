"""Process faults of a real ``tandem-cloud`` (one subprocess, replica A, shared by the tests, in
order): health and a direct request; a silent stream kept alive by client keepalive pings;
``kill -9`` of one vLLM EngineCore (NOT_SERVING and UNAVAILABLE at once, then restarted and
SERVING); ``kill -9`` of replica A during an upload and of a second replica B (its own process and
engines, the same Redis block store) during a decode, the turns moving and resuming with the
reference tokens; ``kill -9`` of the gateway (no engine process outlives it).

Time bounds here are correctness bounds (failure detection, restart), not performance."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.common.runtime.grpc_setup import channel_options
from tandem.daemons import Daemon, cloud_command
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

psutil = pytest.importorskip("psutil")
pytestmark = [pytest.mark.engines]

PROMPT_IDS = [504, 3458, 282, 4649, 314]  # "The capital of France is" in SmolLM2's vocabulary
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
DETECT_S = 10.0  # a dead engine or gateway must be noticed within this
RESTART_S = 240.0  # one engine restart on a busy 2-core CPU box


def _gone(p) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _title(p) -> str:
    try:
        return " ".join(p.cmdline())[:60]
    except psutil.Error:
        return "?"


def _kill_all(procs) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


def cloud_extra(redis_url: str) -> list[str]:
    # fp32 on the wire: the answers are checked against the unsplit reference token for token
    fp32 = ["--wire-dtypes", "fp32", "--kv-wire-dtypes", "fp32"]
    return ["--kv-cache-bytes", str(256 << 20), "--max-num-seqs", "4", "--store-url", redis_url, *fp32]


def _segments(proc) -> set[str]:
    """``/dev/shm`` segments ``proc`` maps (vLLM's shared-memory ring buffers)."""
    try:
        return {os.path.basename(m.path) for m in proc.memory_maps() if m.path.startswith("/dev/shm/")}
    except psutil.Error:
        return set()


def kill_tree(daemon: Daemon) -> None:
    """``kill -9`` of a ``tandem-cloud`` process and of its engines (they would follow it anyway)."""
    try:
        kids = psutil.Process(daemon.proc.pid).children(recursive=True)
    except psutil.Error:
        kids = []
    daemon.proc.kill()
    daemon.proc.wait()
    _kill_all(kids)


@pytest.fixture(scope="module")
def cloud(split_dir, tmp_path_factory, redis_server):
    d = tmp_path_factory.mktemp("faults")
    extra = cloud_extra(redis_server.url)
    daemon = Daemon("tandem-cloud", cloud_command(split_dir, d / "kv", extra=extra), d / "cloud.log", d / "ready")
    state = {"daemon": daemon, "gateway": psutil.Process(daemon.proc.pid), "seen": {}, "log": d / "cloud.log"}
    try:
        state["port"] = daemon.wait_ready(300)
        yield state  # a test that restarts the cloud puts the new process in "daemon" and "gateway"
    finally:
        seen = state["seen"]  # every descendant ever seen, killed at the end whatever happens
        try:
            seen.update({c.pid: c for c in state["gateway"].children(recursive=True)})
        except psutil.Error:
            pass
        if state["daemon"].proc.poll() is None:
            state["daemon"].proc.kill()
            state["daemon"].proc.wait()
        _kill_all(seen.values())


def descendants(cloud) -> list:
    kids = cloud["gateway"].children(recursive=True)
    cloud["seen"].update({c.pid: c for c in kids})
    return kids


def engine_cores(cloud) -> list:
    cores = []
    for c in descendants(cloud):
        try:
            if "EngineCore" in _title(c) or "EngineCore" in c.name():
                cores.append(c)
        except psutil.Error:
            pass
    return sorted(cores, key=lambda c: c.create_time())


async def health(port: int, service: str = "") -> int | None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
            return r.status
        except grpc.aio.AioRpcError:
            return None


async def wait_health(port: int, status: int, timeout_s: float) -> float:
    t0 = time.monotonic()
    while await health(port) != status:
        assert time.monotonic() - t0 < timeout_s, f"health not {status} after {timeout_s:.0f} s"
        await asyncio.sleep(0.2)
    return time.monotonic() - t0


async def negotiate(ch: grpc.aio.Channel, manifest) -> pb.NegotiateResponse:
    req = pb.NegotiateRequest(
        edge_id="faults",
        model_id=manifest.model_id,
        head_keys={manifest.split_layer: manifest.compatibility_key()},
    )
    return await pb_grpc.CloudStub(ch).Negotiate(req, timeout=10)


def header(params: pb.LinkParams, **kw) -> pb.Uplink:
    base = dict(
        request_id=uuid.uuid4().hex,
        params_version=params.params_version,
        split_layer=0,
        prompt_token_ids=PROMPT_IDS,
        sampling=pb.SamplingParams(max_new_tokens=4),
    )
    return pb.Uplink(header=pb.RequestHeader(**{**base, **kw}))


async def direct(port: int, manifest) -> tuple[grpc.StatusCode, list[pb.Downlink]]:
    """A direct-mode turn (token ids up); its final status and the messages received."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        params = (await negotiate(ch, manifest)).params
        got: list[pb.Downlink] = []
        try:
            async for m in pb_grpc.CloudStub(ch).Generate(iter([header(params)]), timeout=120):
                got.append(m)
        except grpc.aio.AioRpcError as e:
            return e.code(), got
        return grpc.StatusCode.OK, got


async def test_serving_and_direct_generate(cloud, manifest):
    """A started cloud reports SERVING (overall and for tandem.v1.Cloud), serves a direct Generate to its
    final message, and runs two EngineCore processes."""
    assert await health(cloud["port"]) == SERVING
    assert await health(cloud["port"], "tandem.v1.Cloud") == SERVING
    code, got = await direct(cloud["port"], manifest)
    assert code == grpc.StatusCode.OK
    assert got and got[-1].WhichOneof("msg") == "final" and got[-1].final.output_tokens > 0
    tree = [(p.pid, p.ppid(), _title(p)) for p in descendants(cloud)]
    print("\ncloud process tree (pid, ppid, title):", *tree, sep="\n  ")
    assert len(engine_cores(cloud)) == 2


async def test_client_keepalive_on_a_silent_stream_keeps_the_connection(cloud, manifest):
    """A split turn's header promising one chunk, then nothing, for 8 s while the client pings
    every second: the cloud sends nothing meanwhile (it waits for the upload); gRPC core's
    server defaults would answer the 5th ping or so with GOAWAY too_many_pings."""
    opts = channel_options(1.0, 10.0, 64 << 20)
    release = asyncio.Event()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{cloud['port']}", options=opts) as ch:
        params = (await negotiate(ch, manifest)).params
        assert params.split_layer == manifest.split_layer

        async def uplink() -> AsyncIterator[pb.Uplink]:
            yield header(params, split_layer=params.split_layer, num_chunks=1)
            await release.wait()

        call = pb_grpc.CloudStub(ch).Generate(uplink())
        states = []
        for _ in range(16):
            await asyncio.sleep(0.5)
            states.append(ch.get_state())
        assert not call.done(), "the silent Generate ended early"
        assert grpc.ChannelConnectivity.TRANSIENT_FAILURE not in states, states
        assert (await negotiate(ch, manifest)).params.params_version == params.params_version
        call.cancel()
        release.set()


async def test_dead_engine_is_unavailable_then_restarted(cloud, manifest):
    port = cloud["port"]
    cores = engine_cores(cloud)
    assert len(cores) == 2
    victim = cores[-1]  # started second: the decode engine, which a direct request needs
    victim_kids = victim.children(recursive=True)
    segments = set().union(*(_segments(p) for p in [victim, *victim_kids]))
    assert segments, "the engine maps no shared-memory segments: nothing to check"
    t0 = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)
    detect_s = await wait_health(port, NOT_SERVING, DETECT_S)
    assert await health(port, "tandem.v1.Cloud") == NOT_SERVING
    code, _ = await direct(port, manifest)
    assert code == grpc.StatusCode.UNAVAILABLE, code
    # vLLM's own tie: the dead EngineCore's worker exits with it
    while not all(_gone(p) for p in [victim, *victim_kids]):
        assert time.monotonic() - t0 < DETECT_S, "the killed engine's worker outlived it"
        await asyncio.sleep(0.2)
    restart_s = await wait_health(port, SERVING, RESTART_S)
    code, got = await direct(port, manifest)
    assert code == grpc.StatusCode.OK and got[-1].final.output_tokens > 0
    assert cloud["daemon"].proc.poll() is None
    new_cores = engine_cores(cloud)
    assert len(new_cores) == 2 and victim.pid not in {c.pid for c in new_cores}
    # the dead engine's shared memory went with its replacement, not with the cloud's exit
    assert not [n for n in segments if os.path.exists(f"/dev/shm/{n}")], "a dead engine's shared memory is left"
    print(f"\nNOT_SERVING {detect_s:.1f} s after kill -9; SERVING again {restart_s:.1f} s later")


async def test_kill_9_of_replicas_during_upload_and_during_decode(
    cloud, split_dir, hf_model, tokenizer, redis_server, monkeypatch, tmp_path, caplog
):
    """Real process faults on two replicas: A (this module's cloud,
    behind a link emulator: 20 Mbit/s up, 10 ms RTT, so that its upload takes a while) and B, each
    a ``tandem-cloud`` process with its own engines, one Redis block store; the edge (in this
    process) is configured with both.

    1. Turn 1 of a session whose replica is A: A is killed (``kill -9``, engines and all) once it
       acknowledged keeping part of the upload (``WindowAck.held_tokens``). The turn moves to B,
       which loads the kept prefix from Redis after a sync and receives only the rest.
    2. Turn 2 streams from B; B is killed after 4 tokens. A comes back at its address (the link
       now leads to A2, a fresh ``tandem-cloud`` on the same Redis store, started together with B
       so that the two starts overlap); the turn resumes there from the prompt plus the emitted
       tokens.

    Both turns equal the unsplit reference; the client's stream repeats no token."""
    from tandem import AsyncClient
    from tandem.benchmarks.linkproxy import LinkProxy
    from tandem.benchmarks.links import LinkProfile
    from tandem.edge.config import EdgeConfig
    from tandem.edge.link import uplink
    from tandem.edge.link.replicas import rendezvous
    from tandem.edge.server import create_edge
    from tests.references import LONG, assert_same_or_near_tie, hf_greedy, prompt_ids

    caplog.set_level("INFO", logger="tandem.edge")
    extra = cloud_extra(redis_server.url)
    procs: list[Daemon] = []
    edge, link = None, None
    try:
        for name in ("b", "a2"):
            cmd = cloud_command(split_dir, tmp_path / f"kv-{name}", extra=extra)
            procs.append(Daemon("tandem-cloud", cmd, tmp_path / f"{name}.log", tmp_path / name))
        b, a2 = procs
        proxy = LinkProxy("127.0.0.1", cloud["port"])
        proxy.set_profile(LinkProfile("slow-uplink", rtt_ms=10.0, uplink_mbps=20.0, downlink_mbps=None))
        link = await asyncio.start_server(proxy.handle, "127.0.0.1", 0)
        b_port, a2_port = await asyncio.gather(*(asyncio.to_thread(d.wait_ready, 300) for d in (b, a2)))
        targets = [f"127.0.0.1:{link.sockets[0].getsockname()[1]}", f"127.0.0.1:{b_port}"]
        cfg = EdgeConfig(
            split_dir=split_dir,
            cloud_target=targets[0],
            cloud_replicas=targets[1:],
            host="127.0.0.1",
            port=0,
            local=False,
        )
        edge = await create_edge(cfg)
        t0 = time.monotonic()
        while not all(up for _, up in edge.node.conn.status()):  # both replicas negotiated (A's probe is slow)
            assert time.monotonic() - t0 < 60, edge.node.conn.status()
            await asyncio.sleep(0.2)
        session = next(s for s in (f"kill9-{uuid.uuid4().hex}" for _ in range(64)) if rendezvous(s, targets)[0] == 0)

        acked: dict[str, float] = {}
        real_send_more = uplink._send_more

        def send_more(call, turn, received_bytes):  # runs on every WindowAck the edge gets
            if turn.header.session_id == session and turn.held_tokens > 0 and not acked:
                acked["held"], acked["t"] = turn.held_tokens, time.monotonic()
                kill_tree(cloud["daemon"])  # A dies in the middle of the upload
            return real_send_more(call, turn, received_bytes)

        monkeypatch.setattr(uplink, "_send_more", send_more)
        messages = [{"role": "user", "content": LONG * 2 + "What is this text about?"}]
        async with AsyncClient(f"127.0.0.1:{edge.port}", timeout_s=600) as client:
            one = await client.complete(messages, max_new_tokens=8, session_id=session, mode="split")
            assert acked, "the upload ended before A acknowledged keeping any of it (a longer prompt is needed)"
            ids = prompt_ids(tokenizer, {"messages": messages})
            ref, gaps = hf_greedy(hf_model, ids, 8)
            assert_same_or_near_tie(list(one.output_token_ids), ref, gaps, "turn 1, moved to B mid-upload")
            held, per_token = int(acked["held"]), 576 * 4  # fp32 activations of SmolLM2-135M
            # B received at most what A had not acknowledged (it may hold more: a keep A finished later)
            assert 0 < one.sent_bytes["activations"] <= (len(ids) - held) * per_token + 4096, (held, one.sent_bytes)
            print(
                f"\nturn 1: A killed after acknowledging {held} of {len(ids)} tokens; B got {one.sent_bytes}; "
                f"answer complete {time.monotonic() - acked['t']:.2f} s after the kill"
            )

            monkeypatch.setattr(uplink, "_send_more", real_send_more)
            messages += [{"role": "assistant", "content": one.text}, {"role": "user", "content": "Tell me more."}]
            stream = client.chat(messages, max_new_tokens=40, session_id=session, mode="split", ignore_eos=True)
            text, streamed, restarted = "", 0, None
            async for delta in stream:
                text += delta.text
                streamed += len(delta.token_ids)
                if streamed >= 4 and restarted is None:
                    kill_tree(b)  # B dies in the middle of the decode; A comes back at its address
                    restarted = a2
                    proxy.upstream = ("127.0.0.1", a2_port)
                    cloud.update(daemon=a2, gateway=psutil.Process(a2.proc.pid), port=a2_port)
                    t_back = time.monotonic()
            res = stream.result
            t_done = time.monotonic()
        assert restarted is not None and res.resumes >= 1
        assert res.output_tokens == len(res.output_token_ids) == 40
        assert text == tokenizer.decode(list(res.output_token_ids), skip_special_tokens=True)  # once, in order
        ids = prompt_ids(tokenizer, {"messages": messages})
        ref, gaps = hf_greedy(hf_model, ids, 40)
        got = list(res.output_token_ids)[: len(ref)]  # the reference stops at end-of-sequence; this ignores it
        assert_same_or_near_tie(got, ref, gaps, "turn 2, B killed mid-decode, resumed on the restarted A")
        print(
            f"turn 2: B killed after 4 tokens, A back at its address at once; the turn resumed {res.resumes}x "
            f"and ended {t_done - t_back:.1f} s later; 40 tokens, none repeated"
        )
        trace = [r for r in caplog.records if r.name == "tandem.edge" and r.levelno >= 20]
        print("edge log (the replica moves):", *(f"{r.levelname} {r.getMessage()[:160]}" for r in trace), sep="\n  ")
    finally:
        if edge is not None:
            await edge.stop(0)
        if link is not None:
            link.close()
        if len(procs) == 2 and cloud["daemon"].proc.poll() is not None and procs[1].proc.poll() is None:
            # failed after A's kill, before the hand-over: A2 is the module's cloud from here on
            a2 = procs[1]
            with contextlib.suppress(Exception):  # A2 did not start either: the test's own error stands
                cloud.update(port=a2.wait_ready(300), daemon=a2, gateway=psutil.Process(a2.proc.pid))
        for p in procs:
            if p.proc.poll() is None and p is not cloud["daemon"]:
                kill_tree(p)


async def test_no_engine_process_outlives_the_gateway(cloud):
    kids = descendants(cloud)
    assert len(engine_cores(cloud)) == 2
    t0 = time.monotonic()
    cloud["daemon"].proc.kill()
    cloud["daemon"].proc.wait()
    try:
        while not all(_gone(p) for p in kids):
            left = [(p.pid, _title(p)) for p in kids if not _gone(p)]
            assert time.monotonic() - t0 < DETECT_S, f"outlived the gateway: {left}"
            await asyncio.sleep(0.2)
        print(f"\nall {len(kids)} former children gone {time.monotonic() - t0:.1f} s after kill -9 of the gateway")
    finally:
        _kill_all(kids)
