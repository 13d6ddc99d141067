"""Every prefill: after a prefix whose KV is already known (`extend`: the preamble, a chunk, a cached path; with no
prefix, the plain reference forward), and into a decode cache, whole (`prefill`) or a piece at a time
(`ChunkedPrefill`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrag.kernels.attention import PagedKeys, RowTally
from kvrag.model.cache import DecodeCache
from kvrag.model.step import CacheKV, GrowingKV, Rows, run_layers
from kvrag.model.transformer import Transformer


@dataclass(frozen=True)
class PagedRows:
    """A prompt's first rows left where the engine's paged pool holds them (a prefix-cache hit): every layer's K
    (rotated) and V as the pool's flat rows, k and v [L, N, Hkv, hd] (views), and the rows of tokens 0..n-1, slots [n];
    `tally`: the pool's count of rows copied out of it."""

    k: torch.Tensor
    v: torch.Tensor
    slots: torch.Tensor
    tally: RowTally | None = None

    def __len__(self) -> int:
        return int(self.slots.shape[0])

    def layer(self, index: int) -> PagedKeys:
        return PagedKeys(self.k[index], self.v[index], self.slots, self.tally)


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


def extend(model: Transformer, prefix: LayerKV | None, ids: torch.Tensor, positions: torch.Tensor | None = None,
           all_logits: bool = False) -> tuple[torch.Tensor, LayerKV]:
    """Prefill ids [T] after `prefix`: the last position's logits [V] (every position's [T, V] with `all_logits`)
    and the new tokens' LayerKV, keys before rotary.

    Positions default to right after the prefix. The new tokens attend to every prefix key at a
    position at or before theirs, and causally to each other. With no prefix this is the plain causal forward the
    tests hold against transformers.
    """
    start = int(prefix.positions[-1]) + 1 if prefix is not None and len(prefix) else 0
    if positions is None:
        positions = torch.arange(start, start + ids.shape[0])
    rows = Rows.at(model, ids, positions)
    kv = GrowingKV(model, prefix, rows.pos)
    logits = run_layers(model, rows, kv, all_rows=all_logits)
    return logits if all_logits else logits[0], LayerKV(kv.new_k, kv.new_v, rows.pos)


class ChunkedPrefill:
    """A full prefill of ids [T] run a piece at a time: each piece is one pass of every layer over the next tokens,
    attending to every token before them in the cache. An engine decodes its running sequences between the pieces
    of a long prompt instead of stalling them all for its whole prefill."""

    def __init__(self, model: Transformer, ids: torch.Tensor, extra: int, tap=None, head: LayerKV | None = None):
        self.model, self.ids, self.tap = model, ids, tap  # tap: sees every layer's queries and keys, where set
        self.cache = DecodeCache(model, ids.shape[0] + extra)
        self.logits: torch.Tensor | None = None  # [V] at the last position, once every piece has run
        # a head wholly in the engine's pool, read there by the row kernel: its cache rows are left unwritten (the
        # engine's table takes the pool's blocks for them), nothing gathered or placed
        self.paged: PagedRows | None = None
        if head is None or not len(head):
            return
        if head.n_paged == len(head) and tap is None and model.uses_row_kernel():
            if len(head) >= ids.shape[0]:
                raise ValueError(f"a head of {len(head)} rows leaves nothing of a {ids.shape[0]}-token prompt to run")
            self.paged, self.cache.length = head.paged, len(head)
        else:  # a LayerKV of the first ids' exact KV (a prefix cache hit): not computed
            self._seed(head.dense())

    @torch.inference_mode()
    def _seed(self, head: LayerKV) -> None:
        n = len(head)
        if n >= self.ids.shape[0]:
            raise ValueError(f"a seeded head of {n} rows leaves nothing of a {self.ids.shape[0]}-token prompt to run")
        for layer, (k, v) in enumerate(zip(head.k, head.v, strict=True)):  # each [n, Hkv, hd]
            if head.rotated:
                self.cache.k[layer, :n] = k
            else:
                self.model.rotate_keys(k, head.positions, out=self.cache.k[layer, :n], layer=layer)
            self.cache.v[layer, :n] = v
        self.cache.length = n

    @property
    def done(self) -> bool:
        return self.cache.length == self.ids.shape[0]

    @torch.inference_mode()
    def advance(self, tokens: int) -> bool:
        """Run the next `tokens` positions (at least one); True when the whole prompt is in the cache."""
        start = self.cache.length
        stop = min(start + max(tokens, 1), self.ids.shape[0])
        rows = Rows.at(self.model, self.ids[start:stop], torch.arange(start, stop))
        kv = CacheKV(self.model, self.cache, rows.pos, paged=self.paged)
        kv.tap = self.tap
        logits = run_layers(self.model, rows, kv)  # [1, V]
        self.cache.length = stop
        if self.done:
            self.logits = logits[0]
        return self.done


def prefill(model: Transformer, ids: torch.Tensor, extra: int) -> tuple[torch.Tensor, DecodeCache]:
    """Plain full prefill of ids [T] in one piece: last-position logits [V] and a cache ready for decoding."""
    job = ChunkedPrefill(model, ids, extra)
    job.advance(ids.shape[0])
    return job.logits, job.cache
