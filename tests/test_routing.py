"""server/routing.py by hand: rendezvous homes, held chunks outweighing homes, the bounded-load cap, and the
properties consistent hashing promises (a chunk set always to one replica; a replica leaving moves only its own)."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from kvrag.server.routing import RoutingConfig, home, load_cap, rank, scores, weight

REPLICAS = ["r0", "r1", "r2"]


def test_weight_is_a_stable_hash_of_both_names():
    assert weight("c", "r0") == weight("c", "r0")
    assert weight("c", "r0") != weight("c", "r1")
    assert home("c", REPLICAS) == max(REPLICAS, key=lambda r: weight("c", r))


def test_scores_by_hand():
    homes = {c: home(c, REPLICAS) for c in ("a", "b")}
    held = {"r2": {"a"}}
    got = scores([("a", 100), ("b", 10)], REPLICAS, held, RoutingConfig(held=2.0))
    expected = dict.fromkeys(REPLICAS, 0.0)
    expected[homes["a"]] += 100
    expected[homes["b"]] += 10
    expected["r2"] += 200
    assert got == expected


def test_a_chunk_held_elsewhere_beats_its_home():
    chunk = "passage-7"
    owner = home(chunk, REPLICAS)
    warm = next(r for r in REPLICAS if r != owner)
    assert rank([(chunk, 50)], REPLICAS, {}, {})[0] == owner
    assert rank([(chunk, 50)], REPLICAS, {warm: {chunk}}, {})[0] == warm


def test_most_tokens_win():
    """A replica holding the long passage wins over one holding two short ones."""
    held = {"r0": {"short1", "short2"}, "r1": {"long"}}
    chunks = [("short1", 20), ("short2", 20), ("long", 300)]
    order = rank(chunks, REPLICAS, held, {})
    s = scores(chunks, REPLICAS, held)
    # r1: 600 held, plus what it is home to; r0: 80 held, plus at most every token as a home (340)
    assert order[0] == "r1" and s["r1"] >= 600 and s["r0"] <= 80 + 340


def test_no_chunks_goes_to_the_least_loaded():
    assert rank([], REPLICAS, {}, {"r0": 3, "r1": 0, "r2": 1})[0] == "r1"


def test_load_cap_by_hand():
    # 6 in flight + this one over 3 replicas, 25 % over an even share: ceil(1.25 * 7 / 3) = ceil(2.92) = 3
    assert load_cap({"r0": 4, "r1": 1, "r2": 1}, 3, 1.25) == 3
    assert load_cap({}, 2, 1.25) == 1


def test_a_replica_at_the_cap_is_passed_over():
    chunk = "hot"
    owner = home(chunk, REPLICAS)
    load = dict.fromkeys(REPLICAS, 0)
    load[owner] = 4  # cap = ceil(1.25 * 5 / 3) = 3
    order = rank([(chunk, 100)], REPLICAS, {owner: {chunk}}, load)
    assert order[-1] == owner and order[0] != owner


@pytest.mark.parametrize("balance", [1.0, 1.25, 2.0])
def test_one_hot_chunk_set_spreads_within_the_bound(balance):
    """Every request the same chunk set, none finishing: the bounded cap keeps every replica within it."""
    load = dict.fromkeys(REPLICAS, 0)
    for n in range(1, 61):
        load[rank([("hot", 100)], REPLICAS, {}, load, RoutingConfig(balance=balance))[0]] += 1
        assert max(load.values()) <= math.ceil(balance * n / 3)


def test_the_same_chunk_set_always_goes_to_the_same_replica():
    rng = random.Random(0)
    sets = [[(f"c{rng.randrange(1000)}", rng.randrange(50, 500)) for _ in range(5)] for _ in range(50)]
    for chunks in sets:
        first = rank(chunks, REPLICAS, {}, {})[0]
        assert all(rank(chunks, list(order), {}, {})[0] == first for order in itertools.permutations(REPLICAS))


def test_a_replica_leaving_moves_only_its_own_chunks():
    chunks = [f"chunk{i}" for i in range(2000)]
    before = {c: home(c, REPLICAS) for c in chunks}
    after = {c: home(c, ["r0", "r1"]) for c in chunks}
    moved = [c for c in chunks if before[c] != after[c]]
    assert moved and all(before[c] == "r2" for c in moved)
    assert abs(sum(1 for c in chunks if before[c] == "r2") / len(chunks) - 1 / 3) < 0.05  # homes spread evenly
