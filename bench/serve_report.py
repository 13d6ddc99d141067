"""`kvrag bench serve`'s report as tables: markdown (stdout, docs/performance.md) from the JSON report."""

from __future__ import annotations

from kvrag.bench.rag.report import _f, _md_table

POINT_COLUMNS = ("config", "rate q/s", "sent", "failed", "served q/s", "TTFT p50 s", "mean", "p99",
                 "latency p50 s", "reused %", "memory hit %", "load 1m", "within limit")


def _ms(x) -> str:
    return _f(x, ".0f", 1000)


def point_rows(report: dict) -> list[list[str]]:
    rows = []
    for name, c in report["configs"].items():
        for p in c["points"]:
            server = p["server"]
            rows.append([name, f"{p['rate_qps']:g}", str(p["sent"]), str(p["failed"]), f"{p['served_qps']:.3f}",
                         _f(p["ttft_p50_s"], ".2f"), _f(p["ttft_mean_s"], ".2f"), _f(p["ttft_p99_s"], ".2f"),
                         _f(p["latency_p50_s"], ".2f"), _f(server["reused_share"], ".0f", 100),
                         _f(server["tier_hit_rate"].get("memory"), ".0f", 100), _f(p.get("load_average_1m"), ".1f"),
                         "yes" if p["within_limit"] else "no"])
    return rows


def throughput_rows(report: dict) -> list[list[str]]:
    full = report["configs"].get("full", {}).get("throughput_qps")
    return [[name, f"{c['throughput_qps']:g}", f"{c['served_qps_at_throughput']:.3f}",
             _f(c["throughput_qps"] / full if full else None, ".2f")] for name, c in report["configs"].items()]


def single_rows(report: dict) -> list[list[str]]:
    rows = []
    for name, c in report["configs"].items():
        m = c["single_question"].get("median") or {}
        if m:
            rows.append([name, _ms(m["end_to_end_s"]), _ms(m["engine_ttft_s"]), _ms(m["decode_s"]),
                         _ms(m["retrieval_s"]), _ms(m["http_s"]), _ms(m["on_top_s"])])
    return rows


def simulated_rows(report: dict) -> list[list[str]]:
    return [[name, f"{s['rate_qps']:g}", _f(s["measured_p50_s"], ".2f"), _f(s["simulated_p50_s"], ".2f"),
             _f(s["measured_p99_s"], ".2f"), _f(s["simulated_p99_s"], ".2f")]
            for name, c in report["configs"].items() for s in c["simulated"]]


def markdown(report: dict) -> str:
    cfg, m = report["config"], report["machine"]
    stat, limit = cfg["ttft_stat"], cfg["ttft_limit_s"]
    ratio = report["throughput_ratio_tiers_to_full"]
    lines = [
        f"{cfg['questions']} questions, Zipf {cfg['zipf']:g}, k={cfg['k']}, {cfg['max_tokens']} answer tokens, "
        f"up to {cfg['requests_per_rate']} requests or {cfg['seconds_per_rate']:g} s of arrivals per rate, seed "
        f"{cfg['seed']}; {m['cpu_count']} CPUs ({m['cpu']}), load average at the end "
        f"{', '.join(f'{x:.2f}' for x in m['load_average'] or [])}; {report['wall_s']:.0f} s in all.", "",
        f"Throughput = the highest rate whose {stat} TTFT stays ≤ {limit:g} s with no failed request.", "",
        *_md_table(["config", "throughput q/s", "served q/s there", "÷ full"], throughput_rows(report)), "",
        f"blend with tiers ÷ full prefill: {_f(ratio, '.2f')}×", "",
        *_md_table(list(POINT_COLUMNS), point_rows(report)), "",
    ]
    if rows := single_rows(report):
        lines += ["Single questions on the warm idle server (medians, ms):", "",
                  *_md_table(["config", "end to end", "engine TTFT", "decode", "retrieval", "HTTP", "on top"],
                             rows), ""]
    if rows := simulated_rows(report):
        lines += ["Measured against the simulated FIFO queue (`kvrag bench`'s model) at the same rates, TTFT s:", "",
                  *_md_table(["config", "rate q/s", "measured p50", "simulated p50", "measured p99",
                              "simulated p99"], rows), ""]
    return "\n".join(lines)
