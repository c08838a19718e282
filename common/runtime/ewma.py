"""Exponentially weighted moving averages: the smoothed estimates both sides keep of rates,
link conditions and prediction residuals (pure Python)."""

from __future__ import annotations

import math
from dataclasses import dataclass

ALPHA = 0.2  # weight of the newest sample: follows a change within about 5-10 samples


@dataclass
class Ewma:
    """``value`` is 0.0 until the first sample, then the first sample, then
    ``(1 - alpha) * value + alpha * x`` per sample ``x``."""

    alpha: float = ALPHA
    value: float = 0.0
    samples: int = 0

    def add(self, x: float) -> None:
        """Fold in sample ``x`` (ignored when not finite)."""
        if not math.isfinite(x):
            return
        self.value = x if self.samples == 0 else (1 - self.alpha) * self.value + self.alpha * x
        self.samples += 1
