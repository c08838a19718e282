"""In-memory doubles shared by the unit tests of the gateway and the edge service: a tiny
model shape, a toy tokenizer, and builders wiring ``Gateway`` (with ``MemoryEngines`` and
``MemoryBlockStore``) to ``EdgeNode`` (with ``MemoryHead``) through ``InProcessLink``."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from tandem.cloud.config import CloudConfig, EngineConfig
from tandem.cloud.engines.memory import MemoryEngines
from tandem.cloud.gateway import Gateway
from tandem.cloud.server import build_gateway
from tandem.cloud.sessions.table import CloudSession
from tandem.cloud.store.blocks import MemoryBlockStore
from tandem.cloud.turn import as_principal
from tandem.common.protocol.errors import EngineError
from tandem.common.protocol.limits import RequestLimits
from tandem.common.protocol.params import NegotiateOffer
from tandem.common.runtime.ewma import Ewma
from tandem.common.runtime.security import scoped
from tandem.common.wire import chunks as wire
from tandem.common.wire.messages import TurnHeader, uplink_to_pb
from tandem.edge.compute.batcher import HeadBatcher
from tandem.edge.compute.head import MemoryHead
from tandem.edge.config import EdgeConfig
from tandem.edge.link.base import CloudLink, InProcessLink, TurnCall
from tandem.edge.link.connection import CloudConnection, CloudTarget
from tandem.edge.modes.split_head import Head
from tandem.edge.node import EdgeNode
from tandem.edge.server import build_node
from tandem.edge.session import EdgeSessions

# the toy model, shared with the fuzzing (tests/fuzz)
from tests.toy import HKV, MANIFEST, VOCAB, B, D, H, K, ToyTokenizer, toy_manifest  # noqa: F401


def cloud_config(**kw: Any) -> CloudConfig:
    base: dict[str, Any] = dict(
        split_dir=Path("/nonexistent"), chunk_tokens=16, max_chunk_tokens=16, engine=EngineConfig(block_size_tokens=B)
    )
    return CloudConfig(**{**base, **kw})


def toy_node(
    heads: list[Head],
    cloud: CloudTarget | None,
    sessions: EdgeSessions | None = None,
    turn_timeout_s: float = 30.0,
    pipeline_tokens: int = 0,
    resume_wait_s: float = 120.0,
    prompt_kv: str = "download",
    **node_kw: Any,
) -> EdgeNode:
    """An ``EdgeNode`` of the toy model (``ToyTokenizer``) over ``heads`` and ``cloud``, built as the
    daemon builds one (``edge.server.build_node``); ``sessions`` default 64 sessions of 1 GiB in all;
    ``prompt_kv``: ``EdgeConfig.remote_prefill_prompt_kv`` (default ``download``: the toy's timings
    would make ``auto``'s plan vary from run to run); ``node_kw`` as ``build_node``'s."""
    cfg = EdgeConfig(
        turn_timeout_s=turn_timeout_s,
        pipeline_tokens=pipeline_tokens,
        resume_wait_s=resume_wait_s,
        remote_prefill_prompt_kv=prompt_kv,
    )
    sessions = sessions if sessions is not None else EdgeSessions(64, 1 << 30)
    return build_node(cfg, ToyTokenizer(), heads, cloud, sessions=sessions, **node_kw)


@dataclass
class Toy:
    gateway: Gateway
    engines: MemoryEngines
    store: MemoryBlockStore
    edge: EdgeNode
    batcher: HeadBatcher

    async def another_edge(self, edge_id: str) -> EdgeNode:
        """A second edge ``edge_id`` on this toy's cloud (its own link and negotiation, this
        toy's head batcher): another client whose turns load the same engines."""
        key = MANIFEST.compatibility_key()
        conn = CloudConnection(
            InProcessLink(self.gateway),
            NegotiateOffer(edge_id=edge_id, model_id="toy", head_keys={K: key}, edge_max_batch=4),
            probe_bytes=0,
        )
        await conn.connect()
        return toy_node([Head(self.batcher, key)], conn)

    def cloud_session(self, session_id: str) -> CloudSession | None:
        """The gateway's session ``session_id`` of this toy edge (cloud sessions live in the
        namespace of the edge that made them)."""
        return self.gateway.sessions.get(scoped(as_principal("in-process"), session_id))

    def lose_cloud_sessions(self, stored: bool = True) -> None:
        """The gateway forgets every session (a restart); ``stored``: the block store's session
        records and activation pieces go too (a restart that lost its store)."""
        if stored:
            for key in list(self.gateway.sessions.keys()):
                self.gateway.sync.store.drop(key)
        self.gateway.sessions.clear()


PIPELINE_TOKENS = 32  # the toy edge pipelines its head in pieces of 32 tokens (two 16-token chunks)


async def toy_stack(
    link_wrapper=None,
    edge_session_bytes: int = 1 << 30,
    offer_kw: dict[str, Any] | None = None,
    pipeline_tokens: int = PIPELINE_TOKENS,
    store: Any = None,
    node_kw: dict[str, Any] | None = None,
    **cloud_kw: Any,
) -> Toy:
    """A gateway and an edge service in this event loop, joined by an ``InProcessLink``
    (optionally wrapped, e.g. for fault injection); ``offer_kw`` amends the edge's
    ``NegotiateOffer``; ``pipeline_tokens`` as the edge's (0: the head runs whole before the
    upload); ``store``: the block store (default: a ``MemoryBlockStore``); ``node_kw``: the edge's
    parts as ``edge.server.build_node`` takes them (a local model, ``model_key``). Call
    ``await toy.batcher.stop()`` at the end."""
    store = MemoryBlockStore(1 << 30) if store is None else store
    engines = MemoryEngines(store, B, VOCAB)
    gw = build_gateway(cloud_config(**cloud_kw), MANIFEST, engines, store)
    link: CloudLink = InProcessLink(gw)
    if link_wrapper is not None:
        link = link_wrapper(link)
    key = MANIFEST.compatibility_key()
    conn = CloudConnection(
        link,
        NegotiateOffer(edge_id="e", model_id="toy", head_keys={K: key}, edge_max_batch=4, **(offer_kw or {})),
        probe_bytes=0,
    )
    await conn.connect()  # once; the background loop (polls, reconnects) is not started here
    batcher = HeadBatcher(MemoryHead(K, H, HKV, D), 4)
    batcher.start()
    svc = toy_node(
        [Head(batcher, key)],
        conn,
        EdgeSessions(64, edge_session_bytes),
        pipeline_tokens=pipeline_tokens,
        **(node_kw or {}),
    )
    return Toy(gw, engines, store, svc, batcher)


class TamperLink:
    """Wraps a ``CloudLink``: every uplink item passes through ``fn(item, attempt)`` (attempt counts
    sends of the same chunk seq / leaf index from 1) before it is sent."""

    def __init__(self, inner: CloudLink, fn) -> None:
        self.inner, self.fn = inner, fn
        self.attempts: dict[tuple[str, int], int] = {}

    async def negotiate(self, offer):
        return await self.inner.negotiate(offer)

    async def server_info(self, link_id, padding_bytes=0, timeout_s=5.0):
        return await self.inner.server_info(link_id, padding_bytes, timeout_s)

    def open(self, timeout_s):
        return _TamperCall(self.inner.open(timeout_s), self)

    async def sync_session(self, req, timeout_s=5.0):
        self.syncs = getattr(self, "syncs", 0) + 1
        return await self.inner.sync_session(req, timeout_s)

    async def end_session(self, session_id, timeout_s=5.0):
        return await self.inner.end_session(session_id, timeout_s)

    async def close(self) -> None:
        await self.inner.close()


class _TamperCall:
    def __init__(self, inner: TurnCall, link: TamperLink) -> None:
        self.inner, self.link = inner, link

    def send(self, item) -> int:
        key = (type(item).__name__, getattr(item, "seq", getattr(item, "leaf_index", -1)))
        n = self.link.attempts[key] = self.link.attempts.get(key, 0) + 1
        return self.inner.send(self.link.fn(item, n))

    def close_send(self) -> None:
        self.inner.close_send()

    def events(self):
        return self.inner.events()

    def cancel(self) -> None:
        self.inner.cancel()


class GatedLink:
    """Wraps a ``CloudLink``: each turn's uplink after its header waits for ``gate`` (an
    ``asyncio.Event``), so that many turns are admitted and in flight on the cloud at once. With
    ``cut`` set when the gate opens, the held uplinks are closed instead (the upload fails)."""

    def __init__(self, inner: CloudLink, gate: asyncio.Event) -> None:
        self.inner, self.gate, self.cut = inner, gate, False

    async def negotiate(self, offer):
        return await self.inner.negotiate(offer)

    async def server_info(self, link_id, padding_bytes=0, timeout_s=5.0):
        return await self.inner.server_info(link_id, padding_bytes, timeout_s)

    def open(self, timeout_s):
        return _GatedCall(self.inner.open(timeout_s), self)

    async def sync_session(self, req, timeout_s=5.0):
        return await self.inner.sync_session(req, timeout_s)

    async def end_session(self, session_id, timeout_s=5.0):
        return await self.inner.end_session(session_id, timeout_s)

    async def close(self) -> None:
        await self.inner.close()


class _GatedCall:
    def __init__(self, inner: TurnCall, link: GatedLink) -> None:
        self.inner, self.link = inner, link
        self.held: list[Any] = []  # items waiting for the gate, in order (None: close_send)
        self.flusher: asyncio.Task | None = None

    def _hold(self, item: Any) -> None:
        self.held.append(item)
        if self.flusher is None:
            self.flusher = asyncio.create_task(self._flush())

    async def _flush(self) -> None:
        await self.link.gate.wait()
        if self.link.cut:
            self.inner.close_send()
        else:
            for item in self.held:
                self.inner.close_send() if item is None else self.inner.send(item)
        self.held.clear()

    def send(self, item) -> int:
        if isinstance(item, TurnHeader) or (self.link.gate.is_set() and not self.held):
            return self.inner.send(item)
        self._hold(item)
        return uplink_to_pb(item).ByteSize()

    def close_send(self) -> None:
        if self.link.gate.is_set() and not self.held:
            self.inner.close_send()
        else:
            self._hold(None)

    def events(self):
        return self.inner.events()

    def cancel(self) -> None:
        self.inner.cancel()


def rechunk(chunk, h):
    """``chunk`` carrying other activations float32 ``[n, H]`` (fp32, CRC recomputed: it arrives intact)."""
    payload = np.ascontiguousarray(h, np.float32).tobytes()
    return replace(chunk, payload=payload, raw_nbytes=len(payload), crc32c=wire.crc32c(payload))


class MemoryLocal:
    """The in-memory double of ``edge.compute.local.LocalEngine`` (local mode) for service unit tests:
    ``tokens(n)`` whatever the prompt, no sessions kept; it refuses what ``LocalEngine`` refuses
    for the toy model (``limits``: its vocabulary and positions)."""

    def __init__(
        self, prefill_ms_per_token: float = 0.01, decode_ms_per_token: float = 0.1, shape: Any = MANIFEST.shape
    ) -> None:
        """The rates it starts with (as measured at warm-up); each run measures 0.01 ms per token."""
        self.prefill_rate, self.decode_rate, self.active = Ewma(), Ewma(), 0
        self.pending_prefill_tokens = self.pending_prefills = 0  # its runs never queue
        self.prefill_rate.add(prefill_ms_per_token)
        self.decode_rate.add(decode_ms_per_token)
        self.calls: list[list[int]] = []
        self.limits = RequestLimits(vocab_size=shape.vocab_size, max_model_len_tokens=shape.max_position_embeddings)
        self.ended: list[str] = []  # session ids ended (``end_session``)

    @staticmethod
    def tokens(n: int) -> tuple[int, ...]:
        return tuple(10 + i for i in range(n))

    def cached_tokens(self, session_id: str, prompt_ids) -> int:
        return 0

    async def end_session(self, session_id: str) -> bool:
        self.ended.append(session_id)
        return False

    def session_expired(self, session_id: str) -> bool:
        return False  # it keeps no sessions

    async def generate(self, prompt_ids, sampling, session_id: str = "", *, prompt_param: str = "prompt"):
        from tandem.edge.compute.local import LocalToken

        self.limits.check(prompt_ids, sampling, prompt_param)
        self.calls.append(list(prompt_ids))
        self.prefill_rate.add(0.01)  # what it measures, as LocalEngine does on each run
        toks = self.tokens(sampling.max_new_tokens)
        for i, t in enumerate(toks):
            await asyncio.sleep(0)
            yield LocalToken(t, "length" if i == len(toks) - 1 else None)


class Down(TamperLink):
    """A replica link that can be cut: every call fails as with a dead host."""

    down = False

    def _check(self) -> None:
        if self.down:
            raise EngineError("connection refused")

    async def negotiate(self, offer):
        self._check()
        return await self.inner.negotiate(offer)

    async def server_info(self, link_id, padding_bytes=0, timeout_s=5.0):
        self._check()
        return await self.inner.server_info(link_id, padding_bytes, timeout_s)

    async def sync_session(self, req, timeout_s=5.0):
        self._check()
        return await self.inner.sync_session(req, timeout_s)

    def open(self, timeout_s):
        self._check()
        return super().open(timeout_s)


class FakeClock:
    """A settable monotonic clock (seconds) for the link table's tests."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def settle() -> None:
    """Let the event loop run the callbacks and tasks that are ready (a few passes)."""
    for _ in range(10):
        await asyncio.sleep(0)
