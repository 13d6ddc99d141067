"""The one per-layer step every forward runs: full prefill, prefix extension, blend and decode.

    rows = Rows.at(model, ids, positions)              # hidden states [R, D] at absolute positions
    for layer in range(n_layers):
        rows = layer_step(model, layer, rows, kv)     # project, place K/V, (check), attend, finish

What differs between the forwards is where a layer's keys and values go and what the rows attend to: that is
the KV target (`place`, `attend`). A contiguous cache (`CacheKV`: full prefill, the reference decode step), a
prefix plus the new rows (`GrowingKV`: prefix extension), a blend's assembled prompt (fusion.BlendKV) or the
paged pool of a batch of sequences (engine.batch_decode.PoolKV). A blend's check layer also narrows the rows
(fusion.Selector); it is the step's one optional hook.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from kvrag.kernels.native import cpu_has_fast_bf16

if TYPE_CHECKING:
    from kvrag.model.cache import DecodeCache
    from kvrag.model.transformer import Transformer


@dataclass
class Rows:
    """Token rows on their way through the layers."""

    h: torch.Tensor  # [R, D] hidden states
    pos: torch.Tensor  # [R] absolute positions
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin of `pos`, [R, 1, hd] each ([R, 2, hd]: Transformer.layer_rope)
    index: torch.Tensor | None = None  # [R] the rows' places among the target's computed rows (a blend narrows them)
    prompt: bool = False  # a prompt's rows (a prefill), not decode rows: quantized products follow their positions

    @classmethod
    def at(cls, model: Transformer, ids: torch.Tensor, positions: torch.Tensor,
           index: torch.Tensor | None = None, prompt: bool = True) -> Rows:
        positions = positions.to(model.device)
        return cls(model.embed(ids), positions, model.positions_cos_sin(positions), index, prompt)

    def take(self, which: torch.Tensor | slice) -> Rows:
        if isinstance(which, slice) and which.indices(len(self)) == (0, len(self), 1):
            # every row: the same tensors, so attention recognises the positions (read once a prompt: on a GPU
            # each read of them is a sync, kernels/attention.py)
            return Rows(self.h, self.pos, self.rope, self.index, self.prompt)
        index = None if self.index is None else self.index[which]
        return Rows(self.h[which], self.pos[which], (self.rope[0][which], self.rope[1][which]), index, self.prompt)

    @property
    def prompt_positions(self) -> torch.Tensor | None:
        """The positions a quantized product splits a prompt's rows by (model/quant.py), None for decode rows."""
        return self.pos if self.prompt else None

    def __len__(self) -> int:
        return int(self.h.shape[0])


class KVTarget(Protocol):
    def place(self, layer: int, rows: Rows, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep this layer's keys (before rotary) and values of `rows`, [R, Hkv, hd] each."""

    def attend(self, layer: int, q: torch.Tensor, rows: Rows) -> torch.Tensor:
        """Attention of `rows`' queries q [R, Hq, hd] over this layer's keys -> [R, Hq * hd]."""


class Narrowing(Protocol):
    def __call__(self, layer: int, rows: Rows, kv: KVTarget) -> tuple[Rows, torch.Tensor]:
        """Project and place the rows' K/V itself, then narrow them: the rows that go on and their queries."""


def layer_step(model: Transformer, layer: int, rows: Rows, kv: KVTarget, check: Narrowing | None = None,
               all_rows: bool = False) -> Rows:
    """One layer for `rows`: q/k/v, K/V into the target, attention over it, output projection and MLP. At the
    last layer only the last row goes on (its logits are all a prefill reads) unless `all_rows`; every row's K/V
    is placed either way."""
    if check is None:
        qkv = model.project(layer, rows.h, rows.pos, rows.rope, rows.prompt)
        kv.place(layer, rows, qkv.k, qkv.v)
        q = qkv.q  # [R, Hq, hd]
    else:
        rows, q = check(layer, rows, kv)
    out = slice(None) if all_rows else model.rows_read_after(layer, len(rows))
    rows, q = rows.take(out), q[out]
    rows.h = model.finish(layer, rows.h, kv.attend(layer, q, rows), rows.prompt_positions)
    return rows


def run_layers(model: Transformer, rows: Rows, kv: KVTarget, all_rows: bool = False) -> torch.Tensor:
    """Every layer for `rows` over `kv`; the logits of the last row ([1, V]), or of every row ([R, V])."""
    for layer in range(model.cfg.n_layers):
        rows = layer_step(model, layer, rows, kv, all_rows=all_rows)
    return model.logits(rows.h)


class CacheKV:
    """Rows written straight into a DecodeCache at their positions less `offset` (one slot each) and attending
    to every slot up to theirs: a full prefill into a fresh cache, or the reference decode step (offset: the
    cache's, a reduced prompt's dropped positions, all before these rows)."""

    def __init__(self, model: Transformer, cache: DecodeCache, positions: torch.Tensor, offset: int = 0,
                 paged=None):
        self.model, self.cache = model, cache
        self.paged = paged  # model/prefill.PagedRows: the first slots' keys where a pool holds them (none written here)
        start, self.stop = int(positions[0]) - offset, int(positions[-1]) + 1 - offset
        self.slots = slice(start, self.stop)  # the new rows: consecutive positions
        # the mask's key positions: slot numbers, at or below the real ones, so every earlier slot stays visible
        self.key_pos = torch.arange(self.stop, device=model.device)  # [S]
        self.tap = None  # called with each layer's queries and keys (engine/kv_budget.AttentionScore), where set

    def place(self, layer: int, rows: Rows, k: torch.Tensor, v: torch.Tensor) -> None:
        self.model.rotate_keys(k, rows.pos, rows.rope, out=self.cache.k[layer, self.slots], layer=layer)
        self.cache.v[layer, self.slots] = v

    def attend(self, layer: int, q: torch.Tensor, rows: Rows) -> torch.Tensor:
        c = self.cache
        if self.tap is not None:
            self.tap(layer, q, rows.pos, c.k[layer, :self.stop], self.key_pos)
        if self.paged is not None:  # the first slots read in the pool, the rest here
            n = len(self.paged)
            return self.model.attend(q, rows.pos, c.k[layer, n:self.stop], c.v[layer, n:self.stop], self.key_pos,
                                     layer, self.paged.layer(layer))
        return self.model.attend(q, rows.pos, c.k[layer, :self.stop], c.v[layer, :self.stop], self.key_pos, layer)


class GrowingKV:
    """New rows after an optional prefix whose keys are kept before rotary (LayerKV-like: per-layer k, v and
    positions): each layer's keys are rotated at use, and the new rows' K (before rotary) and V are collected."""

    def __init__(self, model: Transformer, prefix, positions: torch.Tensor):
        self.model, self.prefix = model, prefix
        self.new_k: list[torch.Tensor] = []  # per layer [R, Hkv, hd], before rotary
        self.new_v: list[torch.Tensor] = []  # per layer [R, Hkv, hd]
        if prefix is None:
            self.key_pos = positions.to(model.device)
        else:
            self.prefix_pos = prefix.positions.to(model.device)
            # keys before rotary are rotated at use; a rotated (or paged) prefix needs no rope
            self.prefix_rope = None if prefix.rotated else model.positions_cos_sin(prefix.positions)
            self.key_pos = torch.cat([self.prefix_pos, positions.to(model.device)])  # [S]
        self.k_rot = self.v = None  # this layer's, between place and attend

    def place(self, layer: int, rows: Rows, k: torch.Tensor, v: torch.Tensor) -> None:
        self.new_k.append(k)
        self.new_v.append(v)
        k_rot = self.model.rotate_keys(k, rows.pos, rows.rope, layer=layer)
        p = self.prefix
        if p is not None and p.k[layer].shape[0]:  # a paged prefix's own rows stay in the pool (attend reads them)
            prefix_k = p.k[layer].to(self.model.dtype) if p.rotated else \
                self.model.rotate_keys(p.k[layer], self.prefix_pos, self.prefix_rope, layer=layer)
            k_rot = torch.cat([prefix_k, k_rot])
            v = torch.cat([p.v[layer].to(self.model.dtype), v])
        self.k_rot, self.v = k_rot, v

    def attend(self, layer: int, q: torch.Tensor, rows: Rows) -> torch.Tensor:
        head = None if self.prefix is None or self.prefix.paged is None else self.prefix.paged.layer(layer)
        return self.model.attend(q, rows.pos, self.k_rot, self.v, self.key_pos, layer, head)


def attention_logits(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                     exact: bool = True) -> torch.Tensor:
    """What a tap (CacheKV.tap) scores with: the scaled logits [Hkv, g, R, S] in float32 of queries q [R, Hq, hd] over
    rotated keys k [S, Hkv, hd], -inf where a key lies after its query. exact=False: the product in the keys' dtype,
    as Keyformer's code scores (a decode step then skips a float32 copy of every key), where that dtype's matmul is
    fast (a CPU without bf16 hardware multiplies bf16 two orders of magnitude slower than float32)."""
    r, hq, hd = q.shape
    h_kv = k.shape[1]
    low = not exact and (k.dtype != torch.bfloat16 or k.device.type != "cpu" or cpu_has_fast_bf16())
    dtype = k.dtype if low else torch.float32
    qf = q.to(dtype).view(r, h_kv, hq // h_kv, hd).permute(1, 2, 0, 3)  # [Hkv, g, R, hd]
    logits = torch.matmul(qf, k.to(dtype).permute(1, 2, 0).unsqueeze(1)).float() * hd ** -0.5  # [Hkv, g, R, S]
    return logits.masked_fill_(k_pos[None, :] > q_pos[:, None], -math.inf)
