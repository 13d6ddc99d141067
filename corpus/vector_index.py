"""The faiss inner-product index over chunk embeddings, with its id map, in `<store>/index/`.

Each build is a generation: `gNNNNNN.faiss` (the index), `.ids.npy` (row -> chunk id, 16 bytes a
row) and `.vec.npy` (the normalised vectors, so an update never re-embeds kept chunks, whatever
the index type). Files are written under temp names and os.replace'd; `current.json`, replaced
last, names the live generation. A crash at any point leaves the previous generation live.

A factory ending in `,RFlat` (the default from PQ_MIN chunks on) is faiss's refine-flat: the base index
returns REFINE_FACTOR x k candidates, re-scored exactly. The exact scores come from `vectors`, which the
generation keeps anyway, so the refinement costs no second copy of the vectors (faiss's IndexRefineFlat
would hold one); only the base index is in the `.faiss` file.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import faiss
import numpy as np

from kvrag.corpus.staged_search import Stage, staged_search
from kvrag.errors import KvragError

# Exact search up to this many chunks: a query scans the flat index in a few ms on one core, below the cost of
# the embedding (docs/performance.md).
FLAT_MAX = 100_000
# IVF-PQ (4-bit fast-scan codes, dim/4 bytes a vector) with an exact re-rank from this many chunks on: beyond it an
# IVF-Flat's lists, a second full copy of the vectors, grow large, and re-ranking kept IVF-Flat's recall@10 ("The
# index at a million chunks" in docs/performance.md); below it PQ training is a large share of the build.
PQ_MIN = 500_000
REFINE_FACTOR = 8  # candidates re-ranked exactly per hit wanted
REFINE = ",RFlat"
# Training sample, at most: 64 vectors a list (k-means needs ~40; faiss would take up to 256) and never under
# 65,536, what an 8-bit PQ trains on (256 points for each of its 256 centroids).
TRAIN_PER_LIST, TRAIN_MIN = 64, 65_536
ADD_BATCH = 65_536  # vectors added at a time: faiss's temporaries stay ~ADD_BATCH x dim floats
_POINTER = "current.json"
_LOCK = "lock"
_FAISS_PREFIX = re.compile(r"^Error in .*? at \S+:\d+: (Error: )?", re.S)  # C++ location, not for users


def choose_factory(n: int, override: str | None = None, dim: int = 384, pq_min: int = PQ_MIN) -> str:
    """`--index-factory` if given; else Flat up to FLAT_MAX, IVF with ~4*sqrt(n) lists beyond, and from
    `pq_min` on (checked first, so a test can lower it) those lists hold PQ codes re-ranked exactly.

    The list count is a power of two, so the factory (and the trained quantizer, which updates
    reuse) stays the same while the corpus grows, until it has about quadrupled.
    """
    if override:
        return override
    nlist = default_nlist(n)
    if n >= pq_min:
        return f"IVF{nlist},PQ{_pq_codes(dim)}x4fs{REFINE}"
    if n <= FLAT_MAX:
        return "Flat"
    return f"IVF{nlist},Flat"


def default_nlist(n: int) -> int:
    """Inverted lists for n vectors: ~4*sqrt(n), a power of two."""
    return 2 ** round(math.log2(4 * math.sqrt(max(n, 1))))


def _pq_codes(dim: int) -> int:
    """Sub-quantizers of the PQ: one per 2 dimensions (4 bits each, so dim/4 bytes a vector), or the
    largest count below that divides dim."""
    return next(m for m in range(max(dim // 2, 1), 0, -1) if dim % m == 0)


def check_factory(factory: str, dim: int) -> None:
    """Refuse a factory string faiss cannot parse before any work is done (training needs the vectors)."""
    try:
        faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        raise KvragError(f"bad --index-factory {factory!r}: {_faiss_message(exc)}") from None


def live_generation(store_dir: Path) -> str | None:
    """The name of the live generation (cheap: one small file), None without an index."""
    try:
        return json.loads((Path(store_dir) / "index" / _POINTER).read_text())["generation"]
    except FileNotFoundError:
        return None


def default_nprobe(nlist: int) -> int:
    return min(nlist, max(16, nlist // 32))


@dataclass
class VectorIndex:
    ids: list[str]  # row -> chunk id (hex)
    vectors: np.ndarray  # [n, dim] float32, unit norm
    index: faiss.Index
    factory: str
    embedder: str  # Embedder.fingerprint of the vectors
    generation: str = ""  # set when loaded or saved

    @classmethod
    def build(cls, ids: list[str], vectors: np.ndarray, factory: str, embedder: str,
              previous: VectorIndex | None = None, progress: Callable[[int, int], None] | None = None,
              batch: int = ADD_BATCH) -> VectorIndex:
        """A new index over `vectors`; an IVF/PQ index reuses `previous`'s training when it has the
        same factory and embedder (training is the slow part; adding is cheap). Training takes a sample
        (`_train_sample`); then `batch` vectors are added at a time, with `progress(added, total)` once
        trained (added 0) and after each batch.

        Memory beyond `vectors` [n, dim] (not copied when float32 and contiguous): the index, the training
        sample while it trains (<= max(64 x nlist, 65,536) rows) and faiss's temporaries for one batch."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)  # [n, dim]
        report = progress or (lambda added, total: None)
        try:
            if previous is not None and (previous.factory, previous.embedder) == (factory, embedder):
                index = faiss.clone_index(previous.index)
                index.reset()  # drops the vectors, keeps the trained quantizer
            else:
                index = faiss.index_factory(vectors.shape[1], _base(factory), faiss.METRIC_INNER_PRODUCT)
            if not index.is_trained:
                index.train(_train_sample(index, vectors))
            report(0, len(vectors))
            for start in range(0, len(vectors), batch):  # slices are views: no copy of the vectors
                index.add(vectors[start:start + batch])
                report(min(start + batch, len(vectors)), len(vectors))
        except RuntimeError as exc:  # bad factory string, too few vectors to train on, ...
            raise KvragError(f"cannot build index {factory!r} on {len(ids)} vectors: {_faiss_message(exc)}") from None
        ivf = _ivf(index)
        if ivf is not None:
            ivf.nprobe = default_nprobe(ivf.nlist)
        return cls(list(ids), vectors, index, factory, embedder)

    @property
    def refined(self) -> bool:
        """Whether the index's candidates are re-ranked exactly (a factory ending in `,RFlat`)."""
        return self.factory.endswith(REFINE)

    def search(self, queries: np.ndarray, k: int) -> list[list[tuple[str, float]]]:
        """Top-k (chunk id, inner product) per query row, best first."""
        if not self.ids or k < 1:
            return [[] for _ in range(len(queries))]
        queries = np.ascontiguousarray(queries, dtype=np.float32)  # [q, dim]
        scores, rows = self.index.search(queries, self._candidates(k))  # [q, c]
        if self.refined:
            scores, rows = self._rerank(queries, rows, k)  # [q, k]
        return [[(self.ids[r], float(s)) for s, r in zip(srow, rrow, strict=True) if r >= 0]
                for srow, rrow in zip(scores, rows, strict=True)]

    def search_staged(self, query: np.ndarray, k: int,
                      stages: int = 4) -> Iterator[tuple[Stage, list[tuple[str, float]]]]:
        """`search` of one query [dim] in stages (corpus/staged_search.py), each with its running top-k as
        (chunk id, inner product) hits, best first; the last stage's hits are `search`'s. A refined index
        stages its candidates and re-ranks each stage's (the stage then holds the re-ranked top-k)."""
        if not self.ids or k < 1:
            yield Stage(np.empty(0, np.int64), np.empty(0, np.float32), 0, True), []
            return
        query = np.ascontiguousarray(query, dtype=np.float32)  # [dim]
        k = min(k, len(self.ids))
        found = staged_search(self.index, query, self._candidates(k), stages=stages)
        for stage in (self._reranked(found, query, k) if self.refined else found):
            yield stage, [(self.ids[r], float(s)) for s, r in zip(stage.scores, stage.ids, strict=True) if r >= 0]

    def _candidates(self, k: int) -> int:
        """Rows asked of the faiss index for k hits: k, or REFINE_FACTOR x k to re-rank."""
        return min(k * (REFINE_FACTOR if self.refined else 1), len(self.ids))

    def _rerank(self, queries: np.ndarray, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The best k of each query's [q, dim] candidate rows [q, c] (-1: none) by exact inner product with
        the kept vectors: scores [q, k'] and rows [q, k'] (k' = min(k, c); -inf and -1 where fewer)."""
        width = min(k, rows.shape[1])
        best_scores = np.full((len(rows), width), -np.inf, dtype=np.float32)
        best_rows = np.full((len(rows), width), -1, dtype=np.int64)
        for n, (query, found) in enumerate(zip(queries, rows, strict=True)):
            found = found[found >= 0]
            exact = self.vectors[found] @ query  # [c'] one query at a time: the same sums staged or not
            order = np.argsort(-exact, kind="stable")[:width]  # ties keep the faiss candidate order
            best_scores[n, :len(order)], best_rows[n, :len(order)] = exact[order], found[order]
        return best_scores, best_rows

    def _reranked(self, stages: Iterator[Stage], query: np.ndarray, k: int) -> Iterator[Stage]:
        """Each stage's candidates re-ranked to its exact top-k."""
        for stage in stages:
            scores, rows = self._rerank(query[None], stage.ids[None], k)  # [1, k]
            yield replace(stage, ids=rows[0], scores=scores[0])

    # -- files ------------------------------------------------------------------------------------
    @classmethod
    def load(cls, store_dir: Path) -> VectorIndex | None:
        """The live generation, or None when the store has no index yet."""
        folder = Path(store_dir) / "index"
        for _ in range(3):  # a writer may retire the generation between reading the pointer and files
            try:
                pointer = json.loads((folder / _POINTER).read_text())
            except FileNotFoundError:
                return None
            generation = pointer["generation"]
            try:
                index = faiss.read_index(str(folder / f"{generation}.faiss"))
                raw_ids = np.load(folder / f"{generation}.ids.npy")
                vectors = np.load(folder / f"{generation}.vec.npy")
            except (FileNotFoundError, RuntimeError):
                continue
            ivf = _ivf(index)
            if ivf is not None:
                ivf.nprobe = pointer.get("nprobe", ivf.nprobe)
            ids = [row.tobytes().hex() for row in raw_ids]
            return cls(ids, vectors, index, pointer["factory"], pointer["embedder"], generation)
        raise KvragError(f"the vector index in {folder} keeps changing or is damaged; run `kvrag index` again")

    def save(self, store_dir: Path) -> None:
        folder = Path(store_dir) / "index"
        folder.mkdir(parents=True, exist_ok=True)
        generation = f"g{int((live_generation(store_dir) or 'g0')[1:]) + 1:06d}"
        raw_ids = np.frombuffer(b"".join(bytes.fromhex(i) for i in self.ids), dtype=np.uint8).reshape(-1, 16)
        _atomic_write(folder / f"{generation}.faiss", lambda f: f.write(faiss.serialize_index(self.index).tobytes()))
        _atomic_write(folder / f"{generation}.ids.npy", lambda f: np.save(f, raw_ids))
        _atomic_write(folder / f"{generation}.vec.npy", lambda f: np.save(f, self.vectors))
        ivf = _ivf(self.index)
        pointer = {"generation": generation, "factory": self.factory, "embedder": self.embedder,
                   "count": len(self.ids), "dim": int(self.vectors.shape[1]),
                   "nprobe": ivf.nprobe if ivf is not None else None}
        _atomic_write(folder / _POINTER, lambda f: f.write(json.dumps(pointer, indent=1).encode()))
        self.generation = generation
        for path in folder.iterdir():  # retire older generations and temp files of crashed runs
            if path.name not in (_POINTER, _LOCK) and not path.name.startswith(generation + "."):
                path.unlink(missing_ok=True)


def index_bytes(store_dir: Path) -> int:
    """Bytes on disk of the live generation (index, id map and vectors)."""
    generation = live_generation(store_dir)
    if generation is None:
        return 0
    return sum(p.stat().st_size for p in (Path(store_dir) / "index").glob(f"{generation}.*"))


@contextmanager
def writer_lock(store_dir: Path) -> Iterator[None]:
    """One `kvrag index` at a time per store; readers never wait."""
    folder = Path(store_dir) / "index"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / _LOCK, "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise KvragError(f"another `kvrag index` is writing to {store_dir}; wait for it to finish") from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _base(factory: str) -> str:
    """The faiss factory of the stored index: without the `,RFlat` that VectorIndex itself applies."""
    return factory[:-len(REFINE)] if factory.endswith(REFINE) else factory


def _train_sample(index: faiss.Index, vectors: np.ndarray) -> np.ndarray:
    """What the index trains on [m, dim]: every vector, or a fixed-seed sample of
    max(TRAIN_PER_LIST x nlist, TRAIN_MIN) rows (a copy of that many rows only)."""
    ivf = _ivf(index)
    cap = max(TRAIN_PER_LIST * ivf.nlist, TRAIN_MIN) if ivf is not None else TRAIN_MIN
    if len(vectors) <= cap:
        return vectors
    rows = np.sort(np.random.default_rng(0).choice(len(vectors), cap, replace=False))  # [cap] sorted: one pass
    return vectors[rows]


def _faiss_message(exc: RuntimeError) -> str:
    return _FAISS_PREFIX.sub("", str(exc).strip()) or type(exc).__name__


def _ivf(index: faiss.Index):
    try:
        return faiss.extract_index_ivf(index)
    except RuntimeError:  # not an IVF index
        return None


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself must reach the disk before the pointer names it
    finally:
        os.close(dir_fd)
