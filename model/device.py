"""Choosing the compute device and dtype.

bf16 where the hardware does it fast (CUDA, or a CPU with AMX / AVX512-BF16), float32 elsewhere;
float32 stays the reference path.
"""

from __future__ import annotations

import ctypes
import os
import sys
from functools import lru_cache

import torch

from kvrag.errors import KvragError
from kvrag.kernels.native import cpu_has_amx, cpu_has_fast_bf16

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def attention_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype attention runs in. bf16 on a CPU without AMX: float32, as the CPU flash kernel then gains nothing
    from bf16 (no AMX tiles to feed) and pays for converting every block. The matmuls stay in bf16."""
    if dtype == torch.bfloat16 and device.type == "cpu" and not cpu_has_amx():
        return torch.float32
    return dtype


def triton_available() -> bool:
    """Whether Triton's GPU kernels can run: a CUDA device and the triton package (a CUDA torch brings it)."""
    import importlib.util

    return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


def resolve_triton(choice: str | None, device: torch.device) -> bool:
    """`kernels` (config.py): auto (Triton's attention kernels on a GPU where Triton is installed) or torch (SDPA
    and the per-sequence decode, as on a CPU)."""
    choice = (choice or "auto").lower()
    if choice not in ("auto", "torch"):
        raise KvragError(f"unknown kernels '{choice}' (use auto or torch)")
    return choice == "auto" and device.type == "cuda" and triton_available()


def resolve_device(choice: str | None = None) -> torch.device:
    choice = choice or "auto"
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice.startswith("cuda") and not torch.cuda.is_available():
        raise KvragError("--device cuda was asked for, but no CUDA device is available")
    if choice != "cpu" and not choice.startswith("cuda"):
        raise KvragError(f"unknown device '{choice}' (use auto, cpu or cuda)")
    return torch.device(choice)


def resolve_dtype(choice: str | None, device: torch.device, integer_products: bool = False) -> torch.dtype:
    """`--dtype` (config.py's `dtype`): auto, float32 or bfloat16. auto is bf16 on CUDA and on CPUs with bf16
    hardware; on other CPUs float32, unless every matrix product runs on kvrag's integer kernel
    (`integer_products`: a quantized form, model/quant.py's integer_everywhere), where no bf16 matmul runs (torch's
    is two orders of magnitude slower there) and bf16 lets the native decode step serve and halves the KV."""
    choice = (choice or "auto").lower()
    if choice == "auto":
        fast = device.type == "cuda" or (device.type == "cpu" and (cpu_has_fast_bf16() or integer_products))
        return torch.bfloat16 if fast else torch.float32
    if choice not in DTYPES:
        raise KvragError(f"unknown dtype '{choice}' (use auto, float32 or bfloat16)")
    return DTYPES[choice]


def set_cpu_threads(threads: int | None = None, keep_freed: bool = True) -> None:
    """Compute on `threads` cores (None: every core), and keep freed tensor memory for reuse unless `keep_freed`
    is False (config.py's threads and malloc_defaults)."""
    torch.set_num_threads(max(1, threads or os.cpu_count() or 1))
    if keep_freed:
        keep_freed_memory()


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters


@lru_cache(maxsize=1)
def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory in the process: by default it serves every block over a few MiB with its own
    mmap and unmaps it on free, so each layer's new activations fault in (and are zeroed) again, page by page. The
    process keeps its peak heap instead; a CLI run is short. No-op where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):
        return False
