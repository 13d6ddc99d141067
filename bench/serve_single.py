"""Single questions on a warm idle server, and the simulated queue checked against the measured one.

A single question is asked once to warm its chunks (tiers, page cache), then in pairs: timed with retrieval (A),
and with the chunks A was given as `chunk_ids` (B: no retrieval, the same prompt). The server's
/metrics, read around each, give its own TTFT and latency (from the request's arrival in the handler). So:

    http       = A end to end at the client - A's latency at the server   (HTTP, SSE, JSON, the client)
    retrieval  = A's TTFT at the server - B's TTFT at the server          (embedding and search)
    on top     = A end to end - (B's TTFT + A's decode)                   = http + retrieval

which the issue wants within 50 ms.
"""

from __future__ import annotations

import statistics

from kvrag.bench.rag.workloads import Service, simulate_queue
from kvrag.bench.serve_load import ask, metrics_delta, scrape

SIMULATED_SEEDS = 200


async def single_questions(cfg, api, url: str, model: str, extra: dict, repeats: int = 2) -> dict:
    """Per question and repeat (A and B alternate): the client's and the server's timings; medians over all."""
    rows = []
    for q in range(min(cfg.latency_runs, len(cfg.questions))):
        question = cfg.questions[q]
        await ask(api, model, question, q, extra, cfg.max_tokens)
        for _ in range(repeats):
            rows.append(await _pair(api, url, model, question, q, extra, cfg.max_tokens))
    good = [r for r in rows if "error" not in r]
    keys = ("end_to_end_s", "client_ttft_s", "engine_ttft_s", "decode_s", "http_s", "retrieval_s", "on_top_s",
            "server_ttft_s", "server_latency_s")
    medians = {k: statistics.median(r[k] for r in good) for k in keys} if good else {}
    return {"runs": rows, "median": medians}


async def _pair(api, url: str, model: str, question: str, q: int, extra: dict, max_tokens: int) -> dict:
    """A (with retrieval), then B (A's chunks by id), timed by the client and by the server."""
    a, server_a = await _timed(api, url, model, question, q, extra, max_tokens)
    ids = [s["chunk_id"] for s in a.sources]
    b, server_b = await _timed(api, url, model, question, q, {**extra, "chunk_ids": ids}, max_tokens)
    if not (a.ok and b.ok and server_a["server_mean_ttft_s"] and server_b["server_mean_ttft_s"]):
        return {"question": q, "error": a.error or b.error or "no timings from the server"}
    decode = server_a["server_mean_latency_s"] - server_a["server_mean_ttft_s"]
    return {"question": q, "chunks": len(ids), "prompt_tokens": a.prompt_tokens,
            "same_prompt": a.prompt_tokens == b.prompt_tokens, "completion_tokens": a.completion_tokens,
            "end_to_end_s": a.latency_s, "client_ttft_s": a.ttft_s,
            "server_ttft_s": server_a["server_mean_ttft_s"], "server_latency_s": server_a["server_mean_latency_s"],
            "engine_ttft_s": server_b["server_mean_ttft_s"], "decode_s": decode,
            "http_s": a.latency_s - server_a["server_mean_latency_s"],
            "retrieval_s": server_a["server_mean_ttft_s"] - server_b["server_mean_ttft_s"],
            "on_top_s": a.latency_s - server_b["server_mean_ttft_s"] - decode}


async def _timed(api, url: str, model: str, question: str, q: int, extra: dict, max_tokens: int):
    before = await scrape(url)
    result = await ask(api, model, question, q, extra, max_tokens)
    return result, metrics_delta(before, await scrape(url))


def simulated(single: dict, points: list[dict], ttft_limit_s: float, seed: int) -> list[dict]:
    """The bench's single-server FIFO simulation at each measured rate and with as many arrivals as were sent,
    over this configuration's single-question service times (server TTFT, server latency): the figure
    `kvrag bench` would report, beside the measured one. Averaged over SIMULATED_SEEDS arrival draws."""
    services = [Service(r["server_ttft_s"], r["server_latency_s"]) for r in single.get("runs", ()) if "error" not in r]
    if not services:
        return []
    out = []
    for p in points:
        sims = [simulate_queue(services, p["rate_qps"], p["sent"], seed + n, ttft_limit_s)
                for n in range(SIMULATED_SEEDS)]
        out.append({"rate_qps": p["rate_qps"], "simulated_p50_s": statistics.fmean(x.median_ttft_s for x in sims),
                    "simulated_mean_s": statistics.fmean(x.mean_ttft_s for x in sims),
                    "simulated_p99_s": statistics.fmean(x.p99_ttft_s for x in sims),
                    "measured_p50_s": p["ttft_p50_s"], "measured_mean_s": p["ttft_mean_s"],
                    "measured_p99_s": p["ttft_p99_s"]})
    return out
