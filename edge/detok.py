"""Text out of output tokens, with stop strings: what the edge streams to its client.

``TextStream.feed(token_ids)`` decodes the whole output so far (the tokenizer's own
``decode``, so merges across tokens are right) and returns the new text that is safe
to emit: text still incomplete (a partial UTF-8 character, shown as U+FFFD) and the
last ``max(len(stop)) - 1`` characters, which may be the start of a stop string, are
held back until later tokens decide them (vLLM's stop-string rule: the output ends
before the first stop string, which is not included). ``flush()`` returns what is
held back when the output ends for another reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


class TextStream:
    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tok, self.stop = tokenizer, tuple(s for s in stop if s)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.emitted = 0  # characters of the decoded text already returned
        self.text = ""
        self.stopped = False

    def feed(self, token_ids: Sequence[int]) -> str:
        """New text to emit after these tokens; sets ``stopped`` when a stop string appeared."""
        self.token_ids.extend(token_ids)
        text = self.tok.decode(self.token_ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete character: wait for the next token
            return ""
        self.text = text
        if self.stop:
            start = max(0, self.emitted - self.hold)
            hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.stopped = True
                return self._take(min(hits))
        return self._take(len(text) - self.hold)

    def flush(self) -> str:
        """Everything decoded but not yet returned (the output ended without a stop string)."""
        return "" if self.stopped else self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        out, self.emitted = self.text[self.emitted : upto], upto
        return out
