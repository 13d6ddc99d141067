"""`--ratio auto`'s cost cap (blend/ratio.py) by hand and its independence from the machine's speed and load: a moment's
load must not decide a store's answers for ever (issue 49)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass

import pytest

from kvrag.blend import ratio as ratio_module
from kvrag.blend.config import BlendConfig
from kvrag.blend.ratio import (
    AUTO_MASS,
    QUALITY_FLOOR,
    TTFT_BUDGET_TOKENS,
    RatioPolicy,
    blend_cost,
    budget_ratio,
    full_ratio,
)

LAYERS, CHECKED, SUFFIX = 30, 1, 40  # SmolLM2: 30 layers, the check at layer 1; the question suffix guessed


@dataclass(frozen=True)
class LoadComputeProfile:
    """A machine's seconds per layer (a fixed part and a part per row), as earlier releases measured and capped by."""

    compute_base_s: float
    compute_per_row_s: float
    load_per_token_s: float
    keys: int


IDLE = LoadComputeProfile(compute_base_s=0.003, compute_per_row_s=0.039e-3, load_per_token_s=0.002e-3, keys=2048)
SIZES = (1, 10, 50, 100, 250, 300, 430, 700, 1000, 1500, 2000, 2186, 2187, 3000, 6000, 20_000)


def scaled(profile: LoadComputeProfile, base: float, per_row: float) -> LoadComputeProfile:
    return LoadComputeProfile(profile.compute_base_s * base, profile.compute_per_row_s * per_row,
                              profile.load_per_token_s * per_row, profile.keys)


def test_the_cap_by_hand():
    """Counted in rows (a token through a layer). The budget: a full prefill of 430 tokens, 30 x 430 = 12,900 rows.
    A blend that recomputes nothing computes layer 0 for the chunk and suffix, the other 29 layers the suffix alone:
    C + 40 + 29 x 40 rows; each share r adds 29 r C rows."""
    assert TTFT_BUDGET_TOKENS == 430
    # short, 300 chunk tokens: 1,500 rows at share 0, 8,700 more at share 1; 12,900 allows all of it
    assert budget_ratio(LAYERS, CHECKED, 300, SUFFIX) == 1.0
    # 1,000 chunk tokens: 2,200 rows at share 0, 29,000 more at share 1; 12,900 allows 10,700 / 29,000
    assert budget_ratio(LAYERS, CHECKED, 1000, SUFFIX) == pytest.approx(10_700 / 29_000)
    # long, 6,000 chunk tokens: 7,200 rows at share 0; 12,900 allows 5,700 / 174,000 = 0.033, under r*: r*
    assert budget_ratio(LAYERS, CHECKED, 6000, SUFFIX) == QUALITY_FLOOR
    # where r* alone fills the budget: 12,900 = 5.35 C + 1,200, C = 2,186.9
    assert budget_ratio(LAYERS, CHECKED, 2186, SUFFIX) > QUALITY_FLOOR == budget_ratio(LAYERS, CHECKED, 2187, SUFFIX)
    # 10 layers, 1 before the check, 1,000 chunk rows, no suffix: 4,300 rows, 1,000 at share 0, 9,000 a share
    assert budget_ratio(10, 1, 1000, 0) == pytest.approx(3300 / 9000)
    assert budget_ratio(LAYERS, CHECKED, 0, SUFFIX) == 1.0  # no chunk
    assert budget_ratio(LAYERS, LAYERS, 6000, SUFFIX) == 1.0  # every layer computes every row anyway


def test_resolve_caps_auto_and_leaves_a_fixed_ratio_alone():
    config = BlendConfig(ratio=0.3)
    assert RatioPolicy(0.3).resolve(config, LAYERS, 1000, SUFFIX) is config
    auto = RatioPolicy.parse("auto").resolve(config, LAYERS, 1000, SUFFIX)
    assert auto.ratio == QUALITY_FLOOR and auto.deviation_mass == AUTO_MASS
    assert auto.max_ratio == min(budget_ratio(LAYERS, config.check_at, 1000, SUFFIX),
                                 full_ratio(LAYERS, config.check_at, 1000, SUFFIX))
    long = RatioPolicy.parse("auto").resolve(config, LAYERS, 6000, SUFFIX)  # the budget holds it at r*
    assert long.max_ratio == QUALITY_FLOOR
    short = RatioPolicy.parse("auto").resolve(config, LAYERS, 300, SUFFIX)  # the budget allows 1.0; a full prefill less
    assert short.max_ratio == full_ratio(LAYERS, config.check_at, 300, SUFFIX) < 1.0


def test_a_blend_costs_what_its_rows_cost_by_hand(monkeypatch):
    """300 chunk tokens, 40 of suffix, 30 layers, the check at 1; a recomputed chunk row 2.5 rows, a loaded one 0.15.
    Share 0: 340 + 29 x 40 computed, 29 x 300 loaded = 1,500 + 1,305; share 1: 340 + 29 x (750 + 40) = 23,250.
    A full prefill: 30 x 340 = 10,200 rows, reached at (10,200 - 2,805) / (23,250 - 2,805) = 0.3617."""
    monkeypatch.setattr(ratio_module, "BLEND_ROW_COST", 2.5)
    monkeypatch.setattr(ratio_module, "LOADED_ROW_COST", 0.15)
    assert blend_cost(LAYERS, CHECKED, 300, SUFFIX, 0.0) == pytest.approx(2805)
    assert blend_cost(LAYERS, CHECKED, 300, SUFFIX, 1.0) == pytest.approx(23_250)
    assert full_ratio(LAYERS, CHECKED, 300, SUFFIX) == pytest.approx(7395 / 20_445)
    assert full_ratio(LAYERS, CHECKED, 0, SUFFIX) == 1.0  # no chunk: nothing to weigh


def test_auto_takes_a_full_prefill_where_it_costs_less(monkeypatch):
    """Recomputed rows dear enough (7 rows each) that even r* costs more than a full prefill: auto says so (None)."""
    monkeypatch.setattr(ratio_module, "BLEND_ROW_COST", 7.0)
    assert full_ratio(LAYERS, CHECKED, 300, SUFFIX) < QUALITY_FLOOR
    assert RatioPolicy.parse("auto").resolve(BlendConfig(), LAYERS, 300, SUFFIX) is None
    assert RatioPolicy(0.15).resolve(BlendConfig(), LAYERS, 300, SUFFIX) is not None  # a fixed ratio is the user's


def predicted_cap(profile: LoadComputeProfile, chunk: int) -> float:
    """The cap as a profile's predicted seconds give it: the largest share whose first token (base + per_row x rows a
    layer) costs no more than r*'s or than a full prefill of TTFT_BUDGET_TOKENS tokens."""
    b, p = profile.compute_base_s, profile.compute_per_row_s

    def blend(r: float) -> float:
        return CHECKED * (b + p * (chunk + SUFFIX)) + (LAYERS - CHECKED) * (b + p * (r * chunk + SUFFIX))

    budget = max(blend(QUALITY_FLOOR), LAYERS * (b + p * TTFT_BUDGET_TOKENS))
    return min(1.0, max(QUALITY_FLOOR, (budget - blend(0.0)) / (blend(1.0) - blend(0.0))))


@pytest.mark.parametrize("base,per_row", [(1, 1), (9, 9), (20, 3), (1, 9), (0, 1)])
def test_no_profile_moves_the_cap(base, per_row):
    """Idle, every time 9x (a load average of 7 on 2 cores), a load that hits the fixed costs harder than the rows,
    or the reverse, or no fixed cost at all: the same cap for every prompt size, the one the seconds predict."""
    profile = scaled(IDLE, base, per_row)
    for chunk in SIZES:
        cap = budget_ratio(LAYERS, CHECKED, chunk, SUFFIX)
        assert predicted_cap(profile, chunk) == pytest.approx(cap, rel=1e-9), chunk
    short, long = budget_ratio(LAYERS, CHECKED, 250, SUFFIX), budget_ratio(LAYERS, CHECKED, 6000, SUFFIX)
    assert short == 1.0 and long == QUALITY_FLOOR  # short prompts may recompute more, long ones keep r*'s speed


PASSAGES = [
    ("Kelvar Point", "The lighthouse at Kelvar Point was lit in 1874 by Ingrid Halvorsen, who kept it for forty-one "
                     "winters and logged every ship that passed the reef in a green ledger."),
    ("Tomas Halvorsen", "Tomas Halvorsen, Ingrid's nephew, moved the lamp to the new granite tower in 1919 after the "
                        "old one cracked, and kept the light until it was automated in 1952."),
]
QUESTIONS = ("Who moved the lamp at Kelvar Point, and when?", "How long did Ingrid Halvorsen keep the light?")


@pytest.mark.real_model
def test_a_busy_machine_gives_the_same_answers(indexed_store, tmp_path):
    """The same prompts with `ratio auto`, once on an idle machine and once with every core kept busy: the same
    share recomputed and the same tokens, past r* on these short prompts (nothing on the path reads the clock)."""
    from kvrag import KVRag

    shares, tokens = {}, {}
    for busy in (False, True):
        store = tmp_path / f"store-{busy}"
        shutil.copytree(indexed_store, store)
        burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 if busy else 0)]
        try:
            with KVRag(store, dtype="float32", host_cache="0", preload_retriever=False) as rag:
                answers = [rag.ask(q, passages=PASSAGES, ratio="auto", max_tokens=4) for q in QUESTIONS]
        finally:
            for burner in burners:
                burner.kill()
                burner.wait()
        shares[busy] = [a.ratio for a in answers]
        tokens[busy] = [a.token_ids for a in answers]
        assert all(a.mode == "blend" and a.chunk_tokens < 200 for a in answers)
    assert shares[False] == shares[True] and tokens[False] == tokens[True]
    # past r* on a short prompt: a cap that followed a slow machine's seconds would have held it there (the former
    # rule did)
    assert max(shares[False]) > QUALITY_FLOOR, shares


@pytest.mark.real_model
def test_the_answer_says_auto_took_a_full_prefill(indexed_store, tmp_path, monkeypatch):
    """Where a blend would cost more rows than a full prefill, `ratio auto` runs the full prefill, and the answer says
    so (mode full, no ratio) with a full prefill's first token; a fixed ratio still blends."""
    from kvrag import KVRag

    store = tmp_path / "store"
    shutil.copytree(indexed_store, store)
    with KVRag(store, dtype="float32", host_cache="0", preload_retriever=False) as rag:
        full = rag.ask(QUESTIONS[0], passages=PASSAGES, mode="full", max_tokens=4)
        monkeypatch.setattr(ratio_module, "BLEND_ROW_COST", 7.0)
        auto = rag.ask(QUESTIONS[0], passages=PASSAGES, ratio="auto", max_tokens=4)
        fixed = rag.ask(QUESTIONS[0], passages=PASSAGES, ratio=0.15, max_tokens=4)
    assert auto.mode == "full" and auto.ratio is None and auto.token_ids == full.token_ids
    assert fixed.mode == "blend" and fixed.ratio == 0.15
