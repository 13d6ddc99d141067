"""A decode step in decode.cpp: the whole step of a batch of new rows, one a sequence, through every layer and
the LM head in one call over a paged KV pool (`BatchStep`), and its one-row case over a contiguous decode cache
(`WholeStep`). Where kvrag's native library is missing (kernels/native.py), `available()` is False and the
decoder keeps torch's ops."""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

import torch

from kvrag.kernels import native, quant
from kvrag.kernels.cpu import cpu_flags

PROBE_EVERY = 64  # steps between two timings of the thread count not in use (1.5 % of steps)
LAYER_TENSORS = ("attn_norm", "wqkv", "bqkv", "wo", "mlp_norm", "w_gate_up", "w_down")  # decode.cpp's order
MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")  # those that may be packed, in decode.cpp's `matrix` order


@dataclass(frozen=True)
class StepWeights:
    """What the native step reads of a model (model.transformer.Transformer.step_weights): its widths and its
    weights, which it reads by address."""

    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    rms_eps: float
    layers: tuple[tuple[torch.Tensor | quant.Packed | None, ...], ...]  # per layer, LAYER_TENSORS in that order
    lm_head: torch.Tensor | quant.Packed  # [V, D]
    final_norm: torch.Tensor  # [D]

    @property
    def group_size(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def dtype(self) -> torch.dtype:
        return self.final_norm.dtype

    @property
    def device(self) -> torch.device:
        return self.final_norm.device

    @property
    def matrices(self) -> list[torch.Tensor | quant.Packed]:
        """Every layer's matrices (MATRICES' order), then the LM head."""
        return [layer[LAYER_TENSORS.index(name)] for layer in self.layers for name in MATRICES] + [self.lm_head]

    @property
    def packed(self) -> bool | None:
        """False where every matrix is bf16, True where every one is packed (kernels/quant.py), else None."""
        forms = {isinstance(t, quant.Packed) for t in self.matrices}
        return forms.pop() if len(forms) == 1 else None


def available() -> bool:
    return _step() is not None and _batch() is not None


def step_serves(w: StepWeights) -> bool:
    """Whether `WholeStep` runs these weights: a bf16 model on a CPU with the kernels, every width a multiple of 16
    (head_dim at most 256, at most 8 query heads a KV head), every dense weight contiguous bf16 (the kernel reads them by address), and its matrices all bf16 or all packed
    alike (the packed ones where quant.cpp runs)."""
    dense = [t for layer in w.layers for t in layer if isinstance(t, torch.Tensor)] + [w.final_norm]
    return (w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.hidden % 16 == 0 and w.head_dim % 16 == 0
            and w.head_dim <= 256 and w.group_size <= 8 and w.intermediate % 16 == 0 and available()
            and all(t.is_contiguous() and t.dtype == torch.bfloat16 for t in dense)
            and (w.packed is False or (w.packed is True and quant.available())))


def dot_bf16_default() -> bool:
    """Whether a step multiplies with VDPBF16PS (pairs of bf16 products summed into float32): where the process runs
    the AVX-512 build (native.isa) on a CPU with AVX512-BF16, the only place it can. Another order of sums than the
    float32 path's, so other bits; each path is batch-invariant."""
    return _bf16_dot_runs()


def _bf16_dot_runs() -> bool:
    """Whether VDPBF16PS runs in the process's build here (the AVX2 builds have no such path)."""
    return native.isa() == "avx512" and "avx512_bf16" in cpu_flags()


class StepModel(ctypes.Structure):
    """decode.cpp's StepModel: the shapes and addresses one whole step reads. Key (layer l, block b, slot s) is
    at k_base + l * layer_stride + b * block_stride + s * Hkv * hd elements (values alike from v_base)."""
    _fields_ = ([(name, ctypes.c_int64) for name in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim",
                                                      "inter", "vocab", "n_blocks", "block_size", "layer_stride",
                                                      "block_stride", "max_pos", "dot_bf16")]
                + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]
                + [(name, ctypes.c_void_p) for name in ("layers", "k_base", "v_base", "cos", "sin", "final_norm",
                                                         "lm_head")]
                + [("packed", ctypes.c_int64), ("quant", ctypes.c_void_p)])


def _step_model(w: StepWeights, k: int, v: int, strides: tuple[int, int, int, int], cos: torch.Tensor,
                sin: torch.Tensor, dot_bf16: bool | None) -> tuple[StepModel, torch.Tensor]:
    """The StepModel of weights `w` over keys at address k and values at v, strides (n_blocks, block_size,
    layer_stride, block_stride) in elements, and the [L * 7] weight addresses it points to (keep both alive).
    dot_bf16: the products with VDPBF16PS (None: where the build and CPU run it; True where they do not: ValueError)."""
    dot_bf16 = dot_bf16_default() if dot_bf16 is None else dot_bf16
    if dot_bf16 and not _bf16_dot_runs():
        raise ValueError(f"dot_bf16=True: VDPBF16PS products need kvrag's avx512 kernels on a CPU with AVX512-BF16 "
                         f"(this process runs the {native.isa()} build"
                         f"{'' if 'avx512_bf16' in cpu_flags() else ', on a CPU without AVX512-BF16'})")
    for t in (cos, sin):  # [max_pos, 1, hd]
        assert t.is_contiguous() and t.dtype == torch.bfloat16
    addresses = [_address(t) for layer in w.layers for t in layer] + [_address(w.lm_head)]
    packed = [value for t in w.matrices for value in (_address(t.scales), _address(t.mins), t.bits)] \
        if w.packed else [0]  # [(4 L + 1) * 3]: each matrix's scales, minimums and bits
    layers = torch.tensor(addresses + packed, dtype=torch.int64)  # [L * 7 + 1 (+ (4 L + 1) * 3)]
    shape = StepModel(w.n_layers, w.hidden, w.n_heads, w.n_kv_heads, w.head_dim, w.intermediate,
                      w.lm_head.shape[0], *strides, cos.shape[0], int(dot_bf16), w.rms_eps, w.head_dim ** -0.5,
                      layers.data_ptr(), k, v, cos.data_ptr(), sin.data_ptr(), w.final_norm.data_ptr(),
                      addresses[-1], int(w.packed), layers.data_ptr() + 8 * len(addresses))
    return shape, layers


def _address(t: torch.Tensor | quant.Packed | None) -> int:
    """Where a weight's bytes start (a packed matrix's: its weights'), 0 for none."""
    if t is None:
        return 0
    return t.data_ptr() if isinstance(t, torch.Tensor) else t.weights.data_ptr()


class WholeStep:
    """Every layer of one new row and the LM head in one native call, writing K and V into a decode cache's
    bf16 rows: the batch step's one row over one block. Made once per cache (the addresses of the model's
    weights and of the cache are taken here). dot_bf16: the products with VDPBF16PS (None: where the build and
    the CPU run them, dot_bf16_default), each product's float32 sums in another order than without, so other bits."""

    def __init__(self, weights: StepWeights, k_cache: torch.Tensor, v_cache: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, dot_bf16: bool | None = None):
        for t in (k_cache, v_cache):  # [L, cap, Hkv, hd]
            assert t.is_contiguous() and t.dtype == torch.bfloat16
        block = k_cache[0].numel()  # the whole capacity of a layer is its one block
        self.capacity = k_cache.shape[1]
        self.shape, self.layers = _step_model(weights, k_cache.data_ptr(), v_cache.data_ptr(),
                                              (1, self.capacity, block, block), cos, sin, dot_bf16)
        self.keep = (weights, k_cache, v_cache, cos, sin)  # every address above stays valid while this lives
        self.threads = ThreadPicker(torch.get_num_threads())

    def __call__(self, pos: int, h: torch.Tensor, logits: torch.Tensor, n_threads: int | None = None,
                 rotary: int | None = None) -> None:
        """h [D] bf16: the new row's embedding in, the last layer's output out; logits [V] float32 out (the LM
        head's bf16 values); K and V into the cache at row `pos`, attending to rows 0..pos; q and k rotated to
        position `rotary` (None: pos; past it where earlier rows were dropped). n_threads None: the faster of
        one thread and torch's count, as measured (the numbers are the same on any count)."""
        rotary = pos if rotary is None else rotary
        rc = self.threads.run(n_threads, lambda threads: _step()(ctypes.byref(self.shape), pos, rotary, h.data_ptr(),
                                                                  logits.data_ptr(), threads))
        if rc:
            raise RuntimeError(f"decode step refused row {pos} at rotary position {rotary} (capacity "
                               f"{self.capacity}, rotary tables {self.shape.max_pos}; code {rc}: "
                               f"{_REFUSALS.get(rc, '?')})")


class BatchStep:
    """One new row of each of B sequences through every layer and the LM head in one native call, each at its
    own position, its keys and values read and written in place through its block table in a paged pool
    kv [L, 2, N, block_size, Hkv, hd] bf16 (BlockPool's tensor). Row b's numbers are those of the same sequence
    stepped alone by WholeStep, whatever the batch and the thread count. Made once per (model, pool)."""

    def __init__(self, weights: StepWeights, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 dot_bf16: bool | None = None):
        """cos, sin [max_pos, 1, hd] bf16: `model.positions_cos_sin(torch.arange(max_pos))`, long enough for every
        rotary position a row will step at. dot_bf16: as WholeStep's (the same choice gives the same bits)."""
        assert kv.is_contiguous() and kv.dtype == torch.bfloat16 and kv.dim() == 6
        n_blocks, block_size = kv.shape[2], kv.shape[3]
        block = kv[0, 0, 0].numel()  # [block_size, Hkv, hd]
        values = kv.data_ptr() + n_blocks * block * kv.element_size()  # kv[0, 1]
        self.shape, self.layers = _step_model(weights, kv.data_ptr(), values,
                                              (n_blocks, block_size, 2 * n_blocks * block, block), cos, sin,
                                              dot_bf16)
        self.keep = (weights, kv, cos, sin)
        self.dims = (weights.hidden, weights.lm_head.shape[0])
        self.pickers: dict[int, ThreadPicker] = {}  # by batch size's bit length: a step's time grows with B

    def __call__(self, positions: torch.Tensor, tables: torch.Tensor, h: torch.Tensor, logits: torch.Tensor,
                 n_threads: int | None = None, rotary: torch.Tensor | None = None) -> None:
        """positions [B] int64: each row's slot, the row its K/V go to (its sequence's rows so far); tables
        [B, M] int64: row b's blocks in order, the one holding each slot up to positions[b] allocated and that
        slot's block written by no other row; h [B, D] bf16: embeddings in, the last layer's outputs out; logits
        [B, V] float32 out (the LM head's bf16 values). rotary [B] int64: each row's rotary position (None:
        positions; past them where earlier rows were dropped). n_threads None: as WholeStep."""
        n, (d, vocab) = positions.shape[0], self.dims
        rotary = positions if rotary is None else rotary
        if not (positions.dtype == rotary.dtype == tables.dtype == torch.int64 and rotary.shape == (n,)
                and tables.dim() == 2 and tables.shape[0] == n and h.shape == (n, d) and h.dtype == torch.bfloat16
                and logits.shape == (n, vocab) and logits.dtype == torch.float32
                and all(t.is_contiguous() for t in (positions, rotary, tables, h, logits))):
            raise ValueError(f"batch step: positions, rotary [B], tables [B, M] int64, h [B, {d}] bf16, logits "
                             f"[B, {vocab}] float32, contiguous; got {tuple(positions.shape)}, "
                             f"{tuple(rotary.shape)}, {tuple(tables.shape)}, {tuple(h.shape)}, {tuple(logits.shape)}")
        picker = self.pickers.setdefault(n.bit_length(), ThreadPicker(torch.get_num_threads()))
        rc = picker.run(n_threads, lambda threads: _batch()(ctypes.byref(self.shape), n, positions.data_ptr(),
                                                            rotary.data_ptr(), tables.data_ptr(), tables.shape[1],
                                                            h.data_ptr(), logits.data_ptr(), threads))
        if rc:
            raise RuntimeError(f"batch step refused slots {positions.tolist()} at rotary positions "
                               f"{rotary.tolist()} over tables of {tables.shape[1]} blocks (code {rc}: "
                               f"{_REFUSALS.get(rc, '?')})")


_REFUSALS = {1: "an empty batch or table", 2: "a slot past its table or a rotary position past the rotary tables",
             3: "a block outside the pool", 4: "VDPBF16PS products asked of a build without them"}


class ThreadPicker:
    """One thread or `most`, whichever steps faster now. The threads of a step meet at 150 barriers, so on a
    CPU shared with other work a descheduled thread stalls the other at each: on 2 cores with one busy
    process, two threads stepped in 90 ms where one took 27 (14 ms on the idle CPU). Each count's time is a
    running average; the one not in use is timed again every PROBE_EVERY steps."""

    def __init__(self, most: int):
        self.seconds = dict.fromkeys(sorted({1, max(1, most)}))  # threads -> running average step time
        self.calls = 0

    def pick(self) -> int:
        self.calls += 1
        unmeasured = [n for n, s in self.seconds.items() if s is None]
        if unmeasured:
            return unmeasured[-1]
        best = min(self.seconds, key=self.seconds.get)
        if self.calls % PROBE_EVERY == 0:
            return next((n for n in self.seconds if n != best), best)
        return best

    def run(self, n_threads: int | None, step) -> int:
        """step(threads) on n_threads, or on the picked count (None), timed; step's return code."""
        threads = self.pick() if n_threads is None else n_threads
        start = time.perf_counter()
        rc = step(threads)
        if n_threads is None:
            self.record(threads, time.perf_counter() - start)
        return rc

    def record(self, n: int, seconds: float) -> None:
        before = self.seconds[n]
        self.seconds[n] = seconds if before is None else 0.7 * before + 0.3 * seconds


def _step():  # (native.function caches each build's entry point: the build is the process's choice, native.isa)
    return native.function("kvrag_decode_step", ctypes.c_int,
                           [ctypes.POINTER(StepModel), ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                            ctypes.c_void_p, ctypes.c_int])


def _batch():
    return native.function("kvrag_decode_batch", ctypes.c_int,
                           [ctypes.POINTER(StepModel), ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                            ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int])
