"""bench/cluster_sim.py: a tiny cluster by hand, chunk routing against round robin on a skewed load, the bounded load,
where routing stops paying (every tier holds the corpus), and determinism."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from kvrag.bench.cluster_sim import (
    ClusterSpec,
    Costs,
    Replica,
    format_table,
    replay_cluster,
    simulate_cluster,
    sweep,
    workload,
    zipf_ranks,
)
from kvrag.cluster.routing import BALANCE
from kvrag.kvcache.allocator import BlockLayout
from kvrag.store.tiers.cache import TieredKVCache
from kvrag.tests.tier_invariants import check_invariants

TINY = BlockLayout(1, 1, 1)  # 4 B a token: a 16-token chunk is one 64-B block


def spec(**kw) -> ClusterSpec:
    base = dict(replicas=2, n_chunks=10, requests=4, warmup=0, k=2, chunk_tokens=16, layout=TINY, host_bytes=1 << 20)
    return ClusterSpec(**{**base, **kw})


def test_by_hand_chunk_routing_keeps_a_repeated_set_on_one_replica():
    """Four arrivals of one chunk set, 10 s apart (each done before the next: no queue, load 0 at every decision).

    chunk: all four go where the first went (it then holds both chunks): misses 2, then exact 2 + 2 + 2 -> 6/8.
    round robin: r0, r1, r0, r1: each replica misses the set once, then reuses it once -> 4/8.
    """
    costs = Costs()
    sets, arrivals = [("a", "b")] * 4, [0.0, 10.0, 20.0, 30.0]
    cold, warm = costs.service(0, 0, 2), costs.service(2, 0, 0)
    got = replay_cluster(spec(policy="chunk"), arrivals, sets)
    assert got["hit_rate"] == got["exact_rate"] == 6 / 8
    assert got["imbalance"] == 2.0  # 4 requests on one replica, 0 on the other: max 4 over a mean of 2
    assert got["ttft_p50_s"] == pytest.approx(warm) and got["ttft_p90_s"] == pytest.approx(cold - 0.3 * (cold - warm))
    rr = replay_cluster(spec(policy="round_robin"), arrivals, sets)
    assert rr["hit_rate"] == rr["exact_rate"] == 4 / 8
    assert rr["imbalance"] == 1.0
    assert rr["ttft_p50_s"] == pytest.approx((cold + warm) / 2)  # TTFTs cold, cold, warm, warm
    assert np.isnan(got["peak_load"])  # never a request in flight per replica


def test_skewed_load_chunk_routing_beats_round_robin_within_the_load_bound():
    """Small tiers (about 30 chunks each), Zipf 1 over 2,000 chunks, more arrivals than the cluster serves cold.

    The cap admits a replica only while its in-flight < ceil(BALANCE x M / N), M the in-flight total with the new
    request; so the chosen one has at most ceil(BALANCE x M / N) < BALANCE x M / N + 1, which over the mean M / N is
    below BALANCE + N / M <= BALANCE + 1 wherever M >= N (where peak_load is taken)."""
    s = spec(replicas=4, n_chunks=2000, requests=2000, warmup=500, k=3, host_bytes=30 * 64, utilisation=1.2)
    load = workload(s)
    chunk = simulate_cluster(replace(s, policy="chunk"), load)
    even = simulate_cluster(replace(s, policy="chunk", balance=1.0), load)
    rr = simulate_cluster(replace(s, policy="round_robin"), load)
    assert chunk["hit_rate"] > 1.1 * rr["hit_rate"]  # 1.20-1.24x over seeds 0-2
    assert even["hit_rate"] > rr["hit_rate"]  # an even share spills more: 1.10x here
    assert 1.0 <= chunk["peak_load"] <= BALANCE + 1
    assert 1.0 <= even["peak_load"] <= 1.0 + 1
    unbounded = simulate_cluster(replace(s, policy="chunk", balance=1e9), load)
    assert unbounded["peak_load"] > BALANCE + 1  # without the cap the hot set's home takes the queue


def test_when_every_tier_holds_the_corpus_routing_stops_paying_in_hit_rate():
    s = spec(replicas=4, n_chunks=50, requests=400, warmup=100, k=3, host_bytes=1 << 20, preload=True)
    load = workload(s)
    got = {p: simulate_cluster(replace(s, policy=p), load) for p in ("chunk", "round_robin", "least_loaded")}
    assert {round(r["hit_rate"], 12) for r in got.values()} == {1.0}
    assert got["chunk"]["exact_rate"] >= got["round_robin"]["exact_rate"]  # whole questions still repeat per replica


def test_deterministic_under_a_seed():
    s = spec(replicas=3, n_chunks=100_000, requests=300, warmup=50, k=4, host_bytes=20 * 64)
    strip = lambda row: {k: v for k, v in row.items() if k != "wall_s"}  # noqa: E731
    for policy in ("chunk", "round_robin", "least_loaded"):
        one, two = (strip(simulate_cluster(replace(s, policy=policy))) for _ in range(2))
        assert one == two
    assert workload(s).sets != workload(replace(s, seed=1)).sets


def test_zipf_ranks_follow_the_law():
    rng = np.random.default_rng(0)
    ranks = zipf_ranks(rng, 1000, 1.0, 200_000)
    harmonic = (1.0 / np.arange(1, 1001)).sum()
    assert ranks.min() >= 0 and ranks.max() < 1000
    assert np.mean(ranks == 0) == pytest.approx(1 / harmonic, rel=0.03)
    assert np.mean(ranks == 9) == pytest.approx(0.1 / harmonic, rel=0.1)


def test_sweep_and_table():
    rows = sweep((2, 3), ("chunk", "round_robin"), n_chunks=500, requests=200, warmup=50, k=2, chunk_tokens=16,
                 layout=TINY, host_bytes=10 * 64)
    assert [(r["replicas"], r["policy"]) for r in rows] == [(2, "chunk"), (2, "round_robin"), (3, "chunk"),
                                                            (3, "round_robin")]
    assert rows[0]["vs_round_robin"] == pytest.approx(rows[0]["hit_rate"] / rows[1]["hit_rate"])
    table = format_table(rows)
    assert table.count("\n") == 5 and "| chunk | 2 | 500 |" in table


@pytest.mark.parametrize("policy", ["pgdsf", "lru"])
def test_heap_victim_cache_evicts_as_the_scan_does(policy):
    """The simulation's cache (heap-chosen victims) against TieredKVCache's own scan: same reads, same tree."""
    s = spec(n_chunks=300, requests=800, k=4, host_bytes=25 * 64, cache_policy=policy)
    fast, scan = Replica(s), Replica(s, cache_class=TieredKVCache)
    for chunks in workload(s).sets:
        assert fast.serve(chunks) == scan.serve(chunks)
    assert fast.cache.stats == scan.cache.stats and fast.cache.stats.evictions["host"] > 500
    assert sorted(n.path for n in fast.tree.nodes()) == sorted(n.path for n in scan.tree.nodes())
    assert fast.tree.counts == Counter(n.chunk_id for n in scan.tree.nodes())
    check_invariants(fast.cache)
