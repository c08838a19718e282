"""The links of one cloud node: which edge negotiated each, its params versions, its share.

``LinkRegistry`` answers ``Negotiate`` (params per split layer both sides hold, plus direct
mode) and ``GetServerInfo`` (the node's load and a link's current params), keeps each edge
within ``edge_max_links``, looks up the params a request runs under, and runs the p99 SLO
controller of ``cloud.links.table.LinkTable`` (new params versions when a share changes, the
controller's trace). The params themselves come from ``cloud.links.negotiation``; the shares,
admission and the controller's arithmetic from ``cloud.links.table``.

It runs no request and holds no session; single event loop, no grpc.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import re
import time
import uuid

from tandem.cloud.config import CloudConfig
from tandem.cloud.engines import vllm_metrics
from tandem.cloud.links.negotiation import LinkLimits, LinkVersions, link_params
from tandem.cloud.links.rates import CloudRates
from tandem.cloud.links.table import LinkSlo, LinkTable
from tandem.cloud.links.tenancy import EdgeOverLimit
from tandem.cloud.splits import Splits
from tandem.cloud.turn import as_principal
from tandem.common.protocol.errors import IncompatibleModel, InvalidRequest, ParamsVersionMismatch, PermissionDenied
from tandem.common.protocol.limits import MAX_ID_BYTES
from tandem.common.protocol.params import Codec, LinkParams, Negotiated, NegotiateOffer, ServerInfo, ServerLoad
from tandem.common.runtime.security import ANONYMOUS_PEER, Principal
from tandem.common.wire import chunks as wire
from tandem.common.wire.formats import common_formats
from tandem.common.wire.kvblocks import LayerRange, block_nbytes
from tandem.common.wire.messages import TurnHeader

LINK_NAME_CHARS = 48  # the name a link id starts with, before its uuid
_NOT_NAME = re.compile(r"[^A-Za-z0-9._-]")
HEADER_SLACK_BYTES = 4096  # protobuf framing and the header's fixed fields
MAX_PROBE_BYTES = 1 << 20  # padding of an edge's goodput probe (GetServerInfo) the server accepts
log = logging.getLogger("tandem.cloud")


def edge_name(offer: NegotiateOffer, caller: Principal) -> str:
    """Whom a link belongs to, as its id and the controller's trace name it: the caller's
    authenticated name (an API key's name, a client certificate's subject) when the call was
    authenticated, else (a ``peer`` principal: no credentials configured) the ``edge_id`` it claims."""
    return offer.edge_id if caller.kind == "peer" else caller.name


def link_id_for(name: str) -> str:
    """A new link's id: ``name`` in letters, digits, ``.``, ``_`` and ``-`` (any other character
    ``_``), at most ``LINK_NAME_CHARS`` of them ("edge" if none), then ``-`` and 32 hex digits."""
    return f"{_NOT_NAME.sub('_', name[:LINK_NAME_CHARS]) or 'edge'}-{uuid.uuid4().hex}"


class LinkRegistry:
    """Links and their params of one node. ``links`` (the shares) and ``rates`` (written by the
    gateway's stages) are shared with the gateway; ``cfg`` gives ``cloud_id``, ``edge_max_links``
    and the controller's ``slo_interval_s`` / ``slo_trace_file``."""

    def __init__(
        self, cfg: CloudConfig, links: LinkTable, limits: LinkLimits, splits: Splits, rates: CloudRates
    ) -> None:
        self.cfg, self.links, self.limits, self.splits, self.rates = cfg, links, limits, splits, rates
        self.instance_id = uuid.uuid4().hex  # a restarted cloud has another: edges renegotiate
        self._versions: dict[str, LinkVersions] = {}
        self._owners: dict[str, str] = {}  # link id -> str(principal) that negotiated it
        self._kv_usage = (float("-inf"), 0.0)  # (when read, value)
        # the anonymous link (headers without a link id): every split this cloud serves, no measurements
        keys = {k: m.compatibility_key() for k, m in splits.by_layer.items()}
        self._register("", NegotiateOffer(edge_id="", model_id=splits.primary.model_id, head_keys=keys), "")
        anonymous = self.links.get("")
        assert anonymous is not None
        anonymous.last_seen = float("-inf")  # holds no share until a request uses it

    @property
    def params(self) -> LinkParams:
        """The anonymous link's params at the primary split layer (what a plain client gets)."""
        return self._versions[""].current[self.splits.primary.split_layer]

    def negotiate(self, offer: NegotiateOffer, caller: Principal | str = ANONYMOUS_PEER) -> Negotiated:
        """Agree on params with an edge: one set per split layer both sides hold, plus direct mode.
        An edge whose heads this cloud has no tail for gets direct mode and a note saying so,
        never a silent change. Renegotiating (``offer.link_id`` known and negotiated by the same
        ``caller``) keeps the link and its share and makes a new params version if anything
        changed; a link id of another caller is never reused (the caller gets a new link). A new
        link is named by ``edge_name``: an authenticated caller's identity, never the id it claims.

        Raises:
            IncompatibleModel: a head of the edge differs from this cloud's tail at the same ``k``
                (other weights, dtype or shape), or the edge serves another model.
            InvalidRequest: bad ids, or no wire format in common.
        """
        self._check_offer(offer)
        principal = as_principal(caller)
        owner, name = str(principal), edge_name(offer, principal)
        known = offer.link_id and offer.link_id in self._versions and self._owners.get(offer.link_id) == owner
        if not known:
            self._make_room_for_a_link(owner)
        link_id = offer.link_id if known else link_id_for(name)
        self._owners[link_id] = owner
        rec = self._register(link_id, offer, name)
        if not known:
            log.debug("link %s negotiated by %s (edge_id %s)", link_id, owner, offer.edge_id)
        note = self._note(offer, rec)
        if note:
            log.warning("link %s: %s", link_id, note)
        return Negotiated(
            link_id=link_id,
            params_by_split=dict(rec.current),
            split_layers=self.splits.layers,
            note=note,
            cloud_id=self.cfg.cloud_id,
            model_id=self.splits.primary.model_id,
            instance_id=self.instance_id,
        )

    def _check_offer(self, offer: NegotiateOffer) -> None:
        """Raises InvalidRequest (ids too long) or IncompatibleModel (a head of other weights)."""
        for name, value in (("edge_id", offer.edge_id), ("link_id", offer.link_id)):
            if len(value.encode()) > MAX_ID_BYTES:
                raise InvalidRequest(
                    f"edge_id and link_id are at most {MAX_ID_BYTES} bytes", param=name, code="string_above_max_length"
                )
        tails = self.splits.by_layer
        bad = {k: key for k, key in offer.head_keys.items() if k in tails and key != tails[k].compatibility_key()}
        if bad:
            k = min(bad)
            raise IncompatibleModel(
                f"edge head at k={k} ({bad[k]!r}) does not match this cloud's tail at k={k} "
                f"({tails[k].compatibility_key()!r}): both sides must be cut from the same weights"
            )

    def _note(self, offer: NegotiateOffer, rec: LinkVersions) -> str:
        """Why the edge gets fewer splits than it offered ("" when it gets them all)."""
        lacking = sorted(set(offer.head_keys) - set(rec.split_layers))
        unchecked = sorted(set(lacking) & set(self.splits.by_layer) - set(self.splits.checked_layers))
        note = ""
        if unchecked:
            note = (
                f"the heads at k in {unchecked} were not checked against HF (their manifests record no passing "
                "check: run tandem-model again)" + ("" if rec.split_layers else ": direct mode only")
            )
        elif lacking and not common_formats(offer.wire_dtypes, self.limits.wire_dtypes):
            note = (
                f"no common activation format (the edge accepts {[d.name for d in offer.wire_dtypes]}, this cloud "
                f"{[d.name for d in self.limits.wire_dtypes]}): direct mode only"
            )
        elif lacking and not common_formats(offer.kv_wire_dtypes, self.limits.kv_wire_dtypes):
            note = (
                f"no common KV block format (the edge accepts {[d.name for d in offer.kv_wire_dtypes]}, this cloud "
                f"{[d.name for d in self.limits.kv_wire_dtypes]}): direct mode only"
            )
        elif lacking:
            note = (
                f"this cloud serves tails for k in {list(self.splits.layers)}; no tail for the edge's k in {lacking}"
                + ("" if rec.split_layers else ": direct mode only")
            )
        return note

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

    def _register(self, link_id: str, offer: NegotiateOffer, name: str) -> LinkVersions:
        self.links.register(link_id, name, LinkSlo(offer.ttft_slo_ms, offer.itl_p99_slo_ms))
        common = tuple(sorted(k for k in offer.head_keys if k in self.splits.checked_layers))
        if not (  # split needs a common activation format and a common KV format
            common_formats(offer.kv_wire_dtypes, self.limits.kv_wire_dtypes)
            and common_formats(offer.wire_dtypes, self.limits.wire_dtypes)
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
            k: link_params(self.limits, self.splits.manifest(k), k, rec.offer, share, 0) for k in (0, *rec.split_layers)
        }
        return rec.update(by_split)

    def _forget_gone_links(self) -> None:
        known = {link.link_id for link in self.links.links()}
        for link_id in [x for x in self._versions if x not in known and x]:
            del self._versions[link_id]
            self._owners.pop(link_id, None)

    def params_for(self, header: TurnHeader, caller: Principal) -> LinkParams:
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

    def control_step(self) -> list[str]:
        """One step of the p99 SLO controller (``cloud.links.table``): links whose share changed get a
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
            self._kv_usage = (now, vllm_metrics.vllm_kv_cache_usage())
        return self._kv_usage[1]

    def server_info(self, link_id: str, caller: Principal | str, serving: bool) -> ServerInfo:
        """``GetServerInfo``: the load, and the link's current params when the link is known here and
        was negotiated by ``caller`` (another caller's link is reported unknown); ``serving``: the
        node's health.

        Raises:
            InvalidRequest: a link id longer than 256 characters.
        """
        if len(link_id) > 256:
            raise InvalidRequest("link_id longer than 256 characters")
        if link_id and self._owners.get(link_id) != str(as_principal(caller)):
            link_id = ""
        rec = self._versions.get(link_id) if link_id else None
        return ServerInfo(
            cloud_id=self.cfg.cloud_id,
            instance_id=self.instance_id,
            load=self.load(link_id),
            link_known=rec is not None,
            params_by_split=dict(rec.current) if rec is not None else {},
            split_layers=self.splits.layers,
            serving=serving,
        )

    def max_message_bytes(self) -> int:
        """The largest legal message under any link's params: a chunk of ``max_chunk_tokens`` in the
        widest allowed format, a KV block of the deepest split, a whole-model KV block going down (remote
        prefill; fp32, the widest), a header of ``max_prompt_tokens`` token ids (5 bytes each as
        varints), or a goodput probe (``MAX_PROBE_BYTES`` of padding)."""
        lim, sh = self.limits, self.splits.primary.shape
        widest = max(wire.raw_nbytes_of(lim.max_chunk_tokens, d, sh.hidden_size) for d in lim.wire_dtypes)
        k_max = max(self.splits.layers, default=0)  # 0: a direct-only checkpoint, no head blocks
        block = (
            block_nbytes(self.splits.head_part(k_max), sh.num_kv_heads, lim.kv_block_size_tokens, sh.head_dim)
            if k_max
            else 0
        )
        whole = block_nbytes(LayerRange(lo=0, hi=sh.num_layers), sh.num_kv_heads, lim.kv_block_size_tokens, sh.head_dim)
        codec = Codec.ZSTD if Codec.ZSTD in lim.codecs else Codec.NONE
        return (
            max(
                wire.max_payload_bytes(widest, codec),
                wire.max_payload_bytes(max(block, whole), codec),
                5 * lim.max_prompt_tokens,
                MAX_PROBE_BYTES,
            )
            + HEADER_SLACK_BYTES
        )
