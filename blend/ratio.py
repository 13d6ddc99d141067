"""`--ratio auto`: how much of a prompt to recompute, from what its deviation asks and what the first token may cost.

RatioPolicy is `--ratio` (and the API's and the server's `ratio`) from end to end: a number, or auto, parsed once;
resolved per prompt into the BlendConfig the prefill runs; reported as the share a prompt recomputed.

Quality: each prompt recomputes, past the floor r* (DEFAULT_RATIO), until the kept rows hold AUTO_MASS of its deviation
score (`BlendConfig.deviation_mass`, decided at the first check). Cost: never past the largest share whose predicted
first token costs no more than r*'s would, or comes within TTFT_BUDGET_S: long prompts keep r*'s speed, short ones
(where blending's fixed costs already make it 0.36x full prefill) may recompute more. The profile
(compute time per layer as a function of rows, load time per layer per token for this codec) is measured once per
machine, model, dtype and codec and cached in the store's `meta` database. `ratio()` is CacheBlend's own loading
controller (the largest share whose recompute hides under the load), kept for comparison.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

from kvrag.blend.config import DEFAULT_RATIO, BlendConfig
from kvrag.errors import KvragError
from kvrag.model.transformer import Transformer
from kvrag.store.codec import decode, encode
from kvrag.store.env import StoreEnv

QUALITY_FLOOR = DEFAULT_RATIO  # auto never recomputes less than r*
AUTO = "auto"
SUFFIX_GUESS = 40  # question-suffix tokens assumed for the cost cap before the question is tokenized
AUTO_MASS = 0.75  # cross-passage tuning split, first 60 items: top-1 0.983, KL 0.031 (0.6: 0.95, 0.057)
TTFT_BUDGET_S = 0.5  # a first token within this is not worth trading answers for


@dataclass(frozen=True)
class RatioPolicy:
    """How much of a prompt a blend recomputes: `fixed` (a share in [0, 1]), or None for auto."""

    fixed: float | None = None

    @classmethod
    def parse(cls, value: str | float | None, option: str = "--ratio") -> RatioPolicy:
        """A number between 0 and 1, or 'auto' (None too); KvragError naming `option` otherwise."""
        if value is None or value == AUTO:
            return cls(None)
        try:
            share = float(value)
        except (TypeError, ValueError):
            share = -1.0
        if not 0.0 <= share <= 1.0:
            raise KvragError(f"{option} takes a number between 0 and 1 or '{AUTO}', got {value!r}")
        return cls(share)

    @property
    def auto(self) -> bool:
        return self.fixed is None

    def __str__(self) -> str:
        return AUTO if self.auto else f"{self.fixed:g}"

    def start(self, base: BlendConfig | None = None) -> BlendConfig:
        """The blend's settings before a prompt is seen: `base` (or the defaults) at this ratio (auto: r*)."""
        return replace(base or BlendConfig(), ratio=QUALITY_FLOOR if self.auto else self.fixed)

    def resolve(self, config: BlendConfig, profile: Callable[[], LoadComputeProfile], n_layers: int,
                chunk_tokens: int, suffix_tokens: int) -> BlendConfig:
        """The settings one prompt runs: as they are for a fixed ratio; for auto, from r* up until the kept rows
        hold AUTO_MASS of the deviation score, capped where the first token would cost more (budget_ratio, from
        this machine's `profile()`, asked for only here: it may be measured on first use)."""
        if not self.auto:
            return config
        cap = budget_ratio(profile(), n_layers, config.check_layer, chunk_tokens, suffix_tokens)
        return replace(config, ratio=QUALITY_FLOOR, deviation_mass=AUTO_MASS, max_ratio=cap)

    def report(self, ratio: float | None, chunk_tokens: int, recomputed: int) -> float | None:
        """The ratio an answer reports: the fixed one, or for auto the share this prompt recomputed."""
        if ratio is None or not self.auto or not chunk_tokens:
            return ratio
        return round(recomputed / chunk_tokens, 4)


@dataclass(frozen=True)
class LoadComputeProfile:
    compute_base_s: float  # per layer, independent of rows
    compute_per_row_s: float  # per layer, per computed row (at `keys` keys)
    load_per_token_s: float  # per layer, per loaded token: read + checksum + decompress + cast
    keys: int

    def ratio(self, chunk_tokens: int, suffix_tokens: int) -> float:
        """Largest share r with base + per_row * (r*C + S) <= load_per_token * C, floored at 0.15."""
        if chunk_tokens == 0:
            return 1.0
        load = self.load_per_token_s * chunk_tokens
        hidden_rows = (load - self.compute_base_s) / self.compute_per_row_s - suffix_tokens
        return float(min(1.0, max(QUALITY_FLOOR, hidden_rows / chunk_tokens)))


def budget_ratio(profile: LoadComputeProfile, n_layers: int, checked_layers: int, chunk_tokens: int,
                 suffix_tokens: int) -> float:
    """The largest recompute share whose predicted first token costs no more than the floor r* would, or fits
    within TTFT_BUDGET_S. Predicted per layer as base + per_row x rows: the layers up to the check compute every
    chunk row, the others r x chunk rows and the suffix."""
    if chunk_tokens == 0:
        return 1.0

    def blend(r: float) -> float:
        rest = profile.compute_base_s + profile.compute_per_row_s * (r * chunk_tokens + suffix_tokens)
        full = profile.compute_base_s + profile.compute_per_row_s * (chunk_tokens + suffix_tokens)
        return checked_layers * full + (n_layers - checked_layers) * rest

    budget = max(blend(QUALITY_FLOOR), TTFT_BUDGET_S)
    per_share = blend(1.0) - blend(0.0)  # linear in r
    return float(min(1.0, max(QUALITY_FLOOR, (budget - blend(0.0)) / per_share)))


def best_time(fn, repeats: int = 3) -> float:
    """The fastest of `repeats` runs of fn, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_profile(model: Transformer, codec: str, keys: int = 2048) -> LoadComputeProfile:
    c = model.cfg
    g = torch.Generator().manual_seed(0)
    k_all = torch.randn(keys, c.n_kv_heads, c.head_dim, generator=g).to(model.dtype)
    v_all = torch.randn(keys, c.n_kv_heads, c.head_dim, generator=g).to(model.dtype)
    key_pos = torch.arange(keys)

    def one_layer(rows: int) -> float:
        h = torch.randn(rows, c.hidden_size, generator=g).to(model.dtype)
        pos = torch.arange(keys - rows, keys)

        def run():
            qkv = model.project(1, h, pos)
            model.finish(1, h, model.attend(qkv.q, pos, k_all, v_all, key_pos, 1))

        with torch.inference_mode():
            run()
            return best_time(run)

    small, large = 32, 512
    t_small, t_large = one_layer(small), one_layer(large)
    per_row = max(1e-9, (t_large - t_small) / (large - small))
    base = max(0.0, t_small - per_row * small)

    tokens = 512
    raw = encode(np.random.default_rng(0).standard_normal((tokens, c.n_kv_heads, c.head_dim)).astype(np.float32),
                 np.random.default_rng(1).standard_normal((tokens, c.n_kv_heads, c.head_dim)).astype(np.float32),
                 codec)

    def load():
        d = decode(raw)
        torch.from_numpy(d.k).to(model.dtype), torch.from_numpy(d.v).to(model.dtype)

    return LoadComputeProfile(base, per_row, best_time(load) / tokens, keys)


def cached_profile(env: StoreEnv | None, model: Transformer, fingerprint: str, codec: str) -> LoadComputeProfile:
    """The profile for this model/dtype/codec/thread count, measured on first use and kept in `meta`."""
    key = f"profile/{fingerprint}/{codec}/{str(model.dtype)}/{torch.get_num_threads()}".encode()
    if env is not None:
        raw = env.read(lambda txn: txn.get(key, db=env.db("meta")))
        if raw is not None:
            return LoadComputeProfile(**json.loads(raw))
    profile = measure_profile(model, codec)
    if env is not None:
        env.write(lambda txn: txn.put(key, json.dumps(asdict(profile)).encode(), db=env.db("meta")))
    return profile
