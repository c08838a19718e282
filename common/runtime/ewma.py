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
    weight 1), so a mean over many events (a turn's tokens) counts for more than one over few."""

    alpha: float = ALPHA
    value: float = 0.0
    samples: int = 0

    def add(self, x: float, weight: float = 1.0) -> None:
        """Fold in sample ``x`` of ``weight`` (ignored when either is not finite or the weight is
        not positive)."""
        if not (math.isfinite(x) and math.isfinite(weight)) or weight <= 0:
            return
        a = self.alpha if weight == 1.0 else 1 - (1 - self.alpha) ** weight
        self.value = x if self.samples == 0 else (1 - a) * self.value + a * x
        self.samples += 1
