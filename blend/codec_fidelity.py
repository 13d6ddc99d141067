"""How much a lossy KV codec costs: first-token KL of int8 (or bf16) against fp16 stored KV.

For each MuSiQue item the passages' KV is computed once, stored under both codecs, and the same
prompt is prefilled from each (full KV reuse, so every chunk token comes from the store, and blend
at the default ratio). Run: python -m kvrag.blend.codec_fidelity --items 20 [--store DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from kvrag import KvragError
from kvrag.blend.bench.items import read_dataset
from kvrag.blend.engine import Engine
from kvrag.blend.fusion import BlendConfig
from kvrag.blend.precompute import chunk_kv, layers_to_numpy
from kvrag.blend.runtime import Runtime
from kvrag.store.chunks import chunk_id_for
from kvrag.store.env import StoreEnv


def first_token_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(p || q) of the next-token distributions, in nats."""
    p = p_logits.float().log_softmax(-1)
    q = q_logits.float().log_softmax(-1)
    return float(torch.sum(p.exp() * (p - q)))


def store_both(runtime: Runtime, reference: Engine, lossy: Engine, chunks) -> None:
    """Compute each missing chunk's KV once and store it under both codecs (no double rounding)."""
    missing = set(reference.table.missing([c for c, _ in chunks])) | set(lossy.table.missing([c for c, _ in chunks]))
    with torch.inference_mode():
        for chunk_id, ids in chunks:
            if chunk_id in missing:
                layers = layers_to_numpy(chunk_kv(runtime, reference.preamble, ids))
                reference.table.put_chunk(chunk_id, ids, layers)
                lossy.table.put_chunk(chunk_id, ids, layers)


def run(items: list[dict], store: Path, codec: str, model: str | None, dtype: str | None) -> dict:
    runtime = Runtime.load(model, dtype, tune_process=True)
    with StoreEnv.open(store, create=True) as env:
        reference, lossy = Engine(runtime, env, "fp16"), Engine(runtime, env, codec)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", type=Path, default=None,
                        help="MuSiQue-format JSON (default ../shared/data/musique_s.json)")
    parser.add_argument("--items", type=int, default=20)
    parser.add_argument("--codec", default="int8")
    parser.add_argument("--store", type=Path, default=None, help="a store to reuse (default: a temporary one)")
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default=None)
    args = parser.parse_args(argv)
    try:
        items = read_dataset(args.dataset)[: args.items]
    except KvragError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.store is not None:
        print(json.dumps(run(items, args.store, args.codec, args.model, args.dtype), indent=2))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(run(items, Path(tmp) / "store", args.codec, args.model, args.dtype), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
