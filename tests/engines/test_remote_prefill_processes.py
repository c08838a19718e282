"""Remote prefill's faults with real processes: one ``tandem-cloud`` (vLLM engines) and one
``tandem-edge`` (ONNX Runtime) as child processes, joined by a link emulator in this process
(``benchmarks.linkproxy.LinkProxy`` in a thread of its own, reading the link's HTTP/2 frames and
gRPC messages), the client the SDK. In order, sharing the processes:

1. A downlink KV block corrupted on the wire (one bit of its payload): the edge asks for it again,
   never uses the bad copy, takes over; the reply equals direct mode's.
2. The link reset as the second KV block comes down: the reply completes, equal to direct mode's,
   every token streamed once.
3. ``tandem-bench exactness``'s smoke: two chats and a two-turn session in the three modes.
4. The edge killed (``kill -9``) as its takeover goes up, then started again: the next turn of the
   session resyncs (every block of its prompt comes down, nothing goes up but the header) and
   equals direct mode's.
5. The cloud killed (``kill -9``, engines and all) as the takeover goes up: the reply completes
   on the edge, equal to direct mode's.

fp32 on the wire and in the engines: every reply is compared token for token. Time bounds are
correctness bounds (startup), not performance."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
import uuid

import pytest

from tandem.benchmarks.linkproxy import CutLink, GrpcMessage, LinkProxy, Tap
from tandem.daemons import Daemon, cloud_command, edge_command
from tests.references import LONG

psutil = pytest.importorskip("psutil")
pytestmark = [pytest.mark.engines]

KV_BLOCK_DOWN_TAG = 8 << 3 | 2  # Downlink.kv_block: field 8, length-delimited
TAKEOVER_TAG = 6 << 3 | 2  # Uplink.takeover: field 6, length-delimited
FP32 = ["--wire-dtypes", "fp32", "--kv-wire-dtypes", "fp32"]
MAX_NEW = 48
START_S = 1200.0  # engines start in a minute or two each, and in up to ten on a 2-core box shared with others
FIRST = [{"role": "user", "content": LONG + "Summarise this text in two sentences."}]


class KVBlocksDown(Tap):
    """Counts the KV blocks coming down (``KVBlockDown`` messages, resends included, from 1);
    ``corrupt``: flip one bit in the middle of that one's payload; ``cut``: reset the link as that
    one begins."""

    def __init__(self, corrupt: int = 0, cut: int = 0) -> None:
        self.corrupt, self.cut = corrupt, cut
        self.seen: list[tuple[int, int]] = []
        self.corrupted = 0

    def data(self, up: bool, msg: GrpcMessage, offset: int, body: memoryview) -> None:
        if up or msg.tag != KV_BLOCK_DOWN_TAG:
            return
        if offset == 0:
            self.seen.append((msg.stream_id, msg.index))
            if len(self.seen) == self.cut:
                raise CutLink
        mid = msg.length // 2  # the payload is nearly all of a block's message
        if len(self.seen) == self.corrupt and offset <= mid < offset + len(body):
            body[mid - offset] ^= 0x10
            self.corrupted += 1


class OnTakeover(Tap):
    """Runs ``action`` as the edge's ``Takeover`` goes up; ``cut``: it never arrives (reset)."""

    def __init__(self, action, cut: bool) -> None:
        self.action, self.cut, self.fired = action, cut, 0

    def data(self, up: bool, msg: GrpcMessage, offset: int, body: memoryview) -> None:
        if up and msg.tag == TAKEOVER_TAG and offset == 0 and not self.fired:
            self.fired += 1
            self.action()
            if self.cut:
                raise CutLink


def kill_tree(daemon: Daemon) -> None:
    """``kill -9`` of a daemon and of its children (a cloud's engines)."""
    try:
        kids = psutil.Process(daemon.proc.pid).children(recursive=True)
    except psutil.Error:
        kids = []
    daemon.proc.kill()
    daemon.proc.wait()
    for k in kids:
        try:
            k.kill()
        except psutil.Error:
            pass


async def edge_ready(port: int, timeout_s: float = START_S) -> None:
    """Until the edge at ``port`` serves remote prefill (its link to the cloud negotiated)."""
    from tandem import AsyncClient

    t0 = time.monotonic()
    async with AsyncClient(f"127.0.0.1:{port}") as c:
        while True:
            try:
                info = await c.info()
                if info.cloud_connected and "remote_prefill" in info.modes and "local" in info.modes:
                    return
            except Exception:  # noqa: BLE001 - not serving yet
                pass
            assert time.monotonic() - t0 < timeout_s, "the edge never served remote prefill"
            await asyncio.sleep(0.5)


class LinkThread:
    """``proxy`` serving on a port of 127.0.0.1 from its own thread and event loop, so that the
    link moves while this test's loop is busy (loading a tokenizer, say)."""

    def __init__(self, proxy: LinkProxy) -> None:
        self.proxy = proxy
        self.loop = asyncio.new_event_loop()
        port: concurrent.futures.Future[int] = concurrent.futures.Future()
        self.thread = threading.Thread(target=self._run, args=(port,), name="link-emulator", daemon=True)
        self.thread.start()
        self.port = port.result(10)

    def _run(self, port: concurrent.futures.Future[int]) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self.proxy.handle, "127.0.0.1", 0))
        port.set_result(server.sockets[0].getsockname()[1])
        self.loop.run_forever()
        server.close()
        tasks = asyncio.all_tasks(self.loop)
        for t in tasks:
            t.cancel()
        self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self.loop.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
async def pd(split_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("pd-faults")
    proxy = LinkProxy("127.0.0.1", 0, h2=True)  # its upstream is set once the cloud serves
    link = LinkThread(proxy)
    target = f"127.0.0.1:{link.port}"
    extra = ["--kv-cache-bytes", str(256 << 20), "--max-num-seqs", "4", *FP32]
    cloud = Daemon("tandem-cloud", cloud_command(split_dir, d / "kv", extra=extra), d / "cloud.log", d / "cloud.port")

    def start_edge(name: str) -> Daemon:
        # every block comes down: the faults below are the downlink's
        cmd = edge_command(split_dir, target, extra=[*FP32, "--remote-prefill-prompt-kv", "download"])
        return Daemon("tandem-edge", cmd, d / f"{name}.log", d / f"{name}.port")

    st = {"proxy": proxy, "cloud": cloud, "edge": start_edge("edge"), "start_edge": start_edge, "dir": d}
    try:
        proxy.upstream = ("127.0.0.1", await asyncio.to_thread(cloud.wait_ready, START_S))
        st["port"] = await asyncio.to_thread(st["edge"].wait_ready, START_S)
        await edge_ready(st["port"])
        yield st
    finally:
        proxy.tap = None
        for dm in (st["edge"], cloud):
            if dm.proc.poll() is None:
                kill_tree(dm)
        link.stop()


async def chat(port: int, messages: list[dict], mode: str, session: str = ""):
    """One turn through the SDK; its ``ChatResult``. Every token streamed once, in order (a last
    end-of-sequence token has no text)."""
    from tandem import AsyncClient

    async with AsyncClient(f"127.0.0.1:{port}", timeout_s=300) as c:
        s = c.chat(messages, max_new_tokens=MAX_NEW, mode=mode, session_id=session)
        streamed: list[int] = []
        async for delta in s:
            streamed += delta.token_ids
        r = s.result
    out = list(r.output_token_ids)
    assert streamed == out[: len(streamed)] and len(out) - len(streamed) <= 1, (streamed, out)
    return r


def log_has(path, text: str) -> bool:
    return text in path.read_text(errors="replace")


async def test_a_corrupt_downlink_block_is_asked_again_and_never_used(pd):
    direct = await chat(pd["port"], FIRST, "direct")
    pd["proxy"].tap = tap = KVBlocksDown(corrupt=2)
    try:
        r = await chat(pd["port"], FIRST, "remote_prefill")
    finally:
        pd["proxy"].tap = None
    assert tap.corrupted == 1 and r.mode == "remote_prefill"
    assert r.output_token_ids == direct.output_token_ids and r.edge_decoded_tokens > 0
    assert log_has(pd["dir"] / "edge.log", "asking for it again")
    assert log_has(pd["dir"] / "cloud.log", "the edge asked for KV block 1 again")
    n = len(tap.seen)
    print(f"\n{n} KV block messages came down for {r.prompt_tokens} prompt tokens (one resent); {r.received_bytes}")


async def test_a_downlink_reset_mid_kv_still_completes_the_reply(pd):
    direct = await chat(pd["port"], FIRST, "direct")
    pd["proxy"].tap = tap = KVBlocksDown(cut=2)
    try:
        r = await chat(pd["port"], FIRST, "remote_prefill")
    finally:
        pd["proxy"].tap = None
    assert len(tap.seen) >= 2
    assert r.output_token_ids == direct.output_token_ids and r.output_tokens == direct.output_tokens
    print(
        f"\nlink reset at the 2nd KV block: {r.edge_decoded_tokens} tokens decoded on the edge, "
        f"{r.resumes} resumes, {r.received_bytes} received; finish {r.finish_reason}"
    )
    await edge_ready(pd["port"])


async def test_the_exactness_benchmark_counts_replies_equal_in_the_three_modes(pd, tokenizer):
    """``tandem-bench exactness``'s runs on two chats of its set and one two-turn session."""
    from tandem.benchmarks import exactness
    from tandem.benchmarks.fidelity import load_prompts

    prompts = load_prompts(exactness.PROMPTS, 2)
    chats = await exactness.run_chats(pd["port"], prompts, 16)
    sessions = await exactness.run_sessions(pd["port"], prompts[:1], 2, 16, tokenizer)
    c = exactness.count(chats, sessions)
    assert (c.chats, c.sessions, c.session_turns) == (2, 1, 2)
    assert c.equal == 2 and c.turns_equal == 2 and c.sessions_equal == 1, c.differing
    assert all(r.token_ids for per_mode in chats.values() for r in per_mode.values())
    print("\n" + exactness.table(c, "tandem-bench exactness --limit 2 --chats 1 --turns 2", 16, 2))


async def test_an_edge_killed_after_the_switch_resyncs_its_session_on_the_next_turn(pd, tokenizer):
    from tandem import TandemClientError

    session = f"pd-{uuid.uuid4().hex}"
    first_direct = await chat(pd["port"], FIRST, "direct")
    edge = pd["edge"]
    pd["proxy"].tap = tap = OnTakeover(edge.proc.kill, cut=False)
    try:
        with pytest.raises(TandemClientError):
            await chat(pd["port"], FIRST, "remote_prefill", session)
    finally:
        pd["proxy"].tap = None
    assert tap.fired == 1
    edge.proc.wait()
    pd["edge"] = pd["start_edge"]("edge2")
    pd["port"] = await asyncio.to_thread(pd["edge"].wait_ready, START_S)
    await edge_ready(pd["port"])
    answer = tokenizer.decode(list(first_direct.output_token_ids), skip_special_tokens=True)
    second = [*FIRST, {"role": "assistant", "content": answer}, {"role": "user", "content": "Now in one sentence."}]
    direct = await chat(pd["port"], second, "direct")
    r = await chat(pd["port"], second, "remote_prefill", session)
    assert r.output_token_ids == direct.output_token_ids and r.edge_decoded_tokens > 0
    assert r.sent_bytes.get("kv", 0) == r.sent_bytes.get("activations", 0) == 0  # nothing up but the header
    fresh = await chat(pd["port"], second, "remote_prefill", f"pd-{uuid.uuid4().hex}")
    assert r.received_bytes == fresh.received_bytes and r.received_bytes["kv"] > 0  # every block came down
    print(f"\nedge restarted: turn 2 brought down {r.received_bytes} for {r.prompt_tokens} prompt tokens")


async def test_a_cloud_killed_after_the_switch_leaves_the_reply_to_the_edge(pd):
    direct = await chat(pd["port"], FIRST, "direct")
    pd["proxy"].tap = tap = OnTakeover(lambda: kill_tree(pd["cloud"]), cut=True)
    try:
        r = await chat(pd["port"], FIRST, "remote_prefill")
    finally:
        pd["proxy"].tap = None
    assert tap.fired == 1 and pd["cloud"].proc.poll() is not None
    assert r.output_token_ids == direct.output_token_ids and r.edge_decoded_tokens > 0 and r.resumes == 0
    print(f"\ncloud killed at the takeover: the edge decoded {r.edge_decoded_tokens} of {r.output_tokens} tokens")
