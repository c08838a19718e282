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
