"""Remote prefill on the cloud: one turn whose prompt the decode engine prefills from token ids,
whose tokens stream as in direct mode, and whose prompt KV (every layer of its full blocks) goes
down the same call so that the edge can take the decode over.

``RemotePrefills.run`` reads like the data path: pin the prompt's blocks -> the decode engine
prefills with the connector loading the session's blocks already stored and saving the others
(``KVTransferSpec`` with one part, layers ``[0, L)``; a stateless turn whose edge asks for no
block, having computed the prompt itself, is a plain request that keeps nothing) -> tokens go
down as they come -> after the
first token, the blocks the edge lacks go down in order, each as soon as the engine's write of it
landed in the store (``Pins.await_prefix``), framed by the one KV-block codec
(``common.wire.kvcodec.encode_block``, as the edge's uplink frames its head blocks), within a window
the edge's ``KVDownAck``s move and that shrinks while their delays show the blocks queueing ahead of
the reply's tokens (``common.wire.flow.DelayBoundWindow``, ``KV_DOWN_QUEUE_TARGET_MS``), then the
commit (their Merkle root) -> on the edge's ``Takeover`` the engine request is aborted (vLLM frees
its KV slots) once the client has the takeover's ``output_tokens`` tokens (an edge that computed
the prompt itself may take over before the first token: the cloud then stops right after it), the
tokens decoded past the edge's position follow, then a ``Final`` with finish reason ``handover``. A
decode that ends first ends the turn as in direct mode, and a downlink that is cut or slow only
means the edge never takes over.

Block ids (what the edge verifies) are chained over the prompt's token ids from the whole model's
key and the request's scope; store keys chain the same ids from a seed in the caller's namespace,
so one edge's blocks are never another's cache hit. A session's blocks stay in the store for its
next turns (the engine loads them, ``Pins`` holds them until the edge acknowledged them); a
stateless turn's are dropped at its end. No grpc here.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from tandem.cloud.engine_calls import EngineCalls
from tandem.cloud.engines.kvparams import KVTransferSpec, PartSpec
from tandem.cloud.links.table import Ticket
from tandem.cloud.splits import Splits
from tandem.cloud.store.blocks import BlockStore
from tandem.cloud.turn import Turn, UplinkBody
from tandem.cloud.uploads.pins import Pins
from tandem.common.protocol.errors import InvalidRequest
from tandem.common.wire import chunks as wire
from tandem.common.wire import merkle
from tandem.common.wire.flow import DelayBoundWindow
from tandem.common.wire.kvblocks import LayerRange, block_hashes, hash_seed, kv_scope
from tandem.common.wire.kvcodec import BlockSpec, Commit, KVBlock, encode_block
from tandem.common.wire.kvdown import HANDOVER, KVDownAck, Takeover, down_spec, full_model_key
from tandem.common.wire.messages import DownEvent, TokensOut, TurnFinal
from tandem.stages import Stage

log = logging.getLogger("tandem.cloud")
WINDOW_BLOCKS = 4  # the downlink window holds at least this many blocks (a link's window counts uplink items)
# the queueing delay the KV going down may add ahead of the reply's tokens in the same stream: about
# ten of the cloud's decode steps (1.5 ms a token for SmolLM2 on an H100); LEDBAT's 100 ms (RFC 6817)
# is for bulk traffic beside interactive flows on other connections, not in the same stream
KV_DOWN_QUEUE_TARGET_MS = 20.0
KEPT_LINK_WINDOWS = 4096  # links whose last downlink window is kept for their next turn (least recent go)


def check_remote_prefill(turn: Turn, kv_dtypes: tuple[wire.WireDtype, ...]) -> None:
    """Raises InvalidRequest for a remote-prefill header that is not direct-shaped, holds more than
    the prompt, or runs on a link whose KV format this cloud does not allow."""
    h, p = turn.header, turn.link_params
    rp = h.remote_prefill
    if rp is None:
        raise InvalidRequest("not a remote-prefill turn")
    if h.split_layer or h.num_chunks or h.num_kv_blocks or h.cached_tokens:
        raise InvalidRequest("remote prefill sends token ids only: split layer 0, no chunks, blocks or cached tokens")
    if rp.held_tokens > len(h.prompt_token_ids):
        raise InvalidRequest(f"held_tokens {rp.held_tokens} > prompt length {len(h.prompt_token_ids)}")
    if p.kv_wire_dtype not in kv_dtypes:
        raise InvalidRequest(f"this cloud sends KV blocks in {[d.name for d in kv_dtypes]}, not {p.kv_wire_dtype.name}")


@dataclass
class _Window:
    """Flow control of the blocks going down (``DelayBoundWindow``: payload bytes sent, each block
    once, and acknowledged, the window shrunk while the acks' delays show a queue), awaited by the
    sender."""

    flow: DelayBoundWindow
    moved: asyncio.Event = field(default_factory=asyncio.Event)

    async def send(self, n: int) -> None:
        """Wait until ``n`` more bytes fit (or nothing is in flight), and count them sent."""
        while not self.flow.fits(n):
            self.moved.clear()
            await self.moved.wait()
        self.flow.sent_at(n, time.perf_counter() * 1e3)

    def ack(self, received_bytes: int) -> None:
        self.flow.ack_at(received_bytes, time.perf_counter() * 1e3)
        self.moved.set()


@dataclass
class _Blocks:
    """One turn's blocks: what the edge expects of them (``want``: their ids, the first it lacks,
    layers and format), content keys in the caller's namespace and store keys, what was sent and
    resent."""

    want: BlockSpec
    content: list[bytes]
    keys: list[str]
    sent: dict[int, KVBlock] = field(default_factory=dict)
    resends: dict[int, int] = field(default_factory=dict)

    @property
    def first(self) -> int:
        """The first block the edge lacks."""
        return self.want.first

    @property
    def spec(self) -> KVTransferSpec:
        """Load the blocks the store holds, save the others: one part, every layer."""
        part = PartSpec(self.want.layers, tuple(self.content))
        return KVTransferSpec(loads=(part,), save=part)


class RemotePrefills:
    """The remote-prefill turns of one node. ``calls``: the engine calls the gateway's modes make
    too (the decode's token stream, the final message); ``max_resends`` bounds the resends of one
    block."""

    def __init__(self, splits: Splits, pins: Pins, store: BlockStore, calls: EngineCalls, max_resends: int) -> None:
        self.splits, self.pins, self.store, self.calls = splits, pins, store, calls
        self.max_resends = max_resends
        self.model_key = full_model_key(splits.primary)
        # per caller and link: the window its last downlink ended with
        self._link_windows: OrderedDict[tuple[str, str], int] = OrderedDict()

    def _blocks(self, turn: Turn) -> _Blocks:
        h, p = turn.header, turn.link_params
        ids, bs, shape = list(h.prompt_token_ids), p.kv_block_size_tokens, self.splits.primary.shape
        layers = LayerRange(lo=0, hi=shape.num_layers)
        scope = f"{turn.caller.tag}|full|{kv_scope(h.session_id, h.request_id)}"
        content = block_hashes(ids, bs, hash_seed(self.model_key, bs, scope))
        keys = [PartSpec(layers, tuple(content)).store_key(j) for j in range(len(content))]
        first = min((h.remote_prefill.held_tokens if h.remote_prefill else 0) // bs, len(content))
        want = down_spec(ids, first, self.model_key, h.session_id, h.request_id, shape, p, h.params_version)
        return _Blocks(want, content, keys)

    async def run(
        self, turn: Turn, uplink: AsyncIterator[UplinkBody], ticket: Ticket
    ) -> AsyncGenerator[DownEvent, None]:
        """The turn (see module doc): yields tokens, KV blocks, the commit and a ``Final``.

        Raises:
            InvalidRequest: an uplink item other than ``KVDownAck`` or ``Takeover``, or an ack of
                blocks never sent. What the decode raises (EngineError, DeadlineExceeded).
        """
        blocks = self._blocks(turn)
        # a stateless turn that asks for no block keeps no KV here: a plain request, as direct's
        spec = blocks.spec if blocks.want.indices or turn.session_key else None
        if spec is not None:
            await self.pins.pin(turn, blocks.keys)
        q: asyncio.Queue = asyncio.Queue()
        flow = self._flow(turn, blocks.want)
        first_token, window = asyncio.Event(), _Window(flow)
        t0 = time.perf_counter()
        tasks = [
            asyncio.create_task(self._tokens(turn, spec, ticket, q, first_token)),
            asyncio.create_task(self._send(turn, blocks, window, q, first_token)),
            asyncio.create_task(self._acks(turn, uplink, blocks, window, q)),
        ]
        try:
            async for ev in self._merge(turn, q, tasks[0], t0):
                yield ev
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._keep(turn, flow)
            if spec is not None and not turn.session_key:  # a stateless request's KV is reusable by no one
                await self.pins.drop_stateless(spec, blocks.keys)

    async def _merge(self, turn: Turn, q: asyncio.Queue, decoding: asyncio.Task, t0: float) -> AsyncIterator[DownEvent]:
        """The queued events in order; once the edge's takeover came and the client has its
        ``output_tokens`` tokens (at once where the decode already streamed them), the decode is
        aborted and the turn ends with the tokens it produced meanwhile and a ``handover`` final."""
        n_out, stop_at = 0, None
        while True:
            ev = await q.get()
            if isinstance(ev, BaseException):
                raise ev
            if isinstance(ev, Takeover):
                stop_at = ev.output_tokens
            else:
                if isinstance(ev, TokensOut):
                    n_out += len(ev.token_ids)
                yield ev
                if isinstance(ev, TurnFinal):
                    return
            if stop_at is None or n_out < stop_at:
                continue
            decoding.cancel()  # closes the engine's stream: vLLM aborts the request
            await asyncio.gather(decoding, return_exceptions=True)
            turn.time(Stage.CLOUD_DECODE, t0)
            while not q.empty():
                rest = q.get_nowait()
                if isinstance(rest, TokensOut):
                    n_out += len(rest.token_ids)
                    yield rest
                elif isinstance(rest, TurnFinal):  # the decode ended before it was aborted
                    yield rest
                    return
            yield self.calls.final(turn, HANDOVER, n_out, turn.external_tokens)
            return

    def _flow(self, turn: Turn, want: BlockSpec) -> DelayBoundWindow:
        """The turn's downlink window: at most the link's in-flight window and ``WINDOW_BLOCKS``
        blocks, starting where the caller's last downlink over the same link ended (``_keep``)."""
        most = max(turn.link_params.inflight_window_bytes, WINDOW_BLOCKS * want.max_payload_bytes)
        flow = DelayBoundWindow(window_bytes=most, target_queue_ms=KV_DOWN_QUEUE_TARGET_MS)
        kept = self._link_windows.get(self._link_key(turn))
        if kept is not None:
            flow.resume(kept)
        return flow

    def _keep(self, turn: Turn, flow: DelayBoundWindow) -> None:
        """Remember where the turn's downlink window ended (once its acks measured the link), for
        the next turn over the same link; ``KEPT_LINK_WINDOWS`` links at most."""
        key = self._link_key(turn)
        if not key[1] or not math.isfinite(flow.base_delay_ms):
            return
        self._link_windows[key] = flow.window_bytes
        self._link_windows.move_to_end(key)
        while len(self._link_windows) > KEPT_LINK_WINDOWS:
            self._link_windows.popitem(last=False)

    @staticmethod
    def _link_key(turn: Turn) -> tuple[str, str]:
        """The caller's identity and its link id ("" for a turn that names no link)."""
        return turn.caller.tag, turn.header.link_id

    async def _tokens(
        self, turn: Turn, spec: KVTransferSpec | None, ticket: Ticket, q: asyncio.Queue, first_token: asyncio.Event
    ) -> None:
        """The decode engine's events into ``q`` (an error too); ``first_token`` once tokens came.
        ``spec`` None: a plain engine request (no block loaded or saved)."""
        h = turn.header
        try:
            async for ev in self.calls.decode(turn, list(h.prompt_token_ids), spec, h.sampling, 0, ticket):
                q.put_nowait(ev)
                if isinstance(ev, TokensOut):
                    first_token.set()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the turn, which raises it
            q.put_nowait(e)

    async def _send(
        self, turn: Turn, b: _Blocks, window: _Window, q: asyncio.Queue, first_token: asyncio.Event
    ) -> None:
        """After the first token: each block the edge lacks, in order, as soon as the engine's write of
        it landed in the store (the connector's writer puts them in order; ``Pins.await_prefix``
        tells all that landed at one look), within the window; then the commit. Waiting for the
        writes is bounded by ``Pins.tail_save_wait_s`` in all and timed as ``CLOUD_KV_SAVE_WAIT``
        (the time the downlink waited on the store, not on the window). A block missing from the
        store ends the downlink (the decode goes on: the edge never takes over)."""
        await first_token.wait()
        held = [k for k in b.keys[: b.first] if k in turn.pinned]
        await self.pins.release(held, turn.engine_id)  # loaded by now; the edge holds them
        turn.pinned.difference_update(held)
        t0 = time.perf_counter()
        end = self.pins.save_deadline(turn.deadline)
        waited_s, leaves, todo = 0.0, [], list(b.want.indices)
        try:
            while todo:
                w0 = time.perf_counter()
                landed = await self.pins.await_prefix([b.keys[j] for j in todo], end)
                waited_s += time.perf_counter() - w0
                if not landed:
                    log.warning(
                        "remote prefill: KV block %d of %d not stored; no more KV goes down",
                        todo[0],
                        len(b.want.indices),
                    )
                    return
                for j in todo[:landed]:
                    down = await asyncio.to_thread(self._frame, turn, b, j)
                    if down is None:
                        log.warning("remote prefill: KV block %d left the store; no more KV goes down", j)
                        return
                    await window.send(len(down.payload))
                    b.sent[j] = down
                    leaves.append(down.leaf_hash)
                    q.put_nowait(down)
                del todo[:landed]
        finally:
            turn.timings[Stage.CLOUD_KV_SAVE_WAIT] = waited_s * 1e3
        q.put_nowait(Commit(leaf_count=len(leaves), merkle_root=merkle.root(leaves), first_leaf=b.first))
        turn.time(Stage.CLOUD_KV_DOWNLINK, t0)

    def _frame(self, turn: Turn, b: _Blocks, j: int) -> KVBlock | None:
        """Block ``j`` read from the store and framed by the one KV-block codec (blocking); None if
        it is not there."""
        raw = self.store.get(b.keys[j])
        shape = b.want.block_shape
        if raw is None or len(raw) != int(np.prod(shape)) * 4:
            return None
        block = np.frombuffer(raw, np.float32).reshape(shape)
        return encode_block(block, j, b.want.ids[j], b.want.layers, turn.link_params, b.want.params_version)

    async def _acks(
        self, turn: Turn, uplink: AsyncIterator[UplinkBody], b: _Blocks, window: _Window, q: asyncio.Queue
    ) -> None:
        """The edge's acks (window, unpins, resends) and its takeover, queued behind what went before."""
        unpinned = b.first
        try:
            async for item in uplink:
                if isinstance(item, Takeover):
                    q.put_nowait(item)
                    return
                if not isinstance(item, KVDownAck):
                    raise InvalidRequest(f"remote prefill takes KV acks and a takeover, not {type(item).__name__}")
                window.ack(item.received_bytes)
                verified = min(b.first + item.verified_blocks, len(b.want.ids))
                if verified > unpinned:  # the edge holds them: they follow the store's normal eviction
                    keys = b.keys[unpinned:verified]
                    turn.pinned.difference_update(keys)
                    await self.pins.release(keys, turn.engine_id)
                    unpinned = verified
                self._resend(b, item.resend_blocks, q)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the turn, which raises it
            q.put_nowait(e)

    def _resend(self, b: _Blocks, indices: tuple[int, ...], q: asyncio.Queue) -> None:
        """Queue the blocks the edge asks for again, each at most ``max_resends`` times.

        Raises:
            InvalidRequest: a block this turn did not send.
        """
        for j in indices:
            if j not in b.sent:
                raise InvalidRequest(f"the edge asked for KV block {j} again; this turn sent {sorted(b.sent)[:8]}")
            n = b.resends[j] = b.resends.get(j, 0) + 1
            if n > self.max_resends:
                log.warning("remote prefill: KV block %d asked for %d times; not sent again", j, n)
                continue
            log.info("remote prefill: the edge asked for KV block %d again", j)
            q.put_nowait(b.sent[j])
