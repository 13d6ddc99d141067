"""The `kvrag` command: a typer app whose commands live one module per noun/verb.

Every command module registers itself on `app` (or a sub-app) when imported below.
User errors (`KvragError`) and bad options become one line on stderr and exit status 1, never a traceback;
Ctrl-C is one line and status 130.
"""

from __future__ import annotations

import importlib
import os
import sys

import typer

from kvrag.cli.common import INTERRUPTED_STATUS, Interrupted
from kvrag.cli.typer_apps import app, model_app
from kvrag.errors import KvragError

# The benchmarks are a plugin: kvrag.bench is found by name, so nothing in the package imports it, and a package
# installed without the `bench` extra still runs (`kvrag bench` then says how to get them).
BENCH_PLUGIN = "kvrag.bench.plugin"
BENCH_EXTRA = "pip install 'kvrag[bench]'"


def _process_settings() -> None:
    """The `kvrag` process's environment, set when a command starts (before any command imports torch)."""
    # Nothing is ever fetched at run time.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # torch's OpenMP workers spin 300,000 rounds after each parallel region by default (libgomp reads this when torch
    # is imported), keeping a core busy that the loader's decode then shares; 10,000 still spans the gaps between a
    # prefill's ops and shortens the blend's loader wait (figures: docs/performance.md).
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")


def _register_commands() -> None:
    # Imported for their side effect of adding commands to `app`, `model_app`, `store_app`, `bench_app`.
    from kvrag.cli import ask_cmd, index_cmd, model_cmd, precompute_cmd, serve_cmd, store_cmd  # noqa: F401

    try:
        importlib.import_module(BENCH_PLUGIN).register(app, model_app)
    except ModuleNotFoundError as exc:  # the bench extra's libraries (or kvrag.bench itself) are missing
        _no_bench(exc.name or "kvrag.bench")


def _no_bench(missing: str) -> None:
    """`kvrag bench` without the bench extra: one line saying how to get it."""

    @app.command("bench", context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
                 add_help_option=False)
    def bench(ctx: typer.Context) -> None:
        """Benchmarks (needs the bench extra)."""
        raise KvragError(f"the benchmarks need {missing}, which is not installed: {BENCH_EXTRA}")


def main() -> None:
    _process_settings()
    try:
        _register_commands()
        # Not standalone, so errors reach the handlers below; prog_name keeps `kvrag` in usage lines and
        # completion scripts under `python -m kvrag` too.
        status = app(prog_name="kvrag", standalone_mode=False)
    except KvragError as exc:
        _fail(str(exc))
    except Interrupted as exc:
        _interrupted(str(exc))
    except KeyboardInterrupt:  # outside a command's run; typer turns one inside it into the status 130
        _interrupted("interrupted")
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        _fail("aborted")
    except Exception as exc:
        _usage_error(exc)
        raise
    # A command's own typer.Exit(code), Ctrl-C inside a command (typer's 130), or None for success.
    if status == INTERRUPTED_STATUS:
        _interrupted("interrupted")
    sys.exit(status if isinstance(status, int) else 0)


def run() -> None:
    """The `kvrag` executable: `main()`, then a quick exit once the work is done and written.

    Python's own teardown (clearing torch's modules, freeing the model) takes a noticeable share of a short command
    after its result is out. By the time `main()` returns every store and file is closed, so when no other thread
    is left to finish, the process ends at once with the same status.
    """
    import threading

    try:
        main()
        code = 0
    except SystemExit as exc:
        if exc.code is not None and not isinstance(exc.code, int):
            raise
        code = exc.code or 0
    if threading.active_count() > 1:
        sys.exit(code)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (BrokenPipeError, ValueError):  # a reader that went away, or a closed stream: nothing to flush to
        pass
    os._exit(code)


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    sys.exit(1)


def _interrupted(message: str) -> None:
    typer.echo(message, err=True)
    sys.exit(INTERRUPTED_STATUS)


def _usage_error(exc: Exception) -> None:
    """Exit 1 with one line for click's usage errors (bad value, unknown option, missing argument); returns
    for anything else. typer vendors its own click (typer>=0.29), so they are matched by what they carry."""
    if not (hasattr(exc, "format_message") and hasattr(exc, "exit_code")):
        return
    if type(exc).__name__ == "NoArgsIsHelpError":  # a bare `kvrag store`: the help is the answer
        exc.show()
        sys.exit(exc.exit_code)
    message = " ".join(exc.format_message().split()).rstrip(".")
    _fail(f"{message}; see {_command_path(getattr(exc, 'ctx', None))} --help")


def _command_path(ctx) -> str:
    """`kvrag store stats` for the command the usage error is about. Errors from click's parser carry no
    context; then the command words are read off argv."""
    if ctx is not None:
        return ctx.command_path
    command, path = typer.main.get_command(app), ["kvrag"]
    for word in sys.argv[1:]:
        command = getattr(command, "commands", {}).get(word)
        if command is None:
            break
        path.append(word)
    return " ".join(path)
