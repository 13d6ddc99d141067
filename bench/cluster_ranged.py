"""Cold time to first token over an object store: ranged, layer-ordered reads against whole-chunk fetches, at an
injected per-request latency, with the local store as the reference (issue 50; `kvrag bench cluster` calls
`cold_ttft`).

The corpus is MuSiQue's report items (bench/remote.py's: a document per passage, indexed and precomputed into a
SeaweedFS started here on 127.0.0.1, from a mirror directory of its own). A second mirror then asks each question
through the Python API (retrieval k=5, blend@0.15, fp16 + zstd, memory tiers off, one token), once per setting:

    local           a plain local store (a copy of the warmed mirror, no object store): the reference
    ranged / whole  over the object store, every chunk cold (the mirror's local tier emptied and no index kept before
                    each question), the chunks read by ranged GETs of a few layers each or fetched whole, with
                    `latency_ms` slept before each request (store/remote/object_store.py): a network round trip that
                    loopback does not have

The settings take turns question by question, so a change in the machine's load falls on all of them alike; each
question's ratio to the local TTFT of its own turn is kept too (`ratio_paired_p50`: less noisy than a ratio of
medians on a busy machine). Beside the TTFT, the loader's reads alone are timed on each question's chunks, as
load/loader.py makes them (`missing`, then per layer every chunk in turn, with `compute_ms` slept per layer for the
model's compute): `layer0_p50_s` until layer 0 of every chunk is in, `load_p50_s` until every layer is. On loopback
the server shares the cores with the model, and bandwidth is the loopback's: a real network adds transfer time that
the ranged reads overlap with the compute and the whole fetches do not.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path

from kvrag.bench import remote as remote_bench

RATIO = remote_bench.RATIO
LATENCIES_MS = (1, 5, 20)
MODES = ("ranged", "whole")


def cold_ttft(items: int = 5, latencies_ms: Sequence[float] = LATENCIES_MS, *, dataset: Path | None = None,
              model: str | None = None, layers_per_request: int = 4, repeats: int = 1, compute_ms: float = 20.0,
              log: Callable[[str], None] = lambda _: None) -> list[dict]:
    """Median cold TTFT per (mode, latency) over `items` MuSiQue report questions (each asked `repeats` times),
    and its ratio to the local store's: [{"mode", "latency_ms", "ttft_p50_s", "ratio_to_local", "ratio_paired_p50",
    "layer0_p50_s", "load_p50_s", "questions", "requests", "mb_fetched"}], the local reference first (module doc).
    `model`: a model name or directory (default: kvrag's)."""
    from kvrag.bench.rag.datasets import musique_report_items

    questions = [item["question"] for item in musique_report_items(dataset)[:items]]
    with tempfile.TemporaryDirectory(prefix="kvrag-bench-ranged-") as tmp, \
            remote_bench._object_store(remote_bench.Plan(), Path(tmp)) as (url, env):
        root = Path(tmp)
        writer = {**os.environ, **env, "KVRAG_MIRROR_DIR": str(root / "mirror-writer")}
        if model:
            writer["KVRAG_MODEL"] = model
        docs = remote_bench.write_docs(musique_report_items(dataset)[:items], root / "docs")
        for step, args in (("index", [str(docs)]), ("precompute", [])):
            remote_bench._cli([step, *args, "--store", url], writer, log)
        reader = {**env, "KVRAG_MIRROR_DIR": str(root / "mirror-reader")}
        with remote_bench._environ(reader):
            samples = _measure(url, root / "local", questions, latencies_ms, model,
                               (layers_per_request, repeats, compute_ms / 1e3), log)
    return summarize(samples, latencies_ms)


def _measure(url: str, local_dir: Path, questions: list[str], latencies_ms: Sequence[float], model: str | None,
             how: tuple[int, int, float], log: Callable[[str], None]) -> list[dict]:
    """Every question in every setting, the settings taking turns (module doc); `how`: layers per request,
    repeats, seconds of compute per layer."""
    layers_per_request, repeats, compute_s = how
    from kvrag.api import KVRag

    options = {"host_cache": "0", **({"model": model} if model else {})}
    with KVRag(url, **options) as rag:  # a warm pass: the mirror's local tier then holds every chunk
        for question in questions:
            _ask(rag, question)
        mirror = Path(rag.env.path)
    shutil.copytree(mirror, local_dir, ignore=shutil.ignore_patterns("remote.json", "lock.mdb"))
    samples = []
    with ExitStack() as stack:
        remote = stack.enter_context(KVRag(url, **options))
        local = stack.enter_context(KVRag(str(local_dir), **options))
        table = remote.engine.prefiller.source.table  # the mirror's CachedKVTable
        _ask(local, questions[0])  # the first question of a process warms what a process warms once
        _ask(remote, questions[0])  # (its chunks still local here)
        local_table = local.engine.prefiller.source.table
        for repeat in range(repeats):
            for turn, question in enumerate(questions):
                turn += repeat * len(questions)
                asked = _ask(local, question)
                chunk_ids = [s["chunk_id"] for s in asked.pop("sources")]
                samples.append({"mode": "local", "latency_ms": 0, "turn": turn, **asked,
                                **_load(local_table, chunk_ids, compute_s)})
                for latency in latencies_ms:
                    for mode in MODES:
                        table.layers_per_request = layers_per_request if mode == "ranged" else 0
                        table.remote.objects.latency_s = latency / 1e3
                        table.clear_local()
                        asked = _ask(remote, question, table)
                        del asked["sources"]
                        table.clear_local()
                        samples.append({"mode": mode, "latency_ms": latency, "turn": turn, **asked,
                                        **_load(table, chunk_ids, compute_s)})
            log(f"pass {repeat + 1}/{repeats}: {len(questions)} questions in {1 + len(MODES) * len(latencies_ms)} "
                "settings")
    return samples


def _ask(rag, question: str, table=None) -> dict:
    """One question, one token: its TTFT, and the object store's requests and bytes for it."""
    before = table.remote.objects.counts.snapshot() if table is not None else None
    answer = rag.ask(question, mode="blend", ratio=RATIO, max_tokens=1)
    out = {"ttft_s": answer.timings["ttft"], "tiers": list(answer.chunk_tiers), "sources": answer.sources}
    if table is not None:
        after = table.remote.objects.counts.snapshot()
        out["requests"] = sum(after["requests"].values()) - sum(before["requests"].values())
        out["bytes_in"] = after["bytes_in"] - before["bytes_in"]
    return out


def _load(table, chunk_ids: list[str], compute_s: float) -> dict:
    """The loader's reads of these chunks alone (module doc): seconds to layer 0 of every chunk, and to all."""
    start = time.perf_counter()
    table.missing(chunk_ids)  # as ChunkSource.chunk_refs asks before a load
    layer0 = None
    for layer in range(table.record(chunk_ids[0]).n_layers):
        for chunk_id in chunk_ids:
            table.get_layer_raw(chunk_id, layer)
        if layer0 is None:
            layer0 = time.perf_counter() - start
        time.sleep(compute_s)
    return {"layer0_s": layer0, "load_s": time.perf_counter() - start}


def summarize(samples: list[dict], latencies_ms: Sequence[float]) -> list[dict]:
    """Per setting: median TTFT, its ratio to the local store's (of medians, and the median of each question's
    ratio to the local TTFT of its own turn), median loader times, mean requests and MB per question."""
    def rows(mode: str, latency: float) -> list[dict]:
        return [s for s in samples if s["mode"] == mode and s["latency_ms"] == latency]

    local_rows = rows("local", 0)
    local, by_turn = statistics.median(s["ttft_s"] for s in local_rows), {s["turn"]: s["ttft_s"] for s in local_rows}
    out = []
    for mode, latency in [("local", 0)] + [(m, lat) for lat in latencies_ms for m in MODES]:
        got = rows(mode, latency)
        p50 = statistics.median(s["ttft_s"] for s in got)
        out.append({"mode": mode, "latency_ms": latency, "ttft_p50_s": p50, "ratio_to_local": p50 / local,
                    "ratio_paired_p50": statistics.median(s["ttft_s"] / by_turn[s["turn"]] for s in got),
                    "layer0_p50_s": statistics.median(s["layer0_s"] for s in got),
                    "load_p50_s": statistics.median(s["load_s"] for s in got), "questions": len(got),
                    "requests": statistics.mean(s.get("requests", 0) for s in got),
                    "mb_fetched": statistics.mean(s.get("bytes_in", 0) for s in got) / 1e6})
    return out


def markdown(rows: list[dict]) -> str:
    lines = ["| mode | latency ms | cold TTFT ms (median) | vs local | vs local, paired | loader: layer 0 ms | "
             "loader: all layers ms | requests / question | MB / question |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['mode']} | {r['latency_ms']:g} | {1e3 * r['ttft_p50_s']:,.0f} | {r['ratio_to_local']:.2f}x | "
              f"{r['ratio_paired_p50']:.2f}x | {1e3 * r['layer0_p50_s']:,.1f} | {1e3 * r['load_p50_s']:,.0f} | "
              f"{r['requests']:.1f} | {r['mb_fetched']:.1f} |" for r in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # a run by hand: python -m kvrag.bench.cluster_ranged [items [repeats]]
    import json
    import sys

    args = [int(a) for a in sys.argv[1:3]]
    result = cold_ttft(*args, log=lambda line: print(line, file=sys.stderr)) if len(args) < 2 else cold_ttft(
        args[0], repeats=args[1], log=lambda line: print(line, file=sys.stderr))
    print(markdown(result))
    print(json.dumps(result, indent=1))
