"""Fidelity tables: which wire format pairs are within the unquantized system's noise floor, per
model and split layer, as ``tandem-bench fidelity`` measured them (``fidelity-table.json``).

A table is JSON: ``{"weights_blake3", "rule", "floor", "measured", "splits": {"<k>": [{"activations",
"kv", "bytes_per_token", "kl_mean", "flip_rate", "qualifies"}, ...]}}``. It applies to the weights
whose ``SplitManifest.weights_blake3`` it names (the weights' content, so the same model prepared
anywhere matches and other weights never do) on engines that compute in the dtype it was measured
in (``measured.dtype``, float32 where absent): its floor and its verdicts are that precision's.
The tables of the models tandem has measured ship in ``cloud/links/fidelity_tables/``;
``CloudConfig.fidelity_tables`` adds others.

Negotiation (``cloud.links.negotiation.link_params``) takes, at split layer ``k``, the smallest
qualifying pair whose two formats both sides accept and that is smaller than fp16/fp16; without
one (no table for the weights, nothing smaller qualifies, or the edge accepts none of them) the
edge's first preference stands, fp16 by default. A table's ``remote_prefill`` entries (the KV of
every layer through each format, ``tandem-bench fidelity``'s downlink rows) give remote prefill's
downlink (``k = 0``) its smallest qualifying format both sides accept; without one it carries the
engines' own KV dtype.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from tandem.common.protocol.params import WireDtype

PACKAGED = Path(__file__).parent / "fidelity_tables"
# an engine compute dtype (``EngineConfig.compute_dtype``) -> the wire format that carries its KV exactly
ENGINE_KV_FORMATS: Mapping[str, WireDtype] = MappingProxyType(
    {"float32": WireDtype.FP32, "bfloat16": WireDtype.BF16, "float16": WireDtype.FP16}
)
Pair = tuple[WireDtype, WireDtype]  # (activations, KV blocks)


@dataclass(frozen=True)
class FidelityTable:
    """One model's qualifying pairs per split layer, smallest first (bytes per prompt token), and
    the qualifying KV formats of remote prefill's downlink (every layer's KV), smallest first."""

    weights_blake3: str
    pairs: Mapping[int, tuple[Pair, ...]] = field(default_factory=dict)
    dtype: str = "float32"  # the engines' compute dtype it was measured with
    downlink: tuple[WireDtype, ...] = ()

    @classmethod
    def from_json(cls, data: Mapping) -> FidelityTable:
        """Read the bench's table: per split layer the entries that qualify and are smaller than
        that layer's fp16/fp16 entry, by ``bytes_per_token``; of ``remote_prefill`` (where the
        table has it) the KV formats that qualify and are smaller than the format that carries the
        engines' own KV exactly (bf16 for a table measured in bfloat16; fp16 and bf16 themselves
        are candidates in a float32 table).

        Raises:
            ValueError: a missing key, an unknown format name or a split layer that is not an int.
        """
        try:
            by_k: dict[int, tuple[Pair, ...]] = {}
            for k, entries in data["splits"].items():
                half = [e["bytes_per_token"] for e in entries if (e["activations"], e["kv"]) == ("fp16", "fp16")]
                bound = half[0] if half else float("inf")
                ok = sorted((e for e in entries if e["qualifies"] and e["bytes_per_token"] < bound), key=_bytes)
                by_k[int(k)] = tuple((WireDtype[e["activations"].upper()], WireDtype[e["kv"].upper()]) for e in ok)
            dtype = str(data.get("measured", {}).get("dtype", "float32"))
            down = list(data.get("remote_prefill", ()))
            own = ENGINE_KV_FORMATS.get(dtype, WireDtype.FP32).name.lower()  # carries the engines' KV exactly
            wide = min((float(e["bytes_per_token"]) for e in down if e["kv"] == own), default=math.inf)
            ok = sorted((e for e in down if e["qualifies"] and e["bytes_per_token"] < wide), key=_bytes)
            downlink = tuple(WireDtype[e["kv"].upper()] for e in ok)
            return cls(str(data["weights_blake3"]), MappingProxyType(by_k), dtype, downlink)
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not a fidelity table: {e!r}") from None

    @classmethod
    def load(cls, path: Path) -> FidelityTable:
        """Raises: ValueError (not a table, or not JSON), InvalidRequest (missing, unreadable, or not a
        regular file: ``files.read_regular``)."""
        from tandem.common.protocol.files import read_regular

        try:
            return cls.from_json(json.loads(read_regular(path, "fidelity table")))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON: {e}") from None

    def smallest(self, k: int, acts: Iterable[WireDtype], kvs: Iterable[WireDtype]) -> Pair | None:
        """The smallest qualifying pair at split layer ``k`` with its activation format in ``acts``
        and its KV format in ``kvs``; None if there is none."""
        a, v = set(acts), set(kvs)
        return next((p for p in self.pairs.get(k, ()) if p[0] in a and p[1] in v), None)

    def smallest_downlink(self, kvs: Iterable[WireDtype]) -> WireDtype | None:
        """The smallest qualifying KV format of remote prefill's downlink in ``kvs``; None if none."""
        v = set(kvs)
        return next((d for d in self.downlink if d in v), None)

    def formats(self) -> tuple[set[WireDtype], set[WireDtype]]:
        """(activation formats, KV formats) of every qualifying pair at any split layer."""
        every = [p for ps in self.pairs.values() for p in ps]
        return {a for a, _ in every}, {v for _, v in every}


def load_tables(extra: Iterable[Path] = (), dtype: str = "float32") -> Mapping[str, FidelityTable]:
    """The packaged tables and ``extra`` ones measured in compute ``dtype``, by
    ``weights_blake3`` (a later one for the same weights replaces an earlier one).

    Raises:
        ValueError: a file is not a fidelity table.
    """
    out: dict[str, FidelityTable] = {}
    for path in [*sorted(PACKAGED.glob("*.json")), *extra]:
        t = FidelityTable.load(path)
        if t.dtype == dtype:
            out[t.weights_blake3] = t
    return MappingProxyType(out)


def _bytes(e: Mapping) -> float:
    return float(e["bytes_per_token"])
