"""`kvrag precompute`: compute and store the KV of every indexed chunk that has none yet."""

from __future__ import annotations

import time
from pathlib import Path

import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from kvrag.cli.common import (
    DEVICE_OPTION,
    DTYPE_OPTION,
    JSON_OPTION,
    KEEP_OPTION,
    KEEP_RULE_OPTION,
    MODEL_OPTION,
    STORE_OPTION,
    Interrupted,
    print_json,
    resolve_store,
    stderr_console,
    stdout_console,
)
from kvrag.cli.typer_apps import app


@app.command("precompute")
def precompute_command(
    store: Path = STORE_OPTION,
    codec: str = typer.Option("fp16", "--codec", help="fp16 (default), bf16 or int8."),
    compress: bool = typer.Option(True, "--compress/--no-compress",
                                  help="zstd-compress stored values (default), or store them as they are: about "
                                       "half as large again, decoded with no CPU work at question time."),
    limit: int = typer.Option(None, "--limit", min=1, help="Compute at most N chunks this run."),
    shard: str = typer.Option(None, "--shard", help="i/N: compute only this process's share (run N of them)."),
    keep: float = KEEP_OPTION,
    keep_rule: str = KEEP_RULE_OPTION,
    keep_per_layer: bool = typer.Option(False, "--keep-per-layer",
                                        help="With --keep: one token set per layer instead of one per chunk."),
    model: str = MODEL_OPTION,
    dtype: str = DTYPE_OPTION,
    device: str = DEVICE_OPTION,
    ray: str = typer.Option(None, "--ray", metavar="local|ADDRESS",
                            help="Prefill on Ray actors (pip install 'kvrag[ray]'): `local` starts a local cluster of "
                                 "--ray-workers CPUs; `auto` or ray://host:10001 joins a running one."),
    ray_workers: int = typer.Option(2, "--ray-workers", min=1, help="With --ray: actors, one CPU and model each."),
    as_json: bool = JSON_OPTION,
) -> None:
    """Precompute the KV cache of every indexed chunk, so `ask` never prefills a stored passage again.

    Interrupted (Ctrl-C) and run again, it resumes; several processes may share one store.

    Example: kvrag precompute --store ./store --codec int8 --keep 0.5
    Example: kvrag precompute --store ./store --ray local --ray-workers 4
    """
    from kvrag.precompute.keyformer import KeepConfig
    from kvrag.precompute.plain import PrecomputeInterrupted
    from kvrag.store.keys import codec_id
    from kvrag.store.table import Shard

    codec_id(codec)  # validate before loading anything
    if ray is not None:
        from kvrag.precompute.on_ray import import_ray

        import_ray()  # without Ray: one line saying how to install it
    keep_config = KeepConfig(keep, keep_rule, per_layer=keep_per_layer)
    parsed_shard = Shard.parse(shard) if shard else None
    console = stderr_console()
    try:
        summary = _run(resolve_store(store), codec, limit, parsed_shard, compress, keep_config, model, dtype, device,
                       console, show_progress=not as_json or console.is_terminal, ray=(ray, ray_workers))
    except KeyboardInterrupt as exc:  # before the first chunk (loading the model), nothing was stored
        stored = exc.stored if isinstance(exc, PrecomputeInterrupted) else 0
        raise Interrupted(f"interrupted; {stored} chunks stored, run again to resume") from None
    if as_json:
        print_json(summary.to_dict())
        return
    from kvrag.store.keys import is_reduced

    s, table = summary, Table(title="precompute", show_header=False)
    rows = [("model", s.model_fp), ("codec", s.codec), ("variant", s.variant), ("indexed chunks", s.indexed_chunks),
            ("already stored", s.already_stored), ("computed now", f"{s.computed} ({s.tokens:,} tokens)"),
            *([("forms per chunk", f"{s.forms}: after the preamble, and after the lead-in")] if s.forms > 1 else []),
            ("kept", is_reduced(s.variant) and f"{s.kept_tokens:,} tokens"), ("left to other processes", s.skipped_by_others),
            ("throughput", f"{s.tokens_per_s:,.0f} tok/s"), ("store overhead", f"{s.store_overhead:.1%} of compute time"),
            ("time", f"{s.wall_s:.1f} s")]
    for name, value in rows:
        if value or name not in ("variant", "kept", "left to other processes"):  # those three only when they apply
            table.add_row(name, str(value))
    stdout_console().print(table)  # the result; the progress bar was on stderr


def _run(store_dir: Path, codec: str, limit, shard, compress: bool, keep, model, dtype, device, console,
         show_progress: bool, ray: tuple[str | None, int] = (None, 1)):
    """Load the model and precompute (on Ray actors when `ray` names an address), with a progress bar on stderr."""
    from kvrag.cli.common import load_runtime, remote_options, settings
    from kvrag.precompute.plain import precompute
    from kvrag.store.env import StoreEnv

    config = settings()
    remote = remote_options(config)
    with StoreEnv.open(store_dir, max_map_size=config.max_map_size) as env:
        progress = Progress(TextColumn("precompute"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                            console=console, disable=not show_progress)
        task = None
        t0 = 0.0

        def on_start(n: int) -> None:
            nonlocal task, t0
            t0 = time.perf_counter()
            task = progress.add_task("precompute", total=n, rate="")

        def on_progress(done: int, tokens: int, total: int) -> None:
            rate = tokens / max(1e-9, time.perf_counter() - t0)
            progress.update(task, completed=done, rate=f"{rate:,.0f} tok/s")

        address, workers = ray
        if address is not None:
            from kvrag.precompute.on_ray import precompute_ray

            with progress:  # the workers load the model (on CPUs); --device does not apply
                return precompute_ray(env, model, dtype, codec, keep, address, workers, on_progress=on_progress,
                                      on_start=on_start, limit=limit, shard=shard, compress=compress, remote=remote,
                                      lead_in=config.lead_in)
        # Stored KV is the model's own, from its dense weights whatever form `ask` decodes with (as on Ray actors):
        # a store is not keyed by weights form, so every reader blends the same, most faithful values.
        runtime = load_runtime(model, dtype, device, weights="dense")
        with progress:
            return precompute(env, runtime, codec, limit, shard, on_progress, on_start, compress, keep, remote)
