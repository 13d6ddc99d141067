"""Keyformer's decode-time budget: a summary held to a share of its KV, against the same summary with all of it
(issue 41).

Each item's first `passages` passages are blended at 0.15 (as kvrag answers; the chunks are computed into a scratch
store first, so every sequence reads the same values) under a request to summarise them, and the answer generated greedily up to `tokens` tokens, once with no budget and once
per (rule, share): the budget is share x (prompt + tokens) rows, so the prompt is cut at once and again as the
answer grows. All of an item's sequences decode in one batch of the engine. Per (rule, share): ROUGE-L (word LCS
F-measure) of the text against the unbudgeted text, the tokens equal before the first difference, and, in a second
batch fed the unbudgeted answer (teacher forcing), the share of its tokens the budgeted model would have chosen
itself: fidelity at every step, where ROUGE-L and the first difference stop at the first divergence.

Records: each item's figures are appended to a JSON-lines file as it ends; a rerun skips the items it holds, so a
long run goes on where it stopped, and `--offset` starts a split further in.
Run: kvrag bench keyformer --budget --split report --offset 0 --items 30 --records r.jsonl --json
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from kvrag.bench.keyformer_load import RecordLog, item_chunks
from kvrag.blend.config import BlendConfig
from kvrag.blend.ratio import RatioPolicy
from kvrag.cli.common import load_runtime
from kvrag.config import KV_RULE
from kvrag.engine.kv_budget import parse_rule
from kvrag.engine.llm_engine import EngineConfig, LLMEngine
from kvrag.engine.prefiller import Prefiller
from kvrag.engine.sequence import Request
from kvrag.model.sampling import SamplingConfig
from kvrag.store.env import StoreEnv

SHARES = (0.7, 0.5, 0.3)
RULES = ("keyformer", "h2o", "window")
SUMMARY = "Summarize what each of the passages says, in detail."


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


def run_item(llm: LLMEngine, chunks, tokens: int, rules: Sequence[str], shares: Sequence[float],
             mode: str = "blend") -> dict[str, dict]:
    """One item: the unbudgeted answer and one per (rule, share), all in one batch."""
    base = Request(SUMMARY, tuple((c, tuple(ids)) for c, ids in chunks), mode, BlendConfig(0.15), RatioPolicy(0.15),
                   sampling=SamplingConfig(max_tokens=1))
    llm.add(base)  # a blend stores the chunks it computes: every sequence below then loads the same values
    _drain(llm)
    base = replace(base, sampling=SamplingConfig(max_tokens=tokens))
    seqs = {("none", 1.0): llm.add(base)}
    positions = seqs["none", 1.0].prompt_tokens + tokens
    for rule in rules:
        for share in shares:
            seqs[rule, share] = llm.add(replace(base, kv_tokens=round(share * positions), kv_rule=rule))
    _drain(llm)
    ref = seqs["none", 1.0].output
    forced = {key: llm.add(replace(s.request, forced=tuple(ref), sampling=SamplingConfig(max_tokens=len(ref))))
              for key, s in seqs.items()} if ref else {}
    _drain(llm)
    tok = llm.prefiller.runtime.tokenizer
    texts = {key: tok.decode(s.output, skip_special_tokens=True) for key, s in seqs.items()}
    return {f"{rule}@{share:g}": {"rouge_l": rouge_l(texts[rule, share], texts["none", 1.0]),
                                  "same_prefix": _common_prefix(s.output, ref), "tokens": len(s.output),
                                  "agree": forced[rule, share].agreed / len(ref) if ref else 1.0}
            for (rule, share), s in seqs.items()} | {"prompt": {"tokens": seqs["none", 1.0].prompt_tokens}}


def _drain(llm: LLMEngine) -> None:
    while llm.has_work():
        llm.step()


def run(items: list[dict], model: str | None = None, dtype: str | None = None, tokens: int = 128,
        rules: Sequence[str] = RULES, shares: Sequence[float] = SHARES, passages: int = 5, mode: str = "blend",
        store: Path | None = None, records: Path | None = None, on_item=None) -> dict:
    """ROUGE-L and first divergence per rule@share over `items` (MuSiQue format), resumable through `records`."""
    for rule in rules:
        parse_rule(rule)  # a bad rule is one line before any model loads
    runtime = load_runtime(model, dtype)
    log = RecordLog(records, {"version": 2, "tokens": tokens, "passages": passages, "mode": mode, "rules": list(rules),
                              "shares": list(shares)})
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch, StoreEnv.open(store or scratch, create=True) as env:
        llm = LLMEngine(Prefiller.open(runtime, env, "fp16"), EngineConfig(2 << 30, native=False))
        for n, item in enumerate(items):
            if item["question"] not in log.done:
                chunks = item_chunks(runtime, item)[:passages]
                log.add(item["question"], run_item(llm, chunks, tokens, rules, shares, mode))
            if on_item is not None:
                on_item(n + 1, len(items))
    return summary([log.done[item["question"]] for item in items], tokens, time.perf_counter() - t0)


def summary(per_item: list[dict[str, dict]], tokens: int, wall_s: float) -> dict:
    """The report: mean ROUGE-L and tokens before the first difference per rule@share, and the default rule."""
    keys = [k for k in per_item[0] if "@" in k and not k.startswith("none@")]
    return {"items": len(per_item), "tokens": tokens, "wall_s": wall_s, "default": KV_RULE,
            "prompt_tokens": float(np.mean([r["prompt"]["tokens"] for r in per_item])),
            "answer_tokens": float(np.mean([r["none@1"]["tokens"] for r in per_item])),
            "rouge_l": {k: float(np.mean([r[k]["rouge_l"] for r in per_item])) for k in keys},
            "same_prefix": {k: float(np.mean([r[k]["same_prefix"] for r in per_item])) for k in keys},
            "agree": {k: float(np.mean([r[k]["agree"] for r in per_item])) for k in keys},
            "per_item": per_item}


def markdown(result: dict) -> str:
    shares = sorted({float(k.split("@")[1]) for k in result["rouge_l"]}, reverse=True)
    rules = list(dict.fromkeys(k.split("@")[0] for k in result["rouge_l"]))
    lines = ["| rule | " + " | ".join(f"budget {s:.0%}" for s in shares) + " |", "|---|" + "---|" * len(shares)]
    for rule in rules:
        cells = [f"{result['rouge_l'][f'{rule}@{s:g}']:.3f} ({result['same_prefix'][f'{rule}@{s:g}']:.0f}, "
                 f"{result['agree'][f'{rule}@{s:g}']:.2f})" for s in shares]
        name = f"**{rule}** (default)" if rule == result["default"] else rule
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + (f"\n\n{result['items']} items; ROUGE-L against the unbudgeted text (mean tokens equal "
                               "before the first difference, teacher-forced agreement)")
