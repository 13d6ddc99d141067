"""The `kvrag` command: a typer app whose commands live one module per noun/verb.

Every command module registers itself on `app` (or a sub-app) when imported below.
User errors (`KvragError`) become one line on stderr and exit code 1, never a traceback.
"""

from __future__ import annotations

import os
import sys

import typer

from kvrag import KvragError, __version__

# Nothing is ever fetched at run time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# torch's OpenMP workers spin this many rounds after each parallel region before they sleep (libgomp reads it
# when torch is imported, so it is set before any command module imports torch). The default, 300,000 rounds,
# keeps a core busy for milliseconds after every op, and the loader's decode at each layer's hand-over then
# shares its cores with a spinning worker: 4.0 ms a layer after a matmul instead of 2.5 (2 cores). 10,000
# still spans the gaps between a prefill's ops (no slower compute measured) and cut the blend's loader wait
# from 0.14-0.15 s to 0.11-0.12 s a prompt (6.3k tokens, three A/B pairs).
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

app = typer.Typer(
    name="kvrag",
    help="Answer questions over your documents with a local LLM, reusing precomputed KV caches.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
model_app = typer.Typer(help="Inspect and prepare the LLM.", no_args_is_help=True)
store_app = typer.Typer(help="Inspect and maintain a KV store.", no_args_is_help=True)
app.add_typer(model_app, name="model")
app.add_typer(store_app, name="store")


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"kvrag {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version_callback, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """kvrag: fast-first-token RAG over your own documents."""


def _register_commands() -> None:
    # Imported for their side effect of adding commands to `app`, `model_app`, `store_app`.
    from kvrag.cli import ask_cmd, bench_cmd, index_cmd, model_cmd, precompute_cmd, store_cmd  # noqa: F401


def main() -> None:
    _register_commands()
    try:
        app(standalone_mode=False)
    except KvragError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        typer.echo("aborted", err=True)
        sys.exit(1)
    except Exception as exc:
        # Usage errors (unknown option, bad value) come from the click inside typer; they know how
        # to show themselves as one line. typer vendors its own click, so match on behaviour.
        if hasattr(exc, "show") and hasattr(exc, "exit_code"):
            exc.show()
            sys.exit(exc.exit_code)
        raise
