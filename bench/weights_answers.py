"""`kvrag bench weights --answers`: each weights form judged by its free-running answers, as `ask --mode full` gives
them (one full prefill, then greedy decode to the stop token), against the dense model's and against the gold ones.

Per prompt set and form:
    right          answers right against the gold answers (engine/answer_set.py's is_right), a Wilson interval
    kept           of the items the dense model answers right, the share this form answers right too
    exact match    normalized answers equal to the dense model's (their first line), a Wilson interval
    F1             mean token F1 of the answer's first line against the dense model's

This is what decides a model's default form (model/names.py's `weights`): int8 only where it keeps the answers.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from kvrag.bench.rag.metrics import wilson
from kvrag.blend.config import BlendConfig
from kvrag.engine.answer_check import answer, item_chunks
from kvrag.engine.answer_set import answer_line, f1_score, is_right, same_answer
from kvrag.engine.prefiller import Prefiller
from kvrag.model.runtime import Runtime


def answers_by_form(runtimes: dict[str, Runtime], items: list[dict],
                    on_item: Callable[[int], None] | None = None) -> dict[str, list[str]]:
    """Every form's full-prefill answer to every item: form -> [answer text, one per item]."""
    prefillers = {name: Prefiller(rt) for name, rt in runtimes.items()}
    out: dict[str, list[str]] = {name: [] for name in runtimes}
    for j, item in enumerate(items):
        for name, prefiller in prefillers.items():
            chunks = item_chunks(prefiller.runtime, item)
            out[name].append(answer(prefiller, chunks, item["question"], "full", BlendConfig()))
        if on_item is not None:
            on_item(j)
    return out


def judge(items: list[dict], answers: dict[str, list[str]], reference: str = "dense") -> dict[str, dict]:
    """Per form (the reference's own row included): right, kept of the reference's right, exact match and F1
    against the reference's answers."""
    golds = [(it["answers"], it.get("wrong", ())) for it in items]
    ref = answers[reference]
    ref_right = {i for i, a in enumerate(ref) if is_right(a, *golds[i])}
    out = {}
    for name, got in answers.items():
        right = {i for i, a in enumerate(got) if is_right(a, *golds[i])}
        out[name] = {"items": len(got), "right": wilson(len(right), len(got)),
                     "kept": wilson(len(right & ref_right), len(ref_right)),
                     "exact_match": wilson(sum(same_answer(a, b) for a, b in zip(got, ref, strict=True)), len(got)),
                     "f1": statistics.mean(f1_score(answer_line(a), answer_line(b))
                                           for a, b in zip(got, ref, strict=True)) if got else None}
    return out


def _ci(share: dict) -> str:
    if not share["n"]:
        return "-"
    return f"{share['k']}/{share['n']} {share['share']:.2f} [{share['low']:.2f}, {share['high']:.2f}]"


def table(model: str, results: dict[str, dict[str, dict]]) -> str:
    """A markdown table: a row per (prompt set, form)."""
    lines = [f"### {model}: free-running answers", "",
             "| prompts | weights | right | kept of dense's right | exact match with dense | F1 with dense |",
             "|---|---|---|---|---|---|"]
    for where, by_form in results.items():
        for name, r in by_form.items():
            lines.append(f"| {where} | {name} | {_ci(r['right'])} | {_ci(r['kept'])} | {_ci(r['exact_match'])} | "
                         f"{r['f1']:.3f} |")
    return "\n".join(lines)
