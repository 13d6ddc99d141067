"""A decode step in decode.cpp: the whole step of one new row through every layer and the LM head in one call
(`WholeStep`), and its memory-bound pieces alone (bf16 matrix x one vector, one row's attention over the bf16
decode cache). Where kvrag's native library is missing (kernels/native.py), `available()` is False and the
decoder keeps torch's ops."""

from __future__ import annotations

import ctypes
import time
from functools import lru_cache
from typing import TYPE_CHECKING

import torch

from kvrag.kernels import native

if TYPE_CHECKING:
    from kvrag.blend.model import Transformer

PROBE_EVERY = 64  # steps between two timings of the thread count not in use (1.5 % of steps)
LAYER_TENSORS = ("attn_norm", "wqkv", "bqkv", "wo", "mlp_norm", "w_gate_up", "w_down")  # decode.cpp's order


def available() -> bool:
    return _gemv() is not None and _attention() is not None and _step() is not None


def step_serves(model: Transformer) -> bool:
    """Whether `WholeStep` runs this model: bf16 on a CPU with the kernels, every width a multiple of 16, and
    every weight contiguous (the kernel reads them by address)."""
    c = model.cfg
    weights = [t for layer in model.layers for t in vars(layer).values() if t is not None]
    return (serves(model.dtype, model.device, c.hidden_size, c.head_dim, c.group_size)
            and c.intermediate_size % 16 == 0
            and all(t.is_contiguous() and t.dtype == torch.bfloat16 for t in [*weights, model.lm_head, model.final_norm]))


def serves(dtype: torch.dtype, device: torch.device, hidden: int, head_dim: int, group: int) -> bool:
    """Whether a model of this dtype and shape decodes through these kernels (bf16 on a CPU that has them)."""
    return (dtype == torch.bfloat16 and device.type == "cpu" and hidden % 16 == 0 and head_dim % 16 == 0
            and head_dim <= 256 and group <= 8 and available())


def gemv(w: torch.Tensor, x: torch.Tensor, out: torch.Tensor, n_threads: int = 1) -> torch.Tensor:
    """out [N] = w [N, K] @ x [K] (contiguous bf16; K % 16 == 0), float32 sums rounded to bf16. out is bf16, or
    float32 holding the bf16-rounded values (what `F.linear(...).float()` gives)."""
    rc = _gemv()(w.data_ptr(), x.data_ptr(), out.data_ptr(), w.shape[0], w.shape[1],
                 int(out.dtype == torch.float32), n_threads)
    if rc:
        raise RuntimeError(f"decode gemv refused the shapes (code {rc})")
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, n_keys: int,
              scale: float) -> torch.Tensor:
    """One query row q [Hq, D] over the first n_keys rows of k, v [S, Hkv, D] (contiguous bf16) -> out [Hq, D]
    bf16: scores, softmax and the weighted sum in float32."""
    n_q, d = q.shape
    rc = _attention()(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), n_keys, n_q, k.shape[1], d, scale)
    if rc:
        raise RuntimeError(f"decode attention refused the shapes (code {rc})")
    return out


@lru_cache(maxsize=1)
def _gemv():
    return native.function("kvrag_decode_gemv", ctypes.c_int,
                           [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 2)


@lru_cache(maxsize=1)
def _attention():
    return native.function("kvrag_decode_attention", ctypes.c_int,
                           [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_float])


class StepModel(ctypes.Structure):
    """decode.cpp's StepModel: the shapes and addresses one whole step reads."""
    _fields_ = ([(name, ctypes.c_int64) for name in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim",
                                                      "inter", "vocab", "capacity")]
                + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]
                + [(name, ctypes.c_void_p) for name in ("layers", "k_cache", "v_cache", "cos", "sin", "final_norm",
                                                         "lm_head")])


class WholeStep:
    """Every layer of one new row and the LM head in one native call, writing K and V into a decode cache's
    bf16 rows. Made once per cache (the addresses of the model's weights and of the cache are taken here)."""

    def __init__(self, model: Transformer, k_cache: torch.Tensor, v_cache: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor):
        c = model.cfg
        for t in (k_cache, v_cache, cos, sin):  # [L, cap, Hkv, hd] x2, [cap, 1, hd] x2
            assert t.is_contiguous() and t.dtype == torch.bfloat16
        addresses = [0 if t is None else t.data_ptr() for layer in model.layers
                     for t in (getattr(layer, name) for name in LAYER_TENSORS)]
        self.layers = torch.tensor(addresses, dtype=torch.int64)  # [L * 7]
        self.keep = (model, k_cache, v_cache, cos, sin)  # every address above stays valid while this lives
        self.shape = StepModel(c.n_layers, c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim, c.intermediate_size,
                               model.lm_head.shape[0], k_cache.shape[1], c.rms_eps, c.head_dim ** -0.5,
                               self.layers.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), cos.data_ptr(),
                               sin.data_ptr(), model.final_norm.data_ptr(), model.lm_head.data_ptr())

        self.threads = ThreadPicker(torch.get_num_threads())

    def __call__(self, pos: int, h: torch.Tensor, logits: torch.Tensor, n_threads: int | None = None) -> None:
        """h [D] bf16: the new row's embedding in, the last layer's output out; logits [V] float32 out (the LM
        head's bf16 values); K and V into the cache at `pos`, attending to keys 0..pos. n_threads None: the
        faster of one thread and torch's count, as measured (the numbers are the same on any count)."""
        threads = self.threads.pick() if n_threads is None else n_threads
        start = time.perf_counter()
        if _step()(ctypes.byref(self.shape), pos, h.data_ptr(), logits.data_ptr(), threads):
            raise RuntimeError(f"decode step refused position {pos} (capacity {self.shape.capacity})")
        if n_threads is None:
            self.threads.record(threads, time.perf_counter() - start)


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

    def record(self, n: int, seconds: float) -> None:
        before = self.seconds[n]
        self.seconds[n] = seconds if before is None else 0.7 * before + 0.3 * seconds


@lru_cache(maxsize=1)
def _step():
    return native.function("kvrag_decode_step", ctypes.c_int,
                           [ctypes.POINTER(StepModel), ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int])
