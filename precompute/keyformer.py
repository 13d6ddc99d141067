"""Keyformer (Adnan et al., MLSys '24): keep only a chunk's key tokens' KV, with their original positions.

At precompute, the chunk's own queries (its tokens after the preamble, causally) score its keys at every layer:

    keyformer  softmax((logits + gumbel) / tau), summed over the queries and query heads that see each key
    h2o        softmax(logits), the plain accumulated attention (Zhang et al., NeurIPS '23), no noise
    window     the first `sinks` tokens and the most recent ones (StreamingLLM's sinks + window), no attention

and the chunk keeps a recent window plus its best-scoring tokens (`select`). A rule is one function of one
layer's attention (`LayerView`) returning a score per (KV head, chunk key); a new rule is one function and one
line in KEEP_RULES, which also names the settings that change its result (they go into the store variant).

The scores come from the chunk's own forward: `ScoringKV` is the GrowingKV target precompute uses, scoring each
layer as it attends, so the KV stored is bit-for-bit what a full precompute stores, subset aside. Keyformer's score
(`gumbel_softmax`) and its recent share are defined here once; engine/kv_budget.py's decode-time budget uses them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from kvrag.config import KEEP_RULE
from kvrag.errors import KvragError
from kvrag.model.prefill import LayerKV
from kvrag.model.step import GrowingKV, Rows, attention_logits, run_layers
from kvrag.model.transformer import Transformer

# The kept budget's split: Keyformer keeps a recent window w and the rest by score; the paper finds w at 20-30 %
# of the budget works best (Sec. 5.3, "recent window") and its code's default is 30 % (d-matrix-ai/keyformer-llm,
# `--recent 30` of `--kv_cache`): recent_tokens = int(budget * 0.30), key_tokens = budget - recent_tokens.
RECENT_SHARE = 0.3


@dataclass(frozen=True)
class KeepConfig:
    """What `precompute --keep` stores of each chunk."""

    keep: float = 1.0  # share of the chunk's tokens kept; 1: the full chunk
    rule: str = KEEP_RULE
    recent: float = RECENT_SHARE  # share of the kept budget given to the most recent tokens
    tau: float = 1.0  # the paper's tau_init, at the prompt (step 0)
    seed: int = 0  # Gumbel noise: with the chunk id, it fixes the draw (a store is reproducible)
    sinks: int = 4  # the window baseline's first tokens (StreamingLLM's four attention sinks)
    per_layer: bool = False  # one position set per layer (scores summed over KV heads) instead of one per chunk

    def __post_init__(self) -> None:
        if not 0 < self.keep <= 1:  # NaN fails too
            raise KvragError(f"--keep must be in (0, 1], got {self.keep}")
        if self.rule not in KEEP_RULES:
            raise KvragError(f"unknown keep rule {self.rule!r} (choose {', '.join(KEEP_RULES)})")
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


def gumbel_softmax(logits: torch.Tensor, tau: float, generator: torch.Generator | None) -> torch.Tensor:
    """softmax((logits + g) / tau) over the last dimension, g ~ Gumbel(0, 1) drawn per element as the paper's code
    (torch's gumbel_softmax) does."""
    noise = torch.rand(logits.shape, generator=generator, device=logits.device)
    noise.log_().neg_().log_().neg_()  # -log(-log U) ~ Gumbel(0, 1): 3x faster on a CPU than -log(Exp(1))
    return ((logits + noise) / tau).softmax(-1)


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
        return attention_logits(self.q, self.k, self.q_pos, self.k_pos)

    def accumulated(self, probs: torch.Tensor) -> torch.Tensor:
        """Attention probabilities [Hkv, g, T, S] summed over query heads and queries, chunk keys only: [Hkv, T]."""
        return probs.sum(dim=(1, 2))[:, -self.n_chunk:]


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


def select(scores: torch.Tensor, keep: float, recent: float = RECENT_SHARE) -> torch.Tensor:
    """Kept token indices, ascending: the recent window (round(recent * budget) last tokens) and the rest of the
    budget by score among the earlier tokens. scores [T] -> [round(keep * T)]."""
    n = scores.shape[-1]
    budget = max(1, min(n, round(keep * n)))
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

