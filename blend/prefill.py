"""Prefill of new tokens after a prefix whose KV is already known (the preamble, or a cached path)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrag.blend.model import Transformer


@dataclass
class LayerKV:
    """Every layer's keys (before rotary) and values for tokens at `positions`."""

    k: list[torch.Tensor]  # per layer [S, Hkv, hd], pre-rotary
    v: list[torch.Tensor]  # per layer [S, Hkv, hd]
    positions: torch.Tensor  # [S] absolute positions

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
        positions = torch.arange(start, start + ids.shape[0], device=model.device)
    positions = positions.to(model.device)
    key_pos = positions if prefix is None else torch.cat([prefix.positions.to(model.device), positions])
    rope_new = model.positions_cos_sin(positions)
    rope_prefix = model.positions_cos_sin(prefix.positions) if prefix is not None else None
    h = model.embed(ids)
    new_k, new_v = [], []
    for layer in range(model.cfg.n_layers):
        qkv = model.project(layer, h, positions, rope_new)
        k_rot = model.rotate_keys(qkv.k, positions, rope_new)
        v = qkv.v
        if prefix is not None:
            k_rot = torch.cat([model.rotate_keys(prefix.k[layer], prefix.positions, rope_prefix), k_rot])
            v = torch.cat([prefix.v[layer].to(model.dtype), v])
        out = model.rows_read_after(layer, h.shape[0])
        h = model.finish(layer, h[out], model.attend(qkv.q[out], positions[out], k_rot, v, key_pos))
        new_k.append(qkv.k)
        new_v.append(qkv.v)
    return model.logits(h[-1:])[0], LayerKV(new_k, new_v, positions)
