"""The bench report: per-method summaries as a dict (the JSON), Markdown, and rich tables.

Ratios to full prefill are taken per item, then their median (an item's ratio compares two methods
on the same prompt at nearly the same time, which cancels most of a busy machine's drift).
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence

from kvrag.bench.rag.metrics import distribution, mean_or_none, median_or_none
from kvrag.bench.rag.runner import BenchRun, MethodRun

SCHEMA = "kvrag-bench/1"


def summarize(runs: Sequence[MethodRun]) -> dict:
    """One method over its items: TTFT distribution, where TTFT went, cost, quality and fidelity."""
    ttft = [r.ttft_s for r in runs]
    ratios = [r.ttft_ratio_to_full for r in runs]
    chunk_tokens = sum(r.chunk_tokens for r in runs)

    def share(part: str) -> float | None:
        return mean_or_none(getattr(r, part) / r.ttft_s for r in runs if r.ttft_s > 0)

    def ms(part: str) -> float | None:
        m = mean_or_none(getattr(r, part) for r in runs)
        return None if m is None else m * 1000

    return {
        "runs": len(runs),
        **distribution(ttft, "ttft"),
        "median_ttft_ratio_to_full": median_or_none(ratios),
        "median_speedup_vs_full": median_or_none(1 / x for x in ratios if x),
        "mean_ratio_used": mean_or_none(r.ratio for r in runs),
        "mean_compute_ms": ms("compute_s"),
        "mean_load_ms": ms("load_s"),
        "mean_load_wait_ms": ms("load_wait_s"),
        "mean_missing_chunks_ms": ms("missing_chunks_s"),
        "compute_share_of_ttft": share("compute_s"),  # recomputing (and computing the suffix)
        "load_wait_share_of_ttft": share("load_wait_s"),  # stalled on the loader
        "load_share_of_ttft": share("load_s"),  # loader busy time, overlapped with compute
        "decode_tokens_per_s": mean_or_none(r.decode_tokens_per_s for r in runs if r.decode_tokens_per_s > 0),
        "mean_total_ms": ms("total_s"),
        "mean_prompt_tokens": mean_or_none(r.prompt_tokens for r in runs),
        "mean_recomputed_tokens": mean_or_none(r.recomputed_chunk_tokens for r in runs),
        "recompute_share": sum(r.recomputed_chunk_tokens for r in runs) / chunk_tokens if chunk_tokens else None,
        "mean_bytes_loaded": mean_or_none(r.bytes_loaded for r in runs),
        "f1": mean_or_none(r.f1 for r in runs),
        "exact_match": mean_or_none(r.em for r in runs),
        "top1_agreement": mean_or_none(r.top1_agree for r in runs),
        "mean_kl": mean_or_none(r.kl for r in runs),
        "identical_answer_share": mean_or_none(r.identical for r in runs),
        "f1_vs_full": mean_or_none(r.f1_vs_full for r in runs),
    }


def machine() -> dict:
    import numpy
    import torch
    import transformers

    from kvrag import __version__
    from kvrag.model.device import cpu_has_fast_bf16

    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "platform": platform.platform(), "cpu": cpu or platform.processor(), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "fast_bf16": cpu_has_fast_bf16(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_average": list(load) if load else None,
        "versions": {"kvrag": __version__, "python": sys.version.split()[0], "torch": torch.__version__,
                     "transformers": transformers.__version__, "numpy": numpy.__version__},
    }


def store_section(env, model_fp: str, codec: str) -> dict:
    """Bytes per token of the stored KV for this model and codec (headers and compression included)."""
    from kvrag.store.maintenance import stats

    for g in stats(env).groups:
        if g.model_fp == model_fp and g.codec == codec:
            return {"path": str(env.path), "codec": codec, "chunks": g.chunks, "tokens": g.tokens,
                    "bytes": g.bytes, "bytes_per_token": g.bytes_per_token}
    return {"path": str(env.path), "codec": codec, "chunks": 0}


def build_report(bench: BenchRun, config: dict, workloads: dict | None = None, cache: dict | None = None,
                 store: dict | None = None, command: str | None = None) -> dict:
    methods = {}
    for m in bench.methods:
        methods[m.name] = {"mode": m.mode, "ratio": m.label_ratio, **summarize(bench.by_method(m.name))}
    items = []
    for i, item in enumerate(bench.items):
        runs = sorted((r for r in bench.runs if r.item == i), key=lambda r: r.position)
        items.append({"index": item.index, "question": item.question, "answers": item.answers,
                      "chunks": len(item.chunks), "chunk_tokens": item.chunk_tokens,
                      "order": [r.method for r in runs], "runs": {r.method: r.to_dict() for r in runs}})
    return {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": command,
        "machine": machine(),
        "config": config,
        "setup": vars(bench.setup),
        "items": len(bench.items),
        "methods": methods,
        "workloads": {"sequential": {"kind": "one question at a time, methods interleaved per item"},
                      **({"poisson": workloads} if workloads else {})},
        "cache": cache or {},
        "store": store or {},
        "per_item": items,
        "wall_s": bench.wall_s,
    }


# ---- rendering ----------------------------------------------------------------------------------

def _f(x, fmt: str = ".3f", scale: float = 1.0) -> str:
    return "—" if x is None else format(x * scale, fmt)


TTFT_COLUMNS = (  # (header, key, format, scale)
    ("median TTFT ms", "median_ttft_ms", ".0f", 1), ("mean", "mean_ttft_ms", ".0f", 1),
    ("p90", "p90_ttft_ms", ".0f", 1), ("p99", "p99_ttft_ms", ".0f", 1),
    ("÷ full (median)", "median_ttft_ratio_to_full", ".2f", 1), ("ratio used", "mean_ratio_used", ".2f", 1),
)
COST_COLUMNS = (
    ("compute %", "compute_share_of_ttft", ".0f", 100), ("load wait %", "load_wait_share_of_ttft", ".0f", 100),
    ("load %", "load_share_of_ttft", ".0f", 100), ("recomputed %", "recompute_share", ".1f", 100),
    ("MB loaded", "mean_bytes_loaded", ".1f", 1e-6), ("decode tok/s", "decode_tokens_per_s", ".1f", 1),
)
SPEED_COLUMNS = TTFT_COLUMNS + COST_COLUMNS
QUALITY_COLUMNS = (
    ("F1", "f1", ".3f", 1), ("EM", "exact_match", ".3f", 1), ("top-1 agree", "top1_agreement", ".2f", 1),
    ("mean KL", "mean_kl", ".4f", 1), ("identical", "identical_answer_share", ".2f", 1),
    ("F1 vs full", "f1_vs_full", ".3f", 1),
)


def _rows(report: dict, columns) -> list[list[str]]:
    return [[name, *(_f(s.get(key), fmt, scale) for _, key, fmt, scale in columns)]
            for name, s in report["methods"].items()]


def rich_tables(report: dict) -> list:
    from rich.table import Table

    out = []
    for title, columns in (("TTFT", TTFT_COLUMNS), ("where TTFT went, and cost", COST_COLUMNS),
                           ("quality (gold) and fidelity to full prefill", QUALITY_COLUMNS)):
        table = Table(title=f"{title} — {report['items']} items")
        table.add_column("method")
        for header, *_ in columns:
            table.add_column(header, justify="right")
        for row in _rows(report, columns):
            table.add_row(*row)
        out.append(table)
    poisson = report["workloads"].get("poisson")
    if poisson:
        table = Table(title=f"Poisson arrivals (simulated queue, one request at a time; `kvrag bench serve` "
                            f"measures the real server): throughput at {poisson['ttft_stat']} TTFT ≤ "
                            f"{poisson['ttft_limit_s']:.2f} s")
        table.add_column("method")
        for col in ("capacity q/s", "throughput q/s", "÷ full"):
            table.add_column(col, justify="right")
        full = poisson["methods"].get("full", {}).get("throughput_qps")
        for name, m in poisson["methods"].items():
            rel = m["throughput_qps"] / full if full else None
            table.add_row(name, f"{m['capacity_qps']:.3f}", f"{m['throughput_qps']:.3f}", _f(rel, ".2f"))
        out.append(table)
    cache = report.get("cache")
    if cache:
        table = Table(title=f"memory tiers (simulated replay): {cache['workload']['requests']} Zipf requests, "
                            f"k={cache['workload']['k']}, host {cache['chosen']['host']}")
        table.add_column("policy")
        for col in ("prefix hit", "host hit", "gpu hit", "store reads", "evictions"):
            table.add_column(col, justify="right")
        for p in cache["policies"]:
            table.add_row(p["policy"], _f(p["prefix_hit_rate"], ".1%"), _f(p.get("host_hit_rate"), ".1%"),
                          _f(p.get("gpu_hit_rate"), ".1%"), _f(p["store_read_rate"], ".1%"),
                          str(sum(p["evictions"].values())))
        out.append(table)
    return out


def _md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers),
            *("| " + " | ".join(r) + " |" for r in rows)]


def markdown(report: dict, plots: Sequence[str] = ()) -> str:
    c, m = report["config"], report["machine"]
    lines = [
        "# kvrag bench", "",
        f"{report['items']} items from `{c.get('dataset') or c.get('questions')}`, model `{c.get('model')}` "
        f"({c.get('dtype')}), {c.get('codec')} store, {m['cpu_count']} CPUs ({m['cpu']}), "
        f"{m['torch_threads']} torch threads, max {c.get('max_tokens')} answer tokens; run {report['created']}, "
        f"{report['wall_s']:.0f} s in all.", "",
        f"Command: `{report.get('command')}`", "",
        "## Speed", "",
        *_md_table(["method", *(h for h, *_ in SPEED_COLUMNS)], _rows(report, SPEED_COLUMNS)), "",
        "TTFT = request start to first token (prefill, plus the ratio choice for `auto`). `÷ full` is the median "
        "over items of TTFT / full prefill's TTFT on the same item. compute % and load wait % are shares of TTFT; "
        "load % is the loader's busy time, which overlaps compute.", "",
        "## Quality and fidelity", "",
        *_md_table(["method", *(h for h, *_ in QUALITY_COLUMNS)], _rows(report, QUALITY_COLUMNS)), "",
        "F1/EM against the gold answers (SQuAD normalisation); fidelity against full prefill on the same item: "
        "first-token top-1 agreement, mean first-token KL(full ‖ method), share of identical greedy answers, "
        "F1 of the answer against full prefill's.", "",
    ]
    poisson = report["workloads"].get("poisson")
    if poisson:
        full = poisson["methods"].get("full", {}).get("throughput_qps")
        rows = [[n, f"{p['capacity_qps']:.3f}", f"{p['throughput_qps']:.3f}",
                 _f(p["throughput_qps"] / full if full else None, ".2f")] for n, p in poisson["methods"].items()]
        lines += ["## Poisson arrivals", "", f"{poisson['kind']}: {poisson['arrivals']} arrivals per rate; "
                  f"throughput = highest rate whose {poisson['ttft_stat']} TTFT stays ≤ {poisson['ttft_limit_s']:.2f} s.",
                  "", *_md_table(["method", "capacity q/s", "throughput q/s", "÷ full"], rows), ""]
    cache = report.get("cache")
    if cache:
        w = cache["workload"]
        rows = [[p["policy"], _f(p["prefix_hit_rate"], ".1%"), _f(p.get("host_hit_rate"), ".1%"),
                 _f(p.get("gpu_hit_rate"), ".1%"), _f(p["store_read_rate"], ".1%")] for p in cache["policies"]]
        lines += ["## Memory tiers", "", f"{cache['kind']}. {w['requests']} requests ({w['warmup']} warm-up), "
                  f"k={w['k']}, Zipf s={w['zipf']} over {w['distinct_chunks']} chunks; host {cache['chosen']['host']}, "
                  f"GPU {cache['chosen']['gpu']}; cost profile: {cache['profile'].get('kind', 'given')}.", "",
                  *_md_table(["policy", "prefix hit", "host hit", "gpu hit", "store reads"], rows), ""]
    store = report.get("store") or {}
    if store.get("bytes_per_token"):
        lines += [f"Store: {store['chunks']} chunks, {store['tokens']} tokens, "
                  f"{store['bytes_per_token']:,.0f} bytes per token ({store['codec']}).", ""]
    s = report["setup"]
    lines += [f"Setup (not timed in the runs): chunk KV {s['precompute_s']:.1f} s ({s['chunks_computed']} of "
              f"{s['chunks']} chunks computed), warm-up {s['warmup_s']:.1f} s.", ""]
    reads = s.get("item_store_reads_s") or []
    if reads:
        lines += [f"Each item's stored KV was read once before its runs (not timed), so every loaded method found it "
                  f"in the page cache, as a host-memory hit would: that read took {statistics.median(reads):.2f} s per "
                  f"item (median; max {max(reads):.2f} s) — what the first question over cold chunks adds on this disk.", ""]
    slow = {n: m["mean_missing_chunks_ms"] for n, m in report["methods"].items() if (m["mean_missing_chunks_ms"] or 0) > 1}
    if slow:  # setup should have stored every chunk; say so if a timed run still computed some
        lines += ["Chunks computed during timed runs (mean ms per run, included in TTFT): "
                  + ", ".join(f"{n} {v:.0f}" for n, v in slow.items()), ""]
    for p in plots:
        lines += [f"![{os.path.basename(p)}]({os.path.basename(p)})", ""]
    return "\n".join(lines)

