"""Keyformer (Adnan et al., MLSys '24): keep only a chunk's key tokens' KV, with their original positions.

At precompute, the chunk's own queries (its tokens after the preamble, causally) score its keys at every layer:

    keyformer  softmax((logits + gumbel) / tau), summed over the queries and query heads that see each key
    h2o        softmax(logits), the plain accumulated attention (Zhang et al., NeurIPS '23), no noise
    window     the first SINKS tokens and the most recent ones (StreamingLLM's sinks + window), no attention

and the chunk keeps a recent window plus its best-scoring tokens (`select`). A rule is one function of one
layer's attention (`LayerView`) returning a score per (KV head, chunk key); a new rule is one function and one
line in KEEP_RULES, which also names the settings that change its result (they go into the store variant).

The scores come from the chunk's own forward: `ScoringKV` is the GrowingKV target precompute uses, scoring each
layer as it attends, so the KV stored is bit-for-bit what a full precompute stores, subset aside.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from kvrag.errors import KvragError
from kvrag.model.prefill import LayerKV
from kvrag.model.step import GrowingKV, Rows, run_layers
from kvrag.model.transformer import Transformer
from kvrag.store.codec import DecodedKV

# The kept budget's split: Keyformer keeps a recent window w and the rest by score; the paper finds w at 20-30 %
# of the budget works best (Sec. 5.3, "recent window") and its code's default is 30 % (d-matrix-ai/keyformer-llm,
# `--recent 30` of `--kv_cache`): recent_tokens = int(budget * 0.30), key_tokens = budget - recent_tokens.
RECENT_SHARE = 0.3
TAU_PROMPT = 1.0  # the paper's tau_init: tau rises from 1 to 2 over a generation, and the prompt is step 0
SINKS = 4  # the window baseline's first tokens (StreamingLLM's four attention sinks)


@dataclass(frozen=True)
class KeepConfig:
    """What `precompute --keep` stores of each chunk."""

    keep: float = 1.0  # share of the chunk's tokens kept; 1: the full chunk
    rule: str = "keyformer"
    recent: float = RECENT_SHARE  # share of the kept budget given to the most recent tokens
    tau: float = TAU_PROMPT
    seed: int = 0  # Gumbel noise: with the chunk id, it fixes the draw (a store is reproducible)
    sinks: int = SINKS
    per_layer: bool = False  # one position set per layer (scores summed over KV heads) instead of one per chunk

    def __post_init__(self) -> None:
        if not 0 < self.keep <= 1:  # NaN fails too
            raise KvragError(f"--keep must be in (0, 1], got {self.keep}")
        check_rule(self.rule, "keep rule")
        if not 0 <= self.recent <= 1 or not self.tau > 0 or self.sinks < 0:
            raise KvragError(f"bad keep settings: recent {self.recent} (0..1), tau {self.tau} (> 0), "
                             f"sinks {self.sinks} (>= 0)")

    @property
    def reduced(self) -> bool:
        return self.keep < 1

    @property
    def variant(self) -> str:
        """The store variant of these settings ("" for full chunks): every setting that changes what is kept."""
        if not self.reduced:
            return ""
        parts = [self.rule, f"keep={self.keep:g}"] + [f"{name}={_text(getattr(self, name))}" for name in KEEP_RULES[self.rule][1]]
        return ":".join(parts + (["per-layer"] if self.per_layer else []))


def _text(value: float | int) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass
class LayerView:
    """One layer's attention of the chunk's queries over every key they see (the preamble's, then the chunk's)."""

    q: torch.Tensor  # [T, Hq, hd] the chunk's queries, rotated
    k: torch.Tensor  # [S, Hkv, hd] the keys, rotated; the last T are the chunk's
    q_pos: torch.Tensor  # [T]
    k_pos: torch.Tensor  # [S]
    generator: torch.Generator | None = None

    @property
    def n_chunk(self) -> int:
        return int(self.q.shape[0])

    def logits(self) -> torch.Tensor:
        """Scaled attention logits [Hkv, g, T, S] in float32, -inf where a key lies after the query."""
        t, hq, hd = self.q.shape
        h_kv = self.k.shape[1]
        q = self.q.float().view(t, h_kv, hq // h_kv, hd).permute(1, 2, 0, 3)  # [Hkv, g, T, hd]
        k = self.k.float().permute(1, 2, 0)  # [Hkv, hd, S]
        logits = torch.matmul(q, k.unsqueeze(1)) * hd ** -0.5  # [Hkv, g, T, S]
        hidden = self.k_pos[None, :] > self.q_pos[:, None]  # [T, S]
        return logits.masked_fill_(hidden, -math.inf)

    def accumulated(self, probs: torch.Tensor) -> torch.Tensor:
        """Attention probabilities [Hkv, g, T, S] summed over query heads and queries, chunk keys only: [Hkv, T]."""
        return probs.sum(dim=(1, 2))[:, -self.n_chunk:]


def gumbel_softmax(logits: torch.Tensor, tau: float, generator: torch.Generator | None) -> torch.Tensor:
    """softmax((logits + g) / tau) over the last dimension, g ~ Gumbel(0, 1) drawn per element as the paper's code
    (torch's gumbel_softmax) does."""
    noise = torch.empty(logits.shape, device=logits.device).exponential_(generator=generator)
    noise.log_().neg_()  # -log(Exp(1)) ~ Gumbel(0, 1)
    return ((logits + noise) / tau).softmax(-1)


def keyformer(view: LayerView, cfg: KeepConfig) -> torch.Tensor:
    """Keyformer's score: the Gumbel-regularised softmax of each (head, query, key), accumulated over queries:
    [Hkv, T]."""
    return view.accumulated(gumbel_softmax(view.logits(), cfg.tau, view.generator))


def h2o(view: LayerView, cfg: KeepConfig) -> torch.Tensor:
    """H2O's heavy hitters: the plain attention each key receives, accumulated over queries: [Hkv, T]."""
    return view.accumulated(view.logits().softmax(-1))


def window(view: LayerView, cfg: KeepConfig) -> torch.Tensor:
    """First `sinks` tokens, then the later the better: `select` then keeps the sinks and the most recent: [Hkv, T]."""
    score = torch.arange(view.n_chunk, dtype=torch.float32, device=view.q.device)  # [T]
    score[:cfg.sinks] = math.inf
    return score.expand(view.k.shape[1], -1)


Rule = Callable[[LayerView, KeepConfig], torch.Tensor]
# name -> (rule, the KeepConfig settings besides keep that change its result)
KEEP_RULES: dict[str, tuple[Rule, tuple[str, ...]]] = {
    "keyformer": (keyformer, ("recent", "tau", "seed")),
    "h2o": (h2o, ("recent",)),
    "window": (window, ("sinks",)),
}


def check_rule(rule: str, what: str) -> None:
    """KvragError unless `rule` names one of KEEP_RULES."""
    if rule not in KEEP_RULES:
        raise KvragError(f"unknown {what} {rule!r} (choose {', '.join(KEEP_RULES)})")


class ScoringKV(GrowingKV):
    """GrowingKV (a chunk after its prefix) that also scores the chunk's keys at every layer as it attends."""

    def __init__(self, model: Transformer, prefix, positions: torch.Tensor, cfg: KeepConfig,
                 generator: torch.Generator | None = None):
        super().__init__(model, prefix, positions)
        self.cfg, self.generator = cfg, generator
        self.scores: list[torch.Tensor] = []  # per layer [Hkv, T]
        self.rows: Rows | None = None  # this layer's rows, all of them, as placed

    def place(self, layer: int, rows: Rows, k: torch.Tensor, v: torch.Tensor) -> None:
        super().place(layer, rows, k, v)
        self.rows = rows

    def attend(self, layer: int, q: torch.Tensor, rows: Rows) -> torch.Tensor:
        full = self.rows
        q_all = q
        if q.shape[0] != len(full):  # the last layer reads one row on; scoring needs every query
            q_all = self.model.queries(layer, self.model.attention_input(layer, full.h), full.rope)
        self.scores.append(self.score(LayerView(q_all, self.k_rot, full.pos, self.key_pos, self.generator)))
        return super().attend(layer, q, rows)

    def score(self, view: LayerView) -> torch.Tensor:
        """One layer's scores [Hkv, T] (a benchmark overrides it to score several rules in one pass)."""
        return KEEP_RULES[self.cfg.rule][0](view, self.cfg).float()


def chunk_generator(cfg: KeepConfig, chunk_id: str, device: torch.device) -> torch.Generator:
    """The noise of one chunk, from (seed, chunk id) alone: a resumed or sharded precompute draws the same. It
    runs on the model's device, so a store is reproducible per seed and kind of device (CPU and CUDA differ)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(xxhash.xxh3_64_intdigest(f"{cfg.seed}:{chunk_id}".encode()) >> 1)
    return generator


def score_chunk(model: Transformer, prefix: LayerKV | None, ids: torch.Tensor, cfg: KeepConfig,
                generator: torch.Generator | None = None) -> tuple[LayerKV, torch.Tensor]:
    """Prefill ids [T] after `prefix` (as precompute.chunk_kv does): the chunk's LayerKV and its keys' scores
    [L, Hkv, T] under `cfg.rule`."""
    start = int(prefix.positions[-1]) + 1 if prefix is not None and len(prefix) else 0
    rows = Rows.at(model, ids, torch.arange(start, start + ids.shape[0]))
    kv = ScoringKV(model, prefix, rows.pos, cfg, generator)
    run_layers(model, rows, kv)
    return LayerKV(kv.new_k, kv.new_v, rows.pos), torch.stack(kv.scores)


def reduce_chunk(model: Transformer, prefix: LayerKV | None, ids: torch.Tensor, cfg: KeepConfig,
                 chunk_id: str) -> tuple[LayerKV, np.ndarray | list[np.ndarray]]:
    """A chunk's full LayerKV after `prefix` and the positions it keeps (`positions`), its noise drawn from
    (cfg.seed, chunk_id): what precompute stores and what a question computes for a chunk missing from the store."""
    kv, scores = score_chunk(model, prefix, ids, cfg, chunk_generator(cfg, chunk_id, model.device))
    return kv, positions(scores, cfg)


def narrow(kv: LayerKV, kept: np.ndarray) -> LayerKV:
    """kv's rows of the kept token indices [T_kept] (into its rows), at their own positions."""
    rows = torch.from_numpy(kept.astype(np.int64)).to(kv.positions.device)
    return LayerKV([k[rows] for k in kv.k], [v[rows] for v in kv.v], kv.positions[rows])


def kept_count(keep: float, n_tokens: int) -> int:
    """round(keep * T) tokens, at least one."""
    return max(1, min(n_tokens, round(keep * n_tokens)))


def select(scores: torch.Tensor, keep: float, recent: float = RECENT_SHARE) -> torch.Tensor:
    """Kept token indices, ascending: the recent window (round(recent * budget) last tokens) and the rest of the
    budget by score among the earlier tokens. scores [T] -> [round(keep * T)]."""
    n = scores.shape[-1]
    budget = kept_count(keep, n)
    n_recent = min(budget, round(recent * budget))
    top = scores[:n - n_recent].topk(budget - n_recent).indices
    kept = torch.cat([top.to(torch.long), torch.arange(n - n_recent, n, device=scores.device)])
    return kept.sort().values


def positions(scores: torch.Tensor, cfg: KeepConfig) -> np.ndarray | list[np.ndarray]:
    """Kept positions from per-layer scores [L, Hkv, T]: one int32 array [T_kept] for every layer (scores summed
    over layers and KV heads), or one per layer with `cfg.per_layer`."""
    if cfg.per_layer:
        return [select(s.sum(0), cfg.keep, cfg.recent).cpu().numpy().astype(np.int32) for s in scores]
    return select(scores.sum(dim=(0, 1)), cfg.keep, cfg.recent).cpu().numpy().astype(np.int32)


def reduce_layers(layers: Sequence[tuple[np.ndarray, np.ndarray]],
                  kept: np.ndarray | Sequence[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer (K, V) [T, Hkv, hd] narrowed to the kept rows: [T_kept, Hkv, hd] each."""
    per_layer = [kept] * len(layers) if isinstance(kept, np.ndarray) else list(kept)
    return [(np.ascontiguousarray(k[p]), np.ascontiguousarray(v[p]))
            for (k, v), p in zip(layers, per_layer, strict=True)]


def kept_layers(stored: Sequence[DecodedKV], device: torch.device | str = "cpu",
                dtype: torch.dtype | None = None) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A reduced chunk's stored layers (KVTable.get_layer of each) as (k [T_kept, Hkv, hd] before rotary,
    v [T_kept, Hkv, hd], positions [T_kept] token indices within the chunk, int64) per layer: what a loader needs
    to rotate each kept key to (chunk start + position) and leave the dropped tokens' places as gaps."""
    out = []
    for layer, value in enumerate(stored):
        if value.positions is None or value.positions.ndim != 1:
            raise ValueError(f"layer {layer}: not a reduced chunk with one position per kept token")
        k, v = (torch.from_numpy(np.ascontiguousarray(x)).to(device=device, dtype=dtype) for x in value)
        out.append((k, v, torch.from_numpy(value.positions.astype(np.int64)).to(device)))
    return out


# ---- a decode-time budget: Keyformer's eviction while a sequence generates ----------------------------------


class AttentionScore:
    """Keyformer's score of a sequence's KV rows, accumulated as queries attend to them: each observed query
    adds the Gumbel-regularised softmax of its logits over the rows it sees, summed over its heads, at every
    layer. The prompt's rows from `from_position` on (the question) observe at prefill, at tau 1; each generated
    token observes as it decodes, at the `tau` its engine sets (rising from 1 to 2 over the generation, as the
    paper's schedule does). rule "h2o" adds the plain softmax (no noise); "window" scores nothing (the budget then
    keeps the most recent rows, `recent`)."""

    def __init__(self, from_position: int, device: torch.device | str = "cpu", seed: int = 0,
                 rule: str = "keyformer"):
        check_rule(rule, "KV budget rule")
        self.from_position, self.tau, self.rule = from_position, TAU_PROMPT, rule
        self.scores = torch.zeros(0, device=device)  # [S] float32, one per KV row
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, k_pos: torch.Tensor | None) -> None:
        """Queries q [R, Hq, hd] at q_pos [R] over rotated keys k [S, Hkv, hd] at k_pos [S] (None: all visible)."""
        observed = q_pos >= self.from_position  # [R]
        if self.rule == "window" or not bool(observed.any()):
            return
        q_pos = q_pos[observed]
        k_pos = torch.zeros(k.shape[0], dtype=q_pos.dtype, device=q_pos.device) if k_pos is None else k_pos
        logits = LayerView(q[observed], k, q_pos, k_pos.to(q_pos.device)).logits()  # [Hkv, g, R, S]
        probs = gumbel_softmax(logits, self.tau, self.generator) if self.rule == "keyformer" else logits.softmax(-1)
        added = probs.sum(dim=(0, 1, 2))  # [S]
        self.scores = self._padded(added.shape[0])
        self.scores[:added.shape[0]] += added

    def keep(self, rows: torch.Tensor) -> None:
        """Only these rows stay (the others were dropped): their scores, in order."""
        self.scores = self._padded(int(rows.max()) + 1 if rows.numel() else 0)[rows.to(self.scores.device)]

    @property
    def recent(self) -> float:
        """The budget's share for the most recent rows: Keyformer's split, or all of it for the window."""
        return 1.0 if self.rule == "window" else RECENT_SHARE

    def budget_rows(self, n_rows: int, budget: int, protected: int) -> torch.Tensor:
        """The rows of the first n_rows to keep under `budget` (see `budget_rows`)."""
        return budget_rows(self._padded(n_rows)[:n_rows], budget, protected, self.recent)

    def _padded(self, n_rows: int) -> torch.Tensor:
        """The scores of at least n_rows rows: 0 for rows no query has seen yet (every row, under the window)."""
        if self.scores.shape[0] >= n_rows:
            return self.scores
        return torch.cat([self.scores, self.scores.new_zeros(n_rows - self.scores.shape[0])])


def budget_rows(scores: torch.Tensor, budget: int, protected: int, recent: float = RECENT_SHARE) -> torch.Tensor:
    """The rows a sequence keeps when its KV is cut to `budget` rows: the first `protected` (the preamble, shared
    by every sequence and the attention sinks), the most recent round(recent * budget), and the best-scoring of
    the rest. scores [S] -> kept row indices [min(S, budget)], ascending."""
    n = scores.shape[0]
    if n <= budget:
        return torch.arange(n, device=scores.device)
    if budget <= protected:
        raise KvragError(f"a KV budget of {budget} tokens does not exceed the {protected} tokens of the preamble")
    n_recent = min(budget - protected, round(recent * budget))
    top = scores[protected:n - n_recent].topk(budget - protected - n_recent).indices + protected
    rows = torch.cat([torch.arange(protected, device=scores.device), top,
                      torch.arange(n - n_recent, n, device=scores.device)])
    return rows.sort().values
