"""`kvrag bench engine | decode | cold | load | codec | precompute | tiers | model | cutoff`: the benchmarks of one
part.

Each parses its options, loads what it measures and hands over to its module in `kvrag.bench`; tables go to
stdout (or stderr with the progress, where the module says so), --json where the module has a report.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

from kvrag.bench.typer_app import bench_app
from kvrag.cli.common import (
    DEVICE_OPTION,
    DTYPE_OPTION,
    JSON_OPTION,
    MODEL_OPTION,
    print_json,
    settings,
    stderr_console,
    stdout_console,
)
from kvrag.errors import KvragError

MUSIQUE_HELP = "MuSiQue-format JSON (default ../shared/data/musique_s.json)."


def auto_verdict(runtime) -> dict:
    """What `auto` runs for this model in `ask` and `serve`: its stored check's rule and floor ratio, or (no stored
    check: it is not run here, it takes minutes on a large model) the default rule from r*. The report says which."""
    from kvrag.blend.config import DEFAULT_RATIO
    from kvrag.config import DEFAULT_SELECTION
    from kvrag.engine.model_check import stored_report

    report = stored_report(runtime)
    if report is None or report.rule is None:
        note = "no stored check for these settings" if report is None else "its check failed: ask runs full prefill"
        return {"rule": DEFAULT_SELECTION, "ratio": DEFAULT_RATIO, "verdict": None if report is None else
                report.verdict(), "note": f"{note}; blend@auto ran the default rule from r*"}
    return {"rule": report.rule, "ratio": report.ratio, "verdict": report.verdict(),
            "note": "blend@auto ran the model's stored verdict, as `kvrag ask` does"}


def positive_ints(text: str, what: str) -> list[int]:
    """Comma-separated positive whole numbers (an option like --batches 1,4,16), or one line naming the option."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise KvragError(f"{what} takes whole numbers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise KvragError(f"{what} takes positive whole numbers, got {text!r}")
    return values


def stamped(report: dict) -> dict:
    """A bench's report with the command line that made it first."""
    return {"command": " ".join(["kvrag", *sys.argv[1:]]), **report}


def emit(report: dict, render, as_json: bool) -> None:
    """The report as JSON on stdout, or its markdown table."""
    if as_json:
        print_json(report)
    else:
        typer.echo(render(report))


@bench_app.command("decode")
def bench_decode(
    prompts: str = typer.Option(None, "--prompts", help="Prompt (context) lengths, comma-separated "
                                "(default 300,2000; with --batches 1024,6144)."),
    steps: int = typer.Option(None, "--steps", min=1, help="Tokens decoded a round (default 32); with --batches, "
                              "timed steps a point after one untimed (default 4)."),
    rounds: int = typer.Option(5, "--rounds", min=1, help="Rounds per prompt length (the median is reported)."),
    items: int = typer.Option(10, "--items", min=0, help="Invented items for the greedy agreement (0: none)."),
    answer_tokens: int = typer.Option(32, "--answer-tokens", min=1, help="Greedy answer length in the agreement."),
    batches: str = typer.Option(None, "--batches", help="Batch sizes, comma-separated (1 first: the base): time "
                                "the native batched step alone over scattered blocks instead of one stream."),
    threads: int = typer.Option(None, "--threads", min=1, help="Threads a batched step (default: torch's count)."),
    weights: str = typer.Option("dense", "--weights", help="The matrices' forms, comma-separated (dense, int8, "
                                "int4, mixed): a table each, over the same model (its dtype KVRAG_DTYPE's, kernels KVRAG_ISA's)."),
    model: str = MODEL_OPTION,
) -> None:
    """Decode tokens/s against this machine's memory floor: one stream (reference, exact and native steps),
    or with --batches the native batched kernel by batch size and context.

    Example: kvrag bench decode --prompts 300,2000 --steps 32 --rounds 5
             kvrag bench decode --batches 1,4,16 --prompts 1024 --weights dense,int8,int4
    """
    import torch

    from kvrag.bench import decode
    from kvrag.kernels import native as kernel_build
    from kvrag.kernels.decode_step import step_serves
    from kvrag.model.files import resolve_model
    from kvrag.model.names import default_weights
    from kvrag.model.prepared import load_weights
    from kvrag.model.quant import form_dtype, resolve_weights, torch_ops_wanted

    contexts = positive_ints(prompts or ("1024,6144" if batches else "300,2000"), "--prompts")
    sizes = positive_ints(batches, "--batches") if batches else None
    config = settings(model=model)  # KVRAG_DTYPE, KVRAG_NATIVE and KVRAG_ISA as a user's `ask` reads them
    cpu = torch.device("cpu")
    isa = kernel_build.use(config.isa) if config.native else "none"
    local = resolve_model(config.model)
    forms = [resolve_weights(w.strip(), cpu, isa != "none", default_weights(local.name))
             for w in weights.split(",") if w.strip()]
    for form in forms:  # each in the dtype a user's process gives it
        dtype = form_dtype(config.dtype, local.config, form, cpu, isa != "none")
        net = load_weights(local, dtype, cpu, form, torch_ops=torch_ops_wanted(cpu, isa != "none"))
        net.native = isa != "none"
        serves = step_serves(net.step_weights()) and net.native
        typer.echo(f"-- {local.name}, {str(dtype).removeprefix('torch.')}, weights {form}, kernels {isa} (the whole "
                   f"native step {'serves' if serves else 'does not serve: torch steps'}): "
                   f"{decode.bytes_per_token(net, 0) / 1e6:.0f} MB a step, "
                   f"{decode.resident_bytes(net) / 1e6:.0f} MB resident, load {os.getloadavg()[0]:.2f}")
        if sizes is None:
            decode.single_stream(net, local.load_tokenizer(), contexts, steps or 32, rounds, items, answer_tokens,
                                 typer.echo)
            continue
        if not step_serves(net.step_weights()):
            raise KvragError("the native batched step does not serve this model or CPU (needs kvrag's kernels and a "
                            "bf16 model)")
        decode.batched(net, contexts, sizes, steps or 4, threads or torch.get_num_threads(), typer.echo)


@bench_app.command("cold")
def bench_cold(
    store: Path = typer.Option(..., "--store", help="A store to ask over (e.g. .kvrag/demo-store after `make demo`)."),
    runs: int = typer.Option(5, "--runs", min=1, help="Cold processes per side (the median is reported)."),
    baseline: str = typer.Option(None, "--baseline", help="PYTHONPATH of another kvrag checkout to time against "
                                 "(its parent directory); runs of the two alternate."),
    ask_args: list[str] = typer.Argument(None, metavar="[-- ASK_ARGS...]", help="More `kvrag ask` arguments, after `--` "
                                         "(default: -k 1 --max-tokens 64)."),
    as_json: bool = JSON_OPTION,
) -> None:
    """A cold `kvrag ask` per process, as a user at a shell meets it: wall and CPU time, peak memory and the answer's
    own timings, median over runs (a markdown table on stdout; --json: every run and the medians).

    Example: kvrag bench cold --store .kvrag/demo-store --runs 5 -- -k 1 --max-tokens 64
    """
    from kvrag.bench import cold

    if not store.is_dir():
        raise KvragError(f"{store} is not a store directory (--store)")
    rows = cold.run(str(store), runs, baseline, ask_args or ["-k", "1", "--max-tokens", "64"])
    emit(stamped({"runs": rows, "median": cold.medians(rows)}), lambda report: cold.report(report["runs"]), as_json)


@bench_app.command("load")
def bench_load(
    chunks: int = typer.Option(10, "--chunks", min=1, help="Chunks in the prompt (the store's)."),
    tokens: int = typer.Option(600, "--tokens", min=1, help="Tokens a chunk."),
    threads: int = typer.Option(2, "--threads", min=1, help="Staging threads (and the memcpy's)."),
    codec: str = typer.Option("fp16", "--codec", help="fp16, bf16 or int8."),
    compressed: bool = typer.Option(False, "--compressed/--raw", help="Store the values zstd-compressed."),
    as_json: bool = JSON_OPTION,
) -> None:
    """The host side of loading stored KV, on this machine: staging GB/s against memcpy's, the staging thread's
    time a layer, and the staged loader's copies and launches a layer, for an 8B-shaped store of random KV.

    Example: kvrag bench load --json
    """
    import os

    import torch

    if not torch.cuda.is_available():  # the fused loader's kernel, counted in Triton's interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a Triton kernel is decorated: set first
    from kvrag.bench import load
    from kvrag.store.keys import codec_id

    codec_id(codec)  # a bad codec is one line, before the store is built
    console = stderr_console()
    report = stamped(load.run(chunks, tokens, threads, codec, compressed,
                              log=lambda line: console.print(line, highlight=False)))
    emit(report, load.render, as_json)


@bench_app.command("codec")
def bench_codec(
    dataset: Path = typer.Option(None, "--dataset", help=MUSIQUE_HELP),
    items: int = typer.Option(20, "--items", min=1, help="Questions compared (the data set's first N)."),
    codec: str = typer.Option("int8", "--codec", help="The lossy codec compared with fp16: int8 or bf16."),
    store: Path = typer.Option(None, "--store", help="A store to reuse (default: a temporary one)."),
    model: str = MODEL_OPTION,
    dtype: str = DTYPE_OPTION,
) -> None:
    """What a lossy KV codec costs: first-token KL and top-1 agreement against fp16 stored KV, under full reuse
    and blend (JSON on stdout).

    Example: kvrag bench codec --items 20 --codec int8
    """
    from kvrag.bench.codec import run
    from kvrag.bench.rag.items import read_dataset

    data = read_dataset(dataset)[:items]
    print_json(run(data, store, codec, model, dtype))


@bench_app.command("precompute")
def bench_precompute(
    store: Path = typer.Option(..., "--store", help="An indexed store whose first chunks (by id) are timed."),
    chunks: int = typer.Option(40, "--chunks", min=1, help="Chunks timed."),
    rounds: int = typer.Option(2, "--rounds", min=1, help="Rounds, plain prefill and precompute alternating."),
    codec: str = typer.Option("fp16", "--codec", help="Codec precompute stores: fp16, bf16 or int8."),
    as_json: bool = JSON_OPTION,
) -> None:
    """What storing costs precompute: its throughput against plain prefill of the same chunks.

    Example: kvrag bench precompute --store .kvrag/demo-store --chunks 40
    """
    from kvrag.bench.precompute import run, summary_line

    if not store.is_dir():
        raise KvragError(f"{store} is not a store directory (--store)")
    emit(run(store, chunks, rounds, codec), summary_line, as_json)


@bench_app.command("tiers")
def bench_tiers(
    data: Path = typer.Option(None, "--data", help="MuSiQue-style JSON (default: ../shared/data/musique_s.json "
                              "beside the project)."),
    requests: int = typer.Option(4000, "--requests", min=1, help="Replayed questions."),
    warmup: int = typer.Option(1000, "--warmup", min=0, help="First requests not counted."),
    k: int = typer.Option(5, "-k", min=1, help="Chunks per question."),
    zipf: float = typer.Option(1.0, "--zipf", min=0.0, help="Popularity exponent."),
    order: str = typer.Option("rank", "--order", help="rank (best-ranked chunk first) or drawn."),
    seed: int = typer.Option(0, "--seed", help="Seed of the ranking and the draws."),
    drift: int = typer.Option(0, "--drift", min=0, help="Re-rank popularity every N requests (0: stationary)."),
    forget_evicted: bool = typer.Option(False, "--forget-evicted", help="Statistics die with their node (in-cache "
                                        "counts) instead of being remembered per path."),
    sizes: str = typer.Option(None, "--sizes", help="Host cache sizes (default 128MiB,256MiB,512MiB,1GiB,2GiB,4GiB)."),
    policies: str = typer.Option(None, "--policies", help="Comma list of pgdsf, gdsf, lru, lfu (default: all)."),
    reorder_window: int = typer.Option(32, "--reorder-window", min=0, help="Reordering's starvation window."),
    queue_depth: int = typer.Option(64, "--queue-depth", min=1, help="Questions waiting (saturated closed loop)."),
    profile_layers: int = typer.Option(2, "--profile-layers", min=1, help="Layers timed for the cost profile."),
    refresh_profile: bool = typer.Option(False, "--refresh-profile", help="Measure the cost profile again."),
    profile: Path = typer.Option(None, "--profile", help="Profile JSON to use (measured and saved there if absent; "
                                 "default: in $KVRAG_HOME)."),
    measure_load: bool = typer.Option(False, "--measure-load", help="Also time a memory hit against a store hit."),
    as_json: bool = JSON_OPTION,
) -> None:
    """Cache-policy ablation: hit rate and TTFT of every policy x host-cache size, FIFO and reordered, replayed
    over a Zipf workload (progress on stderr, the table or --json on stdout).

    Example: kvrag bench tiers --requests 4000 --sizes 256MiB,1GiB
    """
    from kvrag.bench.replay import ORDERS
    from kvrag.bench.tiers import AblationConfig, render, run
    from kvrag.store.tiers.config import POLICIES, parse_bytes

    defaults = AblationConfig()
    sizes, policies = sizes or defaults.sizes, policies or defaults.policies
    for size in sizes.split(","):  # a bad size fails before the model loads
        parse_bytes(size, "--sizes")
    unknown = sorted({p.strip().lower() for p in policies.split(",")} - set(POLICIES))
    if order not in ORDERS or unknown:
        raise KvragError(f"--order takes {' or '.join(ORDERS)}, got {order!r}" if order not in ORDERS else
                         f"--policies takes {', '.join(POLICIES)}; got {', '.join(unknown)}")
    cfg = AblationConfig(data=data or defaults.data, requests=requests, warmup=warmup, k=k, zipf=zipf, order=order,
                         seed=seed, drift=drift, forget_evicted=forget_evicted, sizes=sizes, policies=policies,
                         reorder_window=reorder_window, queue_depth=queue_depth, profile_layers=profile_layers,
                         refresh_profile=refresh_profile, profile=profile, measure_load=measure_load)
    try:
        report = stamped(run(cfg))
    except ValueError as exc:  # k over the passages the data set has
        raise KvragError(str(exc)) from None
    emit(report, render, as_json)


@bench_app.command("model")
def bench_model(
    dataset: Path = typer.Option(None, "--dataset", help=MUSIQUE_HELP),
    items: int = typer.Option(20, "--items", help="Prompts for the bf16-vs-fp32 fidelity check."),
    cold: bool = typer.Option(True, "--cold/--no-cold", help="Also time a conversion from the GGUF."),
    transformers_baseline: bool = typer.Option(True, "--transformers/--no-transformers",
                                               help="Also time transformers' own forward."),
    model: str = MODEL_OPTION,
    as_json: bool = JSON_OPTION,
) -> None:
    """Measure model load times, prefill speed (ours vs transformers, fp32 and bf16) and bf16 fidelity.

    Example: kvrag bench model --items 20 --json
    """
    from kvrag.bench.model import run_model_bench, table
    from kvrag.bench.rag.items import read_dataset
    from kvrag.model.device import set_cpu_threads

    set_cpu_threads()
    data = read_dataset(dataset)
    console = stderr_console()
    report = run_model_bench(data, model, items, cold, with_transformers=transformers_baseline,
                             log=lambda msg: console.print(f"[dim]{msg}[/dim]"))
    if as_json:
        print_json(report.to_dict())
    else:
        stdout_console().print(table(report))


@bench_app.command("engine")
def bench_engine_command(
    contexts: str = typer.Option("1024,6144", "--contexts", help="Context lengths in tokens, comma-separated."),
    batches: str = typer.Option("1,4,16,32", "--batches", help="Concurrent sequences, comma-separated."),
    steps: int = typer.Option(8, "--steps", min=1, help="Decode steps timed per round."),
    rounds: int = typer.Option(3, "--rounds", min=1, help="Rounds per point (the median is reported)."),
    native: bool = typer.Option(True, "--native/--torch", help="The native batched step where it serves, or torch."),
    model: str = MODEL_OPTION,
    dtype: str = DTYPE_OPTION,
    device: str = DEVICE_OPTION,
    as_json: bool = JSON_OPTION,
) -> None:
    """Aggregate decode tokens/s of the resident engine by batch size and context, against the memory floor.

    Example: kvrag bench engine --contexts 1024,6144 --batches 1,4,16,32
    """
    from dataclasses import asdict

    from kvrag.bench.engine_decode import measure, table
    from kvrag.bench.rag.report import machine as machine_info
    from kvrag.cli.common import load_runtime

    console = stderr_console()
    runtime = load_runtime(model, dtype, device)
    points, bandwidth, path = measure(runtime, positive_ints(contexts, "--contexts"), positive_ints(batches, "--batches"), steps,
                                      rounds, native, progress=lambda line: console.print(line, highlight=False))
    machine = machine_info()
    if as_json:
        print_json({"schema": "kvrag-bench-engine/1", "machine": machine, "path": path,
                    "read_bandwidth_bytes_per_s": bandwidth,
                    "points": [{**asdict(p), "over_floor": p.over_floor} for p in points]})
    else:
        stdout_console().print(table(points, bandwidth, path, machine.get("cpu", "")), highlight=False)


@bench_app.command("cutoff")
def bench_cutoff(
    dataset: Path = typer.Option(None, "--dataset", help=MUSIQUE_HELP),
    store: Path = typer.Option(None, "--store", help="A store of the data set's passages, one a chunk (default: "
                               "built in --work with `kvrag index DATASET --chunk-tokens 1024`)."),
    demo_store: Path = typer.Option(None, "--demo-store", help="A store of corpus/sample (default: built in --work)."),
    work: Path = typer.Option(Path("/tmp/kvrag-cutoff-bench"), "--work", help="Where missing stores are built "
                              "(kept: a rerun reuses them)."),
    k: int = typer.Option(5, "-k", min=1, help="Chunks retrieved per request."),
    relative_cutoff: float = typer.Option(0.5, "--relative-cutoff", min=0.0, max=1.0,
                                          help="The relative cutoff applied with min_score (kvrag ask's default)."),
    as_json: bool = JSON_OPTION,
) -> None:
    """The absolute retrieval cutoff (min_score): top-1 scores of MuSiQue and demo questions against invented chat
    prompts, the cutoff chosen on the tune split and its shares on the report split (docs/retrieval-cutoff.md).

    Example: kvrag bench cutoff --store /tmp/cut-store --demo-store /tmp/demo-store
    """
    from kvrag.bench import cutoff
    from kvrag.bench.rag.items import default_dataset, read_dataset

    source = dataset or default_dataset()
    items = read_dataset(source)
    for given, name in ((store, "--store"), (demo_store, "--demo-store")):
        if given is not None and not given.is_dir():
            raise KvragError(f"{given} is not a store directory ({name})")
    store = store or cutoff.build_store(source, work / "musique-store", "--chunk-tokens", "1024")
    demo_store = demo_store or cutoff.build_store(cutoff.CORPUS / "sample", work / "demo-store")
    emit(stamped(cutoff.run(items, store, demo_store, k, relative_cutoff)), cutoff.render, as_json)
