"""What one request may ask for, and the one check every mode applies.

``RequestLimits`` holds the bounds of a request (vocabulary size, longest prompt, most new
tokens, the model length that prompt and output share); ``check`` raises the ``InvalidRequest``
a request outside them gets, with one message per bound wherever it is checked: the edge before
it chooses a route (``edge.validation``), local mode (``edge.local``) and the cloud on the wire
(``cloud.upload.check_header``). An edge checks against its own limits narrowed by its cloud's
(``narrowed``), so a request passes or fails in the same way whichever mode serves it; each
mode's own check, with limits at least as wide, then never refuses what the edge let through.

What it does not check: stop strings and the message structure (``edge.events.ChatTurn``), the
route (``edge.routing``), the upload's framing (``cloud.upload``). Pure domain code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from tandem.common.errors import InvalidRequest
from tandem.common.params import MAX_STOP_TOKENS, MAX_TEMPERATURE, Sampling

MAX_ID_BYTES = 128  # a session id, on the edge and on the wire to the cloud


@dataclass(frozen=True)
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

        return RequestLimits(*(tighter(getattr(self, f.name), getattr(other, f.name)) for f in fields(self)))

    def check_prompt_length(self, prompt_tokens: int) -> None:
        """Raises InvalidRequest for an empty prompt or one longer than ``max_prompt_tokens``."""
        most = self.max_prompt_tokens
        if prompt_tokens < 1 or (most and prompt_tokens > most):
            raise InvalidRequest(f"prompt has {prompt_tokens} tokens; allowed 1..{most or 'any'}")

    def check(self, prompt_ids: Sequence[int], s: Sampling) -> None:
        """Check a request's prompt token ids and sampling against these limits.

        Raises:
            InvalidRequest: an empty or too long prompt, a token id outside the vocabulary,
                ``max_new_tokens`` outside ``1..max_new_tokens``, prompt plus ``max_new_tokens``
                beyond ``max_model_len_tokens``, sampling values out of range (temperature in
                ``[0, MAX_TEMPERATURE]``, top_p in ``(0, 1]``, top_k >= 0), more than
                ``MAX_STOP_TOKENS`` stop token ids or one outside the vocabulary.
        """
        t = len(prompt_ids)
        self.check_prompt_length(t)
        v = self.vocab_size
        bad = next((int(x) for x in prompt_ids if x < 0 or (v and x >= v)), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {v or 'any'})")
        most = self.max_new_tokens
        if s.max_new_tokens < 1 or (most and s.max_new_tokens > most):
            raise InvalidRequest(f"max_new_tokens {s.max_new_tokens}; allowed 1..{most or 'any'}")
        length = self.max_model_len_tokens
        if length and t + s.max_new_tokens > length:
            raise InvalidRequest(
                f"prompt ({t} tokens) + max_new_tokens ({s.max_new_tokens}) exceeds the model length of {length} tokens"
            )
        check_sampling(s)
        stops = s.stop_token_ids
        if len(stops) > MAX_STOP_TOKENS or any(x < 0 or (v and x >= v) for x in stops):
            raise InvalidRequest(f"stop_token_ids: at most {MAX_STOP_TOKENS}, each in the vocabulary [0, {v or 'any'})")


def check_sampling(s: Sampling) -> None:
    """Raises InvalidRequest for a temperature outside ``[0, MAX_TEMPERATURE]``, a top_p outside
    ``(0, 1]``, a top_k outside ``[0, 2**31)`` (the wire's int32; at or above the vocabulary size it
    is off, as 0 is) or a seed that is not a 64-bit integer (NaN is outside every range)."""
    if not 0 <= s.temperature <= MAX_TEMPERATURE or not 0 < s.top_p <= 1 or not 0 <= s.top_k < 1 << 31:
        raise InvalidRequest(f"bad sampling: temperature={s.temperature} top_p={s.top_p} top_k={s.top_k}")
    if s.seed is not None and not -(1 << 63) <= s.seed < 1 << 63:
        raise InvalidRequest(f"seed {s.seed} is not a 64-bit integer")


def check_session_id(session_id: str) -> None:
    """Raises InvalidRequest for a session id longer than ``MAX_ID_BYTES`` bytes (UTF-8)."""
    if len(session_id.encode()) > MAX_ID_BYTES:
        raise InvalidRequest(f"session_id longer than {MAX_ID_BYTES} bytes")
