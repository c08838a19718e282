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
(gRPC, HTTP, the SDK) answers the same field and code; a number out of its range is worded by the
range (``check_range``, ``tandem.ranges``), as the SDK words it before sending.

What it does not check: stop strings and the message structure (``edge.events.ChatTurn``), the
route (``edge.routing.router``), the upload's framing (``cloud.uploads.upload``). Pure domain code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from tandem.common.protocol.errors import InvalidRequest
from tandem.common.protocol.params import MAX_STOP_TOKENS, Sampling
from tandem.common.protocol.text import check_text
from tandem.ranges import MAX_NEW_TOKENS, SAMPLING_RANGES, SPLIT_LAYER, TOKEN_ID, DecimalRange, IntegerRange

__all__ = ["DecimalRange", "IntegerRange", "RequestLimits", "check_range", "check_sampling", "check_session_id"]

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
                ``max_new_tokens`` outside ``[1, max_new_tokens]``, prompt plus ``max_new_tokens``
                beyond ``max_model_len_tokens``, sampling values out of range (``check_sampling``),
                more than ``MAX_STOP_TOKENS`` stop token ids or one outside the vocabulary; ``param``
                names the field. Every out-of-range number is refused as ``check_range`` words it.
        """
        t = len(prompt_ids)
        self.check_prompt_length(t, prompt_param)
        v = self.vocab_size
        bad = next((int(x) for x in prompt_ids if x < 0 or (v and x >= v)), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {v or 'any'})", param=prompt_param)
        check_range(MAX_NEW_TOKENS.below(self.max_new_tokens), "max_new_tokens", s.max_new_tokens)
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
    vocabulary ``[0, vocab_size - 1]`` (0: the wire's ``[0, 2**32)``), as ``check_range`` words it."""
    v = vocab_size
    if len(stops) > MAX_STOP_TOKENS:
        raise InvalidRequest(
            f"stop_token_ids: at most {MAX_STOP_TOKENS}, got {len(stops)}",
            param="stop_token_ids",
            code="array_above_max_length",
        )
    ids = IntegerRange(0, v - 1) if v else TOKEN_ID
    for i, x in enumerate(stops):
        check_range(ids, f"stop_token_ids.[{i}]", x)


def check_range(allowed: DecimalRange | IntegerRange, param: str, value: float) -> None:
    """Raises InvalidRequest (``param`` the field) for ``value`` outside ``allowed``, with the one
    message and code of that range on every surface (``tandem.ranges``: ``<field> must be a number
    in <range>, got <value>``, ``<field> must be an integer in [<low>, <high>], got <value>``)."""
    refused = allowed.refusal(param, value)  # type: ignore[arg-type]  # an int for an IntegerRange
    if refused is not None:
        raise InvalidRequest(refused.message, param=param, code=refused.code)


def check_sampling(s: Sampling) -> None:
    """Raises InvalidRequest (``param`` the field) for a sampling value outside its range
    (``tandem.ranges.SAMPLING_RANGES``, vLLM's: temperature in ``[0, 2]``, top_p in ``(0, 1]``, NaN
    and +/-inf outside every range, top_k in ``[-1, 2**31)`` (-1 and 0: off; at or above the
    vocabulary size it is off too), a seed that is not a 64-bit integer)."""
    for name, allowed in SAMPLING_RANGES.items():
        value = getattr(s, name)
        if value is not None:
            check_range(allowed, name, value)


def check_split_layer_range(split_layer: int) -> None:
    """Raises InvalidRequest for a ``split_layer`` outside the wire's ``[0, 2**32)`` (the HTTP API's
    JSON can say -1; gRPC's uint32 cannot)."""
    check_range(SPLIT_LAYER, "split_layer", split_layer)


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
