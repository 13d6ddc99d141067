"""Workloads beyond one question at a time, both computed from what the sequential runs measured.

Poisson arrivals (throughput as RAGCache defines it: the highest request rate served while TTFT stays
under a limit). The engine answers one question at a time, so a single FIFO server is simulated:
questions arrive at exponential gaps, each takes one measured (TTFT, whole-request time) pair of its
method, drawn at random over the items; a question's TTFT is its wait in the queue plus its measured
TTFT. The same arrivals and draws serve every method (common random numbers). This is a queueing
simulation over measured service times, not a live load test, and the report says so.

Memory tiers: a bookkeeping-only replay (real block tables, knowledge tree, policy and clocks; no
tensors) of a Zipf workload over the bench's passages through `TieredKVCache`, reporting hit rates per
tier and policy, and over a list of host-cache sizes. The engine does not read from the tiers yet, so
these hit rates are simulated, and the measured TTFTs above are without memory tiers.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from kvrag.bench.rag.metrics import percentile
from kvrag.errors import KvragError

STATS = ("mean", "median", "p90", "p99")


@dataclass(frozen=True)
class Service:
    ttft_s: float  # time to the first token with an idle server
    total_s: float  # how long the server is busy with the question (prefill, decode, write-back)


@dataclass(frozen=True)
class QueuePoint:
    rate: float  # offered questions/s
    mean_ttft_s: float
    median_ttft_s: float
    p90_ttft_s: float
    p99_ttft_s: float
    served_per_s: float  # completed questions / s over the run
    goodput_per_s: float  # questions/s whose TTFT met the limit
    within_limit: float  # share of questions whose TTFT met the limit
    utilisation: float

    def to_dict(self) -> dict:
        return asdict(self)

    def stat(self, name: str) -> float:
        return getattr(self, f"{name}_ttft_s")


@dataclass(frozen=True)
class PoissonSpec:
    rates: tuple[float, ...] = ()  # offered rates in questions/s; empty: spread up to the fastest capacity
    ttft_limit_s: float | None = None  # None: 3 x full prefill's median TTFT (or the slowest method's)
    stat: str = "mean"  # which TTFT statistic must meet the limit
    requests: int = 2000  # simulated arrivals per rate (the first 10 % warm the queue up, not counted)
    seed: int = 0

    def __post_init__(self) -> None:
        if any(r <= 0 for r in self.rates):
            raise KvragError(f"--rates must be positive questions/s, got {', '.join(map(str, self.rates))}")
        if self.ttft_limit_s is not None and self.ttft_limit_s <= 0:
            raise KvragError(f"--ttft-limit must be positive seconds, got {self.ttft_limit_s}")
        if self.stat not in STATS:
            raise KvragError(f"--ttft-stat must be one of {', '.join(STATS)}, got {self.stat}")
        if self.requests < 20:
            raise KvragError(f"--arrivals must be at least 20, got {self.requests}")


def simulate_queue(services: Sequence[Service], rate: float, requests: int, seed: int,
                   ttft_limit_s: float) -> QueuePoint:
    """One FIFO server under Poisson arrivals at `rate`; service drawn uniformly from `services`."""
    if not services:
        raise ValueError("no service times")
    rng = random.Random(seed)
    now = free = 0.0
    skip = requests // 10
    ttfts: list[float] = []
    busy = 0.0
    first_arrival = last_done = None
    for n in range(requests):
        now += rng.expovariate(rate)
        s = services[rng.randrange(len(services))]
        start = max(now, free)
        free = start + s.total_s
        if n >= skip:  # past the warm-up: count it
            first_arrival = now if first_arrival is None else first_arrival
            ttfts.append(start - now + s.ttft_s)
            busy += s.total_s
            last_done = free
    span = max(last_done - first_arrival, 1e-12)
    met = sum(t <= ttft_limit_s for t in ttfts)
    return QueuePoint(rate, statistics.fmean(ttfts), statistics.median(ttfts), percentile(ttfts, 90),
                      percentile(ttfts, 99), len(ttfts) / span, met / span, met / len(ttfts), min(1.0, busy / span))


def max_rate(services: Sequence[Service], ttft_limit_s: float, stat: str, requests: int, seed: int,
             steps: int = 20) -> float:
    """The highest Poisson rate whose TTFT `stat` stays within the limit (bisection; 0 if none does)."""
    capacity = 1.0 / statistics.fmean(s.total_s for s in services)
    lo, hi = 0.0, capacity
    if simulate_queue(services, capacity * 1e-3, requests, seed, ttft_limit_s).stat(stat) > ttft_limit_s:
        return 0.0  # even an idle server misses the limit
    for _ in range(steps):
        mid = (lo + hi) / 2
        if simulate_queue(services, mid, requests, seed, ttft_limit_s).stat(stat) <= ttft_limit_s:
            lo = mid
        else:
            hi = mid
    return lo


def poisson_workload(services: dict[str, list[Service]], spec: PoissonSpec, reference: str | None = "full") -> dict:
    """Per method: queue points at each rate and the throughput under the TTFT limit."""
    services = {name: s for name, s in services.items() if s}
    if not services:
        return {}
    limit = spec.ttft_limit_s
    if limit is None:
        ref = services.get(reference) or max(services.values(), key=lambda s: statistics.median(x.ttft_s for x in s))
        limit = 3 * statistics.median(s.ttft_s for s in ref)
    rates = spec.rates
    if not rates:  # up to just past the fastest method's capacity, so every curve bends
        top = max(1.0 / statistics.fmean(s.total_s for s in svc) for svc in services.values())
        rates = tuple(round(top * f, 6) for f in (0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.1))
    methods = {}
    for name, svc in services.items():
        methods[name] = {
            "capacity_qps": 1.0 / statistics.fmean(s.total_s for s in svc),
            "throughput_qps": max_rate(svc, limit, spec.stat, spec.requests, spec.seed),
            "points": [simulate_queue(svc, r, spec.requests, spec.seed, limit).to_dict() for r in rates],
        }
    return {
        "kind": "simulated single-server FIFO queue over measured service times (not a live load test)",
        "ttft_limit_s": limit, "ttft_stat": spec.stat, "rates_qps": list(rates), "arrivals": spec.requests,
        "warmup_arrivals": spec.requests // 10, "seed": spec.seed, "methods": methods,
    }
