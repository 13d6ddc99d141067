"""Blending judged by its answers (`kvrag bench fidelity --set answerable`): long prompts the model can answer
(engine/answer_set.py), placed among MuSiQue passages of one split, and per method the share of full prefill's right
answers it keeps, with Wilson 95 % intervals.

    accuracy         right answers (the first line's F1 >= 0.5 against a gold answer), by kind
    kept             of the items full prefill answers right, the share this method answers right too
    turned right     of the items full prefill answers wrong, the share this method answers right
    agreement        normalized answers equal to full prefill's (its first line)

The split decides both the items' seed and the MuSiQue items whose passages fill the prompts: tune (0-49) or report
(50-99); the release check's items 100-149 are never read.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence

from kvrag.bench.rag.datasets import MUSIQUE_REPORT, MUSIQUE_TUNE
from kvrag.bench.rag.metrics import wilson
from kvrag.bench.rag.runner import BenchRun
from kvrag.engine.answer_set import KINDS, is_right, make_items, same_answer

SEEDS = {"tune": 1000, "report": 2000}  # the model check's own prompts use another (engine/model_check.py)


def answerable_items(musique: list[dict], split: str, n: int, tokens: tuple[int, int], count) -> list[dict]:
    """`n` generated items of `split`, their prompts filled with the split's MuSiQue passages to `tokens`."""
    indices = MUSIQUE_TUNE if split == "tune" else MUSIQUE_REPORT
    pool = sorted({(c.get("title") or "", c["text"]) for i in indices if i < len(musique) for c in musique[i]["ctxs"]})

    def filler(rng: random.Random) -> tuple[str, str]:
        return rng.choice(pool)

    return make_items(n, SEEDS[split], filler, tokens, count)


def summarize_answers(bench: BenchRun, meta: dict[int, dict]) -> dict[str, dict]:
    """Per method: accuracy, kept, turned right and agreement (each a Wilson interval), by kind too, and the median
    TTFT ÷ full prefill's. `meta`: item index -> its generated item (kind, wrong answers)."""
    golds = {it.index: (it.answers, meta[it.index].get("wrong", ())) for it in bench.items}
    kinds = {i: m["kind"] for i, m in meta.items()}
    full = {r.item: r for r in bench.by_method("full")}
    full_right = {i for i, r in full.items() if is_right(r.answer, *golds[i])}
    out = {}
    for m in bench.methods:
        runs = [r for r in bench.by_method(m.name) if r.item in full]
        right = {r.item for r in runs if is_right(r.answer, *golds[r.item])}
        ratios = [r.ttft_ratio_to_full for r in runs if r.ttft_ratio_to_full is not None]
        out[m.name] = {"items": len(runs), **_shares(runs, right, full_right, full),
                       "by_kind": {k: {**_shares([r for r in runs if kinds.get(r.item) == k], right, full_right, full),
                                       "chance": _chance([meta[r.item] for r in runs if kinds.get(r.item) == k])}
                                   for k in KINDS if any(kinds.get(r.item) == k for r in runs)},
                       "median_ttft_ratio_to_full": statistics.median(ratios) if ratios else None,
                       "median_ttft_s": statistics.median(r.ttft_s for r in runs) if runs else None}
    return out


def _chance(items: list[dict]) -> float:
    """The share a guess gets right: one of each item's candidates (its gold and its `wrong` values) at random."""
    return statistics.mean(1 / (1 + len(it.get("wrong", ()))) for it in items)


def cannot_answer(summary: dict[str, dict]) -> dict[str, tuple[dict, float]]:
    """The kinds full prefill answers no better than a guess among their candidates: kind -> (accuracy, chance)."""
    kinds = summary.get("full", {}).get("by_kind", {})
    return {k: (m["accuracy"], m["chance"]) for k, m in kinds.items() if m["accuracy"]["share"] <= m["chance"]}


def _shares(runs, right: set[int], full_right: set[int], full: dict) -> dict:
    items = {r.item for r in runs}
    agree = sum(same_answer(r.answer, full[r.item].answer) for r in runs)
    return {"accuracy": wilson(len(right & items), len(items)),
            "kept": wilson(len(right & full_right & items), len(full_right & items)),
            "turned_right": wilson(len((right - full_right) & items), len(items - full_right)),
            "agreement": wilson(agree, len(items))}


def _ci(share: dict) -> str:
    if not share["n"]:
        return "-"
    return f"{share['k']}/{share['n']} {share['share']:.2f} [{share['low']:.2f}, {share['high']:.2f}]"


def markdown(summary: dict[str, dict], kinds: Sequence[str] = KINDS) -> str:
    """The answer table (every method), then full prefill's accuracy and each method's kept share by kind."""
    lines = ["| method | right | kept of full's right | turned right | answer agreement | TTFT ÷ full |",
             "|---|---|---|---|---|---|"]
    for name, m in summary.items():
        ratio = "-" if m["median_ttft_ratio_to_full"] is None else f"{m['median_ttft_ratio_to_full']:.3f}"
        lines.append(f"| {name} | {_ci(m['accuracy'])} | {_ci(m['kept'])} | {_ci(m['turned_right'])} "
                     f"| {_ci(m['agreement'])} | {ratio} |")
    present = [k for k in kinds if any(k in m["by_kind"] for m in summary.values())]
    lines += ["", "| method | " + " | ".join(f"{k}: right / kept" for k in present) + " |",
              "|---|" + "---|" * len(present)]
    for name, m in summary.items():
        cells = [f"{_ci(m['by_kind'][k]['accuracy'])} / {_ci(m['by_kind'][k]['kept'])}" if k in m["by_kind"] else "-"
                 for k in present]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    guessed = cannot_answer(summary)
    if guessed:  # what the model cannot answer measures nothing about a blend
        lines += ["", "Full prefill answers no better than a guess among the candidates: " + ", ".join(
            f"{k} ({_ci(acc)}, a guess {chance:.2f})" for k, (acc, chance) in guessed.items()) + "."]
    return "\n".join(lines) + "\n"
