"""The splits one cloud node serves: the primary split (its model, shape and tokenizer) and
splits of the same model at other layers, each with its own tail engine; and what follows
from a split layer ``k``: the layer ranges of the head (``[0, k)``, from the edge) and the tail
(``[k, L)``, computed here), and the seeds of their KV blocks' ids.

Built once at the entry point (``cloud.server.build_gateway``) and shared, read-only. It does
not negotiate (``cloud.links.registry``) and holds no state of requests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tandem.common.protocol.manifest import SplitManifest
from tandem.common.wire.kvblocks import LayerRange, hash_seed, kv_scope, request_seed
from tandem.common.wire.messages import TurnHeader


@dataclass(frozen=True, eq=False)
class Splits:
    """``by_layer[k]``: the manifest of the split at layer ``k`` (the primary one among them, unless it is a
    direct manifest, ``split_layer`` 0: a checkpoint served in direct mode only)."""

    primary: SplitManifest
    by_layer: Mapping[int, SplitManifest]

    @classmethod
    def of(cls, primary: SplitManifest, extra: tuple[SplitManifest, ...] = ()) -> Splits:
        """The primary split and the ``extra`` ones, by split layer.

        Raises:
            ValueError: an extra split holds another model (weights or shape).
        """
        if any(m.weights_blake3 != primary.weights_blake3 or m.shape != primary.shape for m in extra):
            raise ValueError("every split directory must hold the same model (weights and shape)")
        return cls(primary, {m.split_layer: m for m in (primary, *extra) if m.split_layer})

    @property
    def checked_layers(self) -> tuple[int, ...]:
        """The split layers whose head passed its check against HF (``SplitManifest.passed_check``):
        the only ones ``Negotiate`` offers; a split without one serves direct mode only."""
        return tuple(k for k in self.layers if self.by_layer[k].passed_check)

    @property
    def layers(self) -> tuple[int, ...]:
        """The split layers served, ascending."""
        return tuple(sorted(self.by_layer))

    def manifest(self, k: int) -> SplitManifest:
        """The split at layer ``k``; the primary one for a ``k`` not served (direct mode: ``k = 0``)."""
        return self.by_layer.get(k, self.primary)

    def head_part(self, k: int) -> LayerRange:
        return LayerRange(lo=0, hi=k)

    def tail_part(self, k: int) -> LayerRange:
        return LayerRange(lo=k, hi=self.primary.shape.num_layers)

    def request_seed(self, header: TurnHeader, block_tokens: int) -> bytes:
        """Seed of the head blocks' ids, as the edge computes it (``common.wire.kvblocks.request_seed``)."""
        key = self.manifest(header.split_layer).compatibility_key()
        return request_seed(key, block_tokens, header.session_id, header.request_id)

    def tail_seed(self, header: TurnHeader, caller_tag: str, block_tokens: int) -> bytes:
        """Seed of the tail blocks' store keys: the request's sharing scope inside the caller's
        namespace (``caller_tag``), so one edge's tail KV is never loaded for another edge's request
        (no cache hits across edges, hence no timing channel that reveals another edge's prompts)."""
        key = self.manifest(header.split_layer).compatibility_key()
        scope = f"{caller_tag}|{kv_scope(header.session_id, header.request_id)}"
        return hash_seed(key, block_tokens, scope)
