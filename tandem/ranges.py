"""The values a request's numeric fields may take, and the one refusal each range gives.

Every front door (the edge's gRPC API, its HTTP API, the SDK before it sends) and the cloud on the
wire check a number against one of these ranges and refuse what falls outside with the same
message and OpenAI's code: ``<field> must be a number in <range>, got <value>`` for a float
(``decimal_below_min_value`` / ``decimal_above_max_value``; ``invalid_value`` for NaN) and
``<field> must be an integer in [<low>, <high>], got <value>`` for an integer
(``integer_below_min_value`` / ``integer_above_max_value``). The domain raises the refusal as
``InvalidRequest`` (gRPC ``INVALID_ARGUMENT``, HTTP 400; ``common.protocol.limits.check_range``), the
SDK as ``BadArgument`` (``tandem.chat_request``).

The sampling fields follow vLLM's ``SamplingParams``: ``temperature`` in ``[0, 2]`` (0: greedy;
above 0 and below 0.01: sampled at 0.01, ``params.MIN_SAMPLED_TEMPERATURE``),
``top_p`` in ``(0, 1]`` (1: off), ``top_k`` in ``[-1, 2**31)`` (-1 and 0: off; at or above the
vocabulary size it keeps every token, as off does), ``seed`` a 64-bit integer (-1: no seed, as
vLLM reads it). ``max_new_tokens`` and stop token ids have the wire's ranges here; an edge narrows
them to its limit and its vocabulary (``RequestLimits``), with the same wording. Pure code, no
dependencies: the SDK uses it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

UINT32_MAX = (1 << 32) - 1


class Refusal(NamedTuple):
    """Why a value is outside its range: the message and OpenAI's code."""

    message: str
    code: str


@dataclass(frozen=True)
class DecimalRange:
    """The values a float field may take: ``[low, high]``, or ``(low, high]`` with ``low_open``;
    NaN and the infinities are outside every range."""

    low: float
    high: float
    low_open: bool = False

    def __str__(self) -> str:
        return f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"

    def refusal(self, param: str, value: float) -> Refusal | None:
        """None for ``value`` in the range, else the refusal of field ``param``: ``decimal_below_min_value``
        / ``decimal_above_max_value`` (-inf / +inf among them), ``invalid_value`` for NaN."""
        if (self.low < value if self.low_open else self.low <= value) and value <= self.high:
            return None
        if math.isnan(value):
            code = "invalid_value"
        else:
            code = "decimal_below_min_value" if value <= self.low else "decimal_above_max_value"
        return Refusal(f"{param} must be a number in {self}, got {value!r}", code)


@dataclass(frozen=True)
class IntegerRange:
    """The values an integer field may take: ``[low, high]``."""

    low: int
    high: int

    def __str__(self) -> str:
        return f"[{self.low}, {self.high}]"

    def below(self, high: int) -> IntegerRange:
        """This range with its upper bound lowered to ``high`` (an edge's limit; 0: unchanged)."""
        return IntegerRange(self.low, min(self.high, high)) if high else self

    def refusal(self, param: str, value: int) -> Refusal | None:
        """None for ``value`` in the range, else the refusal of field ``param``:
        ``integer_below_min_value`` / ``integer_above_max_value``."""
        if self.low <= value <= self.high:
            return None
        code = "integer_below_min_value" if value < self.low else "integer_above_max_value"
        return Refusal(f"{param} must be an integer in {self}, got {value!r}", code)


# the sampling fields: vLLM's ``SamplingParams`` (and OpenAI's API) take no more
TEMPERATURE = DecimalRange(0.0, 2.0)  # 0: greedy
TOP_P = DecimalRange(0.0, 1.0, low_open=True)  # 1: off
TOP_K = IntegerRange(-1, (1 << 31) - 1)  # -1 and 0: off (vLLM's); the wire's int32
SEED = IntegerRange(-(1 << 63), (1 << 63) - 1)
SAMPLING_RANGES: dict[str, DecimalRange | IntegerRange] = {
    "temperature": TEMPERATURE,
    "top_p": TOP_P,
    "top_k": TOP_K,
    "seed": SEED,
}
# the wire's uint32 ranges; an edge narrows the first two to its limit and its vocabulary
MAX_NEW_TOKENS = IntegerRange(1, UINT32_MAX)
TOKEN_ID = IntegerRange(0, UINT32_MAX)
SPLIT_LAYER = IntegerRange(0, UINT32_MAX)  # 0: the edge's choice


def carried_top_k(top_k: int) -> int:
    """``top_k`` as tandem carries it: vLLM's -1 (off) becomes 0 (off); other values unchanged."""
    return 0 if top_k == -1 else top_k
