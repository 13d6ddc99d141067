"""Options of the memory tiers: byte budgets (`--host-cache 4GiB`) and the replacement policy (config.py resolves
each from the command line, else its environment variable, else the default given here)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvrag.errors import KvragError

POLICIES = ("pgdsf", "gdsf", "lru", "lfu")
DEFAULT_HOST_CACHE = "4GiB"
DEFAULT_GPU_CACHE = "2GiB"
DEFAULT_POLICY = "pgdsf"

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int, what: str = "size") -> int:
    """'4GiB' → 4294967296. Binary units (KiB, MiB, GiB, TiB; bare K, M, G, T too), decimal KB/MB/GB/TB,
    plain bytes. Rounds down to whole bytes; anything else is a KvragError naming `what`."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise KvragError(f"{what} must not be negative, got {text}")
        return text
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise KvragError(f"{what}: cannot read {str(text)!r} as a size (e.g. 512MiB, 4GiB, 0 to turn it off)")
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: int) -> str:
    """4294967296 → '4GiB', 1536 → '1.5KiB' (for tables and messages)."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.4g}{unit}"
    return f"{n}B"


@dataclass(frozen=True)
class CacheConfig:
    """What a long-lived process gives the tiers: byte budgets and the replacement policy.

    `gpu_bytes` is used only where CUDA is present; `from_options` turns it to 0 elsewhere unless the
    user asked for it explicitly (then it is an error).
    """

    host_bytes: int = parse_bytes(DEFAULT_HOST_CACHE)
    gpu_bytes: int = 0
    policy: str = DEFAULT_POLICY

    def __post_init__(self) -> None:
        if self.host_bytes < 0 or self.gpu_bytes < 0:
            raise KvragError("cache sizes must not be negative")
        if self.policy not in POLICIES:
            raise KvragError(f"unknown cache policy {self.policy!r} (choose {', '.join(POLICIES)})")

    @classmethod
    def from_options(cls, host_cache: str | None = None, gpu_cache: str | None = None,
                     policy: str | None = None, cuda_available: bool = False) -> CacheConfig:
        """The settings as given (config.py resolves them from the options and the environment; None: the
        default)."""
        gpu = parse_bytes(gpu_cache or DEFAULT_GPU_CACHE, "--gpu-cache")
        if not cuda_available:
            if gpu_cache and gpu > 0:
                raise KvragError("--gpu-cache needs a CUDA device; none is available (use --gpu-cache 0)")
            gpu = 0
        return cls(host_bytes=parse_bytes(host_cache or DEFAULT_HOST_CACHE, "--host-cache"), gpu_bytes=gpu,
                   policy=(policy or DEFAULT_POLICY).lower())
