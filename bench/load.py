"""`kvrag bench load`: the host side of loading stored KV (issue 38), on any machine, with or without a GPU.

A store of random KV shaped like Llama-3.1-8B's (32 layers, 8 KV heads of 128; fp16, uncompressed as the GPU bench
stores it; 10 chunks of 600 tokens: 6,000 tokens, 786 MB) is written to disk once and read once (the page cache
warm, as for a store in use). Then, on this machine:

    memcpy_gbps        a large numpy copy over the same threads (the staging pool's), the best of several
    map_copy_gbps      a plain copy of the same stored values out of LMDB's map, over the same threads
    staging_gbps       every layer staged through an engine's StagingArea (load/staging.py): read as views of the
                       map, checked, copied into the slot by the pool; stored bytes / wall time, the best round
    staging_share_of_memcpy
    python_ms_per_layer  the staging thread's own CPU time a layer (the reads and the hand-outs; the copies run on
                       the pool)
    copies_per_layer, launches_per_layer  of the staged loader, fused (on a GPU its real kernel over every layer; on
                       a CPU Triton's interpreter over the first 2 layers, which it runs slowly but exactly)
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kvrag.load.layer_work import ChunkRef
from kvrag.load.loader import open_loader
from kvrag.load.staged_loader import StagedLoader
from kvrag.load.staging import LayerPlan, StagingArea
from kvrag.store.env import StoreEnv
from kvrag.store.kv import LocalKVTable
from kvrag.store.table import encode_chunk

LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3.1-8B's KV
ROUNDS = 3
COUNTED_LAYERS_CPU = 2  # the interpreter's pace: enough to count, not to time
COPY_BYTES = 256 << 20


def build_store(env: StoreEnv, chunks: int, tokens: int, codec: str, compress: bool, layers: int) -> list[ChunkRef]:
    """`chunks` chunks of random KV (normal, as float16), each `tokens` tokens, into a fresh table."""
    table = LocalKVTable(env, "bench-load", codec, compress)
    rng = np.random.default_rng(0)
    refs = []
    for c in range(chunks):
        ids = list(range(c * tokens, (c + 1) * tokens))
        kv = [(rng.standard_normal((tokens, KV_HEADS, HEAD_DIM), dtype=np.float32).astype(np.float16),
               rng.standard_normal((tokens, KV_HEADS, HEAD_DIM), dtype=np.float32).astype(np.float16))
              for _ in range(layers)]
        record, values = encode_chunk(ids, kv, None, codec, compress)
        table.put_encoded(f"chunk{c}", record, values)
        refs.append(ChunkRef(f"chunk{c}", ids))
    return refs


def memcpy_gbps(threads: int) -> float:
    """The best of ROUNDS copies of COPY_BYTES, split over `threads` threads (numpy releases the GIL)."""
    src = np.random.default_rng(1).integers(0, 255, COPY_BYTES, dtype=np.uint8)
    dst = np.empty_like(src)
    parts = np.array_split(np.arange(COPY_BYTES), threads)
    bounds = [(int(p[0]), int(p[-1]) + 1) for p in parts]
    np.copyto(dst, src)  # first touch
    best = float("inf")
    for _ in range(ROUNDS):
        workers = [threading.Thread(target=np.copyto, args=(dst[a:b], src[a:b])) for a, b in bounds]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - start)
    return COPY_BYTES / best / 1e9


def map_copy_gbps(table: LocalKVTable, refs: list[ChunkRef], threads: int, layers: int) -> float:
    """A plain copy of the same stored values out of LMDB's map (what the staging reads, without checking), over
    `threads` threads: the ceiling a store in the page cache sets, below an anonymous memcpy (the map's pages are
    the file's 4 KiB ones)."""
    pairs = [(r.chunk_id, r.token_ids) for r in refs]
    with table.layer_views(pairs, 0) as raws:
        out = np.empty(sum(len(raw.value) for raw in raws), dtype=np.uint8)
    best, total = float("inf"), 0

    def copy(values: list) -> None:
        at = 0
        for value in values:
            src = np.frombuffer(value, dtype=np.uint8)
            out[at:at + src.size] = src
            at += src.size

    for _ in range(ROUNDS):
        start, total = time.perf_counter(), 0
        for layer in range(layers):
            with table.layer_views(pairs, layer) as raws:
                values = [raw.value for raw in raws]
                halves = [values[k::threads] for k in range(threads)]
                workers = [threading.Thread(target=copy, args=(part,)) for part in halves]
                for w in workers:
                    w.start()
                for w in workers:
                    w.join()
                total += sum(len(v) for v in values)
        best = min(best, time.perf_counter() - start)
    return total / best / 1e9


def staging_rate(table: LocalKVTable, refs: list[ChunkRef], area: StagingArea, layers: int) -> dict:
    """Every layer staged into the area's slots, as the staged loader does, round after round: the best round's
    stored bytes a second, and the staging thread's CPU time a layer."""
    plan = LayerPlan(table.codec, sum(r.n_rows for r in refs), KV_HEADS, HEAD_DIM,
                     tuple(np.cumsum([0] + [r.n_rows for r in refs]).tolist()))
    pairs = [(r.chunk_id, r.token_ids) for r in refs]
    best, cpu_per_layer, staged_bytes = float("inf"), 0.0, 0
    for _ in range(ROUNDS):
        records: dict = {}  # a load reads them with its first layer, as the staged loader does
        start, cpu, total = time.perf_counter(), time.thread_time(), 0
        for index in range(layers):
            slot = area.acquire(index)
            with table.layer_views(pairs, index, records) as raws:
                staged = area.stage(slot, plan, [raw.value for raw in raws], lambda *_: None)
            total += staged.staged_bytes
            area.release(slot)
        wall = time.perf_counter() - start
        if wall < best:
            best, cpu_per_layer, staged_bytes = wall, (time.thread_time() - cpu) / layers, total
    return {"staging_gbps": staged_bytes / best / 1e9, "staged_mb": staged_bytes / 1e6,
            "python_ms_per_layer": 1e3 * cpu_per_layer, "staging_ms_per_layer": 1e3 * best / layers}


def counts(table: LocalKVTable, refs: list[ChunkRef], device: torch.device, layers: int) -> dict:
    """Copies and launches a layer of the staged loader, fused, over `layers` layers."""
    rows = sum(r.n_rows for r in refs)
    positions = torch.arange(40, 40 + rows)  # after a preamble
    inv_freq = (1.0 / 500000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)).float()
    loader = open_loader(table, refs, range(layers), torch.bfloat16, device, fused=True, positions=positions,
                         inv_freq=inv_freq, area=StagingArea(pinned=device.type == "cuda"))
    assert isinstance(loader, StagedLoader)
    loader.start()
    try:
        for layer in range(layers):
            loader.layer(layer)
    finally:
        loader.close()
    return {"copies_per_layer": loader.copies / layers, "launches_per_layer": loader.launches / layers,
            "counted_layers": layers, "reader_ms_per_layer": 1e3 * loader.reader_cpu_s / layers}


def run(chunks: int = 10, tokens: int = 600, threads: int = 2, codec: str = "fp16", compress: bool = False,
        work: Path | None = None, log: Callable[[str], None] = print) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory(prefix="kvrag-bench-load-", dir=work) as tmp, \
            StoreEnv.open(Path(tmp) / "store", create=True) as env:
        start = time.perf_counter()
        refs = build_store(env, chunks, tokens, codec, compress, LAYERS)
        table = LocalKVTable(env, "bench-load", codec, compress)
        log(f"store: {chunks} chunks x {tokens} tokens x {LAYERS} layers in {time.perf_counter() - start:.1f} s")
        area = StagingArea(pinned=device.type == "cuda", threads=threads)
        staging_rate(table, refs, area, LAYERS)  # the page cache warm, the slots grown
        result = {"machine_device": str(device), "chunks": chunks, "tokens": tokens, "layers": LAYERS,
                  "codec": codec, "compressed": compress, "threads": threads,
                  "memcpy_gbps": memcpy_gbps(threads), "map_copy_gbps": map_copy_gbps(table, refs, threads, LAYERS),
                  **staging_rate(table, refs, area, LAYERS)}
        result["staging_share_of_memcpy"] = result["staging_gbps"] / result["memcpy_gbps"]
        result["staging_share_of_map_copy"] = result["staging_gbps"] / result["map_copy_gbps"]
        log("counting copies and launches (fused loader)...")
        result.update(counts(table, refs, device, LAYERS if device.type == "cuda" else COUNTED_LAYERS_CPU))
        area.close()
    return result


def render(r: dict) -> str:
    return "\n".join([
        f"## Loading stored KV: {r['chunks']} chunks x {r['tokens']} tokens x {r['layers']} layers ({r['codec']}, "
        f"{'compressed' if r['compressed'] else 'uncompressed'}), {r['threads']} staging threads, {r['machine_device']}",
        "",
        "| measure | value |", "|---|---|",
        f"| memcpy ({r['threads']} threads) | {r['memcpy_gbps']:.2f} GB/s |",
        f"| a plain copy out of the store's map ({r['threads']} threads) | {r['map_copy_gbps']:.2f} GB/s |",
        f"| staging | {r['staging_gbps']:.2f} GB/s ({r['staging_share_of_memcpy']:.0%} of memcpy, "
        f"{r['staging_share_of_map_copy']:.0%} of the map copy), "
        f"{r['staging_ms_per_layer']:.2f} ms a layer of {r['staged_mb'] / r['layers']:.1f} MB |",
        f"| staging thread's CPU a layer | {r['python_ms_per_layer']:.3f} ms |",
        f"| copies / launches a layer (fused, {r['counted_layers']} layers) | {r['copies_per_layer']:g} / "
        f"{r['launches_per_layer']:g} |",
    ])
