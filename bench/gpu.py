"""`kvrag bench gpu` (`make bench-gpu`): the Triton kernels against the device's peaks and torch SDPA, then TTFT
of full prefill and blend@0.15 against the physical floor, on SmolLM2 and a random Llama-3.1-8B-shaped model
(issue 28). One markdown report and one JSON; sized for 5-8 minutes on one H100 (docs/gpu.md has
the first run, on an H200).

bench/gpu_kernels.py holds the peaks, the kernel cases and their byte and FLOP formulas; bench/gpu_e2e.py the
models, the stores, the per-item timing and the floor. `--cpu-smoke` runs every part at tiny sizes on the CPU
(Triton's interpreter; SmolLM2 and a tiny model of the 8B's architecture over invented items), so the code path
is tested where no GPU is: its numbers measure nothing.

Run: kvrag bench gpu [--items 50] [--items-8b 10] [--skip-8b] [--out bench-gpu.json] [--json]
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvrag.bench import gpu_e2e, gpu_kernels

SMOKE_WORDS = 24  # words kept of each invented passage in the CPU smoke run


@dataclass(frozen=True)
class Plan:
    smoke: bool = False
    items: int = 50
    items_8b: int = 20  # issue 38: report items 50-69
    skip_8b: bool = False
    dataset: Path | None = None  # MuSiQue-format JSON (default ../shared/data/musique_s.json)


def report_items(plan: Plan) -> list[dict]:
    """The report split of MuSiQue, or for the smoke run a few short invented items."""
    if plan.smoke:
        from kvrag.bench.invented import invented_items

        items = invented_items(max(plan.items, plan.items_8b), seed=0, passages=(2, 3))
        return [{**item, "ctxs": [{**c, "text": " ".join(c["text"].split()[:SMOKE_WORDS])} for c in item["ctxs"]]}
                for item in items]
    from kvrag.bench.rag.datasets import musique_report_items

    return musique_report_items(plan.dataset)


def run(plan: Plan, log: Callable[[str], None]) -> dict:
    device = torch.device("cpu" if plan.smoke else "cuda")
    sizes = gpu_kernels.SMOKE_KERNELS if plan.smoke else gpu_kernels.KernelSizes()
    start = time.perf_counter()
    peaks = gpu_kernels.device_peaks(device, sizes)
    log(f"peaks: {peaks['matmul_tflops']:.1f} TFLOP/s, copy {peaks['copy_gbps']:.0f} GB/s, "
        f"H2D {peaks['h2d_gbps']:.1f} GB/s")
    kernels = gpu_kernels.run(device, sizes, peaks, log)
    items = report_items(plan)
    from kvrag.cli.common import load_runtime

    models = [gpu_e2e.run_model("SmolLM2-135M", load_runtime(None, None, str(device), tune_process=False), items[:plan.items], peaks,
                                log)]
    if not plan.skip_8b:
        _release(device)
        cfg = gpu_e2e.smoke_config() if plan.smoke else gpu_e2e.llama8b_config()
        runtime = gpu_e2e.random_runtime(cfg, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
        models.append(gpu_e2e.run_model("Llama-3.1-8B-shaped, random bf16" if not plan.smoke else
                                        "8B architecture, tiny random", runtime, items[:plan.items_8b], peaks, log))
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke run)",
            "smoke": plan.smoke, "torch": torch.__version__, "triton": _triton_version(),
            "kernel_sizes": asdict(sizes), "peaks": peaks, "kernels": kernels, "floor": gpu_e2e.FLOOR,
            "ratio": gpu_e2e.RATIO, "e2e": models,
            "targets": gpu_e2e.targets(models, kernels), "wall_s": time.perf_counter() - start}


def _release(device: torch.device) -> None:
    """Free the last model's memory before the next one is drawn."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _triton_version() -> str:
    import triton

    return triton.__version__


def markdown(report: dict) -> str:
    sizes, peaks = report["kernel_sizes"], report["peaks"]
    lines = [f"# kvrag bench gpu: {report['device']} (torch {report['torch']}, triton {report['triton']})", ""]
    if report["smoke"]:
        lines += ["CPU smoke run: tiny sizes, Triton's interpreter; the numbers measure nothing.", ""]
    lines += ["## Device peaks (measured)", "",
              f"| bf16 matmul (n={peaks['matmul_n']}) | device copy ({peaks['copy_bytes'] >> 20} MiB, read + "
              f"write) | pinned host-to-device |", "|---|---|---|",
              f"| {_num(peaks['matmul_tflops'])} TFLOP/s | {_num(peaks['copy_gbps'])} GB/s | "
              f"{_num(peaks['h2d_gbps'])} GB/s |", "",
              f"## Kernels (median of {sizes['reps']} calls after {sizes['warmup']}; bf16, Hq {sizes['heads'][0]}, "
              f"Hkv {sizes['heads'][1]}, hd {sizes['heads'][2]})", "",
              "| kernel | shape | ms | GB/s | of copy peak | TFLOP/s | of matmul peak | baseline | baseline ms | "
              "speedup |", "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [_kernel_row(k) for k in report["kernels"]]
    lines += ["", f"## End to end: TTFT against the physical floor (blend@{report['ratio']:g}, medians over items)",
              "", "| model | items | prompt tokens | full ms | floor ms | full / floor | blend ms | floor ms | "
              "blend / floor | blend / full | loaded MB | recomputed | store s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [_model_row(m) for m in report["e2e"]]
    lines += ["", report["floor"] + ".", "", "Blend with every chunk's stored KV in the host tier (pinned on a GPU), "
              "no path of them on the knowledge tree but the first chunk's:", "",
              "| model | blend ms | blend / full | blend / floor | chunks read from the store |", "|---|---|---|---|---|"]
    lines += [f"| {m['model']} | {_num(m['tier_ms'])} | {m['tier_vs_full']:.2f} | {m['tier_vs_floor']:.2f} | "
              f"{m['tier_from_store']:.0%} |" for m in report["e2e"]]
    lines += ["", "What one question runs (its first item, warm; torch's profiler): aten operators, and on a GPU the "
              "kernels and copies the device executed", "", "| model | mode | aten ops | kernels | copies |",
              "|---|---|---|---|---|"]
    lines += [f"| {m['model']} | {mode} | {c['ops']} | {_count(c['kernels'])} | {_count(c['copies'])} |"
              for m in report["e2e"] for mode, c in m["launches"].items()]
    lines += ["", "## Targets (issue 38)", ""]
    lines += _target_lines(report)
    return "\n".join(lines)


def _kernel_row(k: dict) -> str:
    tflops = f"{_num(k['tflops'])} | {k['matmul_peak_share']:.0%}" if k["tflops"] else "- | -"
    base = f"{k['baseline']} | {_num(k['baseline_ms'])} | {k['speedup']:.2f}x" if k["baseline"] else "- | - | -"
    return (f"| {k['kernel']} | {k['shape']} | {_num(k['ms'])} | {_num(k['gbps'])} | {k['copy_peak_share']:.0%} | "
            f"{tflops} | {base} |")


def _num(x: float) -> str:
    """Three significant digits, whole numbers from 100 on."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _model_row(m: dict) -> str:
    return (f"| {m['model']} | {m['items']} | {m['prompt_tokens_median']:,.0f} | {_num(m['full_ms'])} | "
            f"{_num(m['floor_full_ms'])} | {m['full_vs_floor']:.2f} | {_num(m['blend_ms'])} | "
            f"{_num(m['floor_blend_ms'])} | {m['blend_vs_floor']:.2f} | {m['blend_vs_full']:.2f} | "
            f"{_num(m['loaded_mb_mean'])} | {m['recomputed_share']:.0%} | {_num(m['store']['seconds'])} |")


def _count(n: int | None) -> str:
    return "-" if n is None else str(n)


def _target_lines(report: dict) -> list[str]:
    def verdict(met: bool) -> str:
        return "not judged (CPU smoke run)" if report["smoke"] else "met" if met else "not met"
    return [f"- {t['what']}: {t['value']:.2f} (target {t['bound']}): {verdict(t['met'])}" for t in report["targets"]]
