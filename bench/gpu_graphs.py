"""`kvrag bench gpu`, CUDA graphs for the decode step (issue 47): one batched decode step, eager against replayed.

`decode_graph_case(device, batch, ctx, smoke)` builds a random-weight model of SmolLM2-135M's shape (30 layers, 9
query heads over 3 KV heads of dim 64: the small model whose decode step is launch-bound) in bf16, a paged pool
holding `batch` sequences of `ctx` tokens (random K/V: the timing does not read them), and two BatchDecoders over it:
eager, and with `cuda_graphs` (the batch runs in its own bucket, max_batch = batch). It reports:

- the step's time, eager and replayed: the median of `reps` after `warmup` (CUDA events), the step's host work
  included (the eager step's launches are what the graph removes);
- what one step runs, by torch's profiler: aten operators dispatched, the device's kernels and copies, and the
  host's launch calls (cudaLaunchKernel / cuLaunchKernel, one a kernel eager) and graph launches (cudaGraphLaunch,
  one a replayed step);
- the largest difference between the two steps' logits (their decode kernels split the keys by other plans, so they
  sum in another order: not bit-equal).

With `smoke` (the CPU, under Triton's interpreter) a 2-layer model of the same architecture runs each step once:
it tests the code, it measures nothing.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvrag.bench.gpu_e2e import RandomWeights, count_launches, llama8b_config, smoke_config
from kvrag.bench.gpu_kernels import median_seconds
from kvrag.engine.batch_decode import BatchDecoder
from kvrag.engine.kv_pool import SequenceKV
from kvrag.kernels.triton_mode import interpreting
from kvrag.model.config import ModelConfig, RopeScaling
from kvrag.model.transformer import Transformer

BLOCK = 16  # the engine's block size (engine/kv_pool.py)


def smollm2_config() -> ModelConfig:
    """SmolLM2-135M-Instruct's shape, written out (nothing downloaded)."""
    return replace(llama8b_config(), vocab_size=49152, hidden_size=576, intermediate_size=1536, n_layers=30,
                   n_heads=9, n_kv_heads=3, head_dim=64, rope_theta=100000.0, rope_scaling=RopeScaling(),
                   tie_embeddings=True, max_positions=8192)


def decode_graph_case(device: str | torch.device, batch: int, ctx: int, smoke: bool = False,
                      warmup: int = 5, reps: int = 50) -> dict:
    """One decode step of `batch` sequences of `ctx` tokens, eager vs replayed (see the module doc)."""
    device = torch.device(device)
    if device.type != "cuda" and not (smoke and interpreting()):
        raise ValueError("decode_graph_case runs on a CUDA device, or with smoke=True under TRITON_INTERPRET=1")
    cfg = replace(smoke_config(), max_positions=256) if smoke else smollm2_config()  # smoke: M_max 16 blocks
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = Transformer(cfg, RandomWeights(cfg, dtype, device), dtype, device)
    model.triton, model.native = True, False
    kv, tables = _pool(model, batch, ctx)
    eager = BatchDecoder(model, kv, cfg.max_positions, native=False)
    graphed = BatchDecoder(model, kv, cfg.max_positions, native=False, cuda_graphs=True, max_batch=batch)
    tokens = [1 + b for b in range(batch)]
    steps = {"eager": lambda: eager.step(tokens, tables), "graph": lambda: graphed.step(tokens, tables)}
    diff = float((steps["eager"]() - steps["graph"]()).abs().max())  # the graph's first step captures it
    if smoke:
        warmup, reps = 0, 1
    seconds = {name: median_seconds(step, device, warmup, reps) for name, step in steps.items()}
    counts = {name: count_launches(step) for name, step in steps.items()}
    g = graphed.graphs
    return {"case": "decode_graph", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "model": f"random {cfg.n_layers}x{cfg.hidden_size} ({dtype})".replace("torch.", ""), "batch": batch,
            "ctx": ctx, "bucket": g.bucket(batch), "max_blocks": g.max_blocks, "eager_ms": seconds["eager"] * 1e3,
            "graph_ms": seconds["graph"] * 1e3, "speedup": seconds["eager"] / seconds["graph"],
            "eager": counts["eager"], "graph": counts["graph"], "max_abs_diff": diff, "graph_stats": dict(g.stats)}


def _pool(model: Transformer, batch: int, ctx: int) -> tuple[SequenceKV, list]:
    """A pool with `batch` tables of ctx + 1 tokens (the last the step's new one) over random K/V, room for the
    widest table the model's context allows (the graphs' M_max, as in the engine) and the graphs' scratch block."""
    c = model.cfg
    per_block = BLOCK * c.n_layers * 2 * c.n_kv_heads * c.head_dim * model.dtype.itemsize
    blocks = max(batch * -(-(ctx + 1) // BLOCK), -(-c.max_positions // BLOCK)) + 2
    kv = SequenceKV(model, blocks * per_block, BLOCK)
    kv.pool.kv.normal_(0, 1, generator=torch.Generator(kv.pool.kv.device).manual_seed(0))
    tables = []
    for _ in range(batch):
        tables.append(kv.pool.allocate(ctx))
        kv.grow(tables[-1])
    return kv, tables
