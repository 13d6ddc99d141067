"""One decode step for one new row: the reference step's arithmetic with its per-step overhead taken out.

A decode step reads every weight once for a single row, so it runs at the memory's speed only if nothing else
costs: here the rotary angles of every position the cache can hold are computed once, q and k rotate in one
call into a buffer made once per cache, and the keys and values are also kept in float32 (the reference
converts the whole cache to float32 at every layer of every step for its attention matmuls).

Two arithmetics:
- exact: torch's own ops, the reference's bits.
- native (default where it serves: a bf16 model on an x86-64 AVX-512 CPU with kvrag's kernels built, and
  KVRAG_NATIVE not 0): the whole step, every layer and the LM head, in one call into kernels/decode.cpp on
  torch's threads, reading the cache's bf16 keys and values as they are. Each op rounds where torch's does;
  only the order of float32 sums differs, which a bf16 model amplifies: greedy answers part from the
  reference at near-ties. The float32 rescoring of the best logits stays here, in torch.

A model that is not Llama-shaped (q/k norms, a partial rotary, sliding windows) never comes here: decode_step runs
the reference step for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvrag.kernels import decode_step as native_decode
from kvrag.kernels.attention import attend_few_rows
from kvrag.model import rotary
from kvrag.model.quant import linear
from kvrag.model.transformer import Transformer

if TYPE_CHECKING:
    from kvrag.model.cache import DecodeCache


class RowStep:
    def __init__(self, model: Transformer, cache: DecodeCache, native: bool = True):
        c = self.cfg = model.cfg
        self.model, self.cache, self.wants_native = model, cache, native
        self.native = native and model.native and native_decode.step_serves(model.step_weights())
        # [cap + offset, 1, hd] each: every position a row of this cache can take
        self.cos, self.sin = model.positions_cos_sin(torch.arange(cache.capacity + cache.offset))
        self.whole = native_decode.WholeStep(model.step_weights(), cache.k, cache.v, self.cos, self.sin) if self.native else None
        self.h = torch.empty(1, c.hidden_size, dtype=model.dtype, device=model.device)  # [1, D] the residual stream
        self.qk = torch.empty(1, c.n_heads + c.n_kv_heads, c.head_dim, dtype=model.dtype,
                              device=model.device)  # [1, Hq + Hkv, hd] rotated q and k
        # float32 keys and values for the exact attention: the cache's rows so far now, each new row as it comes
        self.k32 = self.v32 = None
        if not self.native:
            self.k32, self.v32 = (torch.empty(x.shape, device=x.device) for x in (cache.k, cache.v))  # [L, cap, Hkv, hd]
            self.k32[:, :cache.length], self.v32[:, :cache.length] = cache.k[:, :cache.length], cache.v[:, :cache.length]
        self.synced = cache.length  # rows below this are in k32 and v32 (rows written elsewhere later are not)

    def step(self, token: int) -> torch.Tensor:
        """Feed `token` at row cache.length (position length + offset): its K and V into the cache, the next-token
        logits [V] out."""
        n = self.cache.length
        self.h.copy_(self.model.embed_tokens[token])
        if self.whole is not None:
            out = torch.empty(self.model.lm_head.shape[0])  # [V] the head's bf16 logits, widened
            self.whole(n, self.h[0], out, rotary=n + self.cache.offset)
            logits = self.model.rescored(out[None], self.model._normed(self.h))[0]  # [V]
        else:
            for layer in range(self.cfg.n_layers):
                self._attention(layer, n)
                self._mlp(layer)
            logits = self.model.logits(self.h)[0]  # [V] Transformer's head, rescored in float32
        self.cache.length = self.synced = n + 1
        return logits

    def _attention(self, layer: int, n: int) -> None:
        """h += o_proj(attention of the row at position n over keys 0..n); its k and v go into the cache."""
        c, m, w, cache = self.cfg, self.model, self.model.layers[layer], self.cache
        nq, nk = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        qkv = linear(m.rms_norm(self.h, w.attn_norm), w.wqkv, w.bqkv)  # [1, (Hq + 2 Hkv) hd]
        qk = qkv[:, :nq + nk].view(1, -1, c.head_dim)  # [1, Hq + Hkv, hd] before rotary
        p = n + cache.offset
        rotary.rotate(qk, self.cos[p:p + 1], self.sin[p:p + 1], out=self.qk)
        cache.k[layer, n] = self.qk[0, c.n_heads:]
        cache.v[layer, n] = qkv[0, nq + nk:].view(c.n_kv_heads, c.head_dim)
        q = self.qk[0, :c.n_heads]  # [Hq, hd]
        self.k32[layer, n], self.v32[layer, n] = cache.k[layer, n], cache.v[layer, n]
        attn = attend_few_rows(q[None], self.k32[layer, :n + 1], self.v32[layer, :n + 1], c.group_size)  # [1, Hq hd]
        self.h.add_(linear(attn, w.wo))

    def _mlp(self, layer: int) -> None:
        """h += down(silu(gate) * up) of the MLP-normed row."""
        w = self.model.layers[layer]
        gate, up = linear(self.model.rms_norm(self.h, w.mlp_norm), w.w_gate_up).chunk(2, dim=-1)  # [1, I] each
        self.h.add_(linear(F.silu(gate) * up, w.w_down))
