"""One benchmark request's record, as ``tandem-bench modes`` and ``tandem-bench capacity`` write it to
``records.jsonl`` and ``benchmarks.report`` reads it back (units in the names)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    mode: str  # split-k{k} | cloud-only | edge-only | remote-prefill | auto
    link: str
    target_prompt_tokens: int
    prompt_tokens: int
    output_tokens: int
    ttft_ms: float
    e2e_ms: float
    itl_ms: list[float]
    start_s: float
    end_s: float
    external_tokens: int = 0
    head_tokens: int = 0
    sent_bytes: dict[str, int] = field(default_factory=dict)
    timings_ms: dict[str, float] = field(default_factory=dict)
    served_mode: str = ""  # the mode that served it (differs from the row only for auto)
    served_split_layer: int = 0
    predicted_ttft_ms: float = 0.0  # the edge's cost-model prediction for the served mode
