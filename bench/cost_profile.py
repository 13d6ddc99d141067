"""A measured cost profile T(cached, new) for `kvrag bench tiers`: timed on a grid once per machine and model (the
caller passes a function that times one prefill, so this module needs no model) and kept as JSON in
`$KVRAG_HOME/profiles/`, keyed by what it depends on. The profile itself (interpolation) is
store/tiers/cost_profile.py's; the engine uses a linear one."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvrag.errors import KvragError
from kvrag.home import kvrag_home
from kvrag.store.tiers.cost_profile import CostProfile

PROFILE_VERSION = 1


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
    """The kept profile for `key`, else `measure_fn()` saved for next time."""
    path = path or profile_path(key)
    if path.exists() and not refresh:
        profile = load_profile(path)
        if all(profile.meta.get(k) == str(v) for k, v in key.items()):
            return profile
    profile = measure_fn()
    profile = CostProfile(profile.cached, profile.new, profile.seconds,
                          {**profile.meta, **{k: str(v) for k, v in key.items()}})
    save_profile(profile, path)
    return profile


def save_profile(profile: CostProfile, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"version": PROFILE_VERSION, "cached": list(profile.cached), "new": list(profile.new),
                               "seconds": [list(r) for r in profile.seconds], "meta": dict(profile.meta)}, indent=1))
    tmp.replace(path)  # atomic: a reader never sees half a profile


def load_profile(path: Path) -> CostProfile:
    try:
        d = json.loads(Path(path).read_text())
        if d.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {d.get('version')}, expected {PROFILE_VERSION}")
        return CostProfile(tuple(d["cached"]), tuple(d["new"]), tuple(tuple(float(t) for t in r) for r in d["seconds"]),
                           {str(k): str(v) for k, v in d.get("meta", {}).items()})
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise KvragError(f"cannot read the cost profile {path}: {exc}") from None
