"""What a store holds, read from outside the server that writes it (bench/serve_mixed.py's crash check): the corpus
chunks whose KV is stored, the kept client passages, and their size as engine/kept_passages.py bounds it."""

from __future__ import annotations

from pathlib import Path

from kvrag.store.chunks import ChunkTable
from kvrag.store.env import StoreEnv
from kvrag.store.kv import LocalKVTable
from kvrag.store.manifest import read_manifests

CODEC = "fp16"  # `kvrag serve`'s default codec, which the soak runs


def snapshot(path: Path) -> dict:
    """{corpus: chunk ids with stored KV, kept: kept passages' ids, records_without_kv: kept records whose KV is
    missing, kept_bytes: their fp16 K and V as the bound counts them, store_bytes: the LMDB file's size}."""
    env = StoreEnv.open(path, readonly=True)
    try:
        kept = {r.chunk_id for r in ChunkTable(env).client_records()}
        stored: dict[str, int] = {}  # chunk id -> bytes the kept-passage bound counts for it
        for model_fp in read_manifests(env):
            for chunk_id, rec in LocalKVTable(env, model_fp, CODEC).iter_chunks():
                tokens = len(rec.token_bytes) // 4
                stored[chunk_id] = tokens * len(rec.value_sizes) * 2 * rec.kv_heads * rec.head_dim * 2
    finally:
        env.close()
    return {"corpus": sorted(set(stored) - kept), "kept": sorted(kept),
            "records_without_kv": sorted(kept - set(stored)),
            "kept_bytes": sum(n for c, n in stored.items() if c in kept),
            "store_bytes": sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())}
