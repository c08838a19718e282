"""The edge's text stream on the real SmolLM2 tokenizer: incremental decoding (tokenizers'
DecodeStream) gives the whole decode's text, whatever the feed sizes, across multi-byte
characters, special tokens and stop strings."""

from __future__ import annotations

import random

import pytest

from tandem.edge.detok import TextStream

TEXTS = [
    "Héllo wörld — 日本語のテキスト 🙂🎉 naïve café",
    "def f(x):\n    return x**2  # ok",
    "  spaces   and\ttabs\n\n end",
    "Ünïcödé at the start, then ascii",
]


def _stream(tokenizer, ids: list[int], sizes: random.Random, stop=()) -> tuple[str, TextStream]:
    s, out, i = TextStream(tokenizer, stop), "", 0
    while i < len(ids) and not s.stopped:
        n = sizes.randint(1, 4)
        out += s.feed(ids[i : i + n])
        i += n
    return out + s.flush(), s


def test_the_real_tokenizer_decodes_incrementally(tokenizer):
    assert TextStream(tokenizer).incremental


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_the_whole_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    ids = ids[:3] + [tokenizer.convert_tokens_to_ids("<|im_end|>")] + ids[3:]  # a special token inside
    want = tokenizer.decode(ids, skip_special_tokens=True)
    rng = random.Random(text)
    for _ in range(10):
        got, _ = _stream(tokenizer, ids, rng)
        assert got == want


def test_random_token_ids_stream_as_the_whole_decode_less_a_trailing_partial_character(tokenizer):
    rng = random.Random(7)
    for _ in range(100):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(24)]
        got, _ = _stream(tokenizer, ids, rng)
        want = tokenizer.decode(ids, skip_special_tokens=True)
        assert want.startswith(got)
        assert want[len(got) :].strip("\ufffd") == ""  # only an unfinished character is held back


def test_stop_strings_cut_the_streamed_text(tokenizer):
    ids = tokenizer.encode("The answer is 42. Done here, thanks.", add_special_tokens=False)
    got, s = _stream(tokenizer, ids, random.Random(1), stop=("Done",))
    assert s.stopped and got == "The answer is 42. "


class _RefusingStream:
    """A ``DecodeStream`` that refuses its third step, as tokenizers does for a window it cannot extend."""

    def __init__(self, real):
        self.real, self.n = real, 0

    def step(self, backend, token_id):
        self.n += 1
        if self.n == 3:
            raise Exception("Invalid prefix encountered")  # noqa: TRY002 - what tokenizers raises
        return self.real.step(backend, token_id)


def test_a_stream_that_refuses_a_window_falls_back_to_the_whole_decode(tokenizer):
    ids = tokenizer.encode(TEXTS[0], add_special_tokens=False)
    s = TextStream(tokenizer)
    stream, backend = s._stream
    s._stream = (_RefusingStream(stream), backend)
    out = "".join(s.feed([t]) for t in ids) + s.flush()
    assert not s.incremental
    assert out == tokenizer.decode(ids, skip_special_tokens=True)


def test_complete_characters_before_a_partial_one_at_the_end_are_not_lost(tokenizer):
    """The last feed brings complete characters then the first byte of another: flush returns them."""
    ids = tokenizer.encode("ab 日本", add_special_tokens=False)
    want = tokenizer.decode(ids, skip_special_tokens=True)
    byte_ids = tokenizer.encode("語", add_special_tokens=False)
    partial = [byte_ids[0]] if len(byte_ids) > 1 else []  # the first of the tokens of a multi-byte character
    for incremental in (True, False):
        s = TextStream(tokenizer)
        if not incremental:
            s._stream = None
        out = s.feed(ids[:1]) + s.feed(ids[1:] + partial) + s.flush()
        assert out == want


def test_every_token_id_is_handed_out_once_with_the_text_that_follows_a_hold(tokenizer):
    """A stop-string prefix holds text back; the ids of the tokens it held travel with the next
    text (``take_ids``), and flushing hands out the rest: the ids handed out are every id fed."""
    ids = tokenizer.encode("Hello there, general Kenobi. You are a bold one.", add_special_tokens=False)
    s, streamed = TextStream(tokenizer, stop=["a bold one, " * 8]), []  # holds 95 characters
    for t in ids:
        if s.feed([t]):
            streamed += s.take_ids()
    assert streamed == []  # the stop prefix held all the text back
    s.flush()
    streamed += s.take_ids()
    assert streamed == ids and s.take_ids() == ()
