"""Makes a session turn's upload (``cloud.uploads.upload.TurnUpload``) resumable when it is cut.

At each window ack, the verified prefix of the upload (``TurnUpload.verified_prefix``) is
committed into the session and saved beside the blocks (its head KV blocks, ``SessionStore``
record and pieces), off the upload's path; once saved it is acknowledged
(``WindowAck.held_tokens``) and a resumed upload, on this node, a restarted one or another
replica, starts there. It does not verify anything (the upload does) and never commits the
whole turn (``cloud.uploads.receive`` does, after ``settle``). No grpc.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from tandem.cloud.sessions.sync import SessionSync
from tandem.cloud.turn import Background, Turn
from tandem.cloud.uploads.pins import Pins
from tandem.cloud.uploads.upload import TurnUpload
from tandem.common.protocol.errors import EngineError, SessionOutOfSync
from tandem.common.wire.kvblocks import LayerRange, part_key

log = logging.getLogger("tandem.cloud")
PutBlocks = Callable[[list[tuple[bytes, bytes]], LayerRange], None]  # (leaf, raw bytes) pairs of one part


class PrefixKeeper:
    """Keeps the verified prefix of one session turn's upload (see module doc). One keep at a
    time per upload; a keep still running when the upload is cut completes on its own.

    Who calls: the receive path, ``kick`` at each window ack and ``settle`` before the turn's
    own commit. ``put_blocks`` writes head KV blocks to the store (blocking; run in a thread)."""

    def __init__(
        self,
        turn: Turn,
        upload: TurnUpload,
        pins: Pins,
        sync: SessionSync,
        put_blocks: PutBlocks,
        background: Background,
    ) -> None:
        self.turn, self.upload, self.pins, self.sync = turn, upload, pins, sync
        self.put_blocks, self.background = put_blocks, background
        self.task: asyncio.Task | None = None
        self.stopped = False

    def kick(self) -> None:
        """Start keeping the verified prefix, if it grew and no keep is running."""
        up = self.upload
        if self.stopped or (self.task is not None and not self.task.done()):
            return
        n = up.verified_prefix()
        if n <= up.stored_tokens:
            return
        parts, leaves = up.prefix_parts(n)  # references: the copy is made in the keep's thread
        blocks = up.new_blocks(up.kept_leaves, n // up.bs)
        self.task = self.background.spawn(self._keep(n, parts, leaves, blocks))

    async def settle(self) -> None:
        """No more keeps; wait for the one running (its state is what the turn's commit builds on)."""
        self.stopped = True
        if self.task is not None:
            await asyncio.shield(self.task)

    async def _keep(
        self, n: int, parts: list[np.ndarray], leaves: list[bytes], blocks: list[tuple[bytes, bytes]]
    ) -> None:
        up, sid, sessions = self.upload, self.turn.session_key, self.sync.sessions
        try:
            hidden = await asyncio.to_thread(lambda: np.ascontiguousarray(np.concatenate(parts)[:n], np.float32))
            await self.pins.pin(self.turn, [part_key(leaf, up.part) for leaf, _ in blocks])
            await asyncio.to_thread(self.put_blocks, blocks, up.part)
            up.blocks_stored(n // up.bs)
            session = up.session
            async with asyncio.timeout_at(self.turn.deadline), session.lock:
                current = sessions.get(sid)
                if current is not None and current is not session:
                    raise SessionOutOfSync("another turn created the session during the upload")
                up.apply_prefix(session, n, hidden, leaves)
                sessions.put(sid, session)
                saved = replace(session, token_ids=list(session.token_ids), leaves=list(session.leaves))
            sessions.evict()
            await asyncio.to_thread(self.sync.store.save, sid, saved, up.stored_tokens)
            up.prefix_kept(n)
        except (SessionOutOfSync, TimeoutError, EngineError) as e:
            self.stopped = True
            log.info("session %s: the upload's prefix of %d tokens not kept (%s)", sid, n, e)
