"""`kvrag index` and `kvrag search`: build the chunk store and vector index, and inspect retrieval."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvrag.cli.common import (
    JSON_OPTION,
    MODEL_OPTION,
    STORE_OPTION,
    print_json,
    resolve_store,
    stderr_console,
    stdout_console,
)
from kvrag.cli.typer_apps import app
from kvrag.errors import KvragError

if TYPE_CHECKING:  # the corpus stack (faiss, semchunk, ...) loads only when a command of this module runs
    from kvrag.corpus.chunking import PassageTokenizer
    from kvrag.corpus.indexer import IndexSummary

_SHOWN_SKIPS = 10  # skipped inputs listed one by one; the rest are counted (all are in --json)


def load_passage_tokenizer(model: str | None) -> PassageTokenizer:
    """The LLM's tokenizer and the prompt's passage format (chunk token ids are spliced as is)."""
    from kvrag.corpus.chunking import PassageTokenizer
    from kvrag.model.files import resolve_model
    from kvrag.model.prompt import PromptBuilder

    local = resolve_model(model)
    builder = PromptBuilder(local.load_tokenizer())  # the passage break is the tokenizer's (model/prompt.py)
    return PassageTokenizer(builder.tokenizer, builder.render_passage, local.tokenizer_fingerprint)


def load_embedder():
    from kvrag.corpus.embedder import Embedder

    return Embedder()


class _Bars:
    """Indexer progress as rich bars on stderr, one per stage."""

    def __init__(self, console: Console):
        self.progress = Progress(TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=console)
        self.tasks: dict[str, int] = {}

    def start(self, stage: str, total: int) -> None:
        self.tasks[stage] = self.progress.add_task(stage, total=total)

    def advance(self, stage: str, n: int = 1) -> None:
        self.progress.advance(self.tasks[stage], n)

    def __enter__(self) -> _Bars:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()


@app.command("index")
def index_command(
    paths: list[str] = typer.Argument(..., help="Files, folders (walked recursively) or globs.", show_default=False),
    store: Path | None = STORE_OPTION,
    model: str | None = MODEL_OPTION,
    chunk_tokens: int = typer.Option(512, "--chunk-tokens", help="Most LLM tokens per chunk, as it stands in a prompt."),
    overlap: int = typer.Option(0, "--overlap", help="Tokens shared by neighbouring chunks of a document."),
    text_field: str = typer.Option("text", "--text-field", help="JSON/JSONL key holding a record's text."),
    title_field: str = typer.Option("title", "--title-field", help="JSON/JSONL key holding a record's title."),
    id_field: str = typer.Option("id", "--id-field", help="JSON/JSONL key holding a record's id."),
    prune: bool = typer.Option(False, "--prune", help="Drop documents indexed earlier that this run did not read."),
    rechunk: bool = typer.Option(False, "--rechunk",
                                 help="Accept new chunking settings or tokenizer: re-chunk what is given, drop the rest."),
    index_factory: str | None = typer.Option(None, "--index-factory",
                                             help="faiss index factory string, e.g. 'IVF1024,Flat' or 'HNSW32' "
                                                  "(kept for later runs; 'auto' goes back to Flat/IVF by size)."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Chunk, embed and index documents: text, Markdown, HTML, PDF, JSON/JSONL, MuSiQue.

    Re-running it adds new and changed documents and keeps unchanged chunks (and their KV).

    Example: kvrag index docs/ 'notes/**/*.md' --store ./my-store
    """
    from kvrag.corpus.chunking import ChunkConfig
    from kvrag.corpus.indexer import IndexOptions, index_corpus
    from kvrag.corpus.sources import JsonFields, expand_paths

    options = IndexOptions(
        chunking=ChunkConfig(chunk_tokens, overlap),
        fields=JsonFields(text_field, title_field, id_field),
        prune=prune, rechunk=rechunk, index_factory=index_factory,
    )
    store_dir = resolve_store(store, need_corpus=False)  # s3://...: its mirror, holding the published corpus
    files = expand_paths(paths, exclude=store_dir)  # a wrong path fails here, before models load
    if not files:
        raise KvragError(f"no files found in {', '.join(paths)}")
    err = stderr_console()
    with err.status("loading the tokenizer and the embedding model"):
        passages = load_passage_tokenizer(model)
        embedder = load_embedder()
    with _Bars(err) as bars:
        summary = index_corpus(files, store_dir, passages, embedder, options, progress=bars)
    published = _publish(store_dir, err)
    if json_out:  # skipped inputs are listed there too
        print_json(summary.to_json() | ({"published": published} if published else {}))
    else:  # the skipped inputs are notes on stderr; the summary is the result
        _print_skipped(err, summary)
        _print_summary(stdout_console(), summary, published)


def _publish(store_dir: Path, console: Console) -> str | None:
    """For a mirror (--store s3://...): its corpus uploaded as the store's current snapshot; its URL."""
    from kvrag.store.open import remote_url

    url = remote_url(store_dir)
    if url is None:
        return None
    from kvrag.cli.common import remote_options, settings
    from kvrag.corpus.mirror import Mirror

    with console.status("publishing the corpus"):
        return Mirror.open(url, remote_options(settings())).publish()


@app.command("search")
def search_command(
    query: str = typer.Argument(..., help="The text to search for.", show_default=False),
    k: int = typer.Option(5, "-k", "--top-k", help="How many chunks to show."),
    store: Path | None = STORE_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Show the chunks retrieval finds for a query, with scores (no LLM involved).

    Example: kvrag search "Who founded the city?" -k 5
    """
    from kvrag.corpus.retrieve import Retriever
    from kvrag.corpus.vector_index import VectorIndex
    from kvrag.store.env import StoreEnv

    if k < 1:
        raise KvragError(f"-k must be at least 1 (got {k})")
    store_dir = resolve_store(store)
    with StoreEnv.open(store_dir, readonly=True) as env:
        if VectorIndex.load(store_dir) is None:  # before the embedder takes seconds to load
            raise KvragError(f"the store at {store_dir} has no vector index yet; run `kvrag index` first")
        with stderr_console().status("loading the embedding model"):
            retriever = Retriever(env, load_embedder())
        hits = retriever.search(query, k)
    if json_out:
        print_json([
            {"rank": h.rank, "score": round(h.score, 4), "chunk_id": h.chunk.chunk_id, "doc_id": h.chunk.doc_id,
             "title": h.chunk.title, "char_start": h.chunk.char_start, "char_end": h.chunk.char_end,
             "tokens": len(h.chunk.token_ids), "text": h.chunk.text} for h in hits])
        return
    table = Table(title=f"top {len(hits)} for {query!r}", expand=True)
    table.add_column("#", justify="right")
    table.add_column("score")
    table.add_column("chunk", no_wrap=True)
    table.add_column("document", max_width=28, overflow="fold")
    table.add_column("text", ratio=1)
    for h in hits:
        snippet = " ".join(h.chunk.text.split())
        table.add_row(str(h.rank), f"{h.score:.3f}", h.chunk.chunk_id[:12], _short_doc(h.chunk),
                      snippet[:160] + ("…" if len(snippet) > 160 else ""))
    stdout_console().print(table)


def _short_doc(chunk) -> str:
    path, sep, record = chunk.doc_id.partition("#")
    return (chunk.title + "\n" if chunk.title else "") + Path(path).name + sep + record


def _print_skipped(console: Console, s: IndexSummary) -> None:
    for skip in s.skipped[:_SHOWN_SKIPS]:
        console.print(f"skipped {skip.source}: {skip.reason}" + (f" ({skip.detail})" if skip.detail else ""),
                      highlight=False, markup=False, soft_wrap=True)
    if len(s.skipped) > _SHOWN_SKIPS:
        console.print(f"... and {len(s.skipped) - _SHOWN_SKIPS} more skipped (all are listed by --json)")


def _print_summary(console: Console, s: IndexSummary, published: str | None) -> None:
    table = Table(title="kvrag index", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("store", s.store)
    table.add_row("files", f"{s.files:,}")
    table.add_row("documents", f"{s.documents:,} (new {s.docs_new:,}, changed {s.docs_changed:,}, "
                               f"unchanged {s.docs_unchanged:,}, removed {s.docs_removed:,})"
                               + (f"; {s.merged_duplicates:,} duplicate passages merged" if s.merged_duplicates else ""))
    table.add_row("chunks", f"{s.chunks:,} (new {s.chunks_new:,}, removed {s.chunks_removed:,}; embedded {s.embedded:,})")
    table.add_row("tokens", f"{s.tokens:,} (new {s.tokens_new:,})")
    reasons = ", ".join(f"{n} {reason}" for reason, n in s.skipped_by_reason().items())
    table.add_row("skipped", f"{len(s.skipped):,}" + (f" ({reasons})" if reasons else ""))
    table.add_row("index", f"{s.index_type}, {s.index_bytes / 2**20:.1f} MiB")
    table.add_row("time", f"{s.seconds:.1f} s")
    if published:
        table.add_row("published", published)
    console.print(table)
