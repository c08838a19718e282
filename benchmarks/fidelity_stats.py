"""The measures of ``tandem-bench fidelity``, over teacher-forced next-token distributions: pure
numpy, no model. Measures as KV and activation quantization work reports them (KIVI, Liu et al.,
arXiv:2402.02750; KVQuant, Hooper et al., arXiv:2401.18079; QuaRot, Ashkboos et al.,
arXiv:2404.00456): the next-token KL divergence from the reference, top-1 agreement and the
perplexity of the reference replies, each beside the unquantized system's own noise.

A distribution is given as its top ``K`` (``ids`` int ``[K]``, ``lps`` float ``[K]``
log-probabilities, best first), which is all vLLM's ``prompt_logprobs`` returns, and, where the
whole vocabulary is known (in-process), as float32 ``[V]`` log-probabilities too.

``topk_kl`` is the KL divergence between the two distributions coarsened to the tokens in both
top-``K`` lists plus one bucket for all the rest. Coarsening never increases a KL divergence
(the data-processing inequality; Cover and Thomas, Elements of Information Theory, 2nd ed., 2.8),
so it is a lower bound of the full KL, exact when the rest holds nothing; comparing two systems
by it is like with like when both are measured the same way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

GAP_NATS = 0.5  # a reference top-2 gap (log p1 - log p2) at or below it is a near-tie
LENGTH_BUCKETS = (64, 128, 256)  # prompt-token bucket edges: < 64, 64-127, 128-255, >= 256
FLOOR_FACTOR = 2.0  # a format qualifies within this factor of the noise floor (KL and flip rate)
_TINY = 1e-30


def topk(lp: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The top ``k`` of log-probabilities ``lp`` float ``[..., V]``: (ids int32, lps float32),
    each ``[..., k]``, best first."""
    idx = np.argpartition(-lp, k, axis=-1)[..., :k]
    vals = np.take_along_axis(lp, idx, -1)
    order = np.argsort(-vals, axis=-1, kind="stable")
    return np.take_along_axis(idx, order, -1).astype(np.int32), np.take_along_axis(vals, order, -1).astype(np.float32)


def topk_kl(ids_p: np.ndarray, lps_p: np.ndarray, ids_q: np.ndarray, lps_q: np.ndarray) -> float:
    """``KL(p || q)`` (nats) coarsened to the tokens in both top lists plus the rest (module doc);
    ``ids_*`` int ``[K]``, ``lps_*`` float ``[K]`` (``-inf`` for empty slots)."""
    common, ip, iq = np.intersect1d(ids_p, ids_q, assume_unique=True, return_indices=True)
    a = np.exp(lps_p[ip].astype(np.float64))
    b = np.exp(lps_q[iq].astype(np.float64))
    ok = (a > 0) & (b > 0)
    kl = float(np.sum(a[ok] * (np.log(a[ok]) - np.log(b[ok]))))
    ra, rb = max(1.0 - a.sum(), 0.0), max(1.0 - b.sum(), _TINY)
    if ra > 0:
        kl += ra * (math.log(ra) - math.log(rb))
    return max(kl, 0.0)


def full_kl(lp_p: np.ndarray, lp_q: np.ndarray) -> np.ndarray:
    """``KL(p || q)`` (nats) per row of float ``[..., V]`` log-probabilities: ``[...]``."""
    p = np.exp(lp_p.astype(np.float64))
    return np.maximum(np.sum(p * (lp_p.astype(np.float64) - lp_q), axis=-1), 0.0)


def bucket_of(prompt_tokens: int) -> str:
    """The prompt-length bucket label of ``prompt_tokens`` (``LENGTH_BUCKETS``)."""
    lo = 0
    for hi in LENGTH_BUCKETS:
        if prompt_tokens < hi:
            return f"{lo}-{hi - 1}"
        lo = hi
    return f">={lo}"


@dataclass
class Positions:
    """Per-position measures of one system against the reference, over many turns (lists of equal
    length): the reference's top-2 gap (nats), top-K KL, full KL (NaN where unknown), whether the
    top-1 tokens agree, the negative log-likelihood of the reference reply's token, and the
    prompt-length bucket."""

    gap: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    kl_full: list[float] = field(default_factory=list)
    agree: list[bool] = field(default_factory=list)
    nll: list[float] = field(default_factory=list)
    bucket: list[str] = field(default_factory=list)

    def add_turn(
        self,
        ref: tuple[np.ndarray, np.ndarray],
        other: tuple[np.ndarray, np.ndarray],
        other_own: np.ndarray,
        prompt_tokens: int,
        kl_full: np.ndarray | None = None,
    ) -> None:
        """One turn of ``n`` positions: ``ref`` and ``other`` as (ids ``[n, K]``, lps ``[n, K]``),
        ``other_own`` float ``[n]`` the other's log-probability of the reference token,
        ``kl_full`` float ``[n]`` where the full distributions are known."""
        (ip, lp), (iq, lq) = ref, other
        b = bucket_of(prompt_tokens)
        for j in range(ip.shape[0]):
            self.gap.append(float(lp[j, 0] - lp[j, 1]))
            self.kl.append(topk_kl(ip[j], lp[j], iq[j], lq[j]))
            self.kl_full.append(float("nan") if kl_full is None else float(kl_full[j]))
            self.agree.append(bool(ip[j, 0] == iq[j, 0]))
            self.nll.append(float(-other_own[j]))
            self.bucket.append(b)


def summarize(pos: Positions, gap_nats: float = GAP_NATS) -> dict:
    """The table's measures over ``pos``: mean and p99 KL (top-K and full), top-1 agreement where
    the reference's gap exceeds ``gap_nats``, the flip rate at near-ties and over all positions,
    perplexity of the reference replies, and mean KL and flip rate per prompt-length bucket."""
    kl, klf = np.asarray(pos.kl), np.asarray(pos.kl_full)
    agree, gap = np.asarray(pos.agree), np.asarray(pos.gap)
    decisive = gap > gap_nats
    buckets = {}
    for b in dict.fromkeys(sorted(pos.bucket, key=lambda s: int(s.split("-")[0].lstrip(">=")))):
        m = np.asarray(pos.bucket) == b
        buckets[b] = {
            "positions": int(m.sum()),
            "kl_mean": float(kl[m].mean()),
            "flip_rate": float(1 - agree[m].mean()),
        }
    return {
        "positions": int(kl.size),
        "near_ties": int((~decisive).sum()),
        "kl_mean": float(kl.mean()),
        "kl_p99": float(np.quantile(kl, 0.99)),
        "kl_full_mean": float(np.nanmean(klf)) if np.isfinite(klf).any() else None,
        "kl_full_p99": float(np.nanquantile(klf, 0.99)) if np.isfinite(klf).any() else None,
        "top1_decisive": float(agree[decisive].mean()) if decisive.any() else 1.0,
        "flip_near_tie": float(1 - agree[~decisive].mean()) if (~decisive).any() else 0.0,
        "flip_rate": float(1 - agree.mean()),
        "ppl": float(math.exp(np.mean(pos.nll))),
        "buckets": buckets,
    }


def greedy_agreement(ref: Mapping[str, Sequence[int]], other: Mapping[str, Sequence[int]]) -> dict:
    """Greedy replies against the reference's, over the ids both hold: the share identical and the
    mean first divergence position (1-based, over the replies that diverge; None if none do)."""
    ids = sorted(set(ref) & set(other))
    firsts = []
    for i in ids:
        a, b = list(ref[i]), list(other[i])
        if a != b:
            firsts.append(
                next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))) + 1
            )
    return {
        "replies": len(ids),
        "identical": 1 - len(firsts) / max(1, len(ids)),
        "first_divergence_mean": float(np.mean(firsts)) if firsts else None,
    }


def first_divergence(reply: np.ndarray, top1: np.ndarray) -> int | None:
    """Where a greedy reply parts from the reference ``reply`` int ``[n]``, given the system's
    teacher-forced top-1 tokens ``top1`` int ``[n]`` along it: the first position (0-based) where
    they differ, or None where they never do."""
    diff = np.flatnonzero(np.asarray(top1) != np.asarray(reply))
    return int(diff[0]) if diff.size else None


@dataclass
class Divergences:
    """At each reply's first greedy divergence, the top-2 log-probability gaps (nats; the logits'
    gap, which a softmax keeps) of the reference and of the other system at that position: a
    divergence at a small reference gap is a near-tie going the other way, one at a large gap an
    error. Lists of equal length, one entry per diverging reply."""

    ref_gap: list[float] = field(default_factory=list)
    own_gap: list[float] = field(default_factory=list)
    position: list[int] = field(default_factory=list)

    def add_turn(self, reply: np.ndarray, ref_lps: np.ndarray, other_ids: np.ndarray, other_lps: np.ndarray) -> None:
        """One reply of ``n`` tokens: ``reply`` int ``[n]`` the reference's, ``ref_lps`` float
        ``[n, K]`` the reference's top-K log-probabilities, ``other_ids`` int ``[n, K]`` and
        ``other_lps`` float ``[n, K]`` the other's top K (best first, ``K >= 2``)."""
        j = first_divergence(reply, other_ids[:, 0])
        if j is None:
            return
        self.ref_gap.append(float(ref_lps[j, 0] - ref_lps[j, 1]))
        self.own_gap.append(float(other_lps[j, 0] - other_lps[j, 1]))
        self.position.append(j)


def summarize_divergences(d: Divergences, gap_nats: float = GAP_NATS) -> dict:
    """The first divergences' gaps: how many replies diverge, how many of them at a near-tie of the
    reference (gap ``<= gap_nats``), the median and smallest gap of the reference and of the other
    system (None where no reply diverges), and every gap (``ref_gaps``, ``own_gaps``, nats)."""
    ref, own = np.asarray(d.ref_gap), np.asarray(d.own_gap)
    some = ref.size > 0
    return {
        "divergences": int(ref.size),
        "at_near_ties": int((ref <= gap_nats).sum()),
        "ref_gap_median": float(np.median(ref)) if some else None,
        "ref_gap_min": float(ref.min()) if some else None,
        "own_gap_median": float(np.median(own)) if some else None,
        "own_gap_min": float(own.min()) if some else None,
        "ref_gaps": [round(g, 4) for g in d.ref_gap],
        "own_gaps": [round(g, 4) for g in d.own_gap],
    }


def qualifies(row: dict, floor: dict, factor: float = FLOOR_FACTOR) -> bool:
    """A format is within the noise floor: its mean top-K KL and its flip rate each at most
    ``factor`` times the floor's."""
    return row["kl_mean"] <= factor * floor["kl_mean"] and row["flip_rate"] <= factor * floor["flip_rate"]


def varint_bytes(token_id: int) -> int:
    """Bytes of one token id in a packed protobuf ``repeated uint32`` (base-128 varint)."""
    return max(1, (int(token_id).bit_length() + 6) // 7)
