"""Stored fp16 KV (byte planes or natural order) straight to bfloat16 tensors: fp16_to_bf16.cpp, one pass.

Where kvrag's native library is missing (kernels/native.py), `available()` is False and the loader keeps its
numpy decode and torch cast (the same values: both round to nearest even).
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import numpy as np
import torch

from kvrag.kernels import native


def available() -> bool:
    return _kernel() is not None


def convert(body: bytes | memoryview, planes: bool, first: torch.Tensor, second: torch.Tensor) -> None:
    """Write the fp16 values of `body` (byte planes when `planes`) as bf16: the first first.numel() into `first`,
    the next second.numel() into `second` (contiguous bfloat16 tensors; K and V of one stored layer)."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the fp16-to-bf16 kernel is not available here")
    if first.dtype != torch.bfloat16 or second.dtype != torch.bfloat16:
        raise ValueError("fp16 values convert into bfloat16 tensors")
    if not (first.is_contiguous() and second.is_contiguous()):
        raise ValueError("fp16 values convert into contiguous tensors")
    count = first.numel() + second.numel()
    data = np.frombuffer(body, dtype=np.uint8)  # a view: bytes and read-only memoryviews alike
    if data.size < 2 * count:
        raise ValueError(f"{data.size} bytes hold fewer than {count} fp16 values")
    kernel(data.ctypes.data, count, int(planes), first.numel(), first.data_ptr(), second.data_ptr())


@lru_cache(maxsize=1)
def _kernel():
    return native.function("kvrag_fp16_to_bf16", None, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int64,
                                                       ctypes.c_void_p, ctypes.c_void_p])
