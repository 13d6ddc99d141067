"""Options and helpers shared by the commands: stderr console, JSON output, common flags."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console

from kvrag import KvragError

MODEL_OPTION = typer.Option(None, "--model", envvar="KVRAG_MODEL",
                            help="Local Hugging Face model directory (default: SmolLM2-135M-Instruct).")
DTYPE_OPTION = typer.Option(None, "--dtype", envvar="KVRAG_DTYPE", help="auto, float32 or bfloat16.")
DEVICE_OPTION = typer.Option(None, "--device", envvar="KVRAG_DEVICE", help="auto, cpu or cuda.")
STORE_OPTION = typer.Option(None, "--store", help="Store directory (default: $KVRAG_STORE, else <home>/store).")
JSON_OPTION = typer.Option(False, "--json", help="Print the result as JSON on stdout.")
ATTENTION_WEIGHT_OPTION = typer.Option(None, "--attention-weight", min=0.0,
                                       help="Blend: rank tokens by deviation x (1 + W x how much the question "
                                            "reads them / the mean); default 4, 0 ranks by deviation alone.")


def attention_weight_override(value: float | None) -> dict[str, float]:
    """--attention-weight as keyword arguments for BlendConfig or RunConfig: none when unset, so their own
    default applies (the option cannot name it: the CLI starts without importing torch-bound fusion)."""
    return {} if value is None else {"attention_weight": value}


def stderr_console() -> Console:
    """Progress, tables and messages go to stderr so stdout stays clean for answers and JSON."""
    return Console(stderr=True)


def print_json(payload) -> None:
    sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
    sys.stdout.flush()


def read_json_file(path: Path):
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise KvragError(f"{path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise KvragError(f"cannot read {path} as JSON: {exc}") from None
