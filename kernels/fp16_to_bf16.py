"""Stored fp16 KV (byte planes or natural order) straight to bfloat16 tensors: fp16_to_bf16.cpp, one pass,
optionally rotating the keys to their absolute positions on the way (`convert_rotated`).

Built for each ISA kvrag's kernels have (kernels/native.py: AVX-512, AVX2 + F16C). Where kvrag's native library is missing (kernels/native.py), `available()` is False and the loader keeps its
numpy decode and torch cast (the same values: both round to nearest even).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from kvrag.kernels import native


def available() -> bool:
    return _kernel() is not None


def convert(body: bytes | memoryview, planes: bool, first: torch.Tensor, second: torch.Tensor) -> None:
    """Write the fp16 values of `body` (byte planes when `planes`) as bf16: the first first.numel() into `first`,
    the next second.numel() into `second` (contiguous bfloat16 tensors; K and V of one stored layer)."""
    kernel = _ready(_kernel())
    if first.dtype != torch.bfloat16 or second.dtype != torch.bfloat16:
        raise ValueError("fp16 values convert into bfloat16 tensors")
    if not (first.is_contiguous() and second.is_contiguous()):
        raise ValueError("fp16 values convert into contiguous tensors")
    count = first.numel() + second.numel()
    kernel(_payload(body, count), count, int(planes), first.numel(), first.data_ptr(), second.data_ptr())


def convert_rotated(body: bytes | memoryview, planes: bool, k_out: torch.Tensor, v_out: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor) -> None:
    """`convert` of one stored layer into k_out, v_out [T, Hkv, hd] (contiguous bfloat16), each key row t rotated
    by cos[t], sin[t] ([T, 1, hd] bfloat16, as model.positions_cos_sin gives): the same bits as converting and then
    rotary.rotate."""
    kernel = _ready(_rotated_kernel())
    rows, heads, dim = k_out.shape
    if k_out.dtype != torch.bfloat16 or v_out.dtype != torch.bfloat16 or cos.dtype != torch.bfloat16 \
            or sin.dtype != torch.bfloat16:
        raise ValueError("fp16 keys rotate into bfloat16 tensors, by bfloat16 cos and sin")
    if not (k_out.is_contiguous() and v_out.is_contiguous()) or v_out.shape != k_out.shape:
        raise ValueError("fp16 keys rotate into contiguous K and V tensors of one shape")
    if cos.shape != (rows, 1, dim) or sin.shape != cos.shape or cos.stride() != sin.stride() or cos.stride(-1) != 1:
        raise ValueError(f"cos and sin must be [{rows}, 1, {dim}] with unit stride along head_dim")
    kernel(_payload(body, 2 * k_out.numel()), rows, heads, dim, int(planes), cos.data_ptr(), sin.data_ptr(),
           cos.stride(0), k_out.data_ptr(), v_out.data_ptr())


def _ready(kernel):
    if kernel is None:
        raise RuntimeError("the fp16-to-bf16 kernel is not available here")
    return kernel


def _payload(body: bytes | memoryview, count: int) -> int:
    """The address of `body`, once it is known to hold `count` fp16 values."""
    data = np.frombuffer(body, dtype=np.uint8)  # a view: bytes and read-only memoryviews alike
    if data.size < 2 * count:
        raise ValueError(f"{data.size} bytes hold fewer than {count} fp16 values")
    return data.ctypes.data


def _rotated_kernel():
    return native.function("kvrag_fp16_to_bf16_rotated", None,
                           [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p])


def _kernel():
    return native.function("kvrag_fp16_to_bf16", None, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int64,
                                                       ctypes.c_void_p, ctypes.c_void_p])
