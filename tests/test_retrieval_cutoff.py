"""The absolute retrieval cutoff (`min_score`): hand-computed hits over a tiny store whose vectors are chosen by
hand, in `search`, `search_batch` and `search_staged`, and the rule `kvrag bench cutoff` chooses it by."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvrag.bench.cutoff import PROMPTS, Group, chat_prompts, choose
from kvrag.config import MIN_SCORE
from kvrag.corpus.retrieve import Retriever, cut_hits
from kvrag.corpus.vector_index import VectorIndex
from kvrag.errors import KvragError
from kvrag.store.chunks import ChunkRecord, ChunkTable, DocChunk, DocRecord
from kvrag.store.env import StoreEnv

# Unit vectors in 4-D: chunk "a" .. "d", and the queries' vectors, so that every score is a hand-computed dot product.
CHUNKS = {"a": [1, 0, 0, 0], "b": [0.8, 0.6, 0, 0], "c": [0.6, 0.8, 0, 0], "d": [0, 0, 1, 0]}
QUERIES = {
    "east": [1, 0, 0, 0],  # a 1.0, b 0.8, c 0.6, d 0.0
    "mixed": [0.6, 0, 0.8, 0],  # d 0.8, a 0.6, b 0.48, c 0.36
    "chat": [0, 0, 0, 1],  # 0.0 against every chunk
    "faint": [0.2, 0, 0, 0.9797959],  # a 0.2, b 0.16, c 0.12, d 0.0
}


class HandEmbedder:
    """The embedder a Retriever asks, with each query's vector from QUERIES."""

    fingerprint = "hand@1"

    def embed(self, texts: list[str]) -> np.ndarray:
        return np.array([QUERIES[t] for t in texts], dtype=np.float32)


def make_store(path, factory: str = "Flat", copies: int = 1):
    """CHUNKS (each `copies` times, as chunks of their own) as one document's chunks, and their vector index."""
    names = [name for name in CHUNKS for _ in range(copies)]
    ids = [f"{i + 1:032x}" for i in range(len(names))]
    with StoreEnv.open(path, create=True) as env:
        records = [ChunkRecord(i, "doc", "", n, 0, 1, (7,)) for i, n in zip(ids, names, strict=True)]
        doc = DocRecord("doc", "doc.txt", "", "h", tuple(DocChunk(r.chunk_id, 0, 1, 1) for r in records))
        ChunkTable(env).put_docs([(doc, records)])
    vectors = np.array([CHUNKS[n] for n in names], dtype=np.float32)
    VectorIndex.build(ids, vectors, factory, HandEmbedder.fingerprint).save(path)
    return path


def found(hits) -> list[tuple[str, float]]:
    return [(h.chunk.text, round(h.score, 4)) for h in hits]


def test_cut_hits_by_hand():
    assert 0 < MIN_SCORE < 1
    hits = [("d", 0.8), ("a", 0.6), ("b", 0.48), ("c", 0.36)]
    assert cut_hits(hits, 0.0, 0.0) == hits
    assert cut_hits(hits, 0.0, 0.5) == hits[:2]
    assert cut_hits(hits, 0.5, 0.0) == hits[:3]  # 0.5 x 0.8 = 0.4: c goes
    assert cut_hits(hits, 0.5, 0.45) == hits[:3]  # both floors under b's 0.48
    assert cut_hits(hits, 0.5, 0.5) == hits[:2]  # b is over the relative floor (0.4), not over min_score
    assert cut_hits(hits, 0.9, 0.5) == hits[:1]  # 0.72: only the best
    assert cut_hits(hits, 0.0, 0.6) == hits[:2]  # a score equal to min_score is kept
    assert cut_hits(hits, 0.5, 0.81) == []  # the best under it: nothing, not even the best
    assert cut_hits([("x", -0.1), ("y", -0.2)], 0.0, 0.0) == [("x", -0.1), ("y", -0.2)]  # 0: no absolute cutoff
    assert cut_hits([], 0.5, 0.3) == []


def test_min_score_in_search_and_search_batch(tmp_path):
    with StoreEnv.open(make_store(tmp_path / "store"), readonly=True) as env:
        retriever = Retriever(env, HandEmbedder())
        assert found(retriever.search("east", 4)) == [("a", 1.0), ("b", 0.8), ("c", 0.6), ("d", 0.0)]
        assert found(retriever.search("east", 4, min_score=0.7)) == [("a", 1.0), ("b", 0.8)]
        assert found(retriever.search("east", 4, min_score=1.0)) == [("a", 1.0)]
        assert found(retriever.search("mixed", 4, 0.5, min_score=0.5)) == [("d", 0.8), ("a", 0.6)]
        assert found(retriever.search("mixed", 4, 0.7, min_score=0.3)) == [("d", 0.8), ("a", 0.6)]  # floor 0.56
        assert [h.rank for h in retriever.search("mixed", 4, min_score=0.4)] == [1, 2, 3]
        assert retriever.search("chat", 4, 0.5, min_score=0.1) == []  # all under it: no hits at all
        assert len(retriever.search("chat", 4)) == 4  # without it, k hits however poor
        batch = retriever.search_batch(["east", "chat", "faint", "mixed"], 3, 0.5, min_score=0.33)
        assert [found(hits) for hits in batch] == [[("a", 1.0), ("b", 0.8), ("c", 0.6)], [], [],
                                                   [("d", 0.8), ("a", 0.6), ("b", 0.48)]]
        for bad in (-0.1, 1.5, float("nan")):
            with pytest.raises(KvragError, match="minimum score"):
                retriever.search("east", min_score=bad)


def test_staged_search_honours_min_score(tmp_path):
    """Every stage's hits are at or over min_score, the last stage is `search`'s, and a query under it everywhere
    ends on a final stage with no hits."""
    with StoreEnv.open(make_store(tmp_path / "store", "IVF2,Flat", copies=2), readonly=True) as env:
        retriever = Retriever(env, HandEmbedder())
        assert retriever.index.index.nprobe == 2  # two lists: a stage each
        staged = 0
        for query in QUERIES:
            for relative, min_score in ((0.0, 0.0), (0.0, 0.5), (0.5, 0.3), (0.0, 0.7), (0.0, 0.9)):
                stages = list(retriever.search_staged(query, 8, relative, stages=2, min_score=min_score))
                assert [s.final for s in stages] == [False] * (len(stages) - 1) + [True]
                assert all(h.score >= min_score for s in stages for h in s.hits)
                want = retriever.search(query, 8, relative, min_score=min_score)
                assert sorted(found(stages[-1].hits)) == sorted(found(want))  # "chat": all tie at 0
                staged += len(stages) > 1 and min_score > 0
        assert staged > 0  # some search under min_score changed its hits between stages
        letters = [[h.chunk.text for h in s.hits] for s in retriever.search_staged("mixed", 8, stages=2, min_score=0.5)]
        assert letters[-1] == ["d", "d", "a", "a"]  # 0.8, 0.8, 0.6, 0.6; b (0.48) and c (0.36) under it
        letters = [[h.chunk.text for h in s.hits] for s in retriever.search_staged("east", 8, stages=2, min_score=0.7)]
        assert letters[-1] == ["a", "a", "b", "b"]
        (last,) = [s for s in retriever.search_staged("chat", 8, stages=2, min_score=0.1) if s.final]
        assert last.hits == []
        assert len(list(retriever.search_staged("chat", 8, stages=2))[-1].hits) == 8


def test_the_rule_picks_the_lowest_cutoff_that_rejects_enough_chat():
    docs = Group("docs", "docs", "tune", "s", [0.30, 0.40, 0.50, 0.60])
    chat = Group("chat", "chat", "tune", "s", [0.10, 0.15, 0.20, 0.25, 0.28, 0.32, 0.12, 0.18, 0.22, 0.26])
    assert docs.share(0.4) == 0.75 and chat.share(0.25) == 0.6  # docs keep at >=, chat goes to plain chat at <
    assert choose([docs, chat]) == 0.29  # 9/10 chat under it; 0.30 .. 0.32 keep as many docs but are higher
    assert choose([docs, chat], reject=1.0) == 0.33  # all chat: one question lost
    report = Group("report", "docs", "report", "s", [0.0])  # report groups play no part
    assert choose([docs, chat, report]) == 0.29
    with pytest.raises(KvragError):
        choose([docs, Group("chat", "chat", "tune", "s", [1.0] * 10)])


def test_the_chat_prompts_are_two_distinct_halves():
    prompts = chat_prompts()
    assert len(prompts["tune"]) == len(prompts["report"]) == 20
    every = prompts["tune"] + prompts["report"]
    assert len(set(every)) == 40 and all(p.strip() for p in every)
    assert "about" in json.loads(PROMPTS.read_text())


@pytest.mark.slow
@pytest.mark.benchmark_data
def test_bench_cutoff_reproduces_min_score(tmp_path, kvrag, musique_path, musique_store, smol):
    """`kvrag bench cutoff` on the real data chooses the MIN_SCORE the code carries (over the suite's MuSiQue store,
    the one it would build in --work)."""
    proc = kvrag("bench", "cutoff", "--dataset", str(musique_path), "--store", str(musique_store), "--work",
                 str(tmp_path), "--json")
    report = json.loads(proc.stdout)
    assert report["chosen"] == report["min_score_default"] == MIN_SCORE
    shares = {row["min_score"]: row for row in report["sweep"]}[MIN_SCORE]
    assert shares["musique tune"] == 1.0 and shares["chat tune @ musique"] >= 0.9
