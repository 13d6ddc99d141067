"""Causal attention of query rows at sorted absolute positions: the AVX-512 or AVX2 kernel in row_attention.cpp,
whichever build the process runs (kernels/native.py).

Where kvrag's native library is missing (kernels/native.py), `available()` is False and callers keep SDPA.
"""

from __future__ import annotations

import ctypes

import torch

from kvrag.kernels import native
from kvrag.kernels.cpu import cpu_flags

KEY_BLOCK = 64  # the kernel's keys per block: K and V are padded to a multiple of it
HEAD_DIM_MULTIPLE = 64  # the kernel handles head dims that are multiples of this
BLOCK_ROWS = 32  # the kernel's query rows (each query head of a row counted) a work item
# Up to this many row blocks a KV head, each key block is laid out as its rows reach it and the values are read
# where they lie (nothing written out: a prefix hit's short tail, a repeat's last row); past it, keys and values
# are laid out once in workspaces first, since every row block would lay them out again
PACK_FROM_BLOCKS = 2


def available() -> bool:
    return _kernel() is not None


def supports(head_dim: int) -> bool:
    return head_dim % HEAD_DIM_MULTIPLE == 0 and available()


def packs_keys(n_rows: int, group: int) -> bool:
    """Whether a call of n_rows query rows, `group` query heads a KV head, lays its keys and values out in
    workspaces first."""
    return -(-n_rows * group // BLOCK_ROWS) > PACK_FROM_BLOCKS


def row_attention(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  bf16_dot: bool | None = None, head=None) -> torch.Tensor:
    """Attention of queries q [R, Hq, D] at sorted positions q_pos [R] over rotated keys k and values v
    [S, Hkv, D] at positions 0..S-1: a row at position p sees exactly keys 0..p. float32 out, [R, Hq, D].

    bf16_dot (default: where it can) takes Q K^T two dimensions per instruction with AVX512_BF16 (the AVX-512
    build alone), for bfloat16 q and k: the products are exact, so it differs from float32 only in the order of the
    sums. The AVX2 builds take every product in float32.
    `head` (kernels/attention.PagedKeys, k's dtype): the first len(head) keys, read in place from a paged pool; k
    and v then hold the keys after them."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the row-attention kernel is not available here")
    n_head = 0 if head is None else len(head)
    if head is not None and (k.dtype not in (torch.float32, torch.bfloat16) or head.k.dtype != k.dtype
                             or head.v.dtype != v.dtype or not head.k.is_contiguous()
                             or not head.v.is_contiguous() or head.k.shape[1:] != k.shape[1:]):
        raise ValueError("a paged head must be contiguous pool rows of the keys' dtype and heads")
    slots = None if head is None else head.slots.to(torch.int64).contiguous()
    s, n_kv, d = k.shape
    s += n_head
    n_rows, n_q = q.shape[:2]
    if n_rows and not 0 <= int(q_pos[0]) <= int(q_pos[-1]) < s:  # the kernel reads keys up to the last position
        raise ValueError(f"query positions {int(q_pos[0])}..{int(q_pos[-1])} lie outside keys 0..{s - 1}")
    s_pad = -(-s // KEY_BLOCK) * KEY_BLOCK
    dtype = k.dtype if k.dtype in (torch.float32, torch.bfloat16) else torch.float32
    possible = q.dtype == dtype and bf16_dot_serves(dtype)
    if bf16_dot and not possible:
        raise ValueError("bf16_dot needs bfloat16 queries and keys and the AVX-512 build on a CPU with AVX512_BF16")
    pairs = possible if bf16_dot is None else bf16_dot
    k, v = (x.to(dtype).contiguous() for x in (k, v))  # no copy for the decode cache's own tensors
    pack = packs_keys(n_rows, n_q // n_kv)
    # the workspaces the kernel fills where it packs: keys as 32-bit pairs of bf16 dimensions or float32, values
    # in float32
    kt = torch.empty((n_kv, s_pad // KEY_BLOCK, d // 2 if pairs else d, KEY_BLOCK) if pack else (0,),
                     dtype=torch.int32 if pairs else torch.float32)
    vt = torch.empty((n_kv, s_pad, d) if pack else (0,), dtype=torch.float32)
    q = q.to(torch.bfloat16 if pairs else torch.float32).contiguous()
    pos = q_pos.to(torch.int64).contiguous()
    out = torch.empty(q.shape, dtype=torch.float32)
    hk, hv = (None, None) if head is None else (head.k.data_ptr(), head.v.data_ptr())
    rc = kernel(q.data_ptr(), int(pairs), pos.data_ptr(), k.data_ptr(), v.data_ptr(), hk, hv,
                None if slots is None else slots.data_ptr(), n_head, int(dtype == torch.bfloat16),
                s, kt.data_ptr(), vt.data_ptr(), int(pack), out.data_ptr(), n_rows, n_q, n_kv, d, d ** -0.5,
                torch.get_num_threads())
    if rc:
        raise RuntimeError(f"row-attention kernel refused the shapes (code {rc})")
    return out


def bf16_dot_available() -> bool:
    """Whether the kernel multiplies bfloat16 pairs in one instruction: the process runs the AVX-512 build, on a CPU
    with AVX512_BF16 (Zen 4, Cooper/Sapphire Rapids). Never on the AVX2 builds, which have no such instruction."""
    return native.isa() == "avx512" and available() and "avx512_bf16" in cpu_flags()


def bf16_dot_serves(dtype: torch.dtype) -> bool:
    """Whether queries and keys of this dtype (a model's compute dtype) take Q K^T in bf16 pairs by default."""
    return dtype == torch.bfloat16 and bf16_dot_available()


def _kernel():
    """The current build's entry point (native.function caches it per ISA), or None."""
    return native.function("kvrag_row_attention", ctypes.c_int,
                           [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 6 + [ctypes.c_int64]
                           + [ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                              ctypes.c_void_p]
                           + [ctypes.c_int64] * 4 + [ctypes.c_float, ctypes.c_int])
