"""A blend's settings (BlendConfig): how many chunk rows to recompute, where, and by which selection rule."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvrag.blend import selection
from kvrag.config import DEFAULT_SELECTION
from kvrag.errors import KvragError

# r*: the share of chunk tokens a blend recomputes unless told otherwise, and the floor `--ratio auto` starts from
# (CacheBlend's 15 %; blend/ratio.py)
DEFAULT_RATIO = 0.15
DEVIATIONS = ("k", "v", "kv")
CHECK_LAYER = 1  # CacheBlend's: every row computed through layer 0, ranked at layer 1
# `query` ranked at layer 0: the same answers as at 1 on the tune split's 40 items, 0.04x full prefill's TTFT sooner
# (docs/answers.md, "Cheaper blends on the tune split")
PREVIEW_CHECK_LAYER = 0
WIDER_AT_CHECK = 1.5  # gradual filtering: the share kept at the check layer, as a multiple of the ratio
ATTENTION_WEIGHT = 4.0  # first 50 MuSiQue items, ratio 0.15: mean first-token KL 0.041 at 1, 0.037 at 2, 0.035 at 4


@dataclass(frozen=True)
class BlendConfig:
    ratio: float = DEFAULT_RATIO  # share of chunk tokens recomputed from the check layer on
    # layers before it are computed for every token; None: the rule's own (check_at): 1 for the rules that rank by
    # what the check layer computes, 0 for those that rank by the preview's reading, which need nothing computed
    # there (a layer-0 row's K/V does not depend on its context, so computing every row there buys nothing)
    check_layer: int | None = None
    deviation: str = "v"  # what ||fresh - loaded|| is measured on
    gradual: bool = True  # select 1.5x the share at the check layer, `ratio` at the next (CacheBlend's gradual filtering)
    # rank by deviation x (1 + attention_weight x how much the suffix reads the token / the mean): a token's
    # error reaches the answer through the question's attention to it; 0 ranks by deviation alone (see the
    # docs/performance.md's measurements for the default)
    attention_weight: float = ATTENTION_WEIGHT
    # reuse the first chunk's KV as loaded when it is exact there (it follows the preamble), as prefix caching
    # does, instead of computing its rows at the layers up to the check and ranking them
    exact_first_chunk: bool = True
    # recompute the first this-many tokens of every chunk after the first at the selected layers, whatever their
    # deviation (EPIC: the attention sink at each chunk's start carries much of a loaded chunk's error)
    chunk_start_rows: int = 0
    # with mass m > 0, the share kept at the last check grows past `ratio` until the kept rows hold m of the
    # selection score's total on its norm's scale (up to max_ratio): a prompt whose deviation is spread out gets more
    deviation_mass: float = 0.0
    max_ratio: float = 0.5
    # the rule that ranks chunk rows at a check (blend/selection.py's SELECTION_RULES); `chunks` ranks by deviation x
    # the question's reading of the row's chunk (docs/performance.md, issue 49)
    # None: the default, which an engine replaces with its model's checked rule (engine/model_check.py); a rule
    # named here is run as named
    selection: str | None = None
    # the layers a previewing rule's reading is taken over (0: all, as ProphetKV reads them; blend/preview.py): fewer
    # keep more of the load overlapped with the blend (QCFuse's critical layers; docs/performance.md)
    preview_layers: int = 0

    def __post_init__(self) -> None:
        for ok, message in (
            (0.0 <= self.ratio <= 1.0, f"--ratio must be between 0 and 1 (or auto), got {self.ratio}"),
            (self.check_layer is None or self.check_layer >= 0, f"--check-layer must be >= 0, got {self.check_layer}"),
            (self.deviation in DEVIATIONS, f"--deviation must be one of {', '.join(DEVIATIONS)}, got {self.deviation}"),
            (self.selection is None or self.selection in selection.SELECTION_RULES,
             f"--selection must be one of {', '.join(selection.SELECTION_RULES)}, got {self.selection}"),
            (0.0 <= self.attention_weight < math.inf,
             f"--attention-weight must be a number >= 0, got {self.attention_weight}"),
            (self.chunk_start_rows >= 0, f"--chunk-start-rows must be >= 0, got {self.chunk_start_rows}"),
            (self.preview_layers >= 0, f"preview_layers must be >= 0 (0: every layer), got {self.preview_layers}"),
            (0.0 <= self.deviation_mass < 1.0, f"--deviation-mass must be in [0, 1), got {self.deviation_mass}"),
        ):
            if not ok:
                raise KvragError(message)

    @property
    def check_at(self) -> int:
        """The first check layer: `check_layer`, or the rule's own (see the field)."""
        if self.check_layer is not None:
            return self.check_layer
        return PREVIEW_CHECK_LAYER if self.rule in selection.PREVIEW_RULES else CHECK_LAYER

    @property
    def rule(self) -> str:
        """The selection rule this blend runs: the one named, else DEFAULT_SELECTION."""
        return self.selection or DEFAULT_SELECTION

    def selection_schedule(self) -> dict[int, float]:
        """Layer -> share of chunk tokens kept after that layer's check."""
        first = self.check_at
        if not self.gradual or self.ratio >= 1.0:
            return {first: self.ratio}
        # start wider and narrow down to `ratio` at the next layer: every wider row at a check costs a blended layer's
        # row, so 1.5x over one layer saves one blended layer against 2x-1.5x (docs/performance.md, "selection defaults")
        return {first: min(1.0, self.ratio * WIDER_AT_CHECK), first + 1: self.ratio}
