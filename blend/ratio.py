"""`--ratio auto`: how much of a prompt to recompute, from what its deviation asks and what the first token may cost.

RatioPolicy is `--ratio` (and the API's and the server's `ratio`) from end to end: a number, or auto, parsed once;
resolved per prompt into the BlendConfig the prefill runs; reported as the share a prompt recomputed.

Quality: each prompt recomputes, past the floor r* (DEFAULT_RATIO), until the kept rows hold AUTO_MASS of its deviation
score (`BlendConfig.deviation_mass`, decided at the first check). Cost: never past the largest share whose first token
costs no more than r*'s would, or than a full prefill of TTFT_BUDGET_TOKENS tokens, nor past the share at which the
blend costs what a full prefill of the prompt does. Cost is counted in rows computed, a row being one token through
one layer: each layer's fixed cost is paid alike by the blend and the full prefill it is held against, so the caps
depend on the prompt's length and the model's layers alone, never on the machine or its load (docs/performance.md,
`--ratio auto`, where the constants below were measured). Profiles that earlier releases kept in a store's `meta`
are never read.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvrag.blend.config import DEFAULT_RATIO, BlendConfig
from kvrag.errors import KvragError

QUALITY_FLOOR = DEFAULT_RATIO  # auto never recomputes less than r*
AUTO = "auto"
SUFFIX_GUESS = 40  # question-suffix tokens assumed for the cost cap before the question is tokenized
AUTO_MASS = 0.75  # cross-passage tuning split, first 60 items: top-1 0.983, KL 0.031 (0.6: 0.95, 0.057)
TTFT_BUDGET_TOKENS = 430  # a first token no dearer than a full prefill of this many is not worth trading answers for
LOADED_ROW_COST = 0.15  # a chunk row a blend loads (copied, its key rotated), in rows computed through a layer
BLEND_ROW_COST = 2.5  # a chunk row a blend recomputes (gathered, put back, ranked), against a full prefill's row


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

    def start(self, base: BlendConfig | None = None, floor: float = QUALITY_FLOOR) -> BlendConfig:
        """The blend's settings before a prompt is seen: `base` (or the defaults) at this ratio (auto: the floor)."""
        return replace(base or BlendConfig(), ratio=floor if self.auto else self.fixed)

    def resolve(self, config: BlendConfig, n_layers: int, chunk_tokens: int, suffix_tokens: int,
                floor: float = QUALITY_FLOOR) -> BlendConfig | None:
        """The settings one prompt runs: as they are for a fixed ratio; for auto, from `floor` (r*, or the ratio the
        model's check chose: engine/answer_check.py) up until the kept rows hold AUTO_MASS of the deviation score,
        capped where the first token would cost more (budget_ratio) or where the blend would cost what a full prefill
        of the prompt costs (full_ratio). None: auto takes a full prefill, which costs less than a blend at the floor
        would."""
        if not self.auto:
            return config
        even = full_ratio(n_layers, config.check_at, chunk_tokens, suffix_tokens)
        if even < floor:
            return None
        cap = min(even, budget_ratio(n_layers, config.check_at, chunk_tokens, suffix_tokens, floor))
        return replace(config, ratio=floor, deviation_mass=AUTO_MASS, max_ratio=max(cap, floor))

    def report(self, ratio: float | None, chunk_tokens: int, recomputed: int) -> float | None:
        """The ratio an answer reports: the fixed one, or for auto the share this prompt recomputed."""
        if ratio is None or not self.auto or not chunk_tokens:
            return ratio
        return round(recomputed / chunk_tokens, 4)


def blend_cost(n_layers: int, checked_layers: int, chunk_tokens: int, suffix_tokens: int, ratio: float) -> float:
    """What a blend at `ratio` costs, in rows computed: every row through the layers to the check, then `ratio` of the
    chunk's (BLEND_ROW_COST each) and the suffix's; each chunk row it loads instead counts LOADED_ROW_COST of a row."""
    blended = n_layers - min(checked_layers, n_layers)
    recomputed = BLEND_ROW_COST * ratio * chunk_tokens
    computed = (n_layers - blended) * (chunk_tokens + suffix_tokens) + blended * (recomputed + suffix_tokens)
    return computed + LOADED_ROW_COST * blended * (1.0 - ratio) * chunk_tokens


def full_ratio(n_layers: int, checked_layers: int, chunk_tokens: int, suffix_tokens: int) -> float:
    """The share at which a blend costs what a full prefill of the same tokens does (n_layers x its rows; the
    preamble's KV is kept for both); past 1 a blend of any share costs less."""
    zero = blend_cost(n_layers, checked_layers, chunk_tokens, suffix_tokens, 0.0)
    per_share = blend_cost(n_layers, checked_layers, chunk_tokens, suffix_tokens, 1.0) - zero
    if per_share <= 0:  # no layer blends: every share costs the same
        return 1.0 if zero <= n_layers * (chunk_tokens + suffix_tokens) else 0.0
    return (n_layers * (chunk_tokens + suffix_tokens) - zero) / per_share


def budget_ratio(n_layers: int, checked_layers: int, chunk_tokens: int, suffix_tokens: int,
                 floor: float = QUALITY_FLOOR) -> float:
    """The largest recompute share whose first token costs no more than the floor's would, or than a full prefill
    of TTFT_BUDGET_TOKENS tokens, counted in rows computed (one token through one layer): each layer's fixed cost is
    paid alike by every blend and by that full prefill, so it drops out, and so does how fast the machine is."""
    blended = n_layers - min(checked_layers, n_layers)
    if chunk_tokens == 0 or blended == 0:  # no chunk, or every layer computes every row whatever the share
        return 1.0
    # a blend that recomputes nothing: the layers to the check compute every row, the others the suffix's
    nothing = (n_layers - blended) * (chunk_tokens + suffix_tokens) + blended * suffix_tokens
    # what a full prefill of TTFT_BUDGET_TOKENS computes beyond it, over a share's rows
    allowed = (n_layers * TTFT_BUDGET_TOKENS - nothing) / (blended * chunk_tokens)
    return float(min(1.0, max(floor, allowed)))  # the floor's own cost is always allowed
