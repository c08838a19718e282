"""Link parameters and sampling parameters as domain types, with ``from_pb`` / ``to_pb``.

Protobuf types never become fields of domain objects; these frozen dataclasses
are what edge and cloud code pass around.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.common.wire import Codec, WireDtype, pb_name
from tandem.pbconv import from_pb, to_pb
from tandem.v1 import tandem_pb2 as pb

MAX_STOP_TOKENS = 64  # stop token ids one request may name
MAX_TEMPERATURE = 2.0  # vLLM's SamplingParams refuses more (and OpenAI's API allows 0..2)


@dataclass(frozen=True)
class LinkParams:
    """What ``Negotiate`` agreed for one edge <-> cloud link (units in names; see the proto)."""

    params_version: int
    split_layer: int
    chunk_tokens: int
    wire_dtype: WireDtype
    codec: Codec
    codec_level: int
    kv_block_size_tokens: int
    inflight_window_chunks: int
    max_concurrent_requests: int
    max_batched_tokens: int
    max_prompt_tokens: int
    max_new_tokens: int
    hidden_size: int
    max_chunk_resends: int

    @classmethod
    def from_pb(cls, m: pb.LinkParams) -> LinkParams:
        return from_pb(cls, m, wire_dtype=WireDtype(m.wire_dtype), codec=Codec(m.codec))

    def to_pb(self) -> pb.LinkParams:
        return to_pb(pb.LinkParams, self)


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters of one request; ``temperature == 0`` is greedy."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    @classmethod
    def from_pb(cls, m: pb.SamplingParams) -> Sampling:
        return from_pb(cls, m, top_p=m.top_p or 1.0, seed=m.seed if m.HasField("seed") else None)

    def to_pb(self) -> pb.SamplingParams:
        return to_pb(pb.SamplingParams, self, seed=self.seed)  # None leaves the optional field unset


@dataclass(frozen=True)
class NegotiateOffer:
    """What an edge offers in ``Negotiate`` (units in names; see ``NegotiateRequest``)."""

    edge_id: str
    model_id: str
    compatibility_key: str
    split_layers: tuple[int, ...]
    edge_max_batch: int
    rtt_ms: float = 0.0
    goodput_mbps: float = 0.0
    ttft_slo_ms: float = 0.0
    itl_p99_slo_ms: float = 0.0

    @classmethod
    def from_pb(cls, m: pb.NegotiateRequest) -> NegotiateOffer:
        return cls(
            m.edge_id,
            m.model_id,
            m.compatibility_key,
            tuple(m.split_layers),
            m.edge_max_batch,
            m.link.rtt_ms,
            m.link.goodput_mbps,
            m.slo.ttft_ms,
            m.slo.itl_p99_ms,
        )

    def to_pb(self) -> pb.NegotiateRequest:
        return pb.NegotiateRequest(
            edge_id=self.edge_id,
            model_id=self.model_id,
            compatibility_key=self.compatibility_key,
            split_layers=list(self.split_layers),
            wire_dtypes=[pb_name(x) for x in WireDtype],
            codecs=[pb_name(x) for x in Codec],
            edge_max_batch=self.edge_max_batch,
            link=pb.LinkMeasurement(rtt_ms=self.rtt_ms, goodput_mbps=self.goodput_mbps),
            slo=pb.LatencySlo(ttft_ms=self.ttft_slo_ms, itl_p99_ms=self.itl_p99_slo_ms),
        )
