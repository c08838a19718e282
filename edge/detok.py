"""Text out of output tokens, with stop strings: what the edge streams to its client.

``TextStream.feed(token_ids)`` turns the new tokens into new text and returns the part that
is safe to emit: text still incomplete (a partial UTF-8 character) and the last
``max(len(stop)) - 1`` characters, which may be the start of a stop string, are held back
until later tokens decide them (vLLM's stop-string rule: the output ends before the first
stop string, which is not included). ``flush()`` returns what is held back when the output
ends for another reason.

Decoding is incremental where the tokenizer allows it: a fast (Rust ``tokenizers``) tokenizer
without ``clean_up_tokenization_spaces`` goes through ``tokenizers.decoders.DecodeStream``,
which keeps a small window of tokens and returns only the new text (the tokenizer's work per
token is constant). Other tokenizers (slow ones, or those whose clean-up rewrites text across
token boundaries) decode the whole output on every feed. When the stream refuses a window it
cannot extend (byte-fallback tokenizers can make it; vLLM's detokenizer meets the same,
vLLM #17448), the rest of the output goes through the whole decode. Either way the text equals
``tokenizer.decode(all_ids, skip_special_tokens=True)`` less a trailing incomplete character
(``tests/inprocess/test_detok.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


def _stream_decoder(tokenizer: Any) -> tuple[Any, Any] | None:
    """``(DecodeStream, backend tokenizer)`` where streaming gives the whole decode's text, else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:  # tokenizers < 0.21
        return None
    return DecodeStream(skip_special_tokens=True), backend


class TextStream:
    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tok, self.stop = tokenizer, tuple(s for s in stop if s)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.emitted = 0  # characters of the decoded text already returned
        self.ids_taken = 0  # token ids already handed out by ``take_ids``
        self.text = ""
        self.stopped = False
        self._stream = _stream_decoder(tokenizer)
        self._pending = ""  # the text the stream returned so far

    @property
    def incremental(self) -> bool:
        """True while decoding goes through ``DecodeStream`` (constant tokenizer work per token)."""
        return self._stream is not None

    def _decode(self, token_ids: Sequence[int]) -> str:
        """The whole text so far that is final: less a trailing incomplete character (U+FFFD), which
        a later token may complete."""
        if self._stream is not None:
            stream, backend = self._stream
            try:
                chunk = None
                for t in token_ids:  # one id per step: older tokenizers' step takes no list
                    part = stream.step(backend, int(t))
                    if part is not None:
                        chunk = part if chunk is None else chunk + part
            except Exception:  # noqa: BLE001 - the library refuses a window it cannot extend (vLLM #17448)
                self._stream = None  # the whole decode from here on, as vLLM's detokenizer does
            else:
                if chunk is not None:
                    self._pending += chunk
                return self._pending
        return self._whole_text()

    def _whole_text(self) -> str:
        """One decode of every token so far, less a trailing incomplete character."""
        return self.tok.decode(self.token_ids, skip_special_tokens=True).rstrip("\ufffd")

    def feed(self, token_ids: Sequence[int]) -> str:
        """New text to emit after these tokens; sets ``stopped`` when a stop string appeared."""
        self.token_ids.extend(token_ids)
        text = self.text = self._decode(token_ids)
        if self.stop:
            start = max(0, self.emitted - self.hold)
            hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.stopped = True
                return self._take(min(hits))
        return self._take(len(text) - self.hold)

    def take_ids(self) -> tuple[int, ...]:
        """The token ids fed since the last call: what a streamed delta carries, so that the ids of
        tokens whose text was held back travel with the next text (none is left out of the stream)."""
        out = tuple(self.token_ids[self.ids_taken :])
        self.ids_taken = len(self.token_ids)
        return out

    def flush(self) -> str:
        """Everything decoded but not yet returned (the output ended without a stop string). The
        output is over, so text the stream still holds for a later token comes from one whole
        decode (less a trailing incomplete character)."""
        if self.stopped:
            return ""
        if self._stream is not None and self.token_ids:
            self.text = self._whole_text()
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        out, self.emitted = self.text[self.emitted : upto], upto
        return out
