"""A skewed question workload over the MuSiQue passages, and a replay simulator for the policy ablation.

Workload: the 1,255 distinct passages of musique_s.json get a popularity rank (a seeded shuffle) and
Zipf weights 1 / rank^s. A request draws k distinct passages by weight (without replacement) and lists
them best rank first — a retriever's stable relevance order, in which passages popular with many
questions come first — then a question suffix whose length is a real MuSiQue question's.

Simulator: the tiers' own bookkeeping (TieredKVCache with materialize=False: real block tables, tree,
policies, clocks; no tensors) replayed over the requests. A request's TTFT is the cost profile's
T(cached, new): cached = preamble + the matched path, new = every other chunk token + the suffix, as
in RAGCache, where a chunk below the first miss is recomputed. Nothing runs the model.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import xxhash

from kvrag.kvcache.allocator import BlockLayout
from kvrag.store.tiers.cache import TieredKVCache
from kvrag.store.tiers.cost_profile import CostProfile
from kvrag.store.tiers.knowledge_tree import MAX_PATH_STATS
from kvrag.store.tiers.reorder import ReorderQueue, order_priority

ORDERS = ("rank", "drawn")


@dataclass(frozen=True)
class Corpus:
    """Distinct passages (first-appearance order) and the questions of a MuSiQue-style file."""

    passages: tuple[str, ...]
    questions: tuple[str, ...]

    @classmethod
    def load(cls, path: Path) -> Corpus:
        items = json.loads(Path(path).read_text())
        seen: dict[str, None] = {}
        for item in items:
            for ctx in item["ctxs"]:
                seen.setdefault(ctx["text"].strip(), None)
        return cls(tuple(seen), tuple(item["question"] for item in items))


def chunk_id(text: str) -> str:
    return xxhash.xxh3_64_hexdigest(text.encode())


@dataclass(frozen=True)
class WorkloadSpec:
    n_requests: int = 4000
    k: int = 5  # chunks per question (`ask`'s default top-k)
    zipf: float = 1.0  # popularity exponent s
    order: str = "rank"  # "rank": best-ranked first; "drawn": in the order drawn
    seed: int = 0
    drift_every: int = 0  # > 0: popularity is re-ranked (a new shuffle) every this many requests

    def __post_init__(self) -> None:
        if self.n_requests < 1 or self.k < 1 or self.zipf < 0 or self.drift_every < 0:
            raise ValueError(f"bad workload spec {self}")
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {self.order!r}")


@dataclass(frozen=True)
class Request:
    rid: int
    chunk_ids: tuple[str, ...]
    lengths: tuple[int, ...]
    suffix_tokens: int


def zipf_requests(ids: Sequence[str], lengths: Sequence[int], suffix_lengths: Sequence[int],
                  spec: WorkloadSpec) -> list[Request]:
    """Requests whose chunks follow Zipf popularity over a seeded ranking of `ids`."""
    if spec.k > len(ids):
        raise ValueError(f"k={spec.k} but only {len(ids)} chunks")
    rng = random.Random(spec.seed)
    order = list(range(len(ids)))
    rng.shuffle(order)  # order[r] = the chunk of popularity rank r
    weights = [1.0 / (r + 1) ** spec.zipf for r in range(len(ids))]
    cum = _cumulative(weights)
    out = []
    for rid in range(spec.n_requests):
        if spec.drift_every and rid and rid % spec.drift_every == 0:
            rng.shuffle(order)  # what was popular no longer is
        ranks: list[int] = []
        while len(ranks) < spec.k:
            r = rng.choices(range(len(ids)), cum_weights=cum)[0]
            if r not in ranks:
                ranks.append(r)
        if spec.order == "rank":
            ranks.sort()
        chosen = [order[r] for r in ranks]
        out.append(Request(rid, tuple(ids[c] for c in chosen), tuple(lengths[c] for c in chosen),
                           suffix_lengths[rng.randrange(len(suffix_lengths))]))
    return out


def _cumulative(weights: Sequence[float]) -> list[float]:
    out, total = [], 0.0
    for w in weights:
        total += w
        out.append(total)
    return out


def top_share(requests: Sequence[Request], fraction: float = 0.03) -> float:
    """Share of chunk requests that go to the most requested `fraction` of the distinct chunks."""
    counts: dict[str, int] = {}
    for req in requests:
        for c in req.chunk_ids:
            counts[c] = counts.get(c, 0) + 1
    ranked = sorted(counts.values(), reverse=True)
    top = max(1, round(fraction * len(ranked)))
    return sum(ranked[:top]) / sum(ranked)


# --- replay ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SimResult:
    policy: str
    host_bytes: int
    reorder: bool
    window: int
    queue_depth: int
    requests: int  # counted (after warm-up)
    prefix_hit_rate: float  # chunks reused exactly / chunks asked (RAGCache's document hit rate)
    token_hit_rate: float  # chunk tokens reused exactly / chunk tokens asked
    mean_ttft_s: float  # mean T(cached, new) from the profile: the prefill part of TTFT
    mean_latency_s: float  # mean wait in the queue + prefill (closed loop of queue_depth questions)
    max_passed_over: int
    evictions: int
    wall_s: float

    def to_dict(self) -> dict:
        return asdict(self)


def simulate(requests: Sequence[Request], layout: BlockLayout, profile: CostProfile, policy: str,
             host_bytes: int, *, preamble_tokens: int = 0, reorder: bool = False, window: int = 32,
             queue_depth: int = 1, warmup: int = 0, remember_paths: int = MAX_PATH_STATS) -> SimResult:
    """Replay `requests` through a bookkeeping-only cache; the first `warmup` (by arrival) are not counted.

    Questions wait in a closed loop of `queue_depth`: whenever one is answered the next arrives, so
    the queue stays full (saturated). The scheduler serves them first come first served, or reordered.
    """
    start = time.perf_counter()
    cache = TieredKVCache(layout, host_bytes, 0, policy, cost=profile, preamble_tokens=preamble_tokens,
                          materialize=False, remember_paths=remember_paths)

    def score(req: Request) -> float:
        return order_priority(*cache.peek(req.chunk_ids, req.lengths, req.suffix_tokens))

    queue: ReorderQueue[tuple[Request, float]] = ReorderQueue(lambda rq: score(rq[0]), window if reorder else 0)
    stream = iter(requests)
    for req in _take(stream, queue_depth):
        queue.push((req, 0.0))
    now, hits, chunks, hit_tokens, tokens, ttft, latency, counted, passed = 0.0, 0, 0, 0, 0, 0.0, 0.0, 0, 0
    while len(queue):
        passed = max(passed, queue.max_passed_over())
        req, arrival = queue.pop()
        with cache.acquire(req.chunk_ids, req.lengths, req.suffix_tokens, use_base=False) as lease:
            t = profile.time(lease.cached_tokens, lease.new_tokens)
            cache.insert(lease)
        now += t
        if req.rid >= warmup:
            counted += 1
            hits += lease.matched
            chunks += len(req.chunk_ids)
            hit_tokens += sum(req.lengths[: lease.matched])
            tokens += sum(req.lengths)
            ttft += t
            latency += now - arrival
        for nxt in _take(stream, 1):
            queue.push((nxt, now))
    return SimResult(
        policy=cache.policy.name, host_bytes=host_bytes, reorder=reorder, window=window if reorder else 0,
        queue_depth=queue_depth, requests=counted,
        prefix_hit_rate=hits / max(chunks, 1), token_hit_rate=hit_tokens / max(tokens, 1),
        mean_ttft_s=ttft / max(counted, 1), mean_latency_s=latency / max(counted, 1),
        max_passed_over=passed, evictions=sum(cache.stats.evictions.values()),
        wall_s=time.perf_counter() - start,
    )


def _take(stream, n: int) -> list:
    out = []
    for item in stream:
        out.append(item)
        if len(out) == n:
            break
    return out


def sweep(requests: Sequence[Request], layout: BlockLayout, profile: CostProfile, policies: Sequence[str],
          sizes: Sequence[int], *, on_result: Callable[[SimResult], None] | None = None, **kwargs) -> list[SimResult]:
    """simulate() for every (size, policy)."""
    out = []
    for size in sizes:
        for policy in policies:
            result = simulate(requests, layout, profile, policy, size, **kwargs)
            out.append(result)
            if on_result:
                on_result(result)
    return out
