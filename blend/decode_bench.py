"""Single-stream decode speed against this machine's memory floor: `python -m kvrag.blend.decode_bench`.

The floor: a decode step reads every weight and the whole KV cache once, so no step can beat
(bytes read per token) / (memory bandwidth), measured here as a large float32 sum's bytes read a second.
The reference step (decode_step_reference), the exact one-row step (decode_step, native=False) and the native
whole step (decode_step's default where it serves) decode the same tokens, interleaved round by round in one
process; medians, since the machine may be shared. Then, on invented items (tests/invented.py), how many
greedy answers the native step decodes token for token as the reference does.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from kvrag import KvragError
from kvrag.blend.decode import decode_step, decode_step_reference, prefill
from kvrag.blend.model import Transformer

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


def bytes_per_token(model: Transformer, context: int) -> int:
    """Weights read by one step (every layer's matrices and norms, the LM head, one embedding row) plus the KV
    cache's keys and values over `context` positions."""
    weights = sum(t.numel() * t.element_size() for layer in model.layers for t in vars(layer).values()
                  if t is not None)
    head = model.lm_head.numel() * model.lm_head.element_size() + model.final_norm.numel() * 2
    c = model.cfg
    kv = 2 * c.n_layers * context * c.n_kv_heads * c.head_dim * model.embed_tokens.element_size()
    return weights + head + model.embed_tokens[0].numel() * model.embed_tokens.element_size() + kv


def tokens_per_s(model: Transformer, prompt: int, steps: int, rounds: int) -> dict[str, float]:
    """Median tokens a second of each step over `steps` tokens after a `prompt`-token prefill, interleaved."""
    ids = torch.randint(0, model.cfg.vocab_size, (prompt,), generator=torch.Generator().manual_seed(prompt))
    _, cache = prefill(model, ids, extra=steps)
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
    return {name: statistics.median(v) for name, v in times.items()}


def native_call_ms(model: Transformer, prompt: int, steps: int) -> float:
    """Median milliseconds of the native call alone (every layer and the LM head), without the step's torch
    work around it (embedding row, float32 rescoring): the rest of a native step is that overhead."""
    ids = torch.randint(0, model.cfg.vocab_size, (prompt,), generator=torch.Generator().manual_seed(prompt))
    _, cache = prefill(model, ids, extra=1)
    decode_step(model, cache, 0)
    step, out = cache.stepper, torch.empty(model.lm_head.shape[0])
    if step.whole is None:
        return float("nan")
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
    from kvrag.blend.prompt import PromptBuilder
    from kvrag.tests.invented import invented_items

    builder, same = PromptBuilder(tokenizer), 0
    items = invented_items(n_items, seed=1)
    for item in items:
        passages = [builder.passage_ids(c["title"], c["text"]) for c in item["ctxs"][:2]]
        ids = builder.build(passages, item["question"]).flat()
        same += greedy(model, decode_step, ids, n_tokens) == greedy(model, decode_step_reference, ids, n_tokens)
    return same, len(items)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="300,2000", help="prompt lengths, comma-separated")
    parser.add_argument("--steps", type=int, default=32, help="tokens decoded a round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", default=None)
    parser.add_argument("--items", type=int, default=10, help="invented items for the greedy agreement (0: none)")
    parser.add_argument("--answer-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    try:
        prompts = [int(p) for p in args.prompts.split(",")]
        from kvrag.blend.model_files import resolve_model

        local = resolve_model(args.model)
        tokenizer = local.load_tokenizer()
        model = Transformer.from_safetensors(local.config, local.weight_files(), torch.bfloat16)
    except (KvragError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    bandwidth = read_bandwidth()
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s, torch threads {torch.get_num_threads()}")
    print(f"{'prompt':>6} {'MB/token':>8} {'floor':>6} " + " ".join(f"{n:>14}" for n in STEPS)
          + "   tokens/s (floor / speed)")
    with torch.inference_mode():
        for prompt in prompts:
            floor = bandwidth / bytes_per_token(model, prompt)
            speed = tokens_per_s(model, prompt, args.steps, args.rounds)
            cells = " ".join(f"{speed[n]:7.1f} ({floor / speed[n]:4.1f}x)" for n in STEPS)
            print(f"{prompt:>6} {bytes_per_token(model, prompt) / 1e6:8.1f} {floor:6.1f} {cells}")
            call = native_call_ms(model, prompt, 3 * args.steps)
            print(f"{'':>6} native step {1e3 / speed['native']:.2f} ms: the native call {call:.2f} ms "
                  f"({bytes_per_token(model, prompt) / call / 1e6:.1f} GB/s), torch around it "
                  f"{1e3 / speed['native'] - call:.2f} ms")
        if args.items:
            same, items = agreement(model, tokenizer, args.items, args.answer_tokens)
            print(f"greedy answers of {args.answer_tokens} tokens identical to the reference's: {same} of {items} "
                  "invented items")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
