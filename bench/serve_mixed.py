"""`kvrag bench serve --soak MINUTES --mixed`: one `kvrag serve` as many kinds of client use it at once, then a crash.

Arrivals (Poisson at `--soak-rate`) take their kind in turn from KINDS: a question over the stored corpus (server
retrieval, blend); the client's own passages in its message (drawn from a small pool, so passages come back and the
server keeps some at their second sighting, writing them back beside the engine); a three-turn chat without
retrieval; JSON mode (a json_schema); a tool call; a malformed request (must get a 4xx in the API's format); and a
stream the client drops after its first piece. Each answer is classed ok, 4xx, 5xx, timeout (a hang: no answer within
REQUEST_TIMEOUT_S) or error. Per window: the server's RSS and what each kind got.

Then the crash: two sightings of a new passage (the second queues its write-back), SIGKILL at once, `kvrag store
verify`, and the store read before and after (bench/serve_mixed_store.py): every corpus chunk stored before is still
stored, every kept passage's record names KV that is there, and the kept passages fit `--kept-passages`. A restart must
answer one request of every kind.
"""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from kvrag.bench.invented import invented_items
from kvrag.bench.serve_load import labelled, workload
from kvrag.bench.serve_mixed_store import snapshot
from kvrag.bench.serve_server import ServerProcess
from kvrag.bench.serve_soak import SoakConfig, rss_mb
from kvrag.bench.serve_store import model_args
from kvrag.store.tiers.config import parse_bytes

KINDS = ("rag", "passages", "chat", "json", "tool", "bad", "disconnect")
REQUEST_TIMEOUT_S = 180.0  # past this an answer counts as a hang
PASSAGE_POOL = 12  # client passages drawn from: small, so most come back and some are kept
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "year": {"type": "integer"}},
          "required": ["name", "year"]}
TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look a person up by name.",
                                         "parameters": {"type": "object", "properties": {"name": {"type": "string"}},
                                                        "required": ["name"]}}}


@dataclass(frozen=True)
class MixedConfig(SoakConfig):  # (zipf and k unused: kinds come in turn, retrieval at the server's default)
    kept_passages: str = "24MiB"  # room for two or three passages (SmolLM2): the bound is reached within the soak


def run(cfg: MixedConfig, log: Callable[[str], None]) -> dict:
    args = [*model_args(cfg.model, cfg.dtype), "--kept-passages", cfg.kept_passages]
    passages = _passages(cfg.seed)
    with ServerProcess(cfg.store, args, cfg.work / "logs" / "serve-mixed.log") as server:  # killed by _crash
        samples = asyncio.run(_soak(cfg, server, passages, cfg.windows, log))
        crash = asyncio.run(_crash(cfg, server, passages, log))
    with ServerProcess(cfg.store, args, cfg.work / "logs" / "serve-mixed-restart.log") as again:
        restart = asyncio.run(_round(again.url, again.model_id(), cfg, passages, random.Random(cfg.seed)))
    settled = samples[cfg.warmup:]
    totals = Counter()
    for s in samples:
        totals.update({(kind, outcome): n for kind, got in s["kinds"].items() for outcome, n in got.items()})
    return {"schema": "kvrag.bench-serve-mixed/1",
            "config": {**cfg.__dict__, "work": str(cfg.work), "store": str(cfg.store), "questions": len(cfg.questions)},
            "windows": samples, "totals": {f"{k}:{o}": n for (k, o), n in sorted(totals.items())},
            "hangs": totals_of(totals, "timeout"), "server_errors": totals_of(totals, "5xx"),
            "rss_end_over_start": settled[-1]["rss_mb"] / settled[0]["rss_mb"], "crash": crash,
            "restart": {kind: outcome for kind, outcome in restart}}


def totals_of(totals: Counter, outcome: str) -> int:
    return sum(n for (_, o), n in totals.items() if o == outcome)


def _passages(seed: int) -> list[str]:
    """Invented passages (bench/invented.py): none is in the store, so each is the client's own."""
    items = invented_items(PASSAGE_POOL + 4, seed=seed + 101, passages=(2, 2))
    return [item["ctxs"][0]["text"] for item in items]


async def _soak(cfg: MixedConfig, server: ServerProcess, passages: list[str], windows: int, log) -> list[dict]:
    model, rng, samples, turn = server.model_id(), random.Random(cfg.seed), [], 0
    for w in range(windows):
        arrivals = workload(int(cfg.rate * cfg.window_s) + 1, len(KINDS), 0.0, f"{cfg.seed}:{w}")
        start, at, tasks = time.perf_counter(), 0.0, []
        for gap, _ in arrivals:
            at += gap / cfg.rate
            if at > cfg.window_s and tasks:
                break
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            kind, turn = KINDS[turn % len(KINDS)], turn + 1  # in turn across windows
            tasks.append(asyncio.create_task(_one(server.url, model, kind, cfg, passages, rng)))
        done = await asyncio.gather(*tasks)
        kinds: dict[str, Counter] = {}
        for kind, outcome in done:
            kinds.setdefault(kind, Counter())[outcome] += 1
        sample = {"window": w, "warmup": w < cfg.warmup, "rss_mb": rss_mb(server.proc.pid),
                  "wall_s": time.perf_counter() - start, "sent": len(done),
                  "kinds": {k: dict(v) for k, v in sorted(kinds.items())}}
        samples.append(sample)
        bad = sum(n for v in kinds.values() for o, n in v.items() if o not in ("ok", "4xx"))
        log(f"window {w}: {len(done)} requests, {bad} neither answered nor refused, RSS {sample['rss_mb']:.0f} MB")
    return samples


async def _round(url: str, model: str, cfg: MixedConfig, passages: list[str], rng: random.Random) -> list:
    """One request of every kind, one after another."""
    return [await _one(url, model, kind, cfg, passages, rng) for kind in KINDS]


async def _one(url: str, model: str, kind: str, cfg: MixedConfig, passages: list[str],
               rng: random.Random) -> tuple[str, str]:
    """Send one request of `kind`; (kind, outcome)."""
    body = _body(kind, model, cfg, passages, rng)
    try:
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
            if kind == "disconnect":
                async with http.stream("POST", url + "/v1/chat/completions", json=body) as resp:
                    async for _ in resp.aiter_bytes():
                        break  # dropped after its first piece
                    return kind, _outcome(resp.status_code, kind)
            if kind == "bad":
                resp = await http.post(url + "/v1/chat/completions", content="{not json",
                                       headers={"content-type": "application/json"})
            else:
                resp = await http.post(url + "/v1/chat/completions", json=body)
            return kind, _outcome(resp.status_code, kind, resp)
    except httpx.TimeoutException:
        return kind, "timeout"
    except httpx.HTTPError:
        return kind, "error"


def _outcome(status: int, kind: str, resp: httpx.Response | None = None) -> str:
    if status >= 500:
        return "5xx"
    if status >= 400:
        error = resp.json().get("error", {}) if resp is not None else {}
        return "4xx" if kind == "bad" and error.get("message") else "unexpected-4xx"
    return "ok" if kind != "bad" else "bad-accepted"


def _body(kind: str, model: str, cfg: MixedConfig, passages: list[str], rng: random.Random) -> dict:
    question = rng.choice(cfg.questions)
    body: dict = {"model": model, "max_tokens": cfg.max_tokens, "temperature": 0}
    if kind in ("rag", "disconnect"):
        return {**body, "messages": [{"role": "user", "content": question}], "stream": kind == "disconnect"}
    if kind == "passages":
        chosen = rng.sample(passages[:PASSAGE_POOL], 2)
        text = "Answer from the sources below.\n\n" + "\n\n".join(chosen) + f"\n\nQuestion: {question}"
        return {**body, "messages": [{"role": "user", "content": text}]}
    plain = {**body, "rag": False}
    if kind == "chat":
        return {**plain, "messages": [{"role": "user", "content": "Hello, who are you?"},
                                      {"role": "assistant", "content": "I am an assistant."},
                                      {"role": "user", "content": question}]}
    if kind == "json":
        return {**plain, "messages": [{"role": "user", "content": "Name a person and a year as JSON."}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}
    if kind == "tool":
        return {**plain, "messages": [{"role": "user", "content": "Look up Ada Lovelace."}], "tools": [TOOL],
                "tool_choice": "required"}
    return body  # "bad": sent as broken JSON


async def _crash(cfg: MixedConfig, server: ServerProcess, passages: list[str], log) -> dict:
    """A new passage twice (its write-back queued at the second), SIGKILL at once, then the store checked."""
    model, rng = server.model_id(), random.Random(cfg.seed + 1)
    before = snapshot(cfg.store)
    fresh = {**_body("passages", model, cfg, passages, rng)}
    fresh["messages"] = [{"role": "user", "content": "Answer from the sources below.\n\n" + passages[-1]
                          + "\n\nQuestion: who is it about?"}]
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
        outcomes = [(await http.post(server.url + "/v1/chat/completions", json=fresh)).status_code]
        metrics = (await http.get(server.url + "/metrics")).text  # the jobs before the one the kill meets
        outcomes.append((await http.post(server.url + "/v1/chat/completions", json=fresh)).status_code)
    server.proc.send_signal(signal.SIGKILL)  # as the second answer ends: its passage's write-back has just begun
    server.exit_code = server.proc.wait()
    verify = subprocess.run([sys.executable, "-m", "kvrag", "store", "verify", "--store", str(cfg.store)],
                            capture_output=True, text=True)
    after = snapshot(cfg.store)
    bound = parse_bytes(cfg.kept_passages, "--kept-passages")
    lost = sorted(set(before["corpus"]) - set(after["corpus"]))
    log(f"crash: verify exit {verify.returncode}, {len(lost)} corpus chunks lost, kept passages "
        f"{after['kept_bytes'] / 2**20:.1f} MiB of {bound / 2**20:.1f}")
    return {"statuses": outcomes, "write_back_before": labelled(metrics, "kvrag_write_back_jobs_total", "state"),
            "verify_exit": verify.returncode,
            "killed_passage_kept": bool(set(after["kept"]) - set(before["kept"])),
            "verify_tail": verify.stdout.strip().splitlines()[-1:] + verify.stderr.strip().splitlines()[-1:],
            "corpus_before": len(before["corpus"]), "corpus_lost": lost, "kept_before": len(before["kept"]),
            "kept_after": len(after["kept"]), "records_without_kv": after["records_without_kv"],
            "kept_bytes": after["kept_bytes"], "kept_bound": bound, "store_bytes": after["store_bytes"]}


def markdown(report: dict) -> str:
    rows = ["| window | requests | RSS MB | outcomes |", "|---|---|---|---|"]
    for s in report["windows"]:
        got = ", ".join(f"{k} {dict(v)}" for k, v in s["kinds"].items())
        rows.append(f"| {s['window']}{' (warm-up)' if s['warmup'] else ''} | {s['sent']} | {s['rss_mb']:.0f} | {got} |")
    c = report["crash"]
    rows += ["", f"hangs {report['hangs']}, 5xx {report['server_errors']}, RSS last/first settled "
                 f"{report['rss_end_over_start']:.3f}",
             f"kill -9 as a write-back began (jobs before: {c['write_back_before']}; its passage stored: "
             f"{c['killed_passage_kept']}): verify exit {c['verify_exit']}, corpus chunks "
             f"lost {len(c['corpus_lost'])} of {c['corpus_before']}, records without KV {c['records_without_kv']}, "
             f"kept {c['kept_bytes'] / 2**20:.2f} MiB of {c['kept_bound'] / 2**20:.2f} MiB",
             f"after the restart: {report['restart']}"]
    return "\n".join(rows)
