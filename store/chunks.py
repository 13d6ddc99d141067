"""Chunk and document records in the store's `chunks` and `docs` databases, and the index config.

A chunk's id is a content address: blake2b of its token ids under the tokenizer's fingerprint, so an
identical chunk is stored once and an unchanged chunk keeps its id (and its KV) across re-indexing.
Value layout of a chunk: b"KC" + version byte + u32 JSON length + JSON metadata + token ids as
little-endian int32. A document record lists its chunks; a chunk lives while some document lists it.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, fields, replace

import lmdb

from kvrag.errors import KvragError
from kvrag.store import chunk_log
from kvrag.store.env import StoreEnv

_CHUNK_MAGIC = b"KC\x01"
_HEADER = struct.Struct("<I")
INDEX_CONFIG_KEY = b"index_config"


def _le_int32(token_ids: Iterable[int]) -> bytes:
    ids = array("i", token_ids)
    if sys.byteorder == "big":  # the store is little-endian everywhere
        ids.byteswap()
    return ids.tobytes()


def chunk_id_for(token_ids: Iterable[int], tokenizer_fingerprint: str) -> str:
    """The content address of a chunk: 128-bit blake2b, hex."""
    digest = hashlib.blake2b(digest_size=16, person=b"kvrag-chunk")
    digest.update(tokenizer_fingerprint.encode() + b"\0")
    digest.update(_le_int32(token_ids))
    return digest.hexdigest()


@dataclass(frozen=True)
class ChunkRecord:
    chunk_id: str  # hex content address
    doc_id: str  # the document it was first read from (another, if that one goes)
    title: str
    text: str  # exactly the document's text[char_start:char_end]
    char_start: int
    char_end: int
    token_ids: tuple[int, ...]  # tokenizer(render_passage(title, text)): spliced into prompts as is

    def to_bytes(self) -> bytes:
        meta = json.dumps(
            {"doc": self.doc_id, "title": self.title, "text": self.text,
             "start": self.char_start, "end": self.char_end},
            ensure_ascii=False, separators=(",", ":"),
        ).encode()
        return _CHUNK_MAGIC + _HEADER.pack(len(meta)) + meta + _le_int32(self.token_ids)

    @classmethod
    def from_bytes(cls, chunk_id: str, raw: bytes) -> ChunkRecord:
        if raw[:3] != _CHUNK_MAGIC:
            raise KvragError(f"chunk {chunk_id} has an unknown format; re-index with --rechunk")
        (size,) = _HEADER.unpack_from(raw, 3)
        meta = json.loads(raw[7:7 + size])
        ids = array("i")
        ids.frombytes(raw[7 + size:])
        if sys.byteorder == "big":
            ids.byteswap()
        return cls(chunk_id, meta["doc"], meta["title"], meta["text"], meta["start"], meta["end"],
                   tuple(ids))


@dataclass(frozen=True)
class DocChunk:
    chunk_id: str
    char_start: int
    char_end: int
    n_tokens: int


@dataclass(frozen=True)
class DocRecord:
    doc_id: str
    source: str
    title: str
    content_hash: str  # of title, text and the chunking settings: equal hash, nothing to redo
    chunks: tuple[DocChunk, ...]

    def to_bytes(self) -> bytes:
        return json.dumps(
            {"doc": self.doc_id, "source": self.source, "title": self.title, "hash": self.content_hash,
             "chunks": [[c.chunk_id, c.char_start, c.char_end, c.n_tokens] for c in self.chunks]},
            ensure_ascii=False, separators=(",", ":"),
        ).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> DocRecord:
        d = json.loads(raw)
        return cls(d["doc"], d["source"], d["title"], d["hash"], tuple(DocChunk(*c) for c in d["chunks"]))


CLIENT_DOC = "client:"  # the doc id of a passage kept from a client's prompt (engine/kept_passages.py): this + its salt


def _chunk_key(chunk_id: str) -> bytes | None:
    """The LMDB key of a chunk id, None for a string that is no chunk id (a user's typo)."""
    try:
        key = bytes.fromhex(chunk_id)
    except ValueError:
        return None
    return key if len(key) == 16 else None


def _doc_key(doc_id: str) -> bytes:
    # Hashed: paths plus record ids can exceed LMDB's 511-byte key limit.
    return hashlib.blake2b(doc_id.encode(), digest_size=16).digest()


@dataclass(frozen=True)
class IndexConfig:
    """Settings a store was indexed with. Chunking settings fix the token ids, hence the chunk ids."""

    tokenizer_fingerprint: str
    passage_format: str  # hash of render_passage's output on a probe: a new format means new token ids
    chunk_tokens: int
    overlap: int
    embedder: str = ""
    index_factory: str = ""  # the user's --index-factory, kept for later runs; "" = automatic
    index_type: str = ""  # the faiss factory string of the index built last

    CHUNKING = ("tokenizer_fingerprint", "passage_format", "chunk_tokens", "overlap")

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1 or self.overlap < 0:
            raise ValueError(f"bad chunking settings: {self.chunk_tokens=} {self.overlap=}")

    def chunking_differences(self, other: IndexConfig) -> list[str]:
        return [f"{name} {getattr(other, name)!r} -> {getattr(self, name)!r}"
                for name in self.CHUNKING if getattr(self, name) != getattr(other, name)]

    def chunking_hash(self) -> str:
        key = json.dumps([getattr(self, name) for name in self.CHUNKING])
        return hashlib.blake2b(key.encode(), digest_size=8).hexdigest()

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> IndexConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in json.loads(raw).items() if k in known})


class ChunkTable:
    """Chunks and documents of one store. Reads are snapshots; each write method is one transaction."""

    def __init__(self, env: StoreEnv):
        self.env = env
        self._chunks = env.db("chunks")
        self._docs = env.db("docs")
        self._meta = env.db("meta")

    # -- chunks -----------------------------------------------------------------------------------
    def get(self, chunk_id: str) -> ChunkRecord | None:
        key = _chunk_key(chunk_id)
        raw = None if key is None else self.env.read(lambda txn: txn.get(key, db=self._chunks))
        return None if raw is None else ChunkRecord.from_bytes(chunk_id, raw)

    def get_many(self, ids: Iterable[str]) -> list[ChunkRecord]:
        """Records in the order of `ids`, read in one transaction. An id not in the store (or not a
        chunk id at all) is a KvragError naming it: never a silent gap in the list."""
        ids = list(ids)

        def fetch(txn: lmdb.Transaction) -> list[bytes | None]:
            keys = [_chunk_key(i) for i in ids]
            return [None if k is None else txn.get(k, db=self._chunks) for k in keys]

        records = []
        for chunk_id, raw in zip(ids, self.env.read(fetch), strict=True):
            if raw is None:
                raise KvragError(f"chunk {chunk_id} is not in the store at {self.env.path}")
            records.append(ChunkRecord.from_bytes(chunk_id, raw))
        return records

    def ids(self) -> set[str]:
        with self.env.reader() as txn:
            return {key.hex() for key in txn.cursor(db=self._chunks).iternext(keys=True, values=False)}

    def iter(self) -> Iterator[ChunkRecord]:
        with self.env.reader() as txn:
            for key, raw in txn.cursor(db=self._chunks):
                yield ChunkRecord.from_bytes(key.hex(), bytes(raw))

    def count(self) -> int:
        return self.env.read(lambda txn: txn.stat(self._chunks)["entries"])

    def log_head(self) -> int:
        """The chunk log's last entry (store/chunk_log.py): it moves whenever a chunk is added or deleted."""
        return self.env.read(lambda txn: chunk_log.head(txn, self._meta))

    def changes(self, after: int, limit: int | None = None) -> tuple[list[chunk_log.Change] | None, dict]:
        """The log's entries after `after` (at most `limit`; None: trimmed, read the whole table) and, read in the same
        snapshot, the records of the chunks they added that are still stored (chunk id: ChunkRecord)."""
        def read(txn: lmdb.Transaction):
            changes = chunk_log.since(txn, self._meta, after, limit)
            records = {}
            for change in changes or ():
                for chunk_id in change.chunk_ids if change.added else ():
                    raw = txn.get(bytes.fromhex(chunk_id), db=self._chunks)
                    if raw is not None:
                        records[chunk_id] = ChunkRecord.from_bytes(chunk_id, bytes(raw))
            return changes, records

        return self.env.read(read)

    def trim_log(self, keep: int = chunk_log.KEEP_ENTRIES) -> int:
        return self.env.write(lambda txn: chunk_log.trim(txn, self._meta, keep))

    # -- documents --------------------------------------------------------------------------------
    def docs(self) -> dict[str, DocRecord]:
        with self.env.reader() as txn:
            records = (DocRecord.from_bytes(bytes(raw)) for _, raw in txn.cursor(db=self._docs))
            return {r.doc_id: r for r in records}

    def put_docs(self, items: list[tuple[DocRecord, list[ChunkRecord]]]) -> int:
        """Store documents with their chunks; a chunk already stored is left untouched.

        Returns how many chunks were new.
        """

        def put(txn: lmdb.Transaction) -> int:
            added = []
            for doc, chunks in items:
                for chunk in chunks:
                    key = bytes.fromhex(chunk.chunk_id)
                    if txn.put(key, chunk.to_bytes(), db=self._chunks, overwrite=False):
                        added.append(key)
                txn.put(_doc_key(doc.doc_id), doc.to_bytes(), db=self._docs)
            chunk_log.record(txn, self._meta, chunk_log.ADDED, added)
            return len(added)

        return self.env.write(put)

    def put_records(self, records: Iterable[ChunkRecord]) -> int:
        """Chunks that belong to no document (passages kept from clients' prompts); one already stored is left."""
        items = [(bytes.fromhex(r.chunk_id), r.to_bytes()) for r in records]  # a list: `write` may run again

        def put(txn: lmdb.Transaction) -> int:
            added = [k for k, v in items if txn.put(k, v, db=self._chunks, overwrite=False)]
            chunk_log.record(txn, self._meta, chunk_log.ADDED, added)
            return len(added)

        return self.env.write(put)

    def remove_docs(self, doc_ids: Iterable[str], owners: dict[str, list[DocRecord]]) -> None:
        """Delete document records, and re-point chunks whose owning document went or changed.

        `owners` maps such a chunk id to the live documents that list it: the chunk keeps its owner
        if that is one of them (with the owner's new offsets), else it moves to the first. Chunks no
        document lists are not deleted here (see `delete_unreferenced`): the live vector index may
        still name them.
        """
        doc_ids = list(doc_ids)

        def remove(txn: lmdb.Transaction) -> None:
            for doc_id in doc_ids:
                txn.delete(_doc_key(doc_id), db=self._docs)
            for chunk_id, docs in owners.items():
                key = bytes.fromhex(chunk_id)
                raw = txn.get(key, db=self._chunks)
                if raw is None or not docs:
                    continue
                old = ChunkRecord.from_bytes(chunk_id, raw)
                owner = next((d for d in docs if d.doc_id == old.doc_id), docs[0])
                spot = next(c for c in owner.chunks if c.chunk_id == chunk_id)
                if (owner.doc_id, spot.char_start, spot.char_end) != (old.doc_id, old.char_start, old.char_end):
                    moved = replace(old, doc_id=owner.doc_id, char_start=spot.char_start, char_end=spot.char_end)
                    txn.put(key, moved.to_bytes(), db=self._chunks)

        self.env.write(remove)

    def client_records(self) -> list[ChunkRecord]:
        """The passages kept from clients' prompts (no document lists them; engine/kept_passages.py)."""
        return [r for r in self.iter() if r.doc_id.startswith(CLIENT_DOC)]

    def delete_records(self, chunk_ids: Iterable[str]) -> None:
        keys = [bytes.fromhex(c) for c in chunk_ids]  # a list: `write` may run the transaction again

        def delete(txn: lmdb.Transaction) -> None:
            gone = [key for key in keys if txn.delete(key, db=self._chunks)]
            chunk_log.record(txn, self._meta, chunk_log.DELETED, gone)

        self.env.write(delete)

    def delete_unreferenced(self, live: set[str]) -> list[str]:
        """Delete every chunk no live document lists (crash leftovers included), clients' kept passages aside; returns
        their ids."""
        dead = sorted(self.ids() - live - {r.chunk_id for r in self.client_records()})
        if dead:
            self.delete_records(dead)
        return dead

    # -- settings ---------------------------------------------------------------------------------
    def read_config(self) -> IndexConfig | None:
        raw = self.env.read(lambda txn: txn.get(INDEX_CONFIG_KEY, db=self._meta))
        return None if raw is None else IndexConfig.from_bytes(raw)

    def write_config(self, config: IndexConfig) -> None:
        self.env.write(lambda txn: txn.put(INDEX_CONFIG_KEY, config.to_bytes(), db=self._meta))
