"""The incremental detokenizer (model/detokenize.py) against the tokenizer's own decode of the whole answer, on the
real tokenizers: every prefix of a text whose characters are split across tokens, and random token streams."""

from __future__ import annotations

import random

import pytest

from kvrag.model.detokenize import Detokenizer

# accents, a dash, CJK and emoji: characters of 2 to 4 UTF-8 bytes, several of them split across byte-level tokens
TEXT = "Zürich — 12 km² of naïve café ☕ text. 日本語の文章 🦜🧪 done.\n\nNext: ½ » “quotes”"


@pytest.fixture(params=["smol", "qwen05"])
def tokenizer(request):
    return request.getfixturevalue(request.param).load_tokenizer()


def streamed(tokenizer, ids: list[int]) -> tuple[list[str], str]:
    detokenizer = Detokenizer(tokenizer)
    return [detokenizer.push(token) for token in ids], detokenizer.flush()


def test_the_pieces_are_the_whole_decode_at_every_length(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in tokenizer.decode([token]) for token in ids)  # a character split across tokens
    pieces, tail = streamed(tokenizer, ids)
    assert "".join(pieces) == TEXT and tail == ""
    assert all("\ufffd" not in piece for piece in pieces)  # an incomplete character is held back, never sent
    for cut in range(1, len(ids)):  # an answer may end anywhere: inside a character, the tail says what decode says
        pieces, tail = streamed(tokenizer, ids[:cut])
        assert "".join(pieces) + tail == tokenizer.decode(ids[:cut], skip_special_tokens=True), cut


def test_random_token_streams_decode_as_a_whole(tokenizer):
    vocab = len(tokenizer.get_vocab())
    rng = random.Random(59)
    for _ in range(50):
        ids = [rng.randrange(vocab) for _ in range(40)]
        pieces, tail = streamed(tokenizer, ids)
        assert "".join(pieces) + tail == tokenizer.decode(ids, skip_special_tokens=True), ids
