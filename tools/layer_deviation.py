"""Where a blend's KV deviates from full prefill's, by layer (sliding or global) and by row position inside a chunk
(docs/performance.md, issue 49; docs/sliding-window.md, issue 60).

    python tools/layer_deviation.py --items 3 [--store DIR] [--rules cacheblend,chunks] [--ratio 0.15] [--model M]
        [--lead-in]

For each MuSiQue item (the benchmarks' copy), full prefill's cache against full KV reuse's and each rule's blend:
per layer, ||V - V_full||^2 / ||V_full||^2 over the chunk rows past the first chunk (the first is exact), in all and
by the rows' offset inside their chunk (BINS). Layers are named by index and kind: "5g" global, "6s" sliding.
`--lead-in`: chunks after the first are stored after a lead-in drawn from the items' passages
(precompute/lead_in.py), as `kvrag precompute` stores a sliding-window model's. One JSON line per item on stdout.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvrag.bench.rag.items import build_items, read_dataset, split_passages
from kvrag.blend.config import BlendConfig
from kvrag.cli.common import load_runtime
from kvrag.engine.prefiller import Prefiller
from kvrag.precompute import lead_in
from kvrag.store.env import StoreEnv

BINS = ((0, 32), (32, 128), (128, 256), (256, 512), (512, 1 << 30))  # row offsets inside a chunk


def relative_v_error(full, got, rows: slice, offsets: torch.Tensor, kinds: list[str]) -> dict[str, dict[str, float]]:
    """Per layer: the squared error of got's V over `rows` relative to full's, in all and by offset bin."""
    out = {}
    for layer, kind in enumerate(kinds):
        ref, val = full.v[layer, rows].float(), got.v[layer, rows].float()  # [R, Hkv, hd]
        err = (ref - val).pow(2).sum(dim=(1, 2))  # [R]
        norm = ref.pow(2).sum(dim=(1, 2))
        cells = {"all": float(err.sum() / norm.sum())}
        for lo, hi in BINS:
            m = (offsets >= lo) & (offsets < hi)
            if m.any():
                cells[f"{lo}-{hi if hi < 1 << 30 else ''}"] = round(float(err[m].sum() / norm[m].sum()), 4)
        out[f"{layer}{kind}"] = cells
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", default="3", help="Comma-separated MuSiQue item indices.")
    parser.add_argument("--store", type=Path, default=Path(".kvrag/layer-deviation"))
    parser.add_argument("--rules", default="cacheblend,chunks")
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument("--model", default=None, help="As kvrag's --model (default: SmolLM2).")
    parser.add_argument("--lead-in", action="store_true", help="Chunks stored after a lead-in (see above).")
    args = parser.parse_args()
    raw = read_dataset(None)
    indices = [int(i) for i in args.items.split(",")]
    with StoreEnv.open(args.store, create=True) as env:
        rt = load_runtime(args.model, None, None)
        lead = lead_in.choose(split_passages(raw, indices, rt), lead_in.lead_in_length(rt.model.cfg)) \
            if args.lead_in else None
        pf = Prefiller.open(rt, env, lead_in=lead)
        cfg = rt.model.cfg
        kinds = ["s" if cfg.window(i) else "g" for i in range(cfg.n_layers)] if cfg.layer_types else ["g"] * cfg.n_layers
        for item in build_items(raw, indices, rt):
            with torch.inference_mode():
                pf.source.chunk_refs(item.chunks, start=len(pf.preamble))
            pf.flush_write_back()
            n_pre, n_chunk = len(pf.preamble), item.chunk_tokens
            rows = slice(n_pre + len(item.chunks[0][1]), n_pre + n_chunk)
            offsets = torch.cat([torch.arange(len(ids)) for _, ids in item.chunks[1:]])  # [R]
            full = pf.prefill(item.chunks, item.question, "full").cache
            runs = {"reuse": pf.prefill(item.chunks, item.question, "reuse").cache}
            for rule in args.rules.split(","):
                blend = BlendConfig(ratio=args.ratio, selection=rule)
                runs[f"{rule}@{args.ratio:g}"] = pf.prefill(item.chunks, item.question, "blend", blend).cache
            print(json.dumps({"item": item.index, **{name: relative_v_error(full, cache, rows, offsets, kinds)
                                                     for name, cache in runs.items()}}), flush=True)


if __name__ == "__main__":
    main()
