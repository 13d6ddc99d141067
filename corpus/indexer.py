"""`kvrag index`: read files, chunk what is new or changed, embed what the index lacks, swap the index.

Order of writes, so that a crash at any point leaves a usable store:
1. new chunks and document records (LMDB transactions; existing chunks are never rewritten);
2. removed documents, and owners of shared chunks moved off them;
3. the new vector index (a new generation, made live by one os.replace);
4. chunks no document lists any more (only now: the previous index named them).
A re-run after a crash embeds whatever the live index lacks and drops leftover chunks.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Protocol

import numpy as np

from kvrag.corpus.chunking import ChunkConfig, Chunker, PassageTokenizer
from kvrag.corpus.documents import EMPTY, Document, ReadResult, Skipped
from kvrag.corpus.sources import JsonFields, read_path
from kvrag.corpus.vector_index import VectorIndex, check_factory, choose_factory, index_bytes, writer_lock
from kvrag.errors import KvragError
from kvrag.store.chunks import ChunkRecord, ChunkTable, DocChunk, DocRecord, IndexConfig, chunk_id_for
from kvrag.store.env import StoreEnv, is_store

_FLUSH_CHUNKS = 2048  # chunks per write transaction while chunking

class Progress(Protocol):
    def start(self, stage: str, total: int) -> None: ...
    def advance(self, stage: str, n: int = 1) -> None: ...


class NoProgress:
    def start(self, stage: str, total: int) -> None: ...
    def advance(self, stage: str, n: int = 1) -> None: ...


class EmbedderLike(Protocol):
    fingerprint: str
    dim: int

    def embed(self, texts: list[str], advance=None) -> np.ndarray: ...


@dataclass(frozen=True)
class IndexOptions:
    chunking: ChunkConfig = field(default_factory=ChunkConfig)
    fields: JsonFields = field(default_factory=JsonFields)
    prune: bool = False  # drop documents of earlier runs that this run did not read
    rechunk: bool = False  # accept new chunking settings: re-chunk everything read, drop the rest
    index_factory: str | None = None  # None: keep the store's choice; "auto": automatic


@dataclass
class IndexSummary:
    store: str
    files: int
    documents: int  # in the store after the run
    docs_new: int
    docs_changed: int
    docs_unchanged: int
    docs_removed: int
    chunks: int  # distinct chunks in the store
    chunks_new: int
    chunks_removed: int
    tokens: int  # LLM tokens over the distinct chunks, as rendered in a prompt
    tokens_new: int
    embedded: int
    merged_duplicates: int
    skipped: list[Skipped]
    index_type: str
    index_bytes: int
    seconds: float

    def skipped_by_reason(self) -> dict[str, int]:
        return dict(Counter(s.reason for s in self.skipped).most_common())

    def to_json(self) -> dict:
        data = asdict(self)
        data["skipped_by_reason"] = self.skipped_by_reason()
        return data


def index_corpus(files: list[Path], store_dir: Path, passages: PassageTokenizer, embedder: EmbedderLike,
                 options: IndexOptions, progress: Progress | None = None) -> IndexSummary:
    progress = progress or NoProgress()
    started = time.perf_counter()
    store_dir = Path(store_dir).expanduser()
    config = IndexConfig(passages.fingerprint, passages.passage_format(), options.chunking.chunk_tokens,
                         options.chunking.overlap, embedder.fingerprint)
    if options.index_factory not in (None, "auto"):
        check_factory(options.index_factory, embedder.dim)
    if is_store(store_dir):  # refuse other chunking settings before reading anything
        with StoreEnv.open(store_dir, readonly=True) as env:
            _check_config(ChunkTable(env).read_config(), config, options, store_dir)
    elif store_dir.is_dir() and any(store_dir.iterdir()):
        raise KvragError(f"{store_dir} is not empty and is not a kvrag store; choose another --store")

    read = ReadResult()
    progress.start("reading", len(files))
    for path in files:
        read.extend(read_path(path, options.fields))
        progress.advance("reading")
    if not read.documents:
        reasons = ", ".join(f"{n} {r}" for r, n in Counter(s.reason for s in read.skipped).items())
        raise KvragError(f"nothing to index in {len(files)} file(s)" + (f" (skipped: {reasons})" if reasons else ""))

    with StoreEnv.open(store_dir, create=True) as env, writer_lock(store_dir):
        table = ChunkTable(env)
        old_config = table.read_config()
        _check_config(old_config, config, options, store_dir)
        factory = options.index_factory
        if factory is None:
            factory = old_config.index_factory if old_config else ""
        config = replace(config, index_factory="" if factory == "auto" else factory,
                         index_type=old_config.index_type if old_config else "")
        table.write_config(config)
        run = _Run(table, config, Chunker(passages, options.chunking), progress, options)
        summary = run.execute(read, store_dir, embedder)
        table.write_config(replace(config, index_type=summary.index_type))
    summary.files = len(files)
    summary.seconds = round(time.perf_counter() - started, 3)
    return summary


def _check_config(old: IndexConfig | None, new: IndexConfig, options: IndexOptions, store_dir: Path) -> None:
    if old is None or options.rechunk:
        return
    differences = new.chunking_differences(old)
    if differences:
        raise KvragError(
            f"{store_dir} was chunked with other settings ({'; '.join(differences)}); "
            "use --rechunk to re-chunk the documents given (new chunk ids, so their KV is computed again) "
            "and drop the others, or use another --store"
        )


def _content_hash(doc: Document, chunking_hash: str) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for part in (chunking_hash, doc.title, doc.text):
        digest.update(part.encode("utf-8", "surrogatepass") + b"\0")
    return digest.hexdigest()


class _Run:
    """One indexing run over an open store (holding the writer lock)."""

    def __init__(self, table: ChunkTable, config: IndexConfig, chunker: Chunker, progress: Progress,
                 options: IndexOptions):
        self.table, self.config, self.chunker, self.progress, self.options = table, config, chunker, progress, options

    def execute(self, read: ReadResult, store_dir: Path, embedder: EmbedderLike) -> IndexSummary:
        old_docs = self.table.docs()
        chunks_before = self.table.ids()
        skipped = list(read.skipped)

        # 1. Chunk new and changed documents; store them in batches.
        chunking_hash = self.config.chunking_hash()
        live: dict[str, DocRecord] = {}
        to_chunk: list[tuple[Document, str]] = []
        for doc in read.documents:
            content_hash = _content_hash(doc, chunking_hash)
            old = old_docs.get(doc.doc_id)
            if old is not None and old.content_hash == content_hash:
                live[doc.doc_id] = old
            else:
                to_chunk.append((doc, content_hash))
        unchanged = len(live)
        rechunked = self._chunk_and_store(to_chunk, skipped)
        live.update(rechunked)
        changed = sum(1 for doc_id in rechunked if doc_id in old_docs)

        # 2. Documents of earlier runs not read now stay, unless pruning; then drop what is gone.
        if not (self.options.prune or self.options.rechunk):
            for doc_id, old in old_docs.items():
                live.setdefault(doc_id, old)
        removed = [doc_id for doc_id in old_docs if doc_id not in live]
        candidates = {c.chunk_id for doc_id in removed for c in old_docs[doc_id].chunks}
        candidates |= {c.chunk_id for doc_id in rechunked if doc_id in old_docs for c in old_docs[doc_id].chunks}
        self.table.remove_docs(removed, _owners(candidates, live))

        # 3. Embed what the live index lacks and make a new generation live.
        tokens_of = {c.chunk_id: c.n_tokens for doc in live.values() for c in doc.chunks}
        index, embedded = self._update_index(store_dir, list(tokens_of), embedder)

        # 4. Only now delete chunks no document lists.
        dropped = self.table.delete_unreferenced(set(tokens_of))
        new_ids = set(tokens_of) - chunks_before
        return IndexSummary(
            store=str(store_dir), files=0, documents=len(live),
            docs_new=len(rechunked) - changed, docs_changed=changed, docs_unchanged=unchanged,
            docs_removed=len(removed), chunks=len(tokens_of), chunks_new=len(new_ids),
            chunks_removed=len(dropped), tokens=sum(tokens_of.values()),
            tokens_new=sum(tokens_of[i] for i in new_ids), embedded=embedded,
            merged_duplicates=read.merged_duplicates, skipped=skipped, index_type=index.factory,
            index_bytes=index_bytes(store_dir), seconds=0.0,
        )

    def _chunk_and_store(self, to_chunk: list[tuple[Document, str]], skipped: list[Skipped]) -> dict[str, DocRecord]:
        fingerprint = self.config.tokenizer_fingerprint
        done: dict[str, DocRecord] = {}
        batch: list[tuple[DocRecord, list[ChunkRecord]]] = []
        pending = 0
        self.progress.start("chunking", len(to_chunk))
        for doc, content_hash in to_chunk:
            pieces = self.chunker.chunk(doc)
            self.progress.advance("chunking")
            if not pieces:
                skipped.append(Skipped(doc.source, EMPTY, "no text to chunk"))
                continue
            records = [ChunkRecord(chunk_id_for(p.token_ids, fingerprint), doc.doc_id, p.title, p.text,
                                   p.char_start, p.char_end, p.token_ids) for p in pieces]
            record = DocRecord(doc.doc_id, doc.source, doc.title, content_hash, tuple(
                DocChunk(r.chunk_id, r.char_start, r.char_end, len(r.token_ids)) for r in records))
            done[doc.doc_id] = record
            batch.append((record, records))
            pending += len(records)
            if pending >= _FLUSH_CHUNKS:
                self.table.put_docs(batch)
                batch, pending = [], 0
        if batch:
            self.table.put_docs(batch)
        return done

    def _update_index(self, store_dir: Path, target: list[str], embedder: EmbedderLike) -> tuple[VectorIndex, int]:
        previous = VectorIndex.load(store_dir)
        if previous is not None and previous.embedder != embedder.fingerprint:
            previous = None  # vectors of another model: embed everything again
        factory = choose_factory(len(target), self.config.index_factory or None, dim=embedder.dim)
        old_rows = {chunk_id: row for row, chunk_id in enumerate(previous.ids)} if previous else {}
        missing = [chunk_id for chunk_id in target if chunk_id not in old_rows]
        if previous is not None and not missing and len(target) == len(previous.ids) and previous.factory == factory:
            return previous, 0  # nothing changed: leave the live generation alone
        vectors = np.empty((len(target), embedder.dim), dtype=np.float32)  # [n, dim]
        new = np.array([chunk_id not in old_rows for chunk_id in target], dtype=bool)  # [n], in `missing`'s order
        vectors[new] = self._embed(missing, embedder)
        if previous is not None:
            vectors[~new] = previous.vectors[[old_rows[chunk_id] for chunk_id in target if chunk_id in old_rows]]
        self.progress.start("indexing", len(target))
        reported = [0]

        def advance(added: int, _total: int) -> None:  # the build reports totals; the bar takes steps
            self.progress.advance("indexing", added - reported[0])
            reported[0] = added

        index = VectorIndex.build(target, vectors, factory, embedder.fingerprint, previous=previous, progress=advance)
        index.save(store_dir)
        return index, len(missing)

    def _embed(self, chunk_ids: list[str], embedder: EmbedderLike, batch: int = 1024) -> np.ndarray:
        self.progress.start("embedding", len(chunk_ids))
        parts = []
        for start in range(0, len(chunk_ids), batch):  # read texts a batch at a time: bounded memory
            chunks = self.table.get_many(chunk_ids[start:start + batch])
            texts = [f"{c.title}\n{c.text}" if c.title else c.text for c in chunks]
            parts.append(embedder.embed(texts, advance=lambda n: self.progress.advance("embedding", n)))
        return np.concatenate(parts) if parts else np.empty((0, embedder.dim), dtype=np.float32)


def _owners(candidates: set[str], live: dict[str, DocRecord]) -> dict[str, list[DocRecord]]:
    """For chunks whose document went or changed: the live documents that still list them."""
    owners: dict[str, list[DocRecord]] = {}
    for doc in live.values():
        for c in doc.chunks:
            if c.chunk_id in candidates:
                owners.setdefault(c.chunk_id, []).append(doc)
    return owners
