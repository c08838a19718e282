"""The cloud node's measured rates, reported to edges in ``GetServerInfo`` and every ``Final``:
exponentially weighted moving averages over recent requests (``common.runtime.ewma``).

Who writes: the gateway, once per request stage. Who reads: ``LinkRegistry.load``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.common.runtime.ewma import Ewma


@dataclass
class CloudRates:
    """Per-token times of the node's engines and its admission wait, all in ms."""

    tail_prefill_ms_per_token: dict[int, Ewma] = field(default_factory=dict)  # k -> per prompt token computed
    prefill_ms_per_token: Ewma = field(default_factory=Ewma)  # decode engine (direct mode) prefill + 1st token
    decode_ms_per_token: Ewma = field(default_factory=Ewma)  # decode engine, per output token after the first
    queue_wait_ms: Ewma = field(default_factory=Ewma)  # admission wait per request
