"""What this CPU can do, from /proc/cpuinfo: the kernels' build and dispatch and the choice of dtype read it."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(flags.split())


def cpu_has_fast_bf16() -> bool:
    return bool(cpu_flags() & {"amx_bf16", "avx512_bf16"})


def cpu_has_amx() -> bool:
    return "amx_bf16" in cpu_flags()
