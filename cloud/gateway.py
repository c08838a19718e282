"""The cloud gateway: a turn from verified upload to streamed tokens.

``Gateway.run_turn`` is the main loop of a request and reads like the design's data path:
admission into an engine slot (its link's share orders the waiters) -> receive and verify the
upload, commit it into the session (head KV blocks into the store) -> tail prefill (prompt_embeds,
saves tail KV, samples the first token) -> decode (loads all layers of the aligned prefix). Direct
mode decodes the prompt's token ids; remote prefill (``cloud.remote_prefill``) decodes them too,
sends the prompt's KV down and hands the decode over to the edge. It takes domain messages and
yields domain events; ``cloud.service`` adapts it to gRPC.

The gateway runs a turn's mode on the engines and nothing else; its collaborators, assembled at
the entry point (``cloud.server.build_gateway``), do the rest: the engine calls every mode makes
(``cloud.engine_calls``, which remote prefill shares), links, params and load
(``cloud.links.registry``), sessions (``cloud.sessions.sync``), the receive path
(``cloud.uploads.receive``) and the block store's pins (``cloud.uploads.pins``). A turn's mode is
a ``Mode`` (``mode_of``), the key of its path; its name appears only in logs, metric labels and
spans.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import AbstractContextManager, aclosing, nullcontext
from dataclasses import replace

from tandem.cloud import metrics
from tandem.cloud.config import CloudConfig
from tandem.cloud.engine_calls import EngineCalls
from tandem.cloud.engines.kvparams import KVTransferSpec, PartSpec
from tandem.cloud.links.registry import LinkRegistry
from tandem.cloud.links.table import Ticket
from tandem.cloud.links.tenancy import EdgeLimits
from tandem.cloud.remote_prefill import RemotePrefills, check_remote_prefill
from tandem.cloud.sessions.sync import SessionSync
from tandem.cloud.splits import Splits
from tandem.cloud.store.blocks import BlockStore
from tandem.cloud.turn import Background, Turn, UplinkBody, as_principal
from tandem.cloud.uploads.pins import Pins
from tandem.cloud.uploads.receive import Received, Receiver
from tandem.cloud.uploads.upload import check_header
from tandem.common.protocol.manifest import SplitManifest
from tandem.common.protocol.modes import Mode
from tandem.common.protocol.params import (
    LinkParams,
    Negotiated,
    NegotiateOffer,
    ServerInfo,
    SyncReply,
    SyncRequest,
)
from tandem.common.runtime.logs import bind_request, turn_log
from tandem.common.runtime.security import ANONYMOUS_PEER, Principal
from tandem.common.runtime.tracing import span
from tandem.common.wire.kvblocks import activation_keys
from tandem.common.wire.messages import DownEvent, TokensOut, TurnFinal, TurnHeader, UploadAck
from tandem.stages import Stage

__all__ = ["Gateway", "UplinkBody"]
log = logging.getLogger("tandem.cloud")
ModeRun = Callable[[Turn, AsyncIterator[UplinkBody], Ticket], AsyncGenerator[DownEvent, None]]  # one mode's path


class Gateway:
    """The turns of one cloud node over its collaborators (see module doc). ``links`` (shares),
    ``rates`` and ``sessions`` (the memory table) are the collaborators' own, shared here;
    ``serving`` mirrors the node's health (engines restarting, draining: False)."""

    def __init__(
        self,
        cfg: CloudConfig,
        splits: Splits,
        calls: EngineCalls,
        *,
        remote: RemotePrefills,
        registry: LinkRegistry,
        sync: SessionSync,
        receiver: Receiver,
        pins: Pins,
        edge_limits: EdgeLimits,
        background: Background,
    ) -> None:
        self.cfg, self.splits, self.calls, self.remote = cfg, splits, calls, remote
        self.registry, self.sync, self.receiver, self.pins = registry, sync, receiver, pins
        self.edge_limits, self.background = edge_limits, background
        self.links, self.rates, self.sessions = registry.links, registry.rates, sync.sessions
        self.serving = True
        self._modes: dict[Mode, ModeRun] = {
            Mode.DIRECT: self._direct,
            Mode.SPLIT: self._split_turn,
            Mode.REMOTE_PREFILL: self.remote.run,
        }

    @property
    def manifest(self) -> SplitManifest:
        """The primary split (its model, shape and tokenizer)."""
        return self.splits.primary

    @property
    def params(self) -> LinkParams:
        """The anonymous link's params at the primary split layer (what a plain client gets)."""
        return self.registry.params

    @property
    def store(self) -> BlockStore:
        return self.pins.store

    def negotiate(self, offer: NegotiateOffer, caller: Principal | str = ANONYMOUS_PEER) -> Negotiated:
        """``Negotiate``: see ``LinkRegistry.negotiate``."""
        return self.registry.negotiate(offer, caller)

    def server_info(self, link_id: str, caller: Principal | str = ANONYMOUS_PEER) -> ServerInfo:
        """``GetServerInfo``: see ``LinkRegistry.server_info``."""
        return self.registry.server_info(link_id, caller, self.serving)

    async def sync_session(self, req: SyncRequest, caller: Principal | str = ANONYMOUS_PEER) -> SyncReply:
        """``SyncSession``: see ``SessionSync.sync_session``."""
        return await self.sync.sync_session(req, caller)

    async def end_session(self, session_id: str, caller: Principal | str = ANONYMOUS_PEER) -> bool:
        """``EndSession``: see ``SessionSync.end_session``."""
        return await self.sync.end_session(session_id, caller)

    async def run_turn(
        self,
        header: TurnHeader,
        uplink: AsyncIterator[UplinkBody],
        caller: Principal | str = ANONYMOUS_PEER,
        deadline: float | None = None,
    ) -> AsyncIterator[DownEvent]:
        """One request: the edge's own bounds (``cloud.links.tenancy``), admission into an engine slot,
        upload (split mode), tail prefill (samples the first token), decode. ``caller`` is the
        edge's identity: it scopes the session and bounds the upload; ``deadline`` is
        event-loop time or None. Yields events to send down. Records the request's TTFT and
        inter-token times for its link's SLO controller and the node's rates.

        Raises:
            InvalidRequest, ParamsVersionMismatch, SessionOutOfSync, ChecksumMismatch, MerkleMismatch,
            QuotaExceeded (``LinkBusy`` or ``EdgeOverLimit``, with a retry delay), PermissionDenied,
            UploadTimeout, DeadlineExceeded, EngineError: mapped to gRPC status by the servicer;
            session state is unchanged on error.
        """
        turn = Turn(header, deadline, caller=as_principal(caller))
        mode = mode_of(header)
        with (
            bind_request(header.request_id, header.session_id, turn.caller),
            turn_log(log, mode) as done_fields,
            metrics.cloud_turn(mode, turn),
            span(
                "cloud_turn",
                mode=mode,
                request_id=header.request_id,
                session_id=header.session_id,
                caller=str(turn.caller),
                link_id=header.link_id,
            ),
        ):
            done_fields.update(engine_id=turn.engine_id, link_id=header.link_id)
            t_last: float | None = None
            try:
                async with aclosing(self._run(turn, uplink)) as events:  # its slot frees when the caller stops reading
                    async for ev in events:
                        if isinstance(ev, TokensOut) and ev.token_ids:
                            t_last = self._record_latency(turn, len(ev.token_ids), t_last)
                        if isinstance(ev, TurnFinal):
                            turn.final_sent = True
                            done_fields.update(
                                prompt_tokens=ev.prompt_tokens, output_tokens=ev.output_tokens, finish=ev.finish_reason
                            )
                        yield ev
            finally:
                turn.ended = True
                if turn.pinned:
                    await self.pins.unpin(turn)

    def _record_latency(self, turn: Turn, n_tokens: int, t_last: float | None) -> float:
        """Record the turn's TTFT (``t_last`` None: its first tokens) or its time per output token
        since ``t_last`` for its link's SLO controller; returns now (perf_counter)."""
        now = time.perf_counter()
        if t_last is None:
            self.links.record_ttft(turn.header.link_id, (now - turn.t_start) * 1e3)
        else:
            self.links.record_itl(turn.header.link_id, (now - t_last) * 1e3 / n_tokens)
        return now

    async def _run(self, turn: Turn, uplink: AsyncIterator[UplinkBody]) -> AsyncGenerator[DownEvent, None]:
        """The turn itself (``run_turn`` adds its log ids, logs, metrics and span), run by its mode's
        path once admitted. A split turn's session is in flight throughout: never evicted or expired
        meanwhile, and its place and bytes count against the edge's and the node's bounds from
        before its admission to its end."""
        with self.sessions.turn(turn.session_key if turn.header.split_layer else ""):
            self._check(turn)
            with self._hold_state(turn), await self._admit(turn) as ticket:
                async with aclosing(self._modes[mode_of(turn.header)](turn, uplink, ticket)) as events:
                    async for ev in events:
                        yield ev

    async def _direct(
        self, turn: Turn, uplink: AsyncIterator[UplinkBody], ticket: Ticket
    ) -> AsyncGenerator[DownEvent, None]:
        """Direct mode: decode the prompt's token ids."""
        header = turn.header
        async for ev in self.calls.decode(turn, list(header.prompt_token_ids), None, header.sampling, 0, ticket):
            yield ev

    async def _split_turn(
        self, turn: Turn, uplink: AsyncIterator[UplinkBody], ticket: Ticket
    ) -> AsyncGenerator[DownEvent, None]:
        """Split mode: receive the upload, then run the tail prefill and the decode over it."""
        header = turn.header
        received = Received()
        async with aclosing(self.receiver.upload(turn, uplink, received)) as upload:  # closed with the turn
            async for up in upload:
                yield up
        yield UploadAck(verified_tokens=len(header.prompt_token_ids), leaf_count=len(received.leaves))
        async with aclosing(self._split(turn, received, ticket)) as events:
            async for ev in events:
                yield ev

    def _check(self, turn: Turn) -> None:
        """Look up the params ``turn`` runs under and check its header and its edge's rate.

        Raises:
            ParamsVersionMismatch, PermissionDenied: see ``LinkRegistry.params_for``.
            InvalidRequest: the header is outside the params. EdgeOverLimit: the edge's rate.
        """
        header = turn.header
        params = turn.params = self.registry.params_for(header, turn.caller)
        check_header(header, params, self.splits.manifest(header.split_layer))
        if header.remote_prefill is not None:
            check_remote_prefill(turn, self.registry.limits.kv_wire_dtypes)
        self.edge_limits.check_rate(turn.caller)

    def _hold_state(self, turn: Turn) -> AbstractContextManager[None]:
        """A split turn's hold on its edge's state bounds and the node's session table until it
        ends (``EdgeLimits.hold_state``); nothing for the other modes, which keep no state here.

        Raises:
            EdgeOverLimit, SessionTableFull: no room, every session in the way with a turn in flight.
            TurnTooLarge: the turn alone passes a whole bound (never fits: no retry hint).
        """
        h = turn.header
        if not h.split_layer:
            return nullcontext()
        return self.edge_limits.hold_state(turn.caller, self.sessions, turn.session_key, len(h.prompt_token_ids))

    async def _admit(self, turn: Turn) -> Ticket:
        """An engine slot: at once while one is free, else after waiting in the link's queue, where
        the link's share orders it among the waiters (``cloud.links.table``); records the wait.

        Raises:
            QuotaExceeded: ``LinkBusy`` (every slot taken and the queue full, or still taken at the
                deadline / queue wait bound).
        """
        ticket = await self.links.admit(turn.header.link_id, len(turn.header.prompt_token_ids), turn.deadline)
        turn.timings[Stage.CLOUD_QUEUE] = ticket.queued_ms
        self.rates.queue_wait_ms.add(ticket.queued_ms)
        return ticket

    async def _split(self, turn: Turn, received: Received, ticket: Ticket) -> AsyncGenerator[DownEvent, None]:
        """Tail prefill over the received activations (its first token goes down at once), then the
        decode from prompt + first token, loading every layer of the aligned prefix: head KV from the
        edge, tail KV the tail engine wrote (waited for: it lands after the first token). A
        stateless turn's KV is dropped at its end (``Pins.drop_stateless``)."""
        header = turn.header
        spec = self._kv_spec(turn, received)
        tail = spec.loads[1]
        tail_store_keys = [tail.store_key(j) for j in range(len(tail.keys))]
        tail_saves: list[str] = []  # tail keys the tail engine may still be writing (after token 1)
        try:
            await self.pins.pin(turn, tail_store_keys)
            first = await self.calls.tail_prefill(turn, received.hidden, tail)
            tail_saves = tail_store_keys
            ticket.prefill_done()
            yield TokensOut(token_ids=(first.first_token,), index=0)
            if first.finish_reason is not None or header.sampling.max_new_tokens == 1:
                yield self.calls.final(turn, first.finish_reason or "length", 1, 0)
                return
            tail_saves = await self.pins.wait_for_tail(turn, tail_saves)
            ids = [*header.prompt_token_ids, first.first_token]
            rest = replace(header.sampling, max_new_tokens=header.sampling.max_new_tokens - 1)
            async for ev in self.calls.decode(turn, ids, spec, rest, 1, ticket):
                yield ev
        finally:
            if not turn.session_key:  # a stateless request's KV is reusable by no one
                await self.pins.drop_stateless(spec, tail_saves)

    def _kv_spec(self, turn: Turn, received: Received) -> KVTransferSpec:
        """What the decode loads: the head part (the session's leaves, from the edge) and the tail
        part (keys chained over the activations, in the caller's scope; the tail engine saves it)."""
        h, bs = turn.header, turn.link_params.kv_block_size_tokens
        head, tail = self.splits.head_part(h.split_layer), self.splits.tail_part(h.split_layer)
        tail_keys = activation_keys(received.hidden, bs, self.splits.tail_seed(h, turn.caller.tag, bs), tail)
        return KVTransferSpec(loads=(PartSpec(head, tuple(received.leaves)), PartSpec(tail, tuple(tail_keys))))


def mode_of(header: TurnHeader) -> Mode:
    """The serving mode a header asks for: ``SPLIT`` (a split layer), ``REMOTE_PREFILL`` or ``DIRECT``."""
    if header.split_layer:
        return Mode.SPLIT
    return Mode.REMOTE_PREFILL if header.remote_prefill is not None else Mode.DIRECT
