"""`kvrag bench serve`: the measured load test of `kvrag serve` (issue 26), replacing the simulated queue of
`kvrag bench` (bench/rag/workloads.py) with a real server, a real client and real arrivals.

Each configuration has a `kvrag serve` process of its own (bench/serve_server.py), all started at once. First,
on each warm idle server, single questions end to end against what the server reports (bench/serve_single.py).
Then Poisson arrivals of questions with Zipf-skewed popularity at rising rates (bench/serve_load.py), each rate
bounded in seconds and requests and run for every configuration in turn before the next rate; a configuration
stops rising after its first rate over the TTFT limit or with a failed request. Its throughput is, as RAGCache
defines it, the highest rate whose TTFT statistic stays within the limit with no failed request. Beside each
measured rate, the simulated queue's figures from the single questions' times check the simulation point by point.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack, ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

from kvrag.bench.rag.metrics import percentile
from kvrag.bench.serve_load import Result, client, metrics_delta, run_rate, scrape, workload
from kvrag.bench.serve_server import ServerProcess
from kvrag.bench.serve_single import simulated, single_questions
from kvrag.bench.serve_store import model_args
from kvrag.errors import KvragError

# name -> (the request's mode, kvrag serve's extra options). Full prefill and prefix caching keep the server's
# default tiers: full prefill reads no stored KV, and prefix caching may find its first chunk in memory.
CONFIGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "full": ("full", ()),
    "prefix": ("prefix", ()),
    "blend": ("blend", ("--host-cache", "0")),  # blend without the memory tiers: every chunk from the store
    "blend+tiers": ("blend", ()),  # RAGCache: the tiers on (the server's default host cache)
}
STATS = ("p50", "mean")
LIMIT_FACTOR = 3.0  # the simulated bench's default limit (bench/rag/workloads.py): 3 x full prefill's TTFT


@dataclass(frozen=True)
class ServeBenchConfig:
    work: Path  # server logs
    store: Path | None = None  # indexed and precomputed
    questions: tuple[str, ...] = ()
    rates: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.6, 0.8, 1.0, 1.3, 1.6)
    requests_per_rate: int = 200
    # arrivals stop after this long, even short of requests_per_rate: a time bound, not a small count, so an
    # overloaded rate shows as a queue that grows (a burst of N requests waits N/2 services whatever the rate)
    seconds_per_rate: float = 60.0
    ttft_limit_s: float | None = None  # None: LIMIT_FACTOR x full prefill's median TTFT on the idle server
    ttft_stat: str = "p50"
    configs: tuple[str, ...] = tuple(CONFIGS)
    seed: int = 0
    zipf: float = 1.0
    k: int = 5
    max_tokens: int = 16
    latency_runs: int = 3  # questions timed one at a time on the warm idle server, twice each (0: none)
    model: str | None = None
    dtype: str | None = None
    server_args: tuple[str, ...] = ()  # more `kvrag serve` options for every configuration

    def __post_init__(self) -> None:
        unknown = [c for c in self.configs if c not in CONFIGS]
        if unknown or not self.configs:
            raise KvragError(f"--configs takes {', '.join(CONFIGS)}; got {', '.join(unknown) or 'none'}")
        if not self.rates or min(self.rates) <= 0:
            raise KvragError("--rates must be positive questions/s")
        if (self.ttft_limit_s is not None and self.ttft_limit_s <= 0) or self.ttft_stat not in STATS:
            raise KvragError(f"--ttft-limit must be positive and --ttft-stat one of {', '.join(STATS)}")
        if self.ttft_limit_s is None and ("full" not in self.configs or self.latency_runs < 1):
            raise KvragError("without --ttft-limit the limit is 3 x full prefill's idle TTFT: --configs needs full "
                             "and --latency-runs at least 1")


def run(cfg: ServeBenchConfig, log: Callable[[str], None]) -> dict:
    """Every configuration's server up at once, the rates interleaved across them (so a shared machine's load,
    which drifts over the run, weighs on each alike); the report (bench/serve_report.py renders it)."""
    from kvrag.bench.rag.report import machine

    if cfg.store is None or not cfg.questions:
        raise KvragError("the load test needs a store and questions to send")
    started, created = time.perf_counter(), time.strftime("%Y-%m-%dT%H:%M:%S%z")
    names = sorted(cfg.configs, key=lambda n: n != "full")  # full first: it may set the limit
    with ExitStack() as stack:
        servers = {}
        for name in names:
            args = [*CONFIGS[name][1], *cfg.server_args]
            log(f"{name}: starting kvrag serve {' '.join(args)}".rstrip())
            servers[name] = stack.enter_context(ServerProcess(cfg.store, [*args, *model_args(cfg.model, cfg.dtype)],
                                                              cfg.work / "logs" / f"serve-{name}.log"))
        limit, configs = asyncio.run(_drive(cfg, servers, log))
    for name, server in servers.items():  # stopped (SIGTERM) on leaving the stack
        configs[name]["server_exit_status"] = server.exit_code
    configs = {name: configs[name] for name in cfg.configs}
    full, tiers = (configs.get(n, {}).get("throughput_qps") for n in ("full", "blend+tiers"))
    return {"schema": "kvrag.bench-serve/1", "created": created, "wall_s": time.perf_counter() - started,
            "machine": machine(), "config": {**_config_dict(cfg), "ttft_limit_s": limit,
                                             "ttft_limit_rule": _limit_rule(cfg)},
            "configs": configs,
            "throughput_ratio_tiers_to_full": tiers / full if full and tiers is not None else None}


async def _drive(cfg: ServeBenchConfig, servers: dict[str, ServerProcess],
                 log: Callable[[str], None]) -> tuple[float, dict]:
    """Per configuration a warm-up and the single questions; then each rate for every configuration still
    rising (one stops after its first rate over the limit: higher rates only queue longer)."""
    async with AsyncExitStack() as stack:
        apis = {n: (await stack.enter_async_context(client(s.url)), s.model_id()) for n, s in servers.items()}
        extra = {n: {"mode": CONFIGS[n][0], "k": cfg.k} for n in servers}
        limit, single = cfg.ttft_limit_s, {}
        for n, (api, model) in apis.items():
            await run_rate(api, model, cfg.questions, [(0.0, 0)], 1.0, 0.0, extra[n], cfg.max_tokens)  # first calls
            single[n] = await single_questions(cfg, api, servers[n].url, model, extra[n])
            if limit is None:
                limit = LIMIT_FACTOR * single[n]["median"]["client_ttft_s"]
                log(f"TTFT limit: {LIMIT_FACTOR:g} x full prefill's idle TTFT = {limit:.2f} s")
        points: dict[str, list[dict]] = {n: [] for n in servers}
        for rate in sorted(cfg.rates):
            for n in [n for n in servers if all(p["within_limit"] for p in points[n])]:
                point = await _point(cfg, *apis[n], servers[n].url, rate, extra[n], limit)
                points[n].append(point)
                log(f"{n} @ {rate:g} q/s: {point['sent']} sent, {point['failed']} failed, TTFT p50 "
                    f"{_s(point['ttft_p50_s'])} mean {_s(point['ttft_mean_s'])} p99 {_s(point['ttft_p99_s'])}, "
                    f"served {point['served_qps']:.3f} q/s, load {point['load_average_1m']:.1f}")
    return limit, {n: _summary(CONFIGS[n], points[n], single[n], limit, cfg.seed) for n in servers}


def _summary(config: tuple[str, tuple[str, ...]], points: list[dict], single: dict, limit: float,
             seed: int) -> dict:
    passing = [p for p in points if p["within_limit"]]
    best = max(passing, key=lambda p: p["rate_qps"], default=None)
    return {"mode": config[0], "server_args": list(config[1]), "ttft_limit_s": limit,
            "throughput_qps": best["rate_qps"] if best else 0.0,
            "served_qps_at_throughput": best["served_qps"] if best else 0.0,
            "points": points, "single_question": single, "simulated": simulated(single, points, limit, seed)}


async def _point(cfg: ServeBenchConfig, api, model: str, url: str, rate: float, extra: dict, limit: float) -> dict:
    arrivals = workload(cfg.requests_per_rate, len(cfg.questions), cfg.zipf, f"{cfg.seed}:{rate}")
    before = await scrape(url)
    results, span = await run_rate(api, model, cfg.questions, arrivals, rate, cfg.seconds_per_rate, extra,
                                   cfg.max_tokens)
    server = metrics_delta(before, await scrape(url))
    # the machine's load over the last minute: on a shared machine the figures are its as much as the server's
    point = {"rate_qps": rate, **summarize(results, span), "server": server, "load_average_1m": os.getloadavg()[0]}
    point["within_limit"] = point["failed"] == 0 and point[f"ttft_{cfg.ttft_stat}_s"] is not None \
        and point[f"ttft_{cfg.ttft_stat}_s"] <= limit
    return point


def summarize(results: Sequence[Result], span: float) -> dict:
    """A rate's figures from the client's side: TTFT and latency statistics over the served requests."""
    ok = [r for r in results if r.ok]
    ttft, latency = [r.ttft_s for r in ok], [r.latency_s for r in ok]
    wall = max((r.end for r in results), default=0.0) - min((r.sent for r in results), default=0.0)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "no content"] = errors.get(r.error or "no content", 0) + 1
    return {"sent": len(results), "served": len(ok), "failed": len(results) - len(ok), "errors": errors,
            "offered_qps": len(results) / span if span > 0 else None,
            "served_qps": len(ok) / wall if wall > 0 else 0.0, "wall_s": wall,
            **_stats("ttft", ttft), **_stats("latency", latency),
            "prompt_tokens_mean": _mean([r.prompt_tokens for r in ok]),
            "cached_tokens_share": sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok)),
            "completion_tokens_mean": _mean([r.completion_tokens for r in ok])}


def _stats(what: str, xs: list[float]) -> dict:
    return {f"{what}_mean_s": _mean(xs), f"{what}_p50_s": percentile(xs, 50) if xs else None,
            f"{what}_p99_s": percentile(xs, 99) if xs else None}


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f} s"


def _limit_rule(cfg: ServeBenchConfig) -> str:
    if cfg.ttft_limit_s is not None:
        return "given (--ttft-limit)"
    return f"{LIMIT_FACTOR:g} x full prefill's median client TTFT over the single questions on its idle server"


def _config_dict(cfg: ServeBenchConfig) -> dict:
    out = asdict(cfg)
    out.update(store=str(cfg.store), work=str(cfg.work), questions=len(cfg.questions))
    return out
