"""N replicas behind a router, simulated: where chunk-aware routing (cluster/routing.py) stops paying (issue #50).

Workload: a Zipf-popular RAG load over `n_chunks` chunks. A request's question has Zipf(s) popularity over a question
space as large as the corpus, so popular questions repeat with the same chunk set; each distinct question's k chunks
are drawn once from Zipf(s) over chunk popularity ranks (distinct, listed best rank first, the retriever order of
bench/replay.py). `bench.replay.zipf_requests` is not reused: it builds 10M weights and ids as Python lists. Here ranks
come from numpy (an inverse-CDF search over one float64 array) and only the ranks drawn are hashed to chunk ids.
Arrivals are Poisson at `utilisation` x the cluster's cold capacity (N / a question's all-miss service time).

Replicas: each a single FIFO server with its own memory tier, the real `TieredKVCache` in bookkeeping mode
(materialize=False: knowledge tree, PGDSF, block budget; no tensors; its victim scan replaced by an equivalent heap,
`HeapVictimCache`, for speed), driven as the engine drives it
(engine/chunk_source.py): acquire with stored KV in memory, insert the path, `put_stored` what was read from the
store, release. The cache is consulted when a request starts service, in queue order. Per request,
service = base + per chunk: exact reuse on the tree path, stored KV from memory (blended) or a store read (blended).

Policies: `chunk` (routing.rank; a replica's held set = the chunk ids its tree holds now, its load = requests queued
or in service), `round_robin`, and `least_loaded` (the less loaded of two replicas drawn at random).
Load balance: `imbalance` = requests served, max / mean replica; `peak_load` = at each routing with at least one
request in flight per replica, the chosen replica's in-flight over the mean (routing's cap keeps it < BALANCE + 1).
Run: `python -m kvrag.bench.cluster_sim --n-chunks 10000000`.
"""

from __future__ import annotations

import argparse
import functools
import heapq
import time
from collections import Counter, deque
from dataclasses import dataclass, field, replace

import numpy as np
import xxhash

from kvrag.cluster.routing import BALANCE, RoutingConfig, rank
from kvrag.kvcache.allocator import BlockLayout
from kvrag.store.tiers.cache import TieredKVCache
from kvrag.store.tiers.knowledge_tree import GPU, HOST, STORE, KnowledgeTree, Node

POLICIES = ("chunk", "round_robin", "least_loaded")
SMOLLM2_135M = BlockLayout(30, 3, 64)  # 23,040 B a token in fp16: the default model's KV


@dataclass(frozen=True)
class Costs:
    """Seconds of one request's TTFT: base + per chunk by where its KV comes from.

    From docs/performance.md, "`ask` over an object store" (5 chunks, 2,538-token prompts, blend@0.15): cold (KV in
    the object store) 2,375 ms; local tier (stored KV read locally, still blended) 2,225 ms = 0.94x; the same question
    again from the host tier's knowledge tree (whole path reused, nothing blended) 590 ms = 0.25x. Those fix
    base + 5 x per-chunk; the base is our split: the question suffix and first token, ~40 tokens at full prefill's
    3.6 ms a token (9,052 ms / 2,538 tokens) = 0.15 s. Blending, not fetching, is what costs: stored KV in memory
    saves only the read, so a memory hit pays only when it is on the reused path.
    """

    base_s: float = 0.15
    cost_hit_s: float = 0.088  # (0.590 - 0.15) / 5: reused exactly from the tree path
    cost_blend_s: float = 0.415  # (2.225 - 0.15) / 5: stored KV from memory, blended
    cost_miss_s: float = 0.445  # (2.375 - 0.15) / 5: read from the store, blended

    def service(self, exact: int, blended: int, missed: int) -> float:
        return self.base_s + exact * self.cost_hit_s + blended * self.cost_blend_s + missed * self.cost_miss_s

    def cold(self, k: int) -> float:
        return self.service(0, 0, k)


@dataclass(frozen=True)
class ClusterSpec:
    replicas: int = 8
    policy: str = "chunk"
    n_chunks: int = 10_000_000
    requests: int = 30_000
    warmup: int = -1  # requests not counted while the tiers fill; -1: a quarter
    k: int = 5  # chunks a question (`ask`'s top-k)
    zipf: float = 1.0  # popularity exponent s, of questions and of chunks
    chunk_tokens: int = 480  # ~2,538-token MuSiQue prompts over 5 chunks, less preamble and question
    host_bytes: int = 4 << 30  # `kvrag serve`'s default host tier
    utilisation: float = 0.9  # arrival rate over the cluster's capacity if every chunk missed
    costs: Costs = field(default_factory=Costs)
    cache_policy: str = "pgdsf"
    layout: BlockLayout = SMOLLM2_135M
    balance: float = BALANCE
    preload: bool = False  # every tier starts holding every chunk's stored KV (small corpora only)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.replicas < 1 or self.requests < 1 or not 1 <= self.k <= self.n_chunks:
            raise ValueError(f"bad cluster spec {self}")
        if self.warmup >= self.requests or self.utilisation <= 0 or self.zipf < 0:
            raise ValueError(f"bad cluster spec {self}")

    @property
    def counted_from(self) -> int:
        return self.requests // 4 if self.warmup < 0 else self.warmup


# --- workload -------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=2)
def _zipf_cdf(n: int, s: float) -> np.ndarray:
    cdf = np.arange(1, n + 1, dtype=np.float64)
    np.power(cdf, -s, out=cdf)
    np.cumsum(cdf, out=cdf)
    cdf /= cdf[-1]
    return cdf


def zipf_ranks(rng: np.random.Generator, n: int, s: float, size) -> np.ndarray:
    """Popularity ranks 0..n-1 with P(r) proportional to 1 / (r + 1)^s."""
    return np.minimum(np.searchsorted(_zipf_cdf(n, s), rng.random(size), side="right"), n - 1)


def chunk_id(rank_: int, seed: int = 0) -> str:
    """A chunk's id from its popularity rank, so ids carry no order the router's hash could see."""
    return xxhash.xxh3_64_hexdigest(int(rank_).to_bytes(8, "little"), seed=seed)


@dataclass(frozen=True)
class Workload:
    gaps: np.ndarray  # inter-arrival times at rate 1 (divided by the arrival rate per cluster)
    sets: list[tuple[str, ...]]  # per request: its chunk ids, best rank first


def workload(spec: ClusterSpec) -> Workload:
    """The requests of `spec` (independent of the replica count and policy, so a sweep shares them)."""
    rng = np.random.default_rng(spec.seed)
    questions = zipf_ranks(rng, spec.n_chunks, spec.zipf, spec.requests)
    distinct, which = np.unique(questions, return_inverse=True)
    ranks = np.sort(zipf_ranks(rng, spec.n_chunks, spec.zipf, (len(distinct), spec.k)), axis=1)
    while (dup := (np.diff(ranks, axis=1) == 0).any(axis=1)).any():  # k distinct chunks: redraw those rows
        ranks[dup] = np.sort(zipf_ranks(rng, spec.n_chunks, spec.zipf, (int(dup.sum()), spec.k)), axis=1)
    ids = {int(r): chunk_id(r, spec.seed) for r in np.unique(ranks)}
    per_question = [tuple(ids[int(r)] for r in row) for row in ranks]
    return Workload(rng.exponential(1.0, spec.requests), [per_question[i] for i in which])


# --- replicas -------------------------------------------------------------------------------------


class CountingTree(KnowledgeTree):
    """The knowledge tree, counting its nodes per chunk id: the replica's held set for the router, kept as it changes
    (`KnowledgeTree.held(limit)`, what a replica reports, walks the tree; its 4,096-id limit never binds at 4 GiB)."""

    def __init__(self, max_path_stats: int):
        super().__init__(max_path_stats)
        self.counts: Counter[str] = Counter()

    def add(self, parent, chunk_id, size):
        node = super().add(parent, chunk_id, size)
        self.counts[chunk_id] += 1
        return node

    def remove(self, node) -> None:
        super().remove(node)
        self.counts[node.chunk_id] -= 1
        if not self.counts[node.chunk_id]:
            del self.counts[node.chunk_id]


class HeapVictimCache(TieredKVCache):
    """TieredKVCache whose host victim comes from a lazy min-heap instead of a scan of every member: the same victim
    (the same unique key, over the same evictable leaves) in O(log n). A 4 GiB tier holds ~390 480-token nodes, and
    the scan was 60 % of the simulation. Entries go stale when a node's key changes (it gets a fresh one) or it
    leaves; a node that becomes a leaf again is pushed anew. tests/test_cluster_sim.py checks it against the scan."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._heap: list[tuple[tuple, Node]] = []

    @staticmethod
    def _key(node: Node) -> tuple:
        return node.priority[HOST], node.stats.last_access, -node.depth, node.seq

    def _push(self, node: Node) -> None:
        if HOST in node.tables:
            heapq.heappush(self._heap, (self._key(node), node))

    def _refresh(self, node: Node) -> None:
        super()._refresh(node)
        self._push(node)
        if len(self._heap) > 4 * len(self._members[HOST]) + 64:  # drop the stale entries
            self._heap = [(self._key(n), n) for n in self._members[HOST]]
            heapq.heapify(self._heap)

    def _victim(self, tier: str, skip: set[Node]) -> Node | None:
        if tier != HOST or GPU in self.pools:
            return super()._victim(tier, skip)
        aside, found = [], None
        while self._heap and found is None:
            key, node = entry = heapq.heappop(self._heap)
            if HOST not in node.tables or node.children or key != self._key(node):
                continue  # stale, or not a leaf now (pushed again when it is)
            aside.append(entry)  # still current: it stays, whether pinned or chosen (then stale once evicted)
            if not node.pins and node not in skip:
                found = node
        for entry in aside:
            heapq.heappush(self._heap, entry)
        return found

    def _evict(self, node: Node, tier: str) -> bool:
        parent = node.parent
        evicted = super()._evict(node, tier)
        if evicted and not node.alive and parent is not None and not parent.is_root and not parent.children:
            self._push(parent)  # a leaf now: evictable
        return evicted


class Replica:
    def __init__(self, spec: ClusterSpec, corpus: list[str] | None = None, cache_class=HeapVictimCache):
        self.cache = cache_class(spec.layout, spec.host_bytes, 0, spec.cache_policy, materialize=False)
        self.cache.tree = self.tree = CountingTree(self.cache.tree.max_path_stats)  # still empty: safe to swap
        self.tokens = spec.chunk_tokens
        self.queue: deque[int] = deque()
        self.busy = False
        for cid in corpus or ():
            self.cache.put_stored(cid, None, self.tokens)

    @property
    def in_flight(self) -> int:
        return len(self.queue) + self.busy

    def serve(self, chunks: tuple[str, ...]) -> tuple[int, int, int]:
        """Run one request through the tier as the engine does: (exact, blended from memory, read from store)."""
        cache = self.cache
        with cache.acquire(chunks, (self.tokens,) * len(chunks)) as lease:
            cache.insert(lease)
            missed = [cid for cid, tier in zip(chunks, lease.tiers, strict=True) if tier == STORE]
            for cid in missed:  # kept for the next question, wherever it stands in its prompt
                cache.put_stored(cid, None, self.tokens)
        return lease.matched, len(chunks) - lease.matched - len(missed), len(missed)


def _router(spec: ClusterSpec, replicas: list[Replica]):
    """policy -> a function (request id, chunk ids) -> replica index."""
    names = [f"r{i}" for i in range(len(replicas))]
    index = {name: i for i, name in enumerate(names)}
    held = {name: rep.tree.counts for name, rep in zip(names, replicas, strict=True)}
    config = RoutingConfig(balance=spec.balance)
    rng = np.random.default_rng(spec.seed + 1)

    def chunk(rid: int, chunks: tuple[str, ...]) -> int:
        load = {name: rep.in_flight for name, rep in zip(names, replicas, strict=True)}
        return index[rank([(c, spec.chunk_tokens) for c in chunks], names, held, load, config)[0]]

    def least_loaded(rid: int, chunks: tuple[str, ...]) -> int:
        a, b = rng.choice(len(replicas), 2, replace=False) if len(replicas) > 1 else (0, 0)
        return int(a if replicas[a].in_flight <= replicas[b].in_flight else b)

    return {"chunk": chunk, "round_robin": lambda rid, chunks: rid % len(replicas),
            "least_loaded": least_loaded}[spec.policy]


# --- the simulation -------------------------------------------------------------------------------


def replay_cluster(spec: ClusterSpec, arrivals, sets: list[tuple[str, ...]]) -> dict:
    """Route and serve requests arriving at `arrivals` (seconds, ascending) with chunk ids `sets`."""
    start = time.perf_counter()
    corpus = [chunk_id(r, spec.seed) for r in range(spec.n_chunks)] if spec.preload else None
    reps = [Replica(spec, corpus) for _ in range(spec.replicas)]
    route = _router(spec, reps)
    n = len(sets)
    where, tiers = np.zeros(n, dtype=np.int64), np.zeros((n, 3), dtype=np.int64)
    ttft, service, done = np.zeros(n), np.zeros(n), np.zeros(n)
    heap: list[tuple[float, int, int]] = []  # (departure, request, replica)
    peak = float("nan")  # stays so when the cluster never has a request in flight per replica

    def begin(r: int, now: float) -> None:
        rid = reps[r].queue.popleft()
        reps[r].busy = True
        tiers[rid] = reps[r].serve(sets[rid])
        service[rid] = spec.costs.service(*tiers[rid])
        done[rid] = now + service[rid]
        ttft[rid] = done[rid] - arrivals[rid]
        heapq.heappush(heap, (done[rid], rid, r))

    def drain(until: float) -> None:
        while heap and heap[0][0] <= until:
            now, _, r = heapq.heappop(heap)
            reps[r].busy = False
            if reps[r].queue:
                begin(r, now)

    for rid in range(n):
        drain(arrivals[rid])
        r = where[rid] = route(rid, sets[rid])
        reps[r].queue.append(rid)
        total = sum(rep.in_flight for rep in reps)
        if rid >= spec.counted_from and total >= spec.replicas:  # busy enough for "even" to mean >= 1 each
            peak = float(np.fmax(peak, reps[r].in_flight * spec.replicas / total))  # fmax skips the nan
        if not reps[r].busy:
            begin(r, arrivals[rid])
    drain(float("inf"))
    return _metrics(spec, np.asarray(arrivals), where, tiers, ttft, service, done, peak, time.perf_counter() - start)


def _metrics(spec: ClusterSpec, arrivals, where, tiers, ttft, service, done, peak: float, wall: float) -> dict:
    w = spec.counted_from
    tiers, asked = tiers[w:], max(len(tiers[w:]) * spec.k, 1)
    per_replica = np.bincount(where[w:], minlength=spec.replicas)
    span = max(done[w:].max() - arrivals[w], 1e-9)
    return {
        "policy": spec.policy, "replicas": spec.replicas, "n_chunks": spec.n_chunks, "requests": len(ttft) - w,
        "hit_rate": float(tiers[:, :2].sum() / asked),  # chunks served from a memory tier / chunks asked
        "exact_rate": float(tiers[:, 0].sum() / asked),  # of which reused exactly on the tree path
        "ttft_p50_s": float(np.percentile(ttft[w:], 50)), "ttft_p90_s": float(np.percentile(ttft[w:], 90)),
        "throughput_qps": float((len(ttft) - w) / span),
        "capacity_qps": float(spec.replicas / service[w:].mean()),  # saturated, were the load even
        "imbalance": float(per_replica.max() / per_replica.mean()),  # requests served, max / mean
        "peak_load": peak,  # max at routing of the chosen replica's in-flight / mean in-flight (mean >= 1)
        "offered_qps": spec.utilisation * spec.replicas / spec.costs.cold(spec.k), "wall_s": wall,
    }


def simulate_cluster(spec: ClusterSpec, load: Workload | None = None) -> dict:
    """One policy at one replica count; `load`: a workload(spec) to reuse."""
    load = load or workload(spec)
    rate = spec.utilisation * spec.replicas / spec.costs.cold(spec.k)
    return replay_cluster(spec, np.cumsum(load.gaps) / rate, load.sets)


def sweep(replicas=(8, 16, 32, 64), policies=("chunk", "round_robin"), *, progress=None, **spec) -> list[dict]:
    """simulate_cluster for every replica count and policy over one workload; chunk rows get `vs_round_robin`."""
    base = ClusterSpec(**spec)
    load = workload(base)
    rows = []
    for n in replicas:
        got = {p: simulate_cluster(replace(base, replicas=n, policy=p), load) for p in policies}
        if "chunk" in got and "round_robin" in got:
            got["chunk"]["vs_round_robin"] = got["chunk"]["hit_rate"] / max(got["round_robin"]["hit_rate"], 1e-9)
        for row in got.values():
            rows.append(row)
            if progress:
                progress(row)
    return rows


COLUMNS = (("policy", "policy", "{}"), ("replicas", "N", "{}"), ("n_chunks", "chunks", "{:,}"),
           ("hit_rate", "hit", "{:.3f}"), ("exact_rate", "exact", "{:.3f}"), ("vs_round_robin", "hit/rr", "{:.2f}"),
           ("ttft_p50_s", "p50 s", "{:.2f}"), ("ttft_p90_s", "p90 s", "{:.2f}"),
           ("throughput_qps", "q/s", "{:.1f}"), ("capacity_qps", "cap q/s", "{:.1f}"),
           ("imbalance", "max/mean", "{:.2f}"), ("peak_load", "peak", "{:.2f}"), ("wall_s", "wall s", "{:.0f}"))


def format_table(rows: list[dict]) -> str:
    """A markdown table of sweep rows."""
    lines = ["| " + " | ".join(h for _, h, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = [_cell(row.get(key), fmt) for key, _, fmt in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value, fmt: str) -> str:
    return "-" if value is None or value != value else fmt.format(value)  # value != value: nan


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", default="8,16,32,64")
    p.add_argument("--policies", default="chunk,round_robin")
    p.add_argument("--n-chunks", type=int, default=ClusterSpec.n_chunks)
    p.add_argument("--requests", type=int, default=ClusterSpec.requests)
    p.add_argument("--host-bytes", type=int, default=ClusterSpec.host_bytes)
    p.add_argument("--utilisation", type=float, default=ClusterSpec.utilisation)
    p.add_argument("--zipf", type=float, default=ClusterSpec.zipf)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    rows = sweep(tuple(int(x) for x in a.replicas.split(",")), tuple(a.policies.split(",")),
                 progress=lambda r: print(f"{r['policy']} N={r['replicas']}: hit {r['hit_rate']:.3f}, "
                                          f"{r['wall_s']:.0f} s", flush=True),
                 n_chunks=a.n_chunks, requests=a.requests, host_bytes=a.host_bytes, utilisation=a.utilisation,
                 zipf=a.zipf, seed=a.seed)
    print(format_table(rows))


if __name__ == "__main__":
    main()
