"""Token-aware chunking with the LLM's own tokenizer, on paragraph/sentence boundaries (semchunk).

The limit counts the tokens of the chunk *as it stands in a prompt* (`render_passage(title, text)`),
which are the token ids stored with it: precompute and ask splice them in unchanged.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import semchunk

from kvrag.corpus.documents import Document
from kvrag.errors import KvragError

_MIN_CHUNK_TOKENS = 16
_PROBE = ("Probe title", "Probe text.")  # rendered to fingerprint the passage format


@dataclass(frozen=True)
class ChunkConfig:
    chunk_tokens: int = 512
    overlap: int = 0  # tokens shared by neighbouring chunks of a document

    def __post_init__(self) -> None:
        if self.chunk_tokens < _MIN_CHUNK_TOKENS:
            raise KvragError(f"--chunk-tokens must be at least {_MIN_CHUNK_TOKENS} (got {self.chunk_tokens})")
        if not 0 <= self.overlap <= self.chunk_tokens // 2:
            raise KvragError(f"--overlap must be between 0 and half of --chunk-tokens (got {self.overlap})")


@dataclass(frozen=True)
class PassageTokenizer:
    """The LLM tokenizer and the prompt's passage format, injected by the CLI."""

    tokenizer: Any  # a Hugging Face tokenizer: tokenizer(text, add_special_tokens=False).input_ids
    render_passage: Callable[[str, str], str]
    fingerprint: str  # of the tokenizer; part of every chunk id

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def passage_ids(self, title: str, text: str) -> list[int]:
        return self.encode(self.render_passage(title, text))

    def passage_format(self) -> str:
        probe = self.render_passage(*_PROBE)
        return hashlib.blake2b(probe.encode(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class Piece:
    """One chunk of a document: text[char_start:char_end] and its rendered passage's token ids."""

    title: str
    text: str
    char_start: int
    char_end: int
    token_ids: tuple[int, ...]


class Chunker:
    def __init__(self, passages: PassageTokenizer, config: ChunkConfig):
        self.passages = passages
        self.config = config
        # Per-instance memo: semchunk asks for the same spans' counts repeatedly.
        self._count: Callable[[str], int] = lru_cache(maxsize=1 << 16)(lambda s: len(passages.encode(s)))

    def chunk(self, doc: Document) -> list[Piece]:
        limit = self.config.chunk_tokens
        title = self._fit_title(doc.title)
        overhead = len(self.passages.passage_ids(title, ""))
        pieces: list[Piece] = []
        self._split(doc.text, 0, title, max(1, limit - overhead), self.config.overlap, pieces)
        return pieces

    def _split(self, text: str, base: int, title: str, budget: int, overlap: int, out: list[Piece]) -> None:
        spans = semchunk.chunk(text, budget, self._count, memoize=False, offsets=True,
                               overlap=overlap or None)[1]
        limit = self.config.chunk_tokens
        for start, end in spans:
            # semchunk returns a text that fits whole as is; render_passage strips, so strip here too.
            start += len(text[start:end]) - len(text[start:end].lstrip())
            end -= len(text[start:end]) - len(text[start:end].rstrip())
            if start >= end:
                continue
            piece = text[start:end]
            ids = self.passages.passage_ids(title, piece)
            if len(ids) <= limit:
                out.append(Piece(title, piece, base + start, base + end, tuple(ids)))
            elif budget > 1:
                # Rendering merged tokens differently than counting the parts, or an overlapped
                # chunk overshot: split this one again, tighter, without overlap.
                self._split(piece, base + start, title, max(1, budget - (len(ids) - limit)), 0, out)
            else:
                raise KvragError(f"cannot fit text into --chunk-tokens {limit}: {piece[:40]!r}")

    def _fit_title(self, title: str) -> str:
        """A title is repeated in every chunk: cap it at a quarter of the limit."""
        cap = self.config.chunk_tokens // 4
        ids = self.passages.encode(title)
        if len(ids) <= cap:
            return title
        return self.passages.tokenizer.decode(ids[:cap]).strip()
