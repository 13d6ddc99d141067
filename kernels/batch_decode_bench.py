"""Batched decode speed against this machine's memory floor: `python -m kvrag.kernels.batch_decode_bench`.

B sequences of one context length each own their blocks (scattered over a bf16 pool, as after churn) and take
a few native batched steps (BatchStep) together. A step reads every weight once for the whole batch plus every
sequence's K/V, so none can beat (weights + B x KV bytes) / (memory read bandwidth); the table gives each
step's time over that floor and the aggregate tokens a second against B = 1's. The K/V are a repeated random
block, not a real prompt's: a step's work does not depend on the values, and a 6k prefill of 32 sequences
would take this bench's whole budget.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from kvrag import KvragError
from kvrag.kernels import decode as native_decode

BLOCK_SIZE = 16


def _ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",")]
    if not values or min(values) < 1:
        raise ValueError(f"expected positive integers, got {text!r}")
    return values


def scattered_pool(model, n_blocks: int, seed: int = 0) -> torch.Tensor:
    """A bf16 pool kv [L, 2, N, BLOCK_SIZE, Hkv, hd], every block the same random values (unit-scale)."""
    c = model.cfg
    block = torch.randn(BLOCK_SIZE, c.n_kv_heads, c.head_dim, generator=torch.Generator().manual_seed(seed))
    kv = torch.empty(c.n_layers, 2, n_blocks, BLOCK_SIZE, c.n_kv_heads, c.head_dim, dtype=torch.bfloat16)
    kv.copy_(block.bfloat16().expand_as(kv))
    return kv


def tables_for(n_seqs: int, tokens: int, n_blocks: int, seed: int = 0) -> torch.Tensor:
    """[B, M] int64: each sequence's own `tokens` worth of blocks, drawn in a random order from the pool."""
    per_seq = -(-tokens // BLOCK_SIZE)
    order = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed))[:n_seqs * per_seq]
    return order.view(n_seqs, per_seq).contiguous()


def step_seconds(model, step: native_decode.BatchStep, tables: torch.Tensor, context: int, steps: int,
                 n_threads: int) -> float:
    """Median seconds of one batched step of tables' B sequences, `steps` steps from position `context` on
    (one untimed first)."""
    n = tables.shape[0]
    tokens = torch.randint(0, model.cfg.vocab_size, (steps + 1, n), generator=torch.Generator().manual_seed(n))
    logits = torch.empty(n, model.lm_head.shape[0])  # [B, V]
    times = []
    for j in range(steps + 1):
        h = model.embed_tokens[tokens[j]].contiguous()  # [B, D]
        positions = torch.full((n,), context + j, dtype=torch.int64)  # [B]
        start = time.perf_counter()
        step(positions, tables, h, logits, n_threads)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def floor_bytes(model, n_seqs: int, context: int) -> int:
    """Bytes one step must read: the weights once, and each sequence's K/V over `context` positions."""
    from kvrag.blend.decode_bench import bytes_per_token

    weights = bytes_per_token(model, 0)
    return weights + n_seqs * (bytes_per_token(model, context) - weights)


def run(model, contexts: list[int], batches: list[int], steps: int, n_threads: int, bandwidth: float) -> None:
    most = max(contexts) + steps + 1
    n_blocks = max(batches) * -(-most // BLOCK_SIZE)
    kv = scattered_pool(model, n_blocks)
    step = native_decode.BatchStep(model, kv, *model.positions_cos_sin(torch.arange(most)))
    print(f"{'context':>7} {'B':>3} {'step ms':>8} {'tokens/s':>9} {'vs B=1':>7} {'MB read':>8} {'floor ms':>8} "
          f"{'/ floor':>7}")
    for context in contexts:
        single = None
        for n in batches:
            seconds = step_seconds(model, step, tables_for(n, most, n_blocks, seed=n), context, steps, n_threads)
            rate = n / seconds
            single = single or (rate if n == 1 else None)
            floor = floor_bytes(model, n, context) / bandwidth
            ratio = f"{rate / single:6.1f}x" if single else f"{'-':>7}"
            print(f"{context:>7} {n:>3} {1e3 * seconds:8.1f} {rate:9.1f} {ratio} "
                  f"{floor_bytes(model, n, context) / 1e6:8.1f} {1e3 * floor:8.1f} {seconds / floor:6.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="1024,6144", help="context lengths, comma-separated")
    parser.add_argument("--batches", default="1,4,16,32", help="batch sizes, comma-separated (1 first: the base)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps a point (after one untimed)")
    parser.add_argument("--threads", type=int, default=None, help="threads a step (default: torch's count)")
    parser.add_argument("--model", default=None)
    args = parser.parse_args(argv)
    try:
        contexts, batches = _ints(args.contexts), _ints(args.batches)
        if args.steps < 1 or (args.threads is not None and args.threads < 1):
            raise ValueError("--steps and --threads must be positive")
        from kvrag.blend.model import Transformer
        from kvrag.blend.model_files import resolve_model

        local = resolve_model(args.model)
        model = Transformer.from_safetensors(local.config, local.weight_files(), torch.bfloat16)
    except (KvragError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not native_decode.step_serves(model):
        print("error: the native batched step does not serve this model or CPU (needs AVX-512 and a bf16 model)",
              file=sys.stderr)
        return 1
    from kvrag.blend.decode_bench import read_bandwidth

    bandwidth, threads = read_bandwidth(), args.threads or torch.get_num_threads()
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s, {threads} threads, block size {BLOCK_SIZE}")
    with torch.inference_mode():
        run(model, contexts, batches, args.steps, threads, bandwidth)
    return 0


if __name__ == "__main__":
    sys.exit(main())
