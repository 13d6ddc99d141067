"""The faiss inner-product index over chunk embeddings, with its id map, in `<store>/index/`.

Each build is a generation: `gNNNNNN.faiss` (the index), `.ids.npy` (row -> chunk id, 16 bytes a
row) and `.vec.npy` (the normalised vectors, so an update never re-embeds kept chunks, whatever
the index type). Files are written under temp names and os.replace'd; `current.json`, replaced
last, names the live generation. A crash at any point leaves the previous generation live.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from kvrag import KvragError
from kvrag.corpus.staged_search import Stage, staged_search

# Exact search up to this many chunks. At 100k x 384 float32 the index is 150 MiB and a query scans
# it in a few ms on one core (see docs/performance.md): below the cost of the embedding and far below a prefill.
FLAT_MAX = 100_000
_POINTER = "current.json"
_LOCK = "lock"
_FAISS_PREFIX = re.compile(r"^Error in .*? at \S+:\d+: (Error: )?", re.S)  # C++ location, not for users


def choose_factory(n: int, override: str | None = None) -> str:
    """`--index-factory` if given; else Flat up to FLAT_MAX, IVF with ~4*sqrt(n) lists beyond.

    The list count is a power of two, so the factory (and the trained quantizer, which updates
    reuse) stays the same while the corpus grows, until it has about quadrupled.
    """
    if override:
        return override
    if n <= FLAT_MAX:
        return "Flat"
    return f"IVF{2 ** round(math.log2(4 * math.sqrt(n)))},Flat"


def check_factory(factory: str, dim: int) -> None:
    """Refuse a factory string faiss cannot parse before any work is done (training needs the vectors)."""
    try:
        faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        message = _FAISS_PREFIX.sub("", str(exc).strip()) or type(exc).__name__
        raise KvragError(f"bad --index-factory {factory!r}: {message}") from None


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
              previous: VectorIndex | None = None) -> VectorIndex:
        """A new index over `vectors`; an IVF/PQ index reuses `previous`'s training when it has the
        same factory and embedder (training is the slow part; adding is cheap)."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)  # [n, dim]
        try:
            if previous is not None and (previous.factory, previous.embedder) == (factory, embedder):
                index = faiss.clone_index(previous.index)
                index.reset()  # drops the vectors, keeps the trained quantizer
            else:
                index = faiss.index_factory(vectors.shape[1], factory, faiss.METRIC_INNER_PRODUCT)
            if not index.is_trained:
                index.train(vectors)
            index.add(vectors)
        except RuntimeError as exc:  # bad factory string, too few vectors to train on, ...
            message = _FAISS_PREFIX.sub("", str(exc).strip()) or type(exc).__name__
            raise KvragError(f"cannot build index {factory!r} on {len(ids)} vectors: {message}") from None
        ivf = _ivf(index)
        if ivf is not None:
            ivf.nprobe = default_nprobe(ivf.nlist)
        return cls(list(ids), vectors, index, factory, embedder)

    def search(self, queries: np.ndarray, k: int) -> list[list[tuple[str, float]]]:
        """Top-k (chunk id, inner product) per query row, best first."""
        if not self.ids or k < 1:
            return [[] for _ in range(len(queries))]
        scores, rows = self.index.search(np.ascontiguousarray(queries, dtype=np.float32), min(k, len(self.ids)))
        return [[(self.ids[r], float(s)) for s, r in zip(srow, rrow, strict=True) if r >= 0]
                for srow, rrow in zip(scores, rows, strict=True)]

    def search_staged(self, query: np.ndarray, k: int,
                      stages: int | Sequence[int] = 4) -> Iterator[tuple[Stage, list[tuple[str, float]]]]:
        """`search` of one query [dim] in stages (corpus/staged_search.py), each with its running top-k as
        (chunk id, inner product) hits, best first; the last stage's hits are `search`'s."""
        if not self.ids or k < 1:
            yield Stage(np.empty(0, np.int64), np.empty(0, np.float32), 0, True, True, 0.0), []
            return
        for stage in staged_search(self.index, query, min(k, len(self.ids)), stages=stages):
            yield stage, [(self.ids[r], float(s)) for s, r in zip(stage.scores, stage.ids, strict=True) if r >= 0]

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
        generation = f"g{_last_generation(folder) + 1:06d}"
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


def _ivf(index: faiss.Index):
    try:
        return faiss.extract_index_ivf(index)
    except RuntimeError:  # not an IVF index
        return None


def _last_generation(folder: Path) -> int:
    try:
        return int(json.loads((folder / _POINTER).read_text())["generation"][1:])
    except FileNotFoundError:
        return 0


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
