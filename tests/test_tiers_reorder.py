"""Cache-aware reordering: best cached/compute ratio first, nobody passed over more than `window` times."""

from __future__ import annotations

import random

import pytest

from kvrag.store.tiers.reorder import ReorderQueue, order_priority


def test_order_priority():
    assert order_priority(600, 200) == 3.0
    assert order_priority(0, 100) == 0.0
    assert order_priority(50, 0) == 50.0


def test_best_ratio_first_ties_by_arrival():
    q = ReorderQueue(lambda item: item[1], window=10)
    for item in [("a", 0.5), ("b", 2.0), ("c", 0.5), ("d", 1.0)]:
        q.push(item)
    assert [q.pop()[0] for _ in range(4)] == ["b", "d", "a", "c"]
    with pytest.raises(IndexError):
        q.pop()


def test_window_zero_is_fifo():
    q = ReorderQueue(lambda item: item, window=0)
    for x in [1, 5, 3]:
        q.push(x)
    assert [q.pop() for _ in range(3)] == [1, 5, 3]


@pytest.mark.parametrize("window", [1, 3, 32])
def test_nobody_is_passed_over_more_than_window_times(window):
    rng = random.Random(window)
    q = ReorderQueue(lambda item: item[1], window=window)
    arrival = {}
    n = 0
    served = []
    for _ in range(400):
        for _ in range(rng.randint(0, 2)):
            item = (n, 0.0 if n % 5 == 0 else rng.random())  # every fifth is never preferred
            arrival[n] = n
            q.push(item)
            n += 1
        if len(q):
            assert q.max_passed_over() <= window
            served.append(q.pop()[0])
    while len(q):
        served.append(q.pop()[0])
    assert sorted(served) == list(range(n))
    for i, rid in enumerate(served):  # passed over = served after someone who arrived later
        later_before = sum(1 for other in served[:i] if other > rid)
        assert later_before <= window


def test_score_is_read_at_pop_time():
    state = {"hot": "b"}
    q = ReorderQueue(lambda item: 1.0 if item == state["hot"] else 0.0, window=5)
    for x in "abc":
        q.push(x)
    assert q.pop() == "b"
    state["hot"] = "c"
    assert q.pop() == "c"
