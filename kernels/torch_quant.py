"""Quantized products on torch's own CPU weight-only ops, where kvrag's integer kernel (kernels/quant.py) does not
run: an ARM or older x86 CPU, KVRAG_ISA=none, KVRAG_NATIVE=0. gpt-fast and torchao call the same ops on a CPU.

A kvrag matrix (quant.Packed: groups of quant.GROUP inputs, float16 parameters) is put into torch's layout once, at
load (`pack`), and every product is one or two op calls (`matmul`):

- int4: `aten._convert_weight_to_int4pack_for_cpu` and `aten._weight_int4pack_mm_for_cpu` at group size 32, the
  same groups. torch's convention is w = (q - 8) scale + zero for q in [0, 15], kvrag's w = d q + m, so scale = d and
  zero = m + 8 d: the same quantized numbers, the parameters rounded to bf16 (what the op reads).
- int8: `aten._weight_int8pack_mm` takes one scale an output row, and kvrag's int8 has one a group of 32, so the
  matrix cannot go as it is. It goes as TERMS per-row int8 matrices summed, w ~ s1 q1 + s2 q2: q1 the dequantized
  matrix requantized per output row, q2 what that leaves, requantized the same way. One term alone (per-row int8, as
  torchao's int8 weight-only form is) adds 1.6 to 5.6 times int8's own rounding to the matrix (1.85 times over
  Qwen2.5-Coder-1.5B's sampled matrices, measured against the dequantized matrix); the second term takes that to
  0.7%, so that the products are int8's. The row scales multiply the op's output in float32, outside the op (a
  bf16 scale would round every weight of the row alike, a third of int8's rounding again).

The ops' fast paths (x86 AVX2 and AVX-512, ARM NEON) take bf16 activations; float32 ones take a scalar loop, 4 to 12
times slower here. So x is rounded to bf16, each product accumulates in float32, and the op rounds its output to
bf16 (2**-8 of it at most); the model's dtype comes back. Every row's sum runs in the same order however many rows
share the call, so a row's product does not depend on its neighbours. kvrag's kernel instead rounds activations to
int8 per group of 32 (quant.py): a coarser rounding than bf16's, so the two paths' products differ by about that.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from kvrag.kernels import quant

OPS_DTYPE = torch.bfloat16  # the activations the ops' vectorized paths take
TERMS = 2  # per-row int8 matrices an int8 matrix is summed from (see above)
BLOCK = 64  # rows of torch's int4 layout that never share a block (its blocks are 16, 32 or 64 rows by CPU)
CHUNK = 4096  # rows packed at a time: an LM head's float32 temporaries stay under 100 MB


@dataclass(frozen=True)
class TorchPacked:
    """A matrix W [N, K] in torch's weight-only layout.

    int4: weights uint8 [N, K / 2] (`_convert_weight_to_int4pack_for_cpu`'s, blocked by the CPU's vector width),
    scales bf16 [K / 32, N, 2] (scale, zero). int8: weights int8 [TERMS, N, K], scales float32 [TERMS, N] (applied
    to the op's output), ones bf16 [N] (the op's own scales)."""

    weights: torch.Tensor
    scales: torch.Tensor
    bits: int
    ones: torch.Tensor | None = None

    @classmethod
    def of_state(cls, weights: torch.Tensor, scales: torch.Tensor, bits: int) -> TorchPacked:
        """The form from its tensors as a file kept them (model/prepared.py), each copied where the file's map left
        it off a 64-byte boundary (the int8 op loads its weight rows with aligned loads)."""
        weights, scales = (t if t.data_ptr() % 64 == 0 else t.clone() for t in (weights, scales))
        return cls(weights, scales, bits, torch.ones(weights.shape[1], dtype=torch.bfloat16) if bits == 8 else None)

    @property
    def shape(self) -> tuple[int, int]:
        n = self.scales.shape[1] if self.bits == 4 else self.weights.shape[1]
        return n, self.weights.shape[-1] * (2 if self.bits == 4 else 1)

    @property
    def nbytes(self) -> int:
        """The bytes a product reads."""
        return self.weights.nbytes + self.scales.nbytes + (0 if self.ones is None else self.ones.nbytes)

    def rows(self, start: int, stop: int) -> TorchPacked | None:
        """Output rows start:stop as their own matrix, viewing these weights; None where the int4 layout's blocks
        cannot be cut there (then pack the rows' quant.Packed instead)."""
        if self.bits == 8:
            return TorchPacked(self.weights[:, start:stop], self.scales[:, start:stop], 8, self.ones[start:stop])
        n = self.shape[0]
        if start % BLOCK or (stop % BLOCK and stop != n) or not _blocks_cut_at_64():
            return None
        return TorchPacked(self.weights[start:stop], self.scales[:, start:stop].contiguous(), 4)


def layout() -> str:
    """What the packed layout depends on, for a file that keeps it (model/prepared.py's name): torch's version, the
    CPU capability its kernels dispatch to (the int4 blocks' width follows it) and TERMS."""
    return f"torch{torch.__version__.split('+')[0]}-{torch.backends.cpu.get_cpu_capability().lower()}-t{TERMS}"


def available() -> bool:
    """Whether this torch has both ops (2.6 on: the int4 one's CPU form)."""
    return all(hasattr(torch.ops.aten, op) for op in
               ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu", "_weight_int8pack_mm"))


def pack(p: quant.Packed, terms: int | None = None) -> TorchPacked:
    """kvrag's packed matrix in torch's layout: int4 as it is (parameters in bf16), int8 as `terms` (default TERMS)
    per-row int8 matrices summed (module docstring). Done once a matrix, at load."""
    terms = TERMS if terms is None else terms
    q, d, m = quant.unpack(p)  # [N, K] int8, [N, G] float16 each
    if p.bits == 4:
        zero = m.float() + 8 * d.float()  # (q - 8) d + zero = d q + m
        scales = torch.stack([d.float(), zero], dim=-1).transpose(0, 1).to(torch.bfloat16).contiguous()  # [G, N, 2]
        return TorchPacked(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2), scales, 4)
    n, k = p.shape
    weights = torch.empty(terms, n, k, dtype=torch.int8)
    scales = torch.empty(terms, n)
    for start in range(0, n, CHUNK):
        rows = slice(start, start + CHUNK)
        left = (q[rows].float().reshape(-1, k // quant.GROUP, quant.GROUP)
                * d[rows].float()[..., None]).reshape(-1, k)  # [C, K] the dequantized rows (exact in float32)
        for t in range(terms):
            s = left.abs().amax(-1) / 127  # [C]
            s = torch.where(s > 0, s, torch.ones_like(s))
            qt = torch.round(left / s[:, None]).clamp_(-127, 127)  # [C, K]
            weights[t, rows], scales[t, rows] = qt.to(torch.int8), s
            left = left.sub_(qt.mul_(s[:, None]))  # what the terms so far leave
    return TorchPacked(weights, scales, 8, torch.ones(n, dtype=torch.bfloat16))


def matmul(t: TorchPacked, x: torch.Tensor) -> torch.Tensor:
    """x [R, K] (float32 or bf16) @ W^T -> [R, N] float32 through torch's op: x rounded to bf16, float32 sums, the
    op's output rounded to bf16 (int8: each term's, before its float32 scale)."""
    xb = _operand(x)
    if t.bits == 4:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(xb, t.weights, quant.GROUP, t.scales).float()
    out = None
    for q, s in zip(t.weights, t.scales, strict=True):  # [N, K], [N] each term
        term = torch.ops.aten._weight_int8pack_mm(xb, q, t.ones).float()  # [R, N]
        out = term.mul_(s) if out is None else out.addcmul_(term, s)
    return out


def dequantize(t: TorchPacked) -> torch.Tensor:
    """The matrix the op multiplies by, [N, K] float64 (its float32 dequantization of the bf16 parameters aside):
    what tests and measurements hold against quant.dequantize of the matrix it came from."""
    n, k = t.shape
    if t.bits == 8:
        return (t.weights.double() * t.scales.double()[..., None]).sum(0)
    # the q values back from the op itself: scale 1 and zero 8 make its weights q - 8 + 8 = q, small integers exact
    # in bf16, and an identity's rows pick them out
    unit = torch.tensor([1.0, 8.0], dtype=torch.bfloat16).expand(k // quant.GROUP, n, 2).contiguous()
    q = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(k, dtype=torch.bfloat16), t.weights, quant.GROUP,
                                                   unit).double().T  # [N, K]
    scale, zero = (t.scales[..., i].double().T.repeat_interleave(quant.GROUP, dim=1) for i in (0, 1))  # [N, K]
    return (q - 8) * scale + zero


def _operand(x: torch.Tensor) -> torch.Tensor:
    """x as the ops read it: bf16, contiguous, 64-byte aligned (the int8 op loads its rows with aligned loads; a
    bf16 model's x may be a view into a wider tensor). torch's CPU allocator aligns every tensor to 64 bytes."""
    xb = x.to(OPS_DTYPE)
    return xb if xb.is_contiguous() and xb.data_ptr() % 64 == 0 else xb.clone(memory_format=torch.contiguous_format)


@cache
def _blocks_cut_at_64() -> bool:
    """Whether this CPU's int4 layout keeps rows in blocks that a multiple of 64 rows never splits, so that a row
    range there is a view (checked once: packed whole vs packed apart)."""
    q = torch.randint(0, 16, (208, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    whole = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    return all(torch.equal(whole[a:b], torch.ops.aten._convert_weight_to_int4pack_for_cpu(q[a:b].contiguous(), 2))
               for a, b in ((0, 64), (64, 192), (128, 208)))
