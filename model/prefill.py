"""Prefill of new tokens after a prefix whose KV is already known (the preamble, or a cached path)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrag.kernels.attention import PagedKeys
from kvrag.model.step import GrowingKV, Rows, run_layers
from kvrag.model.transformer import Transformer


@dataclass(frozen=True)
class PagedRows:
    """A prompt's first rows left where the engine's paged pool holds them (a prefix-cache hit): every layer's K
    (rotated) and V as the pool's flat rows, k and v [L, N, Hkv, hd] (views), and the rows of tokens 0..n-1, slots [n]."""

    k: torch.Tensor
    v: torch.Tensor
    slots: torch.Tensor

    def __len__(self) -> int:
        return int(self.slots.shape[0])

    def layer(self, index: int) -> PagedKeys:
        return PagedKeys(self.k[index], self.v[index], self.slots)


@dataclass
class LayerKV:
    """Every layer's keys (before rotary, unless `rotated`) and values for tokens at `positions`."""

    k: list[torch.Tensor]  # per layer [S, Hkv, hd], pre-rotary (rotated to `positions` when `rotated`)
    v: list[torch.Tensor]  # per layer [S, Hkv, hd]
    positions: torch.Tensor  # [S] absolute positions
    # keys already at their positions: a conversation's earlier turns, kept in the engine's pool (rotated), are
    # reused exactly as they were, never rotated back and forth
    rotated: bool = False
    # the first len(paged) rows, read in place from the engine's pool (rotated): k and v then hold only the rows
    # after them, while positions covers them all
    paged: PagedRows | None = None

    def __post_init__(self):
        if self.paged is not None and not self.rotated:
            raise ValueError("the pool's rows are rotated: a paged LayerKV is a rotated one")

    def __len__(self) -> int:
        return int(self.positions.shape[0])

    @property
    def n_paged(self) -> int:
        return 0 if self.paged is None else len(self.paged)

    def dense(self) -> LayerKV:
        """Every row in k and v (the paged ones gathered: a copy), for the paths that read no pool."""
        if self.paged is None:
            return self
        joined = [self.paged.layer(i).join(k, v) for i, (k, v) in enumerate(zip(self.k, self.v, strict=True))]
        return LayerKV([k for k, _ in joined], [v for _, v in joined], self.positions, self.rotated)


def extend(model: Transformer, prefix: LayerKV | None, ids: torch.Tensor,
           positions: torch.Tensor | None = None) -> tuple[torch.Tensor, LayerKV]:
    """Prefill ids [T] after `prefix`: the last position's logits [V] and the new tokens' LayerKV.

    Positions default to right after the prefix. The new tokens attend to every prefix key at a
    position at or before theirs, and causally to each other.
    """
    start = int(prefix.positions[-1]) + 1 if prefix is not None and len(prefix) else 0
    if positions is None:
        positions = torch.arange(start, start + ids.shape[0])
    rows = Rows.at(model, ids, positions)
    kv = GrowingKV(model, prefix, rows.pos)
    logits = run_layers(model, rows, kv)
    return logits[0], LayerKV(kv.new_k, kv.new_v, rows.pos)
