"""Keyformer's decode-time budget: long generations held to a share of their KV, against the same generation with
all of it (issue 27).

Each item's 10 passages are blended (from the bench store's full fp16 chunks) under a summary request that
generates exactly `tokens` tokens (stop tokens held back), once with no budget and once per (rule, share): the
budget is share x (prompt + tokens) rows, so the prompt is cut at once and again as the answer grows. All of an
item's sequences decode in one batch of the engine. Per (rule, share): ROUGE-L (word LCS F-measure) of the text
against the unbudgeted text, the tokens equal before the first difference, and the peak pool blocks.

Run: kvrag bench keyformer --budget --split report --items 4 --store DIR --json
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from kvrag.bench.keyformer import RULE_NAMES
from kvrag.bench.keyformer_load import item_chunks
from kvrag.blend.config import BlendConfig
from kvrag.blend.ratio import RatioPolicy
from kvrag.cli.common import load_runtime
from kvrag.engine.llm_engine import EngineConfig, LLMEngine
from kvrag.engine.prefiller import Prefiller
from kvrag.engine.sequence import Request
from kvrag.model.generate import SamplingConfig
from kvrag.store.env import StoreEnv

SHARES = (0.7, 0.5, 0.3)
SUMMARY = "Summarize what each of the passages says."


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F-measure over whitespace words: the longest common subsequence against both lengths."""
    a, b = candidate.split(), reference.split()
    if not a or not b:
        return float(a == b)
    prev = [0] * (len(b) + 1)
    for x in a:
        row = [0]
        for j, y in enumerate(b):
            row.append(prev[j] + 1 if x == y else max(prev[j + 1], row[j]))
        prev = row
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    p, r = lcs / len(a), lcs / len(b)
    return 2 * p * r / (p + r)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def run_item(llm: LLMEngine, chunks, tokens: int, rules: Sequence[str], shares: Sequence[float]) -> dict:
    """One item: the unbudgeted generation and one per (rule, share), all in one batch."""
    sampling = SamplingConfig(max_tokens=tokens, min_tokens=tokens)
    base = Request(SUMMARY, tuple((c, tuple(ids)) for c, ids in chunks), "blend", BlendConfig(0.15), RatioPolicy(0.15), sampling=sampling)
    seqs = {("none", 1.0): llm.add(base)}
    positions = seqs["none", 1.0].prompt_tokens + tokens
    for rule in rules:
        for share in shares:
            seqs[rule, share] = llm.add(replace(base, kv_tokens=round(share * positions), kv_rule=rule))
    peak = 0
    while llm.has_work():
        llm.step()
        peak = max(peak, llm.sequence_blocks)
    tok = llm.prefiller.runtime.tokenizer
    texts = {key: tok.decode(s.output, skip_special_tokens=True) for key, s in seqs.items()}
    ref = seqs["none", 1.0].output
    return {f"{rule}@{share:g}": {"rouge_l": rouge_l(texts[rule, share], texts["none", 1.0]),
                                  "same_prefix": _common_prefix(s.output, ref), "tokens": len(s.output)}
            for (rule, share), s in seqs.items() if rule != "none"} | {"peak_blocks": peak}


def run(items: list[dict], store: Path, model: str | None = None, dtype: str | None = None, tokens: int = 256,
        rules: Sequence[str] = RULE_NAMES, shares: Sequence[float] = SHARES, on_item=None) -> dict:
    runtime = load_runtime(model, dtype)
    t0 = time.perf_counter()
    per_item = []
    with StoreEnv.open(store) as env:
        llm = LLMEngine(Prefiller.open(runtime, env, "fp16"), EngineConfig(2 << 30, native=False))
        for n, item in enumerate(items):
            per_item.append(run_item(llm, item_chunks(runtime, item), tokens, rules, shares))
            if on_item is not None:
                on_item(n + 1, len(items))
    keys = [k for k in per_item[0] if k != "peak_blocks"]
    return {"items": len(items), "tokens": tokens, "wall_s": time.perf_counter() - t0,
            "rouge_l": {k: float(np.mean([r[k]["rouge_l"] for r in per_item])) for k in keys},
            "same_prefix": {k: float(np.mean([r[k]["same_prefix"] for r in per_item])) for k in keys},
            "per_item": per_item}


def markdown(result: dict) -> str:
    shares = sorted({float(k.split("@")[1]) for k in result["rouge_l"]}, reverse=True)
    rules = list(dict.fromkeys(k.split("@")[0] for k in result["rouge_l"]))
    lines = ["| rule | " + " | ".join(f"budget {s:.0%}" for s in shares) + " |", "|---|" + "---|" * len(shares)]
    for rule in rules:
        cells = [f"{result['rouge_l'][f'{rule}@{s:g}']:.3f} ({result['same_prefix'][f'{rule}@{s:g}']:.0f})"
                 for s in shares]
        lines.append(f"| {rule} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\nROUGE-L against the unbudgeted text (mean tokens equal before the first difference)"
