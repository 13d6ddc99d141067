"""`kvrag bench chat`: a multi-turn plain chat and exact repeats against one `kvrag serve`, as a user's client sends
them (streamed, the openai client, the whole history each turn, the server's defaults).

Each user turn is `words` words of MuSiQue report passages (items 50-99) and a one-line instruction; the server keeps
each turn (its prefix cache) and the next turn's history starts with it. Then the last turn is sent again, exactly,
`repeats` times. Per request: the client's TTFT, prompt and cached tokens (usage), the prompt rows the server
copied into its KV pool (a prefix hit's rows are referenced, not copied) and the cached head's rows it copied out of it
again, per layer (gathered, or packed for the row kernel): its `kvrag_kv_rows_copied` counter, read before and after. The report adds the last turn's TTFT over the first's, the repeats' median TTFT, the
server's peak resident memory and the load average before and after (timings under load are rough).
"""

from __future__ import annotations

import asyncio
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvrag.bench.chat_restart import next_turn_elsewhere
from kvrag.bench.serve_load import ask, client, labelled
from kvrag.bench.serve_server import ServerProcess
from kvrag.bench.serve_soak import rss_mb
from kvrag.bench.serve_store import model_args
from kvrag.errors import KvragError

INSTRUCTION = "\nSummarise the above in one line."


@dataclass(frozen=True)
class ChatBenchConfig:
    store: Path
    work: Path
    turns: int = 12
    words: int = 270
    repeats: int = 3
    max_tokens: int = 12
    model: str | None = None
    dtype: str | None = None
    restart: bool = False  # then the next turn after a kill -9 and a restart (bench/chat_restart.py)
    move: bool = False  # or on a second replica beside the first, on the same store

    def __post_init__(self) -> None:
        if min(self.turns, self.words, self.max_tokens) < 1 or self.repeats < 0:
            raise KvragError("turns, words and max tokens must be positive, repeats at least 0")
        if self.restart and self.move:
            raise KvragError("--restart and --move each take the next turn elsewhere: give one")


def user_turns(items: Sequence[dict], turns: int, words: int) -> list[str]:
    """`turns` user messages of `words` words each, cut in order from the items' passages."""
    text = " ".join(ctx["text"] for item in items for ctx in item["ctxs"]).split()
    if len(text) < turns * words:
        raise KvragError(f"the items hold {len(text)} words, fewer than {turns} turns of {words}")
    return [" ".join(text[i * words:(i + 1) * words]) + INSTRUCTION for i in range(turns)]


def run(cfg: ChatBenchConfig, items: Sequence[dict], log: Callable[[str], None]) -> dict:
    elsewhere = cfg.restart or cfg.move
    messages = user_turns(items, cfg.turns + 2 * elsewhere, cfg.words)  # with --restart or --move, two next turns
    load_before = os.getloadavg()
    args = model_args(cfg.model, cfg.dtype)
    next_turn = None  # --restart's or --move's report
    with ServerProcess(cfg.store, args, cfg.work / "logs" / "serve-chat.log") as server:
        turns, repeats = asyncio.run(_converse(server, messages[:cfg.turns], cfg, log))
        peak = rss_mb(server.proc.pid, "VmHWM")
        if elsewhere and not any("error" in t for t in turns):
            history = [m for message, t in zip(messages, turns, strict=False) for m in ({"role": "user", "content": message},
                                                                           {"role": "assistant", "content": t["text"]})]
            log_name = "serve-chat-restart.log" if cfg.restart else "serve-chat-replica.log"
            again = lambda: ServerProcess(cfg.store, args, cfg.work / "logs" / log_name)  # noqa: E731
            next_turn = next_turn_elsewhere(server, again, history, messages[-2], messages[-1], cfg.max_tokens, log,
                                            kill=cfg.restart)
    good = [t for t in turns + repeats if "error" not in t]
    first, last = turns[0], turns[-1]
    return {"schema": "kvrag.bench-chat/1",
            "config": {**cfg.__dict__, "store": str(cfg.store), "work": str(cfg.work)},
            "turns": turns, "repeats": repeats, "failed": len(turns) + len(repeats) - len(good),
            "last_over_first_ttft": last["ttft_s"] / first["ttft_s"] if "error" not in first and "error" not in last else None,
            "repeat_ttft_p50_s": statistics.median(r["ttft_s"] for r in repeats if "error" not in r)
            if any("error" not in r for r in repeats) else None,
            "server_peak_rss_mb": peak, "restart" if cfg.restart else "move": next_turn,
            "load_average": {"before": load_before, "after": os.getloadavg()}}


async def _converse(server: ServerProcess, messages: list[str], cfg: ChatBenchConfig, log) -> tuple[list, list]:
    extra = {"k": 0}  # plain chat: no retrieval, whatever the store holds
    async with client(server.url) as api, httpx.AsyncClient() as http:
        model = server.model_id()
        # loads and warms up, as a server that has run a while; two tokens: a one-token answer's prompt is put in the
        # pool after its stream ends, which the first turn's count would take for its own
        await ask(api, model, "Hello.", 0, extra, 2)
        history, turns, repeats = [], [], []
        for i, message in enumerate(messages):
            turns.append(await _timed(api, http, server, model, message, history, extra, cfg.max_tokens))
            log(f"turn {i + 1}: " + _line(turns[-1]))
            if "error" in turns[-1]:
                break
            history += [{"role": "user", "content": message}, {"role": "assistant", "content": turns[-1]["text"]}]
        for i in range(cfg.repeats if "error" not in turns[-1] else 0):
            repeats.append(await _timed(api, http, server, model, messages[len(turns) - 1], history[:-2], extra,
                                        cfg.max_tokens))
            log(f"repeat {i + 1}: " + _line(repeats[-1]))
    return turns, repeats


async def _timed(api, http, server, model, message, history, extra, max_tokens) -> dict:
    """One streamed turn, with the rows the server copied into its pool for it."""
    before = await _rows_copied(http, server.url)
    result = await ask(api, model, message, 0, extra, max_tokens, list(history))
    if not result.ok:
        return {"error": result.error or "no answer"}
    after = await _rows_copied(http, server.url)
    copied = {how: after[how] - before.get(how, 0) for how in after}
    return {"ttft_s": result.ttft_s, "prompt_tokens": result.prompt_tokens, "cached_tokens": result.cached_tokens,
            "rows_copied": sum(copied.values()), "rows_admitted": copied.get("admitted", 0),
            "rows_read_out": copied.get("gathered", 0) + copied.get("packed", 0), "text": result.text.strip()}


async def _rows_copied(http: httpx.AsyncClient, url: str) -> dict[str, int]:
    """The server's kvrag_kv_rows_copied counter by its `how` label."""
    text = (await http.get(url + "/metrics")).text
    found = {how: int(n) for how, n in labelled(text, "kvrag_kv_rows_copied_total", "how").items()}
    if not found:
        raise KvragError("the server's /metrics has no kvrag_kv_rows_copied_total")
    return found


def _line(t: dict) -> str:
    if "error" in t:
        return t["error"]
    return (f"TTFT {t['ttft_s']:.3f} s, {t['cached_tokens']}/{t['prompt_tokens']} cached, "
            f"{t['rows_admitted']} rows copied in, {t['rows_read_out']} out of the pool")


def markdown(report: dict) -> str:
    rows = ["| request | prompt tokens | cached | rows copied in | rows copied out (per layer) | TTFT s |",
            "|---|---|---|---|---|---|"]
    named = [(f"turn {i + 1}", t) for i, t in enumerate(report["turns"])]
    named += [(f"repeat {i + 1}", t) for i, t in enumerate(report["repeats"])]
    for name, t in named:
        rows.append(f"| {name} | {t['error']} | | | | |" if "error" in t else
                    f"| {name} | {t['prompt_tokens']} | {t['cached_tokens']} | {t['rows_admitted']} "
                    f"| {t['rows_read_out']} | {t['ttft_s']:.3f} |")
    ratio, repeat = report["last_over_first_ttft"], report["repeat_ttft_p50_s"]
    load = report["load_average"]
    rows += ["", f"last turn's TTFT over the first's: {ratio:.2f}" if ratio else "no ratio (a turn failed)",
             f"exact repeat, median TTFT: {repeat:.3f} s" if repeat is not None else "no repeat served",
             f"server peak RSS: {report['server_peak_rss_mb']:.0f} MB; load average before "
             f"{load['before'][0]:.2f}, after {load['after'][0]:.2f}"]
    for key, name, how in (("restart", "restarted", "after kill -9 and restart"),
                            ("move", "moved", "on another replica")):
        if (r := report.get(key)) is not None:
            rows.append(f"next turn: warm {r['warm']['ttft_s']:.3f} s, in full {r['full']['ttft_s']:.3f} s; {how} "
                        f"{r[name]['ttft_s']:.3f} s ({r[name]['cached_tokens']} of {r[name]['prompt_tokens']} "
                        f"cached): {r[name + '_over_warm']:.2f}x warm, {r[name + '_over_full']:.2f}x full")
    return "\n".join(rows)
