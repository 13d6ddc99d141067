"""Cache-aware reordering of queued questions (RAGCache): the one with the most cached tokens per token
to compute goes first, so the hot paths are used while they are still cached.

No request is passed over more than `window` times: a request passed over (one that arrived later
was served before it) `window` times is served next. window = 0 is first come, first served.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


def order_priority(cached_tokens: int, compute_tokens: int) -> float:
    """RAGCache's OrderPriority = cached length / computation length."""
    return cached_tokens / max(compute_tokens, 1)


def next_index(scores: Sequence[float], oldest_passed_over: int, window: int, oldest_first: bool = False) -> int:
    """Which of the waiting items (oldest first, `scores` theirs) to serve: the oldest (0) when the window is 0,
    when it was passed over `window` times already, or when it must go first (`oldest_first`: a preempted
    sequence); else the best score, the oldest among equals. The engine's scheduler and ReorderQueue both ask it."""
    if oldest_first or window == 0 or oldest_passed_over >= window:
        return 0
    return max(range(len(scores)), key=lambda i: (scores[i], -i))


@dataclass
class _Waiting(Generic[T]):
    item: T
    seq: int  # arrival order
    passed_over: int = 0


class ReorderQueue(Generic[T]):
    """`score(item)` is evaluated at each pop, so it sees the cache as it is then."""

    def __init__(self, score: Callable[[T], float], window: int = 32):
        if window < 0:
            raise ValueError(f"window must be >= 0, got {window}")
        self.score = score
        self.window = window
        self._waiting: list[_Waiting[T]] = []  # in arrival order
        self._seq = 0

    def __len__(self) -> int:
        return len(self._waiting)

    def push(self, item: T) -> None:
        self._waiting.append(_Waiting(item, self._seq))
        self._seq += 1

    def pop(self) -> T:
        if not self._waiting:
            raise IndexError("pop from an empty queue")
        scores = [self.score(w.item) for w in self._waiting] if self.window else []
        chosen = next_index(scores, self._waiting[0].passed_over, self.window)
        for w in self._waiting[:chosen]:
            w.passed_over += 1
        return self._waiting.pop(chosen).item

    def max_passed_over(self) -> int:
        return max((w.passed_over for w in self._waiting), default=0)
