"""The fuzzing's cases of the ``uplink`` target and what they run on: the statuses a call may end with, the
toy cloud (``CloudStack``, a gateway per negotiated wire format), valid uploads framed as the edge frames them
(``make_upload``) and the mutations of an upload (``UplinkPlan``: fields, payload bytes, CRC, values, enums,
order, duplicates, stalls, the sender's answer to NACKs and repair requests)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np

from tandem.cloud.config import CloudConfig, EngineConfig
from tandem.cloud.engines.memory import MemoryEngines
from tandem.cloud.gateway import Gateway
from tandem.cloud.server import build_gateway
from tandem.cloud.store.blocks import MemoryBlockStore
from tandem.common.protocol.errors import TandemError
from tandem.common.protocol.params import LinkParams, Sampling
from tandem.common.wire import chunks as wire
from tandem.common.wire import merkle
from tandem.common.wire.kvblocks import LayerRange, block_hashes, request_seed
from tandem.common.wire.kvcodec import encode_block
from tandem.common.wire.messages import (
    Commit,
    KVBlock,
    TurnHeader,
    uplink_to_pb,
)
from tandem.edge.link.uplink import send_order
from tandem.v1 import tandem_pb2 as pb
from tests.toy import HKV, MANIFEST, VOCAB, B, D, H, K

T = TypeVar("T")
S = grpc.StatusCode
OK = S.OK
REFUSALS = frozenset(
    {
        S.INVALID_ARGUMENT,
        S.FAILED_PRECONDITION,
        S.NOT_FOUND,
        S.RESOURCE_EXHAUSTED,
        S.DATA_LOSS,
        S.DEADLINE_EXCEEDED,
        S.OUT_OF_RANGE,
        S.PERMISSION_DENIED,
        S.UNAUTHENTICATED,
    }
)
ALLOWED = REFUSALS | {OK}  # what any call or turn may end with (never INTERNAL, UNKNOWN, UNAVAILABLE...)
TARGETS = ("uplink", "cloud-typed", "cloud-raw", "edge-typed", "edge-raw")

# ------------------------------------------------------------------ the toy model (tests/toy.py)

# the good session beside the fuzzed turns of the uplink target: another edge's (``GOOD_EDGE``), so that fuzzed
# headers (from ``FUZZ_EDGE``) naming the same session id must not reach it
GOOD_SESSION = "good-session-0c5f1d"
GOOD_EDGE, FUZZ_EDGE = "good-edge", "fuzz-edge"
GRPC_GOOD_SESSION = "grpc-good-session-6b2e"  # over gRPC every call is the same principal: no case names it
OTHER_LINK = "<another edge's link>"  # stands for a link id another edge negotiated (resolved per case)


# the gateways the uplink target runs on: the negotiated wire formats of the anonymous link differ
FLAVORS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "zstd-fp16": {"codecs": [wire.Codec.ZSTD], "wire_dtypes": [wire.WireDtype.FP16]},
    "int8": {"wire_dtypes": [wire.WireDtype.INT8]},
    "int8-hadamard": {"wire_dtypes": [wire.WireDtype.INT8_HADAMARD]},
}


def cloud_config(**kw: Any) -> CloudConfig:
    """The toy cloud's config (16-token chunks, 32-token KV blocks); ``kw`` overrides."""
    base: dict[str, Any] = dict(
        split_dir=Path("/nonexistent"),
        chunk_tokens=16,
        max_chunk_tokens=16,
        engine=EngineConfig(block_size_tokens=B),
        # thousands of cases from one edge: its own bounds (cloud.links.tenancy) are not what is fuzzed here
        edge_rate_limit=None,
        edge_max_sessions=1 << 30,
    )
    return CloudConfig(**{**base, **kw})


@dataclass
class CloudStack:
    """A gateway over in-memory engines and block store."""

    gateway: Gateway
    engines: MemoryEngines
    store: MemoryBlockStore

    @classmethod
    def create(cls, **cfg: Any) -> CloudStack:
        """A fresh gateway (call in the event loop it will serve)."""
        store = MemoryBlockStore(1 << 30)
        engines = MemoryEngines(store, B, VOCAB)
        return cls(build_gateway(cloud_config(**cfg), MANIFEST, engines, store), engines, store)


def busy_bookkeeping(gw: Gateway) -> list[str]:
    """What of the gateway's bookkeeping is not idle: upload reservations, holds on the edges' and
    the node's session bounds, admitted or waiting requests."""
    out: list[str] = []
    b = gw.receiver.budget
    per_peer = {p: v for p, v in b._per_peer.items() if v != [0, 0]}
    if b.uploads or b.nbytes or per_peer:
        out.append(f"upload budget held: uploads={b.uploads} nbytes={b.nbytes} per peer={per_peer}")
    holds = {tag: len(h) for tag, h in gw.edge_limits._holds.items()}
    if holds or gw.sessions.holding():
        out.append(f"session bounds held: per edge {holds}, node {gw.sessions.holding()}")
    t = gw.links
    if t.running or t.waiting or t.running_tokens:
        out.append(f"link table busy: running={t.running} waiting={t.waiting} tokens={t.running_tokens}")
    for link in t.links():
        if link.running or link.waiting or link.running_tokens or link._queue:
            out.append(f"link {link.link_id!r} busy: running={link.running} waiting={link.waiting}")
    return out


# ------------------------------------------------------------------ valid uploads, as the edge frames them


def token_ids(seed: int, n: int) -> list[int]:
    """``n`` prompt token ids (a prefix of the same seed's longer prompts)."""
    return [int(x) for x in np.random.default_rng([seed, 7]).integers(5, VOCAB, max(n, 1))[:n]]


@dataclass(frozen=True)
class Upload:
    """One split turn as the edge sends it: the header, then ``items`` (chunks and KV blocks in the edge's send
    order, the commit last), plus the session's leaves before this turn."""

    header: TurnHeader
    items: tuple[wire.Chunk | KVBlock | Commit, ...]
    base_leaves: tuple[bytes, ...] = ()


def make_upload(
    params: LinkParams,
    ids: Sequence[int],
    session_id: str,
    request_id: str,
    *,
    cached_tokens: int = 0,
    values_seed: int = 0,
    sampling: Sampling = Sampling(max_new_tokens=4),  # noqa: B008 (frozen)
    link_id: str = "",
) -> Upload:
    """A valid upload of prompt ``ids`` under ``params`` (the activations and KV values are a function of
    ``values_seed`` and the position, so a later turn's prefix matches an earlier turn's). With ``cached_tokens``
    it is the next turn of a session that holds the first ``cached_tokens`` tokens (and their full blocks)."""
    n = len(ids)
    hidden = (np.random.default_rng([values_seed, 1]).standard_normal((n, H)) * 0.5).astype(np.float32)
    chunks = wire.split(
        hidden[cached_tokens:],
        cached_tokens,
        params.chunk_tokens,
        params.wire_dtype,
        params.codec,
        params.codec_level,
        params.params_version,
    )
    hashes = block_hashes(list(ids), B, request_seed(MANIFEST.compatibility_key(), B, session_id, request_id))
    kv = (np.random.default_rng([values_seed, 2]).standard_normal((len(hashes), K, 2, HKV, B, D)) * 0.5).astype(
        np.float32
    )
    # every block framed as the edge frames it (the one KV-block codec: leaf and CRC32C)
    framed = [
        encode_block(kv[j], j, h, LayerRange(lo=0, hi=K), params, params.params_version) for j, h in enumerate(hashes)
    ]
    leaves = [b.leaf_hash for b in framed]
    first = cached_tokens // B
    blocks = {j: framed[j] for j in range(first, len(hashes))}
    header = TurnHeader(
        request_id=request_id,
        session_id=session_id,
        params_version=params.params_version,
        split_layer=K,
        prompt_token_ids=tuple(ids),
        cached_tokens=cached_tokens,
        num_chunks=len(chunks),
        num_kv_blocks=len(blocks),
        sampling=sampling,
        link_id=link_id,
    )
    items = (*send_order(chunks, blocks, B), Commit(leaf_count=len(leaves), merkle_root=merkle.root(leaves)))
    return Upload(header, items, tuple(leaves[:first]))


# ------------------------------------------------------------------ mutations of an upload


class Stall:
    """Marks the point where the sender stops sending (and never half-closes)."""

    def __repr__(self) -> str:
        return "STALL"


STALL = Stall()
INVALID, PRECONDITION, NOT_FOUND, DATA_LOSS, DEADLINE = (
    S.INVALID_ARGUMENT,
    S.FAILED_PRECONDITION,
    S.NOT_FOUND,
    S.DATA_LOSS,
    S.DEADLINE_EXCEEDED,
)
Expect = frozenset[grpc.StatusCode]
# the sender's answer to NACKs and repair requests (``_drive``): the original items again, the items as sent
# (mutated) again, or nothing
POLICIES = ("honest", "replay", "mute")


def _crc_like(policy: str) -> Expect:
    """A chunk failing its CRC: resent intact (honest) it verifies; resent as is, DATA_LOSS after the resends;
    never resent, the upload ends incomplete."""
    return frozenset({"honest": {OK}, "replay": {DATA_LOSS}, "mute": {INVALID}}[policy])


def _repair_like(policy: str) -> Expect:
    """A KV block missing or failing its leaf at the commit: as ``_crc_like`` (repair rounds instead of resends)."""
    return _crc_like(policy)


@dataclass
class Work:
    """An upload under mutation: protobuf messages (so that any value the wire can carry can be set), the
    originals (what an honest sender resends) and where the commit stands."""

    header: pb.RequestHeader
    items: list[pb.Uplink | Stall]
    originals: dict[tuple[str, int], pb.Uplink]
    commit: pb.Uplink
    base_leaves: tuple[bytes, ...]
    params: LinkParams
    policy: str
    other_link: str = ""  # a link of another edge (what ``OTHER_LINK`` stands for)
    stall: bool = False

    @classmethod
    def of(cls, u: Upload, params: LinkParams, policy: str, other_link: str = "") -> Work:
        msgs = [uplink_to_pb(x) for x in u.items]
        originals = {_key(m): m for m in msgs if _key(m)[0] != "commit"}
        header = uplink_to_pb(u.header).header
        return cls(header, list(msgs), originals, msgs[-1], u.base_leaves, params, policy, other_link)

    def positions(self, kind: str) -> list[int]:
        return [i for i, m in enumerate(self.items) if isinstance(m, pb.Uplink) and m.WhichOneof("msg") == kind]

    def commit_position(self) -> int:
        """Index of the last commit (len(items) if none): a valid upload completes there, items after it are
        never read."""
        commits = self.positions("commit")
        return commits[-1] if commits else len(self.items)

    def leaf_hashes(self) -> list[bytes]:
        """The session's leaves after this turn as the KV blocks in ``items`` say (for a recomputed root)."""
        leaves = dict(enumerate(self.base_leaves))
        for i in self.positions("kv_block"):
            b = self.items[i].kv_block  # type: ignore[union-attr]
            leaves.setdefault(b.leaf_index, b.leaf_hash)
        return [leaves[j] for j in sorted(leaves)]


def _key(m: pb.Uplink) -> tuple[str, int]:
    kind = m.WhichOneof("msg") or "empty"
    if kind == "chunk":
        return kind, m.chunk.seq
    if kind == "kv_block":
        return kind, m.kv_block.leaf_index
    return kind, 0


def _pick(w: Work, kind: str, index: int) -> int | None:
    where = w.positions(kind)
    return where[index % len(where)] if where else None


def _copy(m: pb.Uplink) -> pb.Uplink:
    out = pb.Uplink()
    out.CopyFrom(m)
    return out


@dataclass(frozen=True)
class PayloadOp:
    """A change of payload bytes: flip bits at ``pos``, truncate to ``pos``, append or replace with ``data``."""

    kind: str  # "flip" | "truncate" | "extend" | "replace"
    pos: int = 0
    mask: int = 1
    data: bytes = b""

    def apply(self, payload: bytes) -> bytes:
        n = len(payload)
        if self.kind == "flip":
            if not n:
                return b"\x01"
            i = self.pos % n
            return payload[:i] + bytes([payload[i] ^ self.mask]) + payload[i + 1 :]
        if self.kind == "truncate":
            return payload[: self.pos % max(n, 1)]
        if self.kind == "extend":
            return payload + (self.data or b"\x00")
        return self.data


@dataclass(frozen=True)
class HeaderEdit:
    """Set one header field to ``value`` (a wire-representable value)."""

    name: str
    value: Any

    def apply(self, w: Work) -> Expect:
        h = w.header
        if self.name == "sampling":
            new = pb.SamplingParams(**self.value)
            if new == h.sampling:
                return frozenset({OK})
            h.sampling.CopyFrom(new)
            return frozenset({OK, INVALID})
        if self.name == "prompt_token_ids":
            if list(h.prompt_token_ids) == list(self.value):
                return frozenset({OK})
            del h.prompt_token_ids[:]
            h.prompt_token_ids.extend(self.value)
            return frozenset({OK, INVALID, PRECONDITION, NOT_FOUND})
        if self.value == OTHER_LINK:  # another edge's link: never usable by this one
            if not w.other_link:
                return frozenset({OK})
            h.link_id = w.other_link
            return frozenset({S.PERMISSION_DENIED})
        if getattr(h, self.name) == self.value:
            return frozenset({OK})
        setattr(h, self.name, self.value)
        long_id = isinstance(self.value, str) and len(self.value.encode()) > 128
        return frozenset(
            {
                "request_id": {INVALID} if long_id else {OK, INVALID},
                "session_id": {INVALID} if long_id else {OK, INVALID, PRECONDITION, NOT_FOUND},
                "link_id": {PRECONDITION},
                "params_version": {PRECONDITION},
                "split_layer": {INVALID},
                "cached_tokens": {INVALID, PRECONDITION, NOT_FOUND},
                "num_chunks": {INVALID},
                "num_kv_blocks": {INVALID},
            }[self.name]
        )


@dataclass(frozen=True)
class PromptTokenEdit:
    """Change one prompt token id (the blocks' chained hashes past it change, the chunks do not)."""

    index: int
    value: int

    def apply(self, w: Work) -> Expect:
        ids = w.header.prompt_token_ids
        if not ids:
            return frozenset({OK})
        i = self.index % len(ids)
        if ids[i] == self.value:
            return frozenset({OK})
        ids[i] = self.value
        return frozenset({OK, INVALID, PRECONDITION, NOT_FOUND})


@dataclass(frozen=True)
class ChunkEdit:
    """Set one field of activation chunk ``index`` (counted among the chunks)."""

    index: int
    name: str
    value: int

    def apply(self, w: Work) -> Expect:
        i = _pick(w, "chunk", self.index)
        if i is None:
            return frozenset({OK})
        m = _copy(w.items[i])  # type: ignore[arg-type]
        if getattr(m.chunk, self.name) == self.value:
            return frozenset({OK})
        setattr(m.chunk, self.name, self.value)
        w.items[i] = m
        if self.name == "crc32c":
            return _crc_like(w.policy)
        return frozenset({PRECONDITION} if self.name == "params_version" else {INVALID})


@dataclass(frozen=True)
class ChunkPayload:
    """Change the payload bytes of chunk ``index``; ``fix_crc``: with a CRC over the new bytes."""

    index: int
    op: PayloadOp
    fix_crc: bool

    def apply(self, w: Work) -> Expect:
        i = _pick(w, "chunk", self.index)
        if i is None:
            return frozenset({OK})
        m = _copy(w.items[i])  # type: ignore[arg-type]
        payload = self.op.apply(m.chunk.payload)
        if payload == m.chunk.payload:
            return frozenset({OK})
        m.chunk.payload = payload
        if self.fix_crc:
            m.chunk.crc32c = wire.crc32c(payload)
        w.items[i] = m
        if self.fix_crc:  # decodes to other values (maybe out of range), or does not decode (NACK, like a CRC)
            return frozenset({OK, INVALID})
        return _crc_like(w.policy) | {INVALID}  # INVALID: larger than the negotiated size (checked first)


@dataclass(frozen=True)
class ChunkValues:
    """Put ``value`` (NaN, inf, huge) at ``(row, col)`` of chunk ``index``, re-encoded with a good CRC."""

    index: int
    row: int
    col: int
    value: float

    def apply(self, w: Work) -> Expect:
        i = _pick(w, "chunk", self.index)
        if i is None:
            return frozenset({OK})
        m = _copy(w.items[i])  # type: ignore[arg-type]
        c, p = m.chunk, w.params
        try:  # an earlier mutation may have left the chunk undecodable: then this one does nothing
            raw = wire.decode_payload(c.payload, wire.Codec(c.codec), c.raw_nbytes)
            x = wire.decode_dtype(raw, wire.WireDtype(c.wire_dtype), c.num_tokens, H)
            x[self.row % c.num_tokens, self.col % H] = self.value
        except (TandemError, ValueError, ZeroDivisionError):
            return frozenset({OK})
        with np.errstate(all="ignore"):
            payload = wire.encode_payload(wire.encode_dtype(x, p.wire_dtype), p.codec, p.codec_level)
        c.payload, c.crc32c = payload, wire.crc32c(payload)
        w.items[i] = m
        return frozenset({INVALID})


@dataclass(frozen=True)
class BlockEdit:
    """Set one field of KV block ``index`` (counted among the blocks)."""

    index: int
    name: str
    value: Any

    def apply(self, w: Work) -> Expect:
        i = _pick(w, "kv_block", self.index)
        if i is None:
            return frozenset({OK})
        m = _copy(w.items[i])  # type: ignore[arg-type]
        if getattr(m.kv_block, self.name) == self.value:
            return frozenset({OK})
        setattr(m.kv_block, self.name, self.value)
        w.items[i] = m
        if self.name in ("leaf_hash", "crc32c"):  # corrupt in transit: asked for again at the commit
            return _repair_like(w.policy)
        return frozenset({PRECONDITION} if self.name == "params_version" else {INVALID})


@dataclass(frozen=True)
class BlockPayload:
    """Change the payload bytes of KV block ``index``; ``fix_leaf``: with the leaf hash and the CRC32C over the new
    bytes (and ``fix_root``: the commit's root over the new leaves), as a dishonest but consistent edge would."""

    index: int
    op: PayloadOp
    fix_leaf: bool
    fix_root: bool

    def apply(self, w: Work) -> Expect:
        i = _pick(w, "kv_block", self.index)
        if i is None:
            return frozenset({OK})
        m = _copy(w.items[i])  # type: ignore[arg-type]
        b = m.kv_block
        payload = self.op.apply(b.payload)
        if payload == b.payload:
            return frozenset({OK})
        b.payload = payload
        if self.fix_leaf:
            try:
                raw = wire.decode_payload(payload, wire.Codec(b.codec), b.raw_nbytes)
            except TandemError:
                raw = payload
            data = merkle.leaf_data(b.block_hash, b.layer_lo, b.layer_hi, b.wire_dtype or 1, raw)
            b.leaf_hash = merkle.leaf_hash(data)
            b.crc32c = wire.crc32c(payload)
        w.items[i] = m
        if self.fix_leaf and self.fix_root:
            _set_root(w)
        if self.fix_leaf:
            return frozenset({OK, INVALID, DATA_LOSS})
        return _repair_like(w.policy) | {INVALID}  # INVALID: larger than the negotiated size


@dataclass(frozen=True)
class BlockValues:
    """Put ``value`` (NaN, inf, huge) at element ``pos`` of KV block ``index``, with its leaf and the root
    recomputed (only the value check can refuse it)."""

    index: int
    pos: int
    value: float

    def apply(self, w: Work) -> Expect:
        i = _pick(w, "kv_block", self.index)
        if i is None:
            return frozenset({OK})
        m = _copy(w.items[i])  # type: ignore[arg-type]
        b = m.kv_block
        try:  # an earlier mutation may have left the block undecodable: then this one does nothing
            x = np.frombuffer(wire.decode_payload(b.payload, wire.Codec(b.codec), b.raw_nbytes), np.float32).copy()
            x[self.pos % x.size] = self.value
        except (TandemError, ValueError, ZeroDivisionError):
            return frozenset({OK})
        raw = x.tobytes()
        b.payload = wire.encode_payload(raw, w.params.codec, w.params.codec_level)
        b.leaf_hash = merkle.leaf_hash(merkle.leaf_data(b.block_hash, b.layer_lo, b.layer_hi, b.wire_dtype or 1, raw))
        b.crc32c = wire.crc32c(b.payload)
        w.items[i] = m
        _set_root(w)
        return frozenset({INVALID})


def _set_root(w: Work) -> None:
    i = _pick(w, "commit", -1)
    if i is not None:
        m = _copy(w.items[i])  # type: ignore[arg-type]
        m.commit.merkle_root = merkle.root(w.leaf_hashes())
        w.items[i] = m


@dataclass(frozen=True)
class CommitEdit:
    """Set the commit's ``leaf_count`` or ``merkle_root``."""

    name: str
    value: Any

    def apply(self, w: Work) -> Expect:
        i = _pick(w, "commit", -1)
        if i is None:
            return frozenset({OK})
        m = _copy(w.items[i])  # type: ignore[arg-type]
        if getattr(m.commit, self.name) == self.value:
            return frozenset({OK})
        setattr(m.commit, self.name, self.value)
        w.items[i] = m
        return frozenset({DATA_LOSS})


@dataclass(frozen=True)
class Reorder:
    """Structural changes of the item sequence: ``drop`` item ``i``; ``duplicate`` item ``i`` at ``j``; ``swap``
    ``i`` and ``j``; ``truncate`` to ``i`` items; insert a second ``header``, an ``empty`` message or a ``stall``
    at ``j``. Indices are taken modulo the sequence's length."""

    kind: str
    i: int = 0
    j: int = 0

    def apply(self, w: Work) -> Expect:
        items, n = w.items, len(w.items)
        if not n:
            return frozenset({OK})
        i, j = self.i % n, self.j % (n + 1)
        commit_at = w.commit_position()
        after_commit = j > commit_at  # never read: the upload completed at the commit
        what = items[i].WhichOneof("msg") if isinstance(items[i], pb.Uplink) else "stall"  # type: ignore[union-attr]
        if self.kind == "drop":
            del items[i]
            if what == "kv_block":
                return _repair_like(w.policy)
            return frozenset({INVALID}) if what in ("chunk", "commit") else frozenset({OK, INVALID, DEADLINE})
        if self.kind == "duplicate":
            items.insert(j, items[i])
            if what in ("chunk", "kv_block") and not after_commit:
                return frozenset({INVALID})  # the later copy is "sent again after it verified"
            return frozenset({OK}) if what == "commit" or after_commit else frozenset({OK, INVALID, DEADLINE})
        if self.kind == "swap":
            j = j % n
            items[i], items[j] = items[j], items[i]
            if i == j or commit_at not in (i, j):
                return frozenset({OK})  # any order of chunks and blocks before the commit is fine
            return frozenset({OK, INVALID, DATA_LOSS})
        if self.kind == "truncate":
            del items[i:]
            return frozenset({INVALID}) if i <= commit_at else frozenset({OK})
        if self.kind == "header":
            items.insert(j, pb.Uplink(header=w.header))
            return frozenset({OK}) if after_commit else frozenset({INVALID})
        if self.kind == "empty":
            items.insert(j, pb.Uplink())
            return frozenset({OK}) if after_commit else frozenset({INVALID})
        if self.kind == "stall":  # the turn runs under a short deadline, also when the stall is never reached
            items.insert(j, STALL)
            w.stall = True
            return frozenset({OK, DEADLINE}) if after_commit else frozenset({DEADLINE})
        raise ValueError(self.kind)


Mutation = (
    HeaderEdit
    | PromptTokenEdit
    | ChunkEdit
    | ChunkPayload
    | ChunkValues
    | BlockEdit
    | BlockPayload
    | BlockValues
    | CommitEdit
    | Reorder
)


@dataclass(frozen=True)
class UplinkPlan:
    """One uplink case: the gateway flavor, the scenario (``stateless``; ``new`` session; ``next`` turn of a
    session holding ``base_tokens``), the prompt, the mutations, the sender's policy and the deadline
    (``none``; ``past``: already passed when the turn starts)."""

    flavor: str
    scenario: str
    base_tokens: int
    new_tokens: int
    values_seed: int
    mutations: tuple[Mutation, ...]
    policy: str = "honest"
    deadline: str = "none"
