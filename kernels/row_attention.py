"""Causal attention of query rows at sorted absolute positions: a small AVX-512 kernel (row_attention.cpp).

Built on first use with the system's C++ compiler into the user's cache folder (a plain shared library,
no Python or torch headers: about a second) and called through ctypes, which releases the GIL. Where there
is no x86-64 AVX-512 CPU, no compiler, or `KVRAG_NATIVE=0`, `available()` is False and callers keep SDPA.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

import platformdirs
import torch

from kvrag.blend.device import cpu_flags

SOURCE = Path(__file__).with_name("row_attention.cpp")
FLAGS = ("-O3", "-std=c++17", "-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mfma", "-fPIC", "-shared",
         "-pthread")
NEEDED_FLAGS = frozenset({"avx512f", "avx512dq", "avx512bw", "avx512vl", "fma"})
KEY_BLOCK = 64  # the kernel's keys per block: K and V are padded to a multiple of it
HEAD_DIM_MULTIPLE = 64  # the kernel handles head dims that are multiples of this


def available() -> bool:
    return _kernel() is not None


def supports(head_dim: int) -> bool:
    return head_dim % HEAD_DIM_MULTIPLE == 0 and available()


def row_attention(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of queries q [R, Hq, D] at sorted positions q_pos [R] over rotated keys k and values v
    [S, Hkv, D] at positions 0..S-1: a row at position p sees exactly keys 0..p. float32 out, [R, Hq, D]."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the row-attention kernel is not available here")
    s, n_kv, d = k.shape
    n_rows, n_q = q.shape[:2]
    s_pad = -(-s // KEY_BLOCK) * KEY_BLOCK
    dtype = k.dtype if k.dtype in (torch.float32, torch.bfloat16) else torch.float32
    k, v = (x.to(dtype).contiguous() for x in (k, v))  # no copy for the decode cache's own tensors
    kt = torch.empty(n_kv, s_pad // KEY_BLOCK, d, KEY_BLOCK, dtype=torch.float32)  # workspaces the kernel fills
    vt = torch.empty(n_kv, s_pad, d, dtype=torch.float32)
    q = q.to(torch.float32).contiguous()
    pos = q_pos.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    rc = kernel(q.data_ptr(), pos.data_ptr(), k.data_ptr(), v.data_ptr(), int(dtype == torch.bfloat16), s,
                kt.data_ptr(), vt.data_ptr(), out.data_ptr(), n_rows, n_q, n_kv, d, d ** -0.5,
                torch.get_num_threads())
    if rc:
        raise RuntimeError(f"row-attention kernel refused the shapes (code {rc})")
    return out


@lru_cache(maxsize=1)
def _kernel():
    if os.environ.get("KVRAG_NATIVE", "1") == "0":
        return None
    if not sys.platform.startswith("linux") or platform.machine() != "x86_64" or not NEEDED_FLAGS <= cpu_flags():
        return None
    library = _build()
    if library is None:
        return None
    fn = ctypes.CDLL(str(library)).kvrag_row_attention
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_int64] + [ctypes.c_void_p] * 3
                   + [ctypes.c_int64] * 4 + [ctypes.c_float, ctypes.c_int])
    return fn


def _build() -> Path | None:
    """The compiled library, built once per source and flags (None without a working compiler)."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return None
    source = SOURCE.read_bytes()
    tag = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]
    folder = Path(os.environ.get("KVRAG_CACHE_DIR") or platformdirs.user_cache_dir("kvrag"))
    library = folder / f"row_attention-{tag}.so"
    if library.exists():
        return library
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:  # built aside, then renamed: concurrent builds are safe
            built = Path(tmp) / library.name
            subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built)], check=True, capture_output=True,
                           timeout=120)
            os.replace(built, library)
    except (OSError, subprocess.SubprocessError):
        return None
    return library
