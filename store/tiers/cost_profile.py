"""Prefill time T(cached, new) on a grid, with bilinear interpolation (RAGCache's cost estimate).

Profiled once per machine and model (the caller passes a function that times one prefill, so this
module needs no model) and kept as JSON in `$KVRAG_HOME/profiles/`, keyed by what it depends on.
T(cached, 0) = 0 is implied; outside the grid the edge cells extrapolate linearly (prefill time is
close to linear in both counts over this range), never below 0.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvrag.errors import KvragError
from kvrag.home import kvrag_home

PROFILE_VERSION = 1


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

    # --- JSON ---------------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {"version": PROFILE_VERSION, "cached": list(self.cached), "new": list(self.new),
                "seconds": [list(r) for r in self.seconds], "meta": dict(self.meta)}

    @classmethod
    def from_dict(cls, d: dict) -> CostProfile:
        if d.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {d.get('version')}, expected {PROFILE_VERSION}")
        return cls(tuple(d["cached"]), tuple(d["new"]), tuple(tuple(float(t) for t in r) for r in d["seconds"]),
                   {str(k): str(v) for k, v in d.get("meta", {}).items()})

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        tmp.replace(path)  # atomic: a reader never sees half a profile

    @classmethod
    def load(cls, path: Path) -> CostProfile:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise KvragError(f"cannot read the cost profile {path}: {exc}") from None


def _segment(xs: Sequence[float], x: float) -> tuple[int, float]:
    """The grid cell [xs[i], xs[i+1]] to interpolate x in (the edge cell outside), and x's fraction in it."""
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    return i, (x - xs[i]) / (xs[i + 1] - xs[i])


def measure(time_prefill: Callable[[int, int], float], cached_grid: Sequence[int], new_grid: Sequence[int],
            repeats: int = 1, meta: dict[str, str] | None = None,
            on_cell: Callable[[int, int, float], None] | None = None) -> CostProfile:
    """Time `time_prefill(cached, new)` (seconds of one prefill) at every grid point.

    Makes `repeats` passes over the whole grid and keeps each point's fastest time: a burst of other
    work on the machine then spoils one pass of a few points, not every try of one point.
    """
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    best = [[float("inf")] * len(new_grid) for _ in cached_grid]
    for _ in range(repeats):
        for i, a in enumerate(cached_grid):
            for j, b in enumerate(new_grid):
                best[i][j] = min(best[i][j], time_prefill(a, b))
    if on_cell:
        for i, a in enumerate(cached_grid):
            for j, b in enumerate(new_grid):
                on_cell(a, b, best[i][j])
    info = {"measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "repeats": str(repeats), **(meta or {})}
    return CostProfile(tuple(cached_grid), tuple(new_grid), tuple(tuple(r) for r in best), info)


def profile_path(key: dict[str, str]) -> Path:
    """Where the profile for this key (model fingerprint, device, dtype, threads, ...) is kept."""
    digest = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=8).hexdigest()
    return kvrag_home() / "profiles" / f"prefill-{digest}.json"


def load_or_measure(key: dict[str, str], measure_fn: Callable[[], CostProfile],
                    path: Path | None = None, refresh: bool = False) -> CostProfile:
    """The cached profile for `key`, else `measure_fn()` saved for next time."""
    path = path or profile_path(key)
    if path.exists() and not refresh:
        profile = CostProfile.load(path)
        if all(profile.meta.get(k) == str(v) for k, v in key.items()):
            return profile
    profile = measure_fn()
    profile = CostProfile(profile.cached, profile.new, profile.seconds,
                          {**profile.meta, **{k: str(v) for k, v in key.items()}})
    profile.save(path)
    return profile
