"""Exponentially weighted moving averages: the smoothed estimates both sides keep of rates,
link conditions and prediction residuals (pure Python)."""

from __future__ import annotations

import math
from dataclasses import dataclass

ALPHA = 0.2  # weight of the newest sample: follows a change within about 5-10 samples


@dataclass
class Ewma:
    """``value`` is 0.0 until the first sample, then the first sample, then
    ``(1 - a) * value + a * x`` per sample ``x``, where ``a = 1 - (1 - alpha) ** weight``: a sample
    of weight ``w`` moves the average as ``w`` samples of ``x`` of weight 1 would (``alpha`` at
    weight 1), so a mean over many events (a turn's tokens) counts for more than one over few.
    Until the samples' weights add up to 1, ``a`` is at least ``w / (weights so far + w)`` (the
    weighted mean of those samples): a light first sample is not the whole average that a heavier
    next one barely moves (with weights of 1: the first sample is the average, then alpha per sample)."""

    alpha: float = ALPHA
    value: float = 0.0
    samples: int = 0
    weight: float = 0.0  # the samples' weights added up

    def add(self, x: float, weight: float = 1.0) -> None:
        """Fold in sample ``x`` of ``weight`` (ignored when either is not finite or the weight is
        not positive)."""
        if not (math.isfinite(x) and math.isfinite(weight)) or weight <= 0:
            return
        a = self.alpha if weight == 1.0 else 1 - (1 - self.alpha) ** weight
        if self.weight < 1.0:
            a = max(a, weight / (self.weight + weight))
        self.value = (1 - a) * self.value + a * x
        self.samples += 1
        self.weight += weight
