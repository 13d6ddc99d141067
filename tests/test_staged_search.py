"""Staged IVF search (corpus/staged_search.py): the last stage is `index.search` exactly, every stage is the
exact top-k over the lists searched so far (brute force in numpy), and a non-IVF index gives one stage."""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from kvrag.corpus.staged_search import stage_bounds, staged_search
from kvrag.corpus.vector_index import VectorIndex

DIM, COUNT, NLIST = 64, 20_000, 64


def clustered(rng: np.random.Generator, n: int, centers: np.ndarray, spread: float) -> np.ndarray:
    """Unit vectors [n, DIM] around random centers, so the IVF lists mean something."""
    x = centers[rng.integers(len(centers), size=n)] + spread * rng.standard_normal((n, DIM))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    centers = rng.standard_normal((200, DIM)) / np.sqrt(DIM)
    vectors = clustered(rng, COUNT, centers, 0.12)
    queries = np.concatenate([clustered(rng, 60, centers, 0.15),  # near the data, like real questions
                              clustered(rng, 20, rng.standard_normal((20, DIM)), 1.0)])  # anywhere
    return vectors, queries


def build(factory: str, vectors: np.ndarray, metric=faiss.METRIC_INNER_PRODUCT) -> faiss.Index:
    index = faiss.index_factory(DIM, factory, metric)
    index.train(vectors[:5000])  # a subsample, as big indexes are trained: quick, and enough for 64 lists
    if factory.startswith("IDMap"):
        index.add_with_ids(vectors, np.arange(len(vectors), dtype=np.int64) * 3 + 1000)  # labels != rows
    else:
        index.add(vectors)
    return index


@pytest.fixture(scope="module")
def ivf_flat(data) -> faiss.Index:
    return build(f"IVF{NLIST},Flat", data[0])


def full_search(index: faiss.Index, query: np.ndarray, k: int, nprobe: int) -> tuple[np.ndarray, np.ndarray]:
    faiss.extract_index_ivf(index).nprobe = nprobe
    scores, ids = index.search(query[None], k)
    return scores[0], ids[0]


@pytest.mark.parametrize(("nprobe", "stages", "k"), [(1, 1, 10), (8, 4, 10), (16, 3, 5), (16, 16, 10),
                                                     (32, 8, 20), (NLIST, 5, 10), (2, 2, 1000)])
def test_last_stage_is_the_full_search(ivf_flat, data, nprobe, stages, k):
    for query in data[1]:
        result = list(staged_search(ivf_flat, query, k, nprobe, stages))
        scores, ids = full_search(ivf_flat, query, k, nprobe)
        assert [s.final for s in result] == [False] * (len(result) - 1) + [True]
        assert result[-1].lists == nprobe
        np.testing.assert_array_equal(result[-1].ids, ids)  # k=1000 over 2 lists: the -1 padding too
        np.testing.assert_array_equal(result[-1].scores, scores)


def test_every_stage_is_the_exact_topk_of_its_lists(ivf_flat, data):
    """Each stage against brute force over the vectors of the lists it has searched; no score gets worse."""
    vectors, queries = data
    ivf = faiss.extract_index_ivf(ivf_flat)
    _, home = ivf.quantizer.search(vectors, 1)  # [n, 1] the list each vector was added to
    k, nprobe, changes = 10, 24, 0
    for query in queries:
        _, probed = ivf.quantizer.search(query[None], nprobe)  # [1, nprobe] closest lists first
        previous = None
        for stage in staged_search(ivf_flat, query, k, nprobe, 6):
            rows = np.flatnonzero(np.isin(home[:, 0], probed[0, :stage.lists]))
            exact = vectors[rows] @ query  # [rows]
            best = np.argsort(-exact)[:k]
            np.testing.assert_array_equal(stage.ids, rows[best])
            np.testing.assert_allclose(stage.scores, exact[best], rtol=0, atol=1e-5)
            if previous is not None:
                assert stage.lists > previous.lists
                assert np.all(stage.scores >= previous.scores)  # the i-th best of a superset is no worse
                changes += not np.array_equal(stage.ids, previous.ids)
            previous = stage
    assert changes > 0  # the data does make later stages find better vectors


@pytest.mark.parametrize("factory", ["IDMap,IVF32,Flat", "PCA32,IVF32,Flat", "IVF32,SQ8"])
def test_wrapped_and_compressed_ivf(data, factory):
    """IndexIDMap labels, a PCA before the IVF, and lossy list codes: still the full search at the end."""
    vectors, queries = data
    index = build(factory, vectors)
    for query in queries[::4]:
        result = list(staged_search(index, query, 10, 12, 3))
        scores, ids = full_search(index, query, 10, 12)
        assert len(result) == 3
        np.testing.assert_array_equal(result[-1].ids, ids)
        np.testing.assert_array_equal(result[-1].scores, scores)
    if factory.startswith("IDMap"):
        assert set(result[-1].ids) <= set(range(1000, 1000 + 3 * COUNT, 3))


def test_l2_metric_keeps_smallest_distances(data):
    vectors, queries = data
    index = build("IVF32,Flat", vectors, faiss.METRIC_L2)
    for query in queries[::4]:
        result = list(staged_search(index, query, 10, 8, 4))
        scores, ids = full_search(index, query, 10, 8)
        np.testing.assert_array_equal(result[-1].ids, ids)
        assert all(np.all(b.scores <= a.scores) for a, b in zip(result, result[1:], strict=False))


@pytest.mark.parametrize("factory", ["Flat", "HNSW16"])
def test_non_ivf_index_gives_one_final_stage(data, factory):
    vectors, queries = data
    index = build(factory, vectors[:3000])
    scores, ids = index.search(queries[:1], 10)
    (stage,) = staged_search(index, queries[0], 10, 16, 4)
    assert stage.final and stage.lists == 0
    np.testing.assert_array_equal(stage.ids, ids[0])
    np.testing.assert_array_equal(stage.scores, scores[0])


def test_stage_bounds():
    assert stage_bounds(128, 4) == [32, 64, 96, 128]
    assert stage_bounds(8, 3) == [3, 5, 8]
    assert stage_bounds(2, 5) == [1, 2]  # no more stages than lists
    with pytest.raises(ValueError):
        stage_bounds(16, 0)


def test_vector_index_staged_hits_end_as_search(data):
    vectors, queries = data
    ids = [f"{n:032x}" for n in range(COUNT)]
    for factory, count in ((f"IVF{NLIST},Flat", 0), ("Flat", 1)):
        index = VectorIndex.build(ids, vectors, factory, "test-embedder")
        for query in queries[::10]:
            stages = list(index.search_staged(query, 5, stages=4))
            assert stages[-1][1] == index.search(query[None], 5)[0]
            assert len(stages) == (count or 4)
    empty = VectorIndex.build([], np.empty((0, DIM), np.float32), "Flat", "test-embedder")
    assert [hits for _, hits in empty.search_staged(queries[0], 5)] == [[]]


def test_search_bench_small(tmp_path):
    """The benchmark end to end on a small IVF: its final stage is the plain search for every query, the index
    is cached, and a non-IVF factory is refused in one line."""
    from kvrag.bench.search import SearchBenchConfig, run
    from kvrag.errors import KvragError

    cfg = SearchBenchConfig(work=tmp_path, count=6000, dim=32, topics=20, subtopics=200, queries=12,
                            nprobes=(8,), stages=(3,), factory="IVF32,Flat")
    logs: list[str] = []
    report = run(cfg, log=logs.append)
    assert [c["queries"] for c in report["cells"]] == ["near", "far", "random"]
    for cell in report["cells"]:
        assert cell["final_equals_search"] == 1.0 and len(cell["stage_ms"]) == 3
        assert 1.0 <= cell["prefills_started"] <= 3.0 and 0.0 <= cell["first_stage_final"] <= 1.0
    run(cfg, log=logs.append)
    assert any(line.startswith("loading ") for line in logs)
    with pytest.raises(KvragError, match="not an IVF index"):
        run(SearchBenchConfig(work=tmp_path, count=6000, dim=32, factory="Flat"), log=logs.append)
