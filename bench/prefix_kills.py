"""`kvrag bench kills`: does the store's prefix table survive servers killed as they write to it (issue 72)?

Round after round, a `kvrag serve` on the store with a small `--prefix-store` bound (so that its spills evict), two
prompts of fresh text whose answers end as their blocks' writes begin, then SIGKILL at once, before the write-back
worker is done. After each kill the table is read whole (as `store verify` reads it): how many blocks, their bytes
against the bound, how many are not whole. The report holds every round and a verdict: no block ever bad, the bound
never exceeded, some blocks left by the writes done before the kills.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from kvrag.bench.serve_load import ask, client
from kvrag.bench.serve_server import ServerProcess
from kvrag.errors import KvragError
from kvrag.store.env import StoreEnv
from kvrag.store.prefix_table import table_stats

FILLER = "Tell me about the harbour's lights. "


def kills_during_spills(store: Path, args: list[str], kills: int, bound: int, logs: Path, log) -> dict:
    """`kills` rounds of a server on `store` (`args`: its model options) killed as it spills: the table after each."""
    if kills < 1 or bound < 1:
        raise KvragError("--kills and --bound must be positive")
    rounds = []
    for i in range(kills):
        with ServerProcess(store, [*args, "--prefix-store", str(bound)], logs / f"serve-kill-{i}.log") as server:
            asyncio.run(_spill(server, i))
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait(60)
        env = StoreEnv.open(store)
        try:
            rounds.append(table_stats(env))
        finally:
            env.close()
        log(f"kill {i + 1}: {rounds[-1]['blocks']} blocks, {rounds[-1]['bytes']} of {bound} bytes, "
            f"{rounds[-1]['bad']} not whole")
    return {"schema": "kvrag.bench-kills/1", "kills": kills, "bound_bytes": bound, "rounds": rounds,
            "ok": all(r["bad"] == 0 and r["bytes"] <= bound for r in rounds) and rounds[-1]["blocks"] > 0}


async def _spill(server: ServerProcess, round_: int) -> None:
    """Two one-token answers to fresh prompts: the first's writes likely done when the second's answer ends, the
    second's not."""
    async with client(server.url) as api:
        model = server.model_id()
        for j in range(2):
            result = await ask(api, model, f"Run {round_}-{j}. " + FILLER * 30, 0, {"k": 0}, 1)
            if not result.ok:
                raise KvragError(f"a request failed before the kill: {result.error or 'no answer'}")


def markdown(report: dict) -> str:
    rows = ["| kill | blocks | bytes | not whole |", "|---|---|---|---|"]
    rows += [f"| {i + 1} | {r['blocks']} | {r['bytes']} | {r['bad']} |" for i, r in enumerate(report["rounds"])]
    verdict = "whole and within the bound" if report["ok"] else "NOT whole or past the bound"
    return "\n".join(rows + ["", f"{report['kills']} kills, bound {report['bound_bytes']} bytes: {verdict}"])
