"""Keyformer before loading exists: what `precompute --keep` saves, and how much of the question's attention it keeps.

For each item, every passage is scored as precompute scores it (after the preamble, its own queries, one forward for
all rules) and reduced at each keep; then the whole prompt is prefilled and the question's queries' attention is
read at every layer. Two figures per (rule, keep):

    bytes per token   the stored values (headers included) over the passages' tokens, fp16 and int8 (zstd)
    attention kept    of the attention the question pays the passages (summed over layers, mean over heads and
                      question tokens), the share that falls on kept tokens: an offline fidelity proxy (1 at keep 1)

Tuning items only (MuSiQue 0-49): the report split stays untouched until loading reduced chunks can be measured.
Run: kvrag bench keyformer --items 50 --json (bench/commands_systems.py; see docs/performance.md).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from kvrag.cli.common import load_runtime
from kvrag.model.prefill import LayerKV, extend
from kvrag.model.runtime import Runtime
from kvrag.model.step import GrowingKV, Rows, run_layers
from kvrag.precompute import keyformer
from kvrag.precompute.keyformer import KEEP_RULES, KeepConfig, LayerView, ScoringKV
from kvrag.precompute.plain import layers_to_numpy
from kvrag.store.chunks import chunk_id_for
from kvrag.store.codec import encode

KEEPS = (1.0, 0.7, 0.5, 0.3)
RULE_NAMES = tuple(KEEP_RULES)  # keyformer, h2o, window
CODECS = ("fp16", "int8")


class AllRulesKV(ScoringKV):
    """Scores a chunk under several rules in its one forward: per layer [n_rules, Hkv, T]."""

    def __init__(self, model, prefix, positions, cfgs: list[KeepConfig], generator):
        super().__init__(model, prefix, positions, cfgs[0], generator)
        self.cfgs = cfgs

    def score(self, view: LayerView) -> torch.Tensor:
        return torch.stack([KEEP_RULES[c.rule][0](view, c).float() for c in self.cfgs])


class QuestionAttentionKV(GrowingKV):
    """A plain prefill that records, per layer, the mean attention of the last `n_question` rows over every key."""

    def __init__(self, model, positions: torch.Tensor, n_question: int):
        super().__init__(model, None, positions)
        self.n_question = n_question
        self.attention: list[torch.Tensor] = []  # per layer [S]
        self.rows: Rows | None = None

    def place(self, layer: int, rows: Rows, k: torch.Tensor, v: torch.Tensor) -> None:
        super().place(layer, rows, k, v)
        self.rows = rows

    def attend(self, layer: int, q: torch.Tensor, rows: Rows) -> torch.Tensor:
        question = self.rows.take(slice(-self.n_question, None))
        q_question = self.model.queries(layer, self.model.attention_input(layer, question.h), question.rope)
        probs = LayerView(q_question, self.k_rot, question.pos, self.key_pos).logits().softmax(-1)  # [Hkv, g, Q, S]
        self.attention.append(probs.mean(dim=(0, 1, 2)))
        return super().attend(layer, q, rows)


def chunk_scores(runtime: Runtime, preamble: LayerKV, ids: list[int], chunk_id: str,
                 cfgs: list[KeepConfig]) -> tuple[LayerKV, torch.Tensor]:
    """A passage's KV and its scores under every rule of `cfgs`, as precompute computes them: [L, n_rules, Hkv, T]."""
    model = runtime.model
    start = int(preamble.positions[-1]) + 1
    rows = Rows.at(model, runtime.ids_tensor(ids), torch.arange(start, start + len(ids)))
    kv = AllRulesKV(model, preamble, rows.pos, cfgs, keyformer.chunk_generator(cfgs[0], chunk_id, model.device))
    run_layers(model, rows, kv)
    return LayerKV(kv.new_k, kv.new_v, rows.pos), torch.stack(kv.scores)


def question_attention(runtime: Runtime, flat: list[int], n_question: int) -> torch.Tensor:
    """The question's attention over the whole prompt, summed over layers: [S]."""
    rows = Rows.at(runtime.model, runtime.ids_tensor(flat), torch.arange(len(flat)))
    kv = QuestionAttentionKV(runtime.model, rows.pos, n_question)
    run_layers(runtime.model, rows, kv)
    return torch.stack(kv.attention).sum(0).float().cpu()


def reduced_chunk(runtime: Runtime, preamble: LayerKV, ids: list[int], chunk_id: str) -> dict:
    """One passage's kept positions per (rule, keep) and its stored bytes per (codec, keep) under Keyformer's set."""
    cfgs = [KeepConfig(0.5, rule) for rule in RULE_NAMES]
    kv, scores = chunk_scores(runtime, preamble, ids, chunk_id, cfgs)
    summed = scores.sum(dim=(0, 2))  # [n_rules, T]: one set per chunk, all layers and KV heads
    kept = {(rule, keep): keyformer.select(summed[r], keep).numpy() for r, rule in enumerate(RULE_NAMES)
            for keep in KEEPS}
    nbytes = {}
    for codec in CODECS:
        layers = layers_to_numpy(kv, codec)
        for keep in KEEPS:
            pos = kept["keyformer", keep] if keep < 1 else None
            reduced = layers if pos is None else keyformer.reduce_layers(layers, pos)
            nbytes[codec, keep] = sum(len(encode(k, v, codec, pos)) for k, v in reduced)
    return {"tokens": len(ids), "kept": kept, "bytes": nbytes}


def run(items: list[dict], model: str | None = None, dtype: str | None = None) -> dict:
    """Bytes per token and attention kept per (rule, keep), over `items` (MuSiQue format: question, ctxs)."""
    runtime = load_runtime(model, dtype)
    t0 = time.perf_counter()
    chunks: dict[str, dict] = {}  # passages recur across items: scored and encoded once
    shares: dict[tuple[str, float], list[float]] = {(r, k): [] for r in RULE_NAMES for k in KEEPS}
    with torch.inference_mode():
        _, preamble = extend(runtime.model, None, runtime.ids_tensor(runtime.prompts.preamble_ids))
        for item in items:
            passages = [runtime.prompts.passage_ids(c["title"], c["text"]) for c in item["ctxs"]]
            ids = [chunk_id_for(p, runtime.local.tokenizer_fingerprint) for p in passages]
            for cid, p in zip(ids, passages, strict=True):
                if cid not in chunks:
                    chunks[cid] = reduced_chunk(runtime, preamble, p, cid)
            prompt = runtime.prompts.build(passages, item["question"])
            mass = question_attention(runtime, prompt.flat(), len(prompt.suffix))  # [S]
            spans = prompt.passage_spans()
            total = sum(float(mass[a:b].sum()) for a, b in spans)
            for rule, keep in shares:
                kept = sum(float(mass[a + chunks[c]["kept"][rule, keep]].sum()) for c, (a, _) in zip(ids, spans,
                                                                                                   strict=True))
                shares[rule, keep].append(kept / total)
    tokens = sum(c["tokens"] for c in chunks.values())
    return {
        "items": len(items), "passages": len(chunks), "tokens": tokens, "wall_s": time.perf_counter() - t0,
        "bytes_per_token": {f"{codec}@{keep:g}": sum(c["bytes"][codec, keep] for c in chunks.values()) / tokens
                            for codec in CODECS for keep in KEEPS},
        "attention_kept": {f"{rule}@{keep:g}": float(np.mean(v)) for (rule, keep), v in shares.items()},
        "attention_kept_min": {f"{rule}@{keep:g}": float(np.min(v)) for (rule, keep), v in shares.items()},
    }


def markdown(result: dict) -> str:
    """The docs/performance.md table of a `run` result."""
    lines = ["| keep | fp16 B/token | int8 B/token | " + " | ".join(f"{r} attention kept" for r in RULE_NAMES) + " |",
             "|---|---|---|" + "---|" * len(RULE_NAMES)]
    for keep in KEEPS:
        b = result["bytes_per_token"]
        kept = " | ".join(f"{result['attention_kept'][f'{r}@{keep:g}']:.3f}" for r in RULE_NAMES)
        lines.append(f"| {keep:g} | {b[f'fp16@{keep:g}']:,.0f} | {b[f'int8@{keep:g}']:,.0f} | {kept} |")
    return "\n".join(lines)
