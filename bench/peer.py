"""`kvrag bench peer`: llama.cpp's own server beside kvrag's, on the same GGUF and the same machine, in one run.

The people kvrag is for would otherwise run llama.cpp (or Ollama, which runs it) on the GGUF they already have. Both
servers are asked the same requests over the same OpenAI API, one server at a time so that each has the cores to
itself: llama-server on the GGUF as it is (`--llama-server PATH`, built from llama.cpp's sources: docs/performance.md
says how; never in CI), then `kvrag serve` on the same model in each weights form asked for. Per server:

- prefill: a prompt of N tokens never seen before (a new first line each time), one token asked: tokens/s is the
  prompt's tokens over the client's time to the first token; then decode at that context: the same request's
  later tokens over their time;
- batched decode: B requests at once (B slots on llama-server), each a short prompt and `--decode-tokens` tokens
  (min_tokens / ignore_eos hold every answer to its length): the tokens of all over the time from the first token
  to the last;
- a chat: `--chat-turns` user turns of MuSiQue passages, the whole history sent each turn (both servers cache the
  conversation: llama-server's prompt cache and `--cache-reuse`, kvrag's prefix cache), the first and last turn's
  TTFT, then the last turn sent again exactly.

`--peer-url` asks a server already running instead of starting llama-server (the tests point it at a second kvrag
server). Timings on a shared machine are rough: the load average is reported before and after each server.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvrag.bench.chat import user_turns
from kvrag.bench.local_s3 import free_ports
from kvrag.bench.peer_rag import RagPrompt, served_rag
from kvrag.bench.serve_load import ask, client
from kvrag.bench.serve_server import ServerProcess
from kvrag.errors import KvragError

FILLER = "The harbour archive keeps a record of every ship that called there, its cargo, crew and the weather."


@dataclass(frozen=True)
class PeerConfig:
    model: str  # a short name whose GGUF kvrag knows (model/names.py), e.g. qwen2.5-coder-0.5b
    store: Path  # an empty store for `kvrag serve` (the requests bring their text; k 0: no retrieval)
    work: Path  # server logs
    llama_server: Path | None = None
    peer_url: str | None = None  # an OpenAI-compatible server already running, instead of llama-server
    weights: tuple[str, ...] = ("dense", "int8", "int4")
    prompts: tuple[int, ...] = (2048,)
    batches: tuple[int, ...] = (1, 4, 16)
    decode_tokens: int = 64
    chat_turns: int = 12
    chat_words: int = 270
    threads: int = 2
    gguf: Path | None = None  # the GGUF llama-server reads (default: the model's own, as kvrag pulled it)
    # served RAG (bench/peer_rag.py): a store holding the prompts' passages for kvrag (None: not run), each
    # concurrency level's own prompts
    rag_store: Path | None = None
    concurrency: tuple[int, ...] = (1, 4)
    rag_tokens: int = 0  # the longest RAG prompt's tokens: llama-server's slots must hold it
    extra: dict = field(default_factory=lambda: {"k": 0, "ignore_eos": True})  # kvrag: no retrieval; llama.cpp: EOS

    def __post_init__(self) -> None:
        if (self.llama_server is None) == (self.peer_url is None):
            raise KvragError("give --llama-server PATH (llama.cpp's llama-server) or --peer-url URL, one of them")
        if self.llama_server is not None and not os.access(self.llama_server, os.X_OK):
            raise KvragError(f"--llama-server {self.llama_server}: not an executable file")
        if min((*self.prompts, *self.batches, self.decode_tokens, self.chat_turns, self.chat_words)) < 1:
            raise KvragError("prompt lengths, batches, decode tokens and chat turns must be positive")


def run(cfg: PeerConfig, items: Sequence[dict], tokens_per_word: float, log: Callable[[str], None],
        rag: Sequence[RagPrompt] = ()) -> dict:
    """Every server in turn over the same requests; `tokens_per_word` sizes the prompts (the model's tokenizer).
    `rag`: the served-RAG prompts, asked of the peer and of a kvrag server over cfg.rag_store (its default weights
    and the model's stored blending verdict, as a user serves it)."""
    turns = user_turns(items, cfg.chat_turns, cfg.chat_words)
    sides = []
    if cfg.peer_url is not None:
        sides.append(("peer", lambda: _Running(cfg.peer_url)))
    else:
        sides.append(("llama.cpp", lambda: LlamaServer(cfg)))
    for form in cfg.weights:
        args = ["--model", cfg.model, "--weights", form, "--max-running", str(max(cfg.batches))]
        # the requests bring no passages, so nothing is blended: the blending check is not run for them
        sides.append((f"kvrag {form}", lambda args=args: ServerProcess(cfg.store, args, cfg.work / "kvrag.log",
                                                                     {"KVRAG_MODEL_CHECK": "0"})))
    report = {"schema": "kvrag.bench-peer/1", "model": cfg.model, "config": _config(cfg), "servers": {}, "rag": {}}
    for i, (name, start) in enumerate(sides):
        load = os.getloadavg()[0]
        with start() as server:
            log(f"{name}: {server.url}")
            named = lambda m, n=name: log(f"{n}: {m}")  # noqa: E731
            measured = asyncio.run(_measure(server.url, cfg, turns, tokens_per_word, named))
            if i == 0 and rag:
                report["rag"][name] = asyncio.run(_rag(server.url, cfg, rag, named))
        report["servers"][name] = {**measured, "load_average": [load, os.getloadavg()[0]]}
    if rag:
        args = ["--model", cfg.model, "--max-running", str(max(cfg.concurrency))]
        # a model not checked yet is checked at first use for at most 120 s, then answered in full (the report's
        # `blend` says so): run `kvrag model check --model M` before
        with ServerProcess(cfg.rag_store, args, cfg.work / "kvrag-rag.log", {"KVRAG_CHECK_BUDGET": "120"}) as server:
            report["rag"]["kvrag"] = asyncio.run(_rag(server.url, cfg, rag, lambda m: log(f"kvrag (RAG): {m}")))
    return report


async def _rag(url: str, cfg: PeerConfig, prompts: Sequence[RagPrompt], log) -> dict:
    """Served RAG at each concurrency level, with the load average around it and what the server says it blends by."""
    load = os.getloadavg()[0]
    async with client(url) as api, httpx.AsyncClient() as http:
        model = (await http.get(url + "/v1/models", timeout=30)).json()["data"][0]["id"]
        await ask(api, model, "Hello.", 0, {"k": 0}, 2)
        verdict = (await http.get(url + "/health", timeout=30)).json().get("blend")
        levels = await served_rag(api, model, prompts, cfg.concurrency, {"k": 0})
    for level, figures in levels.items():
        log(f"RAG at concurrency {level}: {figures}")
    return {"levels": levels, "blend": verdict, "load_average": [load, os.getloadavg()[0]]}


async def _measure(url: str, cfg: PeerConfig, turns: list[str], tokens_per_word: float, log) -> dict:
    async with client(url) as api, httpx.AsyncClient() as http:
        model = (await http.get(url + "/v1/models", timeout=30)).json()["data"][0]["id"]
        await ask(api, model, "Hello.", 0, cfg.extra, 2)  # loads and warms up
        out = {"prefill": {}, "batch": {}, "chat": {}}
        for n in cfg.prompts:
            out["prefill"][str(n)] = await _prefill(api, model, n, tokens_per_word, cfg)
            log(f"prefill {n}: {out['prefill'][str(n)]}")
        for b in cfg.batches:
            out["batch"][str(b)] = await _batch(api, model, b, cfg)
            log(f"batch {b}: {out['batch'][str(b)]}")
        out["chat"] = await _chat(api, model, turns, cfg)
        log(f"chat: {out['chat']}")
    return out


async def _prefill(api, model: str, n: int, tokens_per_word: float, cfg: PeerConfig) -> dict:
    """A new prompt of about n tokens, then `decode_tokens` more at that context."""
    words = FILLER.split()
    body = " ".join(words[i % len(words)] for i in range(int(n / tokens_per_word)))
    result = await ask(api, model, f"Run {time.time_ns()}.\n{body}\nSay what the archive keeps.", 0,
                       {**cfg.extra, "min_tokens": cfg.decode_tokens}, cfg.decode_tokens)
    _raise_if_failed(result)
    decode_s = result.end - result.first
    return {"prompt_tokens": result.prompt_tokens, "ttft_s": round(result.ttft_s, 4),
            "prefill_tokens_per_s": round(result.prompt_tokens / result.ttft_s, 1),
            "decode_tokens_per_s": round((result.completion_tokens - 1) / decode_s, 1) if decode_s > 0 else None}


async def _batch(api, model: str, b: int, cfg: PeerConfig) -> dict:
    """b requests at once, each a short new prompt and decode_tokens tokens."""
    extra = {**cfg.extra, "min_tokens": cfg.decode_tokens}
    results = await asyncio.gather(*(ask(api, model, f"Run {time.time_ns()}-{i}. Tell a long story about a ship.",
                                         i, extra, cfg.decode_tokens) for i in range(b)))
    for r in results:
        _raise_if_failed(r)
    span = max(r.end for r in results) - min(r.first for r in results)
    tokens = sum(r.completion_tokens for r in results)
    return {"tokens": tokens, "seconds": round(span, 3), "tokens_per_s": round(tokens / span, 1)}


async def _chat(api, model: str, turns: list[str], cfg: PeerConfig) -> dict:
    """The chat's turns, each after the whole history, then the last sent again exactly."""
    history, ttft = [], []
    for message in turns:
        result = await ask(api, model, message, 0, cfg.extra, 12, list(history))
        _raise_if_failed(result)
        ttft.append(round(result.ttft_s, 4))
        history += [{"role": "user", "content": message}, {"role": "assistant", "content": result.text.strip()}]
    repeat = await ask(api, model, turns[-1], 0, cfg.extra, 12, history[:-2])
    _raise_if_failed(repeat)
    return {"turn_ttft_s": ttft, "last_over_first": round(ttft[-1] / ttft[0], 3),
            "last_prompt_tokens": repeat.prompt_tokens, "repeat_ttft_s": round(repeat.ttft_s, 4)}


def _raise_if_failed(result) -> None:
    if not result.ok:
        raise KvragError(f"a request failed: {result.error or 'no answer'}")


class LlamaServer:
    """llama.cpp's llama-server on the GGUF, its threads and slots as kvrag's, prompt cache and cache reuse on."""

    def __init__(self, cfg: PeerConfig):
        self.cfg, self.proc, self.url = cfg, None, ""

    def __enter__(self) -> LlamaServer:
        cfg = self.cfg
        (port,) = free_ports(1)
        slots = max(cfg.batches)
        # -c is shared by the slots: each gets a share that holds the longest prompt, RAG's included, and the whole
        # chat (at most two tokens a word, and its answers)
        longest = max(*cfg.prompts, cfg.rag_tokens) + cfg.decode_tokens
        per_slot = max(longest, cfg.chat_turns * (cfg.chat_words * 2 + 64)) + 256
        context = slots * per_slot
        log = open(cfg.work / "llama-server.log", "w")  # noqa: SIM115 - the child keeps its descriptor
        self.proc = subprocess.Popen([str(cfg.llama_server), "-m", str(cfg.gguf), "--host", "127.0.0.1",
                                      "--port", str(port), "-t", str(cfg.threads), "-c", str(context),
                                      "--parallel", str(slots), "--cache-reuse", "256"],
                                     stdout=log, stderr=log)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise KvragError(f"llama-server exited {self.proc.returncode} (log: {cfg.work / 'llama-server.log'})")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise KvragError("llama-server did not become healthy within 300 s")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class _Running:
    """A server someone else runs: entered and left as is."""

    def __init__(self, url: str):
        self.url = url.rstrip("/").removesuffix("/v1")

    def __enter__(self) -> _Running:
        return self

    def __exit__(self, *exc) -> None:
        pass


def _config(cfg: PeerConfig) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in cfg.__dict__.items()}


def markdown(report: dict) -> str:
    servers = report["servers"]
    prompts = sorted({n for s in servers.values() for n in s["prefill"]}, key=int)
    batches = sorted({b for s in servers.values() for b in s["batch"]}, key=int)
    head = ["server", *[f"prefill tok/s @{n}" for n in prompts], *[f"decode tok/s @{n}" for n in prompts],
            *[f"batch {b} tok/s" for b in batches], "chat turn 1 / last TTFT s", "repeat TTFT s", "load"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, s in servers.items():
        chat = s["chat"]
        cells = [name, *[str(s["prefill"][n]["prefill_tokens_per_s"]) for n in prompts],
                 *[str(s["prefill"][n]["decode_tokens_per_s"]) for n in prompts],
                 *[str(s["batch"][b]["tokens_per_s"]) for b in batches],
                 f"{chat['turn_ttft_s'][0]:.3f} / {chat['turn_ttft_s'][-1]:.3f}", f"{chat['repeat_ttft_s']:.3f}",
                 "-".join(f"{x:.1f}" for x in s["load_average"])]
        rows.append("| " + " | ".join(cells) + " |")
    rows += _rag_markdown(report.get("rag", {}))
    batch1 = [s["batch"].get("1", {}).get("tokens_per_s") for s in servers.values()]
    if all(batch1):
        rows += ["", "batch B over batch 1: " + "; ".join(
            f"{name} " + ", ".join(f"{b}: {s['batch'][b]['tokens_per_s'] / s['batch']['1']['tokens_per_s']:.2f}x"
                                   for b in batches) for name, s in servers.items())]
    return "\n".join(rows)


def _rag_markdown(rag: dict) -> list[str]:
    if not rag:
        return []
    rows = ["", "| served RAG | concurrency | requests/s | TTFT p50 s | TTFT p90 s | right | prompt tokens | load |",
            "|---|---|---|---|---|---|---|---|"]
    for name, side in rag.items():
        blend = side.get("blend")
        said = [str(blend[k]) for k in ("mode", "rule", "ratio") if blend and blend.get(k) is not None]
        label = f"{name} ({' '.join(said)})" if said else name
        for level, f in side["levels"].items():
            rows.append(f"| {label} | {level} | {f['requests_per_s']:.3f} | {f['ttft_p50_s']:.3f} | {f['ttft_p90_s']:.3f} "
                        f"| {f['right']}/{f['requests']} | {f['prompt_tokens_p50']:.0f} | "
                        + "-".join(f"{x:.1f}" for x in side["load_average"]) + " |")
    return rows
