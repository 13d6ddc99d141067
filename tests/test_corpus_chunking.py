"""Chunking with the real LLM tokenizer: limits, boundaries, offsets, exact token ids, content ids."""

from __future__ import annotations

import re

import pytest

from kvrag.corpus.chunking import ChunkConfig, Chunker, PassageTokenizer
from kvrag.corpus.documents import Document
from kvrag.errors import KvragError
from kvrag.model.prompt import render_passage
from kvrag.store.chunks import chunk_id_for

SENTENCES = [f"Sentence number {i} tells of the river {chr(65 + i % 26)}lm and its {i * 7} bridges." for i in range(120)]
PARAGRAPHS = "\n\n".join(" ".join(SENTENCES[i:i + 6]) for i in range(0, len(SENTENCES), 6))


@pytest.fixture(scope="module")
def passages(smol, smol_tokenizer) -> PassageTokenizer:
    return PassageTokenizer(smol_tokenizer, render_passage, smol.tokenizer_fingerprint)


def reference_ids(tokenizer, title: str, text: str) -> list[int]:
    return tokenizer(render_passage(title, text), add_special_tokens=False)["input_ids"]


def doc(text: str, title: str = "Rivers") -> Document:
    return Document(doc_id="/corpus/rivers.txt", title=title, text=text, source="/corpus/rivers.txt")


def test_a_passage_under_the_limit_is_one_chunk_with_the_prompts_token_ids(passages, smol_tokenizer):
    text = "  The Elm river has 42 bridges.\nIt floods in spring.  "
    pieces = Chunker(passages, ChunkConfig(512)).chunk(doc(text))
    assert len(pieces) == 1
    piece = pieces[0]
    assert piece.text == text.strip()
    assert text[piece.char_start:piece.char_end] == piece.text
    assert list(piece.token_ids) == reference_ids(smol_tokenizer, "Rivers", piece.text)


@pytest.mark.parametrize("limit, overlap", [(64, 0), (200, 0), (512, 0), (128, 32)])
def test_long_documents_split_within_the_limit_on_sentence_boundaries(passages, smol_tokenizer, limit, overlap):
    document = doc(PARAGRAPHS)
    pieces = Chunker(passages, ChunkConfig(limit, overlap)).chunk(document)
    assert len(pieces) > 1
    for piece in pieces:
        assert document.text[piece.char_start:piece.char_end] == piece.text
        assert list(piece.token_ids) == reference_ids(smol_tokenizer, "Rivers", piece.text)
        assert len(piece.token_ids) <= limit
        assert piece.text.endswith("bridges.")  # every sentence here fits: no cut mid-sentence
    starts = [p.char_start for p in pieces]
    assert starts == sorted(starts) and pieces[0].char_start == 0
    assert pieces[-1].char_end == len(document.text)
    if overlap:
        assert any(a.char_end > b.char_start for a, b in zip(pieces, pieces[1:], strict=False))
    else:  # the chunks cover the text exactly, up to the white space between them
        gaps = [document.text[a.char_end:b.char_start] for a, b in zip(pieces, pieces[1:], strict=False)]
        assert all(not gap.strip() for gap in gaps)
        assert sum(len(p.text) for p in pieces) + sum(len(g) for g in gaps) == len(document.text)


def test_paragraphs_are_preferred_over_sentences(passages):
    pieces = Chunker(passages, ChunkConfig(200)).chunk(doc(PARAGRAPHS))
    paragraph_ends = {m.start() for m in re.finditer("\n\n", PARAGRAPHS)} | {len(PARAGRAPHS)}
    on_paragraph = sum(p.char_end in paragraph_ends for p in pieces)
    assert on_paragraph >= len(pieces) - 1  # 200 tokens hold two paragraphs (~80 tokens each) whole


def test_one_long_sentence_is_still_cut_to_the_limit(passages, smol_tokenizer):
    words = " ".join(f"word{i}" for i in range(2000))
    pieces = Chunker(passages, ChunkConfig(100)).chunk(doc(words, title=""))
    assert all(len(p.token_ids) <= 100 for p in pieces)
    assert " ".join(p.text for p in pieces) == words


def test_a_huge_title_is_capped_so_text_still_fits(passages, smol_tokenizer):
    title = "Very long title " * 100
    pieces = Chunker(passages, ChunkConfig(64)).chunk(doc("Short text here.", title=title))
    assert len(pieces) == 1
    assert len(smol_tokenizer(pieces[0].title, add_special_tokens=False)["input_ids"]) <= 16
    assert title.startswith(pieces[0].title)
    assert list(pieces[0].token_ids) == reference_ids(smol_tokenizer, pieces[0].title, "Short text here.")


def test_chunk_ids_are_content_addresses_under_the_tokenizer_fingerprint(passages):
    chunker = Chunker(passages, ChunkConfig(512))
    a = chunker.chunk(Document("/a.txt", "T", "Same words.", "/a.txt"))[0]
    b = chunker.chunk(Document("/b.txt", "T", "\nSame words.\n", "/b.txt"))[0]
    c = chunker.chunk(Document("/c.txt", "T", "Other words.", "/c.txt"))[0]
    fp = passages.fingerprint
    assert chunk_id_for(a.token_ids, fp) == chunk_id_for(b.token_ids, fp)
    assert chunk_id_for(a.token_ids, fp) != chunk_id_for(c.token_ids, fp)
    assert chunk_id_for(a.token_ids, fp) != chunk_id_for(a.token_ids, fp + "x")
    assert re.fullmatch(r"[0-9a-f]{32}", chunk_id_for(a.token_ids, fp))


def test_passage_format_fingerprint_follows_render_passage(passages):
    other = PassageTokenizer(passages.tokenizer, lambda t, x: f"# {t}\n{x}", passages.fingerprint)
    assert passages.passage_format() != other.passage_format()


@pytest.mark.parametrize("tokens, overlap", [(8, 0), (512, -1), (512, 300)])
def test_bad_chunk_settings_are_user_errors(tokens, overlap):
    with pytest.raises(KvragError):
        ChunkConfig(tokens, overlap)
