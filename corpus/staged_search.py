"""Staged IVF search for dynamic speculative pipelining (RAGCache §5.3).

An IVF search scans the `nprobe` inverted lists closest to the query. Staged, it scans them in
slices, closest lists first (faiss `search_preassigned` on the quantizer's assignment, one slice at a
time), merges each slice's top-k into the running one and yields it. The running top-k only ever
improves, and after the last slice it is the full `index.search` result (same ids, same scores: each
vector's score is computed by the same code whichever slice holds it; equal scores are ordered as faiss
orders them, except that a tie exactly at the k-th place may keep another of the tied vectors). A caller
may start a speculative prefill on a stage whose top-k changed and keep it if the final top-k is the same.

Indexes that are not IVF (Flat, HNSW, a refined IVF, ...) give one final stage from `index.search`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import faiss
import numpy as np


@dataclass(frozen=True)
class Stage:
    ids: np.ndarray  # [k] int64 index labels, best first; -1 where fewer than k vectors were found
    scores: np.ndarray  # [k] float32, best first (largest for inner product, smallest for L2)
    lists: int  # inverted lists searched so far (nprobe at the final stage; 0 for a non-IVF index)
    final: bool


@dataclass(frozen=True)
class _Unwrapped:
    ivf: faiss.IndexIVF
    transforms: tuple  # VectorTransforms an IndexPreTransform applies before the IVF, in order
    labels: Callable[[np.ndarray], np.ndarray]  # IVF ids -> the outer index's labels (IndexIDMap)


def stage_bounds(nprobe: int, stages: int) -> list[int]:
    """Cumulative list counts at the end of each of `stages` equal slices of nprobe lists."""
    if stages < 1:
        raise ValueError(f"stages must be at least 1 (got {stages})")
    count = min(stages, nprobe)
    return sorted({round(nprobe * (s + 1) / count) for s in range(count)})


def staged_search(index: faiss.Index, query: np.ndarray, k: int, nprobe: int | None = None,
                  stages: int = 4) -> Iterator[Stage]:
    """The running top-k of one query [D] after each stage; the last stage (final=True) equals
    `index.search` with this nprobe (default: the index's own)."""
    query = np.ascontiguousarray(query, dtype=np.float32).reshape(1, -1)  # [1, D]
    unwrapped = _unwrap(index)
    if unwrapped is None:
        scores, ids = index.search(query, k)
        yield Stage(ids[0], scores[0], 0, True)
        return
    ivf = unwrapped.ivf
    nprobe = min(ivf.nlist, nprobe or ivf.nprobe)
    bounds = stage_bounds(nprobe, stages)
    for transform in unwrapped.transforms:
        query = transform.apply(query)  # [1, D'] what the IVF itself sees
    coarse_scores, lists = ivf.quantizer.search(query, nprobe)  # [1, nprobe] closest lists first
    similarity = faiss.is_similarity_metric(ivf.metric_type)
    best_scores, best_ids, searched = None, None, 0
    for bound in bounds:
        scores, ids = _search_lists(ivf, query, k, lists[:, searched:bound], coarse_scores[:, searched:bound])
        best_scores, best_ids = _merge(best_scores, best_ids, scores[0], ids[0], k, similarity)
        searched = bound
        yield Stage(unwrapped.labels(best_ids), best_scores, bound, bound == nprobe)


def _search_lists(ivf: faiss.IndexIVF, query: np.ndarray, k: int, lists: np.ndarray,
                  coarse_scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Top-k of query [1, D] over the given inverted lists [1, m] only: scores [1, k], ids [1, k]."""
    lists = np.ascontiguousarray(lists, dtype=np.int64)
    coarse_scores = np.ascontiguousarray(coarse_scores, dtype=np.float32)
    scores = np.empty((1, k), dtype=np.float32)
    ids = np.empty((1, k), dtype=np.int64)
    # nprobe through the parameters, not the index: the index may be shared with other threads
    params = faiss.SearchParametersIVF(nprobe=lists.shape[1])
    p = faiss.swig_ptr
    ivf.search_preassigned_c(1, p(query), k, p(lists), p(coarse_scores), p(scores), p(ids), False, params)
    return scores, ids


def _merge(scores: np.ndarray | None, ids: np.ndarray | None, new_scores: np.ndarray, new_ids: np.ndarray,
           k: int, similarity: bool) -> tuple[np.ndarray, np.ndarray]:
    """The best k of two best-first lists [k] (empty slots, -1, carry faiss's worst-possible score). Equal
    scores go in faiss's heap order (the larger id first for a similarity, the smaller for a distance)."""
    if scores is None:
        return new_scores, new_ids
    all_scores = np.concatenate([scores, new_scores])  # [2k]
    all_ids = np.concatenate([ids, new_ids])
    order = np.lexsort((-all_ids, -all_scores) if similarity else (all_ids, all_scores))[:k]
    return all_scores[order], all_ids[order]


def _unwrap(index: faiss.Index) -> _Unwrapped | None:
    """The IVF inside IndexPreTransform / IndexIDMap wrappers, or None when staging does not apply."""
    transforms: list = []
    maps: list[np.ndarray] = []
    index = faiss.downcast_index(index)
    while True:
        if isinstance(index, faiss.IndexPreTransform):
            chain = index.chain
            transforms += [faiss.downcast_VectorTransform(chain.at(i)) for i in range(chain.size())]
            index = faiss.downcast_index(index.index)
        elif isinstance(index, faiss.IndexIDMap | faiss.IndexIDMap2):
            # a view of the id map, not a copy: it lives as long as the index
            maps.append(faiss.rev_swig_ptr(index.id_map.data(), index.id_map.size()))
            index = faiss.downcast_index(index.index)
        elif isinstance(index, faiss.IndexIVF):
            return _Unwrapped(index, tuple(transforms), lambda ids: _relabel(ids, maps))
        else:
            return None


def _relabel(ids: np.ndarray, maps: list[np.ndarray]) -> np.ndarray:
    """Inner ids [k] -> outer labels [k] through the IndexIDMap id maps, innermost first; -1 stays -1."""
    for id_map in reversed(maps):
        ids = np.where(ids >= 0, id_map[np.maximum(ids, 0)], -1)
    return ids
