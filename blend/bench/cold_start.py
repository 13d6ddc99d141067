"""Cold `kvrag ask`: a new process per question, as a user at a shell meets it. Wall time, peak memory and the
answer's own timings, median over runs.

    python -m kvrag.blend.bench.cold_start --store .kvrag/demo-store --runs 5
    make bench-cold

`--python` runs another interpreter or checkout (e.g. an older kvrag on PYTHONPATH) for a before/after table in
one run; runs of the two alternate so that drift on a shared machine hits both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

QUESTION = "Who was the last keeper of the Skerry Point lighthouse?"
PARTS = ("startup", "model_load", "embedder_load", "retrieve", "prefill", "decode", "decode_tokens_per_s")


def run_once(store: str, args: list[str], pythonpath: str | None = None) -> dict:
    """One cold process (another checkout first on `pythonpath`): wall seconds, peak RSS (MB), the answer's
    timings."""
    env = {**os.environ, "PYTHONPATH": pythonpath} if pythonpath else None
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "kvrag", "ask", QUESTION, "--store", store, "--json", *args],
                                stdout=out, stderr=err, text=True, env=env)
        _, status, usage = os.wait4(proc.pid, 0)  # reaps it, with its own peak memory
        wall = time.perf_counter() - start
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"kvrag ask failed: {stderr.strip().splitlines()[-1] if stderr.strip() else status}")
    answer = json.loads(stdout)
    answer = answer[0] if isinstance(answer, list) else answer
    row = {"wall": wall, "rss_mb": usage.ru_maxrss / 1024, "answer": answer.get("answer", answer.get("text", ""))}
    row.update({k: v for k, v in answer["timings"].items() if k in PARTS})
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--baseline", help="PYTHONPATH of another kvrag checkout to time against (its parent dir)")
    ap.add_argument("args", nargs="*", default=["-k", "1", "--max-tokens", "64"], help="more `kvrag ask` args")
    opts = ap.parse_args()
    sides = {"this": None}  # name -> PYTHONPATH for the run (None: this checkout)
    if opts.baseline:
        sides["baseline"] = opts.baseline
    rows: dict[str, list[dict]] = {name: [] for name in sides}
    run_once(opts.store, opts.args)  # page cache and compiled kernels warm for both sides
    for _ in range(opts.runs):
        for name, path in sides.items():
            rows[name].append(run_once(opts.store, opts.args, path))
    _report(rows)


def _report(rows: dict[str, list[dict]]) -> None:
    keys = ["wall", "rss_mb", *PARTS]
    print("| part (median) | " + " | ".join(rows) + " |")
    print("|---|" + "---|" * len(rows))
    for key in keys:
        cells = []
        for runs in rows.values():
            values = [r[key] for r in runs if r.get(key) is not None]
            cells.append(f"{statistics.median(values):.3f}" if values else "-")
        print(f"| {key} | " + " | ".join(cells) + " |")
    for name, runs in rows.items():
        print(f"{name}: {runs[0]['answer']!r}")


if __name__ == "__main__":
    main()
