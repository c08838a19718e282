"""What the edge believes the cloud holds of a split session, and keeping that belief true.

An ``EdgeSession``'s ``cloud_tokens``, ``leaves``, ``block_tokens`` and ``synced_with`` (the
cloud instance that acknowledged them) move when the cloud acknowledges an upload
(``acknowledged``), or part of one that was cut (``keep_acknowledged_prefix``:
``WindowAck.held_tokens``). When the cloud's copy may differ (``needs_sync``: another cloud
instance, a restart or another replica, acknowledged it), ``sync`` asks the cloud
(``SyncSession``) and keeps only what it proves it holds. Called by ``edge.modes.cloud`` with the
session's lock held.
"""

from __future__ import annotations

import logging

from tandem.common.protocol.errors import QuotaExceeded, TandemError
from tandem.common.protocol.params import LinkParams
from tandem.common.runtime.tracing import traced
from tandem.edge import metrics
from tandem.edge.link import framing
from tandem.edge.link.connection import CloudConnection
from tandem.edge.link.uplink import OutgoingTurn
from tandem.edge.session import EdgeSession
from tandem.edge.turn import Turn

log = logging.getLogger("tandem.edge")


def needs_sync(s: EdgeSession, conn: CloudConnection) -> bool:
    """The session's cloud state was acknowledged by another cloud instance (a restart, or
    another replica) than the one ``conn`` is connected to now."""
    now = conn.instance_id
    return bool(s.cloud_tokens) and bool(now) and s.synced_with != now


def acknowledged(s: EdgeSession, out: OutgoingTurn, ids: list[int], conn: CloudConnection) -> None:
    """The cloud verified all of ``out`` (``UploadAck``): it holds the prompt ``ids`` and the leaves
    of every block sent."""
    s.cloud_tokens = len(ids)
    s.leaves = s.leaves + [out.blocks[j].leaf_hash for j in sorted(out.blocks)]
    s.block_tokens = out.block_tokens
    s.synced_with = conn.instance_id


def keep_acknowledged_prefix(s: EdgeSession, out: OutgoingTurn, ids: list[int], conn: CloudConnection) -> None:
    """An upload cut after the cloud acknowledged keeping its first ``out.held_tokens`` prompt
    tokens (``WindowAck.held_tokens``): the session's cloud state moves there (up to the first
    block this turn did not send), so a resumed upload sends only the rest."""
    bs, n = out.block_tokens, out.held_tokens
    new: list[bytes] = []
    for j in range(len(s.leaves), n // bs):
        if j not in out.blocks:  # not a block this turn sent: hold only what precedes it
            n = j * bs
            break
        new.append(out.blocks[j].leaf_hash)
    if n <= s.cloud_tokens:
        return
    s.cloud_tokens, s.leaves, s.block_tokens = n, s.leaves + new, bs
    s.synced_with = conn.instance_id
    metrics.record_upload_kept(n - out.header.cached_tokens)
    log.info("upload cut with %d of %d prompt tokens acknowledged: a resumed upload starts there", n, len(ids))


@traced("edge_sync")
async def sync(turn: Turn, p: LinkParams, compatibility_key: str) -> None:
    """``SyncSession``: set the turn's session's ``cloud_tokens`` and ``leaves`` to what the cloud
    proves it holds.

    The edge sends the Merkle tree of all its full head-KV blocks (``n`` leaves) and a
    consistency proof from the leaves it believes the cloud holds (RFC 6962 2.1.2); the
    cloud checks it, or hands back its leaves and the edge finds the first that differs.
    A cloud that cannot answer (an older one, an error) leaves the session to be resent
    from token 0; one that refuses for the request rate leaves the belief as it is."""
    s, conn, bs = turn.edge_session, turn.cloud, p.kv_block_size_tokens
    if s.block_tokens != bs:
        s.forget_cloud_past(0)
    hashes = framing.block_ids(s.token_ids, p, compatibility_key, turn.session_id, "")
    req, leaves = framing.sync_request(s, hashes, p, conn.link_id, turn.session_id)
    try:
        reply = await conn.link.sync_session(req, max(0.001, min(5.0, turn.timeout_s)))
    except QuotaExceeded as e:  # the edge is over its request rate: keep its belief, the turn will tell
        log.info("SyncSession refused (%s): the turn goes on with what this edge believes", e)
        return
    except TandemError as e:
        log.warning("SyncSession failed (%s): resending the session from token 0", e)
        s.forget_cloud_past(0)
        metrics.record_session_sync("lost")
        return
    if not reply.found:
        ok = 0
    elif reply.proven:
        ok = min(reply.held_leaves, len(leaves))
    else:
        ok = 0
        for mine, theirs in zip(leaves, reply.leaf_hashes, strict=False):
            if mine != theirs:
                break
            ok += 1
    held = min(reply.held_tokens, len(s.token_ids), (ok + 1) * bs - 1) if reply.found else 0
    s.cloud_tokens, s.leaves, s.block_tokens = held, leaves[: held // bs], bs
    s.synced_with = conn.instance_id
    outcome = "lost" if not held else "in_sync" if held == len(s.token_ids) else "partial"
    log.info("SyncSession: the cloud holds %d of %d tokens (%s)", held, len(s.token_ids), outcome)
    metrics.record_session_sync(outcome)
