"""The generated sets a model can answer (engine/answer_set.py), how an answer is scored, the Wilson interval the bench
reports them with, and `auto` from a model's own ratio (blend/ratio.py): hand-computed cases."""

from __future__ import annotations

import collections

import pytest

from kvrag.bench.rag.metrics import wilson
from kvrag.blend.config import BlendConfig
from kvrag.blend.ratio import RatioPolicy, budget_ratio
from kvrag.engine.answer_set import KINDS, is_right, make_items, same_answer


def _words(text: str) -> int:
    return len(text.split())


def test_items_are_deterministic_and_the_kinds_take_turns():
    a, b = make_items(8, 5, tokens=(600, 900)), make_items(8, 5, tokens=(600, 900))
    assert a == b and make_items(8, 6, tokens=(600, 900)) != a
    assert [it["kind"] for it in a] == [*KINDS, *KINDS]


def test_fact_records_never_stand_first_and_hold_the_answer():
    for it in make_items(24, 1, tokens=(600, 900)):
        facts = [it["ctxs"][i] for i in it["facts"]]
        assert 0 not in it["facts"] and len(facts) == {"lookup": 1, "bridge": 2, "comparison": 2}.get(it["kind"], len(facts))
        text = " ".join(c["text"] for c in facts)
        assert it["answers"][0] in text  # the gold value is written in a fact record
        texts = [c["text"] for c in it["ctxs"]]
        assert max(collections.Counter(texts).values()) == 1  # no passage twice in a prompt
        if it["kind"] == "aggregation":
            assert len(facts) >= 3


def test_two_record_items_come_in_both_orders():
    """Every other bridge has its founder's record before the organisation's, the others after it."""
    bridges = [it for it in make_items(16, 2, tokens=(600, 900)) if it["kind"] == "bridge"]
    first_is_org = [it["ctxs"][it["facts"][0]]["text"].startswith("The ") for it in bridges]
    assert first_is_org == [True, False, True, False]


def test_prompts_reach_their_token_target_and_look_alikes_share_the_template():
    count = _words
    for it in make_items(8, 3, tokens=(1500, 1800), count=count):
        total = sum(count(c["title"]) + count(c["text"]) for c in it["ctxs"])
        assert total >= 1500
    lookup = make_items(1, 4, tokens=(300, 400))[0]
    asked = lookup["ctxs"][lookup["facts"][0]]["text"]
    others = [c["text"] for c in lookup["ctxs"] if "kept a" in c["text"] and c["text"] != asked]
    assert len(others) == lookup["lookalikes"] >= 2  # records of other people, the same sentences
    assert all(value not in asked for value in lookup["wrong"])


@pytest.mark.parametrize(("answer", "golds", "wrong", "right"), [
    ("Tunvan", ["Tunvan"], [], True),
    ("Ragna Raldadahl's cat was named Tunvan.", ["Tunvan"], ["Gindtrol"], True),  # F1 0.29, the value named
    ("The Lortson League was founded earlier than the Libaus Club", ["Lortson League"], ["Libaus Club"], False),
    ("The Lortson League", ["Lortson League", "Lortson"], ["Libaus Club"], True),
    ("Gindtrol", ["Tunvan"], ["Gindtrol"], False),
    ("\n\nTunvan\nBecause the record says so", ["Tunvan"], [], True),  # the first non-empty line
    ("", ["Tunvan"], [], False),
])
def test_an_answer_is_right_when_it_names_the_value_and_no_look_alike(answer, golds, wrong, right):
    assert is_right(answer, golds, wrong) is right


def test_answers_agree_after_normalisation():
    assert same_answer("The Renwicke Society", "Renwicke Society.")
    assert not same_answer("Renwicke Society", "Renwicke Guild")


def test_wilson_interval_by_hand():
    """22 of 23 (the issue's figure): centre (p + z²/2n) / (1 + z²/n), half-width z·sqrt(p(1-p)/n + z²/4n²) / (1 +
    z²/n), z = 1.96: 0.790 to 0.992."""
    w = wilson(22, 23)
    assert w["share"] == pytest.approx(22 / 23)
    assert (round(w["low"], 3), round(w["high"], 3)) == (0.790, 0.992)
    assert wilson(0, 0)["share"] is None and wilson(5, 5)["high"] == 1.0 and wilson(0, 5)["low"] == 0.0


def test_auto_starts_from_the_models_own_ratio():
    """A 3,000-token prompt on 28 layers, check at layer 1: a full prefill of 430 tokens allows (28·430 - (3040 +
    27·40)) / (27·3000) = 0.0978 of the chunk rows; from a floor of 0.05 auto grows to that, from r* it stays at 0.15."""
    config = RatioPolicy(None).resolve(BlendConfig(), 28, 3000, 40, floor=0.05)
    assert config.ratio == 0.05 and config.max_ratio == pytest.approx((28 * 430 - 3040 - 27 * 40) / (27 * 3000))
    assert budget_ratio(28, 1, 3000, 40, 0.05) == pytest.approx(config.max_ratio)
    assert RatioPolicy(None).resolve(BlendConfig(), 28, 3000, 40).max_ratio == 0.15
    assert RatioPolicy(0.3).resolve(BlendConfig(ratio=0.3), 28, 3000, 40, floor=0.05).ratio == 0.3  # fixed: as asked
    assert RatioPolicy(None).start(floor=0.05).ratio == 0.05
