"""T(cached, new) profile: bilinear interpolation, edges; the bench's JSON cache, measuring through a callable."""

from __future__ import annotations

import json

import pytest

from kvrag.bench.cost_profile import load_or_measure, load_profile, measure, profile_path, save_profile
from kvrag.errors import KvragError
from kvrag.store.tiers.cost_profile import CostProfile


def bilinear(a: float, b: float) -> float:
    """A function bilinear interpolation reproduces exactly (and 0 at new = 0)."""
    return b * (2e-4 + 3e-8 * a)


GRID_A, GRID_B = (0, 500, 2000, 4000), (100, 1000, 3000)


def profile() -> CostProfile:
    return CostProfile(GRID_A, GRID_B, tuple(tuple(bilinear(a, b) for b in GRID_B) for a in GRID_A))


@pytest.mark.parametrize("a, b", [(0, 100), (500, 1000), (250, 550), (3999, 2999), (1234, 50), (0, 1),
                                  (4500, 3500), (8000, 6000)])
def test_bilinear_is_exact_inside_and_extrapolates_linearly(a, b):
    assert profile().time(a, b) == pytest.approx(bilinear(a, b), rel=1e-9)
    assert profile().per_token(a, b) == pytest.approx(bilinear(a, b) / b, rel=1e-9)


def test_interpolates_between_measured_points():
    p = CostProfile((0, 100), (10, 20), ((1.0, 3.0), (2.0, 6.0)))
    assert p.time(50, 15) == pytest.approx((2.0 + 4.0) / 2)  # centre of the cell: mean of its corners
    assert p.time(0, 5) == pytest.approx(0.5)  # between the implied T(., 0) = 0 and the first column
    assert p.time(10, 0) == 0.0 and p.per_token(10, 0) == 0.0
    assert p.time(-50, 10) >= 0.0


def test_validation():
    with pytest.raises(ValueError):
        CostProfile((0,), (10,), ((1.0,),))
    with pytest.raises(ValueError):
        CostProfile((0, 0), (10,), ((1.0,), (1.0,)))
    with pytest.raises(ValueError):
        CostProfile((0, 10), (0,), ((1.0,), (1.0,)))
    with pytest.raises(ValueError):
        CostProfile((0, 10), (5,), ((1.0, 2.0), (1.0,)))
    with pytest.raises(ValueError):
        CostProfile((0, 10), (5,), ((-1.0,), (1.0,)))


def test_measure_takes_the_fastest_repeat_and_caches_as_json(tmp_path):
    calls = []

    def timer(a: int, b: int) -> float:
        calls.append((a, b))
        disturbed = len(calls) <= len(GRID_A) * len(GRID_B) and (a + b) % 3 == 0  # some, in the first pass
        return bilinear(a, b) * (3.0 if disturbed else 1.0)

    def run() -> CostProfile:
        return measure(timer, GRID_A, GRID_B, repeats=2)

    key = {"model": "m1", "device": "cpu", "dtype": "bf16"}
    path = tmp_path / "p.json"
    p = load_or_measure(key, run, path)
    assert len(calls) == len(GRID_A) * len(GRID_B) * 2
    assert p.time(700, 700) == pytest.approx(bilinear(700, 700))
    assert p.meta["model"] == "m1" and "measured_at" in p.meta
    again = load_or_measure(key, run, path)  # from the file: nothing measured
    assert len(calls) == len(GRID_A) * len(GRID_B) * 2 and again == p
    load_or_measure({**key, "model": "m2"}, run, path)  # another model: measured again
    assert len(calls) == 2 * len(GRID_A) * len(GRID_B) * 2
    assert json.loads(path.read_text())["meta"]["model"] == "m2"


def test_profile_path_depends_on_key_and_home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path))
    a, b = profile_path({"model": "x"}), profile_path({"model": "y"})
    assert a != b and a.parent == tmp_path / "profiles"


def test_unreadable_profile_is_a_user_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(KvragError, match="cannot read the cost profile"):
        load_profile(bad)
    p = profile()
    save_profile(p, tmp_path / "ok.json")
    assert load_profile(tmp_path / "ok.json") == p
