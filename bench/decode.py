"""Decode speed against this machine's memory floor: `kvrag bench decode` (one stream, or a batch with --batches).

The floor: a decode step reads every weight and the whole KV cache once, so no step can beat
(bytes read per token) / (memory bandwidth), measured here as a large float32 sum's bytes read a second.

One stream: the reference step (decode_step_reference), the exact one-row step (decode_step, native=False) and the
native whole step (decode_step's default where it serves) decode the same tokens, interleaved round by round in
one process; medians, since the machine may be shared. Then, on invented items (tests/invented.py), how many
greedy answers the native step decodes token for token as the reference does.

A batch (the kernel alone; `kvrag bench engine` times the engine around it): B sequences of one context length
each own their blocks (scattered over a bf16 pool, as after churn) and take a few native batched steps
(BatchStep) together. A step reads every weight once for the whole batch plus every sequence's K/V; the table
gives each step's time over that floor and the aggregate tokens a second against B = 1's. The K/V are a repeated
random block, not a real prompt's: a step's work does not depend on the values, and a 6k prefill of 32
sequences would take the whole budget.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch

from kvrag.kernels import decode_step as native_decode
from kvrag.model.decode import decode_step, decode_step_reference
from kvrag.model.prefill import prefill
from kvrag.model.transformer import Transformer

STEPS = {
    "reference": decode_step_reference,
    "exact": lambda model, cache, token: decode_step(model, cache, token, native=False),
    "native": decode_step,
}


def read_bandwidth(mib: int = 512, repeats: int = 9) -> float:
    """Bytes a second the cores read from memory (a float32 sum over a buffer far larger than the caches), median
    of `repeats`. A decode step only reads; a copy's figure swung between 29 and 50 GB/s from run to run on this
    project's VM, the sum's stayed within a few percent."""
    src = torch.ones(mib * 2 ** 20 // 4)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        src.sum()
        times.append(time.perf_counter() - start)
    return src.numel() * 4 / statistics.median(times)


def resident_bytes(model: Transformer) -> int:
    """The model's weights in memory: the embedding table, every layer's tensors, the LM head (once, if tied)."""
    head = 0 if model.lm_head is model.embed_tokens else model.lm_head.nbytes
    layers = sum(t.nbytes for layer in model.layers for t in vars(layer).values() if t is not None)
    return model.embed_tokens.nbytes + model.final_norm.nbytes + head + layers


def bytes_per_token(model: Transformer, context: int) -> int:
    """Weights read by one step (every layer's matrices and norms, the LM head, one embedding row) plus the KV
    cache's keys and values over `context` positions."""
    weights = sum(t.nbytes for layer in model.layers for t in vars(layer).values() if t is not None)
    head = model.lm_head.nbytes + model.final_norm.nbytes  # (a quantized head's packed bytes)
    c = model.cfg
    kv = 2 * c.n_layers * context * c.n_kv_heads * c.head_dim * model.embed_tokens.element_size()
    return weights + head + model.embed_tokens[0].numel() * model.embed_tokens.element_size() + kv


def tokens_per_s(model: Transformer, prompt: int, steps: int, rounds: int) -> dict[str, float]:
    """Median tokens a second of each step over `steps` tokens after a `prompt`-token prefill, interleaved, and the
    prefill's own tokens a second (one run: "prefill")."""
    ids = torch.randint(0, model.cfg.vocab_size, (prompt,), generator=torch.Generator().manual_seed(prompt))
    start = time.perf_counter()
    _, cache = prefill(model, ids, extra=steps)
    prefill_s = time.perf_counter() - start
    feed = torch.randint(0, model.cfg.vocab_size, (steps,), generator=torch.Generator().manual_seed(1)).tolist()
    times: dict[str, list[float]] = {name: [] for name in STEPS}
    for _ in range(rounds):
        for name, step in STEPS.items():
            cache.length = prompt  # the same rows rewritten: every step does the same work
            step(model, cache, feed[0])  # warm (the one-row steps make their buffers here)
            start = time.perf_counter()
            for token in feed[1:]:
                step(model, cache, token)
            times[name].append((steps - 1) / (time.perf_counter() - start))
            cache.length = prompt
    return {name: statistics.median(v) for name, v in times.items()} | {"prefill": prompt / prefill_s}


def native_call_ms(model: Transformer, prompt: int, steps: int) -> float | None:
    """Median milliseconds of the native call alone (every layer and the LM head), without the step's torch
    work around it (embedding row, float32 rescoring): the rest of a native step is that overhead. None where the
    whole native step does not serve (torch steps)."""
    ids = torch.randint(0, model.cfg.vocab_size, (prompt,), generator=torch.Generator().manual_seed(prompt))
    _, cache = prefill(model, ids, extra=1)
    decode_step(model, cache, 0)
    step, out = cache.stepper, torch.empty(model.lm_head.shape[0])
    if step.whole is None:
        return None
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step.whole(prompt, step.h[0], out, torch.get_num_threads())
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def greedy(model: Transformer, step, ids: list[int], n: int) -> list[int]:
    logits, cache = prefill(model, torch.tensor(ids), extra=n)
    tokens = [int(logits.argmax())]
    while len(tokens) < n:
        tokens.append(int(step(model, cache, tokens[-1]).argmax()))
    return tokens


def agreement(model: Transformer, tokenizer, n_items: int, n_tokens: int) -> tuple[int, int]:
    """(identical, items): invented items whose `n_tokens` greedy answer tokens (question over its first two
    passages) the native step decodes exactly as the reference does."""
    from kvrag.bench.invented import invented_items
    from kvrag.model.prompt import PromptBuilder

    builder, same = PromptBuilder(tokenizer), 0
    items = invented_items(n_items, seed=1)
    for item in items:
        passages = [builder.passage_ids(c["title"], c["text"]) for c in item["ctxs"][:2]]
        ids = builder.build(passages, item["question"]).flat()
        same += greedy(model, decode_step, ids, n_tokens) == greedy(model, decode_step_reference, ids, n_tokens)
    return same, len(items)


def single_stream(model: Transformer, tokenizer, prompts: list[int], steps: int, rounds: int, items: int,
                  answer_tokens: int, out: Callable[[str], None] = print) -> None:
    """The one-stream table: each step's tokens/s against the floor at each prompt length, the native call's
    share of a native step, then the greedy agreement on `items` invented items (0: none)."""
    bandwidth = read_bandwidth()
    out(f"read bandwidth {bandwidth / 1e9:.1f} GB/s, torch threads {torch.get_num_threads()}")
    out(f"{'prompt':>6} {'MB/token':>8} {'floor':>6} " + " ".join(f"{n:>14}" for n in STEPS)
        + "   tokens/s (floor / speed)")
    with torch.inference_mode():
        for prompt in prompts:
            floor = bandwidth / bytes_per_token(model, prompt)
            speed = tokens_per_s(model, prompt, steps, rounds)
            cells = " ".join(f"{speed[n]:7.1f} ({floor / speed[n]:4.1f}x)" for n in STEPS)
            out(f"{prompt:>6} {bytes_per_token(model, prompt) / 1e6:8.1f} {floor:6.1f} {cells}   "
                f"(prefill {speed['prefill']:.1f} tokens/s, load {os.getloadavg()[0]:.2f})")
            call = native_call_ms(model, prompt, 3 * steps)
            if call is not None:
                out(f"{'':>6} native step {1e3 / speed['native']:.2f} ms: the native call {call:.2f} ms "
                    f"({bytes_per_token(model, prompt) / call / 1e6:.1f} GB/s), torch around it "
                    f"{1e3 / speed['native'] - call:.2f} ms")
        if items:
            same, n = agreement(model, tokenizer, items, answer_tokens)
            out(f"greedy answers of {answer_tokens} tokens identical to the reference's: {same} of {n} "
                "invented items")


# --- a batch: the native batched step alone ------------------------------------------------------------------

BLOCK_SIZE = 16


def scattered_pool(model: Transformer, n_blocks: int, seed: int = 0) -> torch.Tensor:
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


def step_seconds(model: Transformer, step: native_decode.BatchStep, tables: torch.Tensor, context: int, steps: int,
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


def floor_bytes(model: Transformer, n_seqs: int, context: int) -> int:
    """Bytes one step must read: the weights once, and each sequence's K/V over `context` positions."""
    weights = bytes_per_token(model, 0)
    return weights + n_seqs * (bytes_per_token(model, context) - weights)


@torch.inference_mode()
def batched(model: Transformer, contexts: list[int], batches: list[int], steps: int, n_threads: int,
            out: Callable[[str], None] = print) -> None:
    """The batch table: each (context, B) step's time, aggregate tokens/s, and its ratio to the floor."""
    bandwidth = read_bandwidth()
    out(f"read bandwidth {bandwidth / 1e9:.1f} GB/s, {n_threads} threads, block size {BLOCK_SIZE}")
    most = max(contexts) + steps + 1
    n_blocks = max(batches) * -(-most // BLOCK_SIZE)
    kv = scattered_pool(model, n_blocks)
    step = native_decode.BatchStep(model.step_weights(), kv, *model.positions_cos_sin(torch.arange(most)))
    out(f"{'context':>7} {'B':>3} {'step ms':>8} {'tokens/s':>9} {'vs B=1':>7} {'MB read':>8} {'floor ms':>8} "
        f"{'/ floor':>7}")
    for context in contexts:
        single = None
        for n in batches:
            seconds = step_seconds(model, step, tables_for(n, most, n_blocks, seed=n), context, steps, n_threads)
            rate = n / seconds
            single = single or (rate if n == 1 else None)
            floor = floor_bytes(model, n, context) / bandwidth
            ratio = f"{rate / single:6.1f}x" if single else f"{'-':>7}"
            out(f"{context:>7} {n:>3} {1e3 * seconds:8.1f} {rate:9.1f} {ratio} "
                f"{floor_bytes(model, n, context) / 1e6:8.1f} {1e3 * floor:8.1f} {seconds / floor:6.2f}x")
