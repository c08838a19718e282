"""One turn's upload, checked piece by piece: the header against the link params
and the session, each activation chunk against its CRC32C and the prompt range,
each KV block against the chained block hash the cloud computes itself from the
prompt token ids and against its RFC 6962 leaf, and the commit against the
Merkle root over the session's leaves.

Pure domain code (no grpc, no engines). Nothing from the wire is trusted before
it is checked: every size against the negotiated limits on arrival, before the
payload is decoded; nothing touches the session or the block store until the
whole upload verified (``apply_to``), so a bad request never corrupts other state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tandem.cloud.sessions.table import CloudSession
from tandem.common.protocol.errors import (
    ChecksumMismatch,
    CorruptPayload,
    InvalidRequest,
    ParamsVersionMismatch,
    SessionNotFound,
    SessionOutOfSync,
)
from tandem.common.protocol.limits import MAX_ID_BYTES as MAX_ID_BYTES
from tandem.common.protocol.limits import RequestLimits, check_session_id
from tandem.common.protocol.manifest import SplitManifest
from tandem.common.protocol.params import LinkParams
from tandem.common.wire import chunks as wire
from tandem.common.wire.kvblocks import LayerRange, block_hashes
from tandem.common.wire.kvcodec import (
    BlockSpec,
    Commit,
    KVBlock,
    check_block,
    check_commit,
    check_commit_span,
    open_block,
)
from tandem.common.wire.kvwire import kv_raw_nbytes
from tandem.common.wire.messages import TurnHeader


def wire_limits(params: LinkParams, manifest: SplitManifest) -> RequestLimits:
    """The request limits a turn under ``params`` is checked against: the ones the edge was told
    (``LinkParams``), so that the edge's own check (``edge.validation``) refuses first, alike."""
    return RequestLimits(
        vocab_size=manifest.shape.vocab_size,
        max_prompt_tokens=params.max_prompt_tokens,
        max_new_tokens=params.max_new_tokens,
        max_model_len_tokens=params.max_model_len_tokens,
    )


def check_header(h: TurnHeader, params: LinkParams, manifest: SplitManifest) -> None:
    """Raises InvalidRequest / ParamsVersionMismatch for a header outside the negotiated limits
    (its prompt and sampling: ``RequestLimits.check``)."""
    for name, value in (("request_id", h.request_id), ("session_id", h.session_id)):
        check_session_id(value, name)  # text of at most MAX_ID_BYTES bytes, as the edge checks them
    if h.params_version != params.params_version:
        raise ParamsVersionMismatch(f"header uses params v{h.params_version}, link is at v{params.params_version}")
    wire_limits(params, manifest).check(h.prompt_token_ids, h.sampling)
    if h.split_layer not in (0, manifest.split_layer):
        raise InvalidRequest(f"split layer {h.split_layer}; this cloud serves k={manifest.split_layer} or 0")
    t = len(h.prompt_token_ids)
    if h.split_layer == 0:
        if h.num_chunks or h.num_kv_blocks or h.cached_tokens:
            raise InvalidRequest("direct mode carries no chunks, KV blocks or cached tokens")
        return
    if h.cached_tokens > t:
        raise InvalidRequest(f"cached_tokens {h.cached_tokens} > prompt length {t}")
    new = t - h.cached_tokens
    want_chunks = -(-new // params.chunk_tokens)
    if h.num_chunks != want_chunks:
        raise InvalidRequest(
            f"{new} new tokens need {want_chunks} chunks of {params.chunk_tokens}, header says {h.num_chunks}"
        )
    if h.num_kv_blocks > t // params.kv_block_size_tokens:
        raise InvalidRequest(f"{h.num_kv_blocks} KV blocks for a {t}-token prompt")


def check_values(x: np.ndarray, max_abs: float, what: str) -> None:
    """Raises InvalidRequest for NaN, inf or values beyond ``max_abs``: such inputs would reach
    vLLM's paged KV cache, whose reused blocks are not zeroed on every backend."""
    if not np.isfinite(x).all():
        raise InvalidRequest(f"{what} contain NaN or inf")
    if x.size and float(np.abs(x).max()) > max_abs:
        raise InvalidRequest(f"{what} exceed |x| <= {max_abs:g}")


def upload_bound_bytes(h: TurnHeader, params: LinkParams, manifest: SplitManifest) -> int:
    """Most bytes a checked header's upload may buffer: every chunk and KV block at the larger of
    its largest legal payload and what is kept of it (float32: activations ``[n, H]``, KV blocks
    ``[k, 2, Hkv, B, D]``; a quantised format decodes to up to 8x its wire size). Reserved against
    the cloud's upload budget before any body arrives."""
    sh = manifest.shape
    n, B = params.chunk_tokens, params.kv_block_size_tokens
    chunk = max(
        wire.max_payload_bytes(wire.raw_nbytes_of(n, params.wire_dtype, sh.hidden_size), params.codec),
        wire.raw_nbytes_of(n, wire.WireDtype.FP32, sh.hidden_size),
    )
    shape = (manifest.split_layer, 2, sh.num_kv_heads, B, sh.head_dim)
    block = max(
        wire.max_payload_bytes(kv_raw_nbytes(shape, params.kv_wire_dtype), params.codec),
        kv_raw_nbytes(shape, wire.WireDtype.FP32),
    )
    return h.num_chunks * chunk + h.num_kv_blocks * block


@dataclass
class TurnUpload:
    """Collects and verifies one split turn's upload (see module doc).

    Built from a snapshot of the session (its tokens, leaves and ``version``) without
    holding the session's lock, so a stalled upload never locks out the session's
    owner; ``apply_to`` commits only if the session is still at that version.
    Who calls: the receive path (``cloud.uploads.receive``), ``add_chunk`` / ``add_block`` per arriving
    item (in a worker thread: they decode and hash), ``commit`` per commit, ``release`` when the
    turn ends; the prefix keeper (``cloud.uploads.prefixkeeper``) ``apply_prefix``, ``blocks_stored`` and
    ``prefix_kept`` as it keeps a verified prefix.
    """

    header: TurnHeader
    params: LinkParams
    manifest: SplitManifest
    session: CloudSession
    hash_seed: bytes
    max_abs: float = 1e5  # bound on |activation| and |KV| values
    chunks: dict[int, np.ndarray] = field(default_factory=dict)  # seq -> float32 [n, H], verified
    resends: dict[int, int] = field(default_factory=dict)
    blocks: dict[int, tuple[KVBlock, bytes]] = field(default_factory=dict)  # leaf -> (block, raw bytes)
    committed: bool = False
    received_bytes: dict[str, int] = field(default_factory=lambda: {"activations": 0, "kv": 0})
    # written through ``prefix_kept`` / ``blocks_stored`` (by ``cloud.uploads.prefixkeeper.PrefixKeeper``)
    kept_tokens: int = 0  # prompt tokens [0, n) of this turn its session holds (memory and store): acknowledged
    kept_leaves: int = 0  # the session's leaves whose KV blocks are in the store (this turn's kept prefix)

    def __post_init__(self) -> None:
        h, s = self.header, self.session
        # cached_tokens == 0 restarts the session (a resend from token 0 after eviction); 0 < cached_tokens
        # <= what the session holds keeps that verified prefix (an edit or a regenerated answer): its
        # activations and the leaves of the full blocks inside it, a tree cut to a prefix of its leaves
        c = h.cached_tokens
        if c and not s.token_ids:
            raise SessionNotFound(
                f"this cloud holds no session {h.session_id!r} of this edge (never made, evicted, or another "
                f"edge's): resend from token 0"
            )
        if c > len(s.token_ids) or list(h.prompt_token_ids[:c]) != s.token_ids[:c]:
            raise SessionOutOfSync(
                f"cloud holds {len(s.token_ids)} tokens of session {h.session_id!r}; the edge assumed {c}"
                + (" with other token ids" if c <= len(s.token_ids) else "")
                + ": sync the session or resend from token 0"
            )
        if c and s.split_layer != h.split_layer:
            raise SessionOutOfSync(
                f"session {h.session_id!r} holds activations of split layer {s.split_layer}, the turn is at "
                f"k={h.split_layer}: resend from token 0"
            )
        bs = self.params.kv_block_size_tokens
        if c and s.block_tokens != bs:
            raise SessionOutOfSync(f"session {h.session_id!r} was cut in blocks of {s.block_tokens} tokens, not {bs}")
        self.base_version = s.version
        self.base_hidden = s.hidden[:c] if c and s.hidden is not None else None
        self.base_leaves = list(s.leaves[: c // bs]) if c else []
        self.bs = self.params.kv_block_size_tokens
        self.hashes = block_hashes(list(h.prompt_token_ids), self.bs, self.hash_seed)
        self.first_new_leaf = len(self.base_leaves)
        if self.first_new_leaf > len(self.hashes):
            raise SessionOutOfSync("session has more KV leaves than the prompt has blocks: resend from token 0")
        if h.num_kv_blocks != len(self.expected_leaves):
            raise InvalidRequest(
                f"header announces {h.num_kv_blocks} KV blocks; the prompt needs "
                f"{len(self.expected_leaves)} new full blocks"
            )
        self.part = LayerRange(lo=0, hi=self.manifest.split_layer)
        # what every KV block of this upload must be (the one KV-block codec checks it)
        self.block_spec = BlockSpec.of(
            self.hashes, self.first_new_leaf, self.part, self.manifest.shape, self.params, h.params_version,
            self.max_abs,
        )  # fmt: skip

    @property
    def max_item_bytes(self) -> int:
        """The largest legal payload of one chunk or KV block of this upload."""
        p = self.params
        chunk = wire.raw_nbytes_of(p.chunk_tokens, p.wire_dtype, self.manifest.shape.hidden_size)
        return max(wire.max_payload_bytes(chunk, p.codec), self.block_spec.max_payload_bytes)

    @property
    def stored_tokens(self) -> int:
        """Prompt tokens ``[0, n)`` whose session state the store held before this turn or holds
        since a kept prefix: a save of the session writes its pieces from there on."""
        return max(self.kept_tokens, self.header.cached_tokens)

    def blocks_stored(self, n_leaves: int) -> None:
        """The KV blocks of the session's first ``n_leaves`` leaves are in the store (a kept
        prefix's): ``new_blocks(kept_leaves)`` leaves them out."""
        self.kept_leaves = max(self.kept_leaves, n_leaves)

    def prefix_kept(self, n_tokens: int) -> None:
        """The session holds prompt tokens ``[0, n_tokens)`` of this turn in memory and in the store
        (``kept_tokens``: what the edge is told it may resume from)."""
        self.kept_tokens = n_tokens

    @property
    def new_tokens(self) -> int:
        return len(self.header.prompt_token_ids) - self.header.cached_tokens

    @property
    def expected_leaves(self) -> range:
        """Leaves this turn must deliver: the full blocks not yet in the session."""
        return range(self.first_new_leaf, len(self.hashes))

    def add_chunk(self, c: wire.Chunk) -> bool:
        """Check, decode and keep a chunk. Returns False when it failed its CRC32C or did not decode
        (caller NACKs it; the edge sends it again).

        Raises:
            InvalidRequest: seq, offset, size or format outside this upload and the link's limits
                (checked before the payload is touched), or values out of range.
            ChecksumMismatch: the chunk failed its CRC more than ``max_chunk_resends`` times.
            CorruptPayload: it failed to decode more than ``max_chunk_resends`` times.
        """
        p, h, hidden = self.params, self.header, self.manifest.shape.hidden_size
        if not 0 <= c.seq < h.num_chunks:
            raise InvalidRequest(f"chunk seq {c.seq} outside 0..{h.num_chunks - 1}")
        if c.params_version != h.params_version:
            raise ParamsVersionMismatch(
                f"chunk {c.seq} made with params v{c.params_version}; its request runs under v{h.params_version}"
            )
        want_off = h.cached_tokens + c.seq * p.chunk_tokens
        want_n = min(p.chunk_tokens, len(h.prompt_token_ids) - want_off)
        if c.seq in self.chunks:
            raise InvalidRequest(f"chunk {c.seq} sent again after it verified")
        if c.wire_dtype != p.wire_dtype or c.codec != p.codec:
            raise InvalidRequest(
                f"chunk {c.seq} uses {c.wire_dtype.name}/{c.codec.name}; the link negotiated "
                f"{p.wire_dtype.name}/{p.codec.name}"
            )
        if c.token_offset != want_off or c.num_tokens != want_n:
            raise InvalidRequest(
                f"chunk {c.seq} covers [{c.token_offset}, +{c.num_tokens}), expected [{want_off}, +{want_n})"
            )
        raw_nbytes = wire.raw_nbytes_of(want_n, p.wire_dtype, hidden)
        if c.raw_nbytes != raw_nbytes or len(c.payload) > wire.max_payload_bytes(raw_nbytes, p.codec):
            raise InvalidRequest(
                f"chunk {c.seq}: {len(c.payload)} payload bytes announcing {c.raw_nbytes} raw; "
                f"{want_n} tokens in {p.wire_dtype.name}/{p.codec.name} are {raw_nbytes} raw bytes"
            )
        self.received_bytes["activations"] += len(c.payload)
        try:
            x = wire.decode_chunk(c, hidden, want_n)
        except (ChecksumMismatch, CorruptPayload) as e:
            n = self.resends[c.seq] = self.resends.get(c.seq, 0) + 1
            if n > p.max_chunk_resends:
                raise type(e)(f"chunk {c.seq} failed {n} times: {e}") from None
            return False
        check_values(x, self.max_abs, f"activations of chunk {c.seq}")
        self.chunks[c.seq] = x
        return True

    def add_block(self, b: KVBlock) -> None:
        """Check and keep a KV block (``common.wire.kvcodec``: ``check_block``, then ``open_block``); a
        block that fails its CRC32C or leaf, or does not decode, is kept out and requested again at
        the commit.

        Raises:
            InvalidRequest: index, identity, layer range, format or size inconsistent with the prompt
                and the link's limits (checked before the payload is touched), a block sent again
                after it verified, or values out of range.
            ParamsVersionMismatch: made with other link params than the request's.
        """
        check_block(b, self.block_spec)
        if b.leaf_index in self.blocks:
            raise InvalidRequest(f"KV block leaf {b.leaf_index} sent again after it verified")
        self.received_bytes["kv"] += len(b.payload)
        try:
            kv = open_block(b, self.block_spec)  # canonical float32, what the store holds
        except (ChecksumMismatch, CorruptPayload):
            return  # corrupt in transit: it stays missing and is repaired at commit
        self.blocks[b.leaf_index] = (b, kv.tobytes())

    def missing_leaves(self) -> list[int]:
        return [j for j in self.expected_leaves if j not in self.blocks]

    def commit(self, leaf_count: int, root: bytes) -> list[int]:
        """Check the committed tree (the session's, from leaf 0: ``common.wire.kvcodec.check_commit``);
        returns leaves to repair (empty when verified).

        Raises:
            MerkleMismatch: leaf count wrong, or every leaf verified but the root does not.
        """
        c = Commit(leaf_count=leaf_count, merkle_root=root)
        check_commit_span(c, 0, len(self.hashes))
        missing = self.missing_leaves()
        if missing:
            return missing
        check_commit(c, 0, self.leaves())
        self.committed = True
        return []

    def leaves(self) -> list[bytes]:
        """The session's leaves after this turn (all verified once ``complete``)."""
        return self.base_leaves + [self.blocks[j][0].leaf_hash for j in self.expected_leaves]

    @property
    def complete(self) -> bool:
        return self.committed and len(self.chunks) == self.header.num_chunks

    def activations(self) -> np.ndarray:
        """float32 ``[T, H]`` of the whole prompt: the session's earlier activations, then this
        turn's verified chunks in order (only after ``complete``)."""
        new = [self.chunks[i] for i in range(self.header.num_chunks)]
        parts = ([self.base_hidden] if self.base_hidden is not None else []) + new
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def new_blocks(self, first: int | None = None, end: int | None = None) -> list[tuple[bytes, bytes]]:
        """(Merkle leaf, raw canonical bytes) of the verified new blocks with leaf index in
        ``[first, end)`` (default: all of them), in leaf order: the leaf commits to the block's
        identity, layers and bytes, so it is the block's content key."""
        lo = self.first_new_leaf if first is None else max(first, self.first_new_leaf)
        hi = len(self.hashes) if end is None else end
        return [(self.blocks[j][0].leaf_hash, self.blocks[j][1]) for j in range(lo, hi)]

    def verified_prefix(self) -> int:
        """Prompt tokens ``[0, n)`` of which this upload holds everything a session needs: the
        activation chunks from the first one on without a gap, and every new full KV block inside
        them, each checked on arrival (chunks by CRC32C, blocks by their leaf hash; the Merkle root
        over the leaves is checked by a later commit). At least ``cached_tokens``. What a cut upload
        leaves the session (``apply_prefix``) and a resumed one starts from."""
        h = self.header
        j = 0
        while j in self.chunks:
            j += 1
        n = min(h.cached_tokens + j * self.params.chunk_tokens, len(h.prompt_token_ids))
        for leaf in range(self.first_new_leaf, n // self.bs):
            if leaf not in self.blocks:
                n = leaf * self.bs
                break
        return max(n, h.cached_tokens)

    def prefix_parts(self, n: int) -> tuple[list[np.ndarray], list[bytes]]:
        """The pieces of the session holding the first ``n <= verified_prefix()`` prompt tokens:
        float32 activation arrays whose concatenation's first ``n`` rows are its ``[n, H]`` (the
        arrays themselves: ``release`` drops the upload's references, not them), and the leaves of
        its ``n // B`` full blocks."""
        c, ct = self.header.cached_tokens, self.params.chunk_tokens
        new = [self.chunks[i] for i in range(-(-(n - c) // ct))]
        parts = ([self.base_hidden] if self.base_hidden is not None else []) + new
        leaves = self.base_leaves + [self.blocks[j][0].leaf_hash for j in range(self.first_new_leaf, n // self.bs)]
        return parts, leaves

    def prefix(self, n: int) -> tuple[np.ndarray, list[int], list[bytes]]:
        """Activations float32 ``[n, H]`` (a copy), token ids and leaves of ``prefix_parts(n)``."""
        parts, leaves = self.prefix_parts(n)
        hidden = np.ascontiguousarray(np.concatenate(parts)[:n], np.float32)
        return hidden, list(self.header.prompt_token_ids[:n]), leaves

    def apply_prefix(self, s: CloudSession, n: int, hidden: np.ndarray, leaves: list[bytes]) -> None:
        """Commit the first ``n`` prompt tokens (``prefix(n)``: ``hidden`` and ``leaves``) into
        session ``s`` (its lock held) while the rest of the upload is still on its way; the turn's
        own commit (``apply_to``) then continues from there.

        Raises:
            SessionOutOfSync: another turn of the session committed since this upload began.
        """
        if s.version != self.base_version:
            raise SessionOutOfSync("another turn of this session committed during the upload")
        s.hidden, s.token_ids, s.leaves = hidden, list(self.header.prompt_token_ids[:n]), list(leaves)
        s.split_layer, s.block_tokens = self.header.split_layer, self.bs
        s.version += 1
        self.base_version = s.version

    def apply_to(self, s: CloudSession, hidden: np.ndarray) -> None:
        """Commit the verified turn into session ``s`` (its lock held, only after ``complete``).

        Raises:
            SessionOutOfSync: another turn of the session committed since this upload began.
        """
        if s.version != self.base_version:
            raise SessionOutOfSync("another turn of this session committed during the upload: resend from token 0")
        s.hidden, s.token_ids, s.leaves = hidden, list(self.header.prompt_token_ids), self.leaves()
        s.split_layer, s.block_tokens = self.header.split_layer, self.bs
        s.version += 1
        self.base_version = s.version

    def release(self) -> None:
        """Drop buffered payloads (the turn ended, verified or not)."""
        self.chunks.clear()
        self.blocks.clear()
        self.base_hidden = None
