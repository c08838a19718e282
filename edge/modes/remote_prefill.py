"""Remote prefill on the edge: the cloud prefills the prompt and streams the first tokens, the
prompt's KV comes down the same call, and the edge decodes the rest with its whole model.

``RemotePrefillTurn.run`` reads like the data path: the header (token ids, and the boundary
``held_tokens``: the prompt tokens before the first block that comes down, ``Decision.kv_plan``)
-> the edge runs the tokens before that boundary that its session lacks itself (the whole prompt
where no block comes down: ``LocalEngine.extend``, beside the cloud's prefill) -> tokens from the
cloud go to the client as they come, while the blocks from the boundary on come down and are
checked (``edge.link.downlink``) -> once they all verified and the edge's own run is done, the
session takes them (``LocalEngine.adopt``) and computes what neither covers (the partial last
block) and the tokens received so far (``LocalEngine.extend``, the catch-up run), the cloud still
streaming -> the edge sends ``Takeover``; the cloud aborts its request and ends with the tokens
decoded past that point and a ``handover`` final -> the edge decodes on locally from every token it
has (``LocalEngine.generate`` reuses the session's KV: one short run, then a step per token). The
client's stream neither pauses for the switch beyond one local run nor repeats a token. Where the
catch-up run is predicted to take no longer than the takeover's round trip (the cost model's local
line, ``CostModel.local_run_ms``, against the link's RTT: a GPU edge), the takeover goes up before
it, as soon as the session holds the KV: the cloud's engines are then not held for that run, and
the run is done by the time the cloud's final comes back (``takeover_first``).

A cloud that ends the turn first (the downlink was slow or cut, the output short) ends it as in
direct mode, without waiting for the edge's own run (which finishes alone, its KV kept by the
session); the KV that came down, if it all came once that run was done, stays in the session for
the next turn. A cloud that fails after tokens reached the client does not end the turn: the edge
decodes on from what it has.

A seeded sampled turn hands over at a fixed point, so that its seed gives the same reply whatever
the link's timing: the client gets the cloud's first ``SEEDED_HANDOVER_TOKENS`` tokens (vLLM's
seeded sampler), the cloud's later ones are withheld, and the edge decodes every token after them
with its own sampler seeded as the turn asks, from the KV of its own run over the prompt: such a
turn asks for no block whatever the plan, since downloaded KV (or its absence, where the download
fails) would make the reply depend on the link. The client's stream waits for that run there;
unseeded turns keep the overlap above. No grpc here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

from tandem.common.protocol.errors import EngineError
from tandem.common.protocol.params import LinkParams
from tandem.common.wire.kvcodec import Commit, KVBlock
from tandem.common.wire.kvdown import HANDOVER, RemotePrefill, Takeover, down_spec
from tandem.common.wire.messages import TokensOut, TurnFinal
from tandem.edge.compute.local import SAMPLING_EPS, LocalEngine, LocalSession, past_from_blocks
from tandem.edge.events import SentBytes, TextOut, TurnDone
from tandem.edge.link.base import TurnCall
from tandem.edge.link.downlink import KVDownload
from tandem.edge.routing.costmodel import CostModel
from tandem.edge.routing.occupancy import takeover_first
from tandem.edge.turn import Turn
from tandem.stages import Stage

log = logging.getLogger("tandem.edge")

SEEDED_HANDOVER_TOKENS = 1  # a seeded sampled turn's tokens from the cloud; the edge's after them


class RemotePrefillTurn:
    """One remote-prefill leg (see module doc). ``model_key``: the whole model's
    (``common.wire.kvdown.full_model_key``)."""

    def __init__(self, turn: Turn, local: LocalEngine, model_key: str, cost: CostModel) -> None:
        self.turn, self.local, self.model_key, self.cost = turn, local, model_key, cost
        self.sess: LocalSession = local.sessions.get(turn.session_id)
        self.held_ids = list(self.sess.token_ids)  # what the session holds as the turn starts
        self.final: TurnFinal | None = None
        self.finish = ""  # set when the client's stream ended on the cloud's side (a stop string, a final)
        self.sent = SentBytes()
        self.adopting: asyncio.Task[None] | None = None  # adopt the KV, then compute what follows it
        self.adopted = asyncio.Event()  # the session holds the KV that came down
        self.prefilling: asyncio.Task[None] | None = None  # the edge's own run over the prompt's first tokens
        self.prompt_held = False  # the session holds the whole prompt's KV with no block to come
        self.took_over = False
        self.cloud_ended = False  # the cloud's part is over (a final, a stop string, a failure): no takeover
        self.call: TurnCall | None = None
        self.edge_tokens = 0
        s = turn.sampling
        # a seeded sampled turn: the cloud's tokens past the fixed handover point are withheld
        self.pinned = s.temperature >= SAMPLING_EPS and s.seed is not None and s.seed != -1
        self.withheld = 0  # the cloud's tokens the client never got (a pinned turn's, past the point)

    async def run(self) -> AsyncIterator[TextOut | TurnDone]:
        """Yields the turn's text deltas, then its ``TurnDone``.

        Raises:
            EngineError: no link params (the cloud is not connected), or the cloud failed before any
                token reached the client. TandemError: the cloud's verdict before the first token.
        """
        p = self.turn.cloud.params(0)
        if p is None:
            raise EngineError("no link params: the cloud is not connected")
        down = self._download(p)
        self._prefill_here(down)
        try:
            async for ev in self._from_cloud(p, down):
                yield ev
            if not self.finish and (self.final is None or self.final.finish_reason == HANDOVER or self.withheld):
                async for ev in self._decode_here():
                    yield ev
            else:
                await self._settle()
        finally:
            for task in (self.adopting, self.prefilling):
                if task is not None and not task.done():  # a turn cancelled, or ended by the cloud, meanwhile
                    task.cancel()
            # each ends at once (a run, once started, finishes alone: the session keeps it); what
            # either raised is retrieved here where the turn ended before it heard it
            started = [task for task in (self.adopting, self.prefilling) if task is not None]
            await asyncio.gather(*started, return_exceptions=True)
            down.release()
            if self.turn.session_id:  # the KV that came down counts against the local sessions' bound
                self.local.sessions.evict()
            else:  # a stateless turn's KV goes back to the model
                self.sess.drop()
        rest, ids = self.turn.text.flush(), self.turn.text.take_ids()
        if rest or ids:
            yield TextOut(text=rest, token_ids=ids)
        yield self._done(p, down.received_bytes)

    async def _from_cloud(self, p: LinkParams, down: KVDownload) -> AsyncIterator[TextOut]:
        """The cloud's part of the turn; a cloud that fails after tokens reached the client ends it
        (the router hears that the turn left the cloud either way: ``Turn.left_cloud``)."""
        try:
            async for ev in self._cloud(p, down):
                yield ev
        except EngineError as e:
            if not self.turn.text.token_ids:
                raise
            log.warning("the cloud failed after %d tokens (%s): decoding on here", len(self.turn.text.token_ids), e)
        finally:
            self.turn.left_cloud()
            self.cloud_ended = True
            if self.call is not None:
                self.call.cancel()

    def _download(self, p: LinkParams) -> KVDownload:
        """What this turn asks the cloud for: the blocks from the plan's boundary on
        (``Decision.kv_plan``; without one, every block past those the session holds). A seeded
        sampled turn asks for none: the edge computes the prompt itself, so that the KV its sampler
        decodes from, and with it the reply, does not depend on the link's timing."""
        ids, B = self.turn.ids, p.kv_block_size_tokens
        held = LocalSession(self.held_ids).common_prefix(ids)
        plan = self.turn.decision.kv_plan if self.turn.decision is not None else None
        first = plan.first_down_block if plan is not None else held // B
        if self.pinned:
            first = len(ids) // B
        first, t = min(max(0, first), len(ids) // B), self.turn
        want = down_spec(ids, first, self.model_key, t.session_id, t.request_id, self.local.shape, p, p.params_version)
        return KVDownload(want)

    def _prefill_here(self, down: KVDownload) -> None:
        """Start the edge's own run over the prompt's tokens before the first block that comes down
        (all of them where none does), beside the cloud's prefill; nothing when the session holds them."""
        ids, want = self.turn.ids, down.want
        upto = want.first * want.block_tokens if want.indices else len(ids)
        if LocalSession(self.held_ids).common_prefix(ids[:upto]) < upto:
            self.prefilling = asyncio.create_task(self._prefill(ids[:upto], whole=not want.indices))
        else:
            self.prompt_held = not want.indices

    async def _prefill(self, ids: list[int], whole: bool) -> None:
        """The edge's own run over ``ids`` (the prompt, or its first blocks), into KV with room for
        the whole turn (the prompt and ``max_new_tokens``): the decode it takes over then runs in
        the KV this run left, not first grown into bigger buffers."""
        t0 = time.perf_counter()
        room = len(self.turn.ids) + self.turn.sampling.max_new_tokens
        await self.local.extend(self.sess, ids, room_tokens=room)
        self.turn.clock.since(Stage.EDGE_PREFILL, t0)
        self.prompt_held = whole
        self._take_over_early()

    def _take_over_early(self) -> None:
        """Where no block comes down and the session holds the whole prompt before the cloud's first
        token reached the client: the takeover goes up at once, for that first token, so that the
        cloud stops right after streaming it (no decode step of its own past it, no round trip
        waited for); the edge computes the token's KV with the next one's (``_decode_here``)."""
        if self.call is not None and self.prompt_held and not self.turn.text.token_ids:
            self._take_over(self.call, at_least=1)

    async def _cloud(self, p: LinkParams, down: KVDownload) -> AsyncIterator[TextOut]:
        """The Generate call: tokens to the client, KV blocks checked and acked, the takeover sent
        once the session holds the KV; returns at the cloud's final or a stop string."""
        turn = self.turn
        rp = RemotePrefill(held_tokens=down.want.first * p.kv_block_size_tokens)
        header = replace(turn.header(p, turn.cloud.link_id), remote_prefill=rp)
        call = self.call = turn.cloud.link.open(turn.timeout_s)
        turn.clock.cloud_called = True
        self.sent += SentBytes(header_bytes=call.send(header))
        self._take_over_early()
        async with contextlib.aclosing(call.events()) as events:  # type: ignore[type-var]
            async for ev in events:
                if isinstance(ev, TokensOut):
                    ids = self._shown(ev.token_ids)
                    if not ids:
                        continue
                    turn.clock.tokens_arrived()
                    delta = turn.text.feed(ids)
                    if delta:
                        yield TextOut(text=delta, token_ids=turn.text.take_ids())
                    if turn.text.stopped:
                        self.finish = "stop"
                        return
                elif isinstance(ev, KVBlock | Commit):
                    await self._kv(ev, down, call)
                elif isinstance(ev, TurnFinal):
                    self._final(ev)
                    return

    def _shown(self, token_ids: Sequence[int]) -> list[int]:
        """The cloud's tokens the client gets: all of them, but for a pinned turn only those up to
        ``SEEDED_HANDOVER_TOKENS`` (the rest are counted in ``withheld``)."""
        if not self.pinned:
            return list(token_ids)
        room = max(0, SEEDED_HANDOVER_TOKENS - len(self.turn.text.token_ids))
        self.withheld += max(0, len(token_ids) - room)
        return list(token_ids[:room])

    async def _kv(self, ev: KVBlock | Commit, down: KVDownload, call: TurnCall) -> None:
        """One KV message: a block checked and acknowledged, or the commit noted."""
        if isinstance(ev, KVBlock):
            ack = await down.add(ev)
            if ack is not None:
                self.sent += SentBytes(header_bytes=call.send(ack))
        else:
            down.add_commit(ev)
        self._take_over_when_ready(down, call)

    def _final(self, ev: TurnFinal) -> None:
        """The cloud's final: a handover (the edge decodes on) or the end of the reply."""
        self.final = ev
        self.turn.cloud.observe_load(ev.load)
        if ev.finish_reason == HANDOVER:
            self.turn.clock.since(Stage.HANDOVER)
        elif not self.withheld:  # a pinned turn's cloud went past the point: the edge decodes the rest
            self.finish = ev.finish_reason

    def _take_over_when_ready(self, down: KVDownload, call: TurnCall) -> None:
        """Once every block verified: the session takes the KV and computes what follows it, and the
        takeover goes up (while the call is open), before that run or after it (``takeover_first``)."""
        if not down.ready or self.adopting is not None:
            return
        self.turn.clock.since(Stage.KV_DOWNLINK)
        self.adopting = asyncio.create_task(self._adopt(down, call))

    async def _adopt(self, down: KVDownload, call: TurnCall) -> None:
        """The session holds the prompt's first tokens (its own, and those of the edge's run beside
        the cloud's prefill), then the blocks that came down, then the KV of what neither covers (the
        partial last block) and of the tokens received so far; the takeover goes up before that run
        or after it (``takeover_first``).

        Raises:
            What the edge's own run raised; InvalidRequest: the session no longer holds the tokens
                the blocks follow (``LocalEngine.adopt``).
        """
        want, ids = down.want, self.turn.ids
        if self.prefilling is not None:
            await self.prefilling
        clock = self.turn.clock
        if want.indices:  # the session keeps its first blocks; those that came down follow them
            t0 = time.perf_counter()
            B = want.block_tokens
            await self.local.adopt(
                self.sess, ids[: len(want.ids) * B], past_from_blocks(down.kv()), keep_tokens=want.first * B
            )
            clock.since(Stage.KV_ADOPT, t0)
        self.adopted.set()
        catch_up = [*ids, *self.turn.text.token_ids]
        first = takeover_first(
            self.cost.local_run_ms(len(catch_up) - self.sess.common_prefix(catch_up)), self._rtt_ms()
        )
        if first:
            self._take_over(call)
        t0 = time.perf_counter()
        await self.local.extend(self.sess, catch_up)
        clock.since(Stage.CATCH_UP, t0)
        if not first:
            self._take_over(call)

    def _take_over(self, call: TurnCall, at_least: int = 0) -> None:
        """Send the takeover at the tokens the client has (at least ``at_least``), once, where the
        cloud has not ended the turn."""
        if self.final is None and not self.finish and not self.took_over and not self.cloud_ended:
            self.took_over = True
            n = max(at_least, len(self.turn.text.token_ids))
            self.sent += SentBytes(header_bytes=call.send(Takeover(output_tokens=n)))
            self.turn.clock.since(Stage.TAKEOVER)

    def _rtt_ms(self) -> float:
        """The link's RTT estimate (ms; 0 before one was measured)."""
        return float(self.turn.cloud.rtt_ms.value or 0.0)

    async def _settle(self) -> None:
        """The cloud ended the turn: a session's next turn reuses the KV that came, which it keeps
        where the edge's own run over the prompt's first tokens is done; neither that run nor the
        local run past the KV is waited for (each finishes alone, its result dropped; the blocks
        that came down are not adopted behind a run still going, nor into a stateless turn's
        session, which goes at the turn's end)."""
        if self.adopting is None:
            return
        if not self.adopting.done():
            if self.turn.session_id and (self.prefilling is None or self.prefilling.done()):
                adopted = asyncio.ensure_future(self.adopted.wait())
                await asyncio.wait({adopted, self.adopting}, return_when=asyncio.FIRST_COMPLETED)
                adopted.cancel()
            self.adopting.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.adopting

    async def _decode_here(self) -> AsyncIterator[TextOut]:
        """Decode the rest on the edge from the prompt and every token received."""
        turn, text = self.turn, self.turn.text
        if self.adopting is not None:
            try:
                await self.adopting
            except Exception as e:  # noqa: BLE001 - the session then computes what it lacks itself
                log.warning("remote prefill: the downloaded KV could not be used (%s): computing it here", e)
        out = list(text.token_ids)
        left = turn.sampling.max_new_tokens - len(out)
        if left <= 0 or (out and self._ends(out[-1])):
            self.finish = "length" if left <= 0 else "stop"
            return
        sampling = replace(turn.sampling, max_new_tokens=left)
        self.finish = "length"
        gen = self.local.generate([*turn.ids, *out], sampling, turn.session_id, session=self.sess)
        async with contextlib.aclosing(gen) as steps:
            async for step in steps:
                self.edge_tokens += 1
                turn.clock.tokens_arrived()
                delta = text.feed([step.token_id])
                if delta:
                    yield TextOut(text=delta, token_ids=text.take_ids())
                if text.stopped:
                    self.finish = "stop"
                    return
                if step.finish_reason is not None:
                    self.finish = step.finish_reason

    def _ends(self, token: int) -> bool:
        s = self.turn.sampling
        return token in s.stop_token_ids or (token in self.local.eos_token_ids and not s.ignore_eos)

    def _done(self, p: LinkParams, received_kv_bytes: int) -> TurnDone:
        turn, f = self.turn, self.final
        turn.clock.since(Stage.TOTAL)
        if f is not None:
            turn.clock.timings.update({k: v for k, v in f.timings.items() if k.is_cloud})
        return turn.done(
            self.finish or "stop",
            len(turn.ids),
            external_tokens=f.external_tokens if f is not None else 0,
            sent_bytes=self.sent,
            params_version=p.params_version,
            received_kv_bytes=received_kv_bytes,
            edge_decoded_tokens=self.edge_tokens,
        )


async def run_remote_prefill(
    turn: Turn, local: LocalEngine, model_key: str, cost: CostModel
) -> AsyncIterator[TextOut | TurnDone]:
    """Remote prefill of ``turn`` (see module doc). ``cost``: the router's cost model (its
    ``local_run_ms`` times the catch-up run for the takeover's order, as auto's handover model does).

    Raises:
        TurnTooLarge: the turn's own KV is larger than the whole bound on the edge's KV memory
            (``LocalEngine.check_fits``, before the cloud is called: the edge could not hold it).
        TandemError: see ``RemotePrefillTurn.run``.
    """
    local.check_fits(len(turn.ids), turn.sampling.max_new_tokens, turn.prompt_param)
    if local.session_expired(turn.session_id):
        turn.clock.session_expired = True
    async with contextlib.aclosing(RemotePrefillTurn(turn, local, model_key, cost).run()) as events:  # type: ignore[type-var]
        async for ev in events:
            yield ev
