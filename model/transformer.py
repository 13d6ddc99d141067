"""Our own layer-by-layer forward for Llama-family models (Llama, Mistral, Qwen2, Qwen3, Phi-3) and Gemma 2 / 3 (their
differences in model/gemma.py) over HF weights.

The forward is split into per-layer primitives so that blending can run any layer on any subset
of token rows at explicit absolute positions, and read or replace that layer's K (before rotary)
and V:

    h = embed(ids)                                   # [T, D]
    for layer in range(n_layers):
        qkv = model.project(layer, h, positions)     # q rotated; k *before* rotary; v
        k_rot = model.rotate_keys(k_all, key_pos, layer=layer)  # rotate a fresh copy at use time
        a = model.attend(qkv.q, positions, k_rot, v_all, key_pos)
        h = model.finish(layer, h, a)
    logits = model.logits(h[-1:])

model/step.py runs that loop for every forward (full prefill, prefix extension, blend, decode); `prefill.extend` with no
prefix is the plainest of them, the reference the tests hold against transformers' own logits.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from kvrag.errors import KvragError
from kvrag.kernels import attention
from kvrag.kernels.decode_step import LAYER_TENSORS, StepWeights
from kvrag.model import gemma, rotary
from kvrag.model.config import ModelConfig
from kvrag.model.device import attention_dtype
from kvrag.model.quant import QuantWeight, from_state, head_rows, linear, state_of


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [D]
    wqkv: torch.Tensor | QuantWeight  # [(Hq + 2*Hkv) * hd, D]  q, k, v projections fused into one matmul
    bqkv: torch.Tensor | None  # [(Hq + 2*Hkv) * hd]  Qwen2's q/k/v bias
    wo: torch.Tensor | QuantWeight  # [D, Hq * hd]
    mlp_norm: torch.Tensor  # [D]
    w_gate_up: torch.Tensor | QuantWeight  # [2 * I, D]  gate and up fused
    w_down: torch.Tensor | QuantWeight  # [D, I]
    q_norm: torch.Tensor | None = None  # [hd]  Qwen3's RMSNorm over each query head, before rotary
    k_norm: torch.Tensor | None = None  # [hd]  and over each key head
    post_attn_norm: torch.Tensor | None = None  # [D]  Gemma: a norm of the attention output before the residual add
    post_mlp_norm: torch.Tensor | None = None  # [D]  and of the MLP's output


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
        self.is_gemma = cfg.gemma  # read at every norm: an attribute, not the config's property
        self.inv_freq = rotary.inverse_frequencies(cfg).to(self.device)  # [rotary_dim/2]
        # Gemma 3's sliding layers rotate by their own theta: positions_cos_sin then gives both variants side by side
        # ([T, 2, rot]: global, local) and layer_rope picks a layer's; None for every other model ([T, 1, rot])
        self.local_inv_freq = rotary.inverse_frequencies(cfg, local=True).to(self.device) \
            if cfg.rope_local_theta is not None else None  # [rotary_dim/2]
        self.attend_plans = attention.AttendPlans()  # what the last positions are, and their plan, for the next layer
        # Triton kernels (kernels/triton_*.py) for scattered-row and paged decode attention: Runtime.load sets it
        # (device.resolve_triton: on a GPU unless KVRAG_KERNELS=torch); on a CPU only in tests, under TRITON_INTERPRET
        self.triton = False
        self.native = True  # kvrag's C++ CPU kernels where they serve (config.py's native; Runtime.load sets it)
        self.weights = "dense"  # the layer matrices' form: dense, int8 or int4 (Runtime.load sets it)

    # The native decode step (kernels/decode.cpp) computes a Llama-shaped layer and the Triton and row kernels plain
    # causal attention: a model with more (q/k norms, a partial rotary, sliding windows) runs torch's ops instead of
    # teaching them every family. `native` and `triton` read False for such a model whatever Runtime.load set.
    @property
    def native(self) -> bool:
        return self._native and self.cfg.plain

    @native.setter
    def native(self, on: bool) -> None:
        self._native = on

    @property
    def triton(self) -> bool:
        return self._triton and self.cfg.plain_attention

    @triton.setter
    def triton(self, on: bool) -> None:
        self._triton = on

    def compute_state(self) -> dict[str, torch.Tensor]:
        """Every weight as the forward uses it (fused, cast): what model/prepared.py caches on disk."""
        named = {"embed_tokens": self.embed_tokens, "final_norm": self.final_norm}
        if self.lm_head is not self.embed_tokens:
            named["lm_head"] = self.lm_head
        for i, layer in enumerate(self.layers):
            named.update({f"layers.{i}.{name}": t for name, t in vars(layer).items() if t is not None})
        state = {}
        for name, t in named.items():  # a quantized matrix as its packed weights and scales (model/quant.py)
            state.update(state_of(name, t) if isinstance(t, QuantWeight) else {name: t})
        return state

    @classmethod
    def from_compute_state(cls, cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype,
                           device: torch.device | str = "cpu") -> Transformer:
        """The inverse of `compute_state`: no fusing or casting left to do."""
        model = cls.__new__(cls)
        model._setup(cfg, dtype, device)
        if any(t.dtype != dtype for k, t in state.items() if t.is_floating_point() and not k.endswith((".scales", ".mins"))):
            raise KvragError("prepared weights are not in the requested dtype")
        model.embed_tokens, model.final_norm = state["embed_tokens"], state["final_norm"]
        model.lm_head = from_state(state, "lm_head", dtype)
        if model.lm_head is None:
            model.lm_head = model.embed_tokens
        model.layers = [LayerWeights(**{f.name: from_state(state, f"layers.{i}.{f.name}", dtype)
                                        for f in fields(LayerWeights)}) for i in range(cfg.n_layers)]
        return model

    def _layer_weights(self, i: int, take, tensors) -> LayerWeights:
        p = f"model.layers.{i}."
        attn = p + "self_attn."

        def fused(whole: str, parts: list[str]) -> torch.Tensor:  # Phi-3 keeps qkv_proj and gate_up_proj fused
            return take(whole) if whole in tensors else torch.cat([take(name) for name in parts])

        bqkv = None
        if self.cfg.qkv_bias or (attn + "q_proj.bias") in tensors:
            bqkv = torch.cat([take(attn + "q_proj.bias"), take(attn + "k_proj.bias"), take(attn + "v_proj.bias")])
        qk_norm, g = self.cfg.qk_norm, self.cfg.gemma
        return LayerWeights(
            attn_norm=take(p + "input_layernorm.weight"),
            wqkv=fused(attn + "qkv_proj.weight", [attn + f"{x}_proj.weight" for x in "qkv"]),
            bqkv=bqkv,
            wo=take(attn + "o_proj.weight"),
            mlp_norm=take(p + ("pre_feedforward_layernorm.weight" if g else "post_attention_layernorm.weight")),
            w_gate_up=fused(p + "mlp.gate_up_proj.weight", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
            w_down=take(p + "mlp.down_proj.weight"),
            q_norm=take(attn + "q_norm.weight") if qk_norm else None,
            k_norm=take(attn + "k_norm.weight") if qk_norm else None,
            post_attn_norm=take(p + "post_attention_layernorm.weight") if g else None,
            post_mlp_norm=take(p + "post_feedforward_layernorm.weight") if g else None,
        )

    @classmethod
    def from_safetensors(cls, cfg: ModelConfig, files: list[Path], dtype: torch.dtype,
                         device: torch.device | str = "cpu") -> Transformer:
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    text_name = gemma.text_model_name(name)  # a multimodal checkpoint's language model alone
                    if text_name is not None:
                        tensors[text_name] = sf.get_tensor(name)
        return cls(cfg, tensors, dtype, device)

    # ---- primitives -------------------------------------------------------------------------

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm computed in float32 and cast back, as transformers does."""
        return self._weighted(self._normed(x), weight, x.dtype)

    def _weighted(self, normed: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A norm's weight applied to float32 normed rows [R, D] -> dtype: Llama's weight * normed in dtype, Gemma's
        normed * (1 + weight) in float32 before the cast (as each family's HF norm does)."""
        if self.is_gemma:
            return (normed * (1.0 + weight.float())).to(dtype)
        return weight * normed.to(dtype)

    def _normed(self, x: torch.Tensor) -> torch.Tensor:
        """x / rms(x) in float32, before the norm's weight: [R, D]."""
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.cfg.rms_eps)  # one fused kernel

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> hidden [T, D] (Gemma's scaled by sqrt(D), the factor rounded to the model's dtype as in HF)."""
        h = self.embed_tokens[ids.to(self.device)]
        return h * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=self.dtype) if self.is_gemma else h

    def positions_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, rot] of `positions` [T]; [T, 2, rot] (global, local) for a model with a local rope theta,
        of which `layer_rope` picks a layer's (rows' rope is sliced by row: it travels with them either way)."""
        positions = positions.to(self.device)
        rope = rotary.cos_sin(self.inv_freq, positions, self.dtype, self.cfg.rope_scaling.attention_factor)
        if self.local_inv_freq is None:
            return rope
        local = rotary.cos_sin(self.local_inv_freq, positions, self.dtype)
        return torch.cat([rope[0], local[0]], dim=1), torch.cat([rope[1], local[1]], dim=1)

    def layer_rope(self, layer: int | None, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """`layer`'s cos, sin [T, 1, rot] out of positions_cos_sin's; the rope itself where every layer shares it."""
        if self.local_inv_freq is None:
            return rope
        if layer is None:
            raise KvragError("rotary of a model with a local rope theta needs its layer")
        v = 1 if self.cfg.local_rope(layer) else 0
        return rope[0][:, v:v + 1], rope[1][:, v:v + 1]

    def project(self, layer: int, h: torch.Tensor, positions: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None, prompt: bool = False) -> LayerQKV:
        """Attention-norm and q/k/v of rows h [T, D] at absolute `positions` [T].

        `rope` is `positions_cos_sin(positions)`, passed in when many layers share it.
        """
        c, w = self.cfg, self.layers[layer]
        x = self.rms_norm(h, w.attn_norm)
        qkv = linear(x, w.wqkv, w.bqkv, positions if prompt else None)  # [T, (Hq + 2*Hkv) * hd]
        nq, nk = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        q = self._head_norm(w.q_norm, qkv[:, :nq].view(-1, c.n_heads, c.head_dim))  # [T, Hq, hd]
        k = self._head_norm(w.k_norm, qkv[:, nq:nq + nk].view(-1, c.n_kv_heads, c.head_dim))  # [T, Hkv, hd]
        v = qkv[:, nq + nk:].view(-1, c.n_kv_heads, c.head_dim)  # [T, Hkv, hd]
        cos, sin = self.layer_rope(layer, rope if rope is not None else self.positions_cos_sin(positions))
        return LayerQKV(q=rotary.rotate(q, cos, sin), k=k, v=v)

    def _head_norm(self, weight: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        """Qwen3's per-head RMSNorm of q or k [T, H, hd] (over hd), where the model has one; else x itself."""
        return x if weight is None else self.rms_norm(x, weight)

    def attention_input(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """The attention norm of rows h [T, D]: what `project_kv` and `queries` take, computed once for both."""
        return self.rms_norm(h, self.layers[layer].attn_norm)

    def project_kv(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`project`'s k (before rotary) and v alone, each [T, Hkv, hd], from x = attention_input(layer, h):
        for rows whose queries are not needed."""
        c = self.cfg
        kv = self._qkv_columns(layer, x, slice(c.n_heads * c.head_dim, None))  # [T, 2 * Hkv * hd]
        k, v = kv.view(-1, 2, c.n_kv_heads, c.head_dim).unbind(1)  # [T, Hkv, hd] each
        return self._head_norm(self.layers[layer].k_norm, k), v

    def queries(self, layer: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """`project`'s q alone from x = attention_input(layer, h) [T, D], rotated by `rope` (their positions'
        cos, sin): [T, Hq, hd]."""
        c = self.cfg
        q = self._qkv_columns(layer, x, slice(0, c.n_heads * c.head_dim))  # [T, Hq * hd]
        q = self._head_norm(self.layers[layer].q_norm, q.view(-1, c.n_heads, c.head_dim))  # [T, Hq, hd]
        return rotary.rotate(q, *self.layer_rope(layer, rope))

    def _qkv_columns(self, layer: int, x: torch.Tensor, columns: slice) -> torch.Tensor:
        """Some output columns of the fused q/k/v projection (with their bias, if any) for rows x [T, D]."""
        w = self.layers[layer]
        return linear(x, w.wqkv[columns], None if w.bqkv is None else w.bqkv[columns])

    def rotate_keys(self, k: torch.Tensor, positions: torch.Tensor,
                    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                    out: torch.Tensor | None = None, layer: int | None = None) -> torch.Tensor:
        """Pre-rotary keys [S, Hkv, hd] of `layer` rotated to absolute `positions` [S] (into `out`, else a new
        tensor). `layer` may be None where every layer rotates alike (layer_rope)."""
        cos, sin = self.layer_rope(layer, rope if rope is not None else self.positions_cos_sin(positions))
        return rotary.rotate(k.to(self.dtype), cos, sin, out)

    def attend(self, q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               k_pos: torch.Tensor | None, layer: int | None = None,
               head: attention.PagedKeys | None = None) -> torch.Tensor:
        """Attention of queries q [R, Hq, hd] at q_pos [R] over rotated keys k and values v [S, Hkv, hd].

        A query at position p sees exactly the keys at positions <= p (absolute-position mask,
        never a bottom-right-aligned one). k_pos None means every key is visible (decoding).
        Runs in `attention_dtype` (float32 for bf16 on a CPU without AMX); returns [R, Hq * hd] in the model's dtype.
        `layer` picks the layer's sliding window, where the model has one (it may be None when all layers agree).
        `head`: the first keys stay in a paged pool (a cached prefix), k and v holding the rest.
        """
        window = self.cfg.window(layer)
        if head is not None and (self.is_gemma or window is not None):  # these paths read one tensor of keys
            k, v = head.join(k, v)
            head = None
        if self.is_gemma:
            return gemma.attend(self.cfg, q, q_pos, k, v, k_pos, window).to(self.dtype)
        if window is not None:
            return attention.attend_window(q, q_pos, k, v, k_pos, self.cfg.group_size, self.attention_dtype,
                                           window).to(self.dtype)
        return attention.attend(q, q_pos, k, v, k_pos, self.cfg.group_size, self.attention_dtype,
                                self.uses_row_kernel(), self.attend_plans, self.triton, head).to(self.dtype)

    def attend_latest(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        """A decode step's attention: q [R, Hq, hd] after every key k, v [S, Hkv, hd], the last being its own row
        (only the last `window` keys, where the layer slides) -> [R, Hq * hd]."""
        window = self.cfg.window(layer)
        if window is not None:
            k, v = k[-window:], v[-window:]
        if self.is_gemma:
            return gemma.attend(self.cfg, q, None, k, v, None, None).to(q.dtype)
        return attention.attend_few_rows(q, k, v, self.cfg.group_size)

    def step_weights(self) -> StepWeights:
        """What the native decode step reads (kernels/decode_step.py), in its order."""
        c = self.cfg
        def bare(t):  # a quantized matrix as the kernels read it
            return t.packed if isinstance(t, QuantWeight) else t

        layers = tuple(tuple(bare(getattr(w, name)) for name in LAYER_TENSORS) for w in self.layers)
        return StepWeights(c.n_layers, c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim, c.intermediate_size,
                           c.rms_eps, layers, bare(self.lm_head), self.final_norm)

    def uses_row_kernel(self) -> bool:
        """Whether causal attention goes through kvrag's AVX-512 row kernel (see `row_kernel_serves`)."""
        return self._native and self.cfg.plain_attention and attention.row_kernel_serves(self.cfg.head_dim, self.attention_dtype, self.device)

    def rows_read_after(self, layer: int, n_rows: int) -> slice:
        """Which of a prefill's n_rows need their attention and MLP output at `layer`: all of them, except at
        the last layer, after which only the last position is read (for the next-token logits). Every row's
        K and V at that layer are still computed: the decoder needs them, not the rows' outputs."""
        return slice(n_rows - 1, n_rows) if layer == self.cfg.n_layers - 1 else slice(0, n_rows)

    def finish(self, layer: int, h: torch.Tensor, attn: torch.Tensor,
               positions: torch.Tensor | None = None) -> torch.Tensor:
        """Output projection, residual, MLP, residual: rows h [R, D], attn [R, Hq*hd] -> [R, D]. `positions` [R]:
        a prompt's rows at those positions (quant.linear), None for decode rows."""
        w = self.layers[layer]
        out = linear(attn, w.wo, None, positions)  # [R, D]
        h = h + (out if w.post_attn_norm is None else self.rms_norm(out, w.post_attn_norm))
        if h.shape[0] <= MLP_ROWS:
            return self._mlp_residual(w, h, positions)
        out = torch.empty_like(h)  # [R, D]
        for start in range(0, h.shape[0], MLP_ROWS):  # rows are independent: the same numbers as one call
            part = slice(start, start + MLP_ROWS)
            out[part] = self._mlp_residual(w, h[part], None if positions is None else positions[part])
        return out

    def _mlp_residual(self, w: LayerWeights, h: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """h + MLP(norm(h)) for rows h [R, D] (Gemma: gelu-tanh, and the output normed too)."""
        gate, up = linear(self.rms_norm(h, w.mlp_norm), w.w_gate_up, None, positions).chunk(2, dim=-1)  # [R, I]
        act = F.gelu(gate, approximate="tanh") if self.is_gemma else F.silu(gate)  # [R, I]
        out = linear(act * up, w.w_down, None, positions)  # [R, D]
        return h + (out if w.post_mlp_norm is None else self.rms_norm(out, w.post_mlp_norm))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: h [R, D] -> float32 logits [R, V].

        In bf16 every logit is rounded to 8 significant bits (steps of 0.125 near 20), so the top two
        candidates often tie exactly and greedy decoding picks the lower token id, not the likelier token.
        The RESCORED best candidates are therefore computed again in float32 from the float32-normalised
        hidden state: the head of the distribution is exact, the tail keeps its bf16 rounding.
        """
        normed = self._normed(h)  # [R, D] float32, shared by both heads
        head = linear(self._weighted(normed, self.final_norm, h.dtype), self.lm_head)  # [R, V]
        out = self.rescored(head.float(), normed)
        return gemma.softcap(out, self.cfg.final_softcap)  # monotonic: the rescored best stay the best

    def rescored(self, out: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """The head's logits out [R, V] (float32 holding bf16 values) with each row's RESCORED best computed again
        in float32 from its float32-normalised final hidden state normed [R, D] (see `logits`), in place."""
        if self.dtype != torch.float32:
            top = out.topk(min(RESCORED, out.shape[-1]), dim=-1).indices  # [R, K]
            exact = torch.einsum("rd,rkd->rk", self._weighted(normed, self.final_norm, torch.float32),
                                 head_rows(self.lm_head, top).float())  # [R, K]
            out.scatter_(-1, top, exact)
        return out


RESCORED = 64  # top bf16 logits computed again in float32 (see Transformer.logits)
# MLP rows per call: a whole prompt's [R, 2I] intermediate is tens of MB; 1,024-row slices (6 MB in bf16) ran a
# blend's layer 0 slightly faster, with bit-equal logits
MLP_ROWS = 1024
