"""The simulated workloads: the Poisson queue against queueing theory, and the cache replay."""

from __future__ import annotations

import pytest

from kvrag.bench.rag.cache_sim import CacheSpec, cache_section, fit_profile
from kvrag.bench.rag.items import read_items, select
from kvrag.bench.rag.workloads import PoissonSpec, Service, max_rate, poisson_workload, simulate_queue
from kvrag.errors import KvragError
from kvrag.kvcache.allocator import BlockLayout


def test_md1_queue_matches_pollaczek_khinchine():
    """Deterministic service 1 s at rate 0.5: M/D/1 mean wait = rho / (2 mu (1 - rho)) = 0.5 s."""
    svc = [Service(ttft_s=0.2, total_s=1.0)]
    point = simulate_queue(svc, 0.5, 40000, seed=1, ttft_limit_s=10)
    assert point.mean_ttft_s == pytest.approx(0.2 + 0.5, rel=0.05)
    assert point.utilisation == pytest.approx(0.5, rel=0.05)
    assert point.served_per_s == pytest.approx(0.5, rel=0.05)
    idle = simulate_queue(svc, 1e-4, 2000, seed=1, ttft_limit_s=10)
    assert idle.mean_ttft_s == pytest.approx(0.2, abs=1e-3) and idle.within_limit == 1.0


def test_throughput_is_the_highest_rate_within_the_limit():
    svc = [Service(0.2, 1.0)]
    # mean TTFT = 0.2 + rho / (2 (1 - rho)) <= 0.7  <=>  rho <= 0.5
    rate = max_rate(svc, 0.7, "mean", 20000, seed=1)
    assert rate == pytest.approx(0.5, rel=0.06)
    assert max_rate(svc, 0.1, "mean", 1000, seed=1) == 0.0  # even an idle server is too slow
    fast = max_rate([Service(0.1, 0.5)], 0.7, "mean", 5000, seed=1)
    assert fast > rate


def test_poisson_workload_shape_and_defaults():
    services = {"full": [Service(1.0, 2.0), Service(1.2, 2.2)], "reuse": [Service(0.1, 1.1), Service(0.2, 1.2)]}
    out = poisson_workload(services, PoissonSpec(requests=400, seed=3))
    assert out["ttft_limit_s"] == pytest.approx(3 * 1.1)  # 3 x full prefill's median TTFT
    assert len(out["rates_qps"]) == 7
    for m in out["methods"].values():
        assert len(m["points"]) == 7 and m["throughput_qps"] <= m["capacity_qps"]
    assert out["methods"]["reuse"]["throughput_qps"] > out["methods"]["full"]["throughput_qps"]
    with pytest.raises(KvragError):
        PoissonSpec(rates=(0.0,))
    with pytest.raises(KvragError):
        PoissonSpec(stat="p50")


def test_fit_profile_recovers_the_cost_model():
    a, b = 2e-4, 3e-8
    points = [(c, n, a * n + b * n * (c + n / 2)) for c, n in ((0, 6000), (600, 5400), (6000, 40), (0, 1000))]
    profile = fit_profile(points)
    assert profile.time(0, 4096) == pytest.approx(a * 4096 + b * 4096 * 2048, rel=1e-6)  # on the grid
    assert profile.time(0, 6000) == pytest.approx(a * 6000 + b * 6000 * 3000, rel=0.05)  # bilinear between
    assert profile.time(4096, 1024) == pytest.approx(a * 1024 + b * 1024 * (4096 + 512), rel=1e-6)
    assert fit_profile([]).meta["kind"] == "linear"
    flat = fit_profile([(0, 100, 0.1), (0, 200, 0.2)])  # one direction only: a flat per-token cost
    assert flat.time(0, 300) == pytest.approx(0.3, rel=1e-6)


def test_cache_section_replays_every_policy_and_size():
    pool = [(f"c{i:03d}", 100 + i) for i in range(60)]
    layout = BlockLayout(n_layers=2, kv_heads=1, head_dim=8)  # 64 B per token
    spec = CacheSpec(host_bytes=64 * 2000, sizes=(64 * 500, 64 * 100_000), requests=300, warmup=50, seed=2)
    out = cache_section(pool, [30, 40], 4, layout, fit_profile([]), 20, spec)
    assert out["workload"]["k"] == 4 and out["workload"]["distinct_chunks"] == 60
    assert [p["policy"] for p in out["policies"]] == ["pgdsf", "gdsf", "lru", "lfu"]
    assert len(out["hit_rate_vs_size"]) == 8
    for r in out["policies"] + out["hit_rate_vs_size"]:
        assert 0 <= r["prefix_hit_rate"] <= r["memory_hit_rate"] + 1e-9 <= 1 + 1e-9
        assert r["requests"] == 250
        assert r["memory_hit_rate"] + r["store_read_rate"] == pytest.approx(1.0)
    big = [r for r in out["hit_rate_vs_size"] if r["host_bytes"] == 64 * 100_000]
    assert all(sum(r["evictions"].values()) == 0 and r["prefix_hit_rate"] > 0 for r in big)
    gpu = cache_section(pool, [30], 4, layout, fit_profile([]), 20,
                        CacheSpec(host_bytes=64 * 4000, gpu_bytes=64 * 1000, sizes=(), policies=("lru",),
                                  requests=200, warmup=20))
    assert "gpu_hit_rate" in gpu["chosen"]


def test_read_items_formats(tmp_path):
    (tmp_path / "q.txt").write_text("Who?\n\nWhat?\n")
    assert [i["question"] for i in read_items(tmp_path / "q.txt")] == ["Who?", "What?"]
    (tmp_path / "q.jsonl").write_text('{"question": "Q1", "answers": ["a"]}\n{"question": "Q2"}\n')
    assert len(read_items(tmp_path / "q.jsonl")) == 2
    (tmp_path / "bad.json").write_text('[{"q": 1}]')
    with pytest.raises(KvragError, match="needs a 'question'"):
        read_items(tmp_path / "bad.json")
    assert select(range(10), 3, 0, False) == [0, 1, 2]
    picked = select(range(10), 3, 5, True)
    assert picked == sorted(picked) and len(set(picked)) == 3 and picked == select(range(10), 3, 5, True)
