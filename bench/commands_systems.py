"""`kvrag bench serve | search | index | remote | keyformer | gpu`: the benchmarks of a whole system, each
parsing its options and handing over to its module as bench/commands_parts.py's do."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import typer

from kvrag.bench.commands_parts import MUSIQUE_HELP, emit, positive_ints, stamped
from kvrag.bench.typer_app import bench_app
from kvrag.cli.common import (
    DTYPE_OPTION,
    JSON_OPTION,
    MODEL_OPTION,
    print_json,
    stderr_console,
)
from kvrag.errors import KvragError


@bench_app.command("serve")
def bench_serve(
    work: Path = typer.Option(Path("/tmp/kvrag-serve-bench"), "--work",
                              help="Where the MuSiQue store is built (once, reused), the report and server logs go."),
    dataset: Path = typer.Option(None, "--dataset", help="musique (default: ../shared/data/musique_s.json, its "
                                 "splits) or a MuSiQue-format file, every item in each split."),
    split: str = typer.Option("report", "--split", help="tune or report: whose questions are sent, over a store "
                              "of that split's passages (never the release check's)."),
    store: Path = typer.Option(None, "--store", help="An indexed, precomputed store to serve instead of building "
                               "one (with --questions)."),
    questions: Path = typer.Option(None, "--questions", help="Questions (lines, JSON or JSONL) instead of the "
                                   "split's, answered over --store."),
    rates: str = typer.Option("0.1,0.2,0.3,0.4,0.6,0.8,1,1.3,1.6", "--rates", help="Poisson rates in questions/s."),
    requests_per_rate: int = typer.Option(200, "--requests-per-rate", min=1, help="Requests sent at each rate, at most."),
    seconds_per_rate: float = typer.Option(60.0, "--seconds-per-rate", min=0.0,
                                           help="Seconds of arrivals at each rate (fewer if the count runs out): long "
                                                "enough for a queue to grow past the limit when the rate is too high."),
    ttft_limit: float = typer.Option(None, "--ttft-limit", help="TTFT limit in seconds for the throughput "
                                     "(default: 3 x full prefill's median TTFT on its idle server)."),
    ttft_stat: str = typer.Option("p50", "--ttft-stat", help="p50 or mean: the TTFT statistic held to the limit."),
    configs: str = typer.Option("full,prefix,blend,blend+tiers", "--configs",
                                help="Comma list of full, prefix, blend (tiers off), blend+tiers (RAGCache)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the arrivals and the popularity ranking."),
    zipf: float = typer.Option(1.0, "--zipf", min=0.0, help="Popularity exponent over the questions."),
    k: int = typer.Option(5, "-k", min=1, help="Chunks retrieved per question."),
    max_tokens: int = typer.Option(16, "--max-tokens", min=1, help="Answer tokens per question, at most."),
    latency_runs: int = typer.Option(3, "--latency-runs", min=0,
                                     help="Questions timed one at a time on the warm idle server, twice each "
                                          "(0: none)."),
    soak: float = typer.Option(None, "--soak", min=0.0, help="Instead of the rates: MINUTES of steady mixed load on "
                               "one server (blend with tiers), its RSS and TTFT each window."),
    soak_rate: float = typer.Option(0.5, "--soak-rate", min=0.0, help="The soak's questions/s."),
    soak_window: float = typer.Option(60.0, "--soak-window", min=1.0, help="The soak's window, in seconds."),
    mixed: bool = typer.Option(False, "--mixed", help="With --soak: every kind of client at once, then kill -9 and "
                               "the store checked (bench/serve_mixed.py; WORK/mixed.json)."),
    chat: int = typer.Option(None, "--chat", min=1, help="Instead of the rates: N conversations of two turns, the "
                             "follow-up's TTFT over the first turn's (bench/serve_chat.py; WORK/chat.json)."),
    json_requests: int = typer.Option(0, "--json-requests", min=0, help="With --chat: this many JSON-mode requests "
                                      "(response_format json_schema), the share that parses and fits."),
    model: str = MODEL_OPTION,
    dtype: str = DTYPE_OPTION,
    as_json: bool = JSON_OPTION,
) -> None:
    """The measured load test of `kvrag serve`: Poisson arrivals of MuSiQue questions (Zipf popularity) from an
    async `openai` client at rising rates; TTFT and questions/s per configuration (progress on stderr, the
    table or --json on stdout, the JSON report also in WORK/report.json). With --soak, a steady load instead
    (bench/serve_soak.py; WORK/soak.json).

    Example: kvrag bench serve --rates 0.05,0.1,0.2,0.4 --ttft-limit 10
    """
    from kvrag.bench.serve import ServeBenchConfig, run
    from kvrag.bench.serve_report import markdown

    log = stderr_console()
    if chat is not None:
        return _chat(work, dataset, split, store, questions, model, dtype, chat, json_requests, k, max_tokens, as_json,
                     log)
    if soak is not None:
        return _soak(work, dataset, split, store, questions, model, dtype, soak, soak_rate, soak_window, seed, zipf, k,
                     max_tokens, as_json, log, mixed)
    cfg = ServeBenchConfig(  # the options checked before any build or load
        work=work, rates=tuple(sorted(_positive_floats(rates, "--rates"))),
        requests_per_rate=requests_per_rate, seconds_per_rate=seconds_per_rate, ttft_limit_s=ttft_limit,
        ttft_stat=ttft_stat, configs=tuple(c.strip() for c in configs.split(",") if c.strip()), seed=seed,
        zipf=zipf, k=k, max_tokens=max_tokens, latency_runs=latency_runs, model=model, dtype=dtype)
    store_dir, texts = _serve_inputs(work, dataset, split, store, questions, model, dtype,
                                     lambda m: log.print(f"[dim]{m}[/dim]", soft_wrap=True))
    report = stamped(run(replace(cfg, store=store_dir, questions=texts),
                          lambda m: log.print(m, soft_wrap=True, highlight=False)))
    (work / "report.json").write_text(json.dumps(report, indent=2, default=str))
    emit(report, markdown, as_json)


def _soak(work, dataset, split, store, questions, model, dtype, minutes, rate, window, seed, zipf, k, max_tokens,
          as_json, log, mixed: bool) -> None:
    """`kvrag bench serve --soak`: its report on stdout and in WORK/soak.json (--mixed: WORK/mixed.json)."""
    from kvrag.bench import serve_mixed, serve_soak

    store_dir, texts = _serve_inputs(work, dataset, split, store, questions, model, dtype,
                                     lambda m: log.print(f"[dim]{m}[/dim]", soft_wrap=True))
    if mixed:
        cfg = serve_mixed.MixedConfig(work, store_dir, texts, minutes, rate, window, seed=seed, max_tokens=max_tokens,
                                      model=model, dtype=dtype)
        report = stamped(serve_mixed.run(cfg, lambda m: log.print(m, soft_wrap=True, highlight=False)))
        (work / "mixed.json").write_text(json.dumps(report, indent=2, default=str))
        return emit(report, serve_mixed.markdown, as_json)
    cfg = serve_soak.SoakConfig(work, store_dir, texts, minutes, rate, window, seed=seed, zipf=zipf, k=k,
                                max_tokens=max_tokens, model=model, dtype=dtype)
    report = stamped(serve_soak.run(cfg, lambda m: log.print(m, soft_wrap=True, highlight=False)))
    (work / "soak.json").write_text(json.dumps(report, indent=2, default=str))
    emit(report, serve_soak.markdown, as_json)


def _chat(work, dataset, split, store, questions, model, dtype, pairs, json_requests, k, max_tokens, as_json,
          log) -> None:
    """`kvrag bench serve --chat`: its report on stdout and in WORK/chat.json."""
    from kvrag.bench import serve_chat

    store_dir, texts = _serve_inputs(work, dataset, split, store, questions, model, dtype,
                                     lambda m: log.print(f"[dim]{m}[/dim]", soft_wrap=True))
    cfg = serve_chat.ChatConfig(work, store_dir, texts, pairs, json_requests, k=k, max_tokens=max_tokens, model=model,
                                dtype=dtype)
    report = stamped(serve_chat.run(cfg, lambda m: log.print(m, soft_wrap=True, highlight=False)))
    (work / "chat.json").write_text(json.dumps(report, indent=2, default=str))
    emit(report, serve_chat.markdown, as_json)


def _serve_inputs(work: Path, dataset: Path | None, split: str, store: Path | None, questions: Path | None,
                  model: str | None, dtype: str | None, log) -> tuple[Path, tuple[str, ...]]:
    """The store to serve and the questions to send: --store and --questions as given, else the --split's
    MuSiQue passages built into WORK/store-<split>, and its questions."""
    from kvrag.bench.rag.datasets import load_dataset
    from kvrag.bench.rag.items import read_items
    from kvrag.bench.serve_store import build_store

    if (store is None) != (questions is None):
        raise KvragError("--store and --questions go together (without both, the MuSiQue store is built)")
    if store is not None:
        if not store.is_dir():
            raise KvragError(f"{store} is not a store directory (--store)")
        return store, tuple(item["question"] for item in read_items(questions))
    if split not in ("tune", "report"):
        raise KvragError(f"--split takes tune or report, got {split!r}")
    data = load_dataset(dataset or "musique")
    chosen = [data.items[i] for i in data.indices(split)]
    return build_store(work, split, chosen, log, model, dtype), tuple(item["question"] for item in chosen)


def _positive_floats(text: str, what: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise KvragError(f"{what} takes numbers separated by commas, got {text!r}") from None
    if not values or min(values) <= 0:
        raise KvragError(f"{what} takes positive numbers, got {text!r}")
    return values


@bench_app.command("search")
def bench_search(
    work: Path = typer.Option(Path("/tmp/kvrag-search-bench"), "--work", help="Where the synthetic index is cached."),
    count: int = typer.Option(1_000_000, "--count", min=1, help="Synthetic vectors indexed."),
    queries: int = typer.Option(300, "--queries", min=1, help="Queries timed."),
    k: int = typer.Option(5, "-k", min=1, help="Neighbours per query."),
    nprobe: str = typer.Option(None, "--nprobe", help="Comma-separated (default: the store's and a quarter of it)."),
    stages: str = typer.Option("2,4,8", "--stages", help="Stage counts of the staged search, comma-separated."),
    as_json: bool = JSON_OPTION,
) -> None:
    """How much search time dynamic speculative pipelining hides from TTFT. Example: kvrag bench search --nprobe 128,1024"""
    from kvrag.bench.search import SearchBenchConfig, run

    cfg = SearchBenchConfig(work=work, count=count, queries=queries, k=k, stages=tuple(positive_ints(stages, "--stages")),
                            nprobes=tuple(positive_ints(nprobe, "--nprobe")) if nprobe else ())
    report = run(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
    if as_json:
        print_json(report)


@bench_app.command("index")
def bench_index(
    n: int = typer.Option(1_000_000, "--n", min=1, help="Synthetic vectors indexed."),
    dim: int = typer.Option(384, "--dim", min=2, help="Their dimension (all-MiniLM-L6-v2's: 384)."),
    queries: int = typer.Option(1000, "--queries", min=1, help="Queries timed one at a time and scored for recall."),
    factory: list[str] = typer.Option(None, "--factory", help="A faiss factory to measure, repeatable (default: "
                                      "`kvrag index`'s choice at --n, its IVF-Flat and HNSW32)."),
    as_json: bool = JSON_OPTION,
) -> None:
    """The vector index at scale: build time, peak memory, index bytes, single-query latency p50/p99 and recall@10
    against exact search, per factory (progress on stderr, the markdown table or --json on stdout).

    Example: kvrag bench index --n 100000 --factory IVF1024,PQ192x4fs,RFlat --factory IVF1024,Flat
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvrag.bench.index_scale import IndexScaleConfig, markdown, run

    console = stderr_console()
    cfg = IndexScaleConfig(n=n, dim=dim, queries=queries, factories=tuple(factory or ()))
    bars = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console)
    tasks: dict[str, int] = {}

    def progress(name: str, added: int, total: int) -> None:  # a bar per build, shown once training is done
        if name not in tasks:
            tasks[name] = bars.add_task(f"adding to {name}", total=total)
        bars.update(tasks[name], completed=added)

    with bars:
        report = stamped(run(cfg, log=lambda m: console.print(m, highlight=False, soft_wrap=True), progress=progress))
    emit(report, markdown, as_json)


@bench_app.command("remote")
def bench_remote(
    items: int = typer.Option(10, "--items", min=1, max=50, help="MuSiQue report items (50-99): their passages are "
                              "the corpus, their questions asked."),
    url: str = typer.Option(None, "--url", help="An object store to use (s3://bucket/prefix, the AWS variables "
                            "from the environment); default: a SeaweedFS started here on 127.0.0.1."),
    max_tokens: int = typer.Option(8, "--max-tokens", min=1, help="Tokens each answer generates."),
    dataset: Path = typer.Option(None, "--dataset", help=MUSIQUE_HELP),
    as_json: bool = JSON_OPTION,
) -> None:
    """`ask` over a store on object storage: TTFT with the KV cold in the object store, warm in the local tier and
    in memory, and the requests and bytes per question (progress on stderr, the markdown table or --json).

    Example: kvrag bench remote --items 10
    """
    from kvrag.bench.remote import Plan, markdown, run

    console = stderr_console()
    report = stamped(run(Plan(items, dataset, url, max_tokens), lambda m: console.print(m, highlight=False)))
    emit(report, markdown, as_json)


@bench_app.command("clients")
def bench_clients(
    items: int = typer.Option(10, "--items", min=1, max=50, help="MuSiQue report items (50-99): their passages are "
                              "the corpus, their questions sent in each client's template."),
    stream_requests: int = typer.Option(500, "--stream", min=0, help="Novel questions over Zipf-popular passages."),
    zipf: float = typer.Option(1.0, "--zipf", help="The stream's popularity exponent."),
    store: Path = typer.Option(Path(".kvrag/bench-clients"), "--store", help="The bench's store (made if absent)."),
    seed: int = typer.Option(0, "--seed"),
    dataset: Path = typer.Option(None, "--dataset", help=MUSIQUE_HELP),
    as_json: bool = JSON_OPTION,
) -> None:
    """Prompts that carry their own passages (LangChain, LlamaIndex and Open WebUI templates): the share found
    stored, TTFT, first-token agreement and KL against full prefill, an exact repeat, and the hit rate over a stream.

    Example: kvrag bench clients --items 10 --stream 500
    """
    from kvrag.bench.clients import markdown, run
    from kvrag.bench.rag.datasets import musique_report_items

    console = stderr_console()
    chosen = musique_report_items(dataset)[:items]
    report = stamped(run(store, chosen, stream_requests, zipf, seed, lambda m: console.print(m, highlight=False)))
    emit(report, markdown, as_json)


@bench_app.command("keyformer")
def bench_keyformer(
    items: int = typer.Option(4, "--items", min=1, max=50, help="MuSiQue items of the split to run."),
    split: str = typer.Option("tune", "--split", help="tune (items 0-49) or report (50-99)."),
    offset: int = typer.Option(0, "--offset", min=0, max=49, help="Start this many items into the split."),
    load: bool = typer.Option(False, "--load", help="Load and blend the reduced chunks (needs --store): store and "
                                                    "load bytes, TTFT, first-token fidelity and F1 per variant."),
    budget: bool = typer.Option(False, "--budget", help="The decode-time budget: ROUGE-L of summaries under 70/50/30 percent "
                                                        "budgets against the unbudgeted one."),
    rules: str = typer.Option("keyformer,h2o,window", "--rules", help="The rules to compare. With --budget each is "
                              "name[:modifier+...] (engine/kv_budget.py: pooled, prompt, tau=answer, recent=R)."),
    passages: int = typer.Option(5, "--passages", min=1, help="With --budget: the item's first passages summarised."),
    store: Path = typer.Option(None, "--store", help="The bench store, filled on first use by --load (resumable)."),
    records: Path = typer.Option(None, "--records", help="With --load or --budget: append each item's records to this "
                                 "JSON-lines file as it ends; a rerun skips the items it holds."),
    codecs: str = typer.Option("fp16,int8", "--codecs", help="With --load: the codecs to compare."),
    keeps: str = typer.Option("1,0.7,0.5,0.3", "--keeps", help="With --load: the kept shares to compare."),
    plot_path: Path = typer.Option(None, "--plot", help="With --load: write the fidelity-against-bytes plot here."),
    max_tokens: int = typer.Option(None, "--max-tokens", min=1,
                                   help="With --load: longest answer for F1 (32); with --budget: longest summary (128)."),
    model: str = MODEL_OPTION,
    dtype: str = DTYPE_OPTION,
    as_json: bool = JSON_OPTION,
) -> None:
    """Keyformer (issues 27, 41). Alone: store bytes per token at keep 1/0.7/0.5/0.3 and the share of the question's
    attention on the kept tokens, per rule (keyformer, h2o, window). --load: every (codec, rule, keep) loaded and
    blended at 0.15 against a full prefill. --budget: summaries under a decode-time budget, resumable (--records).
    Example: kvrag bench keyformer --load --split report --items 50 --store /tmp/kf-store --plot kf.png"""
    from kvrag.bench.rag.datasets import load_dataset

    if split not in ("tune", "report"):
        raise KvragError(f"--split must be tune or report, got {split!r}")
    if load and store is None:
        raise KvragError("--load needs --store DIR (a bench store, filled on first use)")
    data = load_dataset("musique")
    chosen = [data.items[i] for i in data.indices(split)[offset:offset + items]]
    if not chosen:
        raise KvragError(f"--offset {offset} is past the {split} split's items")
    progress = stderr_console()

    def on_item(n: int, total: int) -> None:
        progress.print(f"item {n}/{total}", highlight=False)

    if load:
        from kvrag.bench import keyformer_load as bench

        shares = _positive_floats(keeps, "--keeps")
        if max(shares) > 1:
            raise KvragError(f"--keeps takes shares in (0, 1], got {keeps!r}")

        result = bench.run(chosen, store.expanduser(), model, dtype, codecs.split(","), rules.split(","),
                           shares, max_tokens=max_tokens or 32,
                           on_item=on_item, records=records.expanduser() if records else None)
        if plot_path is not None:
            bench.plot(result, plot_path)
    elif budget:
        from kvrag.bench import keyformer_budget as bench

        result = bench.run(chosen, model, dtype, max_tokens or 128, rules.split(","), passages=passages, on_item=on_item,
                           records=records.expanduser() if records else None)
    else:
        from kvrag.bench import keyformer as bench

        result = bench.run(chosen, model, dtype)
    emit(result, bench.markdown, as_json)


@bench_app.command("gpu")
def bench_gpu(
    items: int = typer.Option(None, "--items", min=1, help="MuSiQue report items (50-99) timed on SmolLM2 "
                              "(default 50; 2 with --cpu-smoke)."),
    items_8b: int = typer.Option(None, "--items-8b", min=1, help="Items timed on the random Llama-3.1-8B-shaped "
                                 "model (default 20, items 50-69: its KV is 128 KB a token; 2 with --cpu-smoke)."),
    skip_8b: bool = typer.Option(False, "--skip-8b", help="Leave the 8B-shaped model out."),
    dataset: Path = typer.Option(None, "--dataset", help=MUSIQUE_HELP),
    out: Path = typer.Option(None, "--out", help="Also write the JSON report to this file."),
    cpu_smoke: bool = typer.Option(False, "--cpu-smoke", help="Every part at tiny sizes on the CPU (Triton's "
                                   "interpreter, invented items): tests the code path, measures nothing."),
    as_json: bool = JSON_OPTION,
) -> None:
    """The GPU benchmark (issue 28): each Triton kernel's GB/s and TFLOP/s against the device's measured peaks and
    torch SDPA, then TTFT of full prefill and blend@0.15 against the physical floor, on SmolLM2 and a random
    Llama-3.1-8B-shaped model (progress on stderr, the markdown report or --json on stdout).

    Example: kvrag bench gpu --out bench-gpu.json
    """
    import os

    import torch

    if cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # read when a Triton kernel is decorated: before kvrag.bench.gpu loads
    elif not torch.cuda.is_available():
        raise KvragError("kvrag bench gpu needs a CUDA GPU, and torch sees none here (--cpu-smoke runs every part "
                         "at tiny sizes on the CPU)")
    from kvrag.bench import gpu

    plan = gpu.Plan(smoke=cpu_smoke, items=items or (2 if cpu_smoke else 50),
                    items_8b=items_8b or (2 if cpu_smoke else 20), skip_8b=skip_8b, dataset=dataset)
    progress = stderr_console()
    report = stamped(gpu.run(plan, lambda m: progress.print(m, highlight=False, soft_wrap=True)))
    if out is not None:
        out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    emit(report, gpu.markdown, as_json)
