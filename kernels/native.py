"""kvrag's C++ kernels (kernels/*.cpp): one shared library per instruction set, built on first use and loaded
through ctypes.

Every kernel has one source, written over kernels/simd.h's vectors; it is built for AVX-512, for AVX2 with AVX-VNNI
and for AVX2 (each with FMA and F16C), with the system's C++ compiler into `$KVRAG_HOME/kernels` (plain C entry
points, no Python or torch headers: a few seconds, once per source version and ISA). ctypes releases the GIL
during each call. Which build runs is the process's choice, made once at the edge (`use`, from config.py's `isa`:
the best this CPU runs by default, any lower one on request, `none` for torch's paths), as torch's own kernels
follow ATEN_CPU_CAPABILITY. Where the CPU runs none, there is no compiler, or the choice is `none`, `library()` is
None and every caller keeps its torch/numpy path.
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
from functools import cache
from pathlib import Path

from kvrag.errors import KvragError
from kvrag.home import kvrag_home
from kvrag.kernels import cpu
from kvrag.kernels.cpu import cpu_flags

SOURCES = tuple(sorted(Path(__file__).parent.glob("*.cpp")))
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))  # not compiled on their own, but part of the build
COMMON_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-pthread", "-fopenmp")
# Each build's compiler flags and the CPU flags it needs, best first. AVX-VNNI is AVX2's 256-bit VPDPBUSD (Intel's
# client CPUs since Alder Lake, Zen 5); without it the integer products take VPMADDUBSW and VPMADDWD, as llama.cpp's
ISA_BUILDS = {
    "avx512": (("-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c"),
               frozenset({"avx512f", "avx512dq", "avx512bw", "avx512vl", "fma", "f16c"})),
    "avxvnni": (("-mavx2", "-mfma", "-mf16c", "-mavxvnni"), frozenset({"avx2", "fma", "f16c", "avx_vnni"})),
    "avx2": (("-mavx2", "-mfma", "-mf16c"), frozenset({"avx2", "fma", "f16c"})),
}
ISAS = (*ISA_BUILDS, "none")  # the settings besides auto, best first
ISA_NAMES = {"avx512": "AVX-512", "avxvnni": "AVX2 + AVX-VNNI", "avx2": "AVX2", "none": "none"}

# The process's choice of build: set once by the edge (`use`), read by every kernel wrapper. A process-wide
# setting as torch's thread count is: the kernels a CPU runs belong to the process, not to one model.
_CHOICE: dict[str, str] = {}


def runnable() -> tuple[str, ...]:
    """The builds this machine's CPU runs, best first (none off x86-64 Linux)."""
    if not sys.platform.startswith("linux") or platform.machine() != "x86_64":
        return ()
    return tuple(isa for isa, (_, needs) in ISA_BUILDS.items() if needs <= cpu_flags())


def resolve_isa(setting: str | None) -> str:
    """The build a setting (config.py's `isa`: auto, avx512, avxvnni, avx2 or none) gives here; KvragError (one
    line) for an unknown name or a build this CPU cannot run."""
    setting = (setting or "auto").lower()
    if setting == "auto":
        return (runnable() or ("none",))[0]
    if setting not in ISAS:
        raise KvragError(f"KVRAG_ISA must be auto or one of {', '.join(ISAS)}, got {setting!r}")
    if setting != "none" and setting not in runnable():
        needs = " ".join(sorted(ISA_BUILDS[setting][1] - cpu_flags()))
        raise KvragError(f"KVRAG_ISA={setting}: this CPU lacks {needs or 'x86-64 Linux'} (it runs: "
                         f"{', '.join(runnable() + ('none',))})")
    return setting


def use(setting: str | None) -> str:
    """Make `setting`'s build the one every kernel runs in this process (the edge calls this once, from the
    configuration); the build chosen."""
    _CHOICE["isa"] = resolve_isa(setting)
    return _CHOICE["isa"]


def isa() -> str:
    """The build kernels run in this process: the edge's choice, else the best this CPU runs."""
    return _CHOICE.get("isa") or resolve_isa("auto")


def held_below_avx512() -> bool:
    """Whether the process runs an AVX2 build on a CPU with AVX-512 (KVRAG_ISA=avx2 or avxvnni): it then stands for
    a CPU that has only that build's ISA, so its bf16 hardware (AMX, AVX512-BF16) is not used either."""
    return isa() in ("avx2", "avxvnni") and "avx512" in runnable()


def cpu_has_fast_bf16() -> bool:
    """bf16 hardware (AMX or AVX512-BF16) the process may use: what picks `--dtype auto`."""
    return cpu.cpu_has_fast_bf16() and not held_below_avx512()


def cpu_has_amx() -> bool:
    """AMX the process may use (a quantized bf16 model's long prompts multiply there: model/quant.py)."""
    return cpu.cpu_has_amx() and not held_below_avx512()


def library(which: str | None = None) -> ctypes.CDLL | None:
    """The library of build `which` (default: the process's), built on first use (None where it cannot be: a CPU
    without that ISA, no compiler, the choice `none`). Whether a model uses it is the model's `native` setting
    (config.py), not this library's."""
    return _library(which or isa())


@cache
def _library(which: str) -> ctypes.CDLL | None:
    if which not in runnable():
        return None
    path = build(isa=which)
    if path is None:
        return None
    try:
        return ctypes.CDLL(str(path))
    except OSError:  # a damaged or foreign file where the build should be: torch's paths, as without a compiler
        return None


def function(name: str, restype, argtypes: list):
    """The process's build's C entry point `name` with its ctypes signature, or None where there is no library."""
    return _function(isa(), name, restype, tuple(argtypes))


@cache
def _function(which: str, name: str, restype, argtypes: tuple):
    lib = library(which)
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = restype, list(argtypes)
    return fn


def build(compiler: str | None = None, isa: str = "avx512") -> Path | None:
    """The library of build `isa`, compiled once per sources and flags (None without a working compiler): with
    `compiler` (config.py's, from $CXX), else c++ or g++ on the PATH. The edge builds with the configured compiler
    first; the file is then there for `library`."""
    compiler = compiler or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return None
    flags = COMMON_FLAGS + ISA_BUILDS[isa][0]
    digest = hashlib.sha256(" ".join(flags).encode())
    for source in SOURCES + HEADERS:
        digest.update(source.name.encode() + source.read_bytes())
    folder = kvrag_home() / "kernels"
    path = folder / f"kvrag-kernels-{isa}-{digest.hexdigest()[:16]}.so"
    if path.exists():
        return path
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:  # built aside, then renamed: concurrent builds are safe
            built = Path(tmp) / path.name
            subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", str(built)], check=True, capture_output=True,
                           timeout=300)
            os.replace(built, path)
    except (OSError, subprocess.SubprocessError):
        return None
    return path
