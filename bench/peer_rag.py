"""`kvrag bench peer`'s served RAG: MuSiQue report questions with their passages in the prompt, as a client that
retrieves for itself sends them, to llama-server and to `kvrag serve` alike.

kvrag's server runs over a store holding those passages' KV (`kvrag index` + `kvrag precompute`, as a user builds
one: bench/serve_store.py) and finds them inside the prompt (engine/prompt_reuse.py); llama-server gets the same text
with its prompt cache and `--cache-reuse` on. Each concurrency level sends its own items (a level never repeats an
earlier one's prompts, which either server's cache would answer at once), `concurrency` requests in flight until they
run out: requests a second over the level's span, the median and p90 client TTFT, and the answers right (F1 >= 0.5
against MuSiQue's gold answers) so that a faster side is seen not to answer worse.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvrag.bench.rag.metrics import best_f1, percentile
from kvrag.bench.serve_load import ask
from kvrag.errors import KvragError

INSTRUCTION = "Answer the question from the passages below, in a few words."
ANSWER_TOKENS = 16


@dataclass(frozen=True)
class RagPrompt:
    text: str  # the whole user message: instruction, passages, question
    answers: tuple[str, ...]


def trimmed(items: Sequence[dict], passages: int) -> list[dict]:
    """The items with their first `passages` passages only (what the prompts hold, and the store indexes)."""
    return [{**item, "ctxs": item["ctxs"][:passages]} for item in items]


def rag_prompts(items: Sequence[dict]) -> list[RagPrompt]:
    """Each item's passages as `kvrag index` renders them (the title's line, then the text), blank lines between."""
    out = []
    for item in items:
        body = "\n\n".join(f"{c['title'].strip()}\n{c['text'].strip()}" if c.get("title", "").strip()
                           else c["text"].strip() for c in item["ctxs"])
        out.append(RagPrompt(f"{INSTRUCTION}\n\n{body}\n\nQuestion: {item['question'].strip()}",
                             tuple(item.get("answers") or ())))
    return out


async def served_rag(api, model: str, prompts: Sequence[RagPrompt], concurrency: Sequence[int],
                     extra: dict) -> dict:
    """Per concurrency level, its share of the prompts (len(prompts) // len(concurrency) each, in order)."""
    share = len(prompts) // len(concurrency)
    if share < 1:
        raise KvragError(f"{len(prompts)} RAG prompts cannot give each of {len(concurrency)} levels its own")
    return {str(c): await _level(api, model, prompts[i * share:(i + 1) * share], c, extra)
            for i, c in enumerate(concurrency)}


async def _level(api, model: str, prompts: Sequence[RagPrompt], concurrency: int, extra: dict) -> dict:
    waiting, results = list(enumerate(prompts)), []

    async def client(slot: int) -> None:
        while waiting:
            index, prompt = waiting.pop(0)
            result = await ask(api, model, prompt.text, slot, extra, ANSWER_TOKENS)
            if not result.ok:
                raise KvragError(f"a RAG request failed: {result.error or 'no answer'}")
            results.append((index, result))

    start = time.perf_counter()
    await asyncio.gather(*(client(slot) for slot in range(concurrency)))
    span = time.perf_counter() - start
    ttft = [r.ttft_s for _, r in results]
    right = sum((best_f1(r.text.strip().split("\n")[0], prompts[i].answers) or 0.0) >= 0.5 for i, r in results)
    return {"requests": len(results), "seconds": round(span, 3), "requests_per_s": round(len(results) / span, 4),
            "ttft_p50_s": round(statistics.median(ttft), 4), "ttft_p90_s": round(percentile(ttft, 90), 4),
            "prompt_tokens_p50": statistics.median(r.prompt_tokens for _, r in results),
            "cached_tokens_p50": statistics.median(r.cached_tokens for _, r in results), "right": right}
