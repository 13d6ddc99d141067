"""The `kvrag` command's typer apps: the root and its sub-apps, on which each command module registers itself."""

from __future__ import annotations

import typer

from kvrag import __version__

# Plain click help, not typer's rich panels: typer 0.29's panels print a type after every flag
# (`--json <bool>`, even `--help <bool>`); plain help lists flags bare, values as `--store <path>`.
# It uses up to 120 columns of a wide terminal (the command list cuts each summary to fit).
HELP_STYLE = {"rich_markup_mode": None, "pretty_exceptions_enable": False,
              "context_settings": {"max_content_width": 120}}

app = typer.Typer(
    name="kvrag",
    help="Answer questions over your documents with a local LLM, reusing precomputed KV caches.",
    no_args_is_help=True,
    add_completion=True,
    **HELP_STYLE,
)
model_app = typer.Typer(help="Inspect and prepare the LLM.", no_args_is_help=True, **HELP_STYLE)
store_app = typer.Typer(help="Inspect and maintain a KV store.", no_args_is_help=True, **HELP_STYLE)
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
