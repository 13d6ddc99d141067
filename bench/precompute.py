"""What storing costs precompute: its throughput against plain prefill of the same chunks, one process.

    kvrag bench precompute --store DIR [--chunks 40] [--codec fp16] [--json]

Takes the first N indexed chunks of DIR (sorted by id, so a rerun takes the same ones), copies their
records into a scratch store, and runs, alternating in rounds so drift on a noisy machine is shared:
plain prefill of each chunk after the preamble (the KV thrown away), and `precompute` into the scratch
store. Overhead = plain tokens/s ÷ precompute tokens/s − 1 (the issue's target: under 10 %).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from kvrag.cli.common import load_runtime
from kvrag.model.prefill import extend
from kvrag.model.runtime import Runtime
from kvrag.precompute.plain import chunk_kv, precompute
from kvrag.store.chunks import ChunkRecord, ChunkTable, DocChunk, DocRecord
from kvrag.store.env import StoreEnv


def scratch_store(path: Path, source: ChunkTable, records: list[ChunkRecord]) -> StoreEnv:
    """A store holding just these chunk records and the source's index config."""
    env = StoreEnv.open(path, create=True)
    table = ChunkTable(env)
    table.write_config(source.read_config())
    doc = DocRecord("bench", "bench", "", "bench",
                    tuple(DocChunk(r.chunk_id, r.char_start, r.char_end, len(r.token_ids)) for r in records))
    table.put_docs([(doc, records)])
    return env


def plain_prefill_s(runtime: Runtime, records: list[ChunkRecord]) -> float:
    with torch.inference_mode():
        _, preamble = extend(runtime.model, None, runtime.ids_tensor(runtime.prompts.preamble_ids))
        start = time.perf_counter()
        for record in records:
            chunk_kv(runtime, preamble, record.token_ids)
        return time.perf_counter() - start


def run(store: Path, chunks: int, rounds: int, codec: str) -> dict:
    """Plain prefill against precompute of the store's first `chunks` chunks, `rounds` times alternating."""
    runtime = load_runtime(None, "auto", "auto")
    plain_s, stored_s, store_wait_s, writer_s = 0.0, 0.0, 0.0, 0.0
    with StoreEnv.open(store, readonly=True) as source_env:
        source = ChunkTable(source_env)
        records = source.get_many(sorted(source.ids())[:chunks])
        tokens = sum(len(r.token_ids) for r in records)
        for _ in range(rounds):
            plain_s += plain_prefill_s(runtime, records)
            with tempfile.TemporaryDirectory(prefix="kvrag-precompute-bench-") as tmp:
                with scratch_store(Path(tmp) / "store", source, records) as env:
                    summary = precompute(env, runtime, codec)
            stored_s += summary.wall_s
            store_wait_s += summary.store_s
            writer_s += summary.writer_busy_s
    plain_tps = rounds * tokens / plain_s
    stored_tps = rounds * tokens / stored_s
    return {"chunks": len(records), "tokens": tokens, "rounds": rounds, "codec": codec,
            "dtype": str(runtime.model.dtype).removeprefix("torch."),
            "plain_prefill_tokens_per_s": plain_tps, "precompute_tokens_per_s": stored_tps,
            "store_overhead": plain_tps / stored_tps - 1,
            "forward_loop_wait_s": store_wait_s, "writer_busy_s": writer_s}


def summary_line(r: dict) -> str:
    return (f"{r['chunks']} chunks, {r['tokens']:,} tokens × {r['rounds']}: plain prefill "
            f"{r['plain_prefill_tokens_per_s']:,.0f} tok/s, precompute ({r['codec']}) "
            f"{r['precompute_tokens_per_s']:,.0f} tok/s → store overhead {r['store_overhead']:.1%}")
