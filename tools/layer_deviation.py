"""Where a blend's KV deviates from full prefill's, layer by layer (docs/performance.md, issue 49).

    python tools/layer_deviation.py --items 3 [--store DIR] [--rules cacheblend,chunks] [--ratio 0.15] [--model M]

For each MuSiQue item (the benchmarks' copy), full prefill's cache against full KV reuse's and each rule's blend:
per layer, ||V - V_full||^2 / ||V_full||^2 over the chunk rows past the first chunk (the first is exact). One JSON
line per item on stdout.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvrag.bench.rag.items import build_items, read_dataset
from kvrag.blend.config import BlendConfig
from kvrag.cli.common import load_runtime
from kvrag.engine.prefiller import Prefiller
from kvrag.store.env import StoreEnv


def relative_v_error(full, got, rows: slice, n_layers: int) -> list[float]:
    """Per layer: the squared error of got's V over `rows` relative to full's."""
    out = []
    for layer in range(n_layers):
        ref, val = full.v[layer, rows].float(), got.v[layer, rows].float()  # [R, Hkv, hd]
        out.append(float((ref - val).pow(2).sum() / ref.pow(2).sum()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", default="3", help="Comma-separated MuSiQue item indices.")
    parser.add_argument("--store", type=Path, default=Path(".kvrag/layer-deviation"))
    parser.add_argument("--rules", default="cacheblend,chunks")
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument("--model", default=None, help="As kvrag's --model (default: SmolLM2).")
    args = parser.parse_args()
    raw = read_dataset(None)
    with StoreEnv.open(args.store, create=True) as env:
        rt = load_runtime(args.model, None, None)
        pf = Prefiller.open(rt, env)
        for item in build_items(raw, [int(i) for i in args.items.split(",")], rt):
            with torch.inference_mode():
                pf.source.chunk_refs(item.chunks)
            pf.flush_write_back()
            n_pre, n_chunk = len(pf.preamble), item.chunk_tokens
            rows = slice(n_pre + len(item.chunks[0][1]), n_pre + n_chunk)
            full = pf.prefill(item.chunks, item.question, "full").cache
            runs = {"reuse": pf.prefill(item.chunks, item.question, "reuse").cache}
            for rule in args.rules.split(","):
                cfg = BlendConfig(ratio=args.ratio, selection=rule)
                runs[f"{rule}@{args.ratio:g}"] = pf.prefill(item.chunks, item.question, "blend", cfg).cache
            n_layers = rt.model.cfg.n_layers
            print(json.dumps({"item": item.index, **{name: relative_v_error(full, cache, rows, n_layers)
                                                     for name, cache in runs.items()}}), flush=True)


if __name__ == "__main__":
    main()
