"""Framing of a turn's upload: pure functions of the edge session, the token ids and the link's
params that build what goes to the cloud.

* ``direct_turn``: just the header (token ids up, ``k = 0``);
* ``split_turn``: the activations past what the cloud holds as chunks (``common.wire.chunks.split``:
  wire dtype, codec, CRC32C), the full head-KV blocks past its leaves (``kv_blocks``, framed by
  the one KV-block codec ``common.wire.kvcodec``: each with its BLAKE3 Merkle leaf and CRC32C),
  and the commit (leaf count, RFC 6962 root; ``commit``);
* ``pipelined_turn`` and ``piece``: the same turn framed while its head runs in pieces, the
  header first (its counts follow from the token ids alone), then each piece's whole chunks and
  the blocks inside them;
* ``sync_request``: the ``SyncSession`` question (all the session's leaves, the root and a
  consistency proof from the leaves the edge believes the cloud holds).

What the cloud holds is read from the ``EdgeSession`` (``cloud_tokens``, ``leaves``); nothing
here changes the session, sends or waits (``edge.modes.cloud`` decides when to frame and
``edge.link.uplink`` sends). Shapes: ``T`` tokens, ``H`` hidden size, ``k`` head layers, ``Hkv`` KV
heads, ``D`` head dim; activations float32 ``[T, H]``, head KV float32 ``[k, 2, Hkv, T, D]``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np

from tandem.common.protocol.errors import InvalidRequest
from tandem.common.protocol.params import LinkParams, SyncRequest
from tandem.common.wire import chunks as wire
from tandem.common.wire import kvblocks, merkle
from tandem.common.wire.kvblocks import LayerRange, split_blocks
from tandem.common.wire.kvcodec import KVBlock, encode_block
from tandem.common.wire.messages import TurnHeader
from tandem.edge.link.uplink import OutgoingTurn, Pieces
from tandem.edge.session import EdgeSession


def block_ids(
    ids: Sequence[int], p: LinkParams, compatibility_key: str, session_id: str, request_id: str
) -> list[bytes]:
    """Chained ids of the full KV blocks of ``ids`` at ``p``'s block size, seeded with the head's
    manifest key and the turn's session (or, stateless, its request)."""
    return kvblocks.block_ids(ids, p.kv_block_size_tokens, compatibility_key, session_id, request_id)


def kv_blocks(kv: np.ndarray, hashes: list[bytes], p: LinkParams, first: int, end: int) -> dict[int, KVBlock]:
    """Blocks ``[first, end)`` of the head KV ``kv`` (float32 ``[k, 2, Hkv, T, D]``, ``k =
    p.split_layer``) framed by the one KV-block codec (``common.wire.kvcodec.encode_block``): in
    ``p``'s KV wire dtype and codec, each with its Merkle leaf over the block's id (``hashes[j]``),
    layers and bytes, and its payload's CRC32C."""
    part = LayerRange(lo=0, hi=p.split_layer)
    arrays = split_blocks(kv, p.kv_block_size_tokens, first, end)
    return {
        j: encode_block(arr, j, hashes[j], part, p, p.params_version)
        for j, arr in zip(range(first, end), arrays, strict=True)
    }


def commit(held_leaves: Sequence[bytes], blocks: Mapping[int, KVBlock]) -> tuple[int, bytes]:
    """The commit of a turn: (leaf count, Merkle root) of the leaves the cloud holds followed by
    those of ``blocks`` in index order."""
    leaves = list(held_leaves) + [blocks[j].leaf_hash for j in sorted(blocks)]
    return len(leaves), merkle.root(leaves)


def direct_turn(base: TurnHeader) -> OutgoingTurn:
    """A direct turn: the header of ``base`` as a stateless request at ``k = 0``, nothing else."""
    return OutgoingTurn(replace(base, session_id="", split_layer=0), [], {}, 0, b"")


def split_turn(s: EdgeSession, base: TurnHeader, p: LinkParams, hashes: list[bytes]) -> OutgoingTurn:
    """What the cloud lacks of the session under params ``p``: activations of ``s.hidden`` past
    ``s.cloud_tokens`` and KV blocks past ``s.leaves`` (``hashes``: the ids of the prompt's full
    blocks), with the header of ``base`` counting them.

    Raises:
        InvalidRequest: the session holds no head output.
    """
    if s.hidden is None or s.kv is None:
        raise InvalidRequest("the head produced no output for this turn")
    cached = s.cloud_tokens
    chunks = wire.split(
        s.hidden[cached:], cached, p.chunk_tokens, p.wire_dtype, p.codec, p.codec_level, p.params_version
    )
    blocks = kv_blocks(s.kv, hashes, p, len(s.leaves), len(hashes))
    leaf_count, root = commit(s.leaves, blocks)
    header = replace(base, cached_tokens=cached, num_chunks=len(chunks), num_kv_blocks=len(blocks))
    return OutgoingTurn(
        header, chunks, blocks, leaf_count, root, window=p.inflight_window_bytes, block_tokens=p.kv_block_size_tokens
    )


def pipelined_turn(s: EdgeSession, base: TurnHeader, p: LinkParams, hashes: list[bytes]) -> OutgoingTurn:
    """``split_turn`` before the head has run: the header (its chunk and block counts follow from
    the token ids alone) and no chunks or blocks yet (``OutgoingTurn.extend`` adds each piece's)."""
    cached, n = s.cloud_tokens, len(base.prompt_token_ids)
    header = replace(
        base,
        cached_tokens=cached,
        num_chunks=-(-(n - cached) // p.chunk_tokens),
        num_kv_blocks=len(hashes) - len(s.leaves),
    )
    return OutgoingTurn(
        header,
        [],
        {},
        0,
        b"",
        window=p.inflight_window_bytes,
        block_tokens=p.kv_block_size_tokens,
        complete=False,
        pipelined=True,
    )


def whole_chunks_end(start: int, n: int, chunk_tokens: int, computed: int) -> int:
    """Where the activation chunks from token ``start`` that the first ``computed`` of ``n``
    tokens make whole end (chunks cut as one run of the head would cut them)."""
    end = start
    while end < n and min(n, end + chunk_tokens) <= computed:
        end = min(n, end + chunk_tokens)
    return end


def piece(
    hidden: np.ndarray,
    kv: np.ndarray,
    hashes: list[bytes],
    p: LinkParams,
    tokens: tuple[int, int],
    first_seq: int,
    block_range: tuple[int, int],
) -> Pieces:
    """One piece of a pipelined turn: the chunks of activations ``hidden[tokens[0]:tokens[1]]``
    (``hidden`` float32 ``[T, H]``; sequence numbers from ``first_seq``) and KV blocks
    ``[block_range[0], block_range[1])`` of ``kv``."""
    (a, z), (j0, j1) = tokens, block_range
    chunks = (
        []
        if z == a
        else wire.split(
            hidden[a:z], a, p.chunk_tokens, p.wire_dtype, p.codec, p.codec_level, p.params_version, first_seq
        )
    )
    return chunks, kv_blocks(kv, hashes, p, j0, j1)


def sync_request(
    s: EdgeSession, hashes: list[bytes], p: LinkParams, link_id: str, session_id: str
) -> tuple[SyncRequest, list[bytes]]:
    """The ``SyncSession`` request for session ``s`` and all its leaves: the Merkle tree of all its
    full head-KV blocks and a consistency proof (RFC 6962 2.1.2) from the leaves the edge
    believes the cloud holds (``s.leaves``, at block size ``p.kv_block_size_tokens``).

    Raises:
        InvalidRequest: the session holds no head KV.
    """
    if s.kv is None:
        raise InvalidRequest("the session holds no head KV to sync")
    believed = list(s.leaves)
    leaves = believed + [b.leaf_hash for b in kv_blocks(s.kv, hashes, p, len(believed), len(hashes)).values()]
    m = len(believed)
    proof = merkle.consistency_proof(leaves, m) if 0 < m < len(leaves) else []
    req = SyncRequest(
        link_id=link_id,
        session_id=session_id,
        split_layer=p.split_layer,
        token_ids=tuple(s.token_ids),
        leaf_count=len(leaves),
        merkle_root=merkle.root(leaves),
        proof_from=m,
        consistency_proof=tuple(proof),
        block_size_tokens=p.kv_block_size_tokens,
    )
    return req, leaves
