"""Weight-only int8 and int4 matrices: how they are quantized and packed, kernels/quant.cpp's product (every linear
layer of a quantized model) and its torch twin, which computes the same bits.

A weight matrix W [N, K] is cut into groups of GROUP inputs along K, each with float16 parameters:
- int8: w = d q, q in [-127, 127], d = max |w| / 127 (llama.cpp's Q8_0).
- int4: w = d q + m, q in [0, 15], m = min w, d = (max w - min w) / 15 (llama.cpp's Q4_1): a minimum as well as a
  scale, so that the 16 levels span the group's own range; where a group's values already sit on a grid of at most
  16 levels (a GGUF's 4-bit block), that grid's step, so the block comes back exactly.
Activations are quantized per row and group as int8 weights are, on the fly (what the integer dot needs).

The product runs in kvrag's kernel library (kernels/native.py), in whichever build the process uses: AVX-512 with
AVX512-VNNI's VPDPBUSD; AVX2 with AVX-VNNI's 256-bit VPDPBUSD; plain AVX2 with VPMADDUBSW and VPMADDWD (int8
weights through llama.cpp's sign trick, so that no int16 pair saturates). Each integer dot is exact and the float32
sums run in one order, so every build gives the twin's bits.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kvrag.kernels import native
from kvrag.kernels.cpu import cpu_flags

GROUP = 32  # inputs a group
TILE = 16  # outputs a packed vector (quant.cpp's lanes)
BITS = (8, 4)
LEVELS = {8: (-127, 127), 4: (0, 15)}
STORED = {8: 128, 4: 0}  # added to q when stored: VPDPBUSD's operand is unsigned (plain AVX2 takes it off)


@dataclass(frozen=True)
class Packed:
    """A quantized matrix in quant.cpp's layout (see quant.cpp for the order)."""

    weights: torch.Tensor  # uint8 [N/16, 16 K bits / 8]
    scales: torch.Tensor  # float16 [N/16, G, 16]
    mins: torch.Tensor | None  # float16 [N/16, G, 16] (int4), None (int8)
    bits: int

    @classmethod
    def of(cls, w: torch.Tensor, bits: int) -> Packed:
        return pack(*quantize(w, bits), bits)

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0] * TILE, self.scales.shape[1] * GROUP

    @property
    def nbytes(self) -> int:
        return self.weights.nbytes + self.scales.nbytes + (0 if self.mins is None else self.mins.nbytes)

    def tiles(self, which: slice | torch.Tensor) -> Packed:
        """Some tiles of 16 output rows, in order."""
        return Packed(self.weights[which], self.scales[which], None if self.mins is None else self.mins[which],
                      self.bits)


def quantize(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """w [N, K] -> (q int8 [N, K] in LEVELS[bits], scales float16 [N, G], mins float16 [N, G] or None), with
    w ~ q * scale (+ min) group by group; q is rounded against the float16 parameters kept."""
    n, k = w.shape
    g = w.float().reshape(n, k // GROUP, GROUP)  # [N, G, 32]
    if bits == 8:
        d, m = (g.abs().amax(-1) / 127).half(), None  # [N, G]
        shifted = g
    else:
        lo = g.amin(-1)
        d, m = _grid_step(g, lo).half(), lo.half()
        shifted = g - m.float()[..., None]
    inv = torch.where(d != 0, 1 / d.float(), torch.zeros(d.shape))
    q = torch.round(shifted * inv[..., None]).clamp_(*LEVELS[bits]).to(torch.int8)  # [N, G, 32]
    return q.reshape(n, k), d, m


def _grid_step(g: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """Each group's int4 scale [N, G] for groups g [N, G, 32] of minimum lo: (max - min) / 15, except where the
    values already sit on a grid of at most 16 levels, as a GGUF's 4-bit blocks do (Q4_K's levels need not reach
    0 and 15): there the grid's own step, the smallest gap between values, so that the block comes back exactly."""
    spread = g.amax(-1) - lo  # [N, G]
    ordered = g.sort(-1).values
    gaps = ordered.diff(dim=-1)  # [N, G, 31]
    tiny = 1e-6 * spread[..., None]
    step = torch.where(gaps > tiny, gaps, torch.full_like(gaps, float("inf"))).amin(-1)  # [N, G]
    levels = (g - lo[..., None]) / step[..., None]
    on_grid = ((levels - levels.round()).abs() < 1e-3).all(-1) & (spread / step < 15.5)
    return torch.where(on_grid & torch.isfinite(step), step, spread / 15)


def _tiled(p: torch.Tensor) -> torch.Tensor:
    """Group parameters [N, G] -> [N/16, G, 16]."""
    return p.reshape(-1, TILE, p.shape[1]).transpose(1, 2).contiguous()


def pack(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int) -> Packed:
    """`quantize`'s output in quant.cpp's layout."""
    n, k = q.shape
    u = (q.to(torch.int16) + STORED[bits]).to(torch.uint8)  # [N, K] unsigned
    u = u.reshape(n // TILE, TILE, k // 4, 4).permute(0, 2, 1, 3)  # [tiles, quads, 16, 4]
    if bits == 4:  # quads 2j (low nibbles) and 2j + 1 (high) of each group share a vector
        u = u.reshape(n // TILE, k // 8, 2, TILE, 4)
        u = u[:, :, 0] | (u[:, :, 1] << 4)  # [tiles, K / 8, 16, 4]
    return Packed(u.reshape(n // TILE, -1).contiguous(), _tiled(scales), None if mins is None else _tiled(mins), bits)


def unpack(p: Packed) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The inverse of `pack`: (q int8 [N, K], scales [N, G], mins [N, G] or None)."""
    (n, k), tiles = p.shape, p.scales.shape[0]
    u = p.weights.reshape(tiles, -1, TILE, 4)  # [tiles, K / 4 or K / 8, 16, 4]
    if p.bits == 4:
        u = torch.stack([u & 0x0F, u >> 4], dim=2).reshape(tiles, k // 4, TILE, 4)
    q = (u.permute(0, 2, 1, 3).reshape(n, k).to(torch.int16) - STORED[p.bits]).to(torch.int8)
    scales, mins = (None if t is None else t.transpose(1, 2).reshape(n, -1) for t in (p.scales, p.mins))  # [N, G]
    return q, scales, mins


def dequantize(p: Packed, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The packed matrix's values, q * scale (+ min): [N, K] in dtype."""
    q, d, m = unpack(p)
    n, k = q.shape
    w = q.reshape(n, -1, GROUP).float() * d.float()[..., None]
    if m is not None:
        w = w + m.float()[..., None]
    return w.reshape(n, k).to(dtype)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] float32 per row and group: (q [R, G, 32] as float32 integers, scales [R, G]): quant.cpp's rule."""
    g = x.reshape(x.shape[0], -1, GROUP)
    d = g.abs().amax(-1) / 127  # [R, G]
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return torch.round(g * inv[..., None]), d


def twin(p: Packed, x: torch.Tensor) -> torch.Tensor:
    """quant.cpp's product in torch, the same bits: out [R, N] float32 of x [R, K] float32. The spec, not a fast
    path (a Python loop over the groups)."""
    xq, dx = quantize_activations(x.float())  # [R, G, 32], [R, G]
    q, dw, mw = unpack(p)  # [N, K], [N, G], [N, G]
    n, groups = dw.shape
    stored = (q.reshape(n, groups, GROUP).double() + STORED[p.bits])  # the unsigned weights the kernel reads
    sums = xq.double().sum(-1)  # [R, G] the activations' integer sums
    # exact integer dots in float64 (|dot| < 2**21), int8's offset taken off as the kernel does
    dots = torch.einsum("ngk,rgk->rng", stored, xq.double()) - STORED[p.bits] * sums[:, None, :]
    dw = dw.float()
    out = torch.zeros(x.shape[0], n)  # [R, N]
    for g in range(groups):  # group after group, each product rounded before its sum (no fused multiply-add)
        term = dots[:, :, g].float() * (dw[None, :, g] * dx[:, g, None])
        if mw is not None:
            term = term + mw[None, :, g].float() * (dx[:, g] * sums[:, g].float())[:, None]
        out = out + term
    return out


def _matmul():
    """The current build's product (native.function caches it per build), or None where quant.cpp does not run:
    no library, or the AVX-512 build on a CPU without AVX512-VNNI (the AVX2 builds need nothing more)."""
    if native.isa() == "avx512" and "avx512_vnni" not in cpu_flags():
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    return native.function("kvrag_quant_matmul", ctypes.c_int,
                           [p, p, p, ctypes.c_int, i64, i64, p, i64, p, ctypes.c_int])


def _dequantize_t():
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    return native.function("kvrag_quant_dequantize_t", ctypes.c_int, [p, p, p, ctypes.c_int, i64, i64, p, ctypes.c_int])


def available() -> bool:
    """Whether quant.cpp runs here, in the process's build (native.isa): its library built and, for the AVX-512
    build, a CPU with AVX512-VNNI."""
    return _matmul() is not None


def matmul(p: Packed, x: torch.Tensor, n_threads: int) -> torch.Tensor:
    """quant.cpp's x [R, K] @ W^T -> [R, N] float32 (the kernel must be `available`)."""
    x = x.float().contiguous()
    (n, k), mins = p.shape, None if p.mins is None else p.mins.data_ptr()
    out = torch.empty(x.shape[0], n)
    if x.shape[0] == 0 and x.shape[1] == k:  # no rows (a blend that keeps none at a layer)
        return out
    if x.shape[1] != k or _matmul()(p.weights.data_ptr(), p.scales.data_ptr(), mins, p.bits, n, k, x.data_ptr(),
                                    x.shape[0], out.data_ptr(), n_threads) != 0:
        raise ValueError(f"quantized matmul cannot take a [{n}, {k}] matrix times [{x.shape[0]}, {x.shape[1]}]")
    return out


def dequantize_t(p: Packed, n_threads: int) -> torch.Tensor:
    """W^T [K, N] bf16 from the packed W: `dequantize(p, torch.bfloat16).T`'s values, in quant.cpp (any build:
    `native.library()` present)."""
    (n, k), mins = p.shape, None if p.mins is None else p.mins.data_ptr()
    out = torch.empty(k, n, dtype=torch.bfloat16)
    if _dequantize_t()(p.weights.data_ptr(), p.scales.data_ptr(), mins, p.bits, n, k, out.data_ptr(), n_threads):
        raise ValueError(f"cannot dequantize a [{n}, {k}] matrix")
    return out
