"""A decode-time KV budget: Keyformer's eviction (Adnan et al., MLSys '24) while a sequence generates.

Past its budget a sequence keeps, in every layer and KV head, the preamble's rows (shared, and the attention
sinks), its most recent rows (`recent` of the budget) and the best-scoring of the rest; the others' KV is dropped
and their blocks freed. Keyformer's code (d-matrix-ai/keyformer-llm, models/keyformer-lib/attention.py) keeps a
score and a kept set per layer and per head; so does `BudgetRule.per_head`. Each head's kept rows are compacted
into the sequence's slots in their own order: attention reads every kept key once, so a head's slot j may hold a
different token than its neighbour's (keys are stored rotated, so a row needs no position).

A rule is a name and modifiers, "keyformer", "h2o", "window" or e.g. "keyformer:pooled+prompt" (`parse_rule`):

    keyformer  the Gumbel-regularised softmax((logits + g) / tau), accumulated over the queries that see a row
    h2o        the plain softmax (Zhang et al., NeurIPS '23), accumulated the same way
    window     no score: the preamble and the most recent rows (StreamingLLM)
    pooled     one kept set for the whole sequence, scores summed over layers and heads (kvrag before issue 41)
    prompt     at prefill every query the prefill computes scores the rows (Keyformer's code); by default only the
               question's do (SnapKV's observation window: a RAG prompt's question is what the answer reads for)
    tau=answer the temperature rises 1 -> 2 over max_tokens (the paper's text); by default 1 + 0.01 a step (its code)
    recent=R   the recent window's share of the budget (0.3: Keyformer's code's default)
    pool=K     rank rows by the max of their scores over K neighbours (SnapKV's clustering: keeps phrases whole)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from kvrag.errors import KvragError
from kvrag.model.step import attention_logits
from kvrag.precompute.keyformer import RECENT_SHARE, gumbel_softmax

TAU_STEP = 0.01  # Keyformer's code: tau = tau_init + itr_count * tau_delta, tau_init 1, tau_delta 0.01


@dataclass(frozen=True)
class BudgetRule:
    """How a budgeted sequence scores its rows and which it keeps (see the module's docstring)."""

    score: str  # "gumbel", "softmax" or "none"
    per_head: bool = True
    observe: str = "question"  # "question" or "prompt"
    tau: str = "step"  # "step" or "answer"
    recent: float = RECENT_SHARE
    pool: int = 1

    def temperature(self, step: int, max_tokens: int) -> float:
        """tau at the step-th generated token (the prompt is step 0)."""
        if self.tau == "answer":
            return 1.0 + step / max(1, max_tokens)
        return 1.0 + TAU_STEP * step


RULES = {"keyformer": BudgetRule("gumbel"), "h2o": BudgetRule("softmax"), "window": BudgetRule("none", recent=1.0)}


def parse_rule(spec: str) -> BudgetRule:
    """A rule from "name[:modifier+...]" (module docstring); KvragError naming what is wrong."""
    name, _, mods = spec.partition(":")
    if name not in RULES:
        raise KvragError(f"unknown KV budget rule {name!r} (choose {', '.join(RULES)})")
    rule = RULES[name]
    for mod in filter(None, mods.split("+")):
        key, _, value = mod.partition("=")
        if mod == "pooled":
            rule = replace(rule, per_head=False)
        elif mod == "prompt":
            rule = replace(rule, observe="prompt")
        elif key == "tau" and value in ("step", "answer"):
            rule = replace(rule, tau=value)
        elif key == "recent" and _share(value) is not None:
            rule = replace(rule, recent=_share(value))
        elif key == "pool" and value.isdigit() and int(value) % 2 == 1:
            rule = replace(rule, pool=int(value))
        else:
            raise KvragError(f"bad KV budget rule modifier {mod!r} in {spec!r} (pooled, prompt, tau=step|answer, "
                             "recent=0..1, pool=odd K)")
    return rule


def _share(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0 <= value <= 1 else None


class AttentionScore:
    """A budgeted sequence's row scores [L, Hkv, S] (one per layer, KV head and row), accumulated as queries attend:
    the prompt's observed queries at prefill (tau 1), then each generated token as it decodes (`advance` sets tau).
    A KV head's score sums its query heads' (GQA). The engine's layer steps call it (`model/step.py`'s tap)."""

    def __init__(self, rule: BudgetRule, n_layers: int, n_kv_heads: int, from_position: int,
                 device: torch.device | str = "cpu", seed: int = 0):
        self.rule, self.from_position, self.tau = rule, from_position, 1.0
        self.scores = torch.zeros(n_layers, n_kv_heads, 0, device=device)  # [L, Hkv, S] float32
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, layer: int, q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor,
                 k_pos: torch.Tensor | None) -> None:
        """Layer `layer`'s queries q [R, Hq, hd] at q_pos [R] over its rotated keys k [S, Hkv, hd] at k_pos [S]
        (None: every key visible)."""
        observed = q_pos >= self.from_position  # [R]
        if self.rule.score == "none" or not bool(observed.any()):
            return
        q_pos = q_pos[observed]
        k_pos = torch.zeros(k.shape[0], dtype=q_pos.dtype, device=q_pos.device) if k_pos is None else k_pos
        logits = attention_logits(q[observed], k, q_pos, k_pos.to(q_pos.device), exact=False)  # [Hkv, g, R, S]
        if self.rule.score == "gumbel":
            probs = gumbel_softmax(logits, self.tau, self.generator)
        else:
            probs = logits.softmax(-1)
        added = probs.sum(dim=(1, 2))  # [Hkv, S]
        self._grow(added.shape[1])
        self.scores[layer, :, :added.shape[1]] += added

    def advance(self, step: int, max_tokens: int) -> None:
        """Before the step-th generated token's decode: its temperature."""
        self.tau = self.rule.temperature(step, max_tokens)

    def budget_rows(self, n_rows: int, budget: int, protected: int) -> torch.Tensor:
        """The rows of the first n_rows each layer and KV head keeps under `budget`: [L, Hkv, min(n_rows, budget)]."""
        self._grow(n_rows)
        scores = self.scores[:, :, :n_rows]
        if self.rule.pool > 1:  # [L * Hkv, 1, S] pooled along the rows, same length
            k = self.rule.pool
            scores = F.max_pool1d(scores.reshape(-1, 1, n_rows), k, 1, k // 2).view(scores.shape)
        if not self.rule.per_head:
            pooled = budget_rows(scores.sum(dim=(0, 1)), budget, protected, self.rule.recent)  # [m]
            return pooled.expand(*scores.shape[:2], -1)
        return budget_rows(scores, budget, protected, self.rule.recent)

    def keep(self, rows: torch.Tensor) -> None:
        """Only these rows [L, Hkv, m] stay (as `budget_rows` chose them): their scores, in order."""
        self._grow(int(rows.max()) + 1 if rows.numel() else 0)
        self.scores = self.scores.gather(-1, rows.to(self.scores.device))

    def _grow(self, n_rows: int) -> None:
        """Room for n_rows: 0 for rows no query has seen yet."""
        have = self.scores.shape[-1]
        if have < n_rows:
            self.scores = torch.cat([self.scores, self.scores.new_zeros(*self.scores.shape[:2], n_rows - have)], -1)


def budget_rows(scores: torch.Tensor, budget: int, protected: int, recent: float = RECENT_SHARE) -> torch.Tensor:
    """The rows a sequence keeps when its KV is cut to `budget` rows: the first `protected` (the preamble, shared
    by every sequence and the attention sinks), the most recent round(recent * budget), and the best-scoring of
    the rest, per leading index. scores [..., S] -> kept row indices [..., min(S, budget)], ascending."""
    n = scores.shape[-1]
    lead = scores.shape[:-1]
    if n <= budget:
        return torch.arange(n, device=scores.device).expand(*lead, n)
    if budget <= protected:
        raise KvragError(f"a KV budget of {budget} tokens does not exceed the {protected} tokens of the preamble")
    n_recent = min(budget - protected, round(recent * budget))
    top = scores[..., protected:n - n_recent].topk(budget - protected - n_recent, dim=-1).indices + protected
    fixed = torch.cat([torch.arange(protected, device=scores.device), torch.arange(n - n_recent, n, device=scores.device)])
    rows = torch.cat([fixed.expand(*lead, -1), top], dim=-1)
    return rows.sort(dim=-1).values
