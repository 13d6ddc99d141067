"""`kvrag bench fidelity`'s RULER-style part: needles, multi-key, multi-value and variable tracking spread across
chunks (bench/rag/ruler.py), every method of the sweep on each; of the tasks full prefill answers right (every
expected string in its answer), how many each method keeps right, overall and per kind."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from kvrag.bench.fidelity import FidelitySpec, run_items
from kvrag.bench.rag.ruler import generate_tasks, ruler_all


def run_ruler(engine, runtime, spec: FidelitySpec, kinds: tuple[str, ...], lengths: tuple[int, ...], per_cell: int,
              haystack: Path | None = None, records: Path | None = None, on_item=None) -> dict:
    tasks = generate_tasks(runtime.prompts, runtime.local.tokenizer_fingerprint, kinds, lengths, per_cell,
                           seed=spec.seed, haystack_source=haystack)
    by_index = {t.item.index: t for t in tasks}
    bench = run_items(engine, [t.item for t in tasks], spec, records, on_item)
    right = {(r.method, r.item) for r in bench.runs if ruler_all(r.answer, by_index[r.item].expected) == 1.0}
    full_right = {item for method, item in right if method == "full"}
    kept = {m.name: sum((m.name, i) in right for i in full_right) for m in bench.methods}
    per_kind: dict[str, dict[str, int]] = {}
    for kind in kinds:
        of_kind = {i for i in full_right if by_index[i].kind == kind}
        per_kind[kind] = {"tasks": sum(t.kind == kind for t in tasks), "full_right": len(of_kind),
                          **{m.name: sum((m.name, i) in right for i in of_kind) for m in bench.methods}}
    lengths_seen = Counter(t.target_tokens for t in tasks)
    return {"tasks": len(tasks), "full_right": len(full_right), "kept_right": kept, "per_kind": per_kind,
            "lengths": dict(lengths_seen), "kinds": list(kinds)}
