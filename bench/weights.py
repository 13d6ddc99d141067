"""`kvrag bench weights`: what weight-only quantization (model/quant.py) keeps of the dense model.

Per form (int8, int4) against the dense weights, each item's RAG prompt (its passages and question, in full):
- first-token KL(dense || quantized) and whether the first greedy token is the same;
- token agreement: along the dense model's greedy answer (teacher-forced), the share of its tokens the quantized
  model also picks greedily at that point;
- prefix agreement: the quantized model's own greedy answer, the share of the dense answer it matches before
  their first difference (fidelity.agreed_prefix), and the share of answers identical throughout.
Each model decodes as `ask` does (decode_step: the native whole step where it serves).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvrag.bench.fidelity import agreed_prefix
from kvrag.bench.rag.metrics import kl_divergence
from kvrag.model.decode import decode_step
from kvrag.model.prefill import prefill
from kvrag.model.transformer import Transformer


@dataclass
class Scores:
    first_kl: list[float] = field(default_factory=list)
    first_same: list[bool] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)  # teacher-forced token agreement per item
    prefix: list[float] = field(default_factory=list)
    identical: list[bool] = field(default_factory=list)

    def row(self) -> dict[str, float]:
        return {"first_kl": statistics.mean(self.first_kl), "first_top1": statistics.mean(self.first_same),
                "token_agreement": statistics.mean(self.tokens), "prefix_agreement": statistics.mean(self.prefix),
                "identical": statistics.mean(self.identical), "items": len(self.tokens)}


def greedy(model: Transformer, ids: list[int], n: int) -> tuple[torch.Tensor, list[int]]:
    """The first-token logits [V] and the `n`-token greedy answer."""
    logits, cache = prefill(model, torch.tensor(ids), extra=n)
    first, tokens = logits.clone(), [int(logits.argmax())]
    while len(tokens) < n:
        tokens.append(int(decode_step(model, cache, tokens[-1]).argmax()))
    return first, tokens


def forced(model: Transformer, ids: list[int], answer: list[int]) -> list[int]:
    """The greedy choice at each of the answer's positions, the answer itself fed as the history."""
    logits, cache = prefill(model, torch.tensor(ids), extra=len(answer))
    picks = [int(logits.argmax())]
    for token in answer[:-1]:
        picks.append(int(decode_step(model, cache, token).argmax()))
    return picks


@torch.inference_mode()
def compare(dense: Transformer, forms: dict[str, Transformer], prompts: list[list[int]], n: int,
            on_item: Callable[[int], None] | None = None) -> dict[str, Scores]:
    """Every form's scores against the dense model over `prompts` (token ids each), answers of `n` tokens."""
    scores = {name: Scores() for name in forms}
    for j, ids in enumerate(prompts):
        first, answer = greedy(dense, ids, n)
        for name, model in forms.items():
            s = scores[name]
            got_first, got = greedy(model, ids, n)
            s.first_kl.append(kl_divergence(first, got_first))
            s.first_same.append(int(got_first.argmax()) == answer[0])
            s.prefix.append(agreed_prefix(answer, got))
            s.identical.append(got == answer)
            picks = got if got == answer else forced(model, ids, answer)
            s.tokens.append(sum(a == b for a, b in zip(picks, answer, strict=True)) / n)
        if on_item is not None:
            on_item(j)
    return scores


def rag_prompts(runtime, items: list[dict], max_passages: int | None = None) -> list[list[int]]:
    """Each MuSiQue-format item's prompt: its passages (the first `max_passages`), then its question."""
    builder = runtime.prompts
    out = []
    for item in items:
        ctxs = item["ctxs"][:max_passages] if max_passages else item["ctxs"]
        passages = [builder.passage_ids(c.get("title", ""), c["text"]) for c in ctxs]
        out.append(builder.build(passages, item["question"]).flat())
    return out


def table(model: str, bits_bytes: dict[str, int], results: dict[str, dict[str, Scores]]) -> str:
    """A markdown table: a row per (prompt set, form)."""
    lines = [f"### {model}", "",
             "| prompts | weights | MB of matrices | first-token KL | first top-1 | token agreement | prefix agreement "
             "| identical answers | items |", "|---|---|---|---|---|---|---|---|---|"]
    for where, by_form in results.items():
        for name, s in by_form.items():
            r = s.row()
            lines.append(f"| {where} | {name} | {bits_bytes[name] / 1e6:.0f} | {r['first_kl']:.4f} | "
                         f"{r['first_top1']:.2f} | {r['token_agreement']:.3f} | {r['prefix_agreement']:.3f} | "
                         f"{r['identical']:.2f} | {r['items']} |")
    return "\n".join(lines)


def matrix_bytes(model: Transformer) -> int:
    """Bytes of every layer's matrices and the LM head: what a decode step reads beyond the norms."""
    from kvrag.kernels.decode_step import MATRICES

    return sum(getattr(layer, name).nbytes for layer in model.layers for name in MATRICES) + model.lm_head.nbytes
