"""The methods a bench compares, each a (mode, ratio) of the engine, parsed from --methods / --ratios.

    full         full prefill of the whole prompt (the reference)
    prefix       prefix caching: the first chunk's stored KV is an exact prefix, the rest is computed
    reuse        full KV reuse: every chunk's stored KV as is, only the question computed
    blend@R      CacheBlend at recompute ratio R (one method per --ratios entry; `blend@auto` too)
    RULE@R       a blend at ratio R ranking rows by another selection rule (blend/selection.py), e.g. query@0.1
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrag.blend.selection import SELECTION_RULES
from kvrag.errors import KvragError

FAMILIES = ("full", "prefix", "reuse", "blend")
DEFAULT_METHODS = "full,prefix,reuse,blend"
DEFAULT_RATIOS = "0.05,0.15,0.3,auto"


@dataclass(frozen=True)
class Method:
    name: str  # "full", "prefix", "reuse", "blend@0.15", "blend@auto"
    mode: str  # the engine's mode
    ratio: float | None = None  # blend only; None with auto
    auto: bool = False  # blend: CacheBlend's loading controller picks the ratio
    selection: str | None = None  # blend: the selection rule (None: the run's)

    def __post_init__(self) -> None:
        if self.mode not in FAMILIES:
            raise KvragError(f"unknown method {self.mode!r} (choose from {', '.join(FAMILIES)})")
        if self.mode == "blend" and not self.auto and (self.ratio is None or not 0 <= self.ratio <= 1):
            raise KvragError(f"a blend ratio must be between 0 and 1 or 'auto', got {self.ratio}")

    @property
    def label_ratio(self) -> str | None:
        """The ratio as written in names and tables: '0.15', 'auto', or None outside blend."""
        if self.mode != "blend":
            return None
        return "auto" if self.auto else f"{self.ratio:g}"


def blend_method(ratio: str, rule: str | None = None) -> Method:
    """blend@RATIO, or RULE@RATIO with a selection rule of its own."""
    text, prefix = ratio.strip().lower(), rule or "blend"
    if text == "auto":
        return Method(f"{prefix}@auto", "blend", None, auto=True, selection=rule)
    try:
        value = float(text)
    except ValueError:
        raise KvragError(f"--ratios takes numbers between 0 and 1 or 'auto', got {ratio!r}") from None
    if not 0 <= value <= 1:
        raise KvragError(f"--ratios takes numbers between 0 and 1 or 'auto', got {ratio!r}")
    return Method(f"{prefix}@{value:g}", "blend", value, selection=rule)


def parse_methods(methods: str = DEFAULT_METHODS, ratios: str = DEFAULT_RATIOS) -> list[Method]:
    """'full,prefix,reuse,blend' x '0.05,0.15,auto' -> methods in that order; 'blend@0.2' names one ratio."""
    out: dict[str, Method] = {}
    for token in (t.strip().lower() for t in methods.split(",")):
        if not token:
            continue
        if token == "blend":
            ratio_list = [r for r in ratios.split(",") if r.strip()]
            if not ratio_list:
                raise KvragError("--ratios is empty but --methods asks for blend")
            picked = [blend_method(r) for r in ratio_list]
        elif token.startswith("blend@"):
            picked = [blend_method(token.split("@", 1)[1])]
        elif "@" in token and token.split("@", 1)[0] in SELECTION_RULES:
            rule, ratio = token.split("@", 1)
            picked = [blend_method(ratio, rule)]
        elif token in FAMILIES:
            picked = [Method(token, token)]
        else:
            raise KvragError(f"unknown method {token!r} in --methods (choose from {', '.join(FAMILIES)}, "
                             f"blend@RATIO, or RULE@RATIO with RULE one of {', '.join(SELECTION_RULES)})")
        for m in picked:
            out.setdefault(m.name, m)
    if not out:
        raise KvragError("--methods is empty")
    return list(out.values())
