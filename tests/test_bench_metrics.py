"""Bench metrics against hand-worked cases: answer normalisation, F1/EM, KL, percentiles, methods."""

from __future__ import annotations

import math

import pytest
import torch

from kvrag.bench.rag.methods import parse_methods
from kvrag.bench.rag.metrics import (
    best_em,
    best_f1,
    distribution,
    exact_match,
    f1_score,
    kl_divergence,
    normalize_answer,
    percentile,
    top1_agrees,
)
from kvrag.errors import KvragError


@pytest.mark.parametrize("text, expected", [
    ("The Eiffel Tower", "eiffel tower"),
    ("  an   Apple, a day!", "apple day"),
    ("Theatre of the Absurd", "theatre of absurd"),  # 'the' inside a word stays
    ("U.S.A.", "usa"),
    ("A", ""),
    ("Hello\tworld\n", "hello world"),
])
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


def test_f1_hand_worked():
    # pred "the cat sat on mat" -> [cat, sat, on, mat]; gold "a cat on the mat" -> [cat, on, mat]
    # common 3: precision 3/4, recall 3/3, F1 = 2 * 0.75 * 1 / 1.75 = 6/7
    assert f1_score("the cat sat on mat", "a cat on the mat") == pytest.approx(6 / 7)
    # repeated tokens count by multiplicity: pred [paris, paris] vs gold [paris]: common 1, P 1/2, R 1, F1 2/3
    assert f1_score("Paris Paris", "Paris") == pytest.approx(2 / 3)
    assert f1_score("London", "Paris") == 0.0
    assert f1_score("The answer is: PARIS.", "paris") == pytest.approx(2 * (1 / 3) * 1 / (1 / 3 + 1))
    assert f1_score("", "") == 1.0 and f1_score("", "paris") == 0.0 and f1_score("the", "paris") == 0.0


def test_best_over_gold_answers():
    golds = ["Jan Smuts", "Smuts"]
    assert best_f1("General Smuts", golds) == pytest.approx(2 * 0.5 * 1 / 1.5)  # vs "smuts": P 1/2, R 1
    assert best_em("smuts!", golds) == 1.0 and exact_match("Smuts", "Jan Smuts") == 0.0
    assert best_f1("anything", []) is None and best_em("anything", []) is None


def test_kl_divergence_hand_worked():
    # P = (1/2, 1/2), Q = (1/4, 3/4): KL(P||Q) = 1/2 ln 2 + 1/2 ln(2/3)
    p = torch.log(torch.tensor([0.5, 0.5]))
    q = torch.log(torch.tensor([0.25, 0.75])) + 3.0  # logits: a constant shift changes nothing
    assert kl_divergence(p, q) == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3), rel=1e-6)
    assert kl_divergence(q, q) == 0.0
    assert kl_divergence(p, q) != pytest.approx(kl_divergence(q, p))  # not symmetric: the order matters
    big = torch.randn(49152, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert kl_divergence(big, big) == 0.0


def test_top1():
    assert top1_agrees(torch.tensor([0.1, 2.0, 0.3]), torch.tensor([0.0, 5.0, 4.9]))
    assert not top1_agrees(torch.tensor([0.1, 2.0, 0.3]), torch.tensor([0.0, 5.0, 5.1]))


def test_percentiles_linear_between_ranks():
    xs = [15, 20, 35, 40, 50]
    assert percentile(xs, 0) == 15 and percentile(xs, 100) == 50 and percentile(xs, 50) == 35
    assert percentile(xs, 40) == pytest.approx(29.0)  # rank 1.6: 20 + 0.6 * 15
    assert percentile(xs, 90) == pytest.approx(46.0)  # rank 3.6: 40 + 0.6 * 10
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)  # numpy's 'linear' gives the same
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_distribution_uses_vllm_names_in_ms():
    d = distribution([0.1, 0.2, 0.3, 0.4], "ttft")
    assert d["mean_ttft_ms"] == pytest.approx(250) and d["median_ttft_ms"] == pytest.approx(250)
    assert d["p90_ttft_ms"] == pytest.approx(370) and d["p99_ttft_ms"] == pytest.approx(397)
    assert d["std_ttft_ms"] == pytest.approx(math.sqrt(0.0125) * 1000)
    assert distribution([], "ttft") == {}


def test_parse_methods():
    names = [m.name for m in parse_methods("full,prefix,reuse,blend", "0.05,0.15,0.30,auto")]
    assert names == ["full", "prefix", "reuse", "blend@0.05", "blend@0.15", "blend@0.3", "blend@auto"]
    auto = parse_methods("blend@auto,blend@0.2", "")
    assert auto[0].auto and auto[0].ratio is None and auto[1].ratio == 0.2 and auto[1].label_ratio == "0.2"
    assert [m.name for m in parse_methods("full,full,blend", "0.1,.1")] == ["full", "blend@0.1"]
    for bad in (("magic", "0.1"), ("blend", "1.5"), ("blend", "x"), ("", "0.1"), ("blend", "")):
        with pytest.raises(KvragError):
            parse_methods(*bad)
