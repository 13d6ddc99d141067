"""Cold `kvrag ask`: a new process per question, as a user at a shell meets it. Wall time, peak memory and the
answer's own timings, median over runs.

    kvrag bench cold --store .kvrag/demo-store --runs 5
    make bench-cold

`--baseline DIR` runs another checkout (an older kvrag on PYTHONPATH) for a before/after table in one run; runs
of the two alternate so that drift on a shared machine hits both alike.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from kvrag.errors import KvragError

QUESTION = "Who was the last keeper of the Skerry Point lighthouse?"
PARTS = ("startup", "model_load", "embedder_load", "retrieve", "prefill", "decode", "decode_tokens_per_s")
# cpu_s: the process's user + system seconds, steadier than wall on a shared machine; load1: the 1-minute load
# average as the run starts, to read every figure beside
KEYS = ("wall", "cpu_s", "rss_mb", *PARTS, "load1")


def run_once(store: str, args: list[str], pythonpath: str | None = None) -> dict:
    """One cold process (another checkout first on `pythonpath`): wall and CPU seconds, peak RSS (MB), the answer's
    timings, the load average."""
    env = {**os.environ, "PYTHONPATH": pythonpath} if pythonpath else None
    load1 = os.getloadavg()[0]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "kvrag", "ask", QUESTION, "--store", store, "--json", *args],
                                stdout=out, stderr=err, text=True, env=env)
        _, status, usage = os.wait4(proc.pid, 0)  # reaps it, with its own peak memory
        wall = time.perf_counter() - start
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise KvragError(f"kvrag ask failed: {stderr.strip().splitlines()[-1] if stderr.strip() else status}")
    answer = json.loads(stdout)
    answer = answer[0] if isinstance(answer, list) else answer
    row = {"wall": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "rss_mb": usage.ru_maxrss / 1024, "load1": load1,
           "answer": answer.get("answer", answer.get("text", ""))}
    row.update({k: v for k, v in answer["timings"].items() if k in PARTS})
    return row


def run(store: str, runs: int, baseline: str | None, args: list[str]) -> dict[str, list[dict]]:
    """`runs` cold runs of this checkout (and of `baseline`'s, alternating), after one unrecorded run."""
    sides = {"this": None}  # name -> PYTHONPATH for the run (None: this checkout)
    if baseline:
        sides["baseline"] = baseline
    rows: dict[str, list[dict]] = {name: [] for name in sides}
    run_once(store, args)  # page cache and compiled kernels warm for both sides
    for _ in range(runs):
        for name, path in sides.items():
            rows[name].append(run_once(store, args, path))
    return rows


def medians(rows: dict[str, list[dict]]) -> dict[str, dict[str, float | None]]:
    """Each side's median of each figure (None where no run has it)."""
    out = {}
    for name, runs in rows.items():
        values = {key: [r[key] for r in runs if r.get(key) is not None] for key in KEYS}
        out[name] = {key: statistics.median(v) if v else None for key, v in values.items()}
    return out


def report(rows: dict[str, list[dict]]) -> str:
    """A markdown table of each part's median per side, then each side's first answer."""
    median = medians(rows)
    lines = ["| part (median) | " + " | ".join(rows) + " |", "|---|" + "---|" * len(rows)]
    for key in KEYS:
        cells = [f"{m[key]:.3f}" if m[key] is not None else "-" for m in median.values()]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    lines += [f"{name}: {runs[0]['answer']!r}" for name, runs in rows.items()]
    return "\n".join(lines)
