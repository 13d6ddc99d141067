"""How much vector-search time dynamic speculative pipelining (RAGCache §5.3) hides from TTFT.

A synthetic store-sized IVF index (default 1M x 384 unit vectors in topic/sub-topic clusters, the factory
`kvrag index` would choose, trained on a subsample) is built once and cached under --work. For a few hundred
queries it times the plain `index.search` and the staged search (corpus/staged_search.py), and counts when
the staged top-k first equals the final one. With speculation the prefill started at that stage is the one
kept, so the search time left in TTFT is the time to that stage; without it, the whole search.

    python -m kvrag.bench.search --work /tmp/kvrag-search-bench [--count 1000000] [--json]

Query sets: `near` (a question on a sub-topic the corpus covers), `far` (the same, vaguer), `random` (no
structure: the top-k is scattered over the lists, the worst case for speculation).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import faiss
import numpy as np

from kvrag.corpus.staged_search import staged_search
from kvrag.corpus.vector_index import check_factory, choose_factory, default_nprobe
from kvrag.errors import KvragError

IVF_FLAT_ALWAYS = 1 << 62  # choose_factory's PQ threshold out of reach: this bench stages and times IVF-Flat lists

QUERY_SPREAD = {"near": 1.0, "far": 2.0, "random": None}  # noise/centre norm ratio of a query; None: uniform


@dataclass(frozen=True)
class SearchBenchConfig:
    work: Path = Path("/tmp/kvrag-search-bench")
    count: int = 1_000_000
    dim: int = 384
    topics: int = 1000
    subtopics: int = 16_000
    spread: float = 1.0  # a vector's noise norm against its sub-topic centre's (cosine to it ~0.7)
    queries: int = 300
    k: int = 5
    nprobes: tuple[int, ...] = ()  # () : the store's default_nprobe and a quarter of it
    stages: tuple[int, ...] = (2, 4, 8)
    seed: int = 0
    factory: str | None = None  # None: what `kvrag index` would build (an IVF above 100k vectors)


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def centres(cfg: SearchBenchConfig) -> np.ndarray:
    """Sub-topic centres [subtopics, dim], each near one of `topics` directions (siblings ~0.67 cosine)."""
    rng = np.random.default_rng(cfg.seed)
    topics = _unit(rng.standard_normal((cfg.topics, cfg.dim)))
    offsets = _unit(rng.standard_normal((cfg.subtopics, cfg.dim)))
    return _unit(topics[rng.integers(cfg.topics, size=cfg.subtopics)] + 0.7 * offsets)


def around(rng: np.random.Generator, centre_rows: np.ndarray, spread: float) -> np.ndarray:
    """Unit vectors [n, dim] at `spread` x a unit noise direction from each given centre [n, dim]."""
    return _unit(centre_rows + spread * _unit(rng.standard_normal(centre_rows.shape)))


def corpus_block(cfg: SearchBenchConfig, subs: np.ndarray, block: int, size: int) -> np.ndarray:
    """Rows [block*size, ...) of the corpus, reproducible block by block (sub-topic sizes are skewed)."""
    rng = np.random.default_rng([cfg.seed, 1, block])
    weights = np.random.default_rng([cfg.seed, 2]).lognormal(0.0, 1.0, cfg.subtopics)
    rows = min(size, cfg.count - block * size)
    picks = rng.choice(cfg.subtopics, size=rows, p=weights / weights.sum())
    return around(rng, subs[picks], cfg.spread)


def build_index(cfg: SearchBenchConfig, subs: np.ndarray, log) -> faiss.Index:
    """The cached index, or a new one: trained on ~40 vectors a list (the first rows are a fair sample), then
    filled block by block so the corpus is never whole in memory twice."""
    factory = cfg.factory or choose_factory(cfg.count, pq_min=IVF_FLAT_ALWAYS)  # the staged bench times IVF-Flat
    shape = f"{cfg.count}x{cfg.dim}-t{cfg.topics}-s{cfg.subtopics}-sp{cfg.spread}-seed{cfg.seed}"
    path = cfg.work / f"{factory.replace(',', '_')}-{shape}.faiss"
    if path.exists():
        log(f"loading {path}")
        return faiss.read_index(str(path))
    check_factory(factory, cfg.dim)
    index = faiss.index_factory(cfg.dim, factory, faiss.METRIC_INNER_PRODUCT)
    if faiss.try_extract_index_ivf(index) is None:
        raise KvragError(f"{factory} is not an IVF index: nothing to stage (use over 100,000 vectors)")
    size, nlist = 100_000, faiss.extract_index_ivf(index).nlist
    if cfg.count < nlist:
        raise KvragError(f"{cfg.count} vectors cannot train {nlist} inverted lists")
    train = min(cfg.count, 40 * nlist)
    sample = np.concatenate([corpus_block(cfg, subs, b, size) for b in range(-(-train // size))])[:train]
    start = time.perf_counter()
    log(f"training {factory} on {train:,} of {cfg.count:,} vectors")
    index.train(sample)
    del sample
    for block in range(-(-cfg.count // size)):
        index.add(corpus_block(cfg, subs, block, size))
        log(f"  added {index.ntotal:,} ({time.perf_counter() - start:.0f} s)")
    cfg.work.mkdir(parents=True, exist_ok=True)
    faiss.write_index(index, str(path) + ".tmp")
    os.replace(str(path) + ".tmp", path)
    return index


def query_set(cfg: SearchBenchConfig, subs: np.ndarray, name: str) -> np.ndarray:
    """`cfg.queries` queries [q, dim] of one kind (see QUERY_SPREAD), independent of the corpus rows."""
    rng = np.random.default_rng([cfg.seed, 3, list(QUERY_SPREAD).index(name)])
    spread = QUERY_SPREAD[name]
    if spread is None:
        return _unit(rng.standard_normal((cfg.queries, cfg.dim)))
    return around(rng, subs[rng.integers(cfg.subtopics, size=cfg.queries)], spread)


def time_query(index: faiss.Index, query: np.ndarray, k: int, nprobe: int, stages: int,
               staged_first: bool) -> dict:
    """One query: plain search time, each stage's time, the stage whose top-k is final, prefills started."""
    params = faiss.SearchParametersIVF(nprobe=nprobe)

    def plain() -> tuple[float, np.ndarray]:
        start = time.perf_counter()
        _, ids = index.search(query[None], k, params=params)
        return time.perf_counter() - start, ids[0]

    if not staged_first:  # alternate the order so cache warmth favours neither side
        full_s, full_ids = plain()
    result, stage_s, spent = [], [], 0.0
    stages_left = staged_search(index, query, k, nprobe, stages)
    while True:  # the search's own time to each stage, the time between stages (the caller's) left out
        start = time.perf_counter()
        stage = next(stages_left, None)
        spent += time.perf_counter() - start
        if stage is None:
            break
        result.append(stage)
        stage_s.append(spent)
    if staged_first:
        full_s, full_ids = plain()
    settled = next(n for n, s in enumerate(result) if np.array_equal(s.ids, result[-1].ids))
    started = sum(n == 0 or not np.array_equal(s.ids, result[n - 1].ids) for n, s in enumerate(result))
    return {"full_s": full_s, "stage_s": stage_s, "settled": settled, "started": started,
            "exact": bool(np.array_equal(result[-1].ids, full_ids))}


def summarise(rows: list[dict]) -> dict:
    """Ratios over one (query set, nprobe, stages) cell; times as means (ms) over its queries."""
    full = statistics.fmean(r["full_s"] for r in rows)
    visible = statistics.fmean(r["stage_s"][r["settled"]] for r in rows)
    stage_ms = [1e3 * statistics.fmean(r["stage_s"][n] for r in rows) for n in range(len(rows[0]["stage_s"]))]
    return {"full_ms": 1e3 * full, "full_p50_ms": 1e3 * statistics.median(r["full_s"] for r in rows),
            "stage_ms": stage_ms, "staged_over_full": stage_ms[-1] / (1e3 * full),
            "first_stage_final": statistics.fmean(r["settled"] == 0 for r in rows),
            "visible_with_ms": 1e3 * visible, "visible_ratio": visible / full,
            "visible_ratio_p50": statistics.median(r["stage_s"][r["settled"]] / r["full_s"] for r in rows),
            "prefills_started": statistics.fmean(r["started"] for r in rows),
            "prefills_wasted": statistics.fmean(r["started"] - 1 for r in rows),
            "final_equals_search": statistics.fmean(r["exact"] for r in rows)}


def run(cfg: SearchBenchConfig, log=print) -> dict:
    subs = centres(cfg)
    index = build_index(cfg, subs, log)
    nlist = faiss.extract_index_ivf(index).nlist
    nprobes = cfg.nprobes or (max(1, default_nprobe(nlist) // 4), default_nprobe(nlist))
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)  # one query runs on one core anyway; no OpenMP spinning on a busy machine
    try:
        cells = []
        for name in QUERY_SPREAD:
            queries = query_set(cfg, subs, name)
            for nprobe in nprobes:
                for stages in cfg.stages:
                    for query in queries[:5]:
                        time_query(index, query, cfg.k, nprobe, stages, False)  # warm-up, not recorded
                    rows = [time_query(index, q, cfg.k, nprobe, stages, n % 2 == 1)
                            for n, q in enumerate(queries)]
                    cells.append({"queries": name, "nprobe": nprobe, "stages": stages, **summarise(rows)})
                    log(render_cell(cells[-1]))
    finally:
        faiss.omp_set_num_threads(threads)
    return {"config": {**asdict(cfg), "work": str(cfg.work)},
            "factory": cfg.factory or choose_factory(cfg.count, pq_min=IVF_FLAT_ALWAYS),
            "nlist": nlist, "cpu": _cpu(), "cells": cells}


def render_cell(c: dict) -> str:
    stages = " ".join(f"{t:.2f}" for t in c["stage_ms"])
    return (f"{c['queries']:>6} nprobe {c['nprobe']:>4} stages {c['stages']}: full {c['full_ms']:.2f} ms, "
            f"stages [{stages}] ms, first stage final {c['first_stage_final']:.0%}, visible with speculation "
            f"{c['visible_with_ms']:.2f} ms = {c['visible_ratio']:.2f} x full "
            f"(p50 {c['visible_ratio_p50']:.2f}), "
            f"prefills started {c['prefills_started']:.2f}, staged/full {c['staged_over_full']:.2f}, "
            f"exact {c['final_equals_search']:.0%}")


def _cpu() -> str:
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        model = "unknown"
    return f"{model}, {os.cpu_count()} cores"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=SearchBenchConfig.work)
    parser.add_argument("--count", type=int, default=SearchBenchConfig.count)
    parser.add_argument("--queries", type=int, default=SearchBenchConfig.queries)
    parser.add_argument("--k", type=int, default=SearchBenchConfig.k)
    parser.add_argument("--nprobe", type=lambda s: tuple(int(x) for x in s.split(",")), default=())
    parser.add_argument("--stages", type=lambda s: tuple(int(x) for x in s.split(",")),
                        default=SearchBenchConfig.stages)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    cfg = SearchBenchConfig(work=args.work, count=args.count, queries=args.queries, k=args.k,
                            nprobes=args.nprobe, stages=args.stages)
    try:
        report = run(cfg, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    except (KvragError, RuntimeError, OSError) as exc:  # faiss's RuntimeError: too few vectors to train, ...
        sys.exit(f"error: {str(exc).strip().splitlines()[-1]}")
    if args.json:
        print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
