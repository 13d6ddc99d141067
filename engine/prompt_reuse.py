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

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvrag.model.chat import ChatPrompts
from kvrag.store.chunks import CLIENT_DOC, ChunkTable
from kvrag.store.env import StoreEnv
from kvrag.store.passage_index import PassageIndex, Span

PROMPT_TIER = "prompt"  # a piece of the prompt's own text: computed, never loaded
FIND_ENTRIES = 4  # change-log entries a prompt's probe indexes at most (store/chunk_log.py: 512 chunks each)
PASSAGE_TOKENS = 48  # a run of a prompt's ids this long between breaks is a passage (Paragraphs)
_BREAK = frozenset("\n<>")  # a token holding one of these ends a run: a line break, a tag's bracket


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
    """The store's passage index: filled from its chunk table at first use, then kept up to date from the table's
    change log (store/chunk_log.py), whichever process changed it, and by `add`/`remove` as this one keeps passages."""

    def __init__(self, env: StoreEnv | None, evicted_elsewhere: Callable[[str], None] | None = None):
        self.env, self.index = env, PassageIndex()
        self.evicted_elsewhere = evicted_elsewhere  # told of a kept passage another process evicted (its KV gone)
        self.kept: dict[str, tuple[str, int]] = {}  # the clients' kept passages in the store: chunk id: (salt, tokens)
        self._seen = -1  # the change log's entry read last (-1: the table not indexed yet)
        self._lock = threading.Lock()
        self._closed = False

    def find(self, ids: Sequence[int], salt: str = "") -> list[Span]:
        """The stored spans of a prompt's ids that a request of this salt may reuse (the log's news read first, a
        few entries a prompt: another process's big write is indexed over the next prompts, not in one stall)."""
        self.fill(FIND_ENTRIES)
        return self.index.find(ids, salt)

    def add(self, chunk_id: str, ids: Sequence[int], salt: str = "") -> None:
        """Index a passage kept from a client's prompts (under its salt), its record just written."""
        with self._lock:
            if self._seen < 0:  # the table not indexed yet: its first fill indexes the record with the rest
                return
            self._add(chunk_id, ids, salt, kept=True)

    def remove(self, chunk_id: str) -> None:
        """Forget a kept passage before its record goes (engine/kept_passages.py evicts it): no plan finds it again."""
        with self._lock:
            self._remove(chunk_id)

    def kept_passages(self) -> dict[str, tuple[str, int]]:
        """A copy of `kept` (any thread)."""
        with self._lock:
            return dict(self.kept)

    def fill(self, limit: int | None = None) -> None:
        """Index what the store's chunk table gained or lost since the last look (all of it the first time: KVRag
        starts that beside the model's load): at most `limit` log entries (None: all); a prompt reads the log's head
        (one LMDB read) and nothing more when it has not moved."""
        if self.env is None:
            return
        with self._lock:
            if self._closed:
                return
            table = ChunkTable(self.env)
            changes, records = table.changes(self._seen, limit) if self._seen >= 0 else (None, {})  # []: no news
            if changes is None:  # first use, or this process fell behind the log's trimmed start
                head = table.log_head()  # before the read: a change made meanwhile is read again, to no effect
                self.index.add_many(self._records())
                self._seen = head
                return
            for change in changes:
                for chunk_id in change.chunk_ids:
                    if change.added:
                        if (record := records.get(chunk_id)) is not None:  # None: deleted again since
                            self._add(chunk_id, record.token_ids, *_owner(record.doc_id))
                    elif self._remove(chunk_id) and self.evicted_elsewhere is not None:
                        self.evicted_elsewhere(chunk_id)  # a copy a prompt here computes is not stored back
                self._seen = change.number

    def close(self) -> None:
        """Stop indexing before the store closes: a fill under way stops at its next record, and none starts."""
        self._closed = True
        with self._lock:  # waits out the fill under way, so that nothing reads the store once this returns
            pass

    def _add(self, chunk_id: str, ids: Sequence[int], salt: str, kept: bool) -> None:
        if not self.index.knows(chunk_id, salt):
            if kept:
                self.kept[chunk_id] = (salt, len(ids))
            self.index.add(chunk_id, ids, salt)

    def _remove(self, chunk_id: str) -> bool:
        """Forget a chunk (a corpus chunk `store gc` dropped, or a kept passage); whether it was a kept passage."""
        salt, tokens = self.kept.pop(chunk_id, ("", 0))
        self.index.remove(chunk_id, salt)
        return tokens > 0

    def _records(self):
        """(chunk id, ids, salt) of the store's chunks not indexed yet: a passage kept from a client's prompts carries
        its salt."""
        for r in list(ChunkTable(self.env).iter()):  # read first: a long read transaction would hold up a map resize
            if self._closed:
                return
            salt, kept = _owner(r.doc_id)
            if not self.index.knows(r.chunk_id, salt):
                if kept:
                    self.kept[r.chunk_id] = (salt, len(r.token_ids))
                yield r.chunk_id, r.token_ids, salt


def _owner(doc_id: str) -> tuple[str, bool]:
    """The salt a chunk is found under (a kept passage's tenant's, "" for the corpus), and whether it is a kept
    passage."""
    kept = doc_id.startswith(CLIENT_DOC)
    return (doc_id[len(CLIENT_DOC):] if kept else ""), kept


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


@dataclass(frozen=True)
class PromptFound:
    """A plain prompt rendered once (request_chunks.py, or the engine for a request that came without it): its ids
    and the stored spans found in them for its salt. The engine plans from these, tokenizing and probing nothing
    again."""

    ids: tuple[int, ...]
    spans: tuple[Span, ...]


class Paragraphs:
    """The one rule for "a passage" in a prompt's ids: a run between break tokens (a token whose text holds a line
    break or a tag's bracket) PASSAGE_TOKENS long or more. LangChain's, LlamaIndex's and Open WebUI's templates put
    each passage on lines or in tags of its own, so a run that long is a passage, not a question or a template's
    glue. Used to decide whether a client's prompt carries passages, and to find the ones worth keeping."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer  # fast (its Rust tokenizer reads the vocabulary at once)
        self._breaks: frozenset[int] | None = None
        self._lock = threading.Lock()

    def runs(self, ids: Sequence[int], skip: int = 0) -> list[tuple[int, int]]:
        """(start, end) of each passage of `ids`: a run between breaks with PASSAGE_TOKENS of it at or past `skip`
        (what a prompt computed, past the rows the prefix cache served)."""
        breaks, out, start = self.breaks(), [], 0
        for i, token in enumerate([*ids, None]):
            if token is None or token in breaks:
                if i - max(start, skip) >= PASSAGE_TOKENS:
                    out.append((start, i))
                start = i + 1
        return out

    def breaks(self) -> frozenset[int]:
        with self._lock:
            if self._breaks is None:
                rust = self.tokenizer.backend_tokenizer  # one batched call: per-id decodes take a second
                vocab = range(rust.get_vocab_size(with_added_tokens=True))
                texts = rust.decode_batch([[i] for i in vocab], skip_special_tokens=False)
                self._breaks = frozenset(i for i, t in zip(vocab, texts, strict=True) if _BREAK.intersection(t))
            return self._breaks


def find_in_prompt(chat: ChatPrompts, spans: PromptSpans | None, history: Sequence[tuple[str, str]], question: str,
                   role: str = "user", salt: str = "", probe: bool = True) -> PromptFound:
    """Render a plain prompt (the template over the history and the question) and find its stored spans (where
    `probe`)."""
    ids = chat.plain_ids(history, question, role)
    return PromptFound(tuple(ids), tuple(spans.find(ids, salt)) if probe and spans is not None else ())


def carries_passages(paragraphs: Paragraphs, found: PromptFound, question: str,
                     history: Sequence[tuple[str, str]]) -> bool:
    """Whether the client's own messages (not the model's earlier answers) hold passages: a stored span or a
    passage-like run of the prompt whose text one of them holds."""
    texts = [question, *(text for who, text in history if who != "assistant")]

    def written(start: int, end: int) -> bool:  # a run cut inside a character decodes to U+FFFD at its ends
        text = paragraphs.tokenizer.decode(list(found.ids[start:end])).strip(" \n\ufffd")
        return bool(text) and any(text in t for t in texts)

    return (any(written(s.start, s.end) for s in found.spans)
            or any(written(a, b) for a, b in paragraphs.runs(found.ids)))
