"""The decode cache: every layer's rotated keys and values of one sequence, in one preallocated tensor."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvrag.model.transformer import Transformer


class DecodeCache:
    """Every layer's rotated keys and values, preallocated for the prompt plus the answer.

    Row i holds position i, except after a reduced prompt: its rows skip the dropped tokens' positions, and a new
    token (row `length`) is at position `length + offset`.
    """

    def __init__(self, model: Transformer, capacity: int):
        c = model.cfg
        shape = (c.n_layers, capacity, c.n_kv_heads, c.head_dim)
        self.k = torch.empty(shape, dtype=model.dtype, device=model.device)  # [L, cap, Hkv, hd]
        self.v = torch.empty(shape, dtype=model.dtype, device=model.device)  # [L, cap, Hkv, hd]
        self.length = 0
        self.offset = 0  # prompt positions without a row (dropped tokens' places), all before new rows
        self.stepper = None  # a model.row_step.RowStep: the one-row decode's buffers, made at the first decode step

    @torch.inference_mode()
    def keep_rows(self, rows: torch.Tensor) -> None:
        """Only these rows stay, moved to the front: rows [m] (every layer and head alike) or [L, Hkv, m] (each layer
        and KV head its own, ascending). The dropped ones' positions become gaps. Rows after the last kept one
        would need their own offsets: keep the last row."""
        n, m = self.length, int(rows.shape[-1])
        rows = rows.to(self.k.device).expand(self.k.shape[0], self.k.shape[2], m)  # [L, Hkv, m]
        heads = torch.arange(self.k.shape[2], device=self.k.device)
        for layer in range(self.k.shape[0]):
            self.k[layer, :m] = self.k[layer][rows[layer].T, heads]
            self.v[layer, :m] = self.v[layer][rows[layer].T, heads]
        self.length, self.offset = m, self.offset + n - m
        self.stepper = None  # its float32 copies hold the old rows

    @classmethod
    def from_prompt(cls, model: Transformer, layers: list[tuple[torch.Tensor, torch.Tensor]],
                    extra: int) -> DecodeCache:
        """From the prompt's per-layer (rotated k [S, Hkv, hd], v [S, Hkv, hd]), with room for `extra`."""
        n = layers[0][0].shape[0]
        cache = cls(model, n + extra)
        for i, (k, v) in enumerate(layers):
            cache.k[i, :n] = k
            cache.v[i, :n] = v
        cache.length = n
        return cache

    @property
    def capacity(self) -> int:
        return self.k.shape[1]
