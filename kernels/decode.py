"""A decode step's memory-bound pieces in decode.cpp: bf16 matrix x one vector, and one row's attention over the
bf16 decode cache. Where kvrag's native library is missing (kernels/native.py), `available()` is False and the
decoder keeps torch's ops."""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from kvrag.kernels import native


def available() -> bool:
    return _gemv() is not None and _attention() is not None


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
