"""A turn's hold on its KV blocks in the block store, from its upload to its decode.

``Pins`` pins the store keys a turn reads or writes (head blocks from the edge, tail blocks
from the tail engine) so that no other write evicts them while the turn runs, releases them
when it ends, waits for the tail engine's writes that land after the first token, and drops
a stateless turn's blocks (reusable by no one) once those writes landed. It does not put
blocks (``cloud.uploads.receive``) nor decide what a turn loads (``cloud.gateway``). No grpc.
"""

from __future__ import annotations

import asyncio
import logging
import time

from tandem.cloud import metrics
from tandem.cloud.engines.kvparams import KVTransferSpec
from tandem.cloud.store.blocks import BlockStore
from tandem.cloud.turn import Background, Turn
from tandem.common.protocol.errors import EngineError
from tandem.stages import Stage

PIN_GRACE_S = 60.0  # a request's pins outlive its deadline by this much (then they lapse: its gateway died)
# the longest a pin lasts without its unpin (a request without a deadline, or with a far one from the
# client): its blocks matter only until the decode engine loaded them, at the start of its decode
PIN_MAX_LEASE_S = 3600.0
log = logging.getLogger("tandem.cloud")


class Pins:
    """Pins of the turns of one node in ``store``; ``tail_save_wait_s`` bounds the wait for the
    tail engine's writes; late drops run in ``background``."""

    def __init__(self, store: BlockStore, tail_save_wait_s: float, background: Background) -> None:
        self.store, self.tail_save_wait_s, self.background = store, tail_save_wait_s, background

    async def pin(self, turn: Turn, keys: list[str]) -> None:
        """Pin the block-store keys ``turn`` reads or writes (``BlockStore.pin``) until it ends: its
        lease is the turn's deadline plus ``PIN_GRACE_S``, so a dead gateway's pins lapse.

        Raises:
            EngineError: the store cannot be reached (its writes would fail too).
        """
        new = [k for k in keys if k not in turn.pinned]
        if not new:
            return
        left_s = PIN_MAX_LEASE_S if turn.deadline is None else turn.deadline - asyncio.get_running_loop().time()
        lease_s = min(PIN_MAX_LEASE_S, max(0.0, left_s)) + PIN_GRACE_S
        turn.pinned.update(new)  # before the await: the turn's own unpin, if it comes first, takes these too
        await asyncio.to_thread(self.store.pin, new, turn.engine_id, lease_s)
        if turn.ended:  # the turn ended while this pin ran (a keep after a cut upload): release these now
            turn.pinned.difference_update(new)
            await self.release(new, turn.engine_id)

    async def unpin(self, turn: Turn) -> None:
        """Release every pin of ``turn`` (the set is emptied before the store call)."""
        keys = sorted(turn.pinned)
        turn.pinned.clear()
        await self.release(keys, turn.engine_id)

    async def release(self, keys: list[str], owner: str) -> None:
        """Unpin ``keys`` of ``owner``; a store that cannot be reached lets their lease lapse."""
        if not keys:
            return
        try:
            await asyncio.to_thread(self.store.unpin, keys, owner)
        except EngineError as e:
            log.warning("could not unpin a request's KV blocks (%s): their lease lapses", e)

    async def wait_for_tail(self, turn: Turn, keys: list[str]) -> list[str]:
        """Before ``turn``'s decode: ``await_tail_saves(keys, turn.deadline)``, timed as
        ``CLOUD_TAIL_SAVE_WAIT``; what is still missing is counted and logged. Returns it."""
        t0 = time.perf_counter()
        missing = await self.await_tail_saves(keys, turn.deadline)
        turn.time(Stage.CLOUD_TAIL_SAVE_WAIT, t0)
        if missing:
            metrics.record_tail_save_missing(len(missing))
            log.warning(
                "turn %s: %d of %d tail KV blocks not in the store after %.0f ms; the decode engine recomputes them",
                turn.engine_id,
                len(missing),
                len(keys),
                turn.timings[Stage.CLOUD_TAIL_SAVE_WAIT],
            )
        return missing

    def _present_prefix(self, keys: list[str]) -> int:
        """How many of ``keys``, from the first, the store holds (stops at the first it lacks)."""
        n = 0
        for k in keys:
            if not self.store.contains(k):
                break
            n += 1
        return n

    async def await_prefix(self, keys: list[str], deadline: float | None) -> int:
        """Wait until the store holds ``keys[0]`` (polled as ``await_tail_saves`` polls, bounded the
        same way), then return how many of ``keys`` from the first it holds: a reader that takes
        keys in order learns all that landed with one look. 0: the first did not land in time, or
        the store cannot be read. Raises only on cancellation."""
        if not keys:
            return 0
        if await self.await_tail_saves(keys[:1], deadline):
            return 0
        try:
            return max(1, await asyncio.to_thread(self._present_prefix, keys))
        except Exception as e:  # noqa: BLE001 - the first key is there; the rest is read again later
            log.warning("KV writes: the store cannot be read (%s)", e)
            return 1

    def _absent(self, keys: list[str]) -> list[str]:
        return [k for k in keys if not self.store.contains(k)]

    def save_deadline(self, deadline: float | None) -> float:
        """Event-loop time until which a wait for writes that starts now may last: ``tail_save_wait_s``
        from now, never past ``deadline``. Waits for several keys one at a time pass it to
        ``await_tail_saves`` so that they share the one bound."""
        end = asyncio.get_running_loop().time() + self.tail_save_wait_s
        return end if deadline is None else min(end, deadline)

    async def await_tail_saves(self, keys: list[str], deadline: float | None) -> list[str]:
        """Wait until the tail engine's KV writes of ``keys`` are in the store: the connector writes
        them on its own thread after the first token (``TandemConnector.wait_for_save``). Polls
        ``BlockStore.contains`` (every 2 ms, backing off to 20 ms) until all are there, for at most
        ``tail_save_wait_s`` and never past ``deadline`` (event-loop time). Returns the keys still
        missing: their readers recompute them (the decode engine: its connector's own presence
        check). A store that cannot be read counts as missing. Raises only on cancellation."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.tail_save_wait_s
        if deadline is not None:
            end = min(end, deadline)
        missing, pause = list(keys), 0.002
        while True:
            try:
                missing = await asyncio.to_thread(self._absent, missing)
            except Exception as e:  # noqa: BLE001 - a store error ends the wait; the reader recomputes
                log.warning("tail KV writes: the store cannot be read (%s); treated as missing", e)
                return missing
            left = end - loop.time()
            if not missing or left <= 0:
                return missing
            await asyncio.sleep(min(pause, left))
            pause = min(pause * 1.5, 0.02)

    async def drop_stateless(self, spec: KVTransferSpec, pending: list[str]) -> None:
        """A stateless turn ended: its KV (``spec``'s parts) is reusable by no one, so drop it; once
        the tail writes ``pending`` (keys it may still be writing) landed, or they would outlive the
        drop; that wait runs in the background, off the turn."""
        if pending:
            self.background.spawn(self._drop_when_written(spec, pending))
        else:
            await asyncio.to_thread(self.drop_blocks, spec)

    async def _drop_when_written(self, spec: KVTransferSpec, pending: list[str]) -> None:
        """A stateless turn's drop once the tail writes ``pending`` landed (or ``tail_save_wait_s``
        passed: a write landing later ages out of the store)."""
        missing = await self.await_tail_saves(pending, None)
        if missing:
            log.info("dropping a stateless turn's KV with %d tail blocks not yet written", len(missing))
        await asyncio.to_thread(self.drop_blocks, spec)

    def drop_blocks(self, spec: KVTransferSpec) -> None:
        """Delete a finished stateless request's head and tail KV blocks from the store (blocking)."""
        try:
            for part in spec.loads:
                for j in range(len(part.keys)):
                    self.store.delete(part.store_key(j))
        except EngineError as e:
            log.warning("could not drop a stateless request's KV blocks (%s): they age out of the store", e)
