"""One decode step for a batch of sequences of different lengths, reading and writing K/V through block tables.

Two paths with one contract (row b's logits and K/V depend on sequence b alone, whatever else is in the batch):
- native (a bf16 model on an AVX-512 CPU with kvrag's kernels): kernels/decode.cpp's batched step, which reads
  each weight once for the whole batch and each sequence's K/V in place in the pool;
- torch: the spec, and the path everywhere else. The projections and the MLP run batched; attention runs per
  sequence over its own slots (a gather of its K/V rows: what the native step avoids).
With `cuda_graphs` (off by default until measured on a GPU), a batch on the Triton path replays a step captured
for its batch bucket over static inputs (engine/decode_graphs.py); taps and batches past the largest bucket stay
eager.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvrag.engine.kv_pool import SequenceKV
from kvrag.kernels import decode_step as native_decode
from kvrag.kvcache.allocator import BlockTable
from kvrag.model.step import Rows, run_layers
from kvrag.model.transformer import Transformer

if TYPE_CHECKING:  # the graphs are a GPU's: a plain ask does not import them
    from kvrag.engine.decode_graphs import Capture


class BatchDecoder:
    def __init__(self, model: Transformer, kv: SequenceKV, max_positions: int, native: bool = True,
                 cuda_graphs: bool = False, max_batch: int = 32, capture: Capture | None = None):
        """cuda_graphs: replay captured steps for batches of up to max_batch (the scheduler's max_running) where
        they serve; capture: how (default: a CUDA graph on CUDA, the same static-buffer step eagerly elsewhere)."""
        self.model, self.kv = model, kv
        self.cos, self.sin = model.positions_cos_sin(torch.arange(max_positions))  # [P, 1, hd] each
        self.native = None
        if native and model.native and native_decode.step_serves(model.step_weights()) and kv.pool.kv.dtype == torch.bfloat16:
            self.native = native_decode.BatchStep(model.step_weights(), kv.pool.kv, self.cos, self.sin)
        self.graphs = None
        if cuda_graphs:
            from kvrag.engine.decode_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(model, kv, self.cos, self.sin, max_batch, max_positions, capture)

    @property
    def reserved_blocks(self) -> int:
        """Pool blocks the decoder holds for itself (the graphs' scratch block), which no sequence can have."""
        return 0 if self.graphs is None else 1

    @torch.inference_mode()
    def step(self, tokens: Sequence[int], tables: Sequence[BlockTable], offsets: Sequence[int] | None = None,
             taps: Sequence | None = None) -> torch.Tensor:
        """Feed tokens[b] at row tables[b].n_tokens - 1 (the slot `SequenceKV.grow` made for it), position that row
        + offsets[b] (dropped tokens' places before it; None: 0); returns the next-token logits [B, V] float32.
        taps[b], where set, sees sequence b's queries and keys at every layer (a decode-time budget's scores): the
        native step does not expose them, so such a batch runs the torch step."""
        tapped = any(t is not None for t in taps or ())
        if self.graphs is not None and self.native is None:
            if self.graphs.serves(tables, taps):
                return self.graphs.step(tokens, tables, offsets)
            self.graphs.stats["eager"] += 1
        slots = torch.tensor([t.n_tokens - 1 for t in tables], dtype=torch.long)  # [B]
        positions = slots if offsets is None else slots + torch.tensor(list(offsets), dtype=torch.long)  # [B]
        if self.native is not None and not tapped:
            return self._native(tokens, slots, positions, tables)
        return self._torch(torch.tensor(list(tokens), dtype=torch.long), positions, tables, taps)

    def _native(self, tokens: Sequence[int], slots: torch.Tensor, positions: torch.Tensor,
                tables: Sequence[BlockTable]) -> torch.Tensor:
        m = self.model
        block_table = padded_tables(tables, torch.long)  # [B, M]
        h = m.embed_tokens[torch.tensor(list(tokens))].contiguous()  # [B, D]
        logits = torch.empty(len(tables), m.lm_head.shape[0])  # [B, V] the head's bf16 logits, widened
        self.native(slots, block_table, h, logits, rotary=positions)
        return m.rescored(logits, m._normed(h))

    def _torch(self, tokens: torch.Tensor, positions: torch.Tensor, tables: Sequence[BlockTable],
               taps: Sequence | None = None) -> torch.Tensor:
        m = self.model
        rows = Rows(m.embed(tokens), positions, (self.cos[positions], self.sin[positions]))  # h [B, D]
        kv = PoolKV(m, self.kv, tables, taps)
        return run_layers(m, rows, kv, all_rows=True)  # each row is its sequence's last


class PoolKV:
    """The paged pool as the layer step's KV target (model/step.py): each sequence's new row goes to the slot its
    table made for it, and attends to its own slots alone."""

    def __init__(self, model: Transformer, kv: SequenceKV, tables: Sequence[BlockTable], taps: Sequence | None = None):
        self.model, self.kv, self.tables = model, kv, tables
        self.taps = taps or [None] * len(tables)
        self.k_all, self.v_all = kv.layer_views()  # [L, slots, Hkv, hd] each
        self.new_slots = kv.last_slots(tables)  # [B] each new token's slot
        self.paged = _paged_tables(kv, tables) if model.triton else None
        self._slots: list[torch.Tensor] | None = None

    @property
    def slots(self) -> list[torch.Tensor]:
        """Per sequence [n_b] its slots, the new token's last: only where attention gathers them (torch's step, or
        a tap's keys); the Triton kernel reads the pool through the block tables."""
        if self._slots is None:
            self._slots = [self.kv.rows(t) for t in self.tables]
        return self._slots

    def place(self, layer: int, rows: Rows, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_all[layer].index_copy_(0, self.new_slots, self.model.rotate_keys(k, rows.pos, rows.rope, layer=layer))
        self.v_all[layer].index_copy_(0, self.new_slots, v)

    def attend(self, layer: int, q: torch.Tensor, rows: Rows) -> torch.Tensor:
        k, v = self.k_all[layer], self.v_all[layer]
        keys = [k[self.slots[b]] if tap is not None else None for b, tap in enumerate(self.taps)]  # [n_b, Hkv, hd]
        for b, tap in enumerate(self.taps):
            if tap is not None:
                tap(layer, q[b:b + 1], rows.pos[b:b + 1], keys[b], None)
        if self.paged is not None:  # Triton: every sequence at once, K/V read in place through the block tables
            from kvrag.kernels import triton_attention  # imports Triton: only where it runs

            pool = self.paged[0]  # [L, 2, N, bs, Hkv, hd]
            # the lengths are the tables' own tokens: no host read of them a layer (check=False)
            out = triton_attention.decode_attention(q.to(pool.dtype), pool[layer, 0], pool[layer, 1], *self.paged[1:],
                                                    check=False)
            return out.view(q.shape[0], -1).to(q.dtype)  # [B, Hq * hd]
        return torch.cat([self.model.attend_latest(q[b:b + 1], k[r] if keys[b] is None else keys[b], v[r], layer)
                          for b, r in enumerate(self.slots)])


def _paged_tables(kv: SequenceKV, tables: Sequence[BlockTable]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pool [L, 2, N, bs, Hkv, hd], the tables padded to one width [B, M] int32, and the lengths [B] int32, as
    the Triton decode kernel reads them."""
    device = kv.pool.kv.device
    lens = torch.tensor([t.n_tokens for t in tables], dtype=torch.int32)  # [B]
    return kv.pool.kv, padded_tables(tables, torch.int32).to(device), lens.to(device)


def padded_tables(tables: Sequence[BlockTable], dtype: torch.dtype) -> torch.Tensor:
    """The tables' block ids as one [B, M] tensor, M the longest table's blocks, zeros past each one's end (never
    read: each sequence reads only its own rows)."""
    width = max(len(t.blocks) for t in tables)
    padded = np.zeros((len(tables), width), dtype=np.int32 if dtype == torch.int32 else np.int64)  # [B, M]
    for b, t in enumerate(tables):  # numpy from the lists: 3-4x faster than torch.tensor a step (64 x 512 blocks)
        padded[b, :len(t.blocks)] = t.blocks
    return torch.from_numpy(padded)
