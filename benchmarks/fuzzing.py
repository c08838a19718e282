"""Property-based fuzzing (hypothesis) of the cloud's uplink verification and of raw protobuf messages into the
``Cloud`` and ``Edge`` gRPC services. Shared by ``tests/test_fuzz.py`` (thousands of cases,
fixed seed, fast tier) and ``tandem-fuzz`` (``benchmarks/fuzz.py``: longer runs, random seed).

Everything runs against the in-memory doubles (``MemoryEngines``, ``MemoryBlockStore``, ``MemoryHead``, a toy
tokenizer and model shape mirroring ``tests/doubles.py``), no vLLM and no ONNX Runtime, in one event loop on a
background thread (``LoopThread``), so that a hang is seen from the outside (``hang_s``) and reported.

Targets (``TARGETS``), each a strategy of cases and a property (``Harness.check``):

* ``uplink``: a valid split upload (header, chunks, KV blocks, commit: framed by the same functions as the edge's)
  mutated by ``uplink_plans`` (fields, payload bytes, CRC, values, enums, order, duplicates, stalls, the sender's
  answer to NACKs and repair requests), decoded as the servicer decodes it (``uplink_from_pb``,
  ``cloud.service.uplink_body``) and fed to ``Gateway.run_turn`` while a good session runs beside it.
  Property: the turn completes or raises a ``TandemError`` whose status (``status_of``) is allowed (with one
  mutation: the status that mutation calls for), never another exception, within ``hang_s``; the good
  session's tokens equal those of a fresh gateway; a session the turn failed on is unchanged; the upload budget
  and the link table are back to idle.
* ``cloud-typed`` / ``edge-typed``: well-typed adversarial messages (huge and unknown values, long strings,
  empty oneofs; for ``Generate`` the plans above) into the services over grpc.aio on loopback.
* ``cloud-raw`` / ``edge-raw``: arbitrary or damaged bytes as serialized requests, known and unknown methods.
  Property (gRPC): every call ends within ``hang_s`` with a status in ``ALLOWED`` (``UNIMPLEMENTED`` for unknown
  methods), never ``INTERNAL`` or ``UNKNOWN``; a ``Downlink.error`` verdict matches the call's status; the
  servers stay idle afterwards and good requests still return the reference results.

Open product bugs are listed in ``KNOWN_BUGS``; a case that hits one is counted (``Stats.known``) and, unless
``strict``, not a failure (tests/test_fuzz.py keeps a strict xfail reproducer for each).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import grpc
import numpy as np
from hypothesis import strategies as st

from tandem.benchmarks.toy import HKV, MANIFEST, VOCAB, B, D, H, K, ToyTokenizer
from tandem.cloud.config import CloudConfig, EngineConfig
from tandem.cloud.gateway import Gateway
from tandem.cloud.memory_engines import MemoryEngines
from tandem.cloud.server import build_gateway
from tandem.cloud.service import CloudServicer, uplink_body
from tandem.cloud.sessions import CloudSession
from tandem.cloud.turn import as_principal
from tandem.common import merkle, wire
from tandem.common.errors import TandemError, error_from_name
from tandem.common.grpc_errors import status_of
from tandem.common.grpcsetup import add_service, start_server
from tandem.common.kvblocks import block_hashes, request_seed
from tandem.common.kvstore import MemoryBlockStore
from tandem.common.messages import (
    Commit,
    KVBlock,
    Nack,
    Repair,
    TokensOut,
    TurnFinal,
    TurnHeader,
    UploadAck,
    uplink_from_pb,
    uplink_to_pb,
)
from tandem.common.params import LinkParams, NegotiateOffer, Sampling
from tandem.common.security import scoped
from tandem.edge.batcher import HeadBatcher
from tandem.edge.cloudconn import CloudConnection
from tandem.edge.head_runner import MemoryHead
from tandem.edge.headwork import Head
from tandem.edge.link import InProcessLink
from tandem.edge.node import EdgeNode
from tandem.edge.service import EdgeServicer
from tandem.edge.session import EdgeSessions
from tandem.edge.uplink import send_order
from tandem.v1 import tandem_pb2 as pb

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

# ------------------------------------------------------------------ the toy model (tandem.benchmarks.toy)

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
        # thousands of cases from one edge: its own bounds (cloud.tenancy) are not what is fuzzed here
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
    """What of the gateway's bookkeeping is not idle: upload reservations, admitted or waiting requests."""
    out: list[str] = []
    b = gw.receiver.budget
    per_peer = {p: v for p, v in b._per_peer.items() if v != [0, 0]}
    if b.uploads or b.nbytes or per_peer:
        out.append(f"upload budget held: uploads={b.uploads} nbytes={b.nbytes} per peer={per_peer}")
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
    leaves = [merkle.leaf_hash(merkle.leaf_data(h, 0, K, 1, kv[j].tobytes())) for j, h in enumerate(hashes)]
    first = cached_tokens // B
    blocks = {
        j: KVBlock(
            j,
            hashes[j],
            0,
            K,
            params.codec,
            kv[j].nbytes,
            wire.encode_payload(kv[j].tobytes(), params.codec, params.codec_level),
            leaves[j],
            params.params_version,
        )
        for j in range(first, len(hashes))
    }
    header = TurnHeader(
        request_id,
        session_id,
        params.params_version,
        K,
        tuple(ids),
        cached_tokens,
        len(chunks),
        len(blocks),
        sampling,
        link_id,
    )
    items = (*send_order(chunks, blocks, B), Commit(len(leaves), merkle.root(leaves)))
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
        if self.name == "leaf_hash":
            return _repair_like(w.policy)
        return frozenset({PRECONDITION} if self.name == "params_version" else {INVALID})


@dataclass(frozen=True)
class BlockPayload:
    """Change the payload bytes of KV block ``index``; ``fix_leaf``: with the leaf hash over the new bytes (and
    ``fix_root``: the commit's root over the new leaves), as a dishonest but consistent edge would."""

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


# ------------------------------------------------------------------ strategies


def weighted(*choices: tuple[int, st.SearchStrategy[T]]) -> st.SearchStrategy[T]:
    """``st.one_of`` with integer weights (``one_of`` drops repeated alternatives, so repeating one does not
    weigh it)."""
    table = [s for w, s in choices for _ in range(w)]
    return st.sampled_from(range(len(table))).flatmap(lambda i: table[i])


U32, U64 = 2**32 - 1, 2**64 - 1
u32 = st.one_of(
    st.integers(0, 80),
    st.sampled_from([127, 128, 511, 512, 513, 1535, 1536, 1537, 2**31 - 1, 2**31, U32]),
    st.integers(0, U32),
)
u64 = st.one_of(st.integers(0, 4), st.sampled_from([2**32, 2**63 - 1, 2**63, U64]), st.integers(0, U64))
i32 = st.one_of(st.integers(-3, 3), st.sampled_from([-(2**31), 2**31 - 1]), st.integers(-(2**31), 2**31 - 1))
i64 = st.one_of(st.integers(-3, 3), st.integers(-(2**63), 2**63 - 1))
enum_ints = st.one_of(st.integers(0, 6), i32)  # open proto3 enums carry any int32
ids_text = st.one_of(
    st.text(max_size=24),
    st.sampled_from(["", "x" * 128, "x" * 129, "é" * 64, "é" * 65, "\x00", "\u202e\n"]),
    st.text(min_size=100, max_size=300),
)
hashes = st.one_of(st.binary(min_size=32, max_size=32), st.binary(max_size=40), st.just(b""))
special_floats = st.sampled_from([math.nan, math.inf, -math.inf, 1e6, -3.0e38, 1e5 * 1.0001])
any_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), special_floats, st.floats(-3, 3))


def sampling_fields() -> st.SearchStrategy[dict[str, Any]]:
    """Fields of a ``SamplingParams`` message, absurd values included."""
    return st.fixed_dictionaries(
        {},
        optional={
            "temperature": any_floats,
            "top_p": any_floats,
            "top_k": i32,
            "max_new_tokens": u32,
            "seed": i64,
            "stop_token_ids": st.lists(u32, max_size=80),
            "ignore_eos": st.booleans(),
        },
    )


payload_ops = st.one_of(
    st.builds(PayloadOp, st.just("flip"), st.integers(0, 10_000), st.integers(1, 255)),
    st.builds(PayloadOp, st.just("truncate"), st.integers(0, 10_000)),
    st.builds(PayloadOp, st.just("extend"), data=st.binary(min_size=1, max_size=64)),
    st.builds(PayloadOp, st.just("replace"), data=st.binary(max_size=600)),
)
HEADER_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "request_id": ids_text,
    "session_id": weighted((6, ids_text), (1, st.just(GOOD_SESSION))),
    "link_id": weighted((6, ids_text), (1, st.just(OTHER_LINK))),
    "params_version": u64,
    "split_layer": u32,
    "cached_tokens": u32,
    "num_chunks": u32,
    "num_kv_blocks": u32,
    "prompt_token_ids": st.one_of(
        st.just(()),
        st.lists(u32, max_size=40).map(tuple),
        st.builds(lambda t, n: (t,) * n, st.integers(0, VOCAB - 1), st.sampled_from([1536, 1537, 3000])),
    ),
    "sampling": sampling_fields(),
}
CHUNK_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "seq": u32,
    "token_offset": u32,
    "num_tokens": u32,
    "wire_dtype": enum_ints,
    "codec": enum_ints,
    "raw_nbytes": u32,
    "crc32c": u32,
    "params_version": u64,
}
BLOCK_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "leaf_index": u32,
    "block_hash": hashes,
    "layer_lo": u32,
    "layer_hi": u32,
    "codec": enum_ints,
    "raw_nbytes": u32,
    "leaf_hash": hashes,
    "params_version": u64,
}


def _field_edit(
    cls: Callable[..., T], fields: dict[str, st.SearchStrategy[Any]], indexed: bool
) -> st.SearchStrategy[T]:
    def one(name: str) -> st.SearchStrategy[T]:
        if indexed:
            return st.builds(cls, st.integers(0, 20), st.just(name), fields[name])
        return st.builds(cls, st.just(name), fields[name])

    return st.sampled_from(sorted(fields)).flatmap(one)


def mutations() -> st.SearchStrategy[Mutation]:
    """Any one mutation of an upload."""
    idx = st.integers(0, 40)
    return st.one_of(
        _field_edit(HeaderEdit, HEADER_FIELDS, False),
        st.builds(PromptTokenEdit, idx, st.one_of(st.integers(0, VOCAB - 1), st.sampled_from([VOCAB, U32]))),
        _field_edit(ChunkEdit, CHUNK_FIELDS, True),
        st.builds(ChunkPayload, idx, payload_ops, st.booleans()),
        st.builds(ChunkValues, idx, st.integers(0, 15), st.integers(0, H - 1), special_floats),
        _field_edit(BlockEdit, BLOCK_FIELDS, True),
        st.builds(BlockPayload, idx, payload_ops, st.booleans(), st.booleans()),
        st.builds(BlockValues, idx, st.integers(0, 10_000), special_floats),
        st.builds(CommitEdit, st.just("leaf_count"), u32) | st.builds(CommitEdit, st.just("merkle_root"), hashes),
        st.builds(
            Reorder,
            st.sampled_from(["drop", "duplicate", "swap", "truncate", "header", "empty", "stall"]),
            idx,
            idx,
        ),
    )


def uplink_plans(
    policies: Sequence[str] = POLICIES, max_mutations: int = 3, deadlines: Sequence[str] = ("none",) * 4 + ("past",)
) -> st.SearchStrategy[UplinkPlan]:
    """Uplink cases: zero to ``max_mutations`` mutations of a valid upload."""
    return st.builds(
        UplinkPlan,
        flavor=st.sampled_from(sorted(FLAVORS)),
        scenario=st.sampled_from(["stateless", "new", "next"]),
        base_tokens=st.integers(1, 100),
        new_tokens=st.integers(1, 140),
        values_seed=st.integers(0, 2**16),
        mutations=st.lists(mutations(), max_size=max_mutations).map(tuple),
        policy=st.sampled_from(tuple(policies)),
        deadline=st.sampled_from(tuple(deadlines)),
    )


# ------------------------------------------------------------------ gRPC cases

CLOUD_METHODS = {  # path -> arity ("uu" unary, "us" server streaming, "ss" bidirectional)
    "/tandem.v1.Cloud/Negotiate": "uu",
    "/tandem.v1.Cloud/GetServerInfo": "uu",
    "/tandem.v1.Cloud/Generate": "ss",
}
EDGE_METHODS = {"/tandem.v1.Edge/Chat": "us", "/tandem.v1.Edge/GetInfo": "uu"}
UNKNOWN_METHODS = {
    "/tandem.v1.Cloud/Chat": "us",
    "/tandem.v1.Edge/Generate": "ss",
    "/tandem.v1.Cloud/Nope": "uu",
    "/tandem.v2.Cloud/Negotiate": "uu",
    "/": "uu",
}


@dataclass(frozen=True)
class RawCall:
    """Raw request bytes into ``method`` (``messages``: one for unary requests, any number for ``Generate``)."""

    method: str
    messages: tuple[bytes, ...]


@dataclass(frozen=True)
class TypedCall:
    """A well-typed request: ``message`` (the request message, or for ``Generate`` an ``UplinkPlan`` or a
    sequence of ``Uplink`` messages) into ``method``."""

    method: str
    message: Any


def _valid_samples() -> dict[str, list[bytes]]:
    """Serialized valid requests of every method, to damage (most random bytes do not even parse)."""
    params = LinkParams(1, K, 16, wire.WireDtype.FP32, wire.Codec.NONE, 3, B, 1 << 26, 8, 4096, 1536, 512, H, 3)
    u = make_upload(params, token_ids(1, 40), "", "raw", values_seed=1)
    offer = NegotiateOffer("e", "toy", {K: MANIFEST.compatibility_key()}, 4)
    chat = pb.ChatRequest(
        messages=[pb.ChatMessage(role="user", content="hi")], sampling=pb.SamplingParams(max_new_tokens=3)
    )
    return {
        "/tandem.v1.Cloud/Negotiate": [offer.to_pb().SerializeToString()],
        "/tandem.v1.Cloud/GetServerInfo": [pb.ServerInfoRequest(link_id="x", padding=b"\0" * 8).SerializeToString()],
        "/tandem.v1.Cloud/Generate": [uplink_to_pb(x).SerializeToString() for x in (u.header, *u.items)],
        "/tandem.v1.Edge/Chat": [chat.SerializeToString()],
        "/tandem.v1.Edge/GetInfo": [b""],
    }


VALID_SAMPLES = _valid_samples()


def _damaged(method: str) -> st.SearchStrategy[bytes]:
    samples = VALID_SAMPLES.get(method, [b"\x08\x01"])
    sample = st.sampled_from(samples)
    return st.one_of(
        st.binary(max_size=64),
        sample,
        st.builds(lambda s, op: op.apply(s), sample, payload_ops),
        st.builds(lambda a, b: a + b, sample, st.binary(max_size=16)),
        st.builds(lambda a, b: a + b, st.binary(max_size=8), sample),
    )


def raw_calls(methods: dict[str, str]) -> st.SearchStrategy[RawCall]:
    """Arbitrary and damaged serialized requests into ``methods`` and into unknown methods."""

    def one(method: str) -> st.SearchStrategy[RawCall]:
        arity = {**methods, **UNKNOWN_METHODS}[method]
        # one message into an unknown method: grpc core answers a client still writing to one INTERNAL
        n = st.integers(0, 6) if arity == "ss" and method in methods else st.just(1)
        messages = n.flatmap(lambda k: st.lists(_damaged(method), min_size=k, max_size=k)).map(tuple)
        return st.builds(RawCall, st.just(method), messages)

    known = st.sampled_from(sorted(methods))
    return weighted((7, known), (1, st.sampled_from(sorted(UNKNOWN_METHODS)))).flatmap(one)


def overridden(base: Any, overrides: dict[str, Any]) -> Any:
    """A copy of protobuf message ``base`` with ``overrides`` (field name -> value; messages, maps and repeated
    fields replaced whole)."""
    m = type(base)()
    m.CopyFrom(base)
    for name, value in overrides.items():
        f = getattr(m, name)
        if isinstance(value, dict):
            f.clear()
            f.update(value)
        elif hasattr(value, "ListFields"):
            f.CopyFrom(value)
        elif isinstance(value, list | tuple):
            del f[:]
            f.extend(value)
        else:
            setattr(m, name, value)
    return m


def negotiate_requests() -> st.SearchStrategy[pb.NegotiateRequest]:
    """A good ``NegotiateRequest`` with any of its fields replaced by adversarial values (NaN, infinite and huge
    measurements, unknown enums, many or wrong heads, long ids)."""
    key = MANIFEST.compatibility_key()
    base = NegotiateOffer("e", "toy", {K: key}, 4).to_pb()
    head_keys = st.dictionaries(
        st.one_of(st.sampled_from([0, 1, K, K + 1]), u32),
        st.one_of(st.just(key), st.text(max_size=20), st.just("k" * 1025)),
        max_size=4,
    ) | st.builds(lambda n: {i: key for i in range(n)}, st.sampled_from([64, 65]))
    floats = st.one_of(any_floats, st.floats(0, 1e4), st.sampled_from([1e300, 1e308]))
    return st.fixed_dictionaries(
        {},
        optional={
            "edge_id": ids_text,
            "model_id": st.sampled_from(["", "other"]) | st.text(max_size=10),
            "split_layers": st.lists(u32, max_size=5),
            "wire_dtypes": st.lists(enum_ints, max_size=5),
            "codecs": st.lists(enum_ints, max_size=5),
            "edge_max_batch": u32,
            "link": st.builds(pb.LinkMeasurement, rtt_ms=floats, goodput_mbps=floats),
            "slo": st.builds(pb.LatencySlo, ttft_ms=floats, itl_p99_ms=floats),
            "head_keys": head_keys,
            "link_id": weighted((6, ids_text), (1, st.just(OTHER_LINK))),
        },
    ).map(lambda o: overridden(base, o))


def server_info_requests() -> st.SearchStrategy[pb.ServerInfoRequest]:
    """``ServerInfoRequest`` with long link ids and paddings around the message size bound."""
    big = st.sampled_from([(1 << 20) - 64, (1 << 20) + 4000, (1 << 20) + 8192])
    sizes = weighted((5, st.integers(0, 64)), (1, big))
    return st.builds(
        pb.ServerInfoRequest,
        link_id=st.one_of(ids_text, st.sampled_from(["x" * 256, "x" * 257, OTHER_LINK])),
        padding=sizes.map(bytes),
    )


def uplink_streams() -> st.SearchStrategy[tuple[pb.Uplink, ...]]:
    """Uplink sequences that do not start with a good header (none, empty oneofs, a body item first)."""
    one = st.one_of(
        st.just(pb.Uplink()),
        st.builds(pb.Uplink, commit=st.builds(pb.Commit, leaf_count=u32, merkle_root=hashes)),
        st.builds(pb.Uplink, chunk=st.builds(pb.ActivationChunk, seq=u32, payload=st.binary(max_size=32))),
        st.builds(pb.Uplink, header=st.builds(pb.RequestHeader, prompt_token_ids=st.lists(u32, max_size=5))),
    )
    return st.lists(one, max_size=4).map(tuple)


def chat_requests() -> st.SearchStrategy[pb.ChatRequest]:
    """A good ``ChatRequest`` with any of its fields (and of its sampling) replaced by adversarial values: roles,
    modes, split layers, stop strings, sizes."""
    base = pb.ChatRequest(
        messages=[pb.ChatMessage(role="user", content="hello, tell me something")],
        sampling=pb.SamplingParams(max_new_tokens=4),
        mode=pb.MODE_SPLIT,
    )
    text = weighted((2, st.text(max_size=40)), (1, st.integers(0, 110_000).map(lambda n: "x" * n)))
    roles = st.sampled_from(["system", "user", "assistant"])
    role = weighted((3, roles), (1, st.text(max_size=8)))
    messages = st.lists(st.builds(pb.ChatMessage, role=role, content=text), max_size=4)
    modes = st.sampled_from(sorted(pb.Mode.values()))
    return st.fixed_dictionaries(
        {},
        optional={
            "session_id": ids_text,
            "messages": messages,
            "prompt": st.one_of(st.just(""), text),
            "sampling": st.builds(lambda f: overridden(base.sampling, f), sampling_fields()),
            "mode": weighted((2, modes), (1, enum_ints)),
            "stop": st.lists(st.one_of(st.text(max_size=5), st.just("s" * 257)), max_size=18),
            "split_layer": st.one_of(st.sampled_from([0, K]), u32),
        },
    ).map(lambda o: overridden(base, o))


def typed_cloud_calls() -> st.SearchStrategy[TypedCall]:
    """Well-typed adversarial requests into the three ``Cloud`` methods."""
    return st.one_of(
        st.builds(TypedCall, st.just("/tandem.v1.Cloud/Negotiate"), negotiate_requests()),
        st.builds(TypedCall, st.just("/tandem.v1.Cloud/GetServerInfo"), server_info_requests()),
        st.builds(TypedCall, st.just("/tandem.v1.Cloud/Generate"), uplink_plans(("mute",), deadlines=("none",))),
        st.builds(TypedCall, st.just("/tandem.v1.Cloud/Generate"), uplink_plans(("mute",), deadlines=("none",))),
        st.builds(TypedCall, st.just("/tandem.v1.Cloud/Generate"), uplink_streams()),
    )


def typed_edge_calls() -> st.SearchStrategy[TypedCall]:
    """Well-typed adversarial requests into the ``Edge`` methods."""
    return st.one_of(
        st.builds(TypedCall, st.just("/tandem.v1.Edge/Chat"), chat_requests()),
        st.builds(TypedCall, st.just("/tandem.v1.Edge/GetInfo"), st.just(pb.GetInfoRequest())),
    )


def strategy_of(target: str) -> st.SearchStrategy[Any]:
    """The cases of ``target`` (one of ``TARGETS``)."""
    return {
        "uplink": lambda: uplink_plans(),
        "cloud-typed": typed_cloud_calls,
        "cloud-raw": lambda: raw_calls(CLOUD_METHODS),
        "edge-typed": typed_edge_calls,
        "edge-raw": lambda: raw_calls(EDGE_METHODS),
    }[target]()


# ------------------------------------------------------------------ known product bugs


@dataclass(frozen=True)
class KnownBug:
    """An open product bug: ``matches(method, messages, outcome, server_errors)`` says whether a call's
    ending is this bug's signature."""

    key: str
    where: str
    summary: str
    matches: Callable[[str, Sequence[bytes | Stall], Outcome, Sequence[str]], bool]


# tests/test_fuzz.py keeps a reproducer of each case this fuzzing guards against: undecodable requests (answered by
# common.grpcsetup.add_service), an undecodable message after a verdict (cloud.service.drain), Negotiate with
# infinite or NaN measurements (NegotiateOffer.from_pb), the anonymous link evicted by max_links negotiations
# (LinkTable.register). An open bug goes here, keyed by ``KnownBug.key``; none is open.
KNOWN_BUGS: dict[str, KnownBug] = {}


def known_bug(method: str, messages: Sequence[bytes | Stall], out: Outcome, server_errors: Sequence[str]) -> str | None:
    """The ``KNOWN_BUGS`` key this call's ending matches, if any (``messages``: the request messages sent;
    ``server_errors``: exception type names the servers logged during the call)."""
    return next((b.key for b in KNOWN_BUGS.values() if b.matches(method, messages, out, server_errors)), None)


# ------------------------------------------------------------------ running


class PropertyFailure(AssertionError):
    """A case broke a property (the message says which and how)."""


class LoopThread:
    """An event loop on a daemon thread; ``run`` waits for a coroutine at most ``timeout_s``."""

    def __init__(self, name: str = "tandem-fuzz") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """The coroutine's result. Raises PropertyFailure (a hang) if it runs past ``timeout_s``; it is cancelled."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError:
            if fut.done():
                raise
            fut.cancel()
            with contextlib.suppress(BaseException):
                fut.result(5.0)
            raise PropertyFailure(f"hang: the case did not end within {timeout_s:.0f} s") from None

    def close(self) -> None:
        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(BaseException):
            asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(10.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10.0)
        if not self._thread.is_alive():
            self.loop.close()


class ServerErrors(logging.Handler):
    """Collects the exception types logged (with a traceback) by the ``tandem`` loggers."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.types: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[0] is not None:
            self.types.append(record.exc_info[0].__name__)


@dataclass
class Stats:
    """Cases run and how they ended, per target."""

    cases: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    known: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0


@dataclass
class Outcome:
    """How one turn or call ended: its status, the error (uplink target) or details, and what came back."""

    status: grpc.StatusCode
    detail: str = ""
    events: list[Any] = field(default_factory=list)


async def _drive(
    gw: Gateway,
    w: Work,
    peer: str,
    deadline: float | None,
) -> Outcome:
    """Send the mutated upload into ``gw.run_turn`` the way the servicer decodes it, answering NACKs and repair
    requests per ``w.policy``. Returns the outcome; any exception but a ``TandemError`` propagates."""
    queue: deque[pb.Uplink | Stall] = deque(w.items)
    last: dict[tuple[str, int], pb.Uplink] = {_key(m): m for m in w.items if isinstance(m, pb.Uplink)}
    resends = 0

    async def body() -> AsyncIterator[pb.Uplink]:
        while queue:  # every answer to what the gateway said about earlier items is queued by now
            m = queue.popleft()
            if isinstance(m, Stall):
                await asyncio.Event().wait()
            else:
                yield m

    def resend(keys: list[tuple[str, int]]) -> None:
        nonlocal resends
        for key in keys:
            m = w.originals.get(key) if w.policy == "honest" else last.get(key)
            if key == ("commit", 0):
                m = w.commit if w.policy == "honest" else last.get(key)
            if m is not None and resends < 64:
                resends += 1
                queue.append(m)

    events: list[Any] = []
    try:
        header = uplink_from_pb(pb.Uplink(header=w.header))
        assert isinstance(header, TurnHeader)
        turn = cast(AsyncGenerator[Any, None], gw.run_turn(header, uplink_body(body()), peer, deadline))
        async with contextlib.aclosing(turn):
            async for ev in turn:
                events.append(ev)
                if w.policy == "mute":
                    continue
                if isinstance(ev, Nack):
                    resend([("chunk", ev.seq)])
                elif isinstance(ev, Repair):
                    resend([*(("kv_block", j) for j in ev.leaf_indices), ("commit", 0)])
    except TandemError as e:
        return Outcome(status_of(e), f"{type(e).__name__}: {e}", events)
    return Outcome(OK, "", events)


def _check_final(events: Sequence[Any], what: str) -> None:
    finals = [e for e in events if isinstance(e, TurnFinal)]
    if len(finals) != 1 or events[-1] is not finals[0]:
        raise PropertyFailure(f"{what}: completed without exactly one final event last: {events[-4:]}")
    n = sum(len(e.token_ids) for e in events if isinstance(e, TokensOut))
    if n != finals[0].output_tokens:
        raise PropertyFailure(f"{what}: {n} tokens streamed, the final says {finals[0].output_tokens}")


def _tokens(events: Sequence[Any]) -> tuple[int, ...]:
    return tuple(t for e in events if isinstance(e, TokensOut) for t in e.token_ids)


GOOD_A = token_ids(99, 70)  # the good session's first prompt; its second extends it
GOOD_AB = token_ids(99, 101)


def good_uploads(params: LinkParams, session_id: str = GOOD_SESSION) -> tuple[Upload, Upload]:
    """The good session's two turns (the second sends only what the first did not)."""
    s = Sampling(max_new_tokens=6)
    first = make_upload(params, GOOD_A, session_id, "good-1", values_seed=99, sampling=s)
    second = make_upload(params, GOOD_AB, session_id, "good-2", cached_tokens=len(GOOD_A), values_seed=99, sampling=s)
    return first, second


async def run_good(gw: Gateway, u: Upload, what: str, caller: str = GOOD_EDGE) -> tuple[int, ...]:
    """Run a good upload honestly from ``caller``; its tokens. Raises PropertyFailure if it does not complete."""
    out = await _drive(gw, Work.of(u, gw.params, "honest"), caller, None)
    if out.status != OK:
        raise PropertyFailure(f"{what}: a good turn failed on the fuzzed gateway: {out.status.name} {out.detail}")
    _check_final(out.events, what)
    return _tokens(out.events)


@dataclass
class ServiceStack:
    """The ``Cloud`` and ``Edge`` gRPC servers on loopback (the edge's link to the cloud's gateway in process),
    client channels to both, and the reference results of good requests."""

    cloud: CloudStack
    cloud_servicer: CloudServicer
    cloud_server: grpc.aio.Server
    edge: EdgeNode
    edge_servicer: EdgeServicer
    edge_server: grpc.aio.Server
    batcher: HeadBatcher
    cloud_channel: grpc.aio.Channel
    edge_channel: grpc.aio.Channel
    reference: dict[str, Any] = field(default_factory=dict)

    @classmethod
    async def start(cls) -> ServiceStack:
        cloud = CloudStack.create(upload_timeout_s=5.0, drain_timeout_s=0.25)
        gw = cloud.gateway
        cloud_servicer = CloudServicer(gw, "toy-cloud")
        cloud_server, cloud_port, _ = await start_server(
            [lambda s: add_service(s, cloud_servicer, "Cloud")],
            ["tandem.v1.Cloud"],
            "127.0.0.1",
            0,
            gw.registry.max_message_bytes(),
        )
        key = MANIFEST.compatibility_key()
        conn = CloudConnection(InProcessLink(gw), NegotiateOffer("e", "toy", {K: key}, 4), probe_bytes=0)
        await conn.connect()
        batcher = HeadBatcher(MemoryHead(K, H, HKV, D), 4)
        batcher.start()
        edge = EdgeNode(ToyTokenizer(), [Head(batcher, key)], conn, EdgeSessions(64, 1 << 30), 30.0)
        edge_servicer = EdgeServicer(edge, "toy")
        edge_server, edge_port, _ = await start_server(
            [lambda s: add_service(s, edge_servicer, "Edge")],
            ["tandem.v1.Edge"],
            "127.0.0.1",
            0,
            4 << 20,
        )
        opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
        stack = cls(
            cloud,
            cloud_servicer,
            cloud_server,
            edge,
            edge_servicer,
            edge_server,
            batcher,
            grpc.aio.insecure_channel(f"127.0.0.1:{cloud_port}", options=opts),
            grpc.aio.insecure_channel(f"127.0.0.1:{edge_port}", options=opts),
        )
        await stack._take_reference()
        return stack

    def edge_link(self) -> str:
        """The edge's link to the cloud: another principal's than the gRPC callers'."""
        return self.edge.conn.current().link_id if self.edge.conn is not None else ""

    async def stop(self) -> None:
        await self.cloud_channel.close()
        await self.edge_channel.close()
        await self.cloud_server.stop(0)
        await self.edge_server.stop(0)
        await self.batcher.stop()

    # --- good requests

    def _good_generate(self) -> list[bytes]:
        return _serialized(make_upload(self.cloud.gateway.params, GOOD_A, "", "good-g", values_seed=5))

    def _good_session(self) -> tuple[list[bytes], list[bytes]]:
        first, second = good_uploads(self.cloud.gateway.params, GRPC_GOOD_SESSION)
        return _serialized(first), _serialized(second)

    def _good_chat(self, turn: int) -> bytes:
        convo = [pb.ChatMessage(role="user", content="hello there, fuzz")]
        if turn == 2:
            convo += [
                pb.ChatMessage(role="assistant", content="ok"),
                pb.ChatMessage(role="user", content="and a longer second question, to make a new KV block or two"),
            ]
        sid = "good-edge-session" if turn else ""
        return pb.ChatRequest(
            session_id=sid, messages=convo, sampling=pb.SamplingParams(max_new_tokens=5), mode=pb.MODE_SPLIT
        ).SerializeToString()

    async def _generate_tokens(self, msgs: list[bytes], what: str) -> tuple[int, ...]:
        out = await call(self.cloud_channel, "/tandem.v1.Cloud/Generate", "ss", msgs, None)
        if out.status != OK:
            raise PropertyFailure(f"{what}: {out.status.name} {out.detail}")
        downs = [pb.Downlink.FromString(m) for m in out.events]
        return tuple(t for m in downs if m.WhichOneof("msg") == "tokens" for t in m.tokens.token_ids)

    async def _chat_tokens(self, msg: bytes, what: str) -> tuple[int, ...]:
        out = await call(self.edge_channel, "/tandem.v1.Edge/Chat", "us", [msg], None)
        if out.status != OK:
            raise PropertyFailure(f"{what}: {out.status.name} {out.detail}")
        done = pb.ChatEvent.FromString(out.events[-1])
        if done.WhichOneof("event") != "done":
            raise PropertyFailure(f"{what}: the stream did not end with ChatDone")
        return tuple(done.done.output_token_ids)

    async def _take_reference(self) -> None:
        r = self.reference
        r["generate"] = await self._generate_tokens(self._good_generate(), "reference Generate")
        first, second = self._good_session()
        r["session"] = (
            await self._generate_tokens(first, "reference session turn 1"),
            await self._generate_tokens(second, "reference session turn 2"),
        )
        r["chat"] = await self._chat_tokens(self._good_chat(0), "reference Chat")
        r["edge-session"] = (
            await self._chat_tokens(self._good_chat(1), "reference edge session turn 1"),
            await self._chat_tokens(self._good_chat(2), "reference edge session turn 2"),
        )
        r["get-info"] = await self._get_info()
        # the sessions are left at turn 1: each health check runs turn 2 (their state lived through the cases
        # since the last check), then turn 1 again
        await self._generate_tokens(first, "reference session turn 1")
        await self._chat_tokens(self._good_chat(1), "reference edge session turn 1")

    async def _get_info(self) -> pb.EdgeInfo:
        out = await call(self.edge_channel, "/tandem.v1.Edge/GetInfo", "uu", [b""], None)
        if out.status != OK:
            raise PropertyFailure(f"GetInfo failed: {out.status.name} {out.detail}")
        return pb.EdgeInfo.FromString(out.events[0])

    async def wait_idle(self, timeout_s: float = 5.0) -> None:
        """Raises PropertyFailure if the servers' bookkeeping is not idle within ``timeout_s``."""
        t_end = time.monotonic() + timeout_s
        while True:
            busy = busy_bookkeeping(self.cloud.gateway)
            if self.cloud_servicer.in_flight:
                busy.append(f"{self.cloud_servicer.in_flight} Generate calls still in flight")
            in_cloud, in_flight = self.edge.turns_in_flight
            if in_cloud or in_flight:
                busy.append(f"edge turns in flight: {in_cloud} / {in_flight}")
            if not busy:
                return
            if time.monotonic() > t_end:
                raise PropertyFailure(f"not idle {timeout_s:.0f} s after the case: {'; '.join(busy)}")
            await asyncio.sleep(0.005)

    async def check_cloud(self) -> None:
        """The cloud still answers good requests with the reference results, its good session included."""
        r = self.reference
        first, second = self._good_session()
        got = await self._generate_tokens(second, "good session turn 2")
        if got != r["session"][1]:
            raise PropertyFailure(f"good session turn 2 gave {got}, reference {r['session'][1]}")
        got = await self._generate_tokens(first, "good session turn 1")
        if got != r["session"][0]:
            raise PropertyFailure(f"good session turn 1 gave {got}, reference {r['session'][0]}")
        got = await self._generate_tokens(self._good_generate(), "good Generate")
        if got != r["generate"]:
            raise PropertyFailure(f"good Generate gave {got}, reference {r['generate']}")
        info = await call(self.cloud_channel, "/tandem.v1.Cloud/GetServerInfo", "uu", [b""], None)
        if info.status != OK or not pb.ServerInfo.FromString(info.events[0]).serving:
            raise PropertyFailure(f"GetServerInfo after the case: {info.status.name} {info.detail}")

    async def check_edge(self) -> None:
        """The edge still answers good requests with the reference results, its good session included."""
        r = self.reference
        got = await self._chat_tokens(self._good_chat(2), "good edge session turn 2")
        if got != r["edge-session"][1]:
            raise PropertyFailure(f"good edge session turn 2 gave {got}, reference {r['edge-session'][1]}")
        got = await self._chat_tokens(self._good_chat(1), "good edge session turn 1")
        if got != r["edge-session"][0]:
            raise PropertyFailure(f"good edge session turn 1 gave {got}, reference {r['edge-session'][0]}")
        got = await self._chat_tokens(self._good_chat(0), "good Chat")
        if got != r["chat"]:
            raise PropertyFailure(f"good Chat gave {got}, reference {r['chat']}")
        if await self._get_info() != r["get-info"]:
            raise PropertyFailure("GetInfo changed")


def _serialized(u: Upload) -> list[bytes]:
    return [uplink_to_pb(x).SerializeToString() for x in (u.header, *u.items)]


def _identity(b: bytes) -> bytes:
    return b


async def call(
    channel: grpc.aio.Channel,
    method: str,
    arity: str,
    messages: Sequence[bytes | Stall],
    timeout_s: float | None,
) -> Outcome:
    """One call of raw request bytes; the outcome with the raw responses as ``events``."""
    responses: list[bytes] = []
    if arity == "uu":
        try:
            m = messages[0]
            assert isinstance(m, bytes)
            responses.append(
                await channel.unary_unary(method, request_serializer=_identity, response_deserializer=_identity)(
                    m, timeout=timeout_s
                )
            )
            return Outcome(OK, "", responses)
        except grpc.aio.AioRpcError as e:
            return Outcome(e.code(), e.details() or "", responses)

    released = asyncio.Event()  # a stalled request stream ends once the call has

    async def requests() -> AsyncIterator[bytes]:
        for m in messages:
            if isinstance(m, Stall):
                await released.wait()
                return
            yield m

    if arity == "us":
        assert isinstance(messages[0], bytes)
        c: Any = channel.unary_stream(method, request_serializer=_identity, response_deserializer=_identity)(
            messages[0], timeout=timeout_s
        )
    else:
        c = channel.stream_stream(method, request_serializer=_identity, response_deserializer=_identity)(
            requests(), timeout=timeout_s
        )
    try:
        with contextlib.suppress(grpc.aio.AioRpcError):
            async for r in c:
                responses.append(r)
        return Outcome(await c.code(), await c.details() or "", responses)
    finally:
        released.set()
        c.cancel()


class Harness:
    """The stacks every property runs against, in one event loop on a background thread (``LoopThread``).

    ``check(target, case)`` runs one case and raises ``PropertyFailure`` (or the unexpected exception) when it
    breaks its target's property; ``stats`` counts cases and outcomes. ``strict``: a case that hits one of
    ``KNOWN_BUGS`` fails too. ``check_every``: the gRPC targets check the good requests after every so many cases
    (and ``final_check`` at the end)."""

    def __init__(self, *, hang_s: float = 30.0, strict: bool = False, check_every: int = 5) -> None:
        self.hang_s, self.strict, self.check_every = hang_s, strict, check_every
        self.stats = {t: Stats() for t in TARGETS}
        self.errors = ServerErrors()
        self._log = logging.getLogger("tandem")
        self._log.addHandler(self.errors)
        self._n = itertools.count()  # names sessions and requests of the cases apart
        self._grpc_cases = itertools.count()
        self.loop = LoopThread()
        self.loop.run(self._start(), 120.0)

    async def _start(self) -> None:
        self.gateways = {f: CloudStack.create(**cfg) for f, cfg in FLAVORS.items()}
        offer = NegotiateOffer("good", "toy", {K: MANIFEST.compatibility_key()}, 4)
        self.other_links = {f: s.gateway.negotiate(offer, GOOD_EDGE).link_id for f, s in self.gateways.items()}
        self.reference: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        for f, cfg in FLAVORS.items():  # the good session on a fresh gateway of each flavor
            fresh = CloudStack.create(**cfg).gateway
            first, second = good_uploads(fresh.params)
            self.reference[f] = (await run_good(fresh, first, "reference"), await run_good(fresh, second, "reference"))
        self.services = await ServiceStack.start()

    def close(self) -> None:
        """Stop the servers and the loop."""
        with contextlib.suppress(BaseException):
            self.loop.run(self.services.stop(), 30.0)
        self.loop.close()
        self._log.removeHandler(self.errors)

    def check(self, target: str, case: Any) -> None:
        """Run one case of ``target`` against its property."""
        runners: dict[str, Callable[[Any], Coroutine[Any, Any, str]]] = {
            "uplink": self._uplink,
            "cloud-typed": self._cloud_typed,
            "cloud-raw": self._cloud_raw,
            "edge-typed": self._edge_typed,
            "edge-raw": self._edge_raw,
        }
        run = runners[target]
        st_ = self.stats[target]
        st_.cases += 1
        t0 = time.perf_counter()
        try:
            outcome = self.loop.run(run(case), self.hang_s)
        finally:
            st_.seconds += time.perf_counter() - t0
        st_.outcomes[outcome] += 1

    def final_check(self) -> None:
        """The servers are idle and still answer good requests with the reference results."""
        self.loop.run(self._final(), self.hang_s)

    async def _final(self) -> None:
        for stack in self.gateways.values():
            if busy := busy_bookkeeping(stack.gateway):
                raise PropertyFailure("; ".join(busy))
        await self.services.wait_idle()
        await self.services.check_cloud()
        await self.services.check_edge()
        await self.services.wait_idle()

    # --- uplink

    async def _uplink(self, plan: UplinkPlan) -> str:
        stack = self.gateways[plan.flavor]
        gw = stack.gateway
        n = next(self._n)
        sid = "" if plan.scenario == "stateless" else f"fz-{n}"
        base = plan.base_tokens if plan.scenario == "next" else 0
        ids = token_ids(plan.values_seed, base + plan.new_tokens)
        params = gw.params
        if base:  # the session's earlier turn
            first = make_upload(params, ids[:base], sid, f"fz-{n}-0", values_seed=plan.values_seed)
            await run_good(gw, first, "the victim session's first turn", FUZZ_EDGE)
        upload = make_upload(params, ids, sid, f"fz-{n}-1", cached_tokens=base, values_seed=plan.values_seed)
        w = Work.of(upload, params, plan.policy, self.other_links[plan.flavor])
        expect = frozenset({OK})
        for m in plan.mutations:
            expect = m.apply(w)
        strict = len(plan.mutations) <= 1
        loop = asyncio.get_running_loop()
        deadline = None
        if plan.deadline == "past":
            deadline, expect = loop.time() - 1.0, (expect - {OK}) | {DEADLINE}
        elif w.stall:
            deadline = loop.time() + 0.05
        victim = cloud_session(gw, FUZZ_EDGE, sid)
        before = _snapshot(victim)
        good_first, good_second = good_uploads(params)
        want = self.reference[plan.flavor]
        got1 = await run_good(gw, good_first, "good session turn 1")
        out, got2 = await asyncio.gather(
            _drive(gw, w, FUZZ_EDGE, deadline), run_good(gw, good_second, "good session turn 2")
        )
        what = f"{out.status.name} ({out.detail[:300]})"
        if out.status not in ALLOWED:
            raise PropertyFailure(f"the fuzzed turn ended {what}")
        if strict and out.status not in expect:
            raise PropertyFailure(f"the fuzzed turn ended {what}; expected {sorted(s.name for s in expect)}")
        if out.status == OK:
            _check_final(out.events, "the fuzzed turn")
        if (got1, got2) != want:
            raise PropertyFailure(f"good session gave {(got1, got2)} beside the fuzzed turn; a fresh gateway {want}")
        if victim is not None and before is not None:
            # the session moves on exactly when the cloud acknowledged the upload (the edge keeps its own state
            # then, even if the turn fails later, e.g. past its deadline in the tail prefill)
            after = _snapshot(cloud_session(gw, FUZZ_EDGE, sid))
            acked = w.header.session_id == sid and any(isinstance(e, UploadAck) for e in out.events)
            if not acked and after != before:
                raise PropertyFailure(f"session {sid!r} changed although the turn on it ended {what} unacknowledged")
            if acked and (after is None or after[0] != before[0] + 1 or after[1] != list(w.header.prompt_token_ids)):
                raise PropertyFailure(f"session {sid!r} does not hold the acknowledged turn ({what})")
        if busy := busy_bookkeeping(gw):
            raise PropertyFailure(f"after the fuzzed turn ({what}): {'; '.join(busy)}")
        return out.status.name

    # --- gRPC

    async def _grpc_case(
        self, channel: grpc.aio.Channel, method: str, arity: str, msgs: Sequence[bytes | Stall], timeout_s: float | None
    ) -> tuple[Outcome, str | None]:
        self.errors.types.clear()
        out = await call(channel, method, arity, msgs, timeout_s)
        await self.services.wait_idle()
        bug = known_bug(method, msgs, out, self.errors.types)
        return out, bug

    def _judge(
        self,
        target: str,
        method: str,
        out: Outcome,
        bug: str | None,
        expect: Expect | None = None,
        client_deadline: bool = False,
    ) -> str:
        allowed = ALLOWED | ({S.UNIMPLEMENTED} if method in UNKNOWN_METHODS else frozenset())
        if method in UNKNOWN_METHODS and out.status != S.UNIMPLEMENTED:
            raise PropertyFailure(f"unknown method {method} ended {out.status.name}: {out.detail[:200]}")
        if bug is not None and out.status not in allowed:
            self.stats[target].known[bug] += 1
            if self.strict:
                raise PropertyFailure(f"known bug {bug}: {method} ended {out.status.name}: {out.detail[:200]}")
            return f"known:{bug}"
        if out.status not in allowed:
            raise PropertyFailure(
                f"{method} ended {out.status.name}: {out.detail[:300]} (server errors: {self.errors.types})"
            )
        if expect is not None and out.status not in expect:
            raise PropertyFailure(
                f"{method} ended {out.status.name} ({out.detail[:300]}); expected {sorted(s.name for s in expect)}"
            )
        if method.endswith("/Generate"):
            _check_verdict(out, client_deadline)
        return out.status.name

    async def _periodic(self, check: Callable[[], Coroutine[Any, Any, None]]) -> None:
        if next(self._grpc_cases) % self.check_every == self.check_every - 1:
            await check()
            await self.services.wait_idle()

    async def _cloud_raw(self, case: RawCall) -> str:
        arity = {**CLOUD_METHODS, **UNKNOWN_METHODS}[case.method]
        if arity != "ss" and not case.messages:
            return "skipped"
        out, bug = await self._grpc_case(self.services.cloud_channel, case.method, arity, case.messages, None)
        verdict = self._judge("cloud-raw", case.method, out, bug)
        await self._periodic(self.services.check_cloud)
        return verdict

    async def _edge_raw(self, case: RawCall) -> str:
        arity = {**EDGE_METHODS, **UNKNOWN_METHODS}[case.method]
        out, bug = await self._grpc_case(self.services.edge_channel, case.method, arity, case.messages, None)
        verdict = self._judge("edge-raw", case.method, out, bug)
        await self._periodic(self.services.check_edge)
        return verdict

    async def _cloud_typed(self, case: TypedCall) -> str:
        arity = CLOUD_METHODS[case.method]
        expect: Expect | None = None
        timeout_s: float | None = None
        m: Any = case.message
        other = self.services.edge_link()
        if isinstance(case.message, UplinkPlan):
            msgs, expect, stall = self._plan_messages(case.message)
            timeout_s = 0.6 if stall else None  # past the drain after a verdict (0.25 s): its status comes first
        elif isinstance(case.message, tuple):  # no header first: INVALID_ARGUMENT
            msgs = [m.SerializeToString() for m in case.message]
            expect = None if case.message and case.message[0].HasField("header") else frozenset({INVALID})
        else:  # NegotiateRequest, ServerInfoRequest
            if m.link_id == OTHER_LINK:
                m = overridden(m, {"link_id": other})
            msgs = [m.SerializeToString()]
        out, bug = await self._grpc_case(self.services.cloud_channel, case.method, arity, msgs, timeout_s)
        verdict = self._judge("cloud-typed", case.method, out, bug, expect, timeout_s is not None)
        if out.status == OK and case.method.endswith("/Negotiate"):
            r = pb.NegotiateResponse.FromString(out.events[0])
            if not r.link_id or 0 not in r.params_by_split:
                raise PropertyFailure(f"Negotiate answered OK without a link id or direct-mode params: {r}")
            if r.link_id == other:
                raise PropertyFailure("Negotiate handed another edge's link to this caller")
        if out.status == OK and case.method.endswith("/GetServerInfo"):
            if pb.ServerInfo.FromString(out.events[0]).link_known and m.link_id == other:
                raise PropertyFailure("GetServerInfo told this caller about another edge's link")
        await self._periodic(self.services.check_cloud)
        return verdict

    def _plan_messages(self, plan: UplinkPlan) -> tuple[list[bytes | Stall], Expect | None, bool]:
        """An uplink plan as Generate's request messages (stateless or a new session: no earlier turn)."""
        gw = self.services.cloud.gateway
        n = next(self._n)
        sid = "" if plan.scenario == "stateless" else f"fzg-{n}"
        ids = token_ids(plan.values_seed, plan.new_tokens)
        u = make_upload(gw.params, ids, sid, f"fzg-{n}", values_seed=plan.values_seed)
        w = Work.of(u, gw.params, "mute", self.services.edge_link())
        expect = frozenset({OK})
        for m in plan.mutations:
            expect = m.apply(w)
        msgs: list[bytes | Stall] = [pb.Uplink(header=w.header).SerializeToString()]
        msgs += [m if isinstance(m, Stall) else m.SerializeToString() for m in w.items]
        return msgs, (expect if len(plan.mutations) <= 1 else None), w.stall

    async def _edge_typed(self, case: TypedCall) -> str:
        arity = EDGE_METHODS[case.method]
        msg = case.message.SerializeToString()
        out, bug = await self._grpc_case(self.services.edge_channel, case.method, arity, [msg], None)
        verdict = self._judge("edge-typed", case.method, out, bug)
        if out.status == OK and case.method.endswith("/Chat"):
            evs = [pb.ChatEvent.FromString(m) for m in out.events]
            if not evs or evs[-1].WhichOneof("event") != "done" or sum(e.HasField("done") for e in evs) != 1:
                raise PropertyFailure("Chat answered OK without exactly one ChatDone, last")
        await self._periodic(self.services.check_edge)
        return verdict


def _check_verdict(out: Outcome, client_deadline: bool) -> None:
    """A Generate call's Downlink.error (the verdict, last) names an error of the call's status (unless the
    client's own deadline ended the call while the server waited for it to stop sending, ``drain``)."""
    downs = []
    for m in out.events:
        try:
            downs.append(pb.Downlink.FromString(m))
        except Exception as e:
            raise PropertyFailure(f"Generate sent a Downlink that does not parse: {e}") from None
    errors = [d for d in downs if d.WhichOneof("msg") == "error"]
    if out.status == OK:
        if errors or not downs or downs[-1].WhichOneof("msg") != "final":
            raise PropertyFailure("Generate ended OK without its final message last, or with an error message")
        return
    if len(errors) > 1 or (errors and downs[-1] is not errors[0]):
        raise PropertyFailure("Generate sent more than one verdict, or not as its last message")
    if errors and not (client_deadline and out.status == DEADLINE):
        err = error_from_name(errors[0].error.kind, errors[0].error.message)
        if status_of(err) != out.status:
            raise PropertyFailure(
                f"Generate's verdict {errors[0].error.kind} is {status_of(err).name}, the call ended {out.status.name}"
            )


def cloud_session(gw: Gateway, caller: str, session_id: str) -> CloudSession | None:
    """The gateway's session ``session_id`` of edge ``caller`` (sessions live in their edge's namespace)."""
    return gw.sessions.get(scoped(as_principal(caller), session_id))


def _snapshot(s: CloudSession | None) -> tuple[Any, ...] | None:
    if s is None:
        return None
    hidden = None if s.hidden is None else s.hidden.tobytes()
    return (s.version, list(s.token_ids), list(s.leaves), hidden)


def describe(stats: dict[str, Stats]) -> str:
    """One line per target: cases, seconds, outcomes, known bugs hit."""
    lines = []
    for t, s in stats.items():
        if not s.cases:
            continue
        outcomes = ", ".join(f"{k} {v}" for k, v in s.outcomes.most_common())
        known = f"; known bugs hit: {dict(s.known)}" if s.known else ""
        lines.append(f"{t:12s} {s.cases:6d} cases in {s.seconds:6.1f} s: {outcomes}{known}")
    total = sum(s.cases for s in stats.values())
    lines.append(f"{'total':12s} {total:6d} cases")
    return "\n".join(lines)
