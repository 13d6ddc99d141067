"""Top-k retrieval: embed the query, search the live vector index, return chunk records with scores."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvrag.corpus.vector_index import VectorIndex, live_generation
from kvrag.errors import KvragError
from kvrag.store.chunks import ChunkRecord, ChunkTable
from kvrag.store.env import StoreEnv


@dataclass(frozen=True)
class Hit:
    rank: int  # 1 = best
    score: float  # inner product of unit vectors = cosine similarity
    chunk: ChunkRecord


@dataclass(frozen=True)
class StagedHits:
    hits: list[Hit]  # this stage's top-k after the cutoff, best first
    final: bool  # the full search's result
    changed: bool  # other chunks than the previous stage's


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

    def search(self, query: str, k: int = 5, relative_cutoff: float = 0.0, min_score: float = 0.0) -> list[Hit]:
        return self.search_batch([query], k, relative_cutoff, min_score)[0]

    def search_batch(self, queries: list[str], k: int = 5, relative_cutoff: float = 0.0,
                     min_score: float = 0.0) -> list[list[Hit]]:
        """Top-k hits per query, best first, after `cut_hits`."""
        self._check(queries, k, min_score)
        found = self.index.search(self.embedder.embed(list(queries)), k)
        return [self._hits(cut_hits(hits, relative_cutoff, min_score)) for hits in found]

    def search_staged(self, query: str, k: int = 5, relative_cutoff: float = 0.0,
                      stages: int = 8, min_score: float = 0.0) -> Iterator[StagedHits]:
        """`search` in stages (corpus/staged_search.py): each stage's running top-k after the cutoffs, `changed`
        when its chunks differ from the previous stage's; the final stage's hits are `search`'s."""
        self._check([query], k, min_score)
        vector = self.embedder.embed([query])[0]
        previous = None
        for stage, hits in self.index.search_staged(vector, k, stages):
            hits = cut_hits(hits, relative_cutoff, min_score)
            ids = [chunk_id for chunk_id, _ in hits]
            if ids != previous or stage.final:
                yield StagedHits(self._hits(hits), stage.final, ids != previous)
            previous = ids

    def _check(self, queries: list[str], k: int, min_score: float) -> None:
        if k < 1:
            raise KvragError(f"-k must be at least 1 (got {k})")
        if not 0.0 <= min_score <= 1.0:
            raise KvragError(f"the minimum score is a cosine similarity between 0 and 1 (got {min_score})")
        if any(not q.strip() for q in queries):
            raise KvragError("the query is empty")
        if live_generation(self.path) != self.index.generation:
            self.index = self._load()

    def _hits(self, hits: list[tuple[str, float]]) -> list[Hit]:
        records = self.table.get_many(chunk_id for chunk_id, _ in hits)
        return [Hit(rank, score, record)
                for rank, ((_, score), record) in enumerate(zip(hits, records, strict=True), start=1)]


def cut_hits(hits: list[tuple[str, float]], relative_cutoff: float, min_score: float) -> list[tuple[str, float]]:
    """The hits (best first) scoring at least `min_score` (none when even the best one scores below it; 0: off)
    and at least `relative_cutoff` x the best one's score (the best is always kept).

    The best chunk's score says whether a request is about the documents at all; off-topic chunks far below the
    best one cost a small model its answer and their KV load time (docs/retrieval.md, docs/retrieval-cutoff.md).
    """
    if min_score > 0:
        hits = [hit for hit in hits if hit[1] >= min_score]
    if not hits or relative_cutoff <= 0 or hits[0][1] <= 0:
        return hits
    return hits[:1] + [hit for hit in hits[1:] if hit[1] >= relative_cutoff * hits[0][1]]
