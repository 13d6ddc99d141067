"""Prefill of new tokens after a prefix whose KV is already known (the preamble, or a cached path)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrag.model.step import GrowingKV, Rows, run_layers
from kvrag.model.transformer import Transformer


@dataclass
class LayerKV:
    """Every layer's keys (before rotary, unless `rotated`) and values for tokens at `positions`."""

    k: list[torch.Tensor]  # per layer [S, Hkv, hd], pre-rotary (rotated to `positions` when `rotated`)
    v: list[torch.Tensor]  # per layer [S, Hkv, hd]
    positions: torch.Tensor  # [S] absolute positions
    # keys already at their positions: a conversation's earlier turns, copied out of the engine's pool (which keeps
    # them rotated), are reused exactly as they were, never rotated back and forth
    rotated: bool = False

    def __len__(self) -> int:
        return int(self.positions.shape[0])


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
