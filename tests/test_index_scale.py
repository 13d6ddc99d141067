"""The vector index at scale (corpus/vector_index.py, bench/index_scale.py): the IVF-PQ index with an exact
re-rank that `kvrag index` builds from PQ_MIN chunks on, here at 20k x 128 with the threshold lowered.

Its recall@10 is checked against faiss's exact flat search of the same vectors. The data (bench/search.py's
clustered generator), the training sample and faiss's k-means all have fixed seeds, so each run builds the same
index and the recall is the same number every time (0.993 when written; IVF-Flat on the same lists: 0.995).
"""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from kvrag.bench.index_scale import IndexScaleConfig, exact_topk, factories, markdown, run, synthetic
from kvrag.corpus.vector_index import (
    PQ_MIN,
    TRAIN_MIN,
    VectorIndex,
    _train_sample,
    check_factory,
    choose_factory,
)

N, DIM, K, BATCH = 20_000, 128, 10, 3_000
CFG = IndexScaleConfig(n=N, dim=DIM, queries=200, topics=30, subtopics=300)


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    vectors, queries = synthetic(CFG)  # [N, DIM], [200, DIM]
    return vectors, queries, exact_topk(vectors, queries, K, 4096)  # exact rows [200, K]


@pytest.fixture(scope="module")
def built(data) -> tuple[VectorIndex, list[tuple[int, int]]]:
    """The default factory with the threshold lowered to N, added BATCH vectors at a time."""
    reports: list[tuple[int, int]] = []
    factory = choose_factory(N, dim=DIM, pq_min=N)
    index = VectorIndex.build(_ids(N), data[0], factory, "emb", progress=lambda *r: reports.append(r), batch=BATCH)
    return index, reports


def _ids(n: int) -> list[str]:
    return [f"{row:032x}" for row in range(n)]  # the row, so a hit's id gives it back


def _recall(index: VectorIndex, queries: np.ndarray, truth: np.ndarray) -> float:
    found = [{int(chunk_id, 16) for chunk_id, _ in hits} for hits in index.search(queries, K)]
    return float(np.mean([len(f & set(t.tolist())) / K for f, t in zip(found, truth, strict=True)]))


def test_factory_thresholds():
    assert choose_factory(PQ_MIN - 1) == "IVF2048,Flat"  # the small-corpus defaults stand below it
    assert choose_factory(PQ_MIN) == "IVF2048,PQ192x4fs,RFlat"
    assert choose_factory(1_000_000) == "IVF4096,PQ192x4fs,RFlat"
    assert choose_factory(N, dim=DIM, pq_min=N) == "IVF512,PQ64x4fs,RFlat"
    assert choose_factory(N, dim=100, pq_min=N) == "IVF512,PQ50x4fs,RFlat"  # a divisor of dim
    check_factory(choose_factory(1_000_000), 384)


def test_refined_pq_recall_against_exact(built, data):
    index, _ = built
    vectors, queries, truth = data
    assert index.refined and isinstance(faiss.downcast_index(index.index), faiss.IndexIVFPQFastScan)
    recall = _recall(index, queries, truth)
    ivf_flat = VectorIndex.build(_ids(N), vectors, "IVF512,Flat", "emb")  # same lists, same nprobe
    assert recall >= 0.98
    assert recall >= _recall(ivf_flat, queries, truth) - 0.01
    for hits, query in zip(index.search(queries[:20], K), queries[:20], strict=True):  # exact scores, best first
        rows = [int(chunk_id, 16) for chunk_id, _ in hits]
        np.testing.assert_allclose([s for _, s in hits], vectors[rows] @ query, rtol=1e-5, atol=1e-6)
        assert [s for _, s in hits] == sorted((s for _, s in hits), reverse=True)


def test_progress_is_monotonic_to_the_total(built):
    _, reports = built
    added = [a for a, _ in reports]
    assert reports[0] == (0, N) and reports[-1] == (N, N) and {t for _, t in reports} == {N}
    assert all(0 < b - a <= BATCH for a, b in zip(added, added[1:], strict=False))
    assert len(reports) == 1 + -(-N // BATCH)


def test_batch_adding_equals_one_shot(built, data):
    index, _ = built
    vectors, queries, _ = data
    one_shot = VectorIndex.build(_ids(N), vectors, index.factory, "emb", previous=index, batch=N)  # same training
    assert one_shot.index.ntotal == N
    assert one_shot.search(queries, K) == index.search(queries, K)
    untrained = VectorIndex.build(_ids(N), vectors, index.factory, "emb", batch=N)  # its own training: same seeds
    assert untrained.search(queries, K) == index.search(queries, K)


def test_staged_search_ends_as_search(built, data, tmp_path):
    index, _ = built
    vectors, queries, _ = data
    for query in queries[:40]:
        stages = list(index.search_staged(query, K, stages=4))
        assert len(stages) == 4 and [s.final for s, _ in stages] == [False, False, False, True]
        assert stages[-1][1] == index.search(query[None], K)[0]
    index.save(tmp_path)  # the file holds the base index; the re-rank comes back with the factory
    loaded = VectorIndex.load(tmp_path)
    assert loaded.refined and loaded.search(queries, K) == index.search(queries, K)


def test_training_sample_is_bounded():
    vectors = np.random.default_rng(1).standard_normal((TRAIN_MIN + 5_000, 8)).astype(np.float32)
    index = faiss.index_factory(8, "IVF16,Flat", faiss.METRIC_INNER_PRODUCT)
    sample = _train_sample(index, vectors)
    assert sample.shape == (TRAIN_MIN, 8) and np.array_equal(sample, _train_sample(index, vectors))
    assert {row.tobytes() for row in sample} <= {row.tobytes() for row in vectors}  # rows, not made up
    assert _train_sample(index, vectors[:1000]).shape == (1000, 8)  # below the bound: every vector


def test_bench_smoke():
    """Every figure, for each factory, at a tiny size; exact search is its own reference (recall 1)."""
    cfg = IndexScaleConfig(n=3_000, dim=32, queries=20, topics=5, subtopics=50,
                           factories=("IVF64,PQ16x4fs,RFlat", "IVF64,Flat", "HNSW32", "Flat"))
    report = run(cfg, log=lambda message: None)
    assert [r["factory"] for r in report["results"]] == list(cfg.factories)
    for r in report["results"]:
        assert r["build_s"] >= r["train_s"] >= 0 and r["peak_rss_bytes"] > 0 and r["extra_rss_bytes"] >= 0
        assert r["index_bytes"] > 0 and 0 < r["p50_ms"] <= r["p99_ms"] and 0 <= r["recall@10"] <= 1
    flat = report["results"][-1]
    assert flat["recall@10"] == 1.0 and flat["nprobe"] is None and report["results"][0]["nprobe"] == 16
    table = markdown(report)
    assert all(f"| {f} |" in table for f in cfg.factories) and "recall@10" in table
    assert factories(IndexScaleConfig()) == ("IVF4096,PQ192x4fs,RFlat", "IVF4096,Flat", "HNSW32")
