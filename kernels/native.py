"""kvrag's C++ kernels (kernels/*.cpp): one shared library, built on first use and loaded through ctypes.

Built with the system's C++ compiler into `$KVRAG_HOME/kernels` (plain C entry points, no Python or torch
headers: a couple of seconds, once per source version). ctypes releases the GIL during each call. Where the
CPU is not x86-64 with AVX-512, there is no compiler, or `KVRAG_NATIVE=0`, `library()` is None and every
caller keeps its torch/numpy path.
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

from kvrag.home import kvrag_home
from kvrag.kernels.cpu import cpu_flags

SOURCES = tuple(sorted(Path(__file__).parent.glob("*.cpp")))
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))  # not compiled on their own, but part of the build
FLAGS = ("-O3", "-std=c++17", "-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c", "-fPIC",
         "-shared", "-pthread", "-fopenmp")
NEEDED_CPU_FLAGS = frozenset({"avx512f", "avx512dq", "avx512bw", "avx512vl", "fma", "f16c"})


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The kernels' library, built on first use (None where it cannot be: no AVX-512, no compiler). Whether a
    model uses it is the model's `native` setting (config.py), not this library's."""
    if not sys.platform.startswith("linux") or platform.machine() != "x86_64" or not NEEDED_CPU_FLAGS <= cpu_flags():
        return None
    path = build()
    if path is None:
        return None
    try:
        return ctypes.CDLL(str(path))
    except OSError:  # a damaged or foreign file where the build should be: torch's paths, as without a compiler
        return None


def function(name: str, restype, argtypes: list):
    """The library's C entry point `name` with its ctypes signature, or None where there is no library."""
    lib = library()
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = restype, argtypes
    return fn


def build(compiler: str | None = None) -> Path | None:
    """The compiled library, built once per sources and flags (None without a working compiler): with `compiler`
    (config.py's, from $CXX), else c++ or g++ on the PATH. The edge builds with the configured compiler first; the
    file is then there for `library`."""
    compiler = compiler or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return None
    digest = hashlib.sha256(" ".join(FLAGS).encode())
    for source in SOURCES + HEADERS:
        digest.update(source.name.encode() + source.read_bytes())
    folder = kvrag_home() / "kernels"
    path = folder / f"kvrag-kernels-{digest.hexdigest()[:16]}.so"
    if path.exists():
        return path
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:  # built aside, then renamed: concurrent builds are safe
            built = Path(tmp) / path.name
            subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", str(built)], check=True, capture_output=True,
                           timeout=300)
            os.replace(built, path)
    except (OSError, subprocess.SubprocessError):
        return None
    return path
