"""Top-k retrieval: embed the query, search the live vector index, return chunk records with scores."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvrag.config import MIN_SCORE  # noqa: E402,F401  (where callers of retrieval find it)
from kvrag.corpus.vector_index import VectorIndex, live_generation
from kvrag.errors import KvragError
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

    def search(self, query: str, k: int = 5, relative_cutoff: float = 0.0, min_score: float = 0.0) -> list[Hit]:
        return self.search_batch([query], k, relative_cutoff, min_score)[0]

    def search_batch(self, queries: list[str], k: int = 5, relative_cutoff: float = 0.0,
                     min_score: float = 0.0) -> list[list[Hit]]:
        """Top-k hits per query, best first; with `relative_cutoff` r > 0, hits scoring below r x the best hit's
        score are dropped (see `keep_close_hits`); with `min_score` > 0, so are hits scoring below it: a query
        whose best hit scores below it gets none (see `cut_hits`)."""
        self._check(queries, k, min_score)
        found = self.index.search(self.embedder.embed(list(queries)), k)
        return [self._hits(cut_hits(hits, relative_cutoff, min_score)) for hits in found]

    def search_staged(self, query: str, k: int = 5, relative_cutoff: float = 0.0,
                      stages: int = 8, min_score: float = 0.0) -> Iterator[StagedHits]:
        """`search` in stages (corpus/staged_search.py: an IVF index's probed lists a slice at a time): each stage's
        running top-k after the cutoffs, `changed` when its chunks differ from the previous stage's; the final
        stage's hits are `search`'s (none, where `min_score` drops them all). One stage for a Flat index."""
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


@dataclass(frozen=True)
class StagedHits:
    hits: list[Hit]  # this stage's top-k after the cutoff, best first
    final: bool  # the full search's result
    changed: bool  # other chunks than the previous stage's


def keep_close_hits(hits: list[tuple[str, float]], relative_cutoff: float) -> list[tuple[str, float]]:
    """The hits (best first) scoring at least `relative_cutoff` x the best one's score; the best is always kept.

    Off-topic chunks in the prompt cost a small model its answer, and their KV costs load time; chunks far
    below the best one are off-topic far more often than they are a second hop (docs/retrieval.md measures it).
    """
    if not hits or relative_cutoff <= 0 or hits[0][1] <= 0:
        return hits
    floor = relative_cutoff * hits[0][1]
    return [hit for n, hit in enumerate(hits) if n == 0 or hit[1] >= floor]


def cut_hits(hits: list[tuple[str, float]], relative_cutoff: float, min_score: float) -> list[tuple[str, float]]:
    """`keep_close_hits` of the hits (best first) scoring at least `min_score`: with `min_score` > 0, none when
    even the best one scores below it. 0 turns the absolute cutoff off (negative scores are kept then).

    The best chunk's score says whether a request is about the documents at all: "Write a haiku about the sea."
    scores at most 0.30 against the 1,255 MuSiQue passages, MuSiQue's questions 0.28-0.71 (median 0.57) against
    theirs (docs/retrieval-cutoff.md, which chose MIN_SCORE).
    """
    if min_score > 0:
        hits = [hit for hit in hits if hit[1] >= min_score]
    return keep_close_hits(hits, relative_cutoff)
