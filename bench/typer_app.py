"""`kvrag bench`'s typer app, on which every bench command module registers itself (bench/plugin.py)."""

from __future__ import annotations

import typer

from kvrag.cli.typer_apps import HELP_STYLE

# `kvrag bench` runs the RAG comparison itself (its options); `kvrag bench <what>` runs another benchmark
bench_app = typer.Typer(help="Benchmarks: `kvrag bench [options]` compares every method on the same questions; "
                        "`kvrag bench <what>` (engine, decode, cold, codec, precompute, tiers, model, cutoff) measures one "
                        "part.", invoke_without_command=True, **HELP_STYLE)
