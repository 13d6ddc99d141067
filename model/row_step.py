"""One decode step for one new row: the reference step's arithmetic with its per-step overhead taken out.

A decode step reads every weight once for a single row, so it runs at the memory's speed only if nothing else
costs: here buffers are made once per cache, the rotary angles of every position the cache can hold are
computed once, q and k rotate in one call, and the keys and values are also kept in float32 (the reference
converts the whole cache to float32 at every layer of every step for its attention matmuls).

Two arithmetics:
- exact (default): torch's own ops, the reference's bits. DECODE_THREADS = 1 runs them on one thread (the same
  bits as on two): on a busy shared CPU its matrix-vector products then wait at no barrier for a descheduled
  second thread (0.4 vs 7.8 ms for a 3072x576 bf16 product under load on 2 cores; 18-22 tokens/s steady vs
  1-32), but on an idle 2-core CPU two threads are faster (32 vs 21 tokens/s), so torch's setting is kept.
- native (default where it serves: a bf16 model on an x86-64 AVX-512 CPU with kvrag's kernels built, and
  KVRAG_NATIVE not 0): the whole step, every layer and the LM head, in one call into kernels/decode.cpp on
  torch's threads, reading the cache's bf16 keys and values as they are. Each op rounds where torch's does;
  only the order of float32 sums differs, which a bf16 model amplifies: greedy answers part from the
  reference at near-ties. The float32 rescoring of the best logits stays here, in torch.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvrag.kernels import decode_step as native_decode
from kvrag.kernels.attention import attend_few_rows
from kvrag.model import rotary
from kvrag.model.quant import linear
from kvrag.model.step import CacheKV, Rows, run_layers
from kvrag.model.transformer import Transformer

if TYPE_CHECKING:
    from kvrag.model.cache import DecodeCache

DECODE_THREADS: int | None = None  # torch threads during an exact step, None: as set (see the module doc)


class RowStep:
    def __init__(self, model: Transformer, cache: DecodeCache, native: bool = True):
        c = self.cfg = model.cfg
        self.model, self.cache, self.wants_native = model, cache, native
        self.native = native and model.native and native_decode.step_serves(model.step_weights())
        # the arithmetic below is a Llama-shaped layer's: another family (q/k norms, a partial rotary, sliding
        # windows) steps through the model's general primitives, the reference step's own ops
        self.general = not c.plain
        # [cap + offset, 1, hd] each: every position a row of this cache can take
        self.cos, self.sin = model.positions_cos_sin(torch.arange(cache.capacity + cache.offset))
        self.whole = native_decode.WholeStep(model.step_weights(), cache.k, cache.v, self.cos, self.sin) if self.native else None
        new = partial(torch.empty, dtype=model.dtype, device=model.device)
        self.h = new(1, c.hidden_size)  # [1, D] the residual stream
        self.qkv = new(1, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim)  # [1, (Hq + 2 Hkv) hd]
        self.qk = new(1, c.n_heads + c.n_kv_heads, c.head_dim)  # [1, Hq + Hkv, hd] rotated q and k
        self.attn = new(1, c.n_heads * c.head_dim)  # [1, Hq hd]
        self.out = new(1, c.hidden_size)  # [1, D] an attention or MLP output before the residual add
        self.gate_up = new(1, 2 * c.intermediate_size)  # [1, 2I]
        self.act = new(1, c.intermediate_size)  # [1, I]
        # float32 keys and values for the exact attention: the cache's rows so far now, each new row as it comes
        self.k32 = self.v32 = None
        if not self.native and not self.general:
            self.k32, self.v32 = (torch.empty(x.shape, device=x.device) for x in (cache.k, cache.v))  # [L, cap, Hkv, hd]
            self.k32[:, :cache.length], self.v32[:, :cache.length] = cache.k[:, :cache.length], cache.v[:, :cache.length]
        self.synced = cache.length  # rows below this are in k32 and v32 (rows written elsewhere later are not)

    def step(self, token: int) -> torch.Tensor:
        """Feed `token` at row cache.length (position length + offset): its K and V into the cache, the next-token
        logits [V] out."""
        n = self.cache.length
        if self.general:
            rows = Rows.at(self.model, torch.tensor([token]), torch.tensor([n + self.cache.offset]))
            logits = run_layers(self.model, rows, CacheKV(self.model, self.cache, rows.pos, self.cache.offset))
            self.cache.length = self.synced = n + 1
            return logits[0]
        if self.whole is not None:
            self.h.copy_(self.model.embed_tokens[token])
            out = torch.empty(self.model.lm_head.shape[0])  # [V] the head's bf16 logits, widened
            self.whole(n, self.h[0], out, rotary=n + self.cache.offset)
            self.cache.length = self.synced = n + 1
            return self._rescored(out, self.model._normed(self.h))
        with _threads(DECODE_THREADS):
            self.h.copy_(self.model.embed_tokens[token])
            for layer in range(self.cfg.n_layers):
                self._attention(layer, n)
                self._mlp(layer)
            self.cache.length = self.synced = n + 1
            return self._logits()

    def _attention(self, layer: int, n: int) -> None:
        """h += o_proj(attention of the row at position n over keys 0..n); its k and v go into the cache."""
        c, m, w, cache = self.cfg, self.model, self.model.layers[layer], self.cache
        nq, nk = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        self._linear(m.rms_norm(self.h, w.attn_norm), w.wqkv, w.bqkv, self.qkv)
        qk = self.qkv[:, :nq + nk].view(1, -1, c.head_dim)  # [1, Hq + Hkv, hd] before rotary
        p = n + cache.offset
        rotary.rotate(qk, self.cos[p:p + 1], self.sin[p:p + 1], out=self.qk)
        cache.k[layer, n] = self.qk[0, c.n_heads:]
        cache.v[layer, n] = self.qkv[0, nq + nk:].view(c.n_kv_heads, c.head_dim)
        q = self.qk[0, :c.n_heads]  # [Hq, hd]
        self.k32[layer, n], self.v32[layer, n] = cache.k[layer, n], cache.v[layer, n]
        self.attn.copy_(attend_few_rows(q[None], self.k32[layer, :n + 1], self.v32[layer, :n + 1], c.group_size))
        self.h.add_(self._linear(self.attn, w.wo, None, self.out))

    def _mlp(self, layer: int) -> None:
        """h += down(silu(gate) * up) of the MLP-normed row."""
        w = self.model.layers[layer]
        self._linear(self.model.rms_norm(self.h, w.mlp_norm), w.w_gate_up, None, self.gate_up)
        gate, up = self.gate_up.chunk(2, dim=-1)  # [1, I] each
        torch.mul(F.silu(gate), up, out=self.act)
        self.h.add_(self._linear(self.act, w.w_down, None, self.out))

    def _linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
        """out [1, N] = x [1, K] @ w [N, K]^T (+ b): Transformer's numbers (model/quant.py's linear), into out."""
        out.copy_(linear(x, w, b))
        return out

    def _logits(self) -> torch.Tensor:
        """Transformer.logits of the one row: the bf16 head, then its RESCORED best again in float32."""
        m = self.model
        normed = m._normed(self.h)  # [1, D] float32
        return self._rescored(linear(m.final_norm * normed.to(m.dtype), m.lm_head)[0].float(), normed)  # [V]

    def _rescored(self, out: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """The head's logits out [V] with their best rescored in float32 (Transformer.rescored) from the final
        row's float32 norm normed [1, D]."""
        return self.model.rescored(out[None], normed)[0]


@contextmanager
def _threads(n: int | None):
    """torch's intra-op threads set to n for the block (None: unchanged)."""
    before = torch.get_num_threads()
    if n is not None and n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
