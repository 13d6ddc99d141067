"""Prefill time T(cached, new) on a grid, with bilinear interpolation (RAGCache's cost estimate).

The engine's is linear (`CostProfile.linear`, from the last prefill's time per token); `kvrag bench tiers`
measures a grid once per machine and model (bench/cost_profile.py). T(cached, 0) = 0 is implied; outside the grid the edge cells extrapolate linearly (prefill time is
close to linear in both counts over this range), never below 0.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CostProfile:
    cached: tuple[int, ...]  # cached-token grid, ascending
    new: tuple[int, ...]  # new-token grid, ascending, all > 0
    seconds: tuple[tuple[float, ...], ...]  # [len(cached)][len(new)]: T(cached[i], new[j])
    meta: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if len(self.cached) < 2 or len(self.new) < 1:
            raise ValueError("a profile needs at least 2 cached-token points and 1 new-token point")
        if list(self.cached) != sorted(set(self.cached)) or list(self.new) != sorted(set(self.new)):
            raise ValueError("grid points must be strictly ascending")
        if self.cached[0] < 0 or self.new[0] <= 0:
            raise ValueError("cached counts must be >= 0 and new counts > 0")
        if len(self.seconds) != len(self.cached) or any(len(r) != len(self.new) for r in self.seconds):
            raise ValueError(f"seconds must be a {len(self.cached)} x {len(self.new)} grid")
        if any(t < 0 for row in self.seconds for t in row):
            raise ValueError("times must be >= 0")

    @classmethod
    def linear(cls, seconds_per_token: float = 1e-3) -> CostProfile:
        """A flat per-token cost: the fallback before anything was measured."""
        s = seconds_per_token
        return cls((0, 1 << 20), (1 << 20,), ((s * (1 << 20),), (s * (1 << 20),)), {"kind": "linear"})

    def time(self, cached: float, new: float) -> float:
        """T(cached, new) in seconds, bilinear between grid points."""
        if new <= 0:
            return 0.0
        xs = (0, *self.new)  # T(., 0) = 0
        i, tx = _segment(self.cached, cached)
        j, ty = _segment(xs, new)

        def at(a: int, b: int) -> float:
            return 0.0 if b == 0 else self.seconds[a][b - 1]

        low = at(i, j) * (1 - ty) + at(i, j + 1) * ty
        high = at(i + 1, j) * (1 - ty) + at(i + 1, j + 1) * ty
        return max(0.0, low * (1 - tx) + high * tx)

    def per_token(self, cached: float, new: float) -> float:
        """T(cached, new) / new: seconds per computed token (PGDSF's Cost/Size of one request)."""
        return self.time(cached, new) / new if new > 0 else 0.0


def _segment(xs: Sequence[float], x: float) -> tuple[int, float]:
    """The grid cell [xs[i], xs[i+1]] to interpolate x in (the edge cell outside), and x's fraction in it."""
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    return i, (x - xs[i]) / (xs[i + 1] - xs[i])
