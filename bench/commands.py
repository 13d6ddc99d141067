"""`kvrag bench`: every method on the same questions in one run; speed and quality side by side."""

from __future__ import annotations

import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path

import typer

from kvrag.bench.typer_app import bench_app
from kvrag.cli.common import (
    ATTENTION_WEIGHT_OPTION,
    DEVICE_OPTION,
    DTYPE_OPTION,
    JSON_OPTION,
    MODEL_OPTION,
    SELECTION_OPTION,
    attention_weight_override,
    print_json,
    stderr_console,
    stdout_console,
)
from kvrag.errors import KvragError

QUICK_LIMIT = 2
QUICK_RATIOS = "0.15"
QUICK_ARRIVALS = 500
QUICK_CACHE_REQUESTS = 800
QUICK_MAX_TOKENS = 16


# the RAG comparison's longer options, declared here so that bench_command reads as its list of settings
DATASET_OPTION = typer.Option(None, "--dataset", help="musique, cross-passage, sample (named sets, each with a "
                              "tuning and a report split), or a MuSiQue-format JSON file: items with their own "
                              "passages.")
QUESTIONS_OPTION = typer.Option(None, "--questions", help="Questions (lines, JSON or JSONL; optional 'answers'), "
                                "answered over the indexed --store with retrieval.")
BENCH_STORE_OPTION = typer.Option(None, "--store", help="Store directory (default: <home>/bench-store for --dataset, "
                            "$KVRAG_STORE or <home>/store for --questions).")
GRADUAL_OPTION = typer.Option(True, "--gradual/--no-gradual",
                              help="Blend: gradual filtering, 1.5x the share at the check layer (default).")
CHUNK_START_ROWS_OPTION = typer.Option(0, "--chunk-start-rows", min=0,
                                       help="Blend: always recompute the first N tokens of every chunk after the "
                                            "first.")
DEVIATION_MASS_OPTION = typer.Option(0.0, "--deviation-mass", min=0.0, max=0.99,
                                     help="Blend: recompute past --ratio until the kept rows hold this share "
                                          "of the selection score (0: a fixed ratio).")
WARM_STORE_OPTION = typer.Option(True, "--warm-store/--cold-store",
                                 help="Read each item's stored KV once before its runs (page cache warm for "
                                      "every loaded method), or leave the page cache as it is.")
PASSAGE_WORDS_OPTION = typer.Option(None, "--passage-words", min=1, help="Cut every passage to its first N "
                                    "words (quick experiments; not comparable with full runs).")
RATES_OPTION = typer.Option(None, "--rates", help="Poisson arrival rates in questions/s (default: spread up to "
                            "the fastest method's capacity).")
TTFT_LIMIT_OPTION = typer.Option(None, "--ttft-limit", help="TTFT limit in s for throughput (default: 3 x "
                                 "full prefill's median TTFT).")
CACHE_REQUESTS_OPTION = typer.Option(None, "--cache-requests", help="Replayed Zipf requests (default 4000; "
                                     "--quick 800); the first quarter warms the cache.")


@bench_app.callback()
def bench_command(
    ctx: typer.Context,
    dataset: str = DATASET_OPTION,
    split: str = typer.Option("all", "--split", help="tune, report or all: which of the data set's items run."),
    questions: Path = QUESTIONS_OPTION,
    store: Path = BENCH_STORE_OPTION,
    k: int = typer.Option(5, "-k", "--top-k", min=1, help="Chunks retrieved per question (--questions)."),
    limit: int = typer.Option(None, "--limit", min=1, help="Run the first N items (with --sample: N at random)."),
    sample: bool = typer.Option(False, "--sample", help="Take a seeded random sample of --limit items."),
    seed: int = typer.Option(0, "--seed", help="Seed of the method order, the sample and the workloads."),
    methods: str = typer.Option("full,prefix,reuse,blend", "--methods",
                                help="Comma list of full, prefix, reuse, blend (every --ratios entry), blend@R."),
    ratios: str = typer.Option(None, "--ratios", help="Blend ratios, e.g. 0.05,0.15,0.3,auto (default; --quick: 0.15)."),
    quick: bool = typer.Option(False, "--quick", help=f"Smoke run: {QUICK_LIMIT} items, ratio {QUICK_RATIOS}, "
                               f"{QUICK_MAX_TOKENS}-token answers, short simulations (each overridable)."),
    out: Path = typer.Option(None, "--out", help="Write report.json, report.md and PNG plots to this directory."),
    max_tokens: int = typer.Option(None, "--max-tokens", min=1, help="Greedy answer length in tokens (default 32)."),
    codec: str = typer.Option("fp16", "--codec", help="Stored KV codec the loading methods read: fp16, bf16, int8."),
    compress: bool = typer.Option(True, "--compress/--no-compress",
                                  help="How the setup stores chunks that have no KV yet: zstd, or as they are."),
    check_layer: int = typer.Option(None, "--check-layer", help="Blend: layers before it are computed in full "
                                    "(default: the rule's own, blend/config.py)."),
    deviation: str = typer.Option("v", "--deviation", help="Blend: select tokens by deviation of k, v or kv."),
    gradual: bool = GRADUAL_OPTION,
    attention_weight: float = ATTENTION_WEIGHT_OPTION,
    selection: str = SELECTION_OPTION,
    chunk_start_rows: int = CHUNK_START_ROWS_OPTION,
    deviation_mass: float = DEVIATION_MASS_OPTION,
    warmup: bool = typer.Option(True, "--warmup/--no-warmup", help="Run each method once, unrecorded, first."),
    warm_store: bool = WARM_STORE_OPTION,
    passage_words: int = PASSAGE_WORDS_OPTION,
    rates: str = RATES_OPTION,
    ttft_limit: float = TTFT_LIMIT_OPTION,
    ttft_stat: str = typer.Option("mean", "--ttft-stat", help="Which TTFT must meet the limit: mean, median, p90, p99."),
    arrivals: int = typer.Option(None, "--arrivals", help="Simulated arrivals per rate (default 2000; --quick 500)."),
    host_cache: str = typer.Option("4GiB", "--host-cache", help="Host tier size for the cache replay."),
    gpu_cache: str = typer.Option("0", "--gpu-cache", help="GPU tier size for the cache replay (simulated)."),
    cache_policy: str = typer.Option("pgdsf", "--cache-policy", help="pgdsf, gdsf, lru or lfu."),
    cache_sizes: str = typer.Option("256MiB,1GiB,4GiB,16GiB", "--cache-sizes", help="Host sizes for hit rate vs size."),
    cache_requests: int = CACHE_REQUESTS_OPTION,
    zipf: float = typer.Option(1.0, "--zipf", help="Popularity exponent of the replayed workload."),
    no_workloads: bool = typer.Option(False, "--sequential-only", help="Skip the Poisson and cache simulations."),
    model: str = MODEL_OPTION,
    dtype: str = DTYPE_OPTION,
    device: str = DEVICE_OPTION,
    as_json: bool = JSON_OPTION,
) -> None:
    """Run full prefill, prefix caching, full KV reuse and blending on the same questions, and compare.

    Reports TTFT (mean/median/p90/p99, ratios to full prefill per item), where TTFT went, F1/EM against gold answers and fidelity to full prefill.
    Then a Poisson throughput and memory-tier hit rates simulated from the runs (one request at a time: `kvrag bench
    serve` measures the real server). Tables on stderr, or --json on stdout; --out DIR for report.json, report.md, plots.

    Example: kvrag bench --dataset ../shared/data/musique_s.json --limit 50 --out bench-out
    """
    if ctx.invoked_subcommand is not None:  # `kvrag bench <what>`: that benchmark alone
        return
    from kvrag.bench.rag.methods import parse_methods
    from kvrag.bench.rag.runner import RunConfig
    from kvrag.bench.rag.workloads import PoissonSpec

    t_start = time.perf_counter()
    data = _source(dataset, questions, split)
    limit = limit or (QUICK_LIMIT if quick else None)
    max_tokens = max_tokens or (QUICK_MAX_TOKENS if quick else 32)
    chosen = parse_methods(methods, ratios or (QUICK_RATIOS if quick else "0.05,0.15,0.3,auto"))
    config = RunConfig(max_tokens, seed, warmup, codec, check_layer, deviation, gradual, warm_store,
                       chunk_start_rows=chunk_start_rows, deviation_mass=deviation_mass, selection=selection,
                       **attention_weight_override(attention_weight))
    poisson = PoissonSpec(_floats(rates, "--rates"), ttft_limit, ttft_stat,
                          arrivals or (QUICK_ARRIVALS if quick else 2000), seed)
    cache_spec = _cache_spec(host_cache, gpu_cache, cache_policy, cache_sizes,
                             cache_requests or (QUICK_CACHE_REQUESTS if quick else 4000), zipf, seed)
    console = _wide(stderr_console())
    report = _measure(console, store, dataset, data, split, questions, chosen, config, poisson, cache_spec,
                      (model, dtype, device), compress, (k, limit, seed, sample, passage_words, quick), no_workloads)
    report["total_wall_s"] = time.perf_counter() - t_start
    _write(report, out, as_json, console)


def _wide(console):
    if not console.is_terminal:  # a log file: wide enough for the tables
        console.width = max(console.width, 120)
    return console


def _cache_spec(host_cache: str, gpu_cache: str, policy: str, sizes: str, requests: int, zipf: float, seed: int):
    """The memory-tier replay's settings, sizes parsed (one line for a bad one)."""
    from kvrag.bench.rag.cache_sim import CacheSpec
    from kvrag.store.tiers.config import parse_bytes

    return CacheSpec(parse_bytes(host_cache, "--host-cache"), parse_bytes(gpu_cache, "--gpu-cache"), policy.lower(),
                     tuple(parse_bytes(x, "--cache-sizes") for x in sizes.split(",") if x.strip()),
                     requests=requests, warmup=requests // 4, zipf=zipf, seed=seed)


def _measure(console, store, dataset, data, split, questions, chosen, config, poisson, cache_spec, model_options,
             compress, selection_options, no_workloads) -> dict:
    """Load the model over the store, pick the items, run every method on them and build the report."""
    from kvrag.home import default_store_dir, kvrag_home
    from kvrag.store.env import StoreEnv

    load_start = _warn_if_busy(console)
    store_dir = store or (kvrag_home() / "bench-store" if dataset is not None else default_store_dir())
    with StoreEnv.open(store_dir, create=dataset is not None) as env:
        from kvrag.bench.commands_parts import auto_verdict
        from kvrag.cli.common import load_runtime
        from kvrag.engine.prefiller import Prefiller
        from kvrag.precompute import lead_in

        k, limit, seed, sample, passage_words, quick = selection_options
        with console.status("loading the model"):
            runtime = load_runtime(*model_options)
            verdict = auto_verdict(runtime)  # blend@auto runs what `kvrag ask` runs for this model
            config = replace(config, auto_rule=verdict["rule"], auto_floor=verdict["ratio"])
        items, pool = _items(data, split, questions, env, runtime, k, limit, seed, sample, passage_words)
        # a sliding-window model's chunks follow a lead-in: a data set's from its items' passages, as precompute
        # draws one from a corpus; an indexed store's is its own (found by the engine)
        lead = lead_in.choose((ids for item in items for _, ids in item.chunks), lead_in.tokens_for(runtime)) \
            if dataset is not None else None
        engine = Prefiller.open(runtime, env, config.codec, compress=compress, lead_in=lead)
        console.print(f"bench: {len(items)} items × {len(chosen)} methods ({', '.join(m.name for m in chosen)}), "
                      f"{runtime.model.dtype}, store {store_dir}")
        from kvrag.bench.rag.runner import run_bench

        with _progress(console) as on_progress:
            bench = run_bench(engine, items, chosen, config, on_progress)
        report = _report(bench, env, runtime, config, poisson, cache_spec, pool, no_workloads, console,
                         {**asdict(config), "dataset": str(dataset) if dataset else None,
                          "split": split if dataset else None, "questions": str(questions) if questions else None,
                          "store": str(store_dir), "limit": limit, "sample": sample, "quick": quick,
                          "methods": [m.name for m in chosen], "compress": compress,
                          "model": model_options[0] or "SmolLM2-135M-Instruct (default)",
                          "model_fingerprint": runtime.fingerprint,
                          "dtype": str(runtime.model.dtype).replace("torch.", ""), "device": str(runtime.model.device),
                          "passage_words": passage_words, "top_k": k if questions else None,
                          "load_average_start": load_start, "auto": verdict, "chunk_forms": engine.source.forms()})
    return report


def _source(dataset: str | None, questions: Path | None, split: str):
    """The named or given data set (None with --questions), read or generated before any model loads: a bad name,
    file or split fails at once."""
    if (dataset is None) == (questions is None):
        raise KvragError("give exactly one of --dataset FILE or --questions FILE")
    if questions is not None and not questions.exists():
        raise KvragError(f"{questions} does not exist")
    if dataset is None:
        return None
    from kvrag.bench.rag.datasets import load_dataset

    data = load_dataset(dataset)
    data.indices(split)
    return data


def _warn_if_busy(console) -> float | None:
    """Timings on a shared machine measure the other jobs too; say so before spending an hour."""
    import os

    if not hasattr(os, "getloadavg"):
        return None
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    threads = int(os.environ.get("KVRAG_THREADS") or cores)
    if load > 0.5 * cores:
        hint = " KVRAG_THREADS=1 avoids the worst of oversubscription." if threads > 1 else ""
        console.print(f"[yellow]warning: load average {load:.1f} on {cores} cores before the bench: timings will "
                      f"include other jobs' work.{hint}[/]")
    return load


def _floats(text: str | None, what: str) -> tuple[float, ...]:
    if not text:
        return ()
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise KvragError(f"{what} takes comma-separated numbers, got {text!r}") from None


def _items(data, split: str, questions: Path | None, env, runtime, k: int, limit, seed: int, sample: bool, words):
    """The bench items (a data set's `split`, or `questions` with retrieval), and the chunk pool (id, tokens) the
    cache replay draws from."""
    from kvrag.bench.rag.items import build_items, corpus_chunks, read_items, select

    if data is not None:
        chosen = select(data.indices(split), limit, seed, sample)
        items = build_items(data.items, chosen, runtime, words, where=data.name)
        return items, [(cid, len(ids)) for cid, ids in corpus_chunks(data.items, runtime, words)]
    from kvrag.store.chunks import ChunkTable

    table = ChunkTable(env)
    retriever = None

    def retrieve(question: str):
        nonlocal retriever
        if retriever is None:
            from kvrag.corpus.embedder import Embedder
            from kvrag.corpus.retrieve import Retriever

            if table.count() == 0:
                raise KvragError(f"the store at {env.path} has no indexed chunks; run `kvrag index` first")
            retriever = Retriever(env, Embedder())
        return [(h.chunk.chunk_id, list(h.chunk.token_ids)) for h in retriever.search(question, k)]

    raw = read_items(questions)
    items = build_items(raw, select(range(len(raw)), limit, seed, sample), runtime, words, retrieve, str(questions))
    pool = {cid: len(ids) for item in items for cid, ids in item.chunks}
    if table.count():
        pool.update((r.chunk_id, len(r.token_ids)) for r in table.get_many(sorted(table.ids())))
    return items, list(pool.items())


PLAIN_PROGRESS_EVERY_S = 30.0  # without a terminal (nohup, CI logs): one plain line per phase change or this often


@contextmanager
def _progress(console):
    """A progress bar per phase (setup, warm-up, runs) with the current method and an ETA; without a terminal, a
    plain line now and then instead (a bar there would print nothing until the end)."""
    if not console.is_terminal:
        yield _plain_progress(console)
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    names = {"setup": "setup", "warmup": "warm-up", "run": "runs"}
    with Progress(TextColumn("{task.fields[phase]:>8}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.description}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                  console=console) as progress:
        tasks: dict[str, int] = {}

        def update(phase: str, label: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = progress.add_task(label, total=total, phase=names.get(phase, phase))
            progress.update(tasks[phase], description=label, completed=done, total=total)

        yield update


def _plain_progress(console):
    """A progress callback that prints `phase done/total label (elapsed)` when the phase changes, when it ends,
    and at most every PLAIN_PROGRESS_EVERY_S seconds."""
    start = time.monotonic()
    last: dict[str, float] = {}

    def update(phase: str, label: str, done: int, total: int) -> None:
        now = time.monotonic()
        if phase in last and done < total and now - last[phase] < PLAIN_PROGRESS_EVERY_S:
            return
        last[phase] = now
        console.print(f"{phase} {done}/{total} {label} ({now - start:.0f} s)", highlight=False)

    return update


def _report(bench, env, runtime, config, poisson, cache_spec, pool, no_workloads, console, cfg: dict) -> dict:
    from kvrag.bench.rag.report import build_report, store_section

    workloads = cache = None
    if not no_workloads:
        with console.status("simulating Poisson arrivals and the memory tiers"):
            workloads = _poisson(bench, poisson)
            cache = _cache(bench, runtime, config, cache_spec, pool)
    return build_report(bench, cfg, workloads, cache, store_section(env, runtime.fingerprint, config.codec),
                        " ".join(["kvrag", *sys.argv[1:]]))


def _poisson(bench, spec) -> dict:
    from kvrag.bench.rag.workloads import Service, poisson_workload

    services = {m.name: [Service(r.ttft_s, r.total_s) for r in bench.by_method(m.name)] for m in bench.methods}
    return poisson_workload(services, spec)


def _cache(bench, runtime, config, spec, pool) -> dict:
    from kvrag.bench.rag.cache_sim import cache_section, fit_profile
    from kvrag.kvcache.allocator import BlockLayout

    preamble = len(runtime.prompts.preamble_ids)
    points = []  # (cached, new, seconds) of the prefills whose cached/new split is exact
    suffixes = {}  # per item: question + template end
    for r in bench.runs:
        suffix = suffixes[r.item] = r.prompt_tokens - preamble - r.chunk_tokens
        if r.method == "full":
            points.append((0, r.prompt_tokens, r.compute_s))
        elif r.method == "prefix":
            first = r.chunk_tokens - r.recomputed_chunk_tokens
            points.append((preamble + first, r.recomputed_chunk_tokens + suffix, r.compute_s))
        elif r.method == "reuse":
            points.append((preamble + r.chunk_tokens, suffix, r.compute_s))
    c = runtime.model.cfg
    layout = BlockLayout.for_codec(c.n_layers, c.n_kv_heads, c.head_dim, config.codec)
    k = round(statistics.median(len(item.chunks) for item in bench.items))
    return cache_section(pool, list(suffixes.values()), k, layout, fit_profile(points), preamble, spec)


def _write(report: dict, out: Path | None, as_json: bool, console) -> None:
    """The tables, or with --json the report, on stdout; --out's files either way."""
    from kvrag.bench.rag.report import markdown, rich_tables

    if not as_json:
        tables = _wide(stdout_console())
        for table in rich_tables(report):
            tables.print(table)
    if out is not None:
        import json

        out.mkdir(parents=True, exist_ok=True)
        plots = []
        try:
            from kvrag.bench.rag.plots import make_plots

            plots = [str(p) for p in make_plots(report, out)]
        except ImportError:
            console.print("[yellow]matplotlib is not installed: no plots (pip install matplotlib)[/]")
        (out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        (out / "report.md").write_text(markdown(report, plots) + "\n")
        if not as_json:
            console.print(f"wrote {out / 'report.json'}, {out / 'report.md'} and {len(plots)} plots")
    if as_json:
        print_json(report)
    else:
        console.print(f"bench done in {report['total_wall_s']:.0f} s")
