"""`kvrag ask`: retrieve, reuse stored KV with CacheBlend fusion, stream the answer."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.table import Table

from kvrag.cli.ask_server import ServerGone, ask_server, running_server
from kvrag.cli.common import (
    ATTENTION_WEIGHT_OPTION,
    CACHE_POLICY_OPTION,
    CODEC_OPTION,
    DEVICE_OPTION,
    DTYPE_OPTION,
    GPU_CACHE_OPTION,
    HOST_CACHE_OPTION,
    JSON_OPTION,
    KEEP_OPTION,
    KEEP_RULE_OPTION,
    KV_RULE_OPTION,
    KV_TOKENS_OPTION,
    MODEL_OPTION,
    SELECTION_OPTION,
    STORE_OPTION,
    WEIGHTS_OPTION,
    Interrupted,
    attention_weight_override,
    check_cache_options,
    print_json,
    resolve_store,
    stderr_console,
    stdout_console,
)
from kvrag.cli.typer_apps import app
from kvrag.config import MIN_SCORE
from kvrag.errors import KvragError

if TYPE_CHECKING:  # torch-bound: imported when a command runs, not when the CLI starts
    from kvrag.blend.config import BlendConfig
    from kvrag.blend.ratio import RatioPolicy
    from kvrag.model.sampling import SamplingConfig

_IMPORTED_AT = time.perf_counter()


@dataclass
class Question:
    text: str
    passages: list[tuple[str, str]] | None = None  # (title, text) given with the question
    answers: list[str] | None = None


def parse_questions(path: Path) -> list[Question]:
    """One question per line, or JSON / JSON Lines items (`question`, optional `ctxs`, `answers`)."""
    try:
        raw = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise KvragError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise KvragError(f"{path} is not UTF-8 text") from None
    items: list = []
    if path.suffix == ".json":
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise KvragError(f"{path} is not valid JSON: {exc}") from None
        items = data if isinstance(data, list) else [data]
    elif path.suffix == ".jsonl":
        for n, line in enumerate(raw.splitlines(), start=1):
            if line.strip():
                try:
                    items.append(json.loads(line))
                except ValueError:
                    raise KvragError(f"{path}:{n} is not valid JSON") from None
    else:
        items = [line for line in raw.splitlines() if line.strip()]
    return [_question(item, path) for item in items]


def _question(item, where) -> Question:
    if isinstance(item, str):
        return Question(item)
    if not isinstance(item, dict) or not isinstance(item.get("question"), str):
        raise KvragError(f"{where}: each item needs a 'question' string")
    ctxs = item.get("ctxs")
    passages = [(c.get("title") or "", c["text"]) for c in ctxs] if ctxs else None
    return Question(item["question"], passages, item.get("answers"))


@app.command("ask")
def ask_command(
    question: str = typer.Argument(None, help="The question ('-' or nothing with piped input: read stdin)."),
    store: Path = STORE_OPTION,
    k: int = typer.Option(5, "-k", "--top-k", min=1, help="Chunks to retrieve, at most."),
    relative_cutoff: float = typer.Option(0.5, "--relative-cutoff", min=0.0, max=1.0,
                                          help="Drop retrieved chunks scoring below this share of the best "
                                               "chunk's score (0 keeps all k)."),
    min_score: float = typer.Option(MIN_SCORE, "--min-score", min=0.0, max=1.0,
                                    help="Drop retrieved chunks under this cosine similarity (not about the "
                                         "question); with none left the model answers without passages."),
    chunks: str = typer.Option(None, "--chunks", help="Comma-separated chunk ids to use instead of retrieval."),
    questions: Path = typer.Option(None, "--questions", help="File of questions: lines, JSON or JSONL items "
                                   "(items with 'ctxs' bring their own passages)."),
    limit: int = typer.Option(None, "--limit", min=1, help="Answer at most N questions from --questions."),
    mode: str = typer.Option("blend", "--mode", help="blend, full (prefill), prefix (prefix caching), reuse."),
    ratio: str = typer.Option("auto", "--ratio", help="Share of chunk tokens to recompute, or 'auto': from 0.15 up, "
                              "as much as the prompt's deviation asks within a first-token budget."),
    deviation: str = typer.Option("v", "--deviation", help="Select tokens by deviation of k, v or kv."),
    check_layer: int = typer.Option(None, "--check-layer", help="Layers before it are computed in full (default: the "
                                    "rule's own: 1, or 0 for the rules that rank by the preview's reading)."),
    gradual: bool = typer.Option(True, "--gradual/--no-gradual",
                                 help="Gradual filtering: select 1.5x the share at the check layer, narrowing "
                                      "to --ratio at the next (default)."),
    attention_weight: float = ATTENTION_WEIGHT_OPTION,
    selection: str = SELECTION_OPTION,
    max_tokens: int = typer.Option(32, "--max-tokens", help="Longest answer, in tokens."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 means greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling threshold."),
    seed: int = typer.Option(None, "--seed", help="Seed for sampling."),
    codec: str = CODEC_OPTION,
    keep: float = KEEP_OPTION,
    keep_rule: str = KEEP_RULE_OPTION,
    kv_tokens: int = KV_TOKENS_OPTION,
    kv_rule: str = KV_RULE_OPTION,
    show_sources: bool = typer.Option(False, "--show-sources", help="List the chunks used, after the answer."),
    host_cache: str = HOST_CACHE_OPTION,
    gpu_cache: str = GPU_CACHE_OPTION,
    cache_policy: str = CACHE_POLICY_OPTION,
    model: str = MODEL_OPTION,
    dtype: str = DTYPE_OPTION,
    device: str = DEVICE_OPTION,
    weights: str = WEIGHTS_OPTION,
    as_json: bool = JSON_OPTION,
    no_server: bool = typer.Option(False, "--no-server", help="Answer in this process even where a `kvrag serve` "
                                   "on the store runs (by default it asks that server, with the same settings)."),
    api_key: str = typer.Option(None, "--api-key", envvar="KVRAG_API_KEY", help="The key of a running server "
                                "that wants one (without it, such a server is not asked)."),
) -> None:
    """Answer a question from your indexed documents, reusing their precomputed KV caches. Where a `kvrag serve`
    runs on the same store with the same settings, the question goes to it: no model to load.

    Example: kvrag ask "Who founded the company?" --show-sources
    """
    _check(mode, codec)
    todo = _collect_questions(question, questions, limit)
    path, finder = resolve_store(store), _Chunks(k, chunks, relative_cutoff, min_score)
    blend, caches = (check_layer, deviation, gradual, attention_weight, selection), (host_cache, gpu_cache, cache_policy)
    sampling, budget = (max_tokens, temperature, top_p, seed), (kv_tokens, kv_rule)
    answers = None  # a server (its own tiers) takes the blend's default knobs alone; decided before torch loads
    served = None if no_server or blend != _BLEND_DEFAULTS or any(caches) else running_server(path, {
        "model": model, "dtype": dtype, "device": device, "weights": weights, "codec": codec, "keep": keep,
        "keep_rule": keep_rule}, api_key)
    if served:
        request = {"mode": mode, "ratio": ratio if ratio == "auto" else _number(ratio),
                   **dict(zip(("max_tokens", "temperature", "top_p", "seed"), sampling, strict=True)),
                   "kv_tokens": kv_tokens, "kv_rule": kv_rule}
        answers = _answer_served(served, todo, finder, request, codec, as_json, show_sources)
    if answers is None:
        settings = _Settings.of(mode, ratio, blend, sampling, codec, caches, (model, dtype, device, weights),
                                (keep, keep_rule), budget)
        answers = _answer_all(path, todo, finder, settings, as_json, show_sources)
    if as_json:  # one question named on the command line: an object; --questions or stdin: a list
        records = [a.to_json() for a in answers]
        print_json(records[0] if question not in (None, "-") else records)
    if answers and answers[-1].finish_reason == "interrupted":  # after the partial answer is out: status 130
        raise Interrupted(f"interrupted; answered {len(answers) - 1} of {len(todo)} questions in full")


def _check(mode: str, codec: str) -> None:
    """A bad --mode or --codec in one line, before anything loads."""
    from kvrag.config import MODES
    from kvrag.store.keys import codec_id

    if mode not in MODES:
        raise KvragError(f"--mode must be one of {', '.join(MODES)}, got {mode}")
    codec_id(codec)


_BLEND_DEFAULTS = (None, "v", True, None, None)  # ask's blend knobs when none is given: what a server runs


@dataclass(frozen=True)
class _Settings:
    mode: str
    config: BlendConfig
    sampling: SamplingConfig
    ratio: RatioPolicy
    codec: str
    cache_options: tuple  # --host-cache, --gpu-cache, --cache-policy
    model_options: tuple  # --model, --dtype, --device, --weights
    keep_options: tuple  # --keep, --keep-rule
    kv_budget: tuple  # --kv-tokens, --kv-rule

    @classmethod
    def of(cls, mode: str, ratio: str, blend: tuple, sampling: tuple, codec: str, caches: tuple, models: tuple,
           keeps: tuple, budget: tuple) -> _Settings:
        """Checked and built for answering here (imports torch): `blend` is (check layer, deviation, gradual,
        attention weight, selection), `sampling` (max tokens, temperature, top-p, seed)."""
        from kvrag.blend.config import BlendConfig
        from kvrag.blend.ratio import RatioPolicy
        from kvrag.model.sampling import SamplingConfig

        check_cache_options(*caches)
        check_layer, deviation, gradual, attention_weight, selection = blend
        policy = RatioPolicy.parse(ratio)
        config = policy.start(BlendConfig(check_layer=check_layer, deviation=deviation, gradual=gradual,
                                          **attention_weight_override(attention_weight), selection=selection))
        return cls(mode, config, SamplingConfig(*sampling), policy, codec, caches, models, keeps, budget)

    def request_options(self) -> dict:
        """The API's options for how to answer."""
        sp = self.sampling
        return {"mode": self.mode, "ratio": self.ratio, "selection": self.config,
                "max_tokens": sp.max_tokens, "temperature": sp.temperature, "top_p": sp.top_p, "seed": sp.seed,
                "kv_tokens": self.kv_budget[0], "kv_rule": self.kv_budget[1]}


def _answer_all(store: Path, todo: list[Question], finder: _Chunks, s: _Settings, as_json: bool,
                show_sources: bool) -> list:
    """Open the store and load the model (the retriever beside it), then answer each question in turn."""
    from kvrag.api import KVRag

    startup_s = process_age()
    console = stderr_console()
    host_cache, gpu_cache, policy = s.cache_options
    rag = KVRag(store, model=s.model_options[0], dtype=s.model_options[1], device=s.model_options[2],
                weights=s.model_options[3], codec=s.codec,
                host_cache=host_cache if len(todo) > 1 else "0",  # the tiers pay off from the second question on
                gpu_cache=gpu_cache, cache_policy=policy, preload_retriever=any(map(finder.retrieves, todo)),
                tune_process=True, keep=s.keep_options[0], keep_rule=s.keep_options[1])
    answers = []
    try:
        for n, q in enumerate(todo):
            if len(todo) > 1 and not as_json:  # the answers go to stdout, each after its question on stderr
                console.print(f"[bold]Q{n + 1}:[/] {q.text}", highlight=False, soft_wrap=True)
            answer = _stream(rag.submit(q.text, **finder.options(q), **s.request_options()), as_json)
            answer.timings["since_start"] = process_age()
            if n == 0:
                answer.timings.update(startup=startup_s, **rag.load_timings)
            answers.append(answer)
            _report(console, answer, s.codec, as_json, show_sources)
            if answer.finish_reason == "interrupted":
                break
    finally:
        rag.close()
    return answers


def _answer_served(served: tuple[str, str | None], todo: list[Question], finder: _Chunks, request: dict,
                   codec: str, as_json: bool, show_sources: bool) -> list | None:
    """Each question through the running server (cli/ask_server.py), `request` its API fields; None where it does
    not answer the first (gone since it was announced): then this process answers. Ctrl-C ends an answer where it
    stands, as here."""
    url, key = served
    console, startup_s = stderr_console(), process_age()
    answers = []
    for n, q in enumerate(todo):
        if len(todo) > 1 and not as_json:
            console.print(f"[bold]Q{n + 1}:[/] {q.text}", highlight=False, soft_wrap=True)
        try:
            answer = ask_server(url, key, q.text, {**request, **finder.request_fields(q)},
                                (lambda _: None) if as_json else _write)
        except ServerGone:
            if n == 0:
                return None
            raise KvragError(f"the server at {url} went away after {n} answers") from None
        except KeyboardInterrupt:
            answers.append(_interrupted(q.text, request["mode"], url))
            break
        answer.served_by, answer.timings["since_start"] = url, process_age()
        if n == 0:
            answer.timings["startup"] = startup_s  # no model or embedder loaded here: the server holds them
        answers.append(answer)
        _report(console, answer, codec, as_json, show_sources)
    return answers


def _number(text: str) -> float | str:
    """A ratio as the API's number; text that is none goes as it is, for the server to refuse in one line."""
    try:
        return float(text)
    except ValueError:
        return text


def _interrupted(question: str, mode: str, url: str):
    from kvrag.engine.answer import Answer

    return Answer(question, "", [], mode, None, 0, 0, 0, 0, finish_reason="interrupted", served_by=url)


def _stream(job, as_json: bool):
    """The answer, its text written to stdout as it comes (unless --json); Ctrl-C ends it where it stands."""
    try:
        for piece in job:
            if not as_json:
                _write(piece)
    except KeyboardInterrupt:
        job.cancel()
    return job.result()


def _report(console, answer, codec: str, as_json: bool, show_sources: bool) -> None:
    """After an answer on a terminal: its end, its sources if asked, and a note on chunks computed for it."""
    if as_json:
        return
    _write(" [interrupted]\n" if answer.finish_reason == "interrupted" else "\n")
    if show_sources:
        _print_sources(answer.sources, answer.chunk_tiers)
    if answer.computed_chunks:
        console.print(f"note: {len(answer.computed_chunks)} of {len(answer.sources)} chunks had no stored KV for "
                      f"this model and codec ({codec}): computed them and stored them now; "
                      "`kvrag precompute` does this ahead of time", highlight=False, soft_wrap=True)


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def process_age() -> float:
    """Seconds since this process started (Linux: from /proc; elsewhere since kvrag was imported)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22: start time
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED_AT


def _collect_questions(question: str | None, questions: Path | None, limit: int | None) -> list[Question]:
    if questions is not None:
        todo = parse_questions(questions)
    elif question is None or question == "-":
        if question is None and sys.stdin.isatty():
            raise KvragError("give a question, --questions FILE, or pipe questions on stdin")
        todo = [Question(line) for line in sys.stdin.read().splitlines() if line.strip()]
    else:
        todo = [Question(question)]
    if not todo or any(not q.text.strip() for q in todo):
        raise KvragError("the question is empty")
    return todo[:limit] if limit else todo


class _Chunks:
    """Where a question's chunks come from: its own passages, explicit ids, or retrieval."""

    def __init__(self, k: int, chunk_ids: str | None, relative_cutoff: float, min_score: float):
        self.k, self.relative_cutoff, self.min_score = k, relative_cutoff, min_score
        self.explicit = [c.strip() for c in chunk_ids.split(",") if c.strip()] if chunk_ids else None

    def retrieves(self, q: Question) -> bool:
        return q.passages is None and self.explicit is None

    def request_fields(self, q: Question) -> dict:
        """The HTTP API's chunk fields for this question (server/protocol.py)."""
        passages = None if q.passages is None else [{"title": t, "text": x} for t, x in q.passages]
        return {"k": self.k, "relative_cutoff": self.relative_cutoff, "min_score": self.min_score,
                "chunk_ids": self.explicit, "passages": passages}

    def options(self, q: Question) -> dict:
        """The API's chunk options for this question."""
        return {"k": self.k, "relative_cutoff": self.relative_cutoff, "min_score": self.min_score,
                "chunk_ids": self.explicit, "passages": q.passages}


def _print_sources(sources: list[dict], tiers: list[str]) -> None:
    """Part of the result, as they are of --json's record: on stdout after the answer."""
    table = Table(title="sources", show_lines=False)
    for col in ("#", "chunk", "title", "tokens", "score", "KV from"):
        table.add_column(col)
    for n, (s, tier) in enumerate(zip(sources, tiers or [""] * len(sources), strict=True), start=1):
        table.add_row(str(n), s["chunk_id"][:12], s.get("title") or s.get("doc_id", ""), str(s["tokens"]),
                      f"{s['score']:.3f}" if "score" in s else "", tier)
    stdout_console().print(table)
