"""Weight-only quantized linear layers (`--weights int8|int4|mixed`): every layer's matrices and the LM head held as
kernels/quant.py packs them, the embedding table and the norms kept as they are. `mixed` holds each matrix in 4 bits
where 4 bits give its values back at least as closely as 8 (a GGUF's own 4-bit blocks come back almost exactly), else
in 8: what llama.cpp reads of a Q4_K_M file, in half int8's bytes and closer to the checkpoint than int8.

A product runs quant.cpp's integer kernel (VNNI dot products over a quarter or a sixth of float32's bytes); with
AMX, a bf16 model's products of many rows (DENSE_ROWS) run AMX's bf16 matmul over the matrix dequantized for the
call instead (docs/quantized.md has the measurements). Where kvrag's kernel does not run (an ARM or older x86
CPU, KVRAG_ISA=none), a CPU runs the products on torch's own weight-only ops (kernels/torch_quant.py), each matrix
put into their layout once at load (`use_torch_ops`); a quantized form is then run only when asked for by name
(`resolve_weights`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from kvrag.errors import KvragError
from kvrag.kernels import quant, torch_quant
from kvrag.kernels.decode_step import MATRICES
from kvrag.kernels.native import cpu_has_amx
from kvrag.model.device import resolve_dtype

WEIGHTS = ("auto", "dense", "int8", "int4", "mixed")  # auto: the model's own default where the kernel runs, else dense
# The quantized form a model may default to: int8 kept the dense model's greedy tokens far better than int4
# (docs/quantized.md), so int4 is asked for by name. Which models default to it: model/names.py's `weights`
DEFAULT_WEIGHTS = "int8"
BITS = {"int8": 8, "int4": 4, "mixed": None}  # None: each matrix's own (`packed_for`)
# On an AMX CPU a bf16 model's prompt rows at positions from this one on (and decode calls of more rows) multiply by
# the matrix dequantized for the call (AMX's bf16 matmul), the rest through the integer kernel: where the two
# crossed (docs/quantized.md)
DENSE_ROWS = 128
# torch's int8 op reads its weights again for every 4 rows: past 64 rows (a prompt's from position 64) the matrix
# dequantized for the call and a float32 matmul were faster (Qwen2.5-Coder-1.5B's gate/up on 2 cores: 358 against
# 400 ms at 64 rows, 652 against 437 at 128). torch's int4 op stays ahead to beyond 1,024 rows (MLP_ROWS), as
# dequantizing int4 costs three times int8's
TORCH_DENSE_ROWS = 64
RECIPE = 1  # how quantize_layers and kernels/quant.py quantize: part of a prepared file's name (model/prepared.py)


@dataclass(frozen=True)
class QuantWeight:
    """A matrix W [N, K] quantized in groups of quant.GROUP inputs (kernels/quant.py), and the model's dtype;
    `torch_form`: the same matrix in torch's weight-only layout (kernels/torch_quant.py), where the model's products
    run on torch's ops (`for_torch`, at load), else None."""

    packed: quant.Packed
    dtype: torch.dtype  # what a product returns
    torch_form: torch_quant.TorchPacked | None = None

    @classmethod
    def of(cls, w: torch.Tensor, bits: int) -> QuantWeight:
        return cls(quant.Packed.of(w, bits), w.dtype)

    def for_torch(self) -> QuantWeight:
        """This matrix with its torch form packed (once: itself where it has one), so that its products run on
        torch's weight-only ops instead of kvrag's kernel."""
        return self if self.torch_form is not None else replace(self, torch_form=torch_quant.pack(self.packed))

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
        """The bytes a product reads: the torch form's where the products run there (kvrag's packed form is kept
        too, for the prepared file and the head's rows)."""
        return self.packed.nbytes if self.torch_form is None else self.torch_form.nbytes

    def __getitem__(self, rows: slice) -> QuantWeight:
        """Output rows start:stop of the matrix, both on a tile's boundary (the q/k/v projection's parts)."""
        start, stop, _ = rows.indices(self.shape[0])
        if start % quant.TILE or stop % quant.TILE:
            raise KvragError(f"rows {start}:{stop} of a quantized matrix cut a tile of {quant.TILE}")
        packed = self.packed.tiles(slice(start // quant.TILE, stop // quant.TILE))
        if self.torch_form is None:
            return QuantWeight(packed, self.dtype)
        # a view of the torch form's rows where its layout allows (q/k/v's parts: multiples of 64 rows), else packed
        return QuantWeight(packed, self.dtype, self.torch_form.rows(start, stop) or torch_quant.pack(packed))

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
        if self.torch_form is not None:  # torch's weight-only ops (int8's: for few rows; many: the dense matrix)
            dense = self._dense_call if self.torch_form.bits == 8 else None
            return self._by_rows(x, bias, positions, self._torch, dense, TORCH_DENSE_ROWS)
        if not quant.available():  # neither kernel: the dequantized matrix, every call (slow; not what load sets up)
            return self._dense_call(x, bias)
        if x.dtype != torch.bfloat16 or not cpu_has_amx():
            return self._integer(x, bias)
        return self._by_rows(x, bias, positions, self._integer, self._amx, DENSE_ROWS)

    def _by_rows(self, x: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor | None, few, many,
                 rows: int) -> torch.Tensor:
        """x's product through `few` (a weight-only kernel) or, for many rows, `many` (a dense matmul over the matrix
        dequantized for the call); `many` None: `few` for all."""
        if many is None:
            return few(x, bias)
        if positions is None:  # by the call's rows
            return many(x, bias) if x.shape[0] > rows else few(x, bias)
        # A prompt row's arithmetic follows its position, not how many rows share the call, so that a prefix hit's
        # tail computes as a fresh full prefill of the same prompt did: the first `rows` through the weight-only
        # kernel, the rest through the dense matmul
        wide = positions >= rows  # [R]
        if bool(wide.all()):
            return many(x, bias)
        if not bool(wide.any()):
            return few(x, bias)
        out = torch.empty(x.shape[0], self.shape[0], dtype=self.dtype, device=x.device)  # [R, N]
        out[wide], out[~wide] = many(x[wide], bias), few(x[~wide], bias)
        return out

    def _torch(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [R, K] through torch's weight-only op (x and the op's output rounded to bf16) -> [R, N]."""
        out = torch_quant.matmul(self.torch_form, x)  # [R, N] float32
        return (out if bias is None else out + bias.float()).to(self.dtype)

    def _dense_call(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [R, K] times the matrix dequantized for this call, in x's dtype -> [R, N]."""
        return F.linear(x, self.dense(x.dtype), bias).to(self.dtype)

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
    where a quantized form cannot run here.

    A form named explicitly runs on a CPU: on kvrag's integer kernel where it runs (kvrag's kernels on, `native`,
    and built for this CPU: quant.available()), else on torch's weight-only ops (kernels/torch_quant.py: an ARM or
    older x86 CPU, KVRAG_ISA=none, KVRAG_NATIVE=0); never on a GPU. auto gives `default` (the model's own,
    model/names.py's default_weights) only where kvrag's kernel runs, and dense elsewhere, torch's ops included: a
    default is given only where its answers were measured, and they were measured on kvrag's kernel, whose
    arithmetic torch's ops do not share (bf16 activations and outputs, int8 as two per-row terms)."""
    if weights not in WEIGHTS:
        raise KvragError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    kernel = device.type == "cpu" and native and quant.available()
    if weights == "auto":
        return default if kernel else "dense"
    if weights != "dense" and not kernel and not (device.type == "cpu" and torch_quant.available()):
        raise KvragError(f"--weights {weights} runs on a CPU (kvrag's integer kernel, or torch's weight-only ops); "
                         f"this {device.type} runs neither (use --weights dense)")
    return weights


def torch_ops_wanted(device: torch.device, native: bool = True) -> bool:
    """Whether a quantized model's products run on torch's ops here: a CPU where kvrag's kernel does not run
    (`native` False: kvrag's kernels turned off for this model)."""
    return device.type == "cpu" and not (native and quant.available())


def use_torch_ops(model) -> float:
    """Put every quantized matrix of the model (its layers' and the LM head) into torch's layout as well, so that
    its products run on torch's weight-only ops; the seconds it took. Once, at load (model/prepared.py)."""
    start = time.perf_counter()
    for layer in model.layers:
        for name in MATRICES:
            w = getattr(layer, name)
            if isinstance(w, QuantWeight):
                setattr(layer, name, w.for_torch())
    if isinstance(model.lm_head, QuantWeight):
        model.lm_head = model.lm_head.for_torch()
    return time.perf_counter() - start


def packed_for(w: torch.Tensor, weights: str) -> quant.Packed:
    """A layer matrix w [N, K] packed in the form's bits, or for `mixed` in 4 bits where they give back w's values at
    least as closely as 8 (the dequantized matrix's error), else in 8: each form quantized once."""
    if BITS[weights] is not None:
        return quant.Packed.of(w, BITS[weights])
    four, eight = quant.Packed.of(w, 4), quant.Packed.of(w, 8)
    error = {p.bits: float((quant.dequantize(p) - w.float()).norm()) for p in (four, eight)}
    return four if error[4] <= error[8] else eight


def _fits(n: int, k: int) -> bool:
    """Whether a matrix [N, K] fits the kernel's tiles (N % 16, K % 32)."""
    return n % quant.TILE == 0 and k % quant.GROUP == 0


def _qkv_splits(cfg) -> bool:
    """Whether q, k and v's parts of the fused projection each fill whole tiles (they are read apart)."""
    return (cfg.n_heads * cfg.head_dim) % quant.TILE == 0 and (cfg.n_kv_heads * cfg.head_dim) % quant.TILE == 0


def integer_everywhere(cfg, weights: str, device: torch.device, native: bool = True) -> bool:
    """Whether every matrix product of a model of this shape in form `weights` runs on kvrag's integer kernel here:
    a quantized form, kvrag's kernel running (`native` and built for this CPU), and every matrix packed by
    quantize_layers (none left dense)."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    shapes = [(q + 2 * kv, cfg.hidden_size), (cfg.hidden_size, q), (2 * cfg.intermediate_size, cfg.hidden_size),
              (cfg.hidden_size, cfg.intermediate_size), (cfg.vocab_size, cfg.hidden_size)]
    return (weights != "dense" and device.type == "cpu" and native and quant.available() and _qkv_splits(cfg)
            and all(_fits(n, k) for n, k in shapes))


def form_dtype(setting: str | None, cfg, weights: str, device: torch.device, native: bool = True) -> torch.dtype:
    """The dtype `--dtype` (`setting`) gives a model of this shape in form `weights`: auto is bf16 on a CPU without
    bf16 hardware too where every product is integer (`integer_everywhere`; model/device.py's resolve_dtype)."""
    return resolve_dtype(setting, device, integer_everywhere(cfg, weights, device, native))


def quantize_layers(model, weights: str, torch_ops: bool = False) -> None:
    """Replace the model's layer matrices and LM head by their `weights` form, in place: int8 all in 8 bits; int4
    the layers' matrices in 4 bits and the head in 8, as GGUF's 4-bit files keep their output tensor at 6-8 bits
    (the head decides every token; docs/quantized.md); mixed each layer matrix as `packed_for` picks, the head in 8.
    A matrix whose shape does not fit the kernel's tiles (N % 16, K % 32; q/k/v's parts each a multiple of 16)
    stays dense. `torch_ops`: each also packed for torch's weight-only ops (`use_torch_ops`)."""
    split = _qkv_splits(model.cfg)
    for layer in model.layers:
        for name in MATRICES:  # LayerWeights' linear layers
            w = getattr(layer, name)
            if _fits(*w.shape) and (name != "wqkv" or split):  # q, k and v are read apart, each in whole tiles
                setattr(layer, name, QuantWeight(packed_for(w, weights), w.dtype))
    if _fits(*model.lm_head.shape):
        model.lm_head = QuantWeight.of(model.lm_head, 8)
    if torch_ops:
        use_torch_ops(model)


def state_of(name: str, w: QuantWeight) -> dict[str, torch.Tensor]:
    """A quantized matrix as named tensors (model/prepared.py's file): name.q8 or name.q4, name.scales and int4's
    name.mins; where it has its torch form, that too: name.t8 or name.t4 and name.t8.scales or name.t4.scales."""
    p = w.packed
    state = {f"{name}.q{p.bits}": p.weights, f"{name}.scales": p.scales}
    if p.mins is not None:
        state[f"{name}.mins"] = p.mins
    if w.torch_form is not None:
        state[f"{name}.t{p.bits}"], state[f"{name}.t{p.bits}.scales"] = w.torch_form.weights, w.torch_form.scales
    return state


def from_state(state: dict[str, torch.Tensor], name: str, dtype: torch.dtype) -> torch.Tensor | QuantWeight | None:
    """`name`'s tensor from a state written with `state_of` for quantized matrices: dense, quantized or None."""
    for bits in quant.BITS:
        if f"{name}.q{bits}" in state:
            packed = quant.Packed(state[f"{name}.q{bits}"], state[f"{name}.scales"], state.get(f"{name}.mins"), bits)
            form = None
            if f"{name}.t{bits}" in state:
                form = torch_quant.TorchPacked.of_state(state[f"{name}.t{bits}"], state[f"{name}.t{bits}.scales"], bits)
            return QuantWeight(packed, dtype, form)
    return state.get(name)
