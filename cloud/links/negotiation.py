"""Per-link parameters: what ``Negotiate`` agrees with one edge, and their versions.

For every split layer ``k`` both sides hold (and ``k = 0``, direct mode) a link gets one
``LinkParams``. The transfer parameters follow the link the edge measured; the quotas
follow the link's share of the engines (``cloud.links.table.LinkTable``):

* ``wire_dtype`` / ``kv_wire_dtype``: among the formats both sides accept (the edge's offer and
  ``CloudConfig.wire_dtypes`` for activations, ``kv_wire_dtypes`` for head-KV blocks), the
  smallest pair that the model's fidelity table (``cloud.links.fidelity``, measured by
  ``tandem-bench fidelity``) puts within the unquantized system's noise floor at this ``k``;
  where none is (or no table names the weights), the edge's first preference (fp16 by
  default; fp32 is exact). No common KV format: split is refused, direct still works. At
  ``k = 0`` the KV format is remote prefill's downlink (every layer's KV): the smallest format
  both sides accept that the table's ``remote_prefill`` entries qualify; else the engines' own
  KV dtype (``LinkLimits.engine_kv_dtype``: bf16 for bf16 engines, fp32 for fp32 ones) where both
  sides accept it, so the edge decodes on the engine's KV bit for bit; else the most faithful
  format both accept (``Fidelity`` class; the edge's preference among equals): no fidelity table
  vouches for a lossy one there.
* ``codec``: the edge's first preference; it offers zstd first only where its measured ratio
  and speed shorten the transfer (``edge.routing.costmodel.zstd_pays``).
* ``chunk_tokens``: a chunk should take about ``CHUNK_TARGET_MS`` on the wire, so a NACKed
  chunk costs little and the cloud can verify chunk i while i+1 travels; a power of two
  in ``[MIN_CHUNK_TOKENS, cfg.max_chunk_tokens]``, ``cfg.chunk_tokens`` when goodput is unknown.
* ``inflight_window_bytes``: twice the bandwidth-delay product (the classic sliding-window rule:
  a window below the BDP leaves the link idle; RFC 7323 s1.1), at least ``MIN_WINDOW_BYTES`` and
  ``WINDOW_ITEMS`` of the link's largest item (so the cloud's ack every quarter window,
  ``ack_threshold_bytes``, always comes),
  at most ``MAX_WINDOW_BYTES``, which is also the window when the link is not measured. The window
  bounds what waits in the link's queues ahead of anything else the edge sends on the connection
  (keepalive pings, polls): at most about two RTTs' worth.
* ``max_concurrent_requests`` / ``max_batched_tokens``: the link's current share (``cloud.links.table``: who goes
  first when every slot is taken, never a cap on free slots).

``LinkVersions`` keeps the last ``KEPT_VERSIONS`` parameter sets of a link: a new set
gets the next ``params_version``; a request names the version it started with and
finishes under it, even after a newer one exists. Pure domain code.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from tandem.cloud.links.fidelity import FidelityTable
from tandem.common.protocol.errors import InvalidRequest, ParamsVersionMismatch
from tandem.common.protocol.manifest import SplitManifest
from tandem.common.protocol.params import Codec, LinkParams, NegotiateOffer, WireDtype
from tandem.common.wire.chunks import max_payload_bytes, raw_nbytes_of
from tandem.common.wire.formats import FORMATS, common_formats
from tandem.common.wire.kvwire import kv_raw_nbytes

CHUNK_TARGET_MS = 10.0
MIN_CHUNK_TOKENS = 16
MIN_WINDOW_BYTES = 1 << 20
MAX_WINDOW_BYTES = 64 << 20
WINDOW_ITEMS = 4
KEPT_VERSIONS = 8


@dataclass(frozen=True)
class LinkLimits:
    """The cloud-wide limits every link's params live within (from ``CloudConfig``)."""

    chunk_tokens: int  # default when the link is not measured
    max_chunk_tokens: int
    wire_dtypes: tuple[WireDtype, ...]  # allowed, in the cloud's order of preference
    kv_wire_dtypes: tuple[WireDtype, ...]  # allowed for head-KV blocks
    codecs: tuple[Codec, ...]
    codec_level: int
    kv_block_size_tokens: int
    max_prompt_tokens: int
    max_new_tokens: int
    max_chunk_resends: int
    max_model_len_tokens: int = 0  # the engines' max_model_len: prompt + max_new_tokens (0 = no bound)
    # fidelity tables by weights_blake3 (cloud.links.fidelity.load_tables); none: the edge's preference
    fidelity: Mapping[str, FidelityTable] = field(default_factory=lambda: MappingProxyType({}))
    # the format of the engines' own KV (their compute dtype): remote prefill's downlink (k = 0) sends
    # it where both sides accept it, so the KV the edge decodes on is the engine's, bit for bit
    engine_kv_dtype: WireDtype | None = None


def pick_chunk_tokens(goodput_mbps: float, bytes_per_token: int, default: int, max_tokens: int) -> int:
    """Tokens per chunk so that a chunk takes about ``CHUNK_TARGET_MS`` at ``goodput_mbps``:
    a power of two in ``[MIN_CHUNK_TOKENS, max_tokens]``; ``default`` when goodput is unknown (0)."""
    if goodput_mbps <= 0:
        return min(default, max_tokens)
    target_bytes = goodput_mbps * 1e6 / 8 * CHUNK_TARGET_MS / 1e3
    tokens = max(1.0, target_bytes / max(1, bytes_per_token))
    p2 = 2 ** round(math.log2(tokens))
    return int(min(max(p2, MIN_CHUNK_TOKENS), max_tokens))


ACKS_PER_WINDOW = 4


def ack_threshold_bytes(window_bytes: int, max_item_bytes: int) -> int:
    """Payload bytes received between two ``WindowAck``s: a quarter of the window, less where items
    are large against it (the edge waits only with more than ``window - its next item`` in flight,
    so an ack at this threshold always comes), at least 1.

    Why a quarter: the edge may have ``window`` bytes unacknowledged, but up to one threshold of
    them has already arrived and waits for its ack, so a long upload moves at least
    ``(window - threshold) / RTT`` (and at most ``window / RTT``). The window is ``2 x BDP`` of the
    edge's goodput estimate, so with half-window acks the guaranteed rate would be the estimate
    itself: measured through the benchmarks' link emulator, an edge whose link got faster (4g, then
    a 100 Mbit/s 80 ms line) then stays at 67% of the new rate, its uploads measuring what its
    window lets through. Quarter acks guarantee 1.5x the estimate, and the edge renegotiates upward at
    ``edge.link.connection.RENEGOTIATE_UP_RATIO`` (1.25x), so the estimate climbs to the link's rate
    (94-98% measured). Uploads no larger than the window (at least 1 MiB) are not limited by it."""
    return max(1, min(window_bytes // ACKS_PER_WINDOW, window_bytes - max_item_bytes))


def pick_window_bytes(goodput_mbps: float, rtt_ms: float, max_item_bytes: int) -> int:
    """Payload bytes in flight before an ack: ``2 * BDP`` (BDP = goodput x RTT), at least
    ``max(MIN_WINDOW_BYTES, WINDOW_ITEMS * max_item_bytes)``, at most ``MAX_WINDOW_BYTES`` (also the
    window when unknown; never below the floor)."""
    floor = max(MIN_WINDOW_BYTES, WINDOW_ITEMS * max_item_bytes)
    if goodput_mbps <= 0 or rtt_ms <= 0:
        return max(MAX_WINDOW_BYTES, floor)
    bdp_bytes = goodput_mbps * 1e6 / 8 * rtt_ms / 1e3
    return int(max(floor, min(math.ceil(2 * bdp_bytes), MAX_WINDOW_BYTES)))


def downlink_format(
    table: FidelityTable | None, kvs: Sequence[WireDtype], engine_kv_dtype: WireDtype | None
) -> WireDtype | None:
    """Remote prefill's downlink format among ``kvs`` (the formats both sides accept, the edge's
    preference first): the smallest ``table`` qualifies for every layer's KV, else the engines'
    own (``engine_kv_dtype``), else the most faithful (``Fidelity`` class; the edge's preference
    among equals); None when ``kvs`` is empty."""
    down = table.smallest_downlink(kvs) if table is not None else None
    if down is not None:
        return down
    if engine_kv_dtype in kvs:
        return engine_kv_dtype
    return min(kvs, key=lambda d: FORMATS[d].fidelity) if kvs else None


def link_params(
    limits: LinkLimits, manifest: SplitManifest, k: int, offer: NegotiateOffer, share: tuple[int, int], version: int
) -> LinkParams:
    """The params of one link at split layer ``k`` (0 = direct) under ``share`` = (requests, tokens).

    Raises:
        InvalidRequest: (``k > 0``) the edge accepts none of the activation formats or none of
            the KV block formats this cloud allows.
    """
    # direct mode (k = 0) sends token ids only: it needs no common format; a format that does not
    # suit the model's widths (``WireFormat.suits``) is skipped
    sh = manifest.shape
    acts = common_formats(offer.wire_dtypes, limits.wire_dtypes, suits=lambda d: FORMATS[d].suits(sh.hidden_size))
    dtype = next(iter(acts), None if k else WireDtype.FP32)
    if dtype is None:
        raise InvalidRequest(
            f"no common wire format: the edge accepts {[d.name for d in offer.wire_dtypes]}, "
            f"this cloud allows {[d.name for d in limits.wire_dtypes]}"
        )
    kvs = common_formats(offer.kv_wire_dtypes, limits.kv_wire_dtypes, suits=lambda d: FORMATS[d].suits(sh.head_dim))
    kv_dtype = next(iter(kvs), None if k else WireDtype.FP32)
    if kv_dtype is None:
        raise InvalidRequest(
            f"no common KV block format: the edge accepts {[d.name for d in offer.kv_wire_dtypes]}, "
            f"this cloud allows {[d.name for d in limits.kv_wire_dtypes]}"
        )
    table = limits.fidelity.get(manifest.weights_blake3) if manifest.weights_blake3 else None
    if not k:  # remote prefill's downlink
        kv_dtype = downlink_format(table, kvs, limits.engine_kv_dtype) or kv_dtype
    elif table is not None and (smallest := table.smallest(k, acts, kvs)) is not None:
        dtype, kv_dtype = smallest
    codec = next(iter(common_formats(offer.codecs, limits.codecs)), Codec.NONE)
    act_bytes = raw_nbytes_of(1, dtype, sh.hidden_size)
    B = limits.kv_block_size_tokens
    block_bytes = kv_raw_nbytes((k, 2, sh.num_kv_heads, B, sh.head_dim), kv_dtype) if k else 0
    per_token = act_bytes + block_bytes // B
    chunk = pick_chunk_tokens(offer.goodput_mbps, per_token, limits.chunk_tokens, limits.max_chunk_tokens)
    max_item = max(max_payload_bytes(chunk * act_bytes, codec), max_payload_bytes(block_bytes, codec))
    window = pick_window_bytes(offer.goodput_mbps, offer.rtt_ms, max_item)
    return LinkParams(
        params_version=version,
        split_layer=k,
        chunk_tokens=chunk,
        wire_dtype=dtype,
        codec=codec,
        codec_level=limits.codec_level,
        kv_block_size_tokens=limits.kv_block_size_tokens,
        inflight_window_bytes=window,
        max_concurrent_requests=share[0],
        max_batched_tokens=share[1],
        max_prompt_tokens=limits.max_prompt_tokens,
        max_new_tokens=limits.max_new_tokens,
        hidden_size=sh.hidden_size,
        max_chunk_resends=limits.max_chunk_resends,
        kv_wire_dtype=kv_dtype,
        max_model_len_tokens=limits.max_model_len_tokens,
        vocab_size=sh.vocab_size,
    )


@dataclass
class LinkVersions:
    """One link's offer and its recent parameter sets, by version (oldest dropped first)."""

    offer: NegotiateOffer
    split_layers: tuple[int, ...]  # k both sides hold (0 excluded)
    version: int = 0
    history: OrderedDict[int, dict[int, LinkParams]] = field(default_factory=OrderedDict)

    @property
    def current(self) -> dict[int, LinkParams]:
        return self.history[self.version]

    def update(self, params_by_split: dict[int, LinkParams]) -> bool:
        """Adopt ``params_by_split`` (their ``params_version`` is overwritten) if it differs from the
        current set; returns whether a new version was made."""
        if self.history:
            same = params_by_split.keys() == self.current.keys() and all(
                replace(p, params_version=0) == replace(self.current[k], params_version=0)
                for k, p in params_by_split.items()
            )
            if same:
                return False
        self.version += 1
        self.history[self.version] = {k: replace(p, params_version=self.version) for k, p in params_by_split.items()}
        while len(self.history) > KEPT_VERSIONS:
            self.history.popitem(last=False)
        return True

    def params(self, version: int, k: int) -> LinkParams:
        """Raises:
        ParamsVersionMismatch: the version is not (or no longer) kept: renegotiate.
        InvalidRequest: the link never negotiated split layer ``k``."""
        by_split = self.history.get(version)
        if by_split is None:
            raise ParamsVersionMismatch(
                f"params v{version} unknown on this link (current v{self.version}, kept "
                f"v{min(self.history)}..v{self.version}): renegotiate"
            )
        if k not in by_split:
            raise InvalidRequest(f"split layer {k} was not negotiated on this link (it has {sorted(by_split)})")
        return by_split[k]
