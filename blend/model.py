"""Our own layer-by-layer forward for Llama-family models (Llama, Mistral, Qwen2) over HF weights.

The forward is split into per-layer primitives so that blending can run any layer on any subset
of token rows at explicit absolute positions, and read or replace that layer's K (before rotary)
and V:

    h = embed(ids)                                   # [T, D]
    for layer in range(n_layers):
        qkv = model.project(layer, h, positions)     # q rotated; k *before* rotary; v
        k_rot = model.rotate_keys(k_all, key_pos)    # rotate a fresh copy at use time
        a = model.attend(qkv.q, positions, k_rot, v_all, key_pos)
        h = model.finish(layer, h, a)
    logits = model.logits(h[-1:])

`full_forward` is the readable reference path (SDPA, plain causal mask) the tests hold against
transformers' own logits.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from safetensors import safe_open

from kvrag import KvragError
from kvrag.blend import rotary
from kvrag.blend.config import ModelConfig

if TYPE_CHECKING:
    from kvrag.blend.decode import DecodeCache
from kvrag.blend.device import attention_dtype
from kvrag.kernels import row_attention


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [D]
    wqkv: torch.Tensor  # [(Hq + 2*Hkv) * hd, D]  q, k, v projections fused into one matmul
    bqkv: torch.Tensor | None  # [(Hq + 2*Hkv) * hd]  Qwen2's q/k/v bias
    wo: torch.Tensor  # [D, Hq * hd]
    mlp_norm: torch.Tensor  # [D]
    w_gate_up: torch.Tensor  # [2 * I, D]  gate and up fused
    w_down: torch.Tensor  # [D, I]


@dataclass
class LayerQKV:
    q: torch.Tensor  # [T, Hq, hd]   rotated to the rows' positions
    k: torch.Tensor  # [T, Hkv, hd]  before rotary: what the store keeps
    v: torch.Tensor  # [T, Hkv, hd]


class Transformer:
    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        """From a Hugging Face checkpoint's tensors (by their HF names), fused and cast for compute."""
        self._setup(cfg, dtype, device)

        def take(name: str) -> torch.Tensor:
            if name not in tensors:
                raise KvragError(f"model weights lack '{name}'")
            return tensors[name].to(device=self.device, dtype=dtype).contiguous()

        self.embed_tokens = take("model.embed_tokens.weight")  # [V, D]
        self.final_norm = take("model.norm.weight")  # [D]
        if "lm_head.weight" in tensors and not cfg.tie_embeddings:
            self.lm_head = take("lm_head.weight")  # [V, D]
        else:
            self.lm_head = self.embed_tokens
        self.layers = [self._layer_weights(i, take, tensors) for i in range(cfg.n_layers)]

    def _setup(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.attention_dtype = attention_dtype(dtype, self.device)  # SDPA's inputs (see device.attention_dtype)
        self.inv_freq = rotary.inverse_frequencies(cfg).to(self.device)  # [hd/2]
        self.segment_plans = SegmentPlans()  # the last scattered-row attention plan, for the next layer's call

    def compute_state(self) -> dict[str, torch.Tensor]:
        """Every weight as the forward uses it (fused, cast): what blend/prepared.py caches on disk."""
        state = {"embed_tokens": self.embed_tokens, "final_norm": self.final_norm}
        if self.lm_head is not self.embed_tokens:
            state["lm_head"] = self.lm_head
        for i, layer in enumerate(self.layers):
            state.update({f"layers.{i}.{name}": t for name, t in vars(layer).items() if t is not None})
        return state

    @classmethod
    def from_compute_state(cls, cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype,
                           device: torch.device | str = "cpu") -> Transformer:
        """The inverse of `compute_state`: no fusing or casting left to do."""
        model = cls.__new__(cls)
        model._setup(cfg, dtype, device)
        if any(t.dtype != dtype for t in state.values()):
            raise KvragError("prepared weights are not in the requested dtype")
        model.embed_tokens, model.final_norm = state["embed_tokens"], state["final_norm"]
        model.lm_head = state.get("lm_head", model.embed_tokens)
        model.layers = [LayerWeights(**{f.name: state.get(f"layers.{i}.{f.name}") for f in fields(LayerWeights)})
                        for i in range(cfg.n_layers)]
        return model

    def _layer_weights(self, i: int, take, tensors) -> LayerWeights:
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        wqkv = torch.cat([take(attn + "q_proj.weight"), take(attn + "k_proj.weight"),
                          take(attn + "v_proj.weight")])
        bqkv = None
        if self.cfg.qkv_bias or (attn + "q_proj.bias") in tensors:
            bqkv = torch.cat([take(attn + "q_proj.bias"), take(attn + "k_proj.bias"), take(attn + "v_proj.bias")])
        return LayerWeights(
            attn_norm=take(p + "input_layernorm.weight"),
            wqkv=wqkv,
            bqkv=bqkv,
            wo=take(attn + "o_proj.weight"),
            mlp_norm=take(p + "post_attention_layernorm.weight"),
            w_gate_up=torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]),
            w_down=take(p + "mlp.down_proj.weight"),
        )

    @classmethod
    def from_safetensors(cls, cfg: ModelConfig, files: list[Path], dtype: torch.dtype,
                         device: torch.device | str = "cpu") -> Transformer:
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    tensors[name] = sf.get_tensor(name)
        return cls(cfg, tensors, dtype, device)

    # ---- primitives -------------------------------------------------------------------------

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm computed in float32 and cast back, as transformers does."""
        return weight * self._normed(x).to(x.dtype)

    def _normed(self, x: torch.Tensor) -> torch.Tensor:
        """x / rms(x) in float32, before the norm's weight: [R, D]."""
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.cfg.rms_eps)  # one fused kernel

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> hidden [T, D]."""
        return self.embed_tokens[ids.to(self.device)]

    def positions_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary.cos_sin(self.inv_freq, positions.to(self.device), self.dtype)

    def project(self, layer: int, h: torch.Tensor, positions: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> LayerQKV:
        """Attention-norm and q/k/v of rows h [T, D] at absolute `positions` [T].

        `rope` is `positions_cos_sin(positions)`, passed in when many layers share it.
        """
        c, w = self.cfg, self.layers[layer]
        x = self.rms_norm(h, w.attn_norm)
        qkv = F.linear(x, w.wqkv, w.bqkv)  # [T, (Hq + 2*Hkv) * hd]
        nq, nk = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        q = qkv[:, :nq].view(-1, c.n_heads, c.head_dim)  # [T, Hq, hd]
        k = qkv[:, nq:nq + nk].view(-1, c.n_kv_heads, c.head_dim)  # [T, Hkv, hd]
        v = qkv[:, nq + nk:].view(-1, c.n_kv_heads, c.head_dim)  # [T, Hkv, hd]
        cos, sin = rope if rope is not None else self.positions_cos_sin(positions)
        return LayerQKV(q=rotary.rotate(q, cos, sin), k=k, v=v)

    def attention_input(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """The attention norm of rows h [T, D]: what `project_kv` and `queries` take, computed once for both."""
        return self.rms_norm(h, self.layers[layer].attn_norm)

    def project_kv(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`project`'s k (before rotary) and v alone, each [T, Hkv, hd], from x = attention_input(layer, h):
        for rows whose queries are not needed."""
        c = self.cfg
        kv = self._qkv_columns(layer, x, slice(c.n_heads * c.head_dim, None))  # [T, 2 * Hkv * hd]
        k, v = kv.view(-1, 2, c.n_kv_heads, c.head_dim).unbind(1)  # [T, Hkv, hd] each
        return k, v

    def queries(self, layer: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """`project`'s q alone from x = attention_input(layer, h) [T, D], rotated by `rope` (their positions'
        cos, sin): [T, Hq, hd]."""
        c = self.cfg
        q = self._qkv_columns(layer, x, slice(0, c.n_heads * c.head_dim))  # [T, Hq * hd]
        return rotary.rotate(q.view(-1, c.n_heads, c.head_dim), *rope)

    def _qkv_columns(self, layer: int, x: torch.Tensor, columns: slice) -> torch.Tensor:
        """Some output columns of the fused q/k/v projection (with their bias, if any) for rows x [T, D]."""
        w = self.layers[layer]
        return F.linear(x, w.wqkv[columns], None if w.bqkv is None else w.bqkv[columns])

    def rotate_keys(self, k: torch.Tensor, positions: torch.Tensor,
                    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """Pre-rotary keys [S, Hkv, hd] rotated to absolute `positions` [S] (into `out`, else a new tensor)."""
        cos, sin = rope if rope is not None else self.positions_cos_sin(positions)
        return rotary.rotate(k.to(self.dtype), cos, sin, out)

    def attend(self, q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               k_pos: torch.Tensor | None) -> torch.Tensor:
        """Attention of queries q [R, Hq, hd] at q_pos [R] over rotated keys k and values v [S, Hkv, hd].

        A query at position p sees exactly the keys at positions <= p (absolute-position mask,
        never a bottom-right-aligned one). k_pos None means every key is visible (decoding).
        Runs in `attention_dtype` (float32 for bf16 on a CPU without AMX); returns [R, Hq * hd] in the model's dtype.
        """
        if q.shape[0] <= FEW_ROWS and (k_pos is None or int(k_pos.max()) <= int(q_pos.min())):
            return _attend_few_rows(q, k, v, self.cfg.group_size)  # a decode step, or the last row of a prefill
        if (k_pos is not None and self.uses_row_kernel() and _is_sorted(q_pos) and _is_arange(k_pos)
                and 0 <= int(q_pos[0]) and int(q_pos[-1]) < k_pos.shape[0]):
            # causal prefill, a prefill after a cached prefix, or a blend's scattered rows: one kernel for all
            # (it reads the bf16 cache as it is, and wastes no key past a 64-key block; see row_attention.cpp)
            out = row_attention.row_attention(q, q_pos.to(self.device), k, v)  # [R, Hq, hd] float32
            return out.view(q.shape[0], -1).to(self.dtype)
        q, k, v = (x.to(self.attention_dtype) for x in (q, k, v))  # no copy unless they differ
        # [1, H, len, hd]: SDPA's fused CPU/CUDA kernels want a batch dimension. Grouped-query attention
        # (each KV head serves group_size query heads) is SDPA's enable_gqa: no expanded copy of K and V,
        # and its causal CPU kernel runs about 20 % faster than over expanded heads.
        qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        sdpa = partial(F.scaled_dot_product_attention, enable_gqa=self.cfg.group_size > 1)
        if k_pos is None:
            out = sdpa(qh, kh, vh)
        elif _is_plain_causal(q_pos, k_pos):
            out = sdpa(qh, kh, vh, is_causal=True)
        elif _is_causal_tail(q_pos, k_pos) and 2 * q.shape[0] >= k.shape[0]:
            # Queries are most of the last rows of the keys (a prefill after a cached prefix). SDPA's
            # is_causal aligns top-left, so pad the queries with zero rows up to the keys' length,
            # use the fast causal kernel, and drop the padding: exact, and no [R, S] mask. Only when
            # the padding is at most the real rows: a few suffix rows over thousands of keys are
            # cheaper through the small [R, S] mask.
            pad = kh.shape[2] - qh.shape[2]
            qh = F.pad(qh, (0, 0, pad, 0))
            out = sdpa(qh, kh, vh, is_causal=True)[:, :, pad:]
        elif _is_sorted(q_pos) and _is_arange(k_pos):
            if qh.device.type == "cpu" and _FLASH_CPU is not None:
                out = _attend_key_segments_grouped(qh, kh, vh, q_pos.to(self.device), self.cfg.group_size,
                                                   self.segment_plans)
            else:
                out = _attend_row_blocks(sdpa, qh, kh, vh, q_pos.to(self.device))
        else:
            mask = k_pos.to(self.device)[None, :] <= q_pos.to(self.device)[:, None]  # [R, S]
            out = sdpa(qh, kh, vh, attn_mask=mask)
        return out[0].transpose(0, 1).reshape(q.shape[0], -1).to(self.dtype)  # [R, Hq * hd]

    def uses_row_kernel(self) -> bool:
        """Whether causal attention goes through kvrag's AVX-512 row kernel (see `row_kernel_serves`)."""
        return row_kernel_serves(self.cfg.head_dim, self.attention_dtype, self.device)

    def rows_read_after(self, layer: int, n_rows: int) -> slice:
        """Which of a prefill's n_rows need their attention and MLP output at `layer`: all of them, except at
        the last layer, after which only the last position is read (for the next-token logits). Every row's
        K and V at that layer are still computed: the decoder needs them, not the rows' outputs."""
        return slice(n_rows - 1, n_rows) if layer == self.cfg.n_layers - 1 else slice(0, n_rows)

    def finish(self, layer: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, MLP, residual: rows h [R, D], attn [R, Hq*hd] -> [R, D]."""
        w = self.layers[layer]
        h = h + F.linear(attn, w.wo)
        if h.shape[0] <= MLP_ROWS:
            return self._mlp_residual(w, h)
        out = torch.empty_like(h)  # [R, D]
        for start in range(0, h.shape[0], MLP_ROWS):  # rows are independent: the same numbers as one call
            out[start:start + MLP_ROWS] = self._mlp_residual(w, h[start:start + MLP_ROWS])
        return out

    def _mlp_residual(self, w: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        """h + MLP(norm(h)) for rows h [R, D]."""
        gate, up = F.linear(self.rms_norm(h, w.mlp_norm), w.w_gate_up).chunk(2, dim=-1)  # [R, I] each
        return h + F.linear(F.silu(gate) * up, w.w_down)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: h [R, D] -> float32 logits [R, V].

        In bf16 every logit is rounded to 8 significant bits (steps of 0.125 near 20), so the top two
        candidates often tie exactly and greedy decoding picks the lower token id, not the likelier token.
        The RESCORED best candidates are therefore computed again in float32 from the float32-normalised
        hidden state: the head of the distribution is exact, the tail keeps its bf16 rounding.
        """
        normed = self._normed(h)  # [R, D] float32, shared by both heads
        return self.rescored(F.linear(self.final_norm * normed.to(h.dtype), self.lm_head).float(), normed)

    def rescored(self, out: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """The head's logits out [R, V] (float32 holding bf16 values) with each row's RESCORED best computed again
        in float32 from its float32-normalised final hidden state normed [R, D] (see `logits`), in place."""
        if self.dtype != torch.float32:
            top = out.topk(min(RESCORED, out.shape[-1]), dim=-1).indices  # [R, K]
            exact = torch.einsum("rd,rkd->rk", self.final_norm.float() * normed, self.lm_head[top].float())  # [R, K]
            out.scatter_(-1, top, exact)
        return out

    # ---- reference path ---------------------------------------------------------------------

    def full_forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None,
                     all_logits: bool = False, into: DecodeCache | None = None) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Plain causal prefill of ids [T]: logits ([T, V] or last row [1, V]) and per-layer (k, v).

        Returned keys are before rotary ([T, Hkv, hd]), values as they are. With `into` (a DecodeCache), each
        layer's rotated keys and values are written to its first T rows instead, and no (k, v) are returned.
        """
        if positions is None:
            positions = torch.arange(ids.shape[0])
        positions = positions.to(self.device)
        h = self.embed(ids)
        rope = self.positions_cos_sin(positions)
        kv = []
        n = ids.shape[0]
        for layer in range(self.cfg.n_layers):
            qkv = self.project(layer, h, positions, rope)
            k_rot = self.rotate_keys(qkv.k, positions, rope, out=None if into is None else into.k[layer, :n])
            v = qkv.v
            if into is None:
                kv.append((qkv.k, qkv.v))
            else:
                v = into.v[layer, :n]
                v.copy_(qkv.v)
            out = slice(None) if all_logits else self.rows_read_after(layer, h.shape[0])
            h = self.finish(layer, h[out], self.attend(qkv.q[out], positions[out], k_rot, v, positions))
        return self.logits(h), kv  # h: every row, or the last alone (rows_read_after)


def row_kernel_serves(head_dim: int, attn_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether prefill attention runs in kvrag's AVX-512 row kernel: float32 attention on a CPU that has it (on
    this project's 2-core AVX512 machine, causal attention over 6.3k tokens 265 vs 345 ms a layer in SDPA's flash
    kernel; a blend's ≈980 scattered rows 51-61 vs 70-88 ms; with a bf16 model's Q.K in bf16 pairs, 200 and 35 ms)."""
    return device.type == "cpu" and attn_dtype == torch.float32 and row_attention.supports(head_dim)


def _is_causal_tail(q_pos: torch.Tensor, k_pos: torch.Tensor) -> bool:
    """True when keys are positions 0..S-1 in order and queries are the last R of them, in order."""
    n, r = k_pos.shape[0], q_pos.shape[0]
    if r == 0 or r > n or int(k_pos[0]) != 0 or int(k_pos[-1]) != n - 1 or int(q_pos[0]) != n - r:
        return False
    return bool((q_pos[1:] - q_pos[:-1] == 1).all()) and bool((k_pos[1:] - k_pos[:-1] == 1).all())


RESCORED = 64  # top bf16 logits computed again in float32 (see Transformer.logits)
# MLP rows per call: the [R, 2I] intermediate of a whole prompt is tens of MB; in 1,024-row slices (6 MB in bf16)
# blend@0.15's layer 0 ran 1.6 % faster on MuSiQue items 0-6 (full prefill unchanged), with bit-equal logits
MLP_ROWS = 1024
FEW_ROWS = 8  # decoding: this many query rows over every key go through two float32 matmuls


def _attend_few_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int) -> torch.Tensor:
    """Attention of a few query rows q [R, Hq, hd] over all keys k/v [S, Hkv, hd] -> [R, Hq * hd].

    A decode step's shape: SDPA's CPU kernel took 4 ms a layer for one row over 6.3k bf16 keys, these two
    float32 matmuls 1.4 ms (scores and softmax in float32, as SDPA accumulates).
    """
    r, hq, hd = q.shape
    qg = q.float().view(r, -1, group, hd).permute(1, 0, 2, 3).reshape(-1, r * group, hd)  # [Hkv, R*g, hd]
    scores = torch.matmul(qg, k.float().permute(1, 2, 0)) * hd ** -0.5  # [Hkv, R*g, S]
    out = torch.matmul(scores.softmax(-1), v.float().permute(1, 0, 2))  # [Hkv, R*g, hd]
    return out.view(-1, r, group, hd).permute(1, 0, 2, 3).reshape(r, hq * hd).to(q.dtype)


BLOCK_ROWS = 192  # scattered query rows per block: at R≈940 over 6.3k keys, 78 ms vs 356 ms as one block (bf16)


def _attend_row_blocks(sdpa, qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """Masked attention of scattered query rows (sorted positions) over keys at positions 0..S-1.

    qh [1, Hq, R, hd], kh/vh [1, Hkv, S, hd] -> [1, Hq, R, hd]; `sdpa` is SDPA with the model's GQA setting.
    A mask does not skip work, so one [R, S] mask pays for every key after each row's position: half the scores, on average, for rows spread
    over the prompt (CacheBlend's selected tokens). Cut into blocks of consecutive rows, each block
    only reads the keys up to its last row's position — close to causal attention's cost.
    """
    n_rows = qh.shape[2]
    n_blocks = max(1, n_rows // BLOCK_ROWS)
    bounds = [n_rows * i // n_blocks for i in range(n_blocks + 1)]
    outs = []
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        end = min(int(q_pos[stop - 1]) + 1, kh.shape[2])  # keys this block can see
        key_pos = torch.arange(end, device=q_pos.device)
        mask = key_pos[None, :] <= q_pos[start:stop, None]  # [rows, end]
        outs.append(sdpa(qh[:, :, start:stop], kh[:, :, :end], vh[:, :, :end], attn_mask=mask))
    return torch.cat(outs, dim=2)


SEGMENT_KEYS = 1024  # keys per segment: at R≈980 over 6.3k keys (bf16, 2 cores) 18.7 ms vs 24 ms in row blocks
# The rows inside a segment go in this many groups, each reading the segment's keys only up to its own last row:
# a masked call pays for every key up to its end, so one group wastes half a segment a row on average, two a
# third. 2: 72.0 vs 74.8 ms a blended layer (bf16), 65.9 vs 68.1 ms (float32); 3 gains nothing more.
MASKED_GROUPS = 2
# The CPU flash kernel behind SDPA, called directly because it also returns each row's log-sum-exp (public
# SDPA does not); with it, partial attentions over key segments merge exactly. Absent: row blocks instead.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attend_key_segments_grouped(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, q_pos: torch.Tensor,
                                 group: int, plans: SegmentPlans) -> torch.Tensor:
    """`_attend_key_segments` with each KV head's query heads stacked as rows of one head.

    qh [1, Hq, R, hd], kh/vh [1, Hkv, S, hd] -> [1, Hq, R, hd]. Query head h reads KV head h // group, so the
    group's rows go in as [1, Hkv, R * group, hd], row r of head j at r * group + j (positions stay sorted):
    the kernel then reads each K/V block once for `group` times as many rows, and takes no GQA path
    (74 vs 79 ms a blended layer at R≈980 over 6.3k keys, bf16, 2 cores).
    """
    if group == 1:
        return _attend_key_segments(qh, kh, vh, q_pos, plans)
    _, n_heads, n_rows, hd = qh.shape
    n_kv = kh.shape[1]
    stacked = qh.view(n_kv, group, n_rows, hd).transpose(1, 2).reshape(1, n_kv, n_rows * group, hd)
    out = _attend_key_segments(stacked, kh, vh, q_pos.repeat_interleave(group), plans)  # [1, Hkv, R * group, hd]
    return out.view(n_kv, n_rows, group, hd).transpose(1, 2).reshape(1, n_heads, n_rows, hd)


def _attend_key_segments(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, q_pos: torch.Tensor,
                         plans: SegmentPlans) -> torch.Tensor:
    """Masked attention of scattered query rows (sorted positions) over keys at positions 0..S-1, by key segment.

    qh [1, Hq, R, hd], kh/vh [1, Hkv, S, hd] -> [1, Hq, R, hd]. Each segment of SEGMENT_KEYS keys is attended
    by exactly the rows at or after its start: rows past its end in one unmasked call, rows inside it with a
    small mask. So every row reads only the keys it sees, as causal attention does (row blocks read up to
    their last row). The parts merge by their log-sum-exp in float32: softmax over the union of segments.
    """
    plan = plans.get(q_pos, min(kh.shape[2], int(q_pos[-1]) + 1), qh.dtype)
    acc = torch.zeros(qh.shape, dtype=torch.float32, device=qh.device)  # [1, Hq, R, hd]: merged output so far
    lse = torch.full(qh.shape[:3], float("-inf"), device=qh.device)  # [1, Hq, R]: its log-sum-exp
    for r0, r1, k0, k1, mask in plan.parts:
        _merge(acc, lse, r0, r1, *_FLASH_CPU(qh[:, :, r0:r1], kh[:, :, k0:k1], vh[:, :, k0:k1], attn_mask=mask))
    return acc.to(qh.dtype)


@dataclass(frozen=True)
class _SegmentPlan:
    """How sorted query positions q_pos [R] read keys 0..n_keys-1 in segments of segment_keys, as parts
    (r0, r1, k0, k1, mask): rows r0..r1-1 attend keys k0..k1-1, with mask [r1 - r0, k1 - k0] (-inf on keys
    past each row's position, in the attention dtype) where some rows lie inside the keys, else None."""

    q_pos: torch.Tensor
    n_keys: int
    segment_keys: int
    masked_groups: int
    dtype: torch.dtype
    parts: tuple[tuple[int, int, int, int, torch.Tensor | None], ...]

    def serves(self, q_pos: torch.Tensor, n_keys: int, dtype: torch.dtype) -> bool:
        return (self.n_keys == n_keys and self.segment_keys == SEGMENT_KEYS and self.masked_groups == MASKED_GROUPS
                and self.dtype == dtype and self.q_pos.shape == q_pos.shape and self.q_pos.device == q_pos.device
                and torch.equal(self.q_pos, q_pos))


class SegmentPlans:
    """The last plan built, per model. Every blended layer after the last selection attends the same rows, so the
    plan (its masks above all: ≈2 ms a layer to build) is made once per prompt instead of once per layer."""

    def __init__(self):
        self.last: _SegmentPlan | None = None

    def get(self, q_pos: torch.Tensor, n_keys: int, dtype: torch.dtype) -> _SegmentPlan:
        if self.last is None or not self.last.serves(q_pos, n_keys, dtype):
            self.last = _segment_plan(q_pos, n_keys, dtype)
        return self.last


def _segment_plan(q_pos: torch.Tensor, n_keys: int, dtype: torch.dtype) -> _SegmentPlan:
    n_rows = q_pos.shape[0]
    bounds = torch.arange(0, n_keys, SEGMENT_KEYS, device=q_pos.device)
    first_rows = torch.searchsorted(q_pos, bounds).tolist()  # first row that sees each segment
    last_masked = torch.searchsorted(q_pos, (bounds + SEGMENT_KEYS - 1).clamp(max=n_keys - 1)).tolist()
    parts = []
    for start, r0, r1 in zip(bounds.tolist(), first_rows, last_masked, strict=True):
        stop = min(start + SEGMENT_KEYS, n_keys)
        cuts = [r0 + (r1 - r0) * i // MASKED_GROUPS for i in range(MASKED_GROUPS + 1)]
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):  # rows inside the segment, in groups
            if b > a:
                end = int(q_pos[b - 1]) + 1  # the group's last row sees no key past its own position
                later = torch.arange(start, end, device=q_pos.device)[None, :] > q_pos[a:b, None]  # [rows, keys]
                mask = torch.zeros((), dtype=dtype, device=q_pos.device).masked_fill(later, float("-inf"))
                parts.append((a, b, start, end, mask))
        if r1 < n_rows:  # rows after the segment see all of it
            parts.append((r1, n_rows, start, stop, None))
    return _SegmentPlan(q_pos.clone(), n_keys, SEGMENT_KEYS, MASKED_GROUPS, dtype, tuple(parts))


def _merge(acc: torch.Tensor, lse: torch.Tensor, r0: int, r1: int, out: torch.Tensor, out_lse: torch.Tensor) -> None:
    """Fold one segment's attention (out [1, Hq, r, hd], out_lse [1, Hq, r]) into rows r0..r1-1 of the sums."""
    old = lse[:, :, r0:r1]
    new = torch.logaddexp(old, out_lse)
    acc[:, :, r0:r1].mul_(torch.exp(old - new)[..., None]).add_(out.float() * torch.exp(out_lse - new)[..., None])
    lse[:, :, r0:r1] = new


def _is_sorted(pos: torch.Tensor) -> bool:
    return pos.numel() > 0 and bool((pos[1:] >= pos[:-1]).all())


def _is_arange(pos: torch.Tensor) -> bool:
    n = pos.shape[0]
    return n > 0 and int(pos[0]) == 0 and int(pos[-1]) == n - 1 and bool((pos[1:] - pos[:-1] == 1).all())


def _is_plain_causal(q_pos: torch.Tensor, k_pos: torch.Tensor) -> bool:
    """True when queries and keys are the same increasing positions: SDPA's is_causal is exact then."""
    if q_pos.shape != k_pos.shape or q_pos.numel() == 0:
        return False
    return bool((q_pos == k_pos).all()) and bool((q_pos[1:] > q_pos[:-1]).all())
