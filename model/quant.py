"""Weight-only quantized linear layers (`--weights int8|int4|mixed`): every layer's matrices and the LM head held as
kernels/quant.py packs them, the embedding table and the norms kept as they are. `mixed` holds each matrix in 4 bits
where 4 bits give its values back at least as closely as 8 (a GGUF's own 4-bit blocks come back almost exactly), else
in 8: what llama.cpp reads of a Q4_K_M file, in half int8's bytes and closer to the checkpoint than int8.

A product runs quant.cpp's integer kernel (VNNI dot products over a quarter or a sixth of float32's bytes); with
AMX, a bf16 model's products of many rows (DENSE_ROWS) run AMX's bf16 matmul over the matrix dequantized for the
call instead (docs/quantized.md has the measurements). Where the kernel cannot run, `resolve_weights` keeps the
model dense.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvrag.errors import KvragError
from kvrag.kernels import quant
from kvrag.kernels.cpu import cpu_has_amx
from kvrag.kernels.decode_step import MATRICES

WEIGHTS = ("auto", "dense", "int8", "int4", "mixed")  # auto: the model's own default where the kernel runs, else dense
# The quantized form a model may default to: int8 kept the dense model's greedy tokens far better than int4
# (docs/quantized.md), so int4 is asked for by name. Which models default to it: model/names.py's `weights`
DEFAULT_WEIGHTS = "int8"
BITS = {"int8": 8, "int4": 4, "mixed": None}  # None: each matrix's own (`packed_for`)
# On an AMX CPU a bf16 model's prompt rows at positions from this one on (and decode calls of more rows) multiply by
# the matrix dequantized for the call (AMX's bf16 matmul), the rest through the integer kernel: where the two
# crossed (docs/quantized.md)
DENSE_ROWS = 128
RECIPE = 1  # how quantize_layers and kernels/quant.py quantize: part of a prepared file's name (model/prepared.py)


@dataclass(frozen=True)
class QuantWeight:
    """A matrix W [N, K] quantized in groups of quant.GROUP inputs (kernels/quant.py), and the model's dtype."""

    packed: quant.Packed
    dtype: torch.dtype  # what a product returns

    @classmethod
    def of(cls, w: torch.Tensor, bits: int) -> QuantWeight:
        return cls(quant.Packed.of(w, bits), w.dtype)

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape

    @property
    def bits(self) -> int:
        return self.packed.bits

    @property
    def device(self) -> torch.device:
        return self.packed.weights.device

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    def __getitem__(self, rows: slice) -> QuantWeight:
        """Output rows start:stop of the matrix, both on a tile's boundary (the q/k/v projection's parts)."""
        start, stop, _ = rows.indices(self.shape[0])
        if start % quant.TILE or stop % quant.TILE:
            raise KvragError(f"rows {start}:{stop} of a quantized matrix cut a tile of {quant.TILE}")
        return QuantWeight(self.packed.tiles(slice(start // quant.TILE, stop // quant.TILE)), self.dtype)

    def dense(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The matrix's values [N, K] (q x scale, + min) in dtype (default the model's)."""
        return quant.dequantize(self.packed, dtype or self.dtype)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` [...] of the dense matrix, [..., K]: only their tiles are unpacked."""
        tiles, inverse = torch.unique(index.reshape(-1) // quant.TILE, return_inverse=True)
        part = quant.dequantize(self.packed.tiles(tiles), self.dtype)  # [T * 16, K]
        return part[inverse * quant.TILE + index.reshape(-1) % quant.TILE].reshape(*index.shape, -1)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               positions: torch.Tensor | None = None) -> torch.Tensor:
        """x [R, K] @ W^T (+ bias) -> [R, N] in the model's dtype. `positions` [R]: the rows are a prompt's, at
        those positions (None: decode rows, or rows no cache keeps)."""
        if not quant.available():  # no activation rounding, and slow: resolve_weights keeps such a model dense
            return F.linear(x, self.dense(x.dtype), bias)
        if x.dtype != torch.bfloat16 or not cpu_has_amx():
            return self._integer(x, bias)
        if positions is None:  # by the call's rows: AMX's bf16 matmul for many
            return self._amx(x, bias) if x.shape[0] > DENSE_ROWS else self._integer(x, bias)
        # A prompt row's arithmetic follows its position, not how many rows share the call, so that a prefix hit's
        # tail computes as a fresh full prefill of the same prompt did: the first DENSE_ROWS through the integer
        # kernel, the rest through AMX
        wide = positions >= DENSE_ROWS  # [R]
        if bool(wide.all()):
            return self._amx(x, bias)
        if not bool(wide.any()):
            return self._integer(x, bias)
        out = torch.empty(x.shape[0], self.shape[0], dtype=self.dtype, device=x.device)  # [R, N]
        out[wide], out[~wide] = self._amx(x[wide], bias), self._integer(x[~wide], bias)
        return out

    def _amx(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [R, K] bf16 times the matrix dequantized for this call (AMX's bf16 matmul) -> [R, N]."""
        out = torch.matmul(x, quant.dequantize_t(self.packed, torch.get_num_threads()))  # [R, N]
        return out if bias is None else out + bias

    def _integer(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [R, K] through the integer kernel (activations rounded per row and group) -> [R, N]."""
        out = quant.matmul(self.packed, x, torch.get_num_threads())  # [R, N] float32
        return (out if bias is None else out + bias.float()).to(self.dtype)


def linear(x: torch.Tensor, w: torch.Tensor | QuantWeight, bias: torch.Tensor | None = None,
           positions: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear over a dense or a quantized matrix: x [R, K] -> [R, N]; `positions` [R] where they are a prompt's
    rows (QuantWeight.linear)."""
    return w.linear(x, bias, positions) if isinstance(w, QuantWeight) else F.linear(x, w, bias)


def head_rows(w: torch.Tensor | QuantWeight, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` of a dense or quantized matrix (the LM head's best candidates, rescored)."""
    return w.rows(index) if isinstance(w, QuantWeight) else w[index]


def resolve_weights(weights: str, device: torch.device, native: bool = True, default: str = DEFAULT_WEIGHTS) -> str:
    """The weights' form a setting (config.py's `weights`) gives on this device: dense, int8, int4 or mixed; KvragError
    where a quantized form cannot run here. `default`: what auto gives where the kernel runs (the model's own,
    model/names.py's default_weights). `native` False (KVRAG_NATIVE=0: kvrag's C++ kernels off) leaves the
    integer kernels off too, so auto is dense."""
    if weights not in WEIGHTS:
        raise KvragError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if weights not in ("auto", "dense") and not native:
        raise KvragError(f"--weights {weights} runs kvrag's native kernels, which KVRAG_NATIVE=0 turns off "
                         "(use --weights dense)")
    runs = device.type == "cpu" and native and quant.available()
    if weights == "auto":
        return default if runs else "dense"
    if weights != "dense" and not runs:
        raise KvragError(f"--weights {weights} runs on a CPU with AVX512-VNNI and kvrag's kernels built; "
                         f"this {device.type} has no such kernel (use --weights dense)")
    return weights


def packed_for(w: torch.Tensor, weights: str) -> quant.Packed:
    """A layer matrix w [N, K] packed in the form's bits, or for `mixed` in 4 bits where they give back w's values at
    least as closely as 8 (the dequantized matrix's error), else in 8: each form quantized once."""
    if BITS[weights] is not None:
        return quant.Packed.of(w, BITS[weights])
    four, eight = quant.Packed.of(w, 4), quant.Packed.of(w, 8)
    error = {p.bits: float((quant.dequantize(p) - w.float()).norm()) for p in (four, eight)}
    return four if error[4] <= error[8] else eight


def quantize_layers(model, weights: str) -> None:
    """Replace the model's layer matrices and LM head by their `weights` form, in place: int8 all in 8 bits; int4
    the layers' matrices in 4 bits and the head in 8, as GGUF's 4-bit files keep their output tensor at 6-8 bits
    (the head decides every token; docs/quantized.md); mixed each layer matrix as `packed_for` picks, the head in 8.
    A matrix whose shape does not fit the kernel's tiles (N % 16, K % 32; q/k/v's parts each a multiple of 16)
    stays dense."""
    c = model.cfg
    split = (c.n_heads * c.head_dim) % quant.TILE == 0 and (c.n_kv_heads * c.head_dim) % quant.TILE == 0

    def fits(w: torch.Tensor) -> bool:
        return w.shape[0] % quant.TILE == 0 and w.shape[1] % quant.GROUP == 0

    for layer in model.layers:
        for name in MATRICES:  # LayerWeights' linear layers
            w = getattr(layer, name)
            if fits(w) and (name != "wqkv" or split):  # q, k and v are read apart, each in whole tiles
                setattr(layer, name, QuantWeight(packed_for(w, weights), w.dtype))
    if fits(model.lm_head):
        model.lm_head = QuantWeight.of(model.lm_head, 8)


def state_of(name: str, w: QuantWeight) -> dict[str, torch.Tensor]:
    """A quantized matrix as named tensors (model/prepared.py's file): name.q8 or name.q4, name.scales and int4's
    name.mins."""
    p = w.packed
    state = {f"{name}.q{p.bits}": p.weights, f"{name}.scales": p.scales}
    return state if p.mins is None else {**state, f"{name}.mins": p.mins}


def from_state(state: dict[str, torch.Tensor], name: str, dtype: torch.dtype) -> torch.Tensor | QuantWeight | None:
    """`name`'s tensor from a state written with `state_of` for quantized matrices: dense, quantized or None."""
    for bits in quant.BITS:
        if f"{name}.q{bits}" in state:
            packed = quant.Packed(state[f"{name}.q{bits}"], state[f"{name}.scales"], state.get(f"{name}.mins"), bits)
            return QuantWeight(packed, dtype)
    return state.get(name)
