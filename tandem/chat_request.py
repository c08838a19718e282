"""``chat()``'s arguments into a ``ChatRequest`` (``build_request``), with their checks: the messages'
shape, text (no NUL, no lone surrogate), stop strings, stop token ids in ``[0, 2**32)``, sampling
ranges, deadlines in seconds > 0 and the names of the modes. A refused argument raises
``tandem.errors.BadArgument`` (an ``InvalidArgument`` and a ``ValueError``; ``BadArgumentType`` is a
``TypeError`` too) naming the field as the edge would (``param``, OpenAI's ``error_code``)."""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TypedDict

from tandem.errors import BadArgument, BadArgumentType
from tandem.ranges import (
    MAX_NEW_TOKENS,
    SEED,
    SPLIT_LAYER,
    TEMPERATURE,
    TOKEN_ID,
    TOP_K,
    TOP_P,
    DecimalRange,
    IntegerRange,
    carried_top_k,
)
from tandem.v1 import tandem_pb2 as pb

Message = Mapping[str, str]  # {"role": "user", "content": "..."}


# "auto" travels as MODE_UNSPECIFIED (its equivalent), which edges older than MODE_AUTO also accept
_MODES = {
    "auto": pb.MODE_UNSPECIFIED,
    "split": pb.MODE_SPLIT,
    "direct": pb.MODE_DIRECT,
    "local": pb.MODE_LOCAL,
    "remote_prefill": pb.MODE_REMOTE_PREFILL,
}


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)  # numpy's floats too


_NOT_TEXT = re.compile("[\x00\ud800-\udfff]")


def _text(value: object, param: str) -> str:
    """``value`` if it is a str that is text (no NUL, no lone surrogate: what the edge refuses).

    Raises:
        BadArgumentType: not a str. BadArgument: not text.
    """
    if not isinstance(value, str):
        raise BadArgumentType(f"{param} must be a str, got {type(value).__name__}", param=param)
    m = _NOT_TEXT.search(value)
    if m is not None:
        what = "a NUL character" if m.group() == "\x00" else f"a lone surrogate U+{ord(m.group()):04X}"
        raise BadArgument(f"{param}: not valid text: {what} at character {m.start()}", param=param)
    return value


def _int_in(value: object, param: str, allowed: IntegerRange) -> int:
    """``value`` if it is an int in ``allowed``.

    Raises:
        BadArgumentType: not an int (bools are not). BadArgument: outside the range, worded as the
            edge words it (``tandem.ranges``).
    """
    if not _is_int(value):
        raise BadArgumentType(f"{param} must be an int, got {value!r}", param=param)
    assert isinstance(value, int)
    refused = allowed.refusal(param, value)
    if refused is not None:
        raise BadArgument(refused.message, param=param, error_code=refused.code)
    return value


def _decimal_in(value: object, param: str, allowed: DecimalRange) -> float:
    """``value`` if it is a number in ``allowed``.

    Raises:
        BadArgumentType: not a number. BadArgument: outside the range (NaN: ``invalid_value``),
            worded as the edge words it (``tandem.ranges``).
    """
    if not _is_number(value):
        raise BadArgumentType(f"{param} must be a number, got {value!r}", param=param)
    x = float(value)  # type: ignore[arg-type]  # a numbers.Real
    refused = allowed.refusal(param, x)
    if refused is not None:
        raise BadArgument(refused.message, param=param, error_code=refused.code)
    return x


def _stop_strings(stop: str | Iterable[str] | None) -> tuple[str, ...]:
    """``chat``'s ``stop`` as a tuple: one string, or a sequence of them, each non-empty text.

    Raises:
        BadArgumentType: not a string or strings.
        BadArgument: an empty stop string, or one that is not text.
    """
    if stop is None:
        return ()
    items = (stop,) if isinstance(stop, str) else tuple(stop)
    for i, s in enumerate(items):
        param = f"stop.[{i}]"  # as the edge names it: one string travels as a list of one
        _text(s, param)
        if not s:
            raise BadArgument(f"{param}: stop strings must not be empty", param=param)
    return items


def _stop_token_ids(ids: Iterable[int] | None) -> tuple[int, ...]:
    """``chat``'s ``stop_token_ids`` as a tuple of ints in ``[0, 2**32)``.

    Raises:
        BadArgumentType: an id that is not an int (bools are not ids).
        BadArgument: a negative id or one that does not fit the wire's uint32.
    """
    out = tuple(ids or ())
    for i, t in enumerate(out):
        _int_in(t, f"stop_token_ids.[{i}]", TOKEN_ID)
    return out


def _messages(messages: Sequence[Message]) -> list[pb.ChatMessage]:
    """``chat``'s ``messages``: a sequence of mappings with a str ``role`` and a str ``content``
    (``None``: empty), as OpenAI's API takes them.

    Raises:
        BadArgumentType: not a sequence of mappings (a str is not), a role or content not a str.
        BadArgument: a message without its role, or a string that is not text.
    """
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise BadArgumentType(
            f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got {type(messages).__name__}",
            param="messages",
        )
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise BadArgumentType(f"messages.[{i}] must be a dict, got {type(m).__name__}", param=f"messages.[{i}]")
        if "role" not in m:
            raise BadArgument(
                f"messages.[{i}] needs a 'role'", param=f"messages.[{i}].role", error_code="missing_required_parameter"
            )
        content = m.get("content")
        role = _text(m["role"], f"messages.[{i}].role")
        out.append(
            pb.ChatMessage(role=role, content=_text("" if content is None else content, f"messages.[{i}].content"))
        )
    return out


def _end_session_request(session_id: str) -> pb.EndSessionRequest:
    """``end_session``'s request.

    Raises:
        BadArgument: an empty ``session_id`` or one that is not text. BadArgumentType: not a str.
    """
    if isinstance(session_id, str) and not session_id:
        raise BadArgument("session_id must not be empty", param="session_id", error_code="missing_required_parameter")
    return pb.EndSessionRequest(session_id=_text(session_id, "session_id"))


def _deadline_s(timeout_s: float | None, what: str) -> float | None:
    """A deadline in seconds for grpc (``inf`` = none); raises ValueError unless > 0."""
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not timeout_s > 0:
        raise ValueError(f"{what} must be a number of seconds > 0 (math.inf: no deadline), got {timeout_s!r}")
    return None if math.isinf(timeout_s) else float(timeout_s)


def build_request(
    messages: Sequence[Message] | None = None,
    *,
    prompt: str | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    session_id: str | None = None,
    mode: str = "auto",
    ignore_eos: bool = False,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    split_layer: int = 0,
    whole_reply: bool = False,
) -> pb.ChatRequest:
    """The ``ChatRequest`` of one turn. ``Client.chat`` / ``AsyncClient.chat`` take the same
    arguments (plus ``timeout_s``) and document them. Each check gives the verdict the edge would
    give (its field in ``param``, OpenAI's code in ``error_code``); ``top_k`` -1 is off, as 0
    (vLLM's).

    Raises:
        BadArgument (an ``InvalidArgument`` and a ``ValueError``): neither or both of ``messages``
            and ``prompt``, an unknown ``mode``, a message without ``role``, a string that is not
            text, or a value out of its range (``max_new_tokens < 1``, ``temperature`` outside
            ``[0, 2]``, ``top_p`` outside ``(0, 1]``, ``top_k < -1``, an empty stop string, a
            negative stop token id, ...).
        BadArgumentType (a ``TypeError`` too): a value of the wrong type (``messages`` a str, a
            non-int token count or id, a non-str stop string).
    """
    if messages is not None and prompt is not None:
        raise BadArgument("pass exactly one of messages= or prompt=, not both", param="prompt")
    if messages is None and prompt is None:
        raise BadArgument(
            "pass exactly one of messages= or prompt=", param="messages", error_code="missing_required_parameter"
        )
    if mode not in _MODES:
        raise BadArgument(f"mode must be one of {sorted(_MODES)}, got {mode!r}", param="mode")
    _int_in(split_layer, "split_layer", SPLIT_LAYER)
    if split_layer and mode != "split":
        raise BadArgument(f"split_layer is for mode='split' only; got {split_layer!r}", param="split_layer")
    if not isinstance(whole_reply, bool):
        raise BadArgumentType(f"whole_reply must be a bool, got {whole_reply!r}", param="whole_reply")
    if not isinstance(ignore_eos, bool):
        raise BadArgumentType(f"ignore_eos must be a bool, got {ignore_eos!r}", param="ignore_eos")
    _int_in(max_new_tokens, "max_new_tokens", MAX_NEW_TOKENS)  # the wire's; the edge's limit is lower
    _decimal_in(temperature, "temperature", TEMPERATURE)  # NaN fails too; vLLM's (and OpenAI's) range
    _decimal_in(top_p, "top_p", TOP_P)
    top_k = carried_top_k(_int_in(top_k, "top_k", TOP_K))  # -1 and 0: off
    if seed is not None:
        _int_in(seed, "seed", SEED)
    msgs = _messages(messages) if messages is not None else []
    sp = pb.SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        ignore_eos=ignore_eos,
        stop_token_ids=_stop_token_ids(stop_token_ids),
    )
    if seed is not None:
        sp.seed = seed
    return pb.ChatRequest(
        session_id=_text(session_id or "", "session_id"),
        prompt=_text(prompt or "", "prompt"),
        sampling=sp,
        mode=_MODES[mode],
        messages=msgs,
        stop=_stop_strings(stop),
        split_layer=split_layer,
        whole_reply=whole_reply,
    )


class ChatOptions(TypedDict, total=False):
    """``chat``'s keyword arguments (for ``complete(**kw)``); documented on ``Client.chat``."""

    prompt: str | None
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    session_id: str | None
    mode: str
    timeout_s: float | None
    ignore_eos: bool
    stop: str | Sequence[str] | None
    stop_token_ids: Sequence[int] | None
    split_layer: int
    whole_reply: bool
