"""How the builder-graph decoder (``edge.compute.decoder.DecoderGraph``) shapes its runs of more
than one new token (prefills, remote prefill's catch-ups, a split head's rows).

ONNX Runtime's CUDA provider pays for the first run of each input shape it has not run before: on
an H100 a SmolLM2 prefill of a length not run before took 45-53 ms against 3 ms for the same length
again, most of it in ``GroupQueryAttention`` (benchmarks/results/gpu/README.md, "The edge's
runtimes"). A served edge sees a new length in nearly every turn (the prompt, the tokens the cloud
decoded before a remote prefill's handover), so it paid that cost where it matters most. A
``PrefillPlan`` runs every multi-token run in a small, fixed set of shapes that a warm-up runs once
at start (``DecoderGraph.warm_prefills``), the way vLLM captures its CUDA graphs for a fixed set of
batch sizes:

* chunks: a run of more than ``chunk_tokens`` new tokens runs as runs of ``chunk_tokens`` (the
  last one shorter), each attending to everything held before it (vLLM's chunked prefill); this
  also bounds the activations one run needs (the logits alone are ``[S, V]``);
* buckets: a run of ``S >= 2`` new tokens is padded on the right to the smallest of
  ``bucket_tokens`` that holds it, where the slot has room. The padding tokens are computed as if
  held (their keys and values land after the real ones in the slot's buffer), but attention is
  causal, so no real token sees them; the slot then holds only the real tokens, and the next run
  writes over the padding's KV. The outputs read are the real rows';
* the mask's width: with ``capacity_mask`` the attention mask is bound over the slot's whole
  capacity ``[1, C]`` (ones over the held and new tokens), as a batched decode step binds it, so
  the run's shapes do not depend on how many tokens the slot holds (``GroupQueryAttention`` takes
  the held count from the mask's sum, and its ``total_sequence_length`` from the mask's width). The
  decode steps bind the mask so already: a graph whose other nodes read the mask's width (the
  builder's LongRoPE cache switch, which preparation does not keep: docs/models.md) could serve
  neither.

A run's results are the exact run's (the padding is invisible to the real tokens; float sums may
round differently with another row count, as between any two GEMM shapes). ``EXACT`` runs every
length as it comes (the CPU build's default: the CPU provider has no per-shape cost, and padding
would cost compute there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

# a long run is cut into runs of at most this many new tokens on the CUDA provider: on an H100 a
# SmolLM2 run of 512 tokens took 3.0-3.5 ms once its shape had run, as long as one of 64 (bound by
# kernel launches, not compute; benchmarks/results/gpu/README.md), so the chunk costs no speed there
CHUNK_TOKENS = 512
MIN_BUCKET_TOKENS = 4  # the smallest padded length (runs of 2-3 tokens pad to it)


@dataclass(frozen=True)
class PrefillPlan:
    """How runs of more than one new token are cut and padded (module doc).

    chunk_tokens: the most new tokens one run computes (0: no bound).
    bucket_tokens: ascending padded lengths (each >= 2); empty: every run at its own length.
    capacity_mask: bind the attention mask over the slot's capacity ``[1, C]``, not over the held
        and new tokens ``[1, T + S]``.
    """

    chunk_tokens: int = 0
    bucket_tokens: tuple[int, ...] = ()
    capacity_mask: bool = False

    EXACT: ClassVar[PrefillPlan]

    def __post_init__(self) -> None:
        """Raises:
        ValueError: a negative chunk, a bucket under 2, buckets not strictly ascending, or a chunk
            bound that the largest bucket does not reach (a chunk's own length would be a new shape)."""
        if self.chunk_tokens < 0:
            raise ValueError(f"chunk_tokens {self.chunk_tokens}: 0 (no bound) or more")
        b = self.bucket_tokens
        if any(x < 2 for x in b) or any(y <= x for x, y in zip(b, b[1:], strict=False)):
            raise ValueError(f"bucket_tokens {b}: strictly ascending lengths of 2 or more")
        if b and self.chunk_tokens and b[-1] < self.chunk_tokens:
            raise ValueError(f"bucket_tokens {b} stop short of chunk_tokens {self.chunk_tokens}")

    @classmethod
    def bucketed(cls, chunk_tokens: int = CHUNK_TOKENS) -> PrefillPlan:
        """Chunks of ``chunk_tokens``, padded to the powers of two from ``MIN_BUCKET_TOKENS`` up to
        the chunk (4, 8, ..., 512: eight shapes), the mask over the capacity.

        Raises:
            ValueError: ``chunk_tokens`` under ``MIN_BUCKET_TOKENS``."""
        if chunk_tokens < MIN_BUCKET_TOKENS:
            raise ValueError(f"chunk_tokens {chunk_tokens}: at least {MIN_BUCKET_TOKENS}")
        buckets, b = [], MIN_BUCKET_TOKENS
        while b < chunk_tokens:
            buckets.append(b)
            b *= 2
        return cls(chunk_tokens, (*buckets, chunk_tokens), capacity_mask=True)

    @property
    def exact(self) -> bool:
        """Whether every run has its own length (no chunks, no padding)."""
        return not self.chunk_tokens and not self.bucket_tokens

    def pieces(self, new_tokens: int) -> list[int]:
        """The new tokens of each run a run of ``new_tokens`` is cut into, in order (sum:
        ``new_tokens``; one piece without a chunk bound)."""
        c = self.chunk_tokens
        if not c or new_tokens <= c:
            return [new_tokens]
        return [c] * (new_tokens // c) + ([new_tokens % c] if new_tokens % c else [])

    def width(self, new_tokens: int, room_tokens: int) -> int:
        """The length a run of ``new_tokens`` runs at: the smallest bucket that holds it and fits
        ``room_tokens`` (the slot's capacity past its held tokens), else ``new_tokens`` itself
        (one token: a decode step's shape, never padded)."""
        if new_tokens < 2:
            return new_tokens
        for b in self.bucket_tokens:
            if b >= new_tokens:
                return b if b <= room_tokens else new_tokens
        return new_tokens

    def shapes(self, capacity_tokens: int) -> list[int]:
        """The padded lengths a slot of ``capacity_tokens`` can run (what a warm-up runs once)."""
        return [b for b in self.bucket_tokens if b <= capacity_tokens]


PrefillPlan.EXACT = PrefillPlan()


def prefill_plan(setting: str) -> PrefillPlan | None:
    """The plan the edge's ``prefill_shapes`` setting names: ``"exact"``, ``"bucketed"``, or None
    for ``"auto"`` (the decoder picks by its provider).

    Raises:
        ValueError: another setting."""
    plans = {"auto": None, "exact": PrefillPlan.EXACT, "bucketed": PrefillPlan.bucketed()}
    if setting not in plans:
        raise ValueError(f"prefill_shapes {setting!r}: one of {', '.join(plans)}")
    return plans[setting]
