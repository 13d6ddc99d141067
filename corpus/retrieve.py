"""Top-k retrieval: embed the query, search the live vector index, return chunk records with scores."""

from __future__ import annotations

from dataclasses import dataclass

from kvrag import KvragError
from kvrag.corpus.vector_index import VectorIndex, live_generation
from kvrag.store.chunks import ChunkRecord, ChunkTable
from kvrag.store.env import StoreEnv


@dataclass(frozen=True)
class Hit:
    rank: int  # 1 = best
    score: float  # inner product of unit vectors = cosine similarity
    chunk: ChunkRecord


class Retriever:
    """Searches one store. A long-lived retriever picks up a new index generation (a later
    `kvrag index`) at its next search: the old one may name chunks that are gone."""

    def __init__(self, env: StoreEnv, embedder):
        self.table = ChunkTable(env)
        self.embedder = embedder
        self.path = env.path
        self.index = self._load()

    def _load(self) -> VectorIndex:
        index = VectorIndex.load(self.path)
        if index is None:
            raise KvragError(f"the store at {self.path} has no vector index yet; run `kvrag index` first")
        if index.embedder != self.embedder.fingerprint:
            raise KvragError(f"the index was built with {index.embedder}, not {self.embedder.fingerprint}; "
                             "run `kvrag index` again to re-embed")
        return index

    def __len__(self) -> int:
        return len(self.index.ids)

    def search(self, query: str, k: int = 5) -> list[Hit]:
        return self.search_batch([query], k)[0]

    def search_batch(self, queries: list[str], k: int = 5) -> list[list[Hit]]:
        if k < 1:
            raise KvragError(f"-k must be at least 1 (got {k})")
        if any(not q.strip() for q in queries):
            raise KvragError("the query is empty")
        if live_generation(self.path) != self.index.generation:
            self.index = self._load()
        found = self.index.search(self.embedder.embed(list(queries)), k)
        results = []
        for hits in found:
            records = self.table.get_many(chunk_id for chunk_id, _ in hits)
            results.append([Hit(rank, score, record)
                            for rank, ((_, score), record) in enumerate(zip(hits, records, strict=True), start=1)])
        return results
