"""`kvrag bench cluster` (issue 50): serving beyond one process, measured on one machine and simulated for many.

    serve       a Zipf-popular RAG load over MuSiQue's report items against engine replicas on Ray Serve (2 by
                default; `nodes` > 1: on a Ray cluster of that many nodes on loopback, cluster/loopback.py), routed by
                chunk (cluster/routers.ChunkRouter) and, on a fresh cluster, round robin: the memory tiers' hit
                rate (chunks served from a tier over chunks asked, from the replicas' /metrics), TTFT p50/p90 (a
                streaming client's first content event), requests per second and each replica's share; with
                `kill_node`, then a worker node killed under the same load: how each request in flight ended
    sim         the same policies for 8-64 replicas and 10M chunks, in bench/cluster_sim.py's discrete-event model
    precompute  tokens/s of `kvrag precompute --ray` with 1 and 2 workers writing the store themselves, and the
                driver's busy time per token (bench/cluster_precompute.py)
    ranged      cold TTFT over an object store with ranged per-layer reads against whole-chunk fetches, at an
                injected per-request latency (bench/cluster_ranged.py)

The serve part indexes and precomputes the items' passages into a store of its own (a document per passage), then
sends `requests` questions, item i drawn with probability proportional to 1/(i+1)^zipf, from `concurrency` client
threads; the first `warmup` fill the tiers and are not counted. The host tier is kept small (host_cache) so that the
hot set does not fit one replica: that is what routing is for.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from kvrag.bench.remote import _cli, write_docs

ROUTERS = ("chunk", "round-robin")
HUNG_S = 120  # a request in flight as a node dies that sends nothing for this long counts as hung
TIER_HIT = ("tree", "host", "gpu")  # kvrag_chunks_total's tiers that are memory hits (server/metrics.py)


@dataclass(frozen=True)
class ServePlan:
    items: int = 20
    requests: int = 80
    warmup: int = 20
    concurrency: int = 4
    zipf: float = 1.0
    replicas: int = 2
    host_cache: str = "192MiB"
    max_tokens: int = 4
    k: int = 5
    seed: int = 0
    dataset: Path | None = None
    port: int = 0
    nodes: int = 1  # > 1: a Ray cluster of that many nodes on loopback, the replicas spread over them
    kill_node: bool = False  # after each router's run, kill a worker node under load (nodes > 1)


def serve_part(plan: ServePlan, log: Callable[[str], None]) -> dict:
    """Both routers on the same load, each on a fresh cluster (cold tiers)."""
    from kvrag.bench.rag.datasets import musique_report_items

    items = musique_report_items(plan.dataset)[:plan.items]
    load = zipf_load(len(items), plan.requests, plan.zipf, plan.seed)
    with tempfile.TemporaryDirectory(prefix="kvrag-bench-cluster-") as tmp:
        store = Path(tmp) / "store"
        env = dict(os.environ)
        build = {"index": _cli(["index", str(write_docs(items, Path(tmp) / "docs")), "--store", str(store)], env, log),
                 "precompute": _cli(["precompute", "--store", str(store)], env, log)}
        with contextlib.redirect_stdout(sys.stderr):  # Ray's shutdown notices print to stdout: keep --json clean
            runs = {router: run_router(store, router, [items[i]["question"] for i in load], plan, log)
                    for router in ROUTERS}
    chunk, rr = runs["chunk"], runs["round-robin"]
    return {"plan": {**asdict(plan), "dataset": str(plan.dataset or "")}, "build_s": build, "runs": runs,
            "hit_rate_ratio": chunk["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else float("inf"),
            "ttft_p50_ratio": chunk["ttft_p50_s"] / rr["ttft_p50_s"] if rr["ttft_p50_s"] else 0.0,
            "ttft_p90_ratio": chunk["ttft_p90_s"] / rr["ttft_p90_s"] if rr["ttft_p90_s"] else 0.0,
            "throughput_ratio": chunk["requests_per_s"] / rr["requests_per_s"] if rr["requests_per_s"] else 0.0}


def zipf_load(n_items: int, requests: int, s: float, seed: int) -> list[int]:
    """Item indexes, item i drawn with probability proportional to 1/(i+1)^s (item 0 the most popular)."""
    rng = random.Random(seed)
    weights = [1 / (i + 1) ** s for i in range(n_items)]
    order = list(range(n_items))
    rng.shuffle(order)  # popularity not tied to the data set's order
    return [order[i] for i in rng.choices(range(n_items), weights, k=requests)]


def run_router(store: Path, router: str, questions: list[str], plan: ServePlan, log) -> dict:
    from kvrag.api import KVRagConfig
    from kvrag.bench.local_s3 import free_ports
    from kvrag.cluster.serve import ClusterServer, ClusterSettings
    from kvrag.server.app import ServerSettings

    config = KVRagConfig.resolve(host_cache=plan.host_cache, threads=1)
    port = plan.port or free_ports(1)[0]
    with _nodes(plan) as nodes:
        cluster = ClusterSettings(replicas=plan.replicas, router=router, stats_period_s=1.0,
                                  address=nodes.address if nodes else None)
        with ClusterServer(store, config, ServerSettings("kvrag"), cluster, port=port) as server:
            log(f"{router}: {plan.replicas} replicas on {plan.nodes} node(s) up; {plan.warmup} warm-up requests")
            _send_all(server.url, questions[:plan.warmup], plan)
            before = tier_counts(server.url)
            start = time.perf_counter()
            records = _send_all(server.url, questions[plan.warmup:], plan)
            wall = time.perf_counter() - start
            time.sleep(2.5)  # the replicas' next reports carry the last requests' counts
            after = tier_counts(server.url)
            out = summarize(records, before, after, wall, log, router)
            if plan.kill_node and nodes is not None:
                out["node_kill"] = node_kill(server.url, nodes, questions, plan, log)
    return out


@contextlib.contextmanager
def _nodes(plan: ServePlan):
    """A loopback Ray cluster of plan.nodes nodes with CPUs for an even share of the replicas each; None for one."""
    if plan.nodes <= 1:
        yield None
        return
    from kvrag.cluster.loopback import LoopbackCluster

    with LoopbackCluster(plan.nodes, cpus=-(-plan.replicas // plan.nodes)) as nodes:
        yield nodes


def node_kill(url: str, nodes, questions: list[str], plan: ServePlan, log) -> dict:
    """2 x concurrency requests sent at once, the last worker node killed a second later: how each ended
    (answered, ended by an error event or status, cut without one, or hung past the client's timeout), then as many
    again on what is left."""
    with ThreadPoolExecutor(2 * plan.concurrency) as pool:
        futures = [pool.submit(stream_one, url, q, plan, HUNG_S) for q in questions[:2 * plan.concurrency]]
        time.sleep(1.0)
        killed = time.perf_counter()
        nodes.kill(len(nodes.nodes) - 1)
        during = [f.result() for f in futures]
    after = _send_all(url, questions[:2 * plan.concurrency], plan)
    out = {"during": dict(Counter(r["ended"] for r in during)), "after": dict(Counter(r["ended"] for r in after)),
           "last_end_after_kill_s": max(r["end"] for r in during) - killed}
    log(f"node killed under load: in flight {out['during']}, then {out['after']}")
    return out



def _send_all(url: str, questions: list[str], plan: ServePlan) -> list[dict]:
    lock = threading.Lock()
    out: list[dict] = []

    def one(question: str) -> None:
        record = stream_one(url, question, plan)
        with lock:
            out.append(record)

    with ThreadPoolExecutor(plan.concurrency) as pool:
        list(pool.map(one, questions))
    return out


def stream_one(url: str, question: str, plan: ServePlan, timeout: float = 600) -> dict:
    """One streamed chat request: the seconds to its first content event and to its end, the replica, and how it
    ended: answered, error (an error event or status), cut (no [DONE]) or hung (no byte for `timeout` s)."""
    import httpx

    body = {"model": "kvrag", "messages": [{"role": "user", "content": question}], "max_tokens": plan.max_tokens,
            "stream": True, "k": plan.k}
    start = time.perf_counter()
    ttft, status, replica, error, done = None, 0, "?", False, False
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=timeout) as response:
            status, replica = response.status_code, response.headers.get("x-kvrag-replica", "?")
            for line in response.iter_lines():
                if ttft is None and line.startswith("data: {") and '"content"' in line:
                    ttft = time.perf_counter() - start
                error = error or line.startswith('data: {"error"')
                done = done or line == "data: [DONE]"
        ended = "error" if error or status != 200 else "answered" if done else "cut"
    except httpx.TimeoutException:
        ended = "hung"
    except httpx.TransportError:
        ended = "cut"
    end = time.perf_counter()
    return {"ttft_s": ttft if ttft is not None else end - start, "total_s": end - start, "end": end,
            "replica": replica, "status": status, "ended": ended}


def tier_counts(url: str) -> dict[str, float]:
    """kvrag_chunks_total by tier, summed over the replicas (the front's federated /metrics)."""
    import httpx

    counts: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        match = re.match(r'kvrag_chunks_total\{(.*)\} ([0-9.e+]+)$', line)
        if match:
            tier = re.search(r'tier="([^"]+)"', match.group(1)).group(1)
            counts[tier] = counts.get(tier, 0.0) + float(match.group(2))
    return counts


def summarize(records: list[dict], before: dict, after: dict, wall: float, log, router: str) -> dict:
    delta = {t: after.get(t, 0.0) - before.get(t, 0.0) for t in set(after) | set(before)}
    asked = sum(delta.values())
    ttfts = sorted(r["ttft_s"] for r in records)
    replicas: dict[str, int] = {}
    for r in records:
        replicas[r["replica"]] = replicas.get(r["replica"], 0) + 1
    out = {"requests": len(records), "failed": sum(r["status"] != 200 for r in records),
           "hit_rate": sum(delta.get(t, 0.0) for t in TIER_HIT) / asked if asked else 0.0,
           "chunks_by_tier": delta, "ttft_p50_s": statistics.median(ttfts),
           "ttft_p90_s": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))], "requests_per_s": len(records) / wall,
           "per_replica": sorted(replicas.values(), reverse=True),
           "max_share": max(replicas.values()) / len(records) if records else 0.0}
    log(f"{router}: hit rate {out['hit_rate']:.3f}, TTFT p50 {out['ttft_p50_s']:.3f} s, "
        f"p90 {out['ttft_p90_s']:.3f} s, {out['requests_per_s']:.2f} req/s, per replica {out['per_replica']}")
    return out


def markdown(report: dict) -> str:
    lines = [f"`{report.get('command', 'kvrag bench cluster')}`", ""]
    serve = report.get("serve")
    if serve:
        lines += ["| router | hit rate | TTFT p50 (s) | TTFT p90 (s) | req/s | per replica | largest share |",
                  "|---|---|---|---|---|---|---|"]
        for router, r in serve["runs"].items():
            lines.append(f"| {router} | {r['hit_rate']:.3f} | {r['ttft_p50_s']:.3f} | {r['ttft_p90_s']:.3f} | "
                         f"{r['requests_per_s']:.2f} | {r['per_replica']} | {r.get('max_share', 0):.2f} |")
        lines += ["", f"chunk / round robin: hit rate {serve['hit_rate_ratio']:.2f}x, throughput "
                  f"{serve.get('throughput_ratio', 0):.2f}x, TTFT p50 {serve['ttft_p50_ratio']:.2f}x, p90 "
                  f"{serve.get('ttft_p90_ratio', 0):.2f}x", ""]
        for router, r in serve["runs"].items():
            if "node_kill" in r:
                lines += [f"{router}, a node killed under load: {json.dumps(r['node_kill'])}", ""]
    for part in ("sim", "precompute", "ranged"):
        if report.get(part) is not None:
            lines += [f"## {part}", "", "```", json.dumps(report[part], indent=1, default=str)[:6000], "```", ""]
    lines.append(f"load average: {report.get('loadavg', '?')}")
    return "\n".join(lines)
