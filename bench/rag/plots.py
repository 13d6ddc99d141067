"""PNG figures of a bench report, drawn with matplotlib's Agg backend (no display needed).

    ttft_vs_ratio.png      median TTFT of blend against its recompute ratio, baselines as lines
    quality_vs_ratio.png   F1 and fidelity to full prefill against the ratio
    quality_vs_ttft.png    the frontier: each method's quality against its median TTFT
    hit_rate_vs_size.png   simulated prefix hit rate against host-cache size, per policy
"""

from __future__ import annotations

from pathlib import Path

BASELINE_STYLE = {"full": ("black", "--"), "prefix": ("tab:orange", ":"), "reuse": ("tab:red", "-.")}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _blend_points(methods: dict, key: str) -> list[tuple[float, float, str]]:
    """(ratio used, value, name) of the blend methods (reuse as ratio 0), sorted by ratio."""
    out = []
    for name, m in methods.items():
        value = m.get(key)
        if value is None:
            continue
        if m["mode"] == "blend" and m.get("mean_ratio_used") is not None:
            out.append((m["mean_ratio_used"], value, name))
        elif m["mode"] == "reuse":
            out.append((0.0, value, name))
    return sorted(out)


def _quality_key(methods: dict) -> tuple[str, str]:
    """F1 against gold where there are gold answers, else F1 against full prefill's answer."""
    if any(m.get("f1") is not None for m in methods.values()):
        return "f1", "F1 (gold)"
    return "f1_vs_full", "F1 vs full prefill"


def make_plots(report: dict, out_dir: Path) -> list[Path]:
    """Write the figures the report has data for; returns their paths."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    methods = report["methods"]
    paths: list[Path] = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)

    items = report["items"]
    pts = _blend_points(methods, "median_ttft_ms")
    if pts:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label="blend (reuse at 0)")
        for x, y, name in pts:
            ax.annotate(name.replace("blend@", ""), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        for name, (color, style) in BASELINE_STYLE.items():
            if name in methods and name != "reuse":
                ax.axhline(methods[name]["median_ttft_ms"], color=color, linestyle=style, label=name)
        ax.set(xlabel="recompute ratio", ylabel="median TTFT (ms)", title=f"TTFT vs recompute ratio ({items} items)")
        ax.set_ylim(bottom=0)
        ax.legend()
        save(fig, "ttft_vs_ratio.png")

    series = [(k, label) for k, label in (("f1", "F1 (gold)"), ("f1_vs_full", "F1 vs full"),
                                          ("top1_agreement", "top-1 agreement"),
                                          ("identical_answer_share", "identical answers"))
              if _blend_points(methods, k)]
    if series:
        fig, ax = plt.subplots(figsize=(6, 4))
        for key, label in series:
            p = _blend_points(methods, key)
            ax.plot([x for x, _, _ in p], [y for _, y, _ in p], "o-", label=label)
        if methods.get("full", {}).get("f1") is not None:
            ax.axhline(methods["full"]["f1"], color="black", linestyle="--", label="full prefill F1")
        ax.set(xlabel="recompute ratio", ylabel="score", title="quality vs recompute ratio", ylim=(0, 1.05))
        ax.legend(fontsize=8)
        save(fig, "quality_vs_ratio.png")

    key, label = _quality_key(methods)
    frontier = [(m["median_ttft_ms"], m[key], name) for name, m in methods.items()
                if m.get(key) is not None and m.get("median_ttft_ms") is not None]
    if frontier:
        fig, ax = plt.subplots(figsize=(6, 4))
        x_span = max(x for x, _, _ in frontier) or 1.0
        y_span = (max(y for _, y, _ in frontier) - min(y for _, y, _ in frontier)) or 1.0
        placed: list[tuple[float, float]] = []
        for x, y, name in frontier:
            color = BASELINE_STYLE.get(name, ("tab:blue", ""))[0]
            ax.scatter([x], [y], color=color)
            # methods on (nearly) the same point, e.g. blend@auto resolving to 0.15: stack their labels
            near = sum(abs(x - px) < 0.03 * x_span and abs(y - py) < 0.03 * y_span for px, py in placed)
            placed.append((x, y))
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4 - 10 * near), fontsize=8)
        ax.set(xlabel="median TTFT (ms)", ylabel=label, title="quality vs TTFT")
        ax.set_xlim(left=0)
        save(fig, "quality_vs_ttft.png")

    curve = (report.get("cache") or {}).get("hit_rate_vs_size") or []
    if curve:
        fig, ax = plt.subplots(figsize=(6, 4))
        for n, policy in enumerate(dict.fromkeys(c["policy"] for c in curve)):
            p = sorted((c["host_bytes"], c["prefix_hit_rate"], c["memory_hit_rate"]) for c in curve
                       if c["policy"] == policy)
            gib = [b / (1 << 30) for b, _, _ in p]
            color = f"C{n}"
            ax.plot(gib, [h for _, h, _ in p], "o-", color=color, label=f"{policy} prefix (exact reuse)")
            ax.plot(gib, [m for _, _, m in p], "s--", color=color, alpha=0.6, label=f"{policy} in memory")
        ax.set_xscale("log", base=2)
        ax.set(xlabel="host cache (GiB)", ylabel="hit rate (share of chunks)",
               title="hit rate vs cache size (simulated replay)", ylim=(0, 1))
        ax.legend(fontsize=7, ncol=2)
        save(fig, "hit_rate_vs_size.png")
    return paths
