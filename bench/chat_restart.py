"""`kvrag bench chat --restart` and `--move`: does a conversation outlive its server, and follow it to another
replica (issue 72)?

After the chat's turns on a server that has run them: the next turn (A) warm, its history in the pool; the same A
under another cache salt (no hit: a full prefill of the same prompt, the baseline both are held to); the write-back
worker's jobs done (the history's blocks in the store's prefix table); then, with --restart, SIGKILL and a new server
on the same store, or with --move a second replica started beside the first on the same store (as a router sends a
conversation elsewhere), warmed up on a short prompt; then another next turn (B, as long as A) after the same
history, whose head comes from the store. Ratios in one run: B's TTFT over A's warm one (target <= 1.5) and over
A's full prefill (target <= 0.3).
"""

from __future__ import annotations

import asyncio
import signal
import time

import httpx

from kvrag.bench.serve_load import ask, client, labelled
from kvrag.bench.serve_server import ServerProcess
from kvrag.errors import KvragError


def next_turn_elsewhere(server: ServerProcess, other, history: list[dict], turn_a: str, turn_b: str,
                        max_tokens: int, log, kill: bool = True) -> dict:
    """`other()`: a new ServerProcess on the same store (entered here), which answers turn B: after `server` is
    killed (kill), or beside it (a moved conversation). The report's keys name B `restarted` or `moved`."""
    warm, full = asyncio.run(_before(server, history, turn_a, max_tokens))
    log(f"next turn warm: TTFT {warm['ttft_s']:.3f} s ({warm['cached_tokens']} cached); in full "
        f"{full['ttft_s']:.3f} s")
    wait_for_writes(server.url)
    if kill:
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(60)
    with other() as again:
        after = asyncio.run(_after(again, history, turn_b, max_tokens))
    name = "restarted" if kill else "moved"
    log(f"{'after kill -9 and restart' if kill else 'on another replica'}: TTFT {after['ttft_s']:.3f} s "
        f"({after['cached_tokens']} cached)")
    return {"warm": warm, "full": full, name: after, f"{name}_over_warm": round(after["ttft_s"] / warm["ttft_s"], 3),
            f"{name}_over_full": round(after["ttft_s"] / full["ttft_s"], 3)}


async def _before(server: ServerProcess, history, message: str, max_tokens: int) -> tuple[dict, dict]:
    async with client(server.url) as api:
        model = server.model_id()
        warm = await _turn(api, model, history, message, {"k": 0}, max_tokens)
        full = await _turn(api, model, history, message, {"k": 0, "cache_salt": f"full-{time.time_ns()}"}, max_tokens)
    return warm, full


async def _after(server: ServerProcess, history, message: str, max_tokens: int) -> dict:
    async with client(server.url) as api:
        model = server.model_id()
        await ask(api, model, "Hello.", 0, {"k": 0}, 2)  # the model's first forward, as a server that has run a while
        return await _turn(api, model, history, message, {"k": 0}, max_tokens)


async def _turn(api, model: str, history, message: str, extra: dict, max_tokens: int) -> dict:
    result = await ask(api, model, message, 0, extra, max_tokens, list(history))
    if not result.ok:
        raise KvragError(f"a turn failed: {result.error or 'no answer'}")
    return {"ttft_s": round(result.ttft_s, 4), "prompt_tokens": result.prompt_tokens,
            "cached_tokens": result.cached_tokens}


def wait_for_writes(url: str, timeout_s: float = 300.0) -> None:
    """Until the server's write-back worker has done every job given (its /metrics)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        jobs = labelled(httpx.get(url + "/metrics").text, "kvrag_write_back_jobs_total", "state")
        if jobs and jobs["given"] <= jobs["done"] + jobs["failed"]:
            return
        time.sleep(0.1)
    raise KvragError(f"the server's writes did not finish within {timeout_s:.0f} s")
