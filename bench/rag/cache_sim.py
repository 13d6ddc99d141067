"""Memory-tier hit rates for the bench: a bookkeeping-only replay through the tiers' own cache.

A Zipf workload (`bench.replay.zipf_requests`) over the bench's passages, each request k chunks
in retriever order plus a question suffix, replayed through `TieredKVCache(materialize=False)`: real
block tables, knowledge tree, replacement policy and clocks, no tensors. Per request the matched path
is reused exactly, chunks below the first miss are read from a tier that holds their stored KV or from
the store (to be blended), and the chunks below the match are inserted as the tiers' simulator does.
The engine does not read from these tiers yet: the hit rates are simulated, not measured in the runs.

PGDSF and GDSF weigh a chunk by its prefill cost: the profile T(cached, new) is fitted to this run's
measured prefill times (full prefill, prefix caching, full reuse) as a*new + b*new*(cached + new/2)
(per-token work plus attention over what came before), or a flat per-token cost when they are missing.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from kvrag.errors import KvragError
from kvrag.kvcache.allocator import BlockLayout
from kvrag.store.tiers.config import POLICIES, format_bytes
from kvrag.store.tiers.cost_profile import CostProfile

CACHED_GRID = (0, 1024, 2048, 4096, 8192, 16384)
NEW_GRID = (16, 256, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class CacheSpec:
    host_bytes: int = 4 << 30  # the chosen host-tier size
    gpu_bytes: int = 0  # a GPU tier above it (bookkeeping only, so it can be simulated anywhere)
    policy: str = "pgdsf"  # the chosen policy
    sizes: tuple[int, ...] = (256 << 20, 1 << 30, 4 << 30)  # host sizes for the hit-rate curve
    policies: tuple[str, ...] = POLICIES  # policies for the curve
    requests: int = 2000
    warmup: int = 500  # first requests fill the cache and are not counted
    k: int | None = None  # chunks per request (None: the items' median)
    zipf: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        for p in (self.policy, *self.policies):
            if p not in POLICIES:
                raise KvragError(f"unknown cache policy {p!r} (choose {', '.join(POLICIES)})")
        if self.requests < 1 or not 0 <= self.warmup < self.requests:
            raise KvragError(f"--cache-requests must exceed the warm-up ({self.warmup}), got {self.requests}")
        if self.host_bytes < 0 or self.gpu_bytes < 0 or any(s < 0 for s in self.sizes):
            raise KvragError("cache sizes must not be negative")
        if self.k is not None and self.k < 1:
            raise KvragError(f"--cache-k must be at least 1, got {self.k}")
        if self.zipf < 0:
            raise KvragError(f"--zipf must be >= 0, got {self.zipf}")


def fit_profile(points: Sequence[tuple[int, int, float]]) -> CostProfile:
    """T(cached, new) ~ a*new + b*new*(cached + new/2), least squares over (cached, new, seconds)."""
    rows = [(n, n * (c + n / 2), t) for c, n, t in points if n > 0 and t > 0]
    a = b = 0.0
    if len(rows) >= 2:
        s11 = sum(x * x for x, _, _ in rows)
        s12 = sum(x * y for x, y, _ in rows)
        s22 = sum(y * y for _, y, _ in rows)
        t1 = sum(x * t for x, _, t in rows)
        t2 = sum(y * t for _, y, t in rows)
        det = s11 * s22 - s12 * s12
        if det > 0:
            a, b = (t1 * s22 - t2 * s12) / det, (t2 * s11 - t1 * s12) / det
    if a < 0 or b < 0 or a == b == 0:  # keep what is physical: a flat per-token cost
        if not rows:
            return CostProfile.linear()
        a, b = sum(x * t for x, _, t in rows) / sum(x * x for x, _, _ in rows), 0.0
    seconds = tuple(tuple(a * n + b * n * (c + n / 2) for n in NEW_GRID) for c in CACHED_GRID)
    return CostProfile(CACHED_GRID, NEW_GRID, seconds,
                       {"kind": "fitted to this run", "a_s_per_token": f"{a:.3e}", "b_s_per_token_pair": f"{b:.3e}",
                        "points": str(len(rows))})


def replay(requests, layout: BlockLayout, profile: CostProfile, policy: str, host_bytes: int, gpu_bytes: int,
           preamble_tokens: int, warmup: int) -> dict:
    """Hit rates of one cache configuration over the requests after the warm-up."""
    from kvrag.store.tiers.cache import TieredKVCache
    from kvrag.store.tiers.lease import CacheStats

    cache = TieredKVCache(layout, host_bytes, gpu_bytes, policy, cost=profile, preamble_tokens=preamble_tokens,
                          materialize=False, gpu_device="cpu" if gpu_bytes else None)
    for n, req in enumerate(requests):
        if n == warmup:
            cache.stats = CacheStats()  # count from here on
        with cache.acquire(req.chunk_ids, req.lengths, req.suffix_tokens) as lease:
            cache.insert(lease)
    s = cache.stats
    chunks = max(s.chunks, 1)
    tokens = sum(sum(r.lengths) for r in requests[warmup:])
    out = {
        "policy": policy, "host_bytes": host_bytes, "gpu_bytes": gpu_bytes, "requests": s.requests,
        "prefix_hit_rate": s.prefix_hits / chunks,  # reused exactly (RAGCache's hit rate)
        "prefix_token_hit_rate": s.prefix_hit_tokens / max(tokens, 1),
        "store_read_rate": s.store_reads / chunks,
        "evictions": dict(s.evictions),
    }
    for tier, hits in s.memory_hits.items():
        if tier == "host" or gpu_bytes:
            out[f"{tier}_hit_rate"] = hits / chunks  # read from this tier (exact or to blend)
    out["memory_hit_rate"] = sum(s.memory_hits.values()) / chunks
    return out


def cache_section(pool: Sequence[tuple[str, int]], suffix_lengths: Sequence[int], k: int, layout: BlockLayout,
                  profile: CostProfile, preamble_tokens: int, spec: CacheSpec) -> dict:
    """The chosen configuration, every policy at it, and hit rate vs host size per policy."""
    from kvrag.bench.replay import WorkloadSpec, top_share, zipf_requests

    ids = [cid for cid, _ in pool]
    lengths = [n for _, n in pool]
    k = min(spec.k or k, len(ids))
    requests = zipf_requests(ids, lengths, list(suffix_lengths) or [40],
                             WorkloadSpec(spec.requests, k, spec.zipf, "rank", spec.seed))

    def run(policy: str, host: int, gpu: int) -> dict:
        return replay(requests, layout, profile, policy, host, gpu, preamble_tokens, spec.warmup)

    chosen = run(spec.policy, spec.host_bytes, spec.gpu_bytes)
    per_policy = [chosen if p == spec.policy else run(p, spec.host_bytes, spec.gpu_bytes) for p in spec.policies]
    curve = [run(p, size, 0) for size in spec.sizes for p in spec.policies]
    return {
        "kind": "simulated: bookkeeping-only replay of a Zipf workload through TieredKVCache (no tensors)",
        "workload": {"requests": spec.requests, "warmup": spec.warmup, "k": k, "zipf": spec.zipf, "seed": spec.seed,
                     "distinct_chunks": len(ids), "mean_chunk_tokens": statistics.fmean(lengths),
                     "top3pct_share": top_share(requests, 0.03), "preamble_tokens": preamble_tokens},
        "bytes_per_token": layout.bytes_per_token,
        "all_chunks_bytes": sum(layout.blocks_for(n) for n in lengths) * layout.bytes_per_block,
        "profile": profile.meta,
        "chosen": {**chosen, "host": format_bytes(spec.host_bytes), "gpu": format_bytes(spec.gpu_bytes)},
        "policies": per_policy,
        "hit_rate_vs_size": curve,
    }
