"""How much a lossy KV codec costs: first-token KL of int8 (or bf16) against fp16 stored KV.

For each MuSiQue item the passages' KV is computed once, stored under both codecs, and the same
prompt is prefilled from each (full KV reuse, so every chunk token comes from the store, and blend
at the default ratio). Run: kvrag bench codec --items 20 [--store DIR]
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from kvrag.blend.config import BlendConfig
from kvrag.cli.common import load_runtime
from kvrag.engine.prefiller import Prefiller
from kvrag.model.runtime import Runtime
from kvrag.precompute.plain import chunk_kv, layers_to_numpy
from kvrag.store.chunks import chunk_id_for
from kvrag.store.env import StoreEnv


def first_token_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(p || q) of the next-token distributions, in nats."""
    p = p_logits.float().log_softmax(-1)
    q = q_logits.float().log_softmax(-1)
    return float(torch.sum(p.exp() * (p - q)))


def store_both(runtime: Runtime, reference: Prefiller, lossy: Prefiller, chunks) -> None:
    """Compute each missing chunk's KV once and store it under both codecs (no double rounding)."""
    missing = set(reference.source.table.missing([c for c, _ in chunks])) | set(lossy.source.table.missing([c for c, _ in chunks]))
    with torch.inference_mode():
        for chunk_id, ids in chunks:
            if chunk_id in missing:
                layers = layers_to_numpy(chunk_kv(runtime, reference.preamble, ids))
                reference.source.table.put_chunk(chunk_id, ids, layers)
                lossy.source.table.put_chunk(chunk_id, ids, layers)


def run(items: list[dict], store: Path | None, codec: str, model: str | None, dtype: str | None) -> dict:
    """Mean first-token KL and top-1 agreement of `codec` against fp16, under reuse and blend. Without a
    `store`, the KV goes to a temporary one."""
    if store is None:
        with tempfile.TemporaryDirectory() as tmp:
            return run(items, Path(tmp) / "store", codec, model, dtype)
    runtime = load_runtime(model, dtype)
    with StoreEnv.open(store, create=True) as env:
        reference, lossy = Prefiller.open(runtime, env, "fp16"), Prefiller.open(runtime, env, codec)
        rows = []
        for item in items:
            chunks = []
            for ctx in item["ctxs"]:
                ids = runtime.prompts.passage_ids(ctx["title"], ctx["text"])
                chunks.append((chunk_id_for(ids, runtime.local.tokenizer_fingerprint), ids))
            store_both(runtime, reference, lossy, chunks)
            row = {}
            for mode, config in (("reuse", None), ("blend", BlendConfig())):
                ref = reference.prefill(chunks, item["question"], mode, config).logits
                got = lossy.prefill(chunks, item["question"], mode, config).logits
                row[mode] = {"kl": first_token_kl(ref, got), "top1_agree": bool(ref.argmax() == got.argmax())}
            rows.append(row)
    summary = {"codec": codec, "items": len(rows)}
    for mode in ("reuse", "blend"):
        summary[f"{mode}_mean_kl"] = sum(r[mode]["kl"] for r in rows) / len(rows)
        summary[f"{mode}_top1_agreement"] = sum(r[mode]["top1_agree"] for r in rows) / len(rows)
    return summary
