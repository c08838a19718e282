"""The receive path of a split turn: from the header's reservation to the session's commit.

``Receiver.upload`` reserves the upload's bytes (``cloud.uploads.admission``), checks every item as
it arrives (``cloud.uploads.upload.TurnUpload``: CRC32C per chunk; per KV block the checks of the one
KV-block codec, ``common.wire.kvcodec``; the Merkle root at the commit) within the upload deadline,
answers NACKs, repair requests and window acks, has a session's verified prefix kept as it grows
(``cloud.uploads.prefixkeeper``), then puts the head KV blocks in the store and commits the turn
into its session. It runs no engine (``cloud.gateway`` does, with what it received) and holds no
state between turns. No grpc.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field, replace

import numpy as np

from tandem.cloud import metrics
from tandem.cloud.config import CloudConfig
from tandem.cloud.links.negotiation import ack_threshold_bytes
from tandem.cloud.sessions.sync import SessionSync
from tandem.cloud.sessions.table import CloudSession
from tandem.cloud.splits import Splits
from tandem.cloud.store.blocks import BlockStore
from tandem.cloud.turn import Background, Turn, UplinkBody, bounded
from tandem.cloud.uploads.admission import UploadBudget
from tandem.cloud.uploads.pins import Pins
from tandem.cloud.uploads.prefixkeeper import PrefixKeeper
from tandem.cloud.uploads.upload import TurnUpload, upload_bound_bytes
from tandem.common.protocol.errors import DeadlineExceeded, EngineError, InvalidRequest, MerkleMismatch, UploadTimeout
from tandem.common.runtime.tracing import traced
from tandem.common.wire import chunks as wire
from tandem.common.wire.flow import ReceivedBytes
from tandem.common.wire.kvblocks import LayerRange, part_key
from tandem.common.wire.messages import Commit, KVBlock, Nack, Repair, WindowAck
from tandem.stages import Stage

log = logging.getLogger("tandem.cloud")
UploadEvent = Nack | Repair | WindowAck


@dataclass
class Received:
    """What a split turn's verified upload gave: the prompt's activations float32 ``[T, H]`` and
    the session's head-KV leaves after the turn (filled by ``Receiver.upload`` at its end)."""

    hidden: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    leaves: list[bytes] = field(default_factory=list)


@dataclass
class _Window:
    """The edge's flow control of one upload: payload received (``common.wire.flow.ReceivedBytes``:
    each chunk and KV block once; resends do not count), what was last acknowledged, and the held
    tokens the edge was told."""

    threshold_bytes: int
    told_tokens: int
    received: ReceivedBytes = field(default_factory=ReceivedBytes)
    acked_bytes: int = 0

    @property
    def received_bytes(self) -> int:
        return self.received.received_bytes

    def count(self, item: UplinkBody) -> None:
        if isinstance(item, wire.Chunk):
            self.received.count(("chunk", item.seq), len(item.payload))
        elif isinstance(item, KVBlock):
            self.received.count(("kv", item.leaf_index), len(item.payload))

    def ack(self, upload: TurnUpload, keeper: PrefixKeeper | None) -> WindowAck | None:
        """A ``WindowAck`` every ``threshold_bytes`` received (which also kicks the keeper), or when
        a keep finished since the last one; else None."""
        if self.received_bytes - self.acked_bytes >= self.threshold_bytes:
            self.acked_bytes = self.received_bytes
            if keeper is not None:
                keeper.kick()
            self.told_tokens = max(self.told_tokens, upload.kept_tokens)
            return WindowAck(
                received_bytes=self.received_bytes, held_tokens=self.told_tokens if keeper is not None else 0
            )
        if keeper is not None and upload.kept_tokens > self.told_tokens:  # a keep finished since the last ack
            self.told_tokens = upload.kept_tokens
            return WindowAck(received_bytes=self.acked_bytes, held_tokens=self.told_tokens)
        return None


class Receiver:
    """The receive path of one node. ``cfg`` gives ``upload_timeout_s``, ``max_repair_rounds`` and
    ``max_abs_activation``; ``sync`` the sessions (memory table and store) turns commit into."""

    def __init__(
        self,
        cfg: CloudConfig,
        splits: Splits,
        budget: UploadBudget,
        store: BlockStore,
        sync: SessionSync,
        pins: Pins,
        background: Background,
    ) -> None:
        self.cfg, self.splits, self.budget, self.store = cfg, splits, budget, store
        self.sync, self.pins, self.background = sync, pins, background

    async def upload(
        self, turn: Turn, uplink: AsyncIterator[UplinkBody], received: Received
    ) -> AsyncGenerator[UploadEvent, None]:
        """Receive, verify and commit ``turn``'s upload, yielding what goes down meanwhile; fills
        ``received``. A turn cut by a Merkle mismatch after its prefix was kept forgets the session
        (the kept leaves are ones the edge's root does not cover).

        Raises:
            QuotaExceeded: the upload budget is spent. SessionNotFound, SessionOutOfSync: the header
            does not fit the session. InvalidRequest, ChecksumMismatch, CorruptPayload,
            MerkleMismatch, UploadTimeout, DeadlineExceeded: from the items and their commit.
        """
        header, params = turn.header, turn.link_params
        manifest = self.splits.manifest(header.split_layer)
        with self.budget.reserve(str(turn.caller), upload_bound_bytes(header, params, manifest)):
            session = await self.sync.session(turn.session_key, header.cached_tokens)
            seed = self.splits.request_seed(header, params.kv_block_size_tokens)
            upload = TurnUpload(header, params, manifest, session, seed, self.cfg.max_abs_activation)
            keeper = self._keeper(turn, upload)
            try:
                async for ev in self._receive(turn, upload, uplink, keeper):
                    yield ev
                if keeper is not None:
                    await keeper.settle()
                received.hidden, received.leaves = await self._commit(turn, upload)
            except MerkleMismatch:
                if keeper is not None:
                    await keeper.settle()  # a keep still running may yet keep leaves
                    if upload.kept_leaves > upload.first_new_leaf:  # leaves the edge's root does not cover
                        await self.sync.forget(turn.session_key)
                raise
            finally:
                metrics.record_received(upload.received_bytes, sum(upload.resends.values()))
                upload.release()

    def _keeper(self, turn: Turn, upload: TurnUpload) -> PrefixKeeper | None:
        """A session turn's prefix keeper; None for a stateless turn (nothing to resume)."""
        if not turn.session_key:
            return None
        return PrefixKeeper(turn, upload, self.pins, self.sync, self.put_head_blocks, self.background)

    def _upload_deadline(self, turn: Turn) -> float:
        loop_deadline = asyncio.get_running_loop().time() + self.cfg.upload_timeout_s
        return loop_deadline if turn.deadline is None else min(loop_deadline, turn.deadline)

    @traced("cloud_upload")
    async def _receive(
        self, turn: Turn, upload: TurnUpload, uplink: AsyncIterator[UplinkBody], keeper: PrefixKeeper | None
    ) -> AsyncIterator[UploadEvent]:
        """Verify the upload item by item (decoding off the event loop), within the upload deadline."""

        def late() -> Exception:
            return UploadTimeout(f"upload not complete within {self.cfg.upload_timeout_s:.0f} s or the deadline")

        async for ev in self._verify_items(upload, bounded(uplink, self._upload_deadline(turn), late), keeper):
            yield ev
        turn.time(Stage.CLOUD_UPLOAD_WAIT, turn.t_start)
        turn.received_bytes = dict(upload.received_bytes)

    async def _verify_items(
        self, upload: TurnUpload, uplink: AsyncIterator[UplinkBody], keeper: PrefixKeeper | None = None
    ) -> AsyncIterator[UploadEvent]:
        """Check each item as it arrives. Payload received (each chunk and KV block once; resends do
        not count) is acknowledged (``WindowAck``) every quarter window (``ack_threshold_bytes``):
        the edge's flow control, which it honours as a sender honours TCP's window. The cloud's
        memory does not depend on it: the upload's bytes are reserved at its header
        (``UploadBudget``) and gRPC's flow control holds back what the gateway has not read. With a
        session, each such ack also has ``keeper`` keep the verified prefix, and the next ack
        (``held_tokens``) tells the edge what it may resume from.

        Raises:
            InvalidRequest: an unexpected item, an early close.
            MerkleMismatch: KV blocks still bad after ``max_repair_rounds``.
        """
        threshold = ack_threshold_bytes(upload.params.inflight_window_bytes, upload.max_item_bytes)
        window, repairs = _Window(threshold, upload.header.cached_tokens), 0
        async for item in uplink:
            window.count(item)
            verdict = await self._check(upload, item)
            if isinstance(verdict, Repair):
                repairs += 1
                if repairs > self.cfg.max_repair_rounds:
                    bad = list(verdict.leaf_indices[:8])
                    raise MerkleMismatch(f"KV blocks {bad} still bad after {repairs - 1} repair rounds")
                log.info("repair round %d: asking for %d KV blocks again", repairs, len(verdict.leaf_indices))
                metrics.record_repair_request(len(verdict.leaf_indices))
            if verdict is not None:
                yield verdict
            if upload.complete:
                return
            if (ack := window.ack(upload, keeper)) is not None:
                yield ack
        raise InvalidRequest(
            f"uplink closed before the upload completed ({len(upload.chunks)}/"
            f"{upload.header.num_chunks} chunks, committed={upload.committed})"
        )

    async def _check(self, upload: TurnUpload, item: UplinkBody) -> Nack | Repair | None:
        """Add one item to ``upload``: a NACK for a chunk that failed its CRC32C or did not decode,
        the leaves to repair for a commit that did not verify, else None. Raises InvalidRequest
        for an item that is no chunk, KV block or commit (and what ``TurnUpload`` raises)."""
        if isinstance(item, wire.Chunk):
            if not await asyncio.to_thread(upload.add_chunk, item):
                log.info("chunk %d failed its CRC32C or did not decode: NACK", item.seq)
                return Nack(seq=item.seq, reason="crc32c mismatch or payload does not decode")
        elif isinstance(item, KVBlock):
            await asyncio.to_thread(upload.add_block, item)
        elif isinstance(item, Commit):
            repair = upload.commit(item.leaf_count, item.merkle_root)
            if repair:
                return Repair(leaf_indices=tuple(repair), reason="leaf hash mismatch, block missing or not decodable")
        else:
            raise InvalidRequest(f"unexpected {type(item).__name__} after the header")
        return None

    async def _commit(self, turn: Turn, upload: TurnUpload) -> tuple[np.ndarray, list[bytes]]:
        """Put the verified head blocks in the store and commit the turn into its session under the
        session's lock, waited for no longer than the request's deadline. Returns the prompt's
        activations ``[T, H]`` and head-KV leaves."""
        t0 = time.perf_counter()
        hidden = upload.activations()
        await self.pins.pin(turn, [part_key(leaf, upload.part) for leaf in upload.leaves()])  # earlier turns' too
        blocks = upload.new_blocks(upload.kept_leaves)  # a kept prefix's blocks are in the store already
        await asyncio.to_thread(self.put_head_blocks, blocks, upload.part)
        turn.time(Stage.CLOUD_STORE_PUT, t0)
        sid, sessions = turn.session_key, self.sync.sessions
        if not sid:
            return hidden, upload.leaves()
        session = upload.session
        try:
            async with asyncio.timeout_at(turn.deadline), session.lock:
                current = sessions.get(sid)
                if current is not None and current is not session:
                    session = current  # another turn created the session meanwhile: version check fails
                upload.apply_to(session, hidden)
                sessions.put(sid, session)
                saved = replace(session, token_ids=list(session.token_ids), leaves=list(session.leaves))
        except TimeoutError:
            raise DeadlineExceeded(f"deadline passed waiting for session {sid!r}") from None
        finally:
            sessions.evict()
        await self._save(turn, sid, saved, upload.stored_tokens)
        return hidden, list(saved.leaves)

    async def _save(self, turn: Turn, sid: str, saved: CloudSession, first_new_token: int) -> None:
        """Save the committed session beside the blocks, so that a restarted node or another replica
        can serve its next turn; timed into ``CLOUD_STORE_PUT``. A store error is logged, not raised."""
        t0 = time.perf_counter()
        try:
            await asyncio.to_thread(self.sync.store.save, sid, saved, first_new_token)
        except EngineError as e:
            log.warning("session %s not saved to the block store (%s): its next turn elsewhere resends more", sid, e)
        turn.timings[Stage.CLOUD_STORE_PUT] = (
            turn.timings.get(Stage.CLOUD_STORE_PUT, 0.0) + (time.perf_counter() - t0) * 1e3
        )

    @traced("cloud_store_put")
    def put_head_blocks(self, blocks: list[tuple[bytes, bytes]], part: LayerRange) -> None:
        """Write (leaf, raw bytes) head KV blocks of ``part`` to the store (blocking)."""
        for leaf, raw in blocks:
            self.store.put(part_key(leaf, part), raw)
