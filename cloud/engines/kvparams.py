"""Per-request parameters of tandem's vLLM KV connector: what to load and what to save.

The gateway builds a ``KVTransferSpec`` per engine request; it travels to the
connector inside ``SamplingParams.extra_args["kv_transfer_params"]`` (vLLM copies
that dict to ``Request.kv_transfer_params`` in the EngineCore process) as
``{"tandem": spec.to_json()}``, and the connector reads it back with
``KVTransferSpec.from_vllm``. A request without the ``"tandem"`` key is a plain
vLLM request (no load, no save). What the connector did comes back the same way, as
a ``ConnectorReport`` in the finished request's ``RequestOutput.kv_transfer_params``.

Every block of a part is named by a *content key*: a digest that commits to what
the block's KV was computed from (see ``common.wire.kvblocks``): the head part by its
Merkle leaf (block identity, layer range and the verified bytes), the tail part by
a chain over the activations ``h_k`` it was computed from. Equal keys therefore
mean equal inputs, so "saved only when absent" and "load when present" are safe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.common.wire.kvblocks import HASH_BYTES, LayerRange, part_key


@dataclass(frozen=True)
class PartSpec:
    """One layer range's blocks: ``keys[j]`` names block ``j`` of the prompt (32-byte digests)."""

    layers: LayerRange
    keys: tuple[bytes, ...]

    def store_key(self, j: int) -> str:
        """Block-store key of block ``j`` of this part."""
        return part_key(self.keys[j], self.layers)

    def to_json(self) -> dict[str, Any]:
        return {"layers": [self.layers.lo, self.layers.hi], "keys": [k.hex() for k in self.keys]}

    @classmethod
    def from_json(cls, d: Any) -> PartSpec:
        """Raises ValueError for malformed input (wrong types, bad hex, bad range, wrong digest size)."""
        if not isinstance(d, dict) or not isinstance(d.get("keys"), list) or not isinstance(d.get("layers"), list):
            raise ValueError(f"tandem part spec must be {{'layers': [lo, hi], 'keys': [hex, ...]}}, got {d!r:.80}")
        try:
            lo, hi = (int(x) for x in d["layers"])
            keys = tuple(bytes.fromhex(k) for k in d["keys"])
        except (TypeError, ValueError) as e:
            raise ValueError(f"malformed tandem part spec: {e}") from None
        if any(len(k) != HASH_BYTES for k in keys):
            raise ValueError(f"tandem block keys must be {HASH_BYTES}-byte hex digests")
        return cls(LayerRange(lo=lo, hi=hi), keys)


@dataclass(frozen=True)
class KVTransferSpec:
    """What the connector does for one request.

    ``loads``: parts that must *all* be stored for a block to be loaded (a block is
    loaded only when every part has it; the first missing block ends the loaded prefix).
    ``save``: the part this engine writes for the prompt's full blocks, or None.
    All parts name the same blocks: ``len(keys)`` may differ only where a part knows
    fewer blocks (the loadable prefix is the shortest).
    """

    loads: tuple[PartSpec, ...] = ()
    save: PartSpec | None = None

    @property
    def num_blocks(self) -> int:
        """Blocks the spec can load (shortest load part) or save."""
        if self.loads:
            return min(len(p.keys) for p in self.loads)
        return len(self.save.keys) if self.save else 0

    def to_json(self) -> dict[str, Any]:
        return {"loads": [p.to_json() for p in self.loads], "save": self.save.to_json() if self.save else None}

    def to_vllm(self) -> dict[str, Any]:
        """The value for ``SamplingParams.extra_args["kv_transfer_params"]``."""
        return {"tandem": self.to_json()}

    @classmethod
    def from_vllm(cls, params: dict[str, Any] | None) -> KVTransferSpec | None:
        """The spec in a request's ``kv_transfer_params``; None for a plain request.

        Raises:
            ValueError: malformed params.
        """
        if not params or "tandem" not in params:
            return None
        d = params["tandem"]
        if not isinstance(d, dict) or not isinstance(d.get("loads") or [], list):
            raise ValueError(f"tandem kv_transfer_params must be {{'loads': [...], 'save': ...}}, got {d!r:.80}")
        loads = tuple(PartSpec.from_json(p) for p in d.get("loads") or [])
        save = None if d.get("save") is None else PartSpec.from_json(d["save"])
        return cls(loads, save)


@dataclass(frozen=True)
class ConnectorReport:
    """What the connector did for one finished request: ``external_tokens`` prompt tokens whose KV
    it loaded from the store, ``saved_blocks`` blocks ``[0, saved_blocks)`` of the save part
    written or already present. The connector returns it from ``request_finished`` (vLLM puts it
    in ``RequestOutput.kv_transfer_params``); the engines read it back with ``from_vllm``."""

    external_tokens: int = 0
    saved_blocks: int = 0

    def to_vllm(self) -> dict[str, Any]:
        """The value ``request_finished`` returns for vLLM's ``RequestOutput.kv_transfer_params``."""
        return {"tandem": {"external_tokens": self.external_tokens, "saved_blocks": self.saved_blocks}}

    @classmethod
    def from_vllm(cls, params: dict[str, Any] | None) -> ConnectorReport:
        """The report in a finished request's ``kv_transfer_params``; all zeros for a request the
        connector reported nothing for (None, or no ``"tandem"`` key).

        Raises:
            ValueError: malformed params (not a dict, or counts that are not integers).
        """
        d = (params or {}).get("tandem", {})
        if not isinstance(d, dict):
            raise ValueError("tandem kv_transfer_params must be a dict")
        try:
            return cls(int(d.get("external_tokens", 0)), int(d.get("saved_blocks", 0)))
        except TypeError as e:
            raise ValueError(f"tandem connector report counts must be integers: {d!r:.80}") from e
