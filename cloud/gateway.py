"""The cloud gateway: a turn from verified upload to streamed tokens.

``Gateway.run_turn`` is the main loop of a request and reads like the design's
data path: receive and verify the upload -> commit it into the session (head KV
blocks into the store) -> tail prefill (prompt_embeds, saves tail KV, samples the
first token) -> decode (loads all layers of the aligned prefix). It takes domain
messages and yields domain events; ``cloud.service`` adapts it to gRPC.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import numpy as np

from tandem.cloud.admission import UploadBudget
from tandem.cloud.config import CloudConfig
from tandem.cloud.engines import EngineBackend, TailResult
from tandem.cloud.links import ControllerConfig, LinkSlo, LinkTable, Ticket
from tandem.cloud.negotiation import LinkLimits, LinkVersions, ack_threshold_bytes, link_params
from tandem.cloud.rates import CloudRates
from tandem.cloud.sessions import CloudSession, SessionTable
from tandem.cloud.sessionstore import SessionStore
from tandem.cloud.tenancy import EdgeLimits, EdgeOverLimit
from tandem.cloud.upload import MAX_ID_BYTES, TurnUpload, check_header, upload_bound_bytes
from tandem.common import merkle, metrics, wire
from tandem.common.errors import (
    DeadlineExceeded,
    EngineError,
    IncompatibleModel,
    InvalidRequest,
    MerkleMismatch,
    ParamsVersionMismatch,
    PermissionDenied,
    SessionOutOfSync,
    UploadTimeout,
)
from tandem.common.ewma import Ewma
from tandem.common.kvblocks import (
    LayerRange,
    activation_keys,
    block_nbytes,
    hash_seed,
    kv_scope,
    part_key,
    request_seed,
)
from tandem.common.kvparams import KVTransferSpec, PartSpec
from tandem.common.kvstore import BlockStore
from tandem.common.logs import bind_request, turn_log
from tandem.common.manifest import SplitManifest
from tandem.common.messages import (
    Commit,
    DownEvent,
    KVBlock,
    Nack,
    Repair,
    TokensOut,
    TurnFinal,
    TurnHeader,
    UploadAck,
    WindowAck,
)
from tandem.common.params import (
    LinkParams,
    Negotiated,
    NegotiateOffer,
    Sampling,
    ServerInfo,
    ServerLoad,
    SyncReply,
    SyncRequest,
)
from tandem.common.security import ANONYMOUS_PEER, Principal, scoped
from tandem.common.tracing import span, traced
from tandem.common.wire import Codec
from tandem.stages import Stage, Timings

UplinkBody = wire.Chunk | KVBlock | Commit
HEADER_SLACK_BYTES = 4096  # protobuf framing and the header's fixed fields
PIN_GRACE_S = 60.0  # a request's pins outlive its deadline by this much (then they lapse: its gateway died)
# the longest a pin lasts without its unpin (a request without a deadline, or with a far one from the
# client): its blocks matter only until the decode engine loaded them, at the start of its decode
PIN_MAX_LEASE_S = 3600.0
MAX_PROBE_BYTES = 1 << 20  # padding of an edge's goodput probe (GetServerInfo) the server accepts
T = TypeVar("T")
log = logging.getLogger("tandem.cloud")


async def bounded(
    it: AsyncIterator[T], deadline: float | None, on_timeout: Callable[[], Exception]
) -> AsyncIterator[T]:
    """Items of ``it``, each awaited no later than ``deadline`` (event-loop time; None = no bound).
    The bound applies to waiting for the next item only, never to the consumer's time between items.

    Raises:
        ``on_timeout()``: the deadline passed while waiting.
    """
    ait = it.__aiter__()
    while True:
        try:
            async with asyncio.timeout_at(deadline):
                item = await ait.__anext__()
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise on_timeout() from None
        yield item


@dataclass
class Turn:
    """One request in flight: its header, deadline (event-loop time, None = none) and timings."""

    header: TurnHeader
    deadline: float | None
    t_start: float = field(default_factory=time.perf_counter)
    timings: Timings = field(default_factory=dict)
    received_bytes: dict[str, int] = field(default_factory=dict)
    t_engine: float | None = None  # when its first engine request started (queue time)
    # the engines' request id: the cloud's own, so that an id from the wire can never name (and
    # collide with or abort) another edge's request inside vLLM; logs carry both
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    params: LinkParams | None = None  # the link params it runs under (its header's version)
    caller: Principal = ANONYMOUS_PEER  # who sent it (the edge's identity)
    pinned: set[str] = field(default_factory=set)  # block-store keys pinned for it (owner: engine_id)
    ended: bool = False  # its call is over (a pin that finishes later releases its own keys: ``_pin``)

    @property
    def session_key(self) -> str:
        """The session's key here: its id in the caller's namespace ("" when stateless)."""
        return scoped(self.caller, self.header.session_id)

    def time(self, stage: Stage, t0: float) -> None:
        self.timings[stage] = (time.perf_counter() - t0) * 1e3

    def engine_start(self) -> None:
        if self.t_engine is None:
            self.t_engine = time.perf_counter()


class PrefixKeeper:
    """Makes a session turn's upload resumable when it is cut: at each window
    ack, the verified prefix of the upload (``TurnUpload.verified_prefix``) is committed into the
    session and saved beside the blocks (its head KV blocks, ``SessionStore`` record and pieces),
    off the upload's path; once saved it is acknowledged (``WindowAck.held_tokens``) and a resumed
    upload, on this node, a restarted one or another replica, starts there. One keep at a time
    per upload; a keep still running when the upload is cut completes on its own.

    Who calls: ``Gateway._verify_items`` (``kick``) and ``Gateway._run`` (``settle``, before the
    turn's own commit)."""

    def __init__(self, gateway: Gateway, turn: Turn, upload: TurnUpload) -> None:
        self.gateway, self.turn, self.upload = gateway, turn, upload
        self.task: asyncio.Task | None = None
        self.stopped = False

    def kick(self) -> None:
        """Start keeping the verified prefix, if it grew and no keep is running."""
        up = self.upload
        if self.stopped or (self.task is not None and not self.task.done()):
            return
        n = up.verified_prefix()
        if n <= max(up.kept_tokens, up.header.cached_tokens):
            return
        parts, leaves = up.prefix_parts(n)  # references: the copy is made in the keep's thread
        blocks = up.new_blocks(up.kept_leaves, n // up.bs)
        self.task = self.gateway._in_background(self._keep(n, parts, leaves, blocks))

    async def settle(self) -> None:
        """No more keeps; wait for the one running (its state is what the turn's commit builds on)."""
        self.stopped = True
        if self.task is not None:
            await asyncio.shield(self.task)

    async def _keep(
        self, n: int, parts: list[np.ndarray], leaves: list[bytes], blocks: list[tuple[bytes, bytes]]
    ) -> None:
        gw, up, sid = self.gateway, self.upload, self.turn.session_key
        try:
            hidden = await asyncio.to_thread(lambda: np.ascontiguousarray(np.concatenate(parts)[:n], np.float32))
            head = gw.head_part(up.header.split_layer)
            await gw._pin(self.turn, [part_key(leaf, head) for leaf, _ in blocks])
            await asyncio.to_thread(gw._put_head_blocks, blocks, head)
            up.kept_leaves = max(up.kept_leaves, n // up.bs)
            session = up.session
            async with asyncio.timeout_at(self.turn.deadline), session.lock:
                current = gw.sessions.get(sid)
                if current is not None and current is not session:
                    raise SessionOutOfSync("another turn created the session during the upload")
                up.apply_prefix(session, n, hidden, leaves)
                gw.sessions.put(sid, session)
                saved = replace(session, token_ids=list(session.token_ids), leaves=list(session.leaves))
            gw.sessions.evict()
            await asyncio.to_thread(gw.session_store.save, sid, saved, max(up.kept_tokens, up.header.cached_tokens))
            up.kept_tokens = n
        except (SessionOutOfSync, TimeoutError, EngineError) as e:
            self.stopped = True
            log.info("session %s: the upload's prefix of %d tokens not kept (%s)", sid, n, e)


def as_principal(caller: Principal | str) -> Principal:
    """A caller given as a plain string (in-process links, tests) is a ``peer`` principal."""
    return caller if isinstance(caller, Principal) else Principal("peer", caller)


class Gateway:
    """Holds the links and their params, sessions, block store and engines of one cloud node.

    ``manifest`` is the primary split (its model, shape and tokenizer); ``extra_manifests`` are
    splits of the same model at other layers, each with its own tail engine."""

    def __init__(
        self,
        cfg: CloudConfig,
        manifest: SplitManifest,
        engines: EngineBackend,
        store: BlockStore,
        extra_manifests: tuple[SplitManifest, ...] = (),
    ):
        self.cfg, self.manifest, self.engines, self.store = cfg, manifest, engines, store
        self.tails = {m.split_layer: m for m in (manifest, *extra_manifests)}
        if any(m.weights_blake3 != manifest.weights_blake3 or m.shape != manifest.shape for m in extra_manifests):
            raise ValueError("every split directory must hold the same model (weights and shape)")
        self.instance_id = uuid.uuid4().hex  # a restarted cloud has another: edges renegotiate
        self.serving = True  # mirrors the node's health (engines restarting, draining: False)
        self.sessions = SessionTable(cfg.max_sessions, cfg.session_bytes)
        self.session_store = SessionStore(store, manifest.shape.hidden_size)
        # work that outlives its turn: a cut upload's kept prefix, a stateless turn's drop after late writes
        self._background: set[asyncio.Task] = set()
        self.budget = UploadBudget(
            cfg.max_uploads, cfg.max_upload_bytes, cfg.max_uploads_per_peer, cfg.max_upload_bytes_per_peer
        )
        e = cfg.engine
        self.limits = LinkLimits(
            chunk_tokens=min(cfg.chunk_tokens, cfg.max_chunk_tokens),
            max_chunk_tokens=cfg.max_chunk_tokens,
            wire_dtypes=tuple(cfg.wire_dtypes),
            kv_wire_dtypes=tuple(cfg.kv_wire_dtypes),
            codecs=tuple(cfg.codecs),
            codec_level=cfg.codec_level,
            kv_block_size_tokens=e.block_size_tokens,
            max_prompt_tokens=min(cfg.max_prompt_tokens, e.max_model_len_tokens - 1),
            max_new_tokens=cfg.max_new_tokens,
            max_chunk_resends=cfg.max_chunk_resends,
        )
        self.links = LinkTable(
            e.max_num_seqs,
            e.max_num_batched_tokens,
            max_links=cfg.max_links,
            idle_s=cfg.link_idle_s,
            max_queue=cfg.max_queue_per_link,
            max_queue_wait_s=cfg.max_queue_wait_s,
            controller=ControllerConfig(interval_s=cfg.slo_interval_s, window_s=cfg.slo_window_s),
        )
        self._versions: dict[str, LinkVersions] = {}
        self._owners: dict[str, str] = {}  # link id -> str(principal) that negotiated it
        sh = manifest.shape
        self.edge_limits = EdgeLimits(
            cfg.edge_rate_limit,
            cfg.edge_max_sessions,
            cfg.edge_max_stored_bytes,
            block_nbytes(LayerRange(0, sh.num_layers), sh.num_kv_heads, e.block_size_tokens, sh.head_dim),
            e.block_size_tokens,
            4 * sh.hidden_size,
        )
        self.rates = CloudRates()
        self._kv_usage = (float("-inf"), 0.0)  # (when read, value)
        # the anonymous link (headers without a link id): every split this cloud serves, no measurements
        keys = {k: m.compatibility_key() for k, m in self.tails.items()}
        self._register("", NegotiateOffer("", manifest.model_id, keys))
        anonymous = self.links.get("")
        assert anonymous is not None
        anonymous.last_seen = float("-inf")  # holds no share until a request uses it
        metrics.watch_cloud(self.sessions, self.budget, store)
        metrics.watch_links(self.links)

    @property
    def params(self) -> LinkParams:
        """The anonymous link's params at the primary split layer (what a plain client gets)."""
        return self._versions[""].current[self.manifest.split_layer]

    def head_part(self, k: int) -> LayerRange:
        return LayerRange(0, k)

    def tail_part(self, k: int) -> LayerRange:
        return LayerRange(k, self.manifest.shape.num_layers)

    def negotiate(self, offer: NegotiateOffer, caller: Principal | str = ANONYMOUS_PEER) -> Negotiated:
        """Agree on params with an edge: one set per split layer both sides hold, plus direct mode.
        An edge whose heads this cloud has no tail for gets direct mode and a note saying so,
        never a silent change. Renegotiating (``offer.link_id`` known and negotiated by the same
        ``caller``) keeps the link and its share and makes a new params version if anything
        changed; a link id of another caller is never reused (the caller gets a new link).

        Raises:
            IncompatibleModel: a head of the edge differs from this cloud's tail at the same ``k``
                (other weights, dtype or shape), or the edge serves another model.
            InvalidRequest: bad ids, or no wire format in common.
        """
        if len(offer.edge_id.encode()) > MAX_ID_BYTES or len(offer.link_id.encode()) > MAX_ID_BYTES:
            raise InvalidRequest(f"edge_id and link_id are at most {MAX_ID_BYTES} bytes")
        bad = {
            k: key for k, key in offer.head_keys.items() if k in self.tails and key != self.tails[k].compatibility_key()
        }
        if bad:
            k = min(bad)
            raise IncompatibleModel(
                f"edge head at k={k} ({bad[k]!r}) does not match this cloud's tail at k={k} "
                f"({self.tails[k].compatibility_key()!r}): both sides must be cut from the same weights"
            )
        owner = str(as_principal(caller))
        known = offer.link_id and offer.link_id in self._versions and self._owners.get(offer.link_id) == owner
        if not known:
            self._make_room_for_a_link(owner)
        link_id = offer.link_id if known else f"{offer.edge_id[:48] or 'edge'}-{uuid.uuid4().hex}"
        self._owners[link_id] = owner
        rec = self._register(link_id, offer)
        lacking = sorted(set(offer.head_keys) - set(rec.split_layers))
        note = ""
        if lacking and not set(offer.wire_dtypes) & set(self.limits.wire_dtypes):
            note = (
                f"no common activation format (the edge accepts {[d.name for d in offer.wire_dtypes]}, this cloud "
                f"{[d.name for d in self.limits.wire_dtypes]}): direct mode only"
            )
        elif lacking and not set(offer.kv_wire_dtypes) & set(self.limits.kv_wire_dtypes):
            note = (
                f"no common KV block format (the edge accepts {[d.name for d in offer.kv_wire_dtypes]}, this cloud "
                f"{[d.name for d in self.limits.kv_wire_dtypes]}): direct mode only"
            )
        elif lacking:
            note = f"this cloud serves tails for k in {sorted(self.tails)}; no tail for the edge's k in {lacking}" + (
                "" if rec.split_layers else ": direct mode only"
            )
        if note:
            log.warning("link %s: %s", link_id, note)
        return Negotiated(
            link_id,
            dict(rec.current),
            tuple(sorted(self.tails)),
            note,
            self.cfg.cloud_id,
            self.manifest.model_id,
            self.instance_id,
        )

    def _make_room_for_a_link(self, owner: str) -> None:
        """Keep ``owner`` within ``edge_max_links``: forget its least recently used idle links.

        Raises:
            EdgeOverLimit: all of its links are busy.
        """
        mine = [lid for lid, o in self._owners.items() if o == owner]
        while len(mine) >= self.cfg.edge_max_links:
            links = {lid: self.links.get(lid) for lid in mine}
            idle = [
                (link.last_seen if link is not None else float("-inf"), lid)
                for lid, link in links.items()
                if link is None or not link.busy
            ]
            if not idle:
                raise EdgeOverLimit(
                    f"this edge holds {len(mine)} links, all busy; its bound is {self.cfg.edge_max_links}"
                )
            _, victim = min(idle)
            self.links.forget(victim)
            self._versions.pop(victim, None)
            self._owners.pop(victim, None)
            mine.remove(victim)
            log.info("link %s forgotten: its edge negotiated more than %d links", victim, self.cfg.edge_max_links)

    def _register(self, link_id: str, offer: NegotiateOffer) -> LinkVersions:
        self.links.register(link_id, offer.edge_id, LinkSlo(offer.ttft_slo_ms, offer.itl_p99_slo_ms))
        common = tuple(sorted(k for k in offer.head_keys if k in self.tails))
        if not (  # split needs a common activation format and a common KV format
            set(offer.kv_wire_dtypes) & set(self.limits.kv_wire_dtypes)
            and set(offer.wire_dtypes) & set(self.limits.wire_dtypes)
        ):
            common = ()
        rec = self._versions.get(link_id)
        if rec is None:
            rec = self._versions[link_id] = LinkVersions(offer, common)
        rec.offer, rec.split_layers = offer, common
        self._refresh(link_id)
        self._forget_gone_links()
        return rec

    def _refresh(self, link_id: str) -> bool:
        """Recompute a link's params from its offer and current share; True if a new version was made."""
        rec = self._versions[link_id]
        share = self.links.share(link_id)
        by_split = {
            k: link_params(self.limits, self.tails.get(k, self.manifest), k, rec.offer, share, 0)
            for k in (0, *rec.split_layers)
        }
        return rec.update(by_split)

    def _forget_gone_links(self) -> None:
        known = {link.link_id for link in self.links.links()}
        for link_id in [x for x in self._versions if x not in known and x]:
            del self._versions[link_id]
            self._owners.pop(link_id, None)

    def control_step(self) -> list[str]:
        """One step of the p99 SLO controller (``cloud.links``): links whose share changed get a
        new params version (requests in flight finish under theirs). Returns those link ids."""
        changed = [x for x in self.links.control_step() if x in self._versions and self._refresh(x)]
        if changed:
            log.info("SLO controller: new params for links %s", changed)
        trace = self.links.trace
        if self.cfg.slo_trace_file is not None and trace:
            step = list(itertools.takewhile(lambda p: p.t_s == trace[-1].t_s, reversed(trace)))
            self._write_trace(step[::-1])
        return changed

    def _write_trace(self, points: list) -> None:
        """Append controller trace points as JSON lines (``slo_trace_file``); edge ids name the links."""
        assert self.cfg.slo_trace_file is not None
        lines = []
        for pt in points:
            link = self.links.get(pt.link_id)
            row = dataclasses.asdict(pt) | {"edge_id": link.edge_id if link else "", "time": time.time()}
            lines.append(json.dumps(row) + "\n")
        with self.cfg.slo_trace_file.open("a") as f:
            f.writelines(lines)

    async def control_loop(self) -> None:
        """Run ``control_step`` every ``slo_interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.cfg.slo_interval_s)
            try:
                self.control_step()
            except Exception:  # the controller must never stop serving
                log.exception("SLO controller step failed")

    def load(self, link_id: str = "") -> ServerLoad:
        """The node's load and measured rates; the counts of ``link_id`` when it is known."""
        link = self.links.get(link_id)
        r = self.rates
        return ServerLoad(
            running_requests=self.links.running,
            waiting_requests=self.links.waiting,
            kv_cache_usage=self._kv_cache_usage(),
            tail_prefill_ms_per_token={k: e.value for k, e in r.tail_prefill_ms_per_token.items()},
            prefill_ms_per_token=r.prefill_ms_per_token.value,
            decode_ms_per_token=r.decode_ms_per_token.value,
            queue_wait_ms=r.queue_wait_ms.value,
            link_running=link.running if link else 0,
            link_waiting=link.waiting if link else 0,
        )

    def _kv_cache_usage(self) -> float:
        """vLLM's KV cache use, read from the metrics registry at most once a second (it walks every metric)."""
        now = time.monotonic()
        if now - self._kv_usage[0] >= 1.0:
            self._kv_usage = (now, metrics.vllm_kv_cache_usage())
        return self._kv_usage[1]

    def server_info(self, link_id: str, caller: Principal | str = ANONYMOUS_PEER) -> ServerInfo:
        """``GetServerInfo``: the load, and the link's current params when the link is known here and
        was negotiated by ``caller`` (another caller's link is reported unknown)."""
        if link_id and self._owners.get(link_id) != str(as_principal(caller)):
            link_id = ""
        rec = self._versions.get(link_id) if link_id else None
        return ServerInfo(
            self.cfg.cloud_id,
            self.instance_id,
            self.load(link_id),
            rec is not None,
            dict(rec.current) if rec is not None else {},
            tuple(sorted(self.tails)),
            self.serving,
        )

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
            QuotaExceeded: the edge is over its request rate.
        """
        c = as_principal(caller)
        lim = self.limits
        if not req.session_id or len(req.session_id.encode()) > MAX_ID_BYTES or len(req.link_id.encode()) > 256:
            raise InvalidRequest(f"SyncSession needs a session id of 1..{MAX_ID_BYTES} bytes")
        vocab = self.manifest.shape.vocab_size
        if len(req.token_ids) > lim.max_prompt_tokens or any(t >= vocab for t in req.token_ids):
            raise InvalidRequest(f"at most {lim.max_prompt_tokens} token ids, each below the vocabulary size")
        bs = lim.kv_block_size_tokens
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
        self.edge_limits.check_rate(c)
        key = scoped(c, req.session_id)
        if self.sessions.get(key) is None:  # loading it from the store counts against the edge's bounds
            self.edge_limits.check_state(c, self.sessions, key, len(req.token_ids))
        s = await self._session(key, 1)
        if not s.token_ids or s.split_layer != req.split_layer or s.block_tokens != bs:
            return SyncReply(False)
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
        return SyncReply(True, held, m, root, proven, () if proven else tuple(leaves))

    def _params_for(self, header: TurnHeader, caller: Principal) -> LinkParams:
        """The params the header's request runs under: its link's version ``params_version`` at its k.

        Raises:
            ParamsVersionMismatch: unknown link (e.g. this cloud restarted) or version: renegotiate.
            PermissionDenied: the link was negotiated by another edge.
        """
        rec = self._versions.get(header.link_id)
        if rec is None:
            raise ParamsVersionMismatch(f"link {header.link_id[:64]!r} is unknown to this cloud: renegotiate")
        if header.link_id and self._owners.get(header.link_id) != str(caller):
            raise PermissionDenied(f"link {header.link_id[:64]!r} belongs to another edge")
        return rec.params(header.params_version, header.split_layer)

    def max_message_bytes(self) -> int:
        """The largest legal message under any link's params: a chunk of ``max_chunk_tokens`` in the
        widest allowed format, a KV block of the deepest split, a header of ``max_prompt_tokens`` token
        ids (5 bytes each as varints), or a goodput probe (``MAX_PROBE_BYTES`` of padding)."""
        lim, sh = self.limits, self.manifest.shape
        widest = max(wire.raw_nbytes_of(lim.max_chunk_tokens, d, sh.hidden_size) for d in lim.wire_dtypes)
        block = block_nbytes(self.head_part(max(self.tails)), sh.num_kv_heads, lim.kv_block_size_tokens, sh.head_dim)
        codec = Codec.ZSTD if Codec.ZSTD in lim.codecs else Codec.NONE
        return (
            max(
                wire.max_payload_bytes(widest, codec),
                wire.max_payload_bytes(block, codec),
                5 * lim.max_prompt_tokens,
                MAX_PROBE_BYTES,
            )
            + HEADER_SLACK_BYTES
        )

    async def run_turn(
        self,
        header: TurnHeader,
        uplink: AsyncIterator[UplinkBody],
        caller: Principal | str = ANONYMOUS_PEER,
        deadline: float | None = None,
    ) -> AsyncIterator[DownEvent]:
        """One request: the edge's own bounds (``cloud.tenancy``), admission into its link's share,
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
        mode = "split" if header.split_layer else "direct"
        with (
            bind_request(header.request_id, header.session_id),
            turn_log(log, mode) as done_fields,
            metrics.cloud_turn(mode, turn),
            span("cloud_turn", mode=mode, request_id=header.request_id, session_id=header.session_id),
        ):
            done_fields.update(engine_id=turn.engine_id, link_id=header.link_id)
            t_last: float | None = None
            try:
                async for ev in self._run(turn, uplink):
                    if isinstance(ev, TokensOut) and ev.token_ids:
                        now = time.perf_counter()
                        if t_last is None:
                            self.links.record_ttft(header.link_id, (now - turn.t_start) * 1e3)
                        else:
                            self.links.record_itl(header.link_id, (now - t_last) * 1e3 / len(ev.token_ids))
                        t_last = now
                    if isinstance(ev, TurnFinal):
                        done_fields.update(
                            prompt_tokens=ev.prompt_tokens, output_tokens=ev.output_tokens, finish=ev.finish_reason
                        )
                    yield ev
            finally:
                turn.ended = True
                if turn.pinned:
                    await self._unpin(turn)

    async def _admit(self, turn: Turn) -> Ticket:
        """Wait for a slot in the link's share (``cloud.links``); records the wait.

        Raises:
            QuotaExceeded: ``LinkBusy`` (queue full, or no slot before the deadline / queue wait bound).
        """
        ticket = await self.links.admit(turn.header.link_id, len(turn.header.prompt_token_ids), turn.deadline)
        turn.timings[Stage.CLOUD_QUEUE] = ticket.queued_ms
        self.rates.queue_wait_ms.add(ticket.queued_ms)
        return ticket

    async def _run(self, turn: Turn, uplink: AsyncIterator[UplinkBody]) -> AsyncIterator[DownEvent]:
        """The turn itself (``run_turn`` adds its log ids, logs, metrics and span)."""
        header = turn.header
        params = turn.params = self._params_for(header, turn.caller)
        k = header.split_layer
        manifest = self.tails.get(k, self.manifest)
        check_header(header, params, manifest)
        self.edge_limits.check_rate(turn.caller)
        if k:
            self.edge_limits.check_state(turn.caller, self.sessions, turn.session_key, len(header.prompt_token_ids))
        with await self._admit(turn) as ticket:
            if not k:
                async for ev in self._decode(turn, list(header.prompt_token_ids), None, header.sampling, 0, ticket):
                    yield ev
                return
            with self.budget.reserve(str(turn.caller), upload_bound_bytes(header, params, manifest)):
                upload = TurnUpload(
                    header,
                    params,
                    manifest,
                    await self._session(turn.session_key, header.cached_tokens),
                    self._seed(header),
                    self.cfg.max_abs_activation,
                )
                keeper = PrefixKeeper(self, turn, upload) if turn.session_key else None
                try:
                    async for ev in self._receive(turn, upload, uplink, keeper):
                        yield ev
                    if keeper is not None:
                        await keeper.settle()
                    hidden, leaves = await self._commit(turn, upload)
                except MerkleMismatch:
                    if keeper is not None:
                        await keeper.settle()  # a keep still running may yet keep leaves
                        if upload.kept_leaves > upload.first_new_leaf:  # leaves the edge's root does not cover
                            await self._forget_session(turn.session_key)
                    raise
                finally:
                    metrics.record_received(upload.received_bytes, sum(upload.resends.values()))
                    upload.release()
            yield UploadAck(len(header.prompt_token_ids), len(leaves))
            tail_keys = activation_keys(hidden, params.kv_block_size_tokens, self._tail_seed(turn), self.tail_part(k))
            spec = KVTransferSpec(
                loads=(PartSpec(self.head_part(k), tuple(leaves)), PartSpec(self.tail_part(k), tuple(tail_keys)))
            )
            tail_store_keys = [spec.loads[1].store_key(j) for j in range(len(tail_keys))]
            tail_saves: list[str] = []  # tail keys the tail engine may still be writing (after token 1)
            try:
                await self._pin(turn, tail_store_keys)
                tail = await self._tail_prefill(turn, hidden, tail_keys)
                tail_saves = tail_store_keys
                ticket.prefill_done()
                yield TokensOut((tail.first_token,), 0)
                if tail.finish_reason is not None or header.sampling.max_new_tokens == 1:
                    yield self._final(turn, tail.finish_reason or "length", 1, 0)
                    return
                # decode continues from prompt + first token, loading every layer of the aligned prefix
                t0 = time.perf_counter()
                tail_saves = await self._await_tail_saves(tail_saves, turn.deadline)
                turn.time(Stage.CLOUD_TAIL_SAVE_WAIT, t0)
                if tail_saves:
                    metrics.record_tail_save_missing(len(tail_saves))
                    log.warning(
                        "turn %s: %d of %d tail KV blocks not in the store after %.0f ms; the decode engine "
                        "recomputes them",
                        turn.engine_id,
                        len(tail_saves),
                        len(tail_keys),
                        turn.timings[Stage.CLOUD_TAIL_SAVE_WAIT],
                    )
                ids = [*header.prompt_token_ids, tail.first_token]
                rest = replace(header.sampling, max_new_tokens=header.sampling.max_new_tokens - 1)
                async for ev in self._decode(turn, ids, spec, rest, 1, ticket):
                    yield ev
            finally:
                if not turn.session_key:  # a stateless request's KV is reusable by no one: drop it
                    if tail_saves:  # once its late writes land, or they would outlive the drop; off the turn
                        self._in_background(self._drop_when_written(spec, tail_saves))
                    else:
                        await asyncio.to_thread(self._drop_blocks, spec)

    # ------------------------------------------------------------------ stages

    def _absent(self, keys: list[str]) -> list[str]:
        return [k for k in keys if not self.store.contains(k)]

    async def _await_tail_saves(self, keys: list[str], deadline: float | None) -> list[str]:
        """Wait until the tail engine's KV writes of ``keys`` are in the store: the connector writes
        them on its own thread after the first token (``TandemConnector.wait_for_save``). Polls
        ``BlockStore.contains`` (every 2 ms, backing off to 20 ms) until all are there, for at most
        ``tail_save_wait_s`` and never past ``deadline`` (event-loop time). Returns the keys still
        missing: their readers recompute them (the decode engine: its connector's own presence
        check). A store that cannot be read counts as missing. Raises only on cancellation."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.cfg.tail_save_wait_s
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

    def _in_background(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task:
        """Run ``coro`` past the turn that started it; ``finish_background`` awaits what is left."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def finish_background(self, timeout_s: float) -> None:
        """At shutdown: wait up to ``timeout_s`` for the background work of finished turns (kept
        prefixes, late drops), then cancel what is left (its blocks age out of the store)."""
        if not self._background:
            return
        _, pending = await asyncio.wait(set(self._background), timeout=timeout_s)
        for task in pending:
            task.cancel()

    async def _drop_when_written(self, spec: KVTransferSpec, pending: list[str]) -> None:
        """A stateless turn's drop once the tail writes ``pending`` landed (or ``tail_save_wait_s``
        passed: a write landing later ages out of the store)."""
        missing = await self._await_tail_saves(pending, None)
        if missing:
            log.info("dropping a stateless turn's KV with %d tail blocks not yet written", len(missing))
        await asyncio.to_thread(self._drop_blocks, spec)

    async def _session(self, key: str, cached_tokens: int) -> CloudSession:
        """The session ``key`` (in the caller's namespace) an upload is checked against: from the
        memory table, else, when the edge assumes the cloud holds some of it, the verified prefix
        the block store holds (a restarted node, or another replica's session); a fresh one for
        new or stateless turns."""
        s = self.sessions.get(key)
        if s is not None or not key or not cached_tokens:
            return s or CloudSession()
        loaded = await asyncio.to_thread(self.session_store.load, key)
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

    async def _pin(self, turn: Turn, keys: list[str]) -> None:
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
            await self._release(new, turn.engine_id)

    async def _unpin(self, turn: Turn) -> None:
        """Release every pin of ``turn`` (the set is emptied before the store call)."""
        keys = sorted(turn.pinned)
        turn.pinned.clear()
        await self._release(keys, turn.engine_id)

    async def _release(self, keys: list[str], owner: str) -> None:
        if not keys:
            return
        try:
            await asyncio.to_thread(self.store.unpin, keys, owner)
        except EngineError as e:
            log.warning("could not unpin a request's KV blocks (%s): their lease lapses", e)

    async def _forget_session(self, key: str) -> None:
        """Drop the session ``key`` here and in the store (its next turn starts from token 0)."""
        self.sessions.discard(key)
        try:
            await asyncio.to_thread(self.session_store.drop, key)
        except EngineError as e:
            log.warning("session %s not dropped from the block store (%s)", key, e)

    def _drop_blocks(self, spec: KVTransferSpec) -> None:
        """Delete a finished stateless request's head and tail KV blocks from the store."""
        try:
            for part in spec.loads:
                for j in range(len(part.keys)):
                    self.store.delete(part.store_key(j))
        except EngineError as e:
            log.warning("could not drop a stateless request's KV blocks (%s): they age out of the store", e)

    def _seed(self, header: TurnHeader) -> bytes:
        """Seed of the head blocks' ids, as the edge computes it (``common.kvblocks.request_seed``)."""
        key = self.tails.get(header.split_layer, self.manifest).compatibility_key()
        return request_seed(key, self.limits.kv_block_size_tokens, header.session_id, header.request_id)

    def _tail_seed(self, turn: Turn) -> bytes:
        """Seed of the tail blocks' store keys: the request's sharing scope inside the caller's
        namespace, so one edge's tail KV is never loaded for another edge's request (no cache
        hits across edges, hence no timing channel that reveals another edge's prompts)."""
        h = turn.header
        key = self.tails.get(h.split_layer, self.manifest).compatibility_key()
        scope = f"{turn.caller.tag}|{kv_scope(h.session_id, h.request_id)}"
        return hash_seed(key, self.limits.kv_block_size_tokens, scope)

    def _upload_deadline(self, turn: Turn) -> float:
        loop_deadline = asyncio.get_running_loop().time() + self.cfg.upload_timeout_s
        return loop_deadline if turn.deadline is None else min(loop_deadline, turn.deadline)

    @traced("cloud_upload")
    async def _receive(
        self, turn: Turn, upload: TurnUpload, uplink: AsyncIterator[UplinkBody], keeper: PrefixKeeper | None
    ) -> AsyncIterator[Nack | Repair | WindowAck]:
        """Verify the upload item by item (decoding off the event loop), within the upload deadline."""

        def late() -> Exception:
            return UploadTimeout(f"upload not complete within {self.cfg.upload_timeout_s:.0f} s or the deadline")

        async for ev in self._verify_items(upload, bounded(uplink, self._upload_deadline(turn), late), keeper):
            yield ev
        turn.time(Stage.CLOUD_UPLOAD_WAIT, turn.t_start)
        turn.received_bytes = dict(upload.received_bytes)

    async def _verify_items(
        self, upload: TurnUpload, uplink: AsyncIterator[UplinkBody], keeper: PrefixKeeper | None = None
    ) -> AsyncIterator[Nack | Repair | WindowAck]:
        """Check each item as it arrives. Payload received (each chunk and KV block once; resends do
        not count) is acknowledged (``WindowAck``) every quarter window (``ack_threshold_bytes``):
        the edge's flow control, which it honours as a sender honours TCP's window. The cloud's
        memory does not depend on it: the upload's bytes are reserved at its header
        (``UploadBudget``) and gRPC's flow control holds back what the gateway has not read. With a
        session, each such ack also has ``keeper`` keep the verified prefix, and the next ack
        (``held_tokens``) tells the edge what it may resume from.

        Raises:
            InvalidRequest: an unexpected item, an early close.
        """
        repairs, acked, received, told = 0, 0, 0, upload.header.cached_tokens
        window = upload.params.inflight_window_bytes
        threshold = ack_threshold_bytes(window, upload.max_item_bytes)  # a quarter window (see there)
        seen: set[tuple[str, int]] = set()
        async for item in uplink:
            if isinstance(item, wire.Chunk | KVBlock):
                key = ("chunk", item.seq) if isinstance(item, wire.Chunk) else ("kv", item.leaf_index)
                if key not in seen:
                    seen.add(key)
                    received += len(item.payload)
            if isinstance(item, wire.Chunk):
                if not await asyncio.to_thread(upload.add_chunk, item):
                    log.info("chunk %d failed its CRC32C or did not decode: NACK", item.seq)
                    yield Nack(item.seq, "crc32c mismatch or payload does not decode")
            elif isinstance(item, KVBlock):
                await asyncio.to_thread(upload.add_block, item)
            elif isinstance(item, Commit):
                repair = upload.commit(item.leaf_count, item.merkle_root)
                if repair:
                    repairs += 1
                    if repairs > self.cfg.max_repair_rounds:
                        raise MerkleMismatch(f"KV blocks {repair[:8]} still bad after {repairs - 1} repair rounds")
                    log.info("repair round %d: asking for %d KV blocks again", repairs, len(repair))
                    metrics.record_repair_request(len(repair))
                    yield Repair(tuple(repair), "leaf hash mismatch, block missing or not decodable")
            else:
                raise InvalidRequest(f"unexpected {type(item).__name__} after the header")
            if upload.complete:
                return
            if received - acked >= threshold:
                acked = received
                if keeper is not None:
                    keeper.kick()
                told = max(told, upload.kept_tokens)
                yield WindowAck(received, told if keeper is not None else 0)
            elif keeper is not None and upload.kept_tokens > told:  # a keep finished since the last ack
                told = upload.kept_tokens
                yield WindowAck(acked, told)
        raise InvalidRequest(
            f"uplink closed before the upload completed ({len(upload.chunks)}/"
            f"{upload.header.num_chunks} chunks, committed={upload.committed})"
        )

    async def _commit(self, turn: Turn, upload: TurnUpload) -> tuple[np.ndarray, list[bytes]]:
        """Put the verified head blocks in the store and commit the turn into its session under the
        session's lock, waited for no longer than the request's deadline. Returns the prompt's
        activations ``[T, H]`` and head-KV leaves."""
        t0 = time.perf_counter()
        hidden = upload.activations()
        head = self.head_part(upload.header.split_layer)
        await self._pin(turn, [part_key(leaf, head) for leaf in upload.leaves()])  # earlier turns' blocks too
        blocks = upload.new_blocks(upload.kept_leaves)  # a kept prefix's blocks are in the store already
        await asyncio.to_thread(self._put_head_blocks, blocks, head)
        turn.time(Stage.CLOUD_STORE_PUT, t0)
        sid = turn.session_key
        if not sid:
            return hidden, upload.leaves()
        session = upload.session
        try:
            async with asyncio.timeout_at(turn.deadline), session.lock:
                current = self.sessions.get(sid)
                if current is not None and current is not session:
                    session = current  # another turn created the session meanwhile: version check fails
                upload.apply_to(session, hidden)
                self.sessions.put(sid, session)
                saved = replace(session, token_ids=list(session.token_ids), leaves=list(session.leaves))
        except TimeoutError:
            raise DeadlineExceeded(f"deadline passed waiting for session {sid!r}") from None
        finally:
            self.sessions.evict()
        t0 = time.perf_counter()
        try:  # beside the blocks, so that a restarted node or another replica can serve its next turn
            first_new = max(upload.header.cached_tokens, upload.kept_tokens)
            await asyncio.to_thread(self.session_store.save, sid, saved, first_new)
        except EngineError as e:
            log.warning("session %s not saved to the block store (%s): its next turn elsewhere resends more", sid, e)
        turn.timings[Stage.CLOUD_STORE_PUT] = (
            turn.timings.get(Stage.CLOUD_STORE_PUT, 0.0) + (time.perf_counter() - t0) * 1e3
        )
        return hidden, list(saved.leaves)

    @traced("cloud_store_put")
    def _put_head_blocks(self, blocks: list[tuple[bytes, bytes]], part: LayerRange) -> None:
        for leaf, raw in blocks:
            self.store.put(part_key(leaf, part), raw)

    @traced("cloud_tail_prefill")
    async def _tail_prefill(self, turn: Turn, hidden: np.ndarray, tail_keys: list[bytes]) -> TailResult:
        """Tail engine over ``prompt_embeds = hidden``: loads tail KV of blocks computed from the same
        activations before, saves the rest, samples the first output token."""
        part = PartSpec(self.tail_part(turn.header.split_layer), tuple(tail_keys))
        turn.engine_start()
        try:
            async with asyncio.timeout_at(turn.deadline):
                tail = await self.engines.tail_prefill(
                    turn.engine_id,
                    turn.header.split_layer,
                    hidden,
                    KVTransferSpec(loads=(part,), save=part),
                    turn.header.sampling,
                )
        except TimeoutError:
            raise DeadlineExceeded("deadline passed during the tail prefill") from None
        turn.timings[Stage.CLOUD_TAIL_PREFILL] = tail.elapsed_ms
        computed = hidden.shape[0] - tail.external_tokens
        if computed > 0:
            k = turn.header.split_layer
            self.rates.tail_prefill_ms_per_token.setdefault(k, Ewma()).add(tail.elapsed_ms / computed)
        return tail

    @traced("cloud_decode")
    async def _decode(
        self,
        turn: Turn,
        ids: list[int],
        kv: KVTransferSpec | None,
        sampling: Sampling,
        first_index: int,
        ticket: Ticket,
    ) -> AsyncIterator[DownEvent]:
        """Stream the decode engine's tokens; output indices start at ``first_index``. Updates the
        node's rates: prefill per prompt token (direct mode's first token) and time per output token."""
        t0 = time.perf_counter()
        turn.engine_start()
        n = first_index
        t_first: float | None = None
        steps = self.engines.decode(turn.engine_id, ids, kv, sampling)
        async for step in bounded(steps, turn.deadline, lambda: DeadlineExceeded("deadline passed while decoding")):
            if step.token_ids:
                if n == first_index:
                    turn.time(Stage.CLOUD_DECODE_FIRST_TOKEN, t0)
                    t_first = time.perf_counter()
                    ticket.prefill_done()
                    if kv is None:  # direct mode: the whole prompt was prefilled here
                        self.rates.prefill_ms_per_token.add(turn.timings[Stage.CLOUD_DECODE_FIRST_TOKEN] / len(ids))
                yield TokensOut(tuple(step.token_ids), n)
                n += len(step.token_ids)
            if step.finish_reason is not None:
                turn.time(Stage.CLOUD_DECODE, t0)
                if t_first is not None and n - first_index > 1:
                    per_token = (time.perf_counter() - t_first) * 1e3 / (n - first_index - 1)
                    self.rates.decode_ms_per_token.add(per_token)
                yield self._final(turn, step.finish_reason, n, step.external_tokens)

    def _final(self, turn: Turn, finish_reason: str, output_tokens: int, external_tokens: int) -> TurnFinal:
        n_prompt = len(turn.header.prompt_token_ids)
        return TurnFinal(
            finish_reason,
            n_prompt,
            output_tokens,
            external_tokens,
            turn.timings,
            turn.received_bytes,
            self.load(turn.header.link_id),
            turn.timings.get(Stage.CLOUD_QUEUE, 0.0),
        )
