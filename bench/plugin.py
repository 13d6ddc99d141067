"""`kvrag bench`: registered on the `kvrag` command by name (cli/app.py), so nothing in the package imports the
benchmarks, and a package installed without the `bench` extra runs without them."""

from __future__ import annotations

import importlib.util

import typer

# The `bench` extra (pip install 'kvrag[bench]'): the report's plots and the serving bench's client. Checked before
# anything registers, without importing them (matplotlib alone would add a third of a second to every command).
NEEDS = ("matplotlib", "openai")


def missing() -> str | None:
    """The first of the extra's packages this Python lacks, or None."""
    for name in NEEDS:
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except (ImportError, ValueError):
            return name
    return None


def register(app: typer.Typer, model_app: typer.Typer) -> None:
    """`kvrag bench ...` on `app`, once (a process that runs the CLI twice, as the tests do, registers once);
    ModuleNotFoundError naming what is missing without the extra."""
    if (absent := missing()) is not None:
        raise ModuleNotFoundError(f"No module named {absent!r}", name=absent)
    from kvrag.bench import (  # noqa: F401  (each registers its commands)
        commands,
        commands_cluster,
        commands_parts,
        commands_peer,
        commands_quality,
        commands_systems,
    )
    from kvrag.bench.typer_app import bench_app

    if any(group.typer_instance is bench_app for group in app.registered_groups):
        return
    app.add_typer(bench_app, name="bench")
    # `kvrag model bench` is the old name of `kvrag bench model`: kept for scripts, hidden from the help
    model_app.command("bench", hidden=True)(commands_parts.bench_model)
