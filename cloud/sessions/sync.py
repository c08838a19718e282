"""Which session state a turn or a ``SyncSession`` call finds on this node.

``SessionSync`` looks a session up in the memory table (``cloud.sessions.table``) and, when the
table lacks it, in the block store (``cloud.sessions.store``: a restarted node, or another
replica's session); it answers ``SyncSession`` by comparing the edge's Merkle root and
token ids with what it holds; it forgets a session in both places (``EndSession``, a Merkle
mismatch). It keeps sessions' lifetime: the table's idle expiry swept every so often
(``sweep_loop``) and the sessions ended, expired and evicted counted. It does not verify
uploads or commit turns (``cloud.uploads.receive``) and changes nothing on a sync. No grpc.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import nullcontext

from tandem.cloud import metrics
from tandem.cloud.links.negotiation import LinkLimits
from tandem.cloud.links.tenancy import EdgeLimits
from tandem.cloud.sessions.store import SessionStore
from tandem.cloud.sessions.table import CloudSession, SessionTable
from tandem.cloud.turn import as_principal
from tandem.common.protocol.errors import EngineError, InvalidRequest
from tandem.common.protocol.limits import check_session_id
from tandem.common.protocol.params import SyncReply, SyncRequest
from tandem.common.runtime.security import ANONYMOUS_PEER, Principal, scoped
from tandem.common.wire import merkle

log = logging.getLogger("tandem.cloud")


def check_sync_request(req: SyncRequest, limits: LinkLimits, vocab_size: int) -> None:
    """Raises InvalidRequest for ids, token ids, leaf counts, proof or block size outside the limits."""
    if not req.session_id:
        raise InvalidRequest("SyncSession needs a session id", param="session_id", code="missing_required_parameter")
    check_session_id(req.session_id)
    if len(req.link_id.encode()) > 256:
        raise InvalidRequest("link_id longer than 256 bytes", param="link_id", code="string_above_max_length")
    if len(req.token_ids) > limits.max_prompt_tokens or any(t >= vocab_size for t in req.token_ids):
        raise InvalidRequest(f"at most {limits.max_prompt_tokens} token ids, each below the vocabulary size")
    bs = limits.kv_block_size_tokens
    if req.block_size_tokens != bs:
        raise InvalidRequest(f"this cloud cuts KV blocks of {bs} tokens, not {req.block_size_tokens}")
    if req.leaf_count > len(req.token_ids) // bs or not 0 <= req.proof_from <= req.leaf_count:
        raise InvalidRequest(f"{req.leaf_count} leaves (proof {req.proof_from}) for {len(req.token_ids)} tokens")
    if (
        len(req.merkle_root) != 32
        or len(req.consistency_proof) > 64
        or any(len(p) != 32 for p in req.consistency_proof)
    ):
        raise InvalidRequest("a Merkle root and proof hashes are 32 bytes each, at most 64 of them")


def compare(s: CloudSession, req: SyncRequest) -> SyncReply:
    """What the held session ``s`` (at the request's split layer and block size) says to the edge's
    view ``req``: the common prefix of the token ids, and whether the leaves are consistent (see
    ``SessionSync.sync_session``)."""
    held = 0
    for a, b in zip(s.token_ids, req.token_ids, strict=False):
        if a != b:
            break
        held += 1
    m, n, leaves = len(s.leaves), req.leaf_count, list(s.leaves)
    root = merkle.root(leaves)
    if m >= n:
        proven = merkle.root(leaves[:n]) == req.merkle_root
    elif m == 0:
        proven = True  # the empty tree is a prefix of every tree
    else:
        proven = req.proof_from == m and merkle.verify_consistency(
            m, n, root, req.merkle_root, list(req.consistency_proof)
        )
    return SyncReply(
        found=True,
        held_tokens=held,
        held_leaves=m,
        held_root=root,
        proven=proven,
        leaf_hashes=() if proven else tuple(leaves),
    )


class SessionSync:
    """``sessions`` (the memory table, shared with the gateway) over ``store`` (the block store's
    session records). ``edge_limits`` bounds each edge's rate and state; ``limits`` and
    ``vocab_size`` bound a sync request."""

    def __init__(
        self,
        sessions: SessionTable,
        store: SessionStore,
        edge_limits: EdgeLimits,
        limits: LinkLimits,
        vocab_size: int,
    ) -> None:
        self.sessions, self.store, self.edge_limits = sessions, store, edge_limits
        self.limits, self.vocab_size = limits, vocab_size
        sessions.on_drop = lambda key, s, reason: metrics.record_cloud_session_end(reason)

    async def end_session(self, session_id: str, caller: Principal | str = ANONYMOUS_PEER) -> bool:
        """``EndSession``: drop the caller's session ``session_id`` here and in the store, once its
        turns in flight ended; True if either held it.

        Raises:
            InvalidRequest: an empty session id, or one ``check_session_id`` refuses (not text, longer
                than ``MAX_ID_BYTES`` bytes).
            EngineError: a shared store could not be written.
        """
        if not session_id:
            raise InvalidRequest("EndSession needs a session id", param="session_id", code="missing_required_parameter")
        check_session_id(session_id)
        key = scoped(as_principal(caller), session_id)
        await self.sessions.wait_quiet(key)
        held = self.sessions.discard(key) is not None
        stored = await asyncio.to_thread(self.store.drop, key)
        if held or stored:
            metrics.record_cloud_session_end("ended")
        return held or stored

    async def sweep_loop(self, period_s: float) -> None:
        """Every ``period_s``, drop the sessions idle past the table's ``idle_s`` (memory only: the
        store keeps what a later turn resyncs from). Until cancelled."""
        while True:
            await asyncio.sleep(period_s)
            expired = self.sessions.expire()
            if expired:
                log.info("%d sessions expired (no turn for %.0f s)", len(expired), self.sessions.idle_s)

    async def sync_session(self, req: SyncRequest, caller: Principal | str = ANONYMOUS_PEER) -> SyncReply:
        """``SyncSession``: what this cloud holds of the caller's session ``req.session_id``, checked
        against the edge's view (memory first, else the block store's verified prefix).

        The leaves: when the cloud holds at least the edge's ``n`` leaves, its first ``n`` must
        hash to the edge's root; when it holds ``m < n``, the edge's consistency proof from ``m``
        (RFC 6962 2.1.2, verified as RFC 9162 2.1.4.2) must take the cloud's root to the edge's.
        Otherwise the reply carries the cloud's leaves and the edge names the first wrong one.
        The tokens: the common prefix of the edge's token ids and the cloud's. Nothing changes
        here; the next turn's ``cached_tokens`` cuts the session to what the edge accepted.

        Raises:
            InvalidRequest: ids, token ids, leaf counts, proof or block size outside the limits.
            QuotaExceeded: the edge is over its request rate, or loading the session would pass the
                edge's or the node's session bounds with every session in the way in flight.
            TurnTooLarge: the session alone passes one of those bounds.
        """
        c = as_principal(caller)
        check_sync_request(req, self.limits, self.vocab_size)
        self.edge_limits.check_rate(c)
        key = scoped(c, req.session_id)
        load = self.sessions.get(key) is None  # loading it from the store counts against the bounds
        with (
            self.sessions.turn(key),
            self.edge_limits.hold_state(c, self.sessions, key, len(req.token_ids)) if load else nullcontext(),
        ):
            s = await self.session(key, 1)
        if not s.token_ids or s.split_layer != req.split_layer or s.block_tokens != self.limits.kv_block_size_tokens:
            return SyncReply(found=False)
        return compare(s, req)

    async def session(self, key: str, cached_tokens: int) -> CloudSession:
        """The session ``key`` (in the caller's namespace) an upload is checked against: from the
        memory table, else, when the edge assumes the cloud holds some of it, the verified prefix
        the block store holds (a restarted node, or another replica's session); a fresh one for
        new or stateless turns.

        Raises:
            EngineError: a shared store could not be read.
        """
        s = self.sessions.get(key)
        if s is not None or not key or not cached_tokens:
            return s or CloudSession()
        loaded = await asyncio.to_thread(self.store.load, key)
        if loaded is None or not loaded.session.token_ids:
            return CloudSession()
        s = self.sessions.get(key)  # loaded by another turn meanwhile: one object per session
        if s is None:
            s = loaded.session
            self.sessions.put(key, s)
            self.sessions.evict()
            log.info(
                "session %s loaded from the block store: %d of %d tokens", key, len(s.token_ids), loaded.stored_tokens
            )
            metrics.record_session_load(len(s.token_ids) == loaded.stored_tokens)
        return s

    async def forget(self, key: str) -> None:
        """Drop the session ``key`` here and in the store (its next turn starts from token 0)."""
        self.sessions.discard(key)
        try:
            await asyncio.to_thread(self.store.drop, key)
        except EngineError as e:
            log.warning("session %s not dropped from the block store (%s)", key, e)
