"""Link parameters and sampling parameters as domain types, with ``from_pb`` / ``to_pb``.

Protobuf types never become fields of domain objects; these frozen dataclasses
are what edge and cloud code pass around.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from tandem.common.protocol.errors import InvalidRequest
from tandem.pbconv import from_pb, to_pb
from tandem.v1 import tandem_pb2 as pb

MAX_STOP_TOKENS = 64  # stop token ids one request may name


class WireDtype(enum.IntEnum):
    """Mirrors ``tandem.v1.WireDtype``."""

    FP32 = 1
    FP16 = 2
    BF16 = 3
    INT8 = 4
    INT4 = 5
    INT8_HADAMARD = 6
    INT4_HADAMARD = 7


class Codec(enum.IntEnum):
    """Mirrors ``tandem.v1.Codec``."""

    NONE = 1
    ZSTD = 2


def pb_name(v: WireDtype | Codec) -> str:
    """The ``tandem.v1`` enum value name (``WIRE_DTYPE_FP32``, ``CODEC_ZSTD``...) of a domain enum."""
    return ("WIRE_DTYPE_" if isinstance(v, WireDtype) else "CODEC_") + v.name


@dataclass(frozen=True, kw_only=True)
class LinkParams:
    """What ``Negotiate`` agreed for one edge <-> cloud link (units in names; see the proto)."""

    params_version: int
    split_layer: int
    chunk_tokens: int
    wire_dtype: WireDtype
    codec: Codec
    codec_level: int
    kv_block_size_tokens: int
    inflight_window_bytes: int
    max_concurrent_requests: int
    max_batched_tokens: int
    max_prompt_tokens: int
    max_new_tokens: int
    hidden_size: int
    max_chunk_resends: int
    kv_wire_dtype: WireDtype = WireDtype.FP32  # format of every head-KV block (``common.wire.kvwire``)
    max_model_len_tokens: int = 0  # most prompt + max_new_tokens of one turn (0 = not said)
    vocab_size: int = 0  # every prompt and stop token id is below it (0 = not said)

    @classmethod
    def from_pb(cls, m: pb.LinkParams) -> LinkParams:
        """Raises InvalidRequest for an unknown wire dtype or codec (an unset KV dtype is fp32)."""
        try:
            return from_pb(
                cls,
                m,
                wire_dtype=WireDtype(m.wire_dtype),
                codec=Codec(m.codec),
                kv_wire_dtype=WireDtype(m.kv_wire_dtype or WireDtype.FP32),
            )
        except ValueError as e:
            raise InvalidRequest(f"link params with an unknown format: {e}") from None

    def to_pb(self) -> pb.LinkParams:
        return to_pb(pb.LinkParams, self)


MIN_SAMPLED_TEMPERATURE = 0.01  # vLLM's ``sampling_params._MAX_TEMP``: the lowest temperature it samples at


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """Sampling parameters of one request; ``temperature == 0`` is greedy, ``top_k`` -1 or 0 and
    ``top_p`` 1 are off (vLLM's). A temperature above 0 and below ``MIN_SAMPLED_TEMPERATURE`` is
    raised to it, as vLLM's ``SamplingParams`` does (its ``_MAX_TEMP``: lower ones overflow), so the
    edge's sampler and the cloud's engines sample such a turn alike. Their ranges: ``tandem.ranges``."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if 0.0 < self.temperature < MIN_SAMPLED_TEMPERATURE:
            object.__setattr__(self, "temperature", MIN_SAMPLED_TEMPERATURE)

    @classmethod
    def from_pb(cls, m: pb.SamplingParams) -> Sampling:
        """The optional fields (``top_p``, ``max_new_tokens``, ``seed``) take their defaults when
        unset; an explicit value, 0 among them, is kept (and refused by ``check_sampling`` and
        ``RequestLimits.check`` where 0 is outside its range)."""
        unset = cls()
        return from_pb(
            cls,
            m,
            top_p=m.top_p if m.HasField("top_p") else unset.top_p,
            max_new_tokens=m.max_new_tokens if m.HasField("max_new_tokens") else unset.max_new_tokens,
            seed=m.seed if m.HasField("seed") else None,
        )

    def to_pb(self) -> pb.SamplingParams:
        return to_pb(pb.SamplingParams, self, seed=self.seed)  # None leaves the optional field unset


MAX_MEASURE = 1e9  # bound on an edge's reported RTT (ms), goodput (Mbit/s) and objectives (ms)


@dataclass(frozen=True, kw_only=True)
class NegotiateOffer:
    """What an edge offers in ``Negotiate`` (units in names; see ``NegotiateRequest``).

    ``head_keys`` maps every split layer ``k`` the edge holds a head for to that head's
    ``SplitManifest.compatibility_key()``; ``wire_dtypes`` (activations), ``kv_wire_dtypes``
    (head-KV blocks) and ``codecs`` are the formats the edge accepts, preferred first;
    ``link_id`` names the link to renegotiate ("" = new)."""

    edge_id: str
    model_id: str
    head_keys: dict[int, str]
    edge_max_batch: int = 8
    rtt_ms: float = 0.0
    goodput_mbps: float = 0.0
    ttft_slo_ms: float = 0.0
    itl_p99_slo_ms: float = 0.0
    wire_dtypes: tuple[WireDtype, ...] = tuple(WireDtype)
    codecs: tuple[Codec, ...] = (Codec.NONE, Codec.ZSTD)
    link_id: str = ""
    kv_wire_dtypes: tuple[WireDtype, ...] = tuple(WireDtype)

    @property
    def split_layers(self) -> tuple[int, ...]:
        return tuple(sorted(self.head_keys))

    @classmethod
    def from_pb(cls, m: pb.NegotiateRequest) -> NegotiateOffer:
        """Format values this cloud does not know (a newer edge's) are skipped: the link uses the
        common ones (none in common: ``link_params`` refuses). Raises InvalidRequest for more than
        64 heads or 16 formats of a kind, or measurements and objectives that are not finite
        numbers in ``[0, MAX_MEASURE]``."""
        for name, v in (
            ("link.rtt_ms", m.link.rtt_ms),
            ("link.goodput_mbps", m.link.goodput_mbps),
            ("slo.ttft_ms", m.slo.ttft_ms),
            ("slo.itl_p99_ms", m.slo.itl_p99_ms),
        ):
            if not 0.0 <= v <= MAX_MEASURE:  # also false for NaN
                raise InvalidRequest(f"{name} = {v!r} is not a finite number in [0, {MAX_MEASURE:g}]")
        if len(m.head_keys) > 64 or any(len(v) > 1024 for v in m.head_keys.values()):
            raise InvalidRequest("at most 64 heads with keys of at most 1024 characters")
        if max(len(m.wire_dtypes), len(m.kv_wire_dtypes), len(m.codecs)) > 16:
            raise InvalidRequest("at most 16 wire dtypes and codecs each")

        def known(values, enum_cls, default):  # formats of a newer edge are skipped, not refused
            return tuple(enum_cls(v) for v in values if v in enum_cls._value2member_map_) if values else default

        return cls(
            edge_id=m.edge_id,
            model_id=m.model_id,
            head_keys={int(k): v for k, v in m.head_keys.items() if k > 0},
            edge_max_batch=m.edge_max_batch,
            rtt_ms=m.link.rtt_ms,
            goodput_mbps=m.link.goodput_mbps,
            ttft_slo_ms=m.slo.ttft_ms,
            itl_p99_slo_ms=m.slo.itl_p99_ms,
            wire_dtypes=known(m.wire_dtypes, WireDtype, (WireDtype.FP32,)),
            codecs=known(m.codecs, Codec, (Codec.NONE,)),
            link_id=m.link_id,
            kv_wire_dtypes=known(m.kv_wire_dtypes, WireDtype, (WireDtype.FP32,)),
        )

    def to_pb(self) -> pb.NegotiateRequest:
        return pb.NegotiateRequest(
            edge_id=self.edge_id,
            model_id=self.model_id,
            head_keys=self.head_keys,
            split_layers=[0, *self.split_layers],
            wire_dtypes=[pb_name(x) for x in self.wire_dtypes],
            kv_wire_dtypes=[pb_name(x) for x in self.kv_wire_dtypes],
            codecs=[pb_name(x) for x in self.codecs],
            edge_max_batch=self.edge_max_batch,
            link=pb.LinkMeasurement(rtt_ms=self.rtt_ms, goodput_mbps=self.goodput_mbps),
            slo=pb.LatencySlo(ttft_ms=self.ttft_slo_ms, itl_p99_ms=self.itl_p99_slo_ms),
            link_id=self.link_id,
        )


@dataclass(frozen=True, kw_only=True)
class Negotiated:
    """What ``Negotiate`` agreed: the link's id and its params for every split layer both sides
    hold (``params_by_split[0]`` is direct mode, always present), what the cloud serves, and a
    note saying why the edge's offer was not met in full ("" when it was)."""

    link_id: str
    params_by_split: dict[int, LinkParams]
    split_layers: tuple[int, ...]
    note: str = ""
    cloud_id: str = ""
    model_id: str = ""
    instance_id: str = ""

    @property
    def params_version(self) -> int:
        return self.params_by_split[0].params_version

    @classmethod
    def from_pb(cls, m: pb.NegotiateResponse) -> Negotiated:
        by_split = {int(k): LinkParams.from_pb(v) for k, v in m.params_by_split.items()}
        if 0 not in by_split:
            by_split[0] = replace(LinkParams.from_pb(m.params), split_layer=0)
        return cls(
            link_id=m.link_id,
            params_by_split=by_split,
            split_layers=tuple(m.split_layers),
            note=m.note,
            cloud_id=m.cloud_id,
            model_id=m.model_id,
            instance_id=m.instance_id,
        )

    def to_pb(self) -> pb.NegotiateResponse:
        best = self.params_by_split[max(self.params_by_split)]
        return pb.NegotiateResponse(
            params=best.to_pb(),
            cloud_id=self.cloud_id,
            model_id=self.model_id,
            link_id=self.link_id,
            split_layers=list(self.split_layers),
            note=self.note,
            instance_id=self.instance_id,
            params_by_split={k: v.to_pb() for k, v in self.params_by_split.items()},
        )


@dataclass(frozen=True, kw_only=True)
class ServerLoad:
    """A cloud node's load and measured rates (see ``ServerLoad`` in the proto; units in names)."""

    running_requests: int = 0
    waiting_requests: int = 0
    kv_cache_usage: float = 0.0
    tail_prefill_ms_per_token: dict[int, float] = field(default_factory=dict)  # per split layer k
    prefill_ms_per_token: float = 0.0
    decode_ms_per_token: float = 0.0
    queue_wait_ms: float = 0.0
    link_running: int = 0
    link_waiting: int = 0

    @classmethod
    def from_pb(cls, m: pb.ServerLoad) -> ServerLoad:
        return from_pb(cls, m)

    def to_pb(self) -> pb.ServerLoad:
        return to_pb(pb.ServerLoad, self)


@dataclass(frozen=True, kw_only=True)
class ServerInfo:
    """``GetServerInfo``'s answer: the cloud's load and the link's current params."""

    cloud_id: str
    instance_id: str
    load: ServerLoad
    link_known: bool
    params_by_split: dict[int, LinkParams]
    split_layers: tuple[int, ...]
    serving: bool = True

    @classmethod
    def from_pb(cls, m: pb.ServerInfo) -> ServerInfo:
        return cls(
            cloud_id=m.cloud_id,
            instance_id=m.instance_id,
            load=ServerLoad.from_pb(m.load),
            link_known=m.link_known,
            params_by_split={int(k): LinkParams.from_pb(v) for k, v in m.params_by_split.items()},
            split_layers=tuple(m.split_layers),
            serving=m.serving,
        )

    def to_pb(self) -> pb.ServerInfo:
        return pb.ServerInfo(
            cloud_id=self.cloud_id,
            instance_id=self.instance_id,
            load=self.load.to_pb(),
            link_known=self.link_known,
            params_by_split={k: v.to_pb() for k, v in self.params_by_split.items()},
            split_layers=list(self.split_layers),
            serving=self.serving,
        )


@dataclass(frozen=True, kw_only=True)
class SyncRequest:
    """``SyncSession``'s request (see the proto): the edge's view of one of its sessions. ``leaf_count``
    leaves with root ``merkle_root`` (32 bytes); ``consistency_proof`` is PROOF(proof_from, D[leaf_count])
    (RFC 6962 2.1.2), empty when ``proof_from`` is 0 or equals ``leaf_count``."""

    link_id: str
    session_id: str
    split_layer: int
    token_ids: tuple[int, ...]
    leaf_count: int
    merkle_root: bytes
    proof_from: int
    consistency_proof: tuple[bytes, ...]
    block_size_tokens: int

    @classmethod
    def from_pb(cls, m: pb.SyncSessionRequest) -> SyncRequest:
        return from_pb(cls, m)

    def to_pb(self) -> pb.SyncSessionRequest:
        return to_pb(pb.SyncSessionRequest, self)


@dataclass(frozen=True, kw_only=True)
class SyncReply:
    """``SyncSession``'s answer (see the proto). ``held_tokens``: leading tokens of the edge's whose
    activations the cloud holds; ``proven``: the cloud's first ``min(held_leaves, leaf_count)`` leaves
    are the edge's; else ``leaf_hashes`` carries the cloud's leaves."""

    found: bool
    held_tokens: int = 0
    held_leaves: int = 0
    held_root: bytes = b""
    proven: bool = False
    leaf_hashes: tuple[bytes, ...] = ()

    @classmethod
    def from_pb(cls, m: pb.SyncSessionReply) -> SyncReply:
        return from_pb(cls, m)

    def to_pb(self) -> pb.SyncSessionReply:
        return to_pb(pb.SyncSessionReply, self)
