"""Options and helpers shared by the commands: the two consoles, JSON output, common flags, Ctrl-C."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console

from kvrag.config import KEEP_RULE, KV_RULE
from kvrag.home import default_store_dir

if TYPE_CHECKING:
    from kvrag.config import KVRagConfig

INTERRUPTED_STATUS = 130  # 128 + SIGINT: what a shell reports for a process stopped by Ctrl-C

MODEL_OPTION = typer.Option(None, "--model", envvar="KVRAG_MODEL",
                            help="A short name (smollm2, the default; gemma3-270m; see kvrag model list), a .gguf "
                                 "file (converted once), or a local Hugging Face model directory.")
DTYPE_OPTION = typer.Option(None, "--dtype", envvar="KVRAG_DTYPE", help="auto, float32 or bfloat16.")
DEVICE_OPTION = typer.Option(None, "--device", envvar="KVRAG_DEVICE", help="auto, cpu or cuda.")
WEIGHTS_OPTION = typer.Option(None, "--weights", envvar="KVRAG_WEIGHTS",
                              help="The layers' matrices: dense (--dtype's), int8, int4 or mixed (weight-only, decoded "
                                   "by kvrag's AVX512-VNNI kernel; mixed: 4 bits where they hold a matrix as well "
                                   "as 8), or auto (the default: docs/quantized.md).")
# The envvar is declared for --help; kvrag.home.default_store_dir reads the same variable when --store is unset.
STORE_OPTION = typer.Option(None, "--store", envvar="KVRAG_STORE",
                            help="Store directory (default: <home>/store), or s3://bucket/prefix: a shared store on "
                                 "object storage, mirrored locally (pip install 'kvrag[s3]').")
JSON_OPTION = typer.Option(False, "--json", help="Print the result as JSON on stdout.")
# what `ask` and `serve` read: the stored KV's codec and the memory tiers for hot chunks across questions
CODEC_OPTION = typer.Option("fp16", "--codec", help="Which stored KV to use: fp16, bf16 or int8.")
HOST_CACHE_OPTION = typer.Option(None, "--host-cache", envvar="KVRAG_HOST_CACHE",
                                 help="Memory for hot chunks' KV across questions, e.g. 4GiB (default; 0 turns the "
                                      "tiers off).")
GPU_CACHE_OPTION = typer.Option(None, "--gpu-cache", envvar="KVRAG_GPU_CACHE",
                                help="GPU memory tier on CUDA (default 2GiB).")
CACHE_POLICY_OPTION = typer.Option(None, "--cache-policy", envvar="KVRAG_CACHE_POLICY",
                                   help="pgdsf (default), gdsf, lru or lfu.")
# Keyformer's reduced chunks: what `precompute --keep` stores and `ask`/`serve` read (their store variant)
KEEP_OPTION = typer.Option(1.0, "--keep", help="Share of each chunk's tokens whose KV is kept, in (0, 1]: below 1, "
                                               "the key tokens' KV alone (Keyformer), stored apart from full "
                                               "chunks by `precompute --keep`. 1 (default): full chunks.")
KEEP_RULE_OPTION = typer.Option(KEEP_RULE, "--keep-rule", help=f"How --keep picks tokens: window (first + recent "
                                f"tokens), keyformer or h2o (default {KEEP_RULE}: docs/keyformer.md).")
KV_TOKENS_OPTION = typer.Option(0, "--kv-budget", "--kv-tokens", min=0,
                                help="A decode-time KV budget per answer, in tokens: past it, the lowest-scoring "
                                     "tokens' KV is dropped (Keyformer's score) and its memory freed. 0: none.")
KV_RULE_OPTION = typer.Option(KV_RULE, "--kv-rule",
                              help=f"With --kv-budget: which tokens go first: keyformer, h2o (accumulated attention) "
                                   f"or window (all but the most recent); default {KV_RULE} (docs/keyformer.md).")
ATTENTION_WEIGHT_OPTION = typer.Option(None, "--attention-weight", min=0.0,
                                       help="Blend: rank tokens by deviation x (1 + W x how much the question "
                                            "reads them / the mean); default 4, 0 ranks by deviation alone.")
SELECTION_OPTION = typer.Option(None, "--selection",
                                help="Blend: the rule that ranks tokens at a check layer (default: the one the "
                                     "model's check chose): chunks (deviation within the passages the question "
                                     "reads), cacheblend (deviation x the "
                                     "question's reading of the token), reading, query (ProphetKV: a preview of the "
                                     "question over the loaded KV), epic (each chunk's first tokens); "
                                     "blend/selection.py lists them all.")


def attention_weight_override(value: float | None) -> dict[str, float]:
    """--attention-weight as keyword arguments for BlendConfig or RunConfig: none when unset, so their own
    default applies (the option cannot name it: the CLI starts without importing torch-bound fusion)."""
    return {} if value is None else {"attention_weight": value}


class Interrupted(Exception):
    """Ctrl-C, caught by a command to say what it leaves behind: `main()` prints the message as the one line
    on stderr and exits INTERRUPTED_STATUS. Not a KeyboardInterrupt, which typer would swallow into a bare
    status before `main()` sees the message."""

    def __init__(self, message: str = "interrupted"):
        super().__init__(message)


def check_cache_options(host_cache: str | None, gpu_cache: str | None, policy: str | None) -> None:
    """Refuse a bad --host-cache / --gpu-cache / --cache-policy before loading anything."""
    import torch

    from kvrag.store.tiers.config import CacheConfig

    CacheConfig.from_options(host_cache, gpu_cache, policy, cuda_available=torch.cuda.is_available())


def settings(**options) -> KVRagConfig:
    """A command's settings: its options (None: not given) over the environment over the defaults (config.py)."""
    from kvrag.config import KVRagConfig

    return KVRagConfig.resolve(**options)


def remote_options(config: KVRagConfig):
    """How this command reaches a store on object storage (store/remote's RemoteOptions)."""
    from kvrag.store.open import RemoteOptions

    return RemoteOptions.of(config.aws, config.mirror_dir, config.remote_cache)


def load_runtime(model: str | None = None, dtype: str | None = None, device: str | None = None,
                 tune_process: bool = True, weights: str | None = None):
    """The model as a command runs it: these options over the environment over the defaults."""
    from kvrag.model.runtime import Runtime

    return Runtime.from_config(settings(model=model, dtype=dtype, device=device, tune_process=tune_process,
                                        weights=weights))


def resolve_store(store: Path | str | None, *, need_corpus: bool = True) -> Path:
    """--store, else $KVRAG_STORE, else <home>/store; `~` expanded (click does not expand it). s3://bucket/prefix:
    its local mirror, brought up to the corpus published there (corpus/mirror.py; `need_corpus`: a store
    with none is one line)."""
    text = str(store or default_store_dir())
    if text.startswith("s3:/") and not text.startswith("s3://"):  # a Path (click's, KVRAG_STORE's) folds the //
        text = "s3://" + text[len("s3:/"):]
    if not text.startswith("s3://"):
        return Path(text).expanduser()
    from kvrag.corpus.mirror import local_store

    return local_store(text, remote_options(settings()), need_corpus=need_corpus)


def stdout_console() -> Console:
    """A command's result (its answer, table or summary) goes to stdout, so `kvrag model list | grep gemma` works."""
    return Console()


def stderr_console() -> Console:
    """Progress, notes and diagnostics go to stderr, so stdout holds the result alone."""
    return Console(stderr=True)


def print_json(payload) -> None:
    sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
    sys.stdout.flush()
