"""The load test's store: one split's MuSiQue passages, deduplicated, indexed and precomputed once in a work dir.

`kvrag index` and `kvrag precompute` run as subprocesses, exactly as a user would run them, so an interrupted
build resumes where it stopped (both commands do) and a finished one is reused as it is (the next run finds
nothing to add). Each split has a store of its own (WORK/store-<split>), so the questions sent retrieve over
their own split's passages and no other's; the release check's items are never read.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from kvrag.errors import KvragError

CHUNK_TOKENS = 1024  # MuSiQue passages run 497-887 tokens: one passage per chunk, as CacheBlend evaluates


def write_corpus(items: Sequence[dict], path: Path) -> int:
    """The items' passages as a MuSiQue-format file (questions dropped); returns the distinct passages.
    `kvrag index` reads each distinct (title, text) once; rewritten only when it changes, so reruns add nothing."""
    distinct = {(c.get("title", ""), c["text"]): None for item in items for c in item["ctxs"]}
    corpus = [{"question": "", "ctxs": [{"title": t, "text": x} for t, x in distinct]}]
    text = json.dumps(corpus)
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return len(distinct)


def model_args(model: str | None, dtype: str | None = None) -> list[str]:
    """--model and --dtype for a kvrag subprocess, where given."""
    return [*(["--model", model] if model else []), *(["--dtype", dtype] if dtype else [])]


def build_store(work: Path, name: str, items: Sequence[dict], log: Callable[[str], None], model: str | None = None,
                dtype: str | None = None, compress: bool = False) -> Path:
    """Index and precompute the items' passages into WORK/store-<name> (a no-op once done); returns the store.
    Uncompressed by default: on a CPU-only machine the zstd decode shares the cores with the blend."""
    store, corpus = work / f"store-{name}", work / f"corpus-{name}.json"
    count = write_corpus(items, corpus)
    log(f"store {store}: {count} distinct passages; indexing (resumes, adds only what is missing)")
    _kvrag(["index", str(corpus), "--store", str(store), "--chunk-tokens", str(CHUNK_TOKENS), "--prune",
            *model_args(model)])
    log("precomputing every chunk's KV (resumes; nothing to do once built)")
    _kvrag(["precompute", "--store", str(store), "--compress" if compress else "--no-compress",
            *model_args(model, dtype)])
    return store


def sample_store(work: Path, model: str | None, dtype: str | None, log: Callable[[str], None]) -> Path:
    """The repository's sample corpus indexed and precomputed into WORK/store, afresh: a store for a bench whose
    prompts read none of it (a server keeps clients' passages in its store, which a rerun must not find)."""
    store = work / "store"
    shutil.rmtree(store, ignore_errors=True)
    log(f"store {store}: the sample corpus, indexed and precomputed")
    _kvrag(["index", str(Path(__file__).parents[1] / "corpus" / "sample"), "--store", str(store), *model_args(model)])
    _kvrag(["precompute", "--store", str(store), *model_args(model, dtype)])
    return store


def _kvrag(args: list[str]) -> None:
    """One kvrag command in a subprocess, its progress on our stderr; a failure is one KvragError line."""
    code = subprocess.run([sys.executable, "-m", "kvrag", *args], stdout=subprocess.DEVNULL).returncode
    if code != 0:
        raise KvragError(f"kvrag {args[0]} exited {code} while building the load test's store (its message is above)")
