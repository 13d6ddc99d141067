"""The Zipf workload over MuSiQue-style passages and the replay simulator (bookkeeping only, no model)."""

from __future__ import annotations

import pytest

from kvrag.bench.replay import (
    Corpus,
    Request,
    WorkloadSpec,
    chunk_id,
    simulate,
    top_share,
    zipf_requests,
)
from kvrag.bench.tiers import render, shortfalls
from kvrag.kvcache.allocator import BlockLayout
from kvrag.store.tiers.cost_profile import CostProfile

LAYOUT = BlockLayout(30, 3, 64)  # the default model: 23,040 B per token
PROFILE = CostProfile((0, 3000), (64, 3200), ((0.2, 6.0), (0.4, 17.0)))


def synthetic(n: int = 300) -> tuple[list[str], list[int]]:
    ids = [f"c{i}" for i in range(n)]
    return ids, [500 + (i * 37) % 200 for i in range(n)]


def test_corpus_keeps_each_distinct_passage_once_in_first_appearance_order(invented_items, tmp_path):
    import json

    path = tmp_path / "m.json"
    path.write_text(json.dumps(invented_items))
    corpus = Corpus.load(path)
    slots = [c["text"].strip() for item in invented_items for c in item["ctxs"]]
    assert len(set(slots)) < len(slots)  # the invented items share passages, as MuSiQue's do
    assert list(corpus.passages) == [t for n, t in enumerate(slots) if t not in slots[:n]]
    assert corpus.questions == tuple(item["question"] for item in invented_items)


@pytest.mark.benchmark_data
def test_corpus_from_musique(musique_path):
    corpus = Corpus.load(musique_path)
    assert len(corpus.passages) == 1255 and len(corpus.questions) == 150
    assert len({chunk_id(p) for p in corpus.passages}) == 1255


def test_zipf_requests_are_skewed_distinct_ordered_and_reproducible():
    ids, lengths = synthetic()
    spec = WorkloadSpec(n_requests=2000, k=5, zipf=1.0, seed=3)
    reqs = zipf_requests(ids, lengths, [40, 60], spec)
    assert reqs == zipf_requests(ids, lengths, [40, 60], spec)
    assert reqs != zipf_requests(ids, lengths, [40, 60], WorkloadSpec(n_requests=2000, seed=4))
    for r in reqs:
        assert len(set(r.chunk_ids)) == 5 and r.suffix_tokens in (40, 60)
        assert r.lengths == tuple(lengths[ids.index(c)] for c in r.chunk_ids)
    assert top_share(reqs, 0.03) > 0.2  # a uniform draw would give ~3 %
    assert top_share(zipf_requests(ids, lengths, [40], WorkloadSpec(n_requests=2000, zipf=0.0)), 0.03) < 0.06
    # rank order: the same pair of passages always comes in the same order
    seen: dict[frozenset, tuple] = {}
    for r in reqs:
        pair = frozenset(r.chunk_ids[:2])
        assert seen.setdefault(pair, r.chunk_ids[:2]) == r.chunk_ids[:2]
    with pytest.raises(ValueError):
        WorkloadSpec(order="random")
    with pytest.raises(ValueError):
        zipf_requests(ids[:3], lengths[:3], [40], WorkloadSpec(k=5))


def test_simulator_hand_case():
    """Three identical questions, room for everything: the 2nd and 3rd reuse all 2 chunks."""
    reqs = [Request(i, ("a", "b"), (100, 100), 50) for i in range(3)]
    r = simulate(reqs, LAYOUT, PROFILE, "pgdsf", 1 << 30, preamble_tokens=60)
    assert r.prefix_hit_rate == pytest.approx(4 / 6)
    expected = (PROFILE.time(60, 250) + 2 * PROFILE.time(260, 50)) / 3
    assert r.mean_ttft_s == pytest.approx(expected)
    r0 = simulate(reqs, LAYOUT, PROFILE, "pgdsf", 0, preamble_tokens=60)  # no room at all
    assert r0.prefix_hit_rate == 0.0 and r0.mean_ttft_s == pytest.approx(PROFILE.time(60, 250))


def test_bigger_caches_hit_more_and_reordering_helps_under_load():
    ids, lengths = synthetic()
    reqs = zipf_requests(ids, lengths, [50], WorkloadSpec(n_requests=800, seed=1))
    sizes = [64 << 20, 256 << 20, 1 << 30]
    for policy in ("pgdsf", "gdsf", "lru", "lfu"):
        rates = [simulate(reqs, LAYOUT, PROFILE, policy, s, warmup=200).prefix_hit_rate for s in sizes]
        assert rates == sorted(rates) and rates[-1] > rates[0]
    fifo = simulate(reqs, LAYOUT, PROFILE, "lru", 256 << 20, queue_depth=32)
    reordered = simulate(reqs, LAYOUT, PROFILE, "lru", 256 << 20, queue_depth=32, reorder=True, window=8)
    assert reordered.prefix_hit_rate > fifo.prefix_hit_rate
    assert reordered.max_passed_over <= 8 and reordered.requests == fifo.requests == 800


def test_ablation_report_helpers():
    ids, lengths = synthetic(50)
    reqs = zipf_requests(ids, lengths, [50], WorkloadSpec(n_requests=100, k=3))
    results = [simulate(reqs, LAYOUT, PROFILE, p, 64 << 20, reorder=r, queue_depth=8)
               for p in ("pgdsf", "lru") for r in (False, True)]
    report = {"workload": {**WorkloadSpec(n_requests=100, k=3).__dict__, "warmup": 0, "distinct_chunks": 50,
                           "mean_chunk_tokens": 600.0, "preamble_tokens": 65, "mean_suffix_tokens": 50.0,
                           "top3pct_share": top_share(reqs), "all_chunks_bytes": 1 << 30, "queue_depth": 8,
                           "reorder_window": 32},
              "profile": {"T(0,600)": 1.0, "T(3000,600)": 2.0, "T(0,3000)": 5.0},
              "results": [r.to_dict() for r in results], "pgdsf_shortfalls": shortfalls(results)}
    text = render(report)
    assert "64MiB pgdsf" in text and "reordered" in text


@pytest.mark.real_model
def test_kvrag_bench_tiers_replays_every_policy_and_size(monkeypatch, capsys, tmp_path, invented_items, smol):
    """`kvrag bench tiers` end to end over invented passages, with a kept profile (no prefill is timed): one
    result per size x policy x (FIFO, reordered), the same as replaying its own workload by hand."""
    import json

    from kvrag.bench.cost_profile import save_profile
    from kvrag.bench.tiers import profile_key
    from kvrag.model.prompt import PromptBuilder
    from kvrag.tests.conftest import run_cli_in_process

    data, profile = tmp_path / "m.json", tmp_path / "profile.json"
    data.write_text(json.dumps(invented_items))
    save_profile(CostProfile(PROFILE.cached, PROFILE.new, PROFILE.seconds, profile_key(smol, 1)), profile)
    code, out, err = run_cli_in_process(monkeypatch, capsys, "bench", "bench", "tiers", "--data", str(data),
                                        "--profile", str(profile), "--profile-layers", "1", "--requests", "60",
                                        "--warmup", "10", "-k", "2", "--sizes", "1MiB,64MiB",
                                        "--policies", "lru,pgdsf", "--json")
    assert code == 0, err
    report = json.loads(out)
    cells = [(r["host_bytes"], r["policy"], r["reorder"]) for r in report["results"]]
    assert cells == [(s, p, r) for s in (1 << 20, 64 << 20) for p in ("lru", "pgdsf") for r in (False, True)]
    builder, corpus = PromptBuilder(smol.load_tokenizer()), Corpus.load(data)
    requests = zipf_requests([chunk_id(t) for t in corpus.passages],
                             [len(builder.passage_ids("", t)) for t in corpus.passages],
                             [len(builder.build([], q).suffix) for q in corpus.questions],
                             WorkloadSpec(n_requests=60, k=2))
    layout = BlockLayout.for_codec(smol.config.n_layers, smol.config.n_kv_heads, smol.config.head_dim, "fp16")
    by_hand = simulate(requests, layout, PROFILE, "pgdsf", 64 << 20, preamble_tokens=len(builder.preamble_ids),
                       warmup=10, queue_depth=64)
    assert report["results"][6]["prefix_hit_rate"] == by_hand.prefix_hit_rate > 0
