"""Helpers shared by the test tiers (no tests here): the repository root and the prepared model's
paths, a real ``redis-server`` on a free port, turns and conversations to send, the calls that drive
an edge's turn to its end, what crosses the uplink, and a gateway behind real grpc.aio on loopback
with edges connected to it (the in-memory doubles of ``tests/doubles.py``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from tandem import AsyncClient
from tandem.common.protocol.modes import Mode
from tandem.common.protocol.params import Sampling
from tandem.common.wire import chunks as wire
from tandem.common.wire.messages import KVBlock
from tandem.edge.events import ChatTurn, TextOut, TurnDone

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = Path(os.environ.get("TANDEM_MODEL_DIR", ROOT / "models" / "smollm2-135m"))
SPLIT_DIR = MODEL_DIR / "split-k4"
TANDEM_BENCH = str(Path(sys.executable).parent / "tandem-bench")  # the installed benchmarks command

LONG = "The quick brown fox jumps over the lazy dog, again and again, " * 3  # ~200 tokens
LONG_UPLOAD = "Tell me everything about the history of bridges, arches and the Romans. " * 6  # ~440 tokens, 28 chunks
TIERS = ("unit", "inprocess", "engines", "install", "gpu", "fuzz")  # the folders of tests/, one marker each


def tier_of(path: Path) -> str | None:
    """The tier of the test file at ``path``: the folder of ``tests/`` it lies in, or None (``tests/``
    itself, or a folder that is no tier)."""
    try:
        parts = path.resolve().relative_to(ROOT / "tests").parts
    except ValueError:
        return None
    return parts[0] if len(parts) > 1 and parts[0] in TIERS else None


RP_LONG = "the quick brown fox jumps over the lazy dog and runs far away into the woods " * 3  # 7 toy KV blocks


# ------------------------------------------------------------------ turns


def turn(text: str, session: str = "", n: int = 8, **kw: Any) -> ChatTurn:
    """One user message in split mode (``mode=`` and other ``ChatTurn`` fields override), ``n`` new tokens."""
    return ChatTurn(
        messages=(("user", text),),
        prompt="",
        session_id=session,
        sampling=Sampling(max_new_tokens=n),
        **{"mode": Mode.SPLIT, **kw},
    )


def chat(*msgs: str, session: str = "", n: int = 8, **kw: Any) -> ChatTurn:
    """A conversation alternating user / assistant messages, ending with a user message (split mode)."""
    convo = tuple(("user" if i % 2 == 0 else "assistant", m) for i, m in enumerate(msgs))
    return ChatTurn(
        messages=convo, prompt="", session_id=session, sampling=Sampling(max_new_tokens=n), **{"mode": Mode.SPLIT, **kw}
    )


def rp_turn(text: str, mode: Mode, n: int = 40, session: str = "", **sampling: Any) -> ChatTurn:
    """One user message in ``mode`` with ``n`` new tokens (the remote-prefill tests' default: 40)."""
    return ChatTurn(
        messages=(("user", text),),
        prompt="",
        session_id=session,
        sampling=Sampling(max_new_tokens=n, **sampling),
        mode=mode,
    )


def rp_chat(*msgs: str, session: str, n: int = 40) -> ChatTurn:
    """A conversation (alternating user / assistant) in remote-prefill mode."""
    convo = tuple(("user" if i % 2 == 0 else "assistant", m) for i, m in enumerate(msgs))
    return ChatTurn(
        messages=convo, prompt="", session_id=session, sampling=Sampling(max_new_tokens=n), mode=Mode.REMOTE_PREFILL
    )


async def run(edge: Any, t: ChatTurn, timeout_s: float | None = None) -> TurnDone:
    """Drive ``edge.chat`` (an ``EdgeNode`` or anything with its ``chat``) to its end; the ``TurnDone``."""
    done = None
    async for ev in edge.chat(t, timeout_s):
        if isinstance(ev, TurnDone):
            done = ev
    assert done is not None
    return done


async def stream(edge: Any, t: ChatTurn) -> tuple[list[int], TurnDone]:
    """The token ids ``edge.chat`` streamed to the client, in order, and the turn's ``TurnDone``."""
    streamed: list[int] = []
    done = None
    async for ev in edge.chat(t):
        if isinstance(ev, TextOut):
            streamed += ev.token_ids
        else:
            done = ev
    assert isinstance(done, TurnDone)
    return streamed, done


class SplitClient(AsyncClient):
    """The SDK client with ``mode="split"`` at ``k = 4`` by default (the engines tier's split tests;
    a test of another mode or of ``k = 8`` asks for it)."""

    def chat(self, messages=None, **kw):
        kw.setdefault("mode", "split")
        if kw["mode"] == "split":
            kw.setdefault("split_layer", 4)  # the primary split; tests of k = 8 ask for it
        return super().chat(messages, **kw)


class Sent:
    """A ``TamperLink`` hook recording what crosses the uplink: the token ranges of activation chunks
    and the KV leaves, passing every item through unchanged."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.leaves: list[int] = []

    def __call__(self, item: Any, attempt: int) -> Any:
        if isinstance(item, wire.Chunk):
            self.tokens += range(item.token_offset, item.token_offset + item.num_tokens)
        elif isinstance(item, KVBlock):
            self.leaves.append(item.leaf_index)
        return item

    def take(self) -> tuple[list[int], list[int]]:
        out = (self.tokens, self.leaves)
        self.tokens, self.leaves = [], []
        return out


# ------------------------------------------------------------------ a gateway over real gRPC


class Cloud:
    """The toy gateway (``MemoryEngines``, ``MemoryBlockStore``) on a grpc.aio server on loopback that
    can be restarted on the same port, keeping its store; ``cfg`` overrides ``cloud_config``."""

    def __init__(self, **cfg: Any) -> None:
        from tandem.cloud.engines.memory import MemoryEngines
        from tandem.cloud.store.blocks import MemoryBlockStore
        from tests.doubles import VOCAB, B, cloud_config

        self.store = MemoryBlockStore(1 << 30)
        self.engines = MemoryEngines(self.store, B, VOCAB)
        self.cfg = cloud_config(**cfg)
        self.port = 0

    async def start(self) -> None:
        from tandem.cloud.server import build_gateway
        from tandem.cloud.service import CloudServicer
        from tandem.common.runtime.grpc_setup import add_service, start_server
        from tests.doubles import MANIFEST

        self.gateway = build_gateway(self.cfg, MANIFEST, self.engines, self.store)
        servicer = CloudServicer(self.gateway, "toy-cloud")
        self.server, self.port, self.health = await start_server(
            [lambda s: add_service(s, servicer, "Cloud")],
            ["tandem.v1.Cloud"],
            "127.0.0.1",
            self.port,
            self.gateway.registry.max_message_bytes(),
        )

    async def stop(self) -> None:
        await self.server.stop(0)


async def edge_to(target: str, keepalive_s: float = 5.0, **node_kw: Any) -> Any:
    """A toy ``EdgeNode`` over a real gRPC link to ``target``, its connection loop running (reconnects,
    renegotiates); ``node_kw`` as ``edge.server.build_node``'s."""
    from tandem.edge.link.grpc_link import GrpcCloudLink

    return await edge_over(GrpcCloudLink(target, keepalive_s, keepalive_s), **node_kw)


async def edge_over(link: Any, edge_id: str = "e", **node_kw: Any) -> Any:
    """A toy ``EdgeNode`` over ``link`` (a ``GrpcCloudLink``, e.g. with TLS and a key), connected;
    ``node_kw`` as ``edge.server.build_node``'s."""
    from tandem.common.protocol.params import NegotiateOffer
    from tandem.edge.compute.batcher import HeadBatcher
    from tandem.edge.compute.head import MemoryHead
    from tandem.edge.link.connection import CloudConnection
    from tandem.edge.modes.split_head import Head
    from tests.doubles import HKV, MANIFEST, D, H, K, toy_node

    key = MANIFEST.compatibility_key()
    conn = CloudConnection(
        link,
        NegotiateOffer(edge_id=edge_id, model_id="toy", head_keys={K: key}, edge_max_batch=4),
        poll_s=0.5,
        backoff_s=0.1,
    )
    conn.start()
    assert await conn.wait_connected(10), conn.last_error
    batcher = HeadBatcher(MemoryHead(K, H, HKV, D), 4)
    batcher.start()
    return toy_node([Head(batcher, key)], conn, **node_kw)


async def close_edge(edge: Any) -> None:
    """Stop an edge of ``edge_to`` / ``edge_over``: its head batcher, connection loop and link."""
    await edge.batcher.stop()
    assert edge.conn is not None
    await edge.conn.stop()
    await edge.conn.link.close()


# ------------------------------------------------------------------ redis


class RedisServer:
    """A real redis-server (Debian's package, installed by ``make test``) on a free loopback port,
    without persistence; ``url`` names database 0."""

    def __init__(self, directory: Path, maxmemory_bytes: int = 0, password: str = "") -> None:
        import shutil
        import socket
        import subprocess
        import time

        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed: `make test` (or `make redis-server`) installs it")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", str(directory)]
        if password:
            args += ["--requirepass", password]
        if maxmemory_bytes:
            args += ["--maxmemory", str(maxmemory_bytes), "--maxmemory-policy", "allkeys-lru"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
