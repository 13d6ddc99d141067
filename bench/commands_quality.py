"""`kvrag bench fidelity`: the selection rules' sweep of recompute ratios against full prefill (bench/fidelity.py)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import typer

from kvrag.bench.commands_parts import MUSIQUE_HELP, auto_verdict, emit, stamped
from kvrag.bench.typer_app import bench_app
from kvrag.cli.common import DEVICE_OPTION, DTYPE_OPTION, JSON_OPTION, MODEL_OPTION, settings, stderr_console
from kvrag.errors import KvragError


def load_average() -> str:
    """The 1-minute load average as /proc/loadavg gives it (a figure's company in every report)."""
    return f"{os.getloadavg()[0]:.2f}"


def _floats(text: str, option: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise KvragError(f"{option} takes comma-separated numbers, got {text!r}") from None
    if not values or not all(0 <= v <= 1 for v in values):
        raise KvragError(f"{option} takes ratios between 0 and 1, got {text!r}")
    return values


def _rules(text: str) -> tuple[str, ...]:
    from kvrag.blend.selection import SELECTION_RULES

    rules = tuple(r.strip() for r in text.split(",") if r.strip())
    unknown = [r for r in rules if r not in SELECTION_RULES]
    if unknown or not rules:
        raise KvragError(f"--rules takes names from {', '.join(SELECTION_RULES)}, got {text!r}")
    return rules


def _lengths(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise KvragError(f"--tokens takes two token counts LOW,HIGH, got {text!r}") from None
    if not 0 < lo <= hi:
        raise KvragError(f"--tokens takes two token counts LOW,HIGH with 0 < LOW <= HIGH, got {text!r}")
    return lo, hi


@bench_app.command("fidelity")
def bench_fidelity(
    items: int = typer.Option(10, "--items", min=1, max=1000, help="Items of the split: MuSiQue's (at most 50, about 6k "
                              "tokens each) or generated ones (--set answerable: 200 or more for a report)."),
    item_set: str = typer.Option("musique", "--set", help="musique (the split's own items) or answerable (generated "
                                 "questions a model can answer, among the split's passages: bench/answers.py)."),
    tokens: str = typer.Option("2000,8000", "--tokens", help="--set answerable: the prompts' length range in tokens."),
    split: str = typer.Option("report", "--split", help="tune (items 0-49) or report (50-99)."),
    offset: int = typer.Option(0, "--offset", min=0, max=49, help="Start this many items into the split."),
    rules: str = typer.Option("cacheblend,query,chunks,epic", "--rules", help="Selection rules to sweep."),
    ratios: str = typer.Option("0.05,0.1,0.15,0.2,0.3", "--ratios", help="Recompute ratios (0, full reuse, always runs)."),
    max_tokens: int = typer.Option(32, "--max-tokens", min=1, help="Greedy answer length compared with full prefill's."),
    ruler: str = typer.Option("needle,multikey,multivalue,vartrack", "--ruler",
                              help="RULER-style task kinds to add ('' for none)."),
    ruler_lengths: str = typer.Option("2048,4096,8192", "--ruler-lengths", help="Their prompt lengths in tokens."),
    ruler_per_cell: int = typer.Option(2, "--ruler-per-cell", min=0, help="Tasks per kind and length."),
    store: Path = typer.Option(Path(".kvrag/bench-fidelity"), "--store", help="The bench's store (made if absent)."),
    records: Path = typer.Option(None, "--records", help="Append each item's runs to this JSON-lines file as it ends; "
                                 "a rerun skips the items it holds (a sweep takes hours on a laptop CPU)."),
    out: Path = typer.Option(None, "--out", help="Write report.json, report.md and the Pareto plot here."),
    dataset: Path = typer.Option(None, "--dataset", help=MUSIQUE_HELP),
    model: str = MODEL_OPTION,
    dtype: str = DTYPE_OPTION,
    device: str = DEVICE_OPTION,
    as_json: bool = JSON_OPTION,
) -> None:
    """How close each selection rule keeps a blend to full prefill over a sweep of ratios, on long prompts:
    first-token agreement, KL, 32-token agreement, TTFT / full, F1 where full prefill is right; the Pareto curve and
    the speed-up within a KL tolerance; RULER-style tasks (needles, multi-key, multi-value, variable tracking).

    Example: kvrag bench fidelity --items 10 --rules cacheblend,query --ratios 0.1,0.15 --records fid.jsonl --out fid
    """
    from kvrag.bench.fidelity import markdown, run_sweep
    from kvrag.bench.rag.datasets import MUSIQUE_REPORT, MUSIQUE_TUNE
    from kvrag.bench.rag.items import build_items, read_dataset, split_passages
    from kvrag.cli.common import load_runtime
    from kvrag.engine.prefiller import Prefiller
    from kvrag.precompute import lead_in
    from kvrag.store.env import StoreEnv

    if split not in ("tune", "report"):
        raise KvragError(f"--split must be tune or report, got {split!r}")
    spec, auto = _spec(rules, ratios, max_tokens)
    lengths = tuple(int(x) for x in ruler_lengths.split(",") if x.strip()) if ruler else ()
    if item_set not in ("musique", "answerable"):
        raise KvragError(f"--set must be musique or answerable, got {item_set!r}")
    raw = read_dataset(dataset)
    indices = [i for i in (MUSIQUE_TUNE if split == "tune" else MUSIQUE_REPORT) if i < len(raw)][offset:offset + items]
    if not indices and item_set == "musique":
        raise KvragError(f"--offset {offset} is past the {split} split's items")
    console = stderr_console()

    def on_item(n: int, total: int, done: bool) -> None:
        console.print(f"item {n + 1}/{total}" + (" (in the records)" if done else ""), highlight=False)

    with StoreEnv.open(store.expanduser(), create=True) as env:
        runtime = load_runtime(model, dtype, device)
        verdict = auto_verdict(runtime)
        spec = replace(spec, auto=auto, auto_rule=verdict["rule"], auto_floor=verdict["ratio"]) if auto else spec
        kinds = None
        if item_set == "answerable":
            raw, indices, kinds = _answerable(raw, split, offset, items, tokens, runtime)
        # a sliding-window model's chunks follow a lead-in drawn from the split's passages, as from a corpus
        lead = lead_in.choose(split_passages(raw, indices, runtime), lead_in.tokens_for(runtime))
        engine = Prefiller.open(runtime, env, lead_in=lead)
        report = run_sweep(engine, build_items(raw, indices, runtime), spec, records, on_item, kinds)
        report["chunk_forms"] = engine.source.forms()
        if ruler and ruler_per_cell:
            from kvrag.bench.fidelity_ruler import run_ruler

            ruler_records = records.with_suffix(".ruler.jsonl") if records is not None else None
            report["ruler"] = run_ruler(engine, runtime, spec, tuple(ruler.split(",")), lengths, ruler_per_cell,
                                        dataset, ruler_records, on_item)
    report = stamped({"model": runtime.local.name, "dtype": str(runtime.model.dtype).removeprefix("torch."),
                      "split": split, "set": item_set, "load_average": load_average(),
                      **({"auto": verdict} if auto else {}), **report})
    if out is not None:
        _write(report, out)
    emit(report, markdown, as_json)


def _answerable(musique: list[dict], split: str, offset: int, items: int, tokens: str, runtime):
    """--set answerable's items (generated among the split's MuSiQue passages), the indices run and each one's item."""
    from kvrag.bench.answers import answerable_items
    from kvrag.engine.answer_check import token_counter

    raw = answerable_items(musique, split, offset + items, _lengths(tokens), token_counter(runtime))
    return raw, list(range(offset, offset + items)), dict(enumerate(raw))


def _spec(rules: str, ratios: str, max_tokens: int):
    """The sweep's spec from --rules and --ratios, and whether `auto` is among the ratios."""
    from kvrag.bench.fidelity import FidelitySpec

    auto = "auto" in [r.strip() for r in ratios.split(",")]
    fixed = ",".join(r for r in ratios.split(",") if r.strip() != "auto")
    return FidelitySpec(_rules(rules), _floats(fixed, "--ratios") if fixed else (), max_tokens), auto


def _write(report: dict, out: Path) -> None:
    """report.json, report.md and the Pareto plot into `out`."""
    from kvrag.bench.fidelity import markdown, pareto_plot

    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(markdown(report))
    pareto_plot(report, out)


@bench_app.command("weights")
def bench_weights(
    dataset: Path = typer.Option(None, "--dataset", help=MUSIQUE_HELP),
    split: str = typer.Option("report", "--split", help="tune (items 0-49) or report (50-99)."),
    items: int = typer.Option(10, "--items", min=0, help="MuSiQue items of the split."),
    invented: int = typer.Option(10, "--invented", min=0, help="Invented items (bench/invented.py, seed 2)."),
    passages: int = typer.Option(None, "--passages", min=1, help="The first N passages of each item (default all)."),
    answer_tokens: int = typer.Option(64, "--answer-tokens", min=1, help="Greedy answer length."),
    forms: str = typer.Option("int8,int4", "--weights", help="Forms to score against the dense model: int8, int4, "
                              "mixed, float32 (dense in float32: how far the dtype alone moves the answers)."),
    out: Path = typer.Option(None, "--out", help="Append the markdown table to this file."),
    answers: bool = typer.Option(False, "--answers", help="Judge each form by its free-running answers (as `ask "
                                 "--mode full` gives them) against the dense model's and the gold ones."),
    answerable: int = typer.Option(0, "--answerable", min=0, help="--answers: also N generated items the model can "
                                   "answer (bench/answers.py), filled with the split's passages."),
    tokens: str = typer.Option("1000,3000", "--tokens", help="--answerable: the prompts' length range in tokens."),
    model: str = MODEL_OPTION,
    dtype: str = DTYPE_OPTION,
) -> None:
    """What int8, int4 and mixed weights keep of the dense model: first-token KL, greedy token and answer agreement on
    RAG prompts, or (--answers) the free-running answers themselves (docs/quantized.md).

    Example: kvrag bench weights --model qwen2.5-coder-0.5b --items 10 --invented 10
    Example: kvrag bench weights --answers --answerable 60 --items 20 --invented 20 --weights int8
    """
    import torch

    from kvrag.bench import weights as bench
    from kvrag.bench.invented import invented_items
    from kvrag.bench.rag.datasets import MUSIQUE_REPORT, MUSIQUE_TUNE
    from kvrag.bench.rag.items import read_dataset
    from kvrag.model.device import resolve_device
    from kvrag.model.prepared import load_weights
    from kvrag.model.quant import BITS, form_dtype, torch_ops_wanted
    from kvrag.model.runtime import Runtime

    names = [f.strip() for f in forms.split(",") if f.strip()]
    if split not in ("tune", "report") or not names or any(n not in (*BITS, "float32") for n in names):
        raise KvragError(f"--split takes tune or report and --weights int8, int4, mixed, float32, got {split!r}, {forms!r}")
    raw = read_dataset(dataset) if items or (answers and answerable) else []
    indices = [i for i in (MUSIQUE_TUNE if split == "tune" else MUSIQUE_REPORT) if i < len(raw)][:items]
    config = settings(model=model, dtype=dtype)  # KVRAG_ISA and KVRAG_NATIVE as a user's `ask` reads them
    runtime = Runtime.load(config.model, config.dtype, tune_process=True, weights="dense", native=config.native,
                           isa=config.isa)
    device = resolve_device(None)
    native, on_torch = runtime.model.native, torch_ops_wanted(device, runtime.model.native)  # on_torch: torch's ops
    # each form in the dtype `--dtype` gives it in a user's process (auto: bf16 where every product is integer)
    quantized = {n: load_weights(runtime.local, torch.float32, device) if n == "float32" else
                 load_weights(runtime.local, form_dtype(config.dtype, runtime.local.config, n, device, native),
                              device, n, torch_ops=on_torch) for n in names}
    sets_items = {f"MuSiQue {split}": [raw[i] for i in indices], "invented": invented_items(invented, seed=2)}
    sets = {} if answers else {where: bench.rag_prompts(runtime, its, passages) for where, its in sets_items.items()}
    console = stderr_console()
    if answers:
        cut = {w: [{**it, "ctxs": it["ctxs"][:passages or None]} for it in its] for w, its in sets_items.items()}
        if answerable:  # whole: their fact passages stand anywhere in the prompt
            from kvrag.bench.answers import answerable_items
            from kvrag.engine.answer_check import token_counter

            cut[f"answerable {split}"] = answerable_items(raw, split, answerable, _lengths(tokens),
                                                          token_counter(runtime))
        text = _answer_table(runtime, quantized, cut, console)
        _emit_table(text, out)
        return
    results = {}
    for where, prompts in sets.items():
        if prompts:
            results[where] = bench.compare(runtime.model, quantized, prompts, answer_tokens,
                                           lambda j, w=where, n=len(prompts): console.print(f"{w}: {j + 1}/{n}"))
    sizes = {"dense": bench.matrix_bytes(runtime.model), **{n: bench.matrix_bytes(m) for n, m in quantized.items()}}
    head = f"`kvrag {' '.join(sys.argv[1:])}` (dense matrices {sizes['dense'] / 1e6:.0f} MB, load {load_average()})"
    _emit_table(head + "\n\n" + bench.table(runtime.local.name, sizes, results), out)


def _emit_table(text: str, out: Path | None) -> None:
    typer.echo(text)
    if out is not None:
        with out.open("a") as f:
            f.write(text + "\n\n")


def _answer_table(runtime, quantized: dict, sets: dict[str, list[dict]], console) -> str:
    """bench weights --answers: every form's answers beside the dense model's, a markdown table."""
    from dataclasses import replace as with_model

    from kvrag.bench import weights_answers as judged

    for name, m in quantized.items():  # as Runtime.load marks the model it loads
        m.triton, m.native, m.weights = runtime.model.triton, runtime.model.native, name
    runtimes = {"dense": runtime, **{n: with_model(runtime, model=m) for n, m in quantized.items()}}
    results = {}
    for where, items in sets.items():
        if items:
            got = judged.answers_by_form(runtimes, items,
                                         lambda j, w=where, n=len(items): console.print(f"{w}: {j + 1}/{n}"))
            results[where] = judged.judge(items, got)
    head = f"`kvrag {' '.join(sys.argv[1:])}` (load {load_average()})"
    return head + "\n\n" + judged.table(runtime.local.name, results)
