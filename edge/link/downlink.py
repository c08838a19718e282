"""The KV of one remote-prefill turn as it comes down, checked block by block by the one KV-block
codec (``common.wire.kvcodec``, which checks the uplink's blocks on the cloud too).

``KVDownload.add`` checks each block against what the turn asked for before touching its payload
(``check_block``: index, version, format, layers, sizes under the link's params, id), then its
CRC32C, payload and leaf off the event loop (``open_block``), keeps the canonical float32 block,
and answers a ``KVDownAck`` (bytes received for the cloud's window, each block once:
``common.wire.flow.ReceivedBytes``; blocks verified so far; the block to send again when it failed
its CRC32C or leaf). The commit is checked once every block verified (``check_commit``: the
Merkle root over their leaves). A block failing more than ``max_failures`` times, or anything
outside the limits, ends the download (``failed`` says why): the turn then never takes over and
the cloud finishes it. Memory: at most the prompt's full blocks, which the link's
``max_prompt_tokens`` bounds.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import numpy as np

from tandem.common.protocol.errors import (
    ChecksumMismatch,
    CorruptPayload,
    InvalidRequest,
    MerkleMismatch,
    ParamsVersionMismatch,
)
from tandem.common.wire.flow import ReceivedBytes
from tandem.common.wire.kvcodec import BlockSpec, Commit, KVBlock, check_block, check_commit, open_block
from tandem.common.wire.kvdown import KVDownAck

log = logging.getLogger("tandem.edge")
MAX_BLOCK_FAILURES = 3  # a block that fails its CRC32C or leaf this many times ends the download


@dataclass
class KVDownload:
    """The blocks ``want.indices`` of one turn (see module doc)."""

    want: BlockSpec
    max_failures: int = MAX_BLOCK_FAILURES
    blocks: dict[int, np.ndarray] = field(default_factory=dict)  # j -> float32 [L, 2, Hkv, B, D], verified
    leaves: dict[int, bytes] = field(default_factory=dict)
    received: ReceivedBytes = field(default_factory=ReceivedBytes)  # block payload, each block once
    failures: dict[int, int] = field(default_factory=dict)
    commit: Commit | None = None
    failed: str = ""  # why this download will not be used ("" while it may)
    ready: bool = False  # every block verified and the commit's root checked

    @property
    def received_bytes(self) -> int:
        """Payload bytes of blocks received, each block once (what the cloud's window counts)."""
        return self.received.received_bytes

    def _verified(self) -> int:
        """Blocks verified from the first one on, without a gap."""
        j = self.want.first
        while j in self.blocks:
            j += 1
        return j - self.want.first

    def _ack(self, resend: tuple[int, ...] = ()) -> KVDownAck:
        return KVDownAck(received_bytes=self.received_bytes, verified_blocks=self._verified(), resend_blocks=resend)

    def _fail(self, why: str) -> None:
        if not self.failed:
            log.warning("remote prefill: the KV download is dropped (%s); the cloud finishes the turn", why)
            self.failed = why

    async def add(self, b: KVBlock) -> KVDownAck | None:
        """Check and keep one block; the ack to send (None once the download failed or is done)."""
        if self.failed or self.ready:
            return None
        j = b.leaf_index
        try:
            check_block(b, self.want)
        except (InvalidRequest, ParamsVersionMismatch) as e:
            self._fail(str(e))
            return None
        self.received.count(j, len(b.payload))
        if j in self.blocks:  # a resend that crossed the first copy's ack
            return self._ack()
        try:
            self.blocks[j] = await asyncio.to_thread(open_block, b, self.want)
        except (ChecksumMismatch, CorruptPayload) as e:
            n = self.failures[j] = self.failures.get(j, 0) + 1
            if n >= self.max_failures:
                self._fail(f"KV block {j} failed {n} times: {e}")
                return None
            log.info("remote prefill: %s; asking for it again", e)
            return self._ack((j,))
        except InvalidRequest as e:
            self._fail(str(e))
            return None
        self.leaves[j] = b.leaf_hash
        self._check_commit()
        return self._ack()

    def add_commit(self, c: Commit) -> None:
        """Note the turn's commit; it is checked once every block verified."""
        if not self.failed and self.commit is None:
            self.commit = c
            self._check_commit()

    def _check_commit(self) -> None:
        if self.commit is None or self.ready or len(self.blocks) < len(self.want.indices):
            return
        try:
            check_commit(self.commit, self.want.first, [self.leaves[j] for j in self.want.indices])
        except MerkleMismatch as e:
            self._fail(str(e))
            return
        self.ready = True

    def kv(self) -> np.ndarray:
        """The verified blocks in order, float32 ``[L, 2, Hkv, (n - first) * B, D]`` (after ``ready``)."""
        order = self.want.indices
        if not order:
            sh = self.want.block_shape
            return np.zeros((sh[0], 2, sh[2], 0, sh[4]), np.float32)
        return np.concatenate([self.blocks[j] for j in order], axis=3)

    def release(self) -> None:
        """Drop the blocks (the turn adopted them, or will not)."""
        self.blocks.clear()
