"""The GPU check's parts (issues 47, 59; docs/gpu.md, "The GPU check"): the GPU figures in one device call.

tools/gpu_check.sh runs each part in a process of its own, under its own time cap (its PLAN), most valuable first:

    tests     the cuda-marked tests on tiny random models built there (bench/gpu_check_tests.py)
    peaks     bf16 matmul TFLOP/s, device copy and pinned host-to-device GB/s (bench/gpu_kernels.py): the floors
    e2e-8b    a Llama-3.1-8B-shaped model of random bf16 weights over the folder's first MuSiQue items: full prefill
              against blend@0.15 from the store (page cache) and from the pinned host tier, the floor, launches
    kernels   decode_attention against SDPA at batch 1/16/64 x context 1k/8k, rows_attention, load_layers;
              FlashInfer's paged decode where it is installed
    graphs    a SmolLM2-shaped decode step eager against replayed from a CUDA graph: time, launches
              (bench/gpu_graphs.py)
    e2e-smol  the same as e2e-8b for a SmolLM2-shaped model of random weights on SmolLM2's real tokenizer
    summary   one table of what the parts wrote

Each part writes `<out>/<part>.json` as it goes ("done": false until it ends), so a run cut by its cap still
returns what it measured. Speed does not depend on the weights' values; fidelity is measured on the CPU with real
weights. `--cpu-smoke` runs every part at toy sizes on the CPU, under Triton's interpreter: it tests the code and
the folder, and measures nothing.

    python -m kvrag.bench.gpu_check PART --out DIR --folder .gpu-check [--cpu-smoke] [--items N]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from kvrag.bench import gpu_e2e, gpu_kernels

PARTS = ("tests", "peaks", "e2e-8b", "kernels", "graphs", "e2e-smol")  # tools/gpu_check.sh's PLAN, in its order
# Sized to the parts' caps (a call of 300 s; the 2026-11-28 run's times): the items of each end-to-end part (10
# items took the 8B shape 83 s, its store fill 37 of them), and the decode steps the graphs part compares.
E2E_ITEMS = {"e2e-8b": 6, "e2e-smol": 3}
GRAPH_CASES = ((1, 1024), (64, 1024), (16, 4096))  # (batch, context) of a SmolLM2-shaped decode step
SMOKE_GRAPH_CASES = ((1, 40), (2, 40))
SMOKE_WORDS = 24  # words kept of each passage in the CPU rehearsal
SMOKE_ITEMS = 2


@dataclass(frozen=True)
class Check:
    out: Path
    folder: Path  # tools/gpu_check.py's: smollm2/, minilm/, musique.json
    smoke: bool = False
    items: int | None = None  # the end-to-end parts' items; None: E2E_ITEMS's

    @property
    def device(self) -> torch.device:
        return torch.device("cpu" if self.smoke else "cuda")

    @property
    def sizes(self) -> gpu_kernels.KernelSizes:
        return gpu_kernels.SMOKE_KERNELS if self.smoke else gpu_kernels.KernelSizes()

    def write(self, part: str, result: dict, done: bool) -> None:
        """<out>/<part>.json, replaced whole (a reader never sees half a file)."""
        path = self.out / f"{part}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"part": part, "smoke": self.smoke, "done": done, **result}, indent=1,
                                  default=str))
        tmp.replace(path)


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def environment(check: Check) -> dict:
    import triton

    env = {"torch": torch.__version__, "triton": triton.__version__, "device": "cpu (smoke run)"}
    if not check.smoke:
        props = torch.cuda.get_device_properties(0)
        env.update(device=props.name, multiprocessors=props.multi_processor_count,
                   memory_gib=props.total_memory / 2**30, cuda=torch.version.cuda)
    return env


def run_peaks(check: Check) -> None:
    peaks = gpu_kernels.device_peaks(check.device, check.sizes)
    log(f"peaks: {peaks['matmul_tflops']:.1f} TFLOP/s, copy {peaks['copy_gbps']:.0f} GB/s, "
        f"H2D {peaks['h2d_gbps']:.1f} GB/s")
    check.write("peaks", {**environment(check), "peaks": peaks}, done=True)


def peaks_of(check: Check) -> dict:
    """The peaks part's figures, or measured again where it did not finish."""
    try:
        return json.loads((check.out / "peaks.json").read_text())["peaks"]
    except (OSError, ValueError, KeyError):
        return gpu_kernels.device_peaks(check.device, check.sizes)


def run_kernels(check: Check) -> None:
    peaks, sizes, kernels = peaks_of(check), check.sizes, []
    for name, bench in (("decode_attention", gpu_kernels.bench_decode), ("rows_attention", gpu_kernels.bench_rows),
                        ("load_layers", gpu_kernels.bench_load)):
        log(f"kernels: {name}")
        kernels += bench(check.device, sizes, peaks)
        check.write("kernels", {"sizes": asdict(sizes), "kernels": kernels}, done=False)
    extra = {"flashinfer": flashinfer_decode(check, sizes, peaks)}
    check.write("kernels", {"sizes": asdict(sizes), "kernels": kernels, **extra,
                            "targets": gpu_e2e.decode_targets(kernels)}, done=True)


def flashinfer_decode(check: Check, sizes: gpu_kernels.KernelSizes, peaks: dict) -> list[dict] | str:
    """FlashInfer's paged decode on decode_attention's cases, where its wheel is installed (it is not in the
    folder: 62 MB, over what a check carries)."""
    import importlib.util

    if check.smoke or importlib.util.find_spec("flashinfer") is None:
        return "not installed"
    from kvrag.bench.gpu_flashinfer import bench_flashinfer

    try:
        return bench_flashinfer(check.device, sizes, peaks)
    except Exception as exc:  # a library we cannot test here: its failure is a finding, not the end of the run
        return f"failed: {type(exc).__name__}: {exc}"


def run_graphs(check: Check) -> None:
    from kvrag.bench.gpu_graphs import decode_graph_case

    cases = []
    for batch, ctx in SMOKE_GRAPH_CASES if check.smoke else GRAPH_CASES:
        cases.append(decode_graph_case(check.device, batch, ctx, smoke=check.smoke))
        log(f"graphs: B={batch} ctx={ctx}: eager {cases[-1]['eager_ms']:.3g} ms, graph {cases[-1]['graph_ms']:.3g} ms")
        check.write("graphs", {"cases": cases}, done=False)
    check.write("graphs", {"cases": cases}, done=True)


def check_items(check: Check, part: str) -> list[dict]:
    items = json.loads((check.folder / "musique.json").read_text())[:check.items or E2E_ITEMS[part]]
    if not check.smoke:
        return items
    return [{**item, "ctxs": [{**c, "text": " ".join(c["text"].split()[:SMOKE_WORDS])} for c in item["ctxs"][:3]]}
            for item in items[:SMOKE_ITEMS]]


def run_e2e(check: Check, part: str) -> None:
    from kvrag.model.files import shape_only

    tokens = shape_only(check.folder / "smollm2")
    if part == "e2e-8b":
        role, name = 1, "Llama-3.1-8B-shaped, random bf16"
        cfg = gpu_e2e.smoke_config() if check.smoke else gpu_e2e.llama8b_config()
    else:
        role, name = 0, "SmolLM2-135M-shaped, random bf16"
        cfg = replace(tokens.config, n_layers=2) if check.smoke else tokens.config
    dtype = torch.float32 if check.smoke else torch.bfloat16
    runtime = gpu_e2e.random_runtime(cfg, check.device, dtype, tokens)
    peaks = peaks_of(check)

    def partial(model: dict) -> None:
        check.write(part, {"model": model, "targets": gpu_e2e.model_targets(model, role)}, done=False)

    model = gpu_e2e.run_model(name, runtime, check_items(check, part), peaks, log, on_item=partial)
    check.write(part, {"model": model, "targets": gpu_e2e.model_targets(model, role)}, done=True)


def run_tests(check: Check) -> None:
    from kvrag.bench.gpu_check_tests import run_cuda_tests

    check.write("tests", run_cuda_tests(check.folder, check.out, check.smoke, log), done=True)


# ---- the summary -----------------------------------------------------------------------------------------------


def summary(check: Check) -> str:
    """One markdown table of every part's state and headline figures, then each target."""
    lines = ["| part | state | figures |", "|---|---|---|"]
    judged = []
    for part in PARTS:
        try:
            result = json.loads((check.out / f"{part}.json").read_text())
        except (OSError, ValueError):
            lines.append(f"| {part} | no result | |")
            continue
        lines.append(f"| {part} | {'done' if result['done'] else 'cut short'} | {_figures(part, result)} |")
        judged += result.get("targets", [])
    lines += ["", *(f"- {t['what']}: {t['value']:.2f} (target {t['bound']}): "
                    f"{'not judged (smoke)' if check.smoke else 'met' if t['met'] else 'not met'}" for t in judged)]
    return "\n".join(lines)


def _figures(part: str, r: dict) -> str:
    if part == "peaks":
        p = r["peaks"]
        return (f"{r['device']}: {p['matmul_tflops']:.0f} TFLOP/s, copy {p['copy_gbps']:.0f} GB/s, "
                f"H2D {p['h2d_gbps']:.1f} GB/s")
    if part == "kernels":
        return "; ".join(f"{k['kernel']} {k['shape']} {k['ms']:.3g} ms" + (f" ({k['speedup']:.2f}x)" if k["speedup"]
                                                                          else "") for k in r["kernels"])
    if part == "graphs":
        return "; ".join(f"B={c['bucket']} ctx={c['ctx']}: eager {c['eager_ms']:.3g} ms, graph {c['graph_ms']:.3g} ms, "
                         f"launches {c['eager']['launch_calls']} -> {c['graph']['launch_calls']}" for c in r["cases"])
    if part == "tests":
        return ", ".join(f"{r[k]} {k}" for k in ("passed", "failed", "errors", "skipped"))
    m = r["model"]
    return (f"{m['items']} items, {m['prompt_tokens_median']:.0f} tokens: full {m['full_ms']:.3g} ms "
            f"(floor {m['floor_full_ms']:.3g}), blend {m['blend_ms']:.3g} ms ({m['blend_vs_full']:.2f}x full, "
            f"{m['blend_vs_floor']:.2f}x floor), pinned tier {m['tier_ms']:.3g} ms ({m['tier_vs_full']:.2f}x)"
            + (f"; launches full/blend {m['launches']['full']['kernels']}/{m['launches']['blend']['kernels']}"
               if "launches" in m else ""))


RUNS = {"peaks": run_peaks, "kernels": run_kernels, "graphs": run_graphs, "e2e-8b": lambda c: run_e2e(c, "e2e-8b"),
        "e2e-smol": lambda c: run_e2e(c, "e2e-smol"), "tests": run_tests}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=[*PARTS, "summary"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--folder", type=Path, default=Path(".gpu-check"))
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--items", type=int, default=None)
    args = parser.parse_args()
    check = Check(args.out, args.folder, args.cpu_smoke, args.items)
    check.out.mkdir(parents=True, exist_ok=True)
    if args.part == "summary":
        print(summary(check))
        return
    if not check.smoke and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA GPU here; --cpu-smoke rehearses the parts on the CPU")
    start = time.perf_counter()
    RUNS[args.part](check)
    log(f"{args.part}: done in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
