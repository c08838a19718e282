"""What one request may ask for, and the one check every mode applies.

``RequestLimits`` holds the bounds of a request (vocabulary size, longest prompt, most new
tokens, the model length that prompt and output share); ``check`` raises the ``InvalidRequest``
a request outside them gets, with one message per bound wherever it is checked: the edge before
it chooses a route (``edge.validation``), local mode (``edge.compute.local``) and the cloud on the wire
(``cloud.uploads.upload.check_header``). An edge checks against its own limits narrowed by its cloud's
(``narrowed``), so a request passes or fails in the same way whichever mode serves it; each
mode's own check, with limits at least as wide, then never refuses what the edge let through.

Every refusal names its field as OpenAI writes it (``InvalidRequest.param``: ``max_new_tokens``,
``stop_token_ids.[2]``; the prompt's own name, ``messages`` or ``prompt``) with OpenAI's code
(``context_length_exceeded`` for a prompt too long, ``integer_above_max_value``...), so each surface
(gRPC, HTTP, the SDK) answers the same field and code.

What it does not check: stop strings and the message structure (``edge.events.ChatTurn``), the
route (``edge.routing.router``), the upload's framing (``cloud.uploads.upload``). Pure domain code.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

from tandem.common.protocol.errors import InvalidRequest
from tandem.common.protocol.params import MAX_STOP_TOKENS, MAX_TEMPERATURE, Sampling
from tandem.common.protocol.text import check_text

MAX_ID_BYTES = 128  # a session id, on the edge and on the wire to the cloud


@dataclass(frozen=True, kw_only=True)
class RequestLimits:
    """Bounds of one request, in tokens; 0 = no bound of this kind (unknown)."""

    vocab_size: int = 0  # V: every token id, prompt and stop, is in [0, V)
    max_prompt_tokens: int = 0
    max_new_tokens: int = 0
    max_model_len_tokens: int = 0  # prompt + max_new_tokens (vLLM's max_model_len, the model's positions)

    def narrowed(self, other: RequestLimits) -> RequestLimits:
        """The tighter of ``self`` and ``other`` in every bound (a bound only one knows is kept)."""

        def tighter(a: int, b: int) -> int:
            return min(a, b) if a and b else a or b

        return RequestLimits(**{f.name: tighter(getattr(self, f.name), getattr(other, f.name)) for f in fields(self)})

    def check_prompt_length(self, prompt_tokens: int, param: str = "prompt") -> None:
        """Raises InvalidRequest (field ``param``) for an empty prompt or one longer than
        ``max_prompt_tokens`` (``context_length_exceeded``)."""
        most = self.max_prompt_tokens
        if prompt_tokens < 1 or (most and prompt_tokens > most):
            code = "invalid_value" if prompt_tokens < 1 else "context_length_exceeded"
            raise InvalidRequest(
                f"prompt has {prompt_tokens} tokens; allowed 1..{most or 'any'}", param=param, code=code
            )

    def check(self, prompt_ids: Sequence[int], s: Sampling, prompt_param: str = "prompt") -> None:
        """Check a request's prompt token ids and sampling against these limits; ``prompt_param`` names
        the prompt's field (``messages`` for a chat).

        Raises:
            InvalidRequest: an empty or too long prompt, a token id outside the vocabulary,
                ``max_new_tokens`` outside ``1..max_new_tokens``, prompt plus ``max_new_tokens``
                beyond ``max_model_len_tokens``, sampling values out of range (``check_sampling``:
                temperature in ``[0, MAX_TEMPERATURE]``, top_p in ``(0, 1]``, NaN and +/-inf
                nowhere, top_k >= 0), more than
                ``MAX_STOP_TOKENS`` stop token ids or one outside the vocabulary; ``param`` names
                the field.
        """
        t = len(prompt_ids)
        self.check_prompt_length(t, prompt_param)
        v = self.vocab_size
        bad = next((int(x) for x in prompt_ids if x < 0 or (v and x >= v)), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {v or 'any'})", param=prompt_param)
        most = self.max_new_tokens
        if s.max_new_tokens < 1 or (most and s.max_new_tokens > most):
            code = "integer_below_min_value" if s.max_new_tokens < 1 else "integer_above_max_value"
            raise InvalidRequest(
                f"max_new_tokens {s.max_new_tokens}; allowed 1..{most or 'any'}", param="max_new_tokens", code=code
            )
        length = self.max_model_len_tokens
        if length and t + s.max_new_tokens > length:
            raise InvalidRequest(
                f"prompt ({t} tokens) + max_new_tokens ({s.max_new_tokens}) exceeds the model length of {length} "
                "tokens",
                param=prompt_param,
                code="context_length_exceeded",
            )
        check_sampling(s)
        check_stop_token_ids(s.stop_token_ids, v)


def check_stop_token_ids(stops: Sequence[int], vocab_size: int = 0) -> None:
    """Raises InvalidRequest for more than ``MAX_STOP_TOKENS`` stop token ids or one outside the
    vocabulary ``[0, vocab_size)`` (0: only negative ids are refused)."""
    v = vocab_size
    if len(stops) > MAX_STOP_TOKENS:
        raise InvalidRequest(
            f"stop_token_ids: at most {MAX_STOP_TOKENS}, got {len(stops)}",
            param="stop_token_ids",
            code="array_above_max_length",
        )
    for i, x in enumerate(stops):
        if x < 0 or (v and x >= v):
            raise InvalidRequest(
                f"stop_token_ids.[{i}]: {x} is outside the vocabulary [0, {v or 'any'})",
                param=f"stop_token_ids.[{i}]",
                code="integer_below_min_value" if x < 0 else "integer_above_max_value",
            )


def _out_of_range(param: str, value: float, low: float, high: float, integer: bool) -> InvalidRequest:
    kind = "integer" if integer else "decimal"
    code = f"{kind}_below_min_value" if value < low else f"{kind}_above_max_value" if value > high else "invalid_value"
    return InvalidRequest(f"{param} {value} is outside [{low}, {high}]", param=param, code=code)


@dataclass(frozen=True)
class DecimalRange:
    """The values a float field of a request may take: ``[low, high]``, or ``(low, high]`` with
    ``low_open``; NaN and the infinities are outside every range."""

    low: float
    high: float
    low_open: bool = False

    def __str__(self) -> str:
        return f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"

    def check(self, param: str, value: float) -> None:
        """Raises InvalidRequest (``param`` the field) for ``value`` outside the range: OpenAI's
        ``decimal_below_min_value`` / ``decimal_above_max_value`` (-inf / +inf among them), and
        ``invalid_value`` for NaN (neither above nor below). The one check of a float field on every
        surface (gRPC, the HTTP API, the cloud's on the wire), so each gives one message and code."""
        if (self.low < value if self.low_open else self.low <= value) and value <= self.high:
            return
        if math.isnan(value):
            code = "invalid_value"
        else:
            code = "decimal_below_min_value" if value <= self.low else "decimal_above_max_value"
        raise InvalidRequest(f"{param} must be a number in {self}, got {value!r}", param=param, code=code)


# the float fields of ``Sampling`` and their ranges: vLLM's ``SamplingParams`` (and OpenAI's API) take
# no more; the HTTP API's own float fields are in ``edge.api.request_models.PENALTY_RANGE``
SAMPLING_DECIMALS: dict[str, DecimalRange] = {
    "temperature": DecimalRange(0.0, MAX_TEMPERATURE),
    "top_p": DecimalRange(0.0, 1.0, low_open=True),
}


def check_sampling(s: Sampling) -> None:
    """Raises InvalidRequest (``param`` the field) for a float field outside its range
    (``SAMPLING_DECIMALS``: temperature in ``[0, MAX_TEMPERATURE]``, top_p in ``(0, 1]``; NaN and
    +/-inf are outside every range), a top_k outside ``[0, 2**31)`` (the wire's int32; at or above
    the vocabulary size it is off, as 0 is) or a seed that is not a 64-bit integer."""
    for name, bounds in SAMPLING_DECIMALS.items():
        bounds.check(name, getattr(s, name))
    if not 0 <= s.top_k < 1 << 31:
        raise _out_of_range("top_k", s.top_k, 0, (1 << 31) - 1, integer=True)
    if s.seed is not None and not -(1 << 63) <= s.seed < 1 << 63:
        raise _out_of_range("seed", s.seed, -(1 << 63), (1 << 63) - 1, integer=True)


def check_session_id(session_id: str, param: str = "session_id") -> str:
    """``session_id`` if it is text (``common.protocol.text``) of at most ``MAX_ID_BYTES`` bytes (UTF-8); the one
    check of a session id on every surface (``Chat``, ``EndSession``, the HTTP API, the cloud).

    Raises:
        InvalidRequest: it is not (``param`` names the field).
    """
    check_text(session_id, param)
    if len(session_id.encode()) > MAX_ID_BYTES:
        raise InvalidRequest(f"{param} longer than {MAX_ID_BYTES} bytes", param=param, code="string_above_max_length")
    return session_id
