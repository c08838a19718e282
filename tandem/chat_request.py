"""``chat()``'s arguments into a ``ChatRequest`` (``build_request``), with their checks: stop strings,
stop token ids in ``[0, 2**32)``, deadlines in seconds > 0 and the names of the modes."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TypedDict

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


_UINT32 = 1 << 32


_INT32 = 1 << 31


_INT64 = 1 << 63


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _stop_strings(stop: str | Iterable[str] | None) -> tuple[str, ...]:
    """``chat``'s ``stop`` as a tuple: one string, or a sequence of them, each non-empty.

    Raises:
        TypeError: not a string or strings.
        ValueError: an empty stop string.
    """
    if stop is None:
        return ()
    items = (stop,) if isinstance(stop, str) else tuple(stop)
    for s in items:
        if not isinstance(s, str):
            raise TypeError(f"stop strings must be str, got {type(s).__name__}")
        if not s:
            raise ValueError("stop strings must not be empty")
    return items


def _stop_token_ids(ids: Iterable[int] | None) -> tuple[int, ...]:
    """``chat``'s ``stop_token_ids`` as a tuple of ints in ``[0, 2**32)``.

    Raises:
        TypeError: an id that is not an int (bools are not ids).
        ValueError: a negative id or one that does not fit the wire's uint32.
    """
    out = tuple(ids or ())
    for t in out:
        if not _is_int(t):
            raise TypeError(f"stop token ids must be int, got {type(t).__name__}")
        if not 0 <= t < _UINT32:
            raise ValueError(f"stop token id {t} out of range [0, 2**32)")
    return out


def _end_session_request(session_id: str) -> pb.EndSessionRequest:
    """``end_session``'s request. Raises ValueError for an empty or non-str ``session_id``."""
    if not isinstance(session_id, str) or not session_id:
        raise ValueError(f"session_id must be a non-empty str, got {session_id!r}")
    return pb.EndSessionRequest(session_id=session_id)


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
    arguments (plus ``timeout_s``) and document them.

    Raises:
        ValueError: neither or both of ``messages`` and ``prompt``, an unknown ``mode``, a
            message without ``role`` / ``content``, or a value out of its range
            (``max_new_tokens < 1``, ``temperature < 0``, ``top_p`` outside ``(0, 1]``,
            ``top_k < 0``, an empty stop string, a negative stop token id, ...).
        TypeError: a value of the wrong type (a non-int token count or id, a non-str stop string).
    """
    if (messages is None) == (prompt is None):
        raise ValueError("pass exactly one of messages= or prompt=")
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {sorted(_MODES)}, got {mode!r}")
    if not _is_int(split_layer) or not 0 <= split_layer < _UINT32 or (split_layer and mode != "split"):
        raise ValueError(f"split_layer must be an int >= 0, given with mode='split' only; got {split_layer!r}")
    if not isinstance(whole_reply, bool):
        raise TypeError(f"whole_reply must be a bool, got {whole_reply!r}")
    if not _is_int(max_new_tokens) or not 1 <= max_new_tokens < _UINT32:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not 0 <= temperature <= 2:  # NaN fails too; vLLM's (and OpenAI's) range
        raise ValueError(f"temperature must be in [0, 2], got {temperature!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if not _is_int(top_k) or not 0 <= top_k < _INT32:
        raise ValueError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
    if seed is not None and (not _is_int(seed) or not -_INT64 <= seed < _INT64):
        raise ValueError(f"seed must be a 64-bit int or None, got {seed!r}")
    try:
        msgs = [pb.ChatMessage(role=m["role"], content=m["content"]) for m in (messages or [])]
    except KeyError as e:
        raise ValueError(f"each message needs 'role' and 'content'; one lacks {e}") from None
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
        session_id=session_id or "",
        prompt=prompt or "",
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
