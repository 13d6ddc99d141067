"""Which chunk rows a blend recomputes: at each check layer a selection rule scores every ranked chunk row, and the
best-scoring rows (as many as the ratio allows) are recomputed from there on.

A rule is one function of what the check layer knows (`Check`) and the blend's settings, returning one score per
row (higher: recompute sooner; inf: always). A new rule is one function and one line in SELECTION_RULES; BlendConfig's
`selection` names the rule a blend uses (`chunks` by default), and the rules in PREVIEW_RULES get the preview's
reading of each row as `Check.prior` (blend/preview.py). docs/performance.md compares them (issue 49).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch


class RuleSettings(Protocol):
    """What a rule reads of the blend's settings: blend/config.py's BlendConfig, which imports this module to check
    its `selection` by name (so the rules cannot import it back)."""

    deviation: str
    attention_weight: float
    rule: str
    chunk_start_rows: int


@dataclass(frozen=True)
class Check:
    """The ranked chunk rows at a check layer."""

    fresh: tuple[torch.Tensor, torch.Tensor]  # (k, v) [R, Hkv, hd] computed at this layer, keys in loaded's frame
    loaded: tuple[torch.Tensor, torch.Tensor]  # (k, v) [R, Hkv, hd] as loaded from the store
    q_suffix: torch.Tensor  # [S, Hq, hd] the question suffix's queries, rotated
    k_rotated: torch.Tensor  # [R, Hkv, hd] the rows' keys rotated to their positions
    rows: torch.Tensor  # [R] the rows' indices among the chunk tokens
    chunk_starts: torch.Tensor | None  # [K] where each chunk begins among the chunk tokens
    group: int  # query heads per KV head
    prior: torch.Tensor | None = None  # [R] the preview's reading of the rows over every layer (blend/preview.py)


def cacheblend(check: Check, config: RuleSettings) -> torch.Tensor:
    """CacheBlend's rule: how far the loaded K/V is from the fresh (`config.deviation`), weighted by how much the
    question reads the row (`config.attention_weight`; 0: deviation alone)."""
    score = deviation(config.deviation, *check.fresh, *check.loaded)
    if config.attention_weight > 0 and check.q_suffix.shape[0] > 0:
        score = weigh_by_reading(score, suffix_attention(check.q_suffix, check.k_rotated, check.group),
                                 config.attention_weight)
    return score


def reading(check: Check, config: RuleSettings) -> torch.Tensor:
    """Query-driven (ProphetKV, A3): the rows the question reads most at this layer, whatever their deviation."""
    if check.q_suffix.shape[0] == 0:
        return cacheblend(check, config)
    return suffix_attention(check.q_suffix, check.k_rotated, check.group)


def query(check: Check, config: RuleSettings) -> torch.Tensor:
    """ProphetKV: the rows the question reads most over every layer of the preview (full reuse's pass), whatever their
    deviation: the budget goes to what the answer is drawn from, not to rows that are only globally salient."""
    return check.prior if check.prior is not None else reading(check, config)


def query_deviation(check: Check, config: RuleSettings) -> torch.Tensor:
    """CacheBlend's rule with the preview's reading in place of the check layer's: deviation x (1 + attention_weight
    x reading / its mean)."""
    if check.prior is None:
        return cacheblend(check, config)
    dev = deviation(config.deviation, *check.fresh, *check.loaded)
    return weigh_by_reading(dev, check.prior, config.attention_weight)


def chunk_weight(check: Check) -> torch.Tensor:
    """Each row's chunk's share of the question's reading (the preview's where there is one, else the check layer's)
    over the mean chunk's: [R]. A3's question-to-chunk attention: the passages the question reads get the budget."""
    read = check.prior if check.prior is not None else suffix_attention(check.q_suffix, check.k_rotated, check.group)
    owner = chunk_owner(check.rows, check.chunk_starts)
    per_chunk = torch.zeros(int(owner.max()) + 1 if owner.numel() else 1, device=read.device).index_add_(0, owner, read)
    return per_chunk[owner] / per_chunk.mean().clamp_min(1e-12)


def chunks(check: Check, config: RuleSettings) -> torch.Tensor:
    """A3 with CacheBlend's deviation: within the chunks the question reads, the rows that deviate. deviation x
    chunk_weight; `chunks-preview` takes the reading from the preview instead of the check layer."""
    return deviation(config.deviation, *check.fresh, *check.loaded) * chunk_weight(check)


def chunks_weighted(check: Check, config: RuleSettings) -> torch.Tensor:
    """CacheBlend's score (deviation weighted by the question's reading of the row) x chunk_weight."""
    return cacheblend(check, config) * chunk_weight(check)


def chunk_starts_first(check: Check, config: RuleSettings) -> torch.Tensor:
    """EPIC: the first tokens of every chunk (its attention sink, where a chunk computed alone differs most), an
    equal number per chunk, whatever their deviation."""
    owner = chunk_owner(check.rows, check.chunk_starts)
    starts = check.chunk_starts if check.chunk_starts is not None else check.rows.new_zeros(1)
    return -(check.rows - starts[owner]).float()


SELECTION_RULES: dict[str, Callable[[Check, RuleSettings], torch.Tensor]] = {
    "cacheblend": cacheblend, "reading": reading, "query": query, "query-deviation": query_deviation,
    "chunks": chunks, "chunks-preview": chunks, "chunks-weighted": chunks_weighted, "epic": chunk_starts_first,
}
PREVIEW_RULES = frozenset({"query", "query-deviation", "chunks-preview"})  # rules that read blend/preview.py's prior


def score(check: Check, config: RuleSettings) -> torch.Tensor:
    """The configured rule's score [R], with the chunk starts `config.chunk_start_rows` forces in set to inf."""
    result = SELECTION_RULES[config.rule](check, config)
    if config.chunk_start_rows and check.chunk_starts is not None:
        forced = chunk_start_mask(check.rows, check.chunk_starts, config.chunk_start_rows)
        result = result.masked_fill(forced, math.inf)
    return result


def deviation(kind: str, fresh_k, fresh_v, loaded_k, loaded_v) -> torch.Tensor:
    """Per-row squared distance between fresh and loaded KV: [R]."""
    dev = torch.zeros(fresh_k.shape[0], device=fresh_k.device)
    if "k" in kind:  # pre-rotary keys: rotation is orthogonal, so the distance is the rotated one too
        dev += (fresh_k.float() - loaded_k.float()).pow(2).sum(dim=(1, 2))
    if "v" in kind:
        dev += (fresh_v.float() - loaded_v.float()).pow(2).sum(dim=(1, 2))
    return dev


def weigh_by_reading(dev: torch.Tensor, read: torch.Tensor, weight: float) -> torch.Tensor:
    """Each row's deviation [R] scaled by 1 + weight x read / mean(read), where read [R] is how much the suffix
    attends to the row. Relative to the mean, so only the ranking within a prompt counts."""
    return dev * (1 + weight * read / read.mean())


def suffix_attention(q_suffix: torch.Tensor, k_rows: torch.Tensor, group: int) -> torch.Tensor:
    """How much the suffix reads each row: the attention weight of the suffix queries q_suffix [S, Hq, hd] over the
    rotated keys k_rows [R, Hkv, hd], averaged over queries and heads: [R]."""
    s, _, hd = q_suffix.shape
    h_kv = k_rows.shape[1]
    qg = q_suffix.float().view(s, h_kv, group, hd).permute(1, 0, 2, 3).reshape(h_kv, s * group, hd)
    scores = torch.matmul(qg, k_rows.float().permute(1, 2, 0)) * hd ** -0.5  # [Hkv, S*g, R]
    return scores.softmax(-1).mean(dim=(0, 1))


def chunk_owner(rows: torch.Tensor, starts: torch.Tensor | None) -> torch.Tensor:
    """The chunk [R] each of `rows` (indices into the chunk tokens) belongs to, for chunks beginning at `starts` [K]
    (sorted; None: one chunk)."""
    if starts is None:
        return torch.zeros_like(rows)
    return (torch.searchsorted(starts, rows, right=True) - 1).clamp(min=0)


def chunk_start_mask(rows: torch.Tensor, starts: torch.Tensor, n_first: int) -> torch.Tensor:
    """Which chunk rows [R] (indices into the chunk tokens) lie among the first `n_first` of their chunk, for the
    chunks beginning at `starts` [K] (sorted): [R] bool."""
    owner = torch.searchsorted(starts, rows, right=True) - 1  # the chunk each row belongs to
    return (owner >= 0) & (rows - starts[owner.clamp(min=0)] < n_first)
