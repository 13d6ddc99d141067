"""Cache-aware reordering of queued questions (RAGCache): the one with the most cached tokens per token
to compute goes first, so the hot paths are used while they are still cached.

No request is passed over more than `window` times: a request passed over (one that arrived later
was served before it) `window` times is served next. window = 0 is first come, first served.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


def order_priority(cached_tokens: int, compute_tokens: int) -> float:
    """RAGCache's OrderPriority = cached length / computation length."""
    return cached_tokens / max(compute_tokens, 1)


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
        oldest = self._waiting[0]
        if self.window == 0 or oldest.passed_over >= self.window:
            chosen = 0  # the oldest is served: nothing older is passed over
        else:
            chosen = max(range(len(self._waiting)), key=lambda i: (self.score(self._waiting[i].item), -i))
        for w in self._waiting[:chosen]:
            w.passed_over += 1
        return self._waiting.pop(chosen).item

    def max_passed_over(self) -> int:
        return max((w.passed_over for w in self._waiting), default=0)
