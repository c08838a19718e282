"""Remote prefill's side of the KV-block protocol: the header's request (``RemotePrefill``), the
edge's answers going up (``KVDownAck``, ``Takeover``) with their protobuf conversion, the finish
reason of a turn the edge took over (``HANDOVER``), and what the blocks coming down are
(``down_spec``). The blocks and their commit are ``common.wire.kvcodec``'s ``KVBlock`` and ``Commit``,
framed and checked by its one codec, as the uplink's are. Pure functions and frozen dataclasses: no
network, no store, no engine.

The blocks are canonical float32 ``[L, 2, Hkv, B, D]`` (every layer ``[0, L)``) of the prompt's full
blocks past the ones the edge holds. Their ids are the chained BLAKE3 of the prompt's token ids
(``common.wire.kvblocks.block_ids``) seeded with the whole model's key (``full_model_key``) and the
request's scope, which the edge computes itself; the turn's blocks ``[first_block, n)`` form an
RFC 6962 tree of their own whose root the commit carries (``Commit.first_leaf`` = ``first_block``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.common.protocol.manifest import ModelShape, SplitManifest
from tandem.common.protocol.params import LinkParams
from tandem.common.wire.kvblocks import LayerRange, block_ids
from tandem.common.wire.kvcodec import BlockSpec
from tandem.pbconv import from_pb, to_pb
from tandem.v1 import tandem_pb2 as pb

HANDOVER = "handover"  # Final.finish_reason of a remote-prefill turn whose decode the edge took over


def full_model_key(manifest: SplitManifest) -> str:
    """The whole model's identity, for the seed of its KV blocks' ids: the weights, dtype and shape
    (not the split layer), so an edge whose model differs from the cloud's refuses every block."""
    s = manifest.shape
    weights = manifest.weights_blake3 or f"{manifest.model_id}|{manifest.checkpoint_blake3}"
    shape = f"L{s.num_layers}.H{s.hidden_size}.Hq{s.num_heads}.Hkv{s.num_kv_heads}.D{s.head_dim}.V{s.vocab_size}"
    return f"tandem-full-v1|weights={weights}|{manifest.dtype}|{shape}"


def down_spec(
    prompt_ids: Sequence[int],
    first_block: int,
    model_key: str,
    session_id: str,
    request_id: str,
    shape: ModelShape,
    p: LinkParams,
    params_version: int,
) -> BlockSpec:
    """The blocks of one remote-prefill turn, as both sides see them: the prompt's full blocks
    ``[first_block, T // B)`` of every layer, their ids seeded with the whole model's key
    ``model_key`` and the turn's session (or, stateless, its request), in ``p``'s KV format."""
    ids = block_ids(prompt_ids, p.kv_block_size_tokens, model_key, session_id, request_id)
    return BlockSpec.of(ids, first_block, LayerRange(lo=0, hi=shape.num_layers), shape, p, params_version)


# ------------------------------------------------------------------ messages


@dataclass(frozen=True, kw_only=True)
class RemotePrefill:
    """A header's remote-prefill request: the edge holds, or computes itself, the whole-model KV
    of the first ``held_tokens`` prompt tokens, so blocks ``[held_tokens // B, T // B)`` come down."""

    held_tokens: int = 0

    @classmethod
    def from_pb(cls, m: pb.RemotePrefill) -> RemotePrefill:
        return cls(held_tokens=m.held_tokens)

    def to_pb(self) -> pb.RemotePrefill:
        return pb.RemotePrefill(held_tokens=self.held_tokens)


@dataclass(frozen=True, kw_only=True)
class KVDownAck:
    """The edge received ``received_bytes`` of block payload (each block once), verified blocks
    ``[first_block, first_block + verified_blocks)``, and asks for ``resend_blocks`` again."""

    received_bytes: int
    verified_blocks: int = 0
    resend_blocks: tuple[int, ...] = ()

    @classmethod
    def from_pb(cls, m: pb.KVDownAck) -> KVDownAck:
        return from_pb(cls, m)

    def to_pb(self) -> pb.KVDownAck:
        return to_pb(pb.KVDownAck, self)


@dataclass(frozen=True, kw_only=True)
class Takeover:
    """The edge decodes on from output token ``output_tokens``: the tokens it has received, or
    (sent before any came, where it computed the prompt itself) those it waits for; the cloud stops
    once it has streamed that many."""

    output_tokens: int

    @classmethod
    def from_pb(cls, m: pb.Takeover) -> Takeover:
        return cls(output_tokens=m.output_tokens)

    def to_pb(self) -> pb.Takeover:
        return pb.Takeover(output_tokens=self.output_tokens)
