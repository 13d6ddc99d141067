"""`kvrag bench serve --soak MINUTES`: one `kvrag serve` as users run it (blend, the memory tiers on) under a steady
mixed load for MINUTES, its resident memory and TTFT read each window, so a server that grows or slows shows.

The load is Poisson arrivals at `--soak-rate` questions/s of the questions (Zipf popularity), their modes mixed
(blend, full, reuse, in turn), in windows of `window_s` seconds; the first `warmup` windows fill the tiers and the
allocator and are left out of the verdict. After each window the server's resident set (/proc/PID/status's VmRSS)
is read. The report: per window the RSS, TTFT p50 and what was served; `rss_end_over_start`, the last window's RSS
over the first one after warm-up (the issue's target: within 1.10); `ttft_p50_end_over_start`, the last window's TTFT
p50 over the first settled window of the same mode.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvrag.bench.serve import summarize
from kvrag.bench.serve_load import client, run_rate, workload
from kvrag.bench.serve_server import ServerProcess
from kvrag.bench.serve_store import model_args
from kvrag.errors import KvragError

MODES = ("blend", "full", "reuse")  # mixed: what the server's different requests cost and keep differs


@dataclass(frozen=True)
class SoakConfig:
    work: Path
    store: Path
    questions: tuple[str, ...]
    minutes: float
    rate: float = 0.5
    window_s: float = 60.0
    warmup: int = 1  # windows left out of the verdict
    seed: int = 0
    zipf: float = 1.0
    k: int = 5
    max_tokens: int = 16
    model: str | None = None
    dtype: str | None = None

    def __post_init__(self) -> None:
        if self.minutes <= 0 or self.rate <= 0 or self.window_s <= 0:
            raise KvragError("--soak takes positive minutes, --soak-rate positive questions/s")
        if not self.questions:
            raise KvragError("the soak needs questions to send")

    @property
    def windows(self) -> int:
        """Windows to run, warm-up included."""
        return self.warmup + max(1, math.ceil(self.minutes * 60 / self.window_s))


def run(cfg: SoakConfig, log: Callable[[str], None]) -> dict:
    windows = cfg.windows
    with ServerProcess(cfg.store, model_args(cfg.model, cfg.dtype), cfg.work / "logs" / "serve-soak.log") as server:
        samples = asyncio.run(_soak(cfg, server, windows, log))
    settled = samples[cfg.warmup:]
    last = settled[-1]

    def ratio(key: str, first: dict) -> float | None:
        return last[key] / first[key] if first.get(key) and last.get(key) is not None else None

    same_mode = next(s for s in settled if s["mode"] == last["mode"])  # TTFT differs by mode: like with like

    return {"schema": "kvrag.bench-serve-soak/1", "config": {**cfg.__dict__, "work": str(cfg.work),
                                                             "store": str(cfg.store), "questions": len(cfg.questions)},
            "windows": samples, "server_exit_status": server.exit_code,
            "rss_end_over_start": ratio("rss_mb", settled[0]), "ttft_p50_end_over_start": ratio("ttft_p50_s", same_mode),
            "failed": sum(s["failed"] for s in samples)}


async def _soak(cfg: SoakConfig, server: ServerProcess, windows: int, log: Callable[[str], None]) -> list[dict]:
    samples = []
    async with client(server.url) as api:
        model = server.model_id()
        for w in range(windows):
            mode = MODES[w % len(MODES)]
            arrivals = workload(int(cfg.rate * cfg.window_s) + 1, len(cfg.questions), cfg.zipf, f"{cfg.seed}:{w}")
            start = time.perf_counter()
            results, span = await run_rate(api, model, cfg.questions, arrivals, cfg.rate, cfg.window_s,
                                           {"mode": mode, "k": cfg.k}, cfg.max_tokens)
            figures = summarize(results, span)
            sample = {"window": w, "warmup": w < cfg.warmup, "mode": mode, "rss_mb": rss_mb(server.proc.pid),
                      "wall_s": time.perf_counter() - start, **{k: figures[k] for k in (
                          "sent", "served", "failed", "ttft_p50_s", "ttft_mean_s")}}
            samples.append(sample)
            log(f"window {w} ({mode}{', warm-up' if sample['warmup'] else ''}): {sample['served']}/{sample['sent']} "
                f"served, TTFT p50 {sample['ttft_p50_s'] or 0:.2f} s, RSS {sample['rss_mb']:.0f} MB")
    return samples


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    """The process's resident set (VmHWM: its peak so far), from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KvragError(f"no {field} for process {pid}")


def markdown(report: dict) -> str:
    rows = ["| window | mode | served | TTFT p50 s | RSS MB |", "|---|---|---|---|---|"]
    for s in report["windows"]:
        rows.append(f"| {s['window']}{' (warm-up)' if s['warmup'] else ''} | {s['mode']} | {s['served']}/{s['sent']} "
                    f"| {s['ttft_p50_s'] or 0:.2f} | {s['rss_mb']:.0f} |")
    ratio = report["rss_end_over_start"]
    rows.append("")
    rows.append(f"RSS, last window over the first after warm-up: {ratio:.3f}" if ratio else "RSS ratio: n/a")
    return "\n".join(rows)
