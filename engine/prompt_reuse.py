"""Reuse for any prompt: the stored passages a client's own prompt carries, cut out as chunks to blend.

A plain prompt (chat or completion, no retrieval of ours) is rendered to ids, and the store's passage index
(store/passage_index.py) finds the runs of them that are stored chunks, whatever template surrounds them. The prompt
becomes

    head   the ids before the first stored span: an exact prefix (block-cached: engine/conversations.py)
    pieces each stored span (its rows of the chunk's stored KV, blended as retrieved chunks are), and between two
           spans the prompt's own text (a separator, a source marker, a passage not stored): computed at every
           layer, as the suffix is
    tail   the ids after the last span (the question and the template's end): computed

A prompt with no stored span is a head cut at a block boundary and a short tail, so the prefix cache serves what it
shares with earlier prompts (a system prompt, a conversation's head).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from kvrag.model.prompt import encode
from kvrag.store.chunks import CLIENT_DOC, ChunkTable
from kvrag.store.env import StoreEnv
from kvrag.store.passage_index import PassageIndex, Span

PROMPT_TIER = "prompt"  # a piece of the prompt's own text: computed, never loaded
# a paragraph this long (between line breaks or tags) is a passage, not a question: LangChain's, LlamaIndex's and
# Open WebUI's templates put each passage on lines or in tags of its own
PASSAGE_TOKENS = 48
_BREAKS = re.compile(r"\n|</?[A-Za-z_][^<>\n]{0,80}>")


@dataclass(frozen=True)
class Piece:
    """What one chunk of a plan is: rows offset.. of a stored chunk (its whole ids `stored`), or, with chunk_id
    None, prompt text computed at every layer."""

    chunk_id: str | None
    offset: int = 0
    stored: tuple[int, ...] = ()


@dataclass(frozen=True)
class Split:
    head: tuple[int, ...]
    chunks: tuple[tuple[str, tuple[int, ...]], ...]  # (a name for the piece, its ids in the prompt)
    pieces: tuple[Piece, ...]
    tail: tuple[int, ...]


class PromptSpans:
    """The store's passage index, filled from its chunk table at first use (and by `add` as passages are kept)."""

    def __init__(self, env: StoreEnv | None):
        self.env, self.index = env, PassageIndex()
        self.kept: dict[str, tuple[str, int]] = {}  # the clients' kept passages in the store: chunk id: (salt, tokens)
        self._indexed = -1  # the chunk table's count when it was last indexed
        self._lock = threading.Lock()
        self._closed = False

    def find(self, ids: Sequence[int], salt: str = "") -> list[Span]:
        """The stored spans of a prompt's ids that a request of this salt may reuse."""
        self.fill()
        return self.index.find(ids, salt)

    def add(self, chunk_id: str, ids: Sequence[int], salt: str = "") -> None:
        """Index a passage kept from a client's prompts (under its salt), its record just written."""
        with self._lock:
            if self._indexed < 0:  # the table not indexed yet: its first fill indexes the record with the rest
                return
            if not self.index.knows(chunk_id, salt):
                self.kept[chunk_id] = (salt, len(ids))
                self.index.add(chunk_id, ids, salt)
                self._indexed += 1  # the record this adds to the table: no need to read the table again for it

    def remove(self, chunk_id: str) -> None:
        """Forget a kept passage before its record goes (engine/admission.py evicts it): no plan finds it again."""
        with self._lock:
            if chunk_id in self.kept:
                salt, _ = self.kept.pop(chunk_id)
                self.index.remove(chunk_id, salt)
                self._indexed -= 1  # the record that goes with it

    def kept_passages(self) -> dict[str, tuple[str, int]]:
        """A copy of `kept` (any thread)."""
        with self._lock:
            return dict(self.kept)

    def fill(self) -> None:
        """Index the store's chunks (KVRag starts it beside the model's load), and later the ones indexed since: a
        prompt looks at the chunk table's count (an LMDB stat) and indexes again only when it has grown."""
        if self.env is None:
            return
        with self._lock:
            if self._closed:
                return
            count = ChunkTable(self.env).count()
            if count == self._indexed:
                return
            self.index.add_many(self._records())
            self._indexed = count

    def close(self) -> None:
        """Stop indexing before the store closes: a fill under way stops at its next record, and none starts."""
        self._closed = True
        with self._lock:  # waits out the fill under way, so that nothing reads the store once this returns
            pass

    def _records(self):
        """(chunk id, ids, salt) of the store's chunks not indexed yet: a passage kept from a client's prompts carries
        its salt."""
        for r in list(ChunkTable(self.env).iter()):  # read first: a long read transaction would hold up a map resize
            if self._closed:
                return
            client = r.doc_id.startswith(CLIENT_DOC)
            salt = r.doc_id[len(CLIENT_DOC):] if client else ""
            if not self.index.knows(r.chunk_id, salt):
                if client:
                    self.kept[r.chunk_id] = (salt, len(r.token_ids))
                yield r.chunk_id, r.token_ids, salt


def split(ids: Sequence[int], spans: Sequence[Span], index: PassageIndex) -> Split | None:
    """The prompt cut around its stored spans (see the module doc); None when it has none. The tail keeps at least
    one token: the prompt's last row is the one whose logits are read."""
    ids = tuple(ids)
    spans = list(spans)
    if spans and spans[-1].end >= len(ids):
        last = spans[-1]
        spans[-1] = Span(last.start, last.chunk_id, last.offset, len(ids) - 1 - last.start)
    spans = [s for s in spans if s.length > 0]
    if not spans:
        return None
    chunks, pieces, at = [], [], spans[0].start
    for span in spans:
        if span.start > at:  # the prompt's own text between two stored spans
            chunks.append((f"prompt[{at}:{span.start}]", ids[at:span.start]))
            pieces.append(Piece(None))
        stored = index.token_ids(span.chunk_id)
        whole = span.offset == 0 and span.length == len(stored)
        name = span.chunk_id if whole else f"{span.chunk_id}[{span.offset}:{span.offset + span.length}]"
        chunks.append((name, ids[span.start:span.end]))
        pieces.append(Piece(span.chunk_id, span.offset, stored))
        at = span.end
    return Split(ids[:spans[0].start], tuple(chunks), tuple(pieces), ids[at:])


def carries_passages(planner, question: str, history: Sequence[tuple[str, str]], salt: str = "") -> bool:
    """Whether a request's messages (not the model's earlier answers) hold passages of their own: a paragraph of
    PASSAGE_TOKENS or more, or a stored chunk's text. `planner`: the engine's (engine/plans.py: its runtime's
    tokenizer, its spans)."""
    tokenizer, spans = planner.runtime.tokenizer, planner.spans
    texts = client_texts(question, history)
    return passage_like(tokenizer, texts) or bool(stored_spans(tokenizer, spans, texts, salt))


def client_texts(question: str, history: Sequence[tuple[str, str]]) -> list[str]:
    """What the client wrote: the question and every earlier message but the model's answers."""
    return [question, *(text for who, text in history if who != "assistant")]


def passage_like(tokenizer, texts: Sequence[str]) -> bool:
    """Whether any paragraph of `texts` (between line breaks or tags) is PASSAGE_TOKENS long or more."""
    return any(len(encode(tokenizer, part)) >= PASSAGE_TOKENS
               for text in texts for part in _BREAKS.split(text) if part.strip())


def stored_spans(tokenizer, spans: PromptSpans | None, texts: Sequence[str], salt: str = "") -> list[Span]:
    """The stored passages found in `texts` (joined by line breaks), as the engine finds them in a prompt."""
    return [] if spans is None else spans.find(encode(tokenizer, "\n".join(texts)), salt)
