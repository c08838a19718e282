"""Strings from clients are text: one check for every string field of both edge APIs (HTTP, gRPC).

Text here is a string of Unicode scalar values without U+0000. Two things that are not text reach
a Python ``str``:

* a lone UTF-16 surrogate (U+D800..U+DFFF): JSON's ``"\\ud800"`` escape decodes to one, and UTF-8
  cannot encode it, so the tokenizer (``TypeError``), the JSON encoder and protobuf fail on it later;
* NUL (U+0000): valid UTF-8 that JSON and protobuf both carry, cut or refused by C strings, logs
  and stores.

Over gRPC only NUL comes through: protobuf's parser (upb) refuses bad UTF-8 in a string field, and
a surrogate encoded as UTF-8 is bad UTF-8. ``check_text`` is called where a request becomes a
domain object (``edge.events.ChatTurn``); the HTTP API also runs ``find_non_text`` over the whole
JSON body, so its error names the parameter.

``printable`` is the other direction: what a peer sent, made safe to write where an operator reads
it (a log line, a metric label, a span attribute): every character that is not printable escaped,
the whole bounded.
"""

from __future__ import annotations

import re
from typing import Any

from tandem.common.protocol.errors import InvalidRequest

_NOT_TEXT = re.compile("[\x00\ud800-\udfff]")
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}

Path = tuple[str | int, ...]


def text_problem(value: str) -> str | None:
    """Why ``value`` is not text (``"a lone surrogate U+D800 at character 0"``), or None if it is."""
    m = _NOT_TEXT.search(value)
    if m is None:
        return None
    ch = m.group()
    what = "a NUL character" if ch == "\x00" else f"a lone surrogate U+{ord(ch):04X}"
    return f"{what} at character {m.start()}"


def check_text(value: str, where: str) -> str:
    """``value`` unchanged if it is text.

    Raises:
        InvalidRequest: it is not: ``"{where}: not valid text: a NUL character at character 3"``, its
            ``param`` ``where`` (the field, as OpenAI writes it: ``messages.[0].content``).
    """
    problem = text_problem(value)
    if problem is not None:
        raise InvalidRequest(f"{where}: not valid text: {problem}", param=where, code="invalid_value")
    return value


def find_non_text(obj: Any, path: Path = ()) -> tuple[Path, str] | None:
    """The first string in ``obj`` (decoded JSON: dicts, lists, scalars; keys included) that is not
    text, as (its path, the problem), or None."""
    if isinstance(obj, str):
        problem = text_problem(obj)
        return None if problem is None else (path, problem)
    if isinstance(obj, dict):
        for key, value in obj.items():
            if isinstance(key, str) and (problem := text_problem(key)) is not None:
                return path, f"a key with {problem}"  # the key itself cannot name the path
            found = find_non_text(value, (*path, key))
            if found is not None:
                return found
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            found = find_non_text(value, (*path, i))
            if found is not None:
                return found
    return None


def _escape(ch: str) -> str:
    code = ord(ch)
    if ch in _ESCAPES:
        return _ESCAPES[ch]
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(value: object, max_chars: int) -> str:
    """``str(value)`` as one printable line of at most ``max_chars`` characters plus the cut's
    marker: each character ``str.isprintable`` refuses (CR, LF, NUL, ESC and the other controls,
    lone surrogates, U+2028, U+0085...) written as its Python escape (``\\n``, ``\\x1b``, ``\\ud800``),
    and what does not fit left out, the line then ending ``...(N more characters)`` (N of ``value``'s
    characters). For peer-supplied strings (ids, names, headers, model names) on their way to a log
    line, a metric label or a span attribute."""
    s = value if isinstance(value, str) else str(value)
    if len(s) <= max_chars and s.isprintable():
        return s
    out: list[str] = []
    used = 0
    for i, c in enumerate(s):
        piece = c if c.isprintable() else _escape(c)
        if used + len(piece) > max_chars:
            return f"{''.join(out)}...({len(s) - i} more characters)"
        out.append(piece)
        used += len(piece)
    return "".join(out)
