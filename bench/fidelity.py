"""`kvrag bench fidelity`: how close each selection rule keeps a blend to full prefill, over a sweep of recompute
ratios, measured the way the field measures it (ProphetKV, QCFuse, A3, EPIC): per rule and ratio, on long prompts,

    top1           first-token agreement with full prefill
    kl             mean KL(full || blend) of the first token's distribution, and as a share of full reuse's
    identical      the whole greedy answer (max_tokens, 32 by default) equal to full prefill's
    agreed         the share of full prefill's answer tokens matched before the first difference
    ttft           median TTFT / full prefill's, on the same item in the same run
    f1, em         F1 and exact match against the gold answers, and F1 on the items full prefill answers right
    kept right     of the items full prefill answers right (F1 >= 0.5), the share this method answers right too

then the Pareto curve of KL against TTFT, the speed-up at which each rule keeps KL within a tolerance of full
reuse's gap, and the RULER-style tasks (bench/rag/ruler.py): of those full prefill answers right, how many each
method keeps right. Every method runs on every item in one process, interleaved (bench/rag/runner.py).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from kvrag.bench.answers import markdown as answers_markdown
from kvrag.bench.answers import summarize_answers
from kvrag.bench.rag.methods import Method, blend_method
from kvrag.bench.rag.metrics import mean_or_none, median_or_none
from kvrag.bench.rag.runner import BenchRun, MethodRun, RunConfig, run_bench
from kvrag.blend.config import DEFAULT_RATIO, DEFAULT_SELECTION

RULES = ("cacheblend", "query", "chunks", "epic")
RATIOS = (0.05, 0.10, 0.15, 0.20, 0.30)  # and 0: full reuse, the same for every rule
TOLERANCES = (0.1, 0.2)  # KL as a share of full reuse's: 1 % of it is below these models' run-to-run noise
RIGHT_F1 = 0.5  # full prefill "answers right" at this F1 against the gold answers


@dataclass(frozen=True)
class FidelitySpec:
    rules: tuple[str, ...] = RULES
    ratios: tuple[float, ...] = RATIOS
    max_tokens: int = 32
    seed: int = 0
    auto: bool = False  # also `auto` (blend@auto), run as the model's stored verdict makes `ask` run it
    auto_rule: str | None = None
    auto_floor: float = DEFAULT_RATIO


def methods(spec: FidelitySpec) -> list[Method]:
    """Full prefill (the reference), full reuse (ratio 0), then every rule at every ratio."""
    out = [Method("full", "full"), Method("reuse", "reuse")]
    out += [blend_method("auto")] if spec.auto else []
    return out + [blend_method(f"{r:g}", rule) for rule in spec.rules for r in spec.ratios if r > 0]


def agreed_prefix(ref: list[int], got: list[int]) -> float:
    """The share of `ref`'s tokens that `got` matches before their first difference (1.0 for equal answers)."""
    n = 0
    for a, b in zip(ref, got, strict=False):
        if a != b:
            break
        n += 1
    return n / len(ref) if ref else float(not got)


def summarize(bench: BenchRun) -> dict[str, dict]:
    """Per method: its rule and ratio, and the figures in the module doc."""
    full = {r.item: r for r in bench.by_method("full")}
    right = {i for i, r in full.items() if r.f1 is not None and r.f1 >= RIGHT_F1}
    reuse_kl = mean_or_none(r.kl for r in bench.by_method("reuse")) or None
    out = {}
    for m in bench.methods:
        runs = bench.by_method(m.name)
        kl = mean_or_none(r.kl for r in runs)
        out[m.name] = {
            "mode": m.mode, "rule": m.selection or (DEFAULT_SELECTION if m.mode == "blend" else None),
            "ratio": 0.0 if m.mode == "reuse" else (1.0 if m.mode == "full" else m.ratio),
            "items": len(runs),
            "top1_agreement": mean_or_none(r.top1_agree for r in runs),
            "mean_kl": kl,
            "kl_vs_reuse": kl / reuse_kl if kl is not None and reuse_kl else None,
            "identical_answer_share": mean_or_none(r.identical for r in runs),
            "agreed_prefix": mean_or_none(agreed_prefix(full[r.item].token_ids, r.token_ids) for r in runs),
            "median_ttft_ratio_to_full": median_or_none(r.ttft_ratio_to_full for r in runs),
            "median_ttft_ms": statistics.median(r.ttft_s for r in runs) * 1000 if runs else None,
            "f1": mean_or_none(r.f1 for r in runs),
            "em": mean_or_none(r.em for r in runs),
            "f1_where_full_right": mean_or_none(r.f1 for r in runs if r.item in right),
            "items_full_right": len(right),
            # of the items full prefill answers right, the share this method answers right too (issue 56's figure)
            "kept_right": mean_or_none(float(r.f1 is not None and r.f1 >= RIGHT_F1) for r in runs if r.item in right),
        }
    return out


def tolerance_speedups(summary: dict[str, dict], tolerances=TOLERANCES) -> dict[str, dict[str, dict | None]]:
    """Per rule and tolerance t: the cheapest swept ratio whose KL is within t of full reuse's (kl_vs_reuse <= t),
    with its median TTFT ratio and speed-up over full prefill; None when no swept ratio gets there."""
    rules = sorted({m["rule"] for m in summary.values() if m["mode"] == "blend"})
    out: dict[str, dict[str, dict | None]] = {}
    for rule in rules:
        points = sorted((m["ratio"], name, m) for name, m in summary.items()
                        if m["rule"] == rule and m["mode"] == "blend" and m["ratio"] is not None)  # auto: no one ratio
        out[rule] = {}
        for t in tolerances:
            hit = next((m | {"method": name} for _, name, m in points
                        if m["kl_vs_reuse"] is not None and m["kl_vs_reuse"] <= t), None)
            out[rule][f"{t:g}"] = None if hit is None else {
                "method": hit["method"], "ratio": hit["ratio"], "kl_vs_reuse": hit["kl_vs_reuse"],
                "median_ttft_ratio_to_full": hit["median_ttft_ratio_to_full"],
                "speedup": 1 / hit["median_ttft_ratio_to_full"] if hit["median_ttft_ratio_to_full"] else None}
    return out


def run_items(engine, items, spec: FidelitySpec, records: Path | None = None, on_item=None) -> BenchRun:
    """Every method of `spec` on each of `items`, an item at a time (each run's `item` is the item's index in its
    data set). With `records`, each item's runs are appended there as it ends and the items it holds are skipped:
    an interrupted sweep resumes where it stopped."""
    chosen = methods(spec)
    done: list[MethodRun] = []
    if records is not None and records.exists():
        done = [MethodRun(**json.loads(line)) for line in records.read_text().splitlines() if line.strip()]
    have = {r.item for r in done}
    for n, item in enumerate(items):
        if on_item:
            on_item(n, len(items), item.index in have)
        if item.index in have:
            continue
        config = RunConfig(max_tokens=spec.max_tokens, seed=spec.seed + item.index, warmup=not done,
                           auto_rule=spec.auto_rule, auto_floor=spec.auto_floor)
        runs = run_bench(engine, [item], chosen, config).runs
        for r in runs:
            r.item = item.index
        done += runs
        if records is not None:
            with open(records, "a") as fh:
                fh.writelines(json.dumps(r.to_dict()) + "\n" for r in runs)
    bench = BenchRun(chosen, list(items))
    wanted = {it.index for it in items}
    bench.runs = [r for r in done if r.item in wanted]
    bench.from_records = len(have & wanted)
    return bench


def run_sweep(engine, items, spec: FidelitySpec, records: Path | None = None, on_item=None,
              kinds: dict[int, str] | None = None) -> dict:
    """The sweep on `items` (long prompts): the summary, the tolerance speed-ups and the raw runs; with `kinds` (item
    index -> kind: a generated set the model can answer), the answers each method keeps (bench/answers.py)."""
    bench = run_items(engine, items, spec, records, on_item)
    summary = summarize(bench)
    report = {"spec": asdict(spec), "items": [it.index for it in items], "items_from_records": bench.from_records,
              "methods": summary,
              "tolerances": tolerance_speedups(summary), "runs": [r.to_dict() for r in bench.runs]}
    if kinds is not None:
        report["answers"] = summarize_answers(bench, kinds)
    return report


def pareto_plot(report: dict, out: Path) -> Path:
    """KL as a share of full reuse's against median TTFT / full prefill's, one line per rule (ratios marked)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    methods_ = report["methods"]
    reuse = methods_.get("reuse", {})
    for rule in sorted({m["rule"] for m in methods_.values() if m["mode"] == "blend"}):
        pts = sorted((m["median_ttft_ratio_to_full"], m["kl_vs_reuse"], m["ratio"]) for m in methods_.values()
                     if m["rule"] == rule and m["ratio"] is not None and m["median_ttft_ratio_to_full"] is not None
                     and m["kl_vs_reuse"] is not None)
        if reuse.get("median_ttft_ratio_to_full") is not None:
            pts = [(reuse["median_ttft_ratio_to_full"], 1.0, 0.0)] + pts
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=rule)
        for x, y, r in pts:
            ax.annotate(f"{r:g}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("median TTFT / full prefill")
    ax.set_ylabel("mean KL / full reuse's")
    ax.set_yscale("log")
    ax.set_title("blend fidelity against speed (lower left is better)")
    ax.legend()
    fig.tight_layout()
    path = out / "fidelity_pareto.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def markdown(report: dict) -> str:
    """The sweep's table, the tolerance speed-ups and the RULER tasks' counts."""
    def f(x, fmt=".3f"):
        return "-" if x is None else format(x, fmt)

    lines = []
    if report.get("answers"):
        lines += ["Answers (Wilson 95 % intervals):", "", answers_markdown(report["answers"]), "Diagnostics:", ""]
    lines += ["| method | top-1 | KL | KL / reuse | identical | agreed | TTFT / full | F1 | EM | F1 (full right) "
             "| kept right |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in report["methods"].items():
        lines.append(f"| {name} | {f(m['top1_agreement'], '.2f')} | {f(m['mean_kl'], '.4f')} | {f(m['kl_vs_reuse'])} "
                     f"| {f(m['identical_answer_share'], '.2f')} | {f(m['agreed_prefix'], '.2f')} "
                     f"| {f(m['median_ttft_ratio_to_full'])} | {f(m.get('f1'))} | {f(m.get('em'))} "
                     f"| {f(m['f1_where_full_right'])} | {f(m.get('kept_right'), '.2f')} |")
    lines += ["", "| rule | tolerance (KL / reuse) | cheapest ratio | TTFT / full | speed-up |", "|---|---|---|---|---|"]
    for rule, per_t in report["tolerances"].items():
        for t, hit in per_t.items():
            lines.append(f"| {rule} | {t} | " + ("not reached | - | - |" if hit is None else
                         f"{hit['ratio']:g} | {f(hit['median_ttft_ratio_to_full'])} | {f(hit['speedup'], '.2f')}x |"))
    forms = report.get("chunk_forms")
    if forms:
        read = ", ".join(f"{n} {form.replace('_', ' ')}" for form, n in forms["read"].items())
        lines += ["", f"Chunks stored {' and '.join(f.replace('_', ' ') for f in forms['stored'])}"
                  + (f" ({forms['lead_in_tokens']} tokens)" if forms["lead_in_tokens"] else "") + f"; read: {read}"
                  + (f" (by the items run in this process; {report['items_from_records']} came from the records)."
                     if report.get("items_from_records") else ".")]
    ruler = report.get("ruler")
    if ruler:
        lines += ["", f"RULER-style tasks: {ruler['full_right']} of {ruler['tasks']} answered right by full prefill",
                  "", "| method | kept right | share |", "|---|---|---|"]
        for name, kept in ruler["kept_right"].items():
            share = kept / ruler["full_right"] if ruler["full_right"] else None
            lines.append(f"| {name} | {kept} | {f(share, '.2f')} |")
    return "\n".join(lines) + "\n"
