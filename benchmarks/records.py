"""One benchmark request's record, as ``tandem-bench modes`` and ``tandem-bench capacity`` write it to
``records.jsonl`` and ``benchmarks.report`` reads it back (units in the names), and the labels of
auto mode's rows (``AUTO_ROWS``, ``is_auto``) that every report tells apart from the fixed modes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class AutoRow:
    """One row of auto mode: the edge chooses the mode per request for one objective.

    ``objective`` is the name ``tandem-bench modes --auto-objectives`` takes; ``whole_reply`` what
    the SDK asks (``client.chat(whole_reply=...)``: the edge then minimises the predicted
    end-to-end time instead of the TTFT); ``metric`` the summary column (``report.summarize``) the
    row is judged by against the best fixed mode, ``metric_name`` its name in the tables."""

    label: str
    objective: str
    whole_reply: bool
    metric: str
    metric_name: str


AUTO_ROWS = (
    AutoRow("auto", "ttft", False, "ttft_mean_ms", "TTFT"),  # streamed replies: time to first token
    AutoRow("auto-whole", "whole", True, "e2e_mean_ms", "e2e"),  # replies used whole: end-to-end time
)


def is_auto(label: str) -> bool:
    """Whether the row ``label`` is one of auto mode's (``auto``, ``auto-whole``, any ``auto-*``): its
    requests were served by the mode the edge chose, so it never counts as a fixed mode."""
    return label == "auto" or label.startswith("auto-")


def auto_row(label: str) -> AutoRow:
    """The ``AutoRow`` of an auto label; an ``auto-*`` label not in ``AUTO_ROWS`` is judged by TTFT,
    as auto's default objective is."""
    return next((a for a in AUTO_ROWS if a.label == label), AutoRow(label, "", False, "ttft_mean_ms", "TTFT"))


@dataclass
class RequestRecord:
    mode: str  # the row's label: split-k{k} | cloud-only | edge-only | remote-prefill | auto | auto-whole
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
    mode_reason: str = ""  # why the edge served that mode (``ChatResult.mode_reason``; "" in older records)
