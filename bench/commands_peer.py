"""`kvrag bench peer`: llama.cpp's own server beside kvrag's on the same GGUF (bench/peer.py); `kvrag bench chat`: a chat
over kvrag's server alone (bench/chat.py); `kvrag bench kills`: servers killed as they spill (bench/prefix_kills.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import typer

from kvrag.bench.commands_parts import MUSIQUE_HELP, emit, positive_ints, stamped
from kvrag.bench.typer_app import bench_app
from kvrag.cli.common import DTYPE_OPTION, JSON_OPTION, MODEL_OPTION, stderr_console
from kvrag.errors import KvragError


@bench_app.command("peer")
def bench_peer(
    model: str = typer.Option("qwen2.5-coder-0.5b", "--model", help="A model kvrag pulled by name: its GGUF is what "
                              "llama-server reads, and what kvrag converted."),
    llama_server: Path = typer.Option(None, "--llama-server", help="llama.cpp's llama-server executable (built "
                                      "from its sources: docs/performance.md)."),
    peer_url: str = typer.Option(None, "--peer-url", help="An OpenAI-compatible server already running, asked "
                                 "instead of starting llama-server."),
    weights: str = typer.Option("dense,int8,int4", "--weights", help="kvrag's weights forms, each its own server."),
    prompts: str = typer.Option("2048", "--prompts", help="Prompt lengths in tokens: prefill, then decode there."),
    batches: str = typer.Option("1,4,16", "--batches", help="Requests decoding at once (llama-server's slots)."),
    decode_tokens: int = typer.Option(64, "--decode-tokens", min=1, help="Tokens each answer is held to."),
    chat_turns: int = typer.Option(12, "--chat-turns", min=1, help="User turns of the chat."),
    chat_words: int = typer.Option(270, "--chat-words", min=1, help="Words of MuSiQue passages a turn."),
    threads: int = typer.Option(2, "--threads", min=1, help="llama-server's threads (kvrag's: KVRAG_THREADS)."),
    dataset: Path = typer.Option(None, "--dataset", help="MuSiQue-format JSON for the chat's turns (default: "
                                 "../shared/data/musique_s.json; its report split)."),
    rag_items: int = typer.Option(8, "--rag-items", min=0, help="Served RAG: MuSiQue report questions a "
                                  "concurrency level sends, with their passages in the prompt (0: none)."),
    rag_passages: int = typer.Option(5, "--rag-passages", min=1, help="Passages in each RAG prompt."),
    concurrency: str = typer.Option("1,4", "--concurrency", help="Served RAG's requests in flight, each level "
                                    "its own questions."),
    work: Path = typer.Option(Path("/tmp/kvrag-peer-bench"), "--work", help="The servers' logs, an empty store and "
                              "the RAG store (its passages indexed and precomputed once, then reused)."),
    as_json: bool = JSON_OPTION,
) -> None:
    """llama.cpp's llama-server and `kvrag serve` on the same model, one after the other on this machine: prefill
    and decode tokens/s, batched decode, a chat's first and last turn and an exact repeat (bench/peer.py), then
    served RAG at each concurrency (bench/peer_rag.py: kvrag with its default weights and stored blending verdict).

    Example: kvrag bench peer --model qwen2.5-coder-0.5b --llama-server ~/llama.cpp/build/bin/llama-server
    """
    from kvrag.bench.peer import FILLER, PeerConfig, markdown, run
    from kvrag.bench.peer_rag import rag_prompts, trimmed
    from kvrag.bench.rag.datasets import MUSIQUE_REPORT
    from kvrag.bench.rag.items import read_dataset
    from kvrag.bench.serve_store import build_store
    from kvrag.model.files import resolve_model
    from kvrag.model.names import KNOWN_MODELS, known_gguf
    from kvrag.store.env import StoreEnv

    if model not in KNOWN_MODELS:
        raise KvragError(f"--model must name a model kvrag pulls by name ({', '.join(KNOWN_MODELS)}), got {model!r}")
    forms = tuple(w.strip() for w in weights.split(",") if w.strip())
    levels = tuple(positive_ints(concurrency, "--concurrency"))
    cfg = PeerConfig(model, work / "store", work, llama_server, peer_url, forms,
                     tuple(positive_ints(prompts, "--prompts")), tuple(positive_ints(batches, "--batches")),
                     decode_tokens, chat_turns, chat_words, threads,
                     gguf=known_gguf(model) if llama_server is not None else None,
                     rag_store=work / "store-rag" if rag_items else None, concurrency=levels)
    tokenizer = resolve_model(model).load_tokenizer()
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    tokens_per_word = count(FILLER) / len(FILLER.split())
    raw = read_dataset(dataset)
    items = [raw[i] for i in MUSIQUE_REPORT if i < len(raw)] or raw  # a small file: all of it
    # the RAG questions from the split's end, the chat's turns from its start
    rag = trimmed(items[-rag_items * len(levels):], rag_passages) if rag_items else []
    prompts_rag = rag_prompts(rag)
    cfg = replace(cfg, rag_tokens=max((count(p.text) for p in prompts_rag), default=0) + 64)  # + the template
    work.mkdir(parents=True, exist_ok=True)
    StoreEnv.open(cfg.store, create=True).close()  # the requests bring their text: nothing to index
    log = stderr_console()
    say = lambda m: log.print(m, soft_wrap=True, highlight=False)  # noqa: E731
    if rag:
        build_store(work, "rag", rag, say, model=model)
    report = stamped(run(cfg, items, tokens_per_word, say, prompts_rag))
    (work / "report.json").write_text(json.dumps(report, indent=2))
    emit(report, markdown, as_json)


@bench_app.command("chat")
def bench_chat(
    work: Path = typer.Option(Path("/tmp/kvrag-chat-bench"), "--work", help="Where the server's log (and the default "
                              "store) go."),
    store: Path = typer.Option(None, "--store", help="The store to serve (default: the repository's sample corpus, "
                               "indexed and precomputed into WORK/store afresh each run: the server keeps clients' "
                               "passages in it). Plain chat reads none of it."),
    turns: int = typer.Option(12, "--turns", min=1, help="User turns in the conversation."),
    words: int = typer.Option(270, "--words", min=1, help="Words of MuSiQue report passages in each user turn."),
    repeats: int = typer.Option(3, "--repeats", min=0, help="Exact repeats of the last turn."),
    restart: bool = typer.Option(False, "--restart", help="Then the next turn warm, the same in full (another "
                                 "cache salt), SIGKILL, a restart on the store, and another next turn: its history "
                                 "from the store's prefix table (bench/chat_restart.py)."),
    move: bool = typer.Option(False, "--move", help="Then the next turn warm, the same in full, and another next "
                              "turn on a second server started beside the first on the same store (a conversation "
                              "a router sends elsewhere): its history from the store's prefix table."),
    max_tokens: int = typer.Option(12, "--max-tokens", min=1, help="Answer tokens per turn, at most."),
    dataset: Path = typer.Option(None, "--dataset", help=MUSIQUE_HELP),
    model: str = MODEL_OPTION,
    dtype: str = DTYPE_OPTION,
    as_json: bool = JSON_OPTION,
) -> None:
    """A multi-turn plain chat and exact repeats over the real server: TTFT per turn, cached tokens, rows copied per
    request, peak memory; with --restart, the next turn after a kill -9 and a restart against the warm server's;
    with --move, on a second replica on the same store.

    Example: kvrag bench chat --turns 12 --repeats 3
    """
    from kvrag.bench.chat import ChatBenchConfig, markdown, run
    from kvrag.bench.rag.datasets import musique_report_items
    from kvrag.bench.serve_store import sample_store

    console = stderr_console()
    log = lambda m: console.print(m, highlight=False)  # noqa: E731
    store = store or sample_store(work, model, dtype, log)
    cfg = ChatBenchConfig(store, work, turns, words, repeats, max_tokens, model, dtype, restart, move)
    report = stamped(run(cfg, musique_report_items(dataset), log))
    emit(report, markdown, as_json)


@bench_app.command("kills")
def bench_kills(
    store: Path = typer.Option(None, "--store", help="The store whose prefix table the servers spill to (its table "
                               "is bounded to --bound and evicted: give a copy). Default: WORK/store, made empty "
                               "afresh."),
    kills: int = typer.Option(10, "--kills", min=1, help="Servers started on the store and killed as they spill."),
    bound: int = typer.Option(4_000_000, "--bound", min=1, help="Each server's --prefix-store bytes: small, so that "
                              "its spills evict (about ten of SmolLM2's blocks)."),
    work: Path = typer.Option(Path("/tmp/kvrag-kills-bench"), "--work", help="Where the servers' logs go."),
    model: str = MODEL_OPTION,
    dtype: str = DTYPE_OPTION,
    as_json: bool = JSON_OPTION,
) -> None:
    """Servers killed (SIGKILL) as their prefix-cache spills run: after each kill, the store's prefix table read whole
    (bench/prefix_kills.py). Exit status 1 when a block is not whole or the table passed its bound.

    Example: kvrag bench kills --kills 10
    """
    import shutil

    from kvrag.bench.prefix_kills import kills_during_spills, markdown
    from kvrag.bench.serve_store import model_args
    from kvrag.store.env import StoreEnv

    if store is None:  # plain chat reads no chunk: an empty store serves
        store = work / "store"
        shutil.rmtree(store, ignore_errors=True)
        StoreEnv.open(store, create=True).close()
    console = stderr_console()
    report = stamped(kills_during_spills(store, model_args(model, dtype), kills, bound, work / "logs",
                                         lambda m: console.print(m, highlight=False)))
    emit(report, markdown, as_json)
    if not report["ok"]:
        raise typer.Exit(1)
