"""The vector index at scale (issue 29): build time, memory, index bytes, single-query latency p50/p99 and
recall@10 against exact search, for the factory `kvrag index` would choose at that size and alternatives.

The vectors are bench/search.py's synthetic corpus (unit vectors in topic/sub-topic clusters), generated block
by block into the one array a store keeps; the queries are its `near` set. Each factory is built by
VectorIndex.build, the store's own build (sampled training, batched adding); the exact top-k is faiss's flat
inner-product search over the same vectors, a block at a time, merged.

    kvrag bench index [--n 1000000] [--dim 384] [--queries 1000] [--factory F ...] [--json]

Peak RSS is the process's high-water mark during one build (reset before each through /proc/self/clear_refs;
without it, the peak since the process started); `extra` is that peak less the RSS before the build, which
already holds the vectors: what the build itself costs.
"""

from __future__ import annotations

import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import faiss
import numpy as np

from kvrag.bench.search import SearchBenchConfig, _cpu, centres, corpus_block, query_set
from kvrag.corpus.vector_index import VectorIndex, check_factory, choose_factory, default_nlist

Progress = Callable[[str, int, int], None]  # (factory, vectors added, total)


@dataclass(frozen=True)
class IndexScaleConfig:
    n: int = 1_000_000
    dim: int = 384
    queries: int = 1000
    k: int = 10
    factories: tuple[str, ...] = ()  # (): the default at n, IVF-Flat and HNSW32
    topics: int = 1000
    subtopics: int = 16_000
    seed: int = 0
    block: int = 65_536  # rows generated, and searched exactly, at a time


def factories(cfg: IndexScaleConfig) -> tuple[str, ...]:
    """The factories measured: --factory as given, else `kvrag index`'s choice at n and two alternatives."""
    if cfg.factories:
        return cfg.factories
    return tuple(dict.fromkeys((choose_factory(cfg.n, dim=cfg.dim), f"IVF{default_nlist(cfg.n)},Flat", "HNSW32")))


def synthetic(cfg: IndexScaleConfig) -> tuple[np.ndarray, np.ndarray]:
    """The corpus [n, dim] (filled block by block: never whole twice) and the queries [queries, dim]."""
    search_cfg = SearchBenchConfig(count=cfg.n, dim=cfg.dim, topics=cfg.topics, subtopics=cfg.subtopics,
                                   queries=cfg.queries, seed=cfg.seed)
    subs = centres(search_cfg)  # [subtopics, dim]
    vectors = np.empty((cfg.n, cfg.dim), dtype=np.float32)
    for block in range(-(-cfg.n // cfg.block)):
        vectors[block * cfg.block:(block + 1) * cfg.block] = corpus_block(search_cfg, subs, block, cfg.block)
    return vectors, query_set(search_cfg, subs, "near")


def exact_topk(vectors: np.ndarray, queries: np.ndarray, k: int, block: int) -> np.ndarray:
    """Rows [queries, k] of the exact top-k by inner product: flat search of each block, merged."""
    heap = faiss.ResultHeap(len(queries), k, keep_max=True)
    for start in range(0, len(vectors), block):
        scores, rows = faiss.knn(queries, vectors[start:start + block], min(k, len(vectors) - start),
                                 metric=faiss.METRIC_INNER_PRODUCT)
        heap.add_result(np.ascontiguousarray(scores), np.ascontiguousarray(rows + start))
    heap.finalize()
    return heap.I


def measure(factory: str, vectors: np.ndarray, ids: list[str], queries: np.ndarray, truth: np.ndarray,
            k: int, progress: Progress) -> dict:
    """One factory: build (time, training time, peak and extra RSS), index bytes, latency and recall@k."""
    _reset_peak_rss()
    before, start, trained = _rss("VmRSS"), time.perf_counter(), []

    def report(added: int, total: int) -> None:
        if not trained:
            trained.append(time.perf_counter() - start)  # the first report comes once training is done
        progress(factory, added, total)

    index = VectorIndex.build(ids, vectors, factory, "synthetic", progress=report)
    build_s, peak = time.perf_counter() - start, _rss("VmHWM")
    with tempfile.TemporaryDirectory() as tmp:  # on disk, not serialised in memory: IVF-Flat's is GBs
        faiss.write_index(index.index, f"{tmp}/index.faiss")
        index_bytes = Path(f"{tmp}/index.faiss").stat().st_size
    latencies = _latencies(index, queries, k)
    rows = [{int(chunk_id, 16) for chunk_id, _ in hits} for hits in index.search(queries, k)]
    recall = statistics.fmean(len(found & set(exact.tolist())) / k for found, exact in zip(rows, truth, strict=True))
    ivf = faiss.try_extract_index_ivf(index.index)
    return {"factory": factory, "build_s": build_s, "train_s": trained[0] if trained else 0.0,
            "peak_rss_bytes": peak, "extra_rss_bytes": max(0, peak - before), "index_bytes": index_bytes,
            "nprobe": ivf.nprobe if ivf is not None else None,
            "p50_ms": 1e3 * float(np.percentile(latencies, 50)), "p99_ms": 1e3 * float(np.percentile(latencies, 99)),
            f"recall@{k}": recall}


def _latencies(index: VectorIndex, queries: np.ndarray, k: int) -> np.ndarray:
    """Seconds [queries] of one single-query `search` each, on one thread (a query's own cost, no OpenMP
    spinning on a busy machine), after a few untimed."""
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        for query in queries[:5]:
            index.search(query[None], k)
        times = []
        for query in queries:
            start = time.perf_counter()
            index.search(query[None], k)
            times.append(time.perf_counter() - start)
    finally:
        faiss.omp_set_num_threads(threads)
    return np.array(times)


def run(cfg: IndexScaleConfig, log: Callable[[str], None] = print,
        progress: Progress = lambda factory, added, total: None) -> dict:
    chosen = factories(cfg)
    for factory in chosen:  # a bad --factory fails before minutes of generating
        check_factory(factory, cfg.dim)
    start = time.perf_counter()
    vectors, queries = synthetic(cfg)
    log(f"{cfg.n:,} x {cfg.dim} vectors and {len(queries):,} queries in {time.perf_counter() - start:.0f} s")
    start = time.perf_counter()
    truth = exact_topk(vectors, queries, cfg.k, cfg.block)  # [queries, k]
    log(f"exact top-{cfg.k} in {time.perf_counter() - start:.0f} s")
    ids = [f"{row:032x}" for row in range(cfg.n)]  # the row, so a hit's id gives it back
    results = []
    for factory in chosen:
        results.append(measure(factory, vectors, ids, queries, truth, cfg.k, progress))
        log(render_row(results[-1], cfg.k))
    return {"config": asdict(cfg), "default": choose_factory(cfg.n, dim=cfg.dim), "cpu": _cpu(),
            "threads": faiss.omp_get_max_threads(), "vectors_bytes": int(vectors.nbytes), "results": results}


def render_row(r: dict, k: int) -> str:
    mib = 2 ** 20
    return (f"| {r['factory']} | {r['build_s']:.1f} ({r['train_s']:.1f}) | {r['peak_rss_bytes'] / mib:,.0f} "
            f"| {r['extra_rss_bytes'] / mib:,.0f} | {r['index_bytes'] / mib:,.1f} | {r['nprobe'] or '-'} "
            f"| {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r[f'recall@{k}']:.3f} |")


def markdown(report: dict) -> str:
    cfg, k = report["config"], report["config"]["k"]
    lines = [f"# Vector index at {cfg['n']:,} x {cfg['dim']} ({cfg['queries']:,} near queries, top-{k})", "",
             f"{report['cpu']}, {report['threads']} faiss threads. Default factory at this size: "
             f"`{report['default']}`. The kept vectors: {report['vectors_bytes'] / 2 ** 20:,.0f} MiB (in every "
             "build's RSS before it starts).", "",
             f"| factory | build s (training) | peak RSS MiB | build extra MiB | index MiB | nprobe | p50 ms "
             f"| p99 ms | recall@{k} |", "|---|---|---|---|---|---|---|---|---|"]
    return "\n".join(lines + [render_row(r, k) for r in report["results"]])


def _reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: the high-water mark restarts from now
    except OSError:
        pass


def _rss(field: str) -> int:
    """Bytes of /proc/self/status's VmRSS (now) or VmHWM (peak); elsewhere the peak from getrusage."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
