"""The model's weights in their compute layout (q/k/v and gate/up fused, in the compute dtype), kept on disk.

Building that layout from a float32 checkpoint casts and concatenates every tensor: most of a cold `kvrag ask`'s
model load. It is done once per model and dtype, and later loads read the result as it is. The file carries the
digest of its bytes, checked at every load: a damaged or partial file is rebuilt, never used.

    $KVRAG_HOME/models/prepared/<fingerprint>-<dtype>[-<weights>-r<recipe>[-<torch layout>]].safetensors

A quantized model whose products run on torch's weight-only ops (where kvrag's integer kernel does not) keeps their
layout in its own file, named by what that layout depends on (kernels/torch_quant.py's `layout`): packing it took
15 to 30 s of a Qwen2.5-Coder-1.5B load on 2 cores.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import sys
from pathlib import Path

import torch
import xxhash

from kvrag.home import kvrag_home
from kvrag.kernels import torch_quant
from kvrag.model.files import LocalModel
from kvrag.model.quant import RECIPE, QuantWeight, quantize_layers, torch_ops_wanted, use_torch_ops
from kvrag.model.transformer import Transformer

_DIGEST_KEY = "kvrag.digest"  # in the safetensors metadata: xxh3-128 of the tensor bytes after the header
_BLANK = "x" * 32  # the digest's place while the bytes are hashed (a hex digest has the same length)


def prepared_path(local: LocalModel, dtype: torch.dtype, weights: str = "dense", torch_ops: bool = False) -> Path:
    form = "" if weights == "dense" else f"-{weights}-r{RECIPE}"  # a new recipe builds new files
    if torch_ops and weights != "dense":
        form += f"-{torch_quant.layout()}"
    name = f"{local.fingerprint}-{str(dtype).removeprefix('torch.')}{form}.safetensors"
    return kvrag_home() / "models" / "prepared" / name


def load_weights(local: LocalModel, dtype: torch.dtype, device: torch.device, weights: str = "dense",
                 keep: bool = True, torch_ops: bool | None = None) -> Transformer:
    """The model for compute, its matrices in `weights`' form (dense, int8, int4: model/quant.py): from its prepared
    file when there is a sound one, else built (a quantized form from the dense one) and, with `keep`, prepared.
    `torch_ops`: a quantized model's products on torch's weight-only ops (None: where kvrag's integer kernel does
    not run, quant.torch_ops_wanted): its file then holds torch's layout as well, packed (model/quant.py's
    use_torch_ops) from kvrag's form where the file is not there yet."""
    if weights == "dense" or not (torch_ops_wanted(device) if torch_ops is None else torch_ops):
        return _load(local, dtype, device, weights, keep)
    path = prepared_path(local, dtype, weights, torch_ops=True)
    model = _from_file(path, local, dtype, device)
    if model is None or not _all_for_torch(model):
        model = _load(local, dtype, device, weights, keep=False)  # kvrag's form: its own file where there is one
        use_torch_ops(model)
        if keep:
            _write(path, model.compute_state())
    return model


def _all_for_torch(model: Transformer) -> bool:
    """Whether every quantized matrix of the model has its torch form."""
    matrices = [*(t for layer in model.layers for t in vars(layer).values()), model.lm_head]
    return all(w.torch_form is not None for w in matrices if isinstance(w, QuantWeight))


def _from_file(path: Path, local: LocalModel, dtype: torch.dtype, device: torch.device) -> Transformer | None:
    """The model of a sound prepared file; None where there is none (or it is from another version)."""
    state = _read(path)
    if state is not None:
        try:
            return Transformer.from_compute_state(local.config, {k: v.to(device) for k, v in state.items()},
                                                  dtype, device)
        except Exception as exc:  # noqa: BLE001 - a file from another version: rebuild it
            print(f"kvrag: prepared weights {path.name} do not fit this model ({exc}); rebuilding", file=sys.stderr)
    return None


def _load(local: LocalModel, dtype: torch.dtype, device: torch.device, weights: str, keep: bool) -> Transformer:
    """The model in kvrag's own form: from its prepared file, else built and, with `keep`, prepared."""
    path = prepared_path(local, dtype, weights)
    model = _from_file(path, local, dtype, device)
    if model is not None:
        return model
    if weights != "dense":
        model = _quantized(local, dtype, device, weights)
    else:
        model = Transformer.from_safetensors(local.config, local.weight_files(), dtype, device)
    if keep:
        _write(path, model.compute_state())
    return model


def _quantized(local: LocalModel, dtype: torch.dtype, device: torch.device, weights: str) -> Transformer:
    """The model with its matrices quantized from the checkpoint's float32 values, not from their cast to dtype: a
    GGUF's own 4- and 8-bit blocks then come back exactly (docs/quantized.md); the rest is cast to dtype."""
    exact = Transformer.from_safetensors(local.config, local.weight_files(), torch.float32, device)
    quantize_layers(exact, weights)
    state = {name: t.to(dtype) if t.is_floating_point() and not name.endswith((".scales", ".mins")) else t
             for name, t in exact.compute_state().items()}
    return Transformer.from_compute_state(local.config, state, dtype, device)


def _read(path: Path) -> dict[str, torch.Tensor] | None:
    """The tensors of a prepared file whose bytes match its digest; None if it is missing or damaged. The digest is
    taken over the mapped file and the tensors read one at a time, so a load holds the weights once (a 1.5B model's
    6 GB of float32 held three times did not fit 24 GB)."""
    from safetensors.torch import load_file

    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            header_end, digest = _body_digest(data)
            sound = json.loads(data[8:header_end]).get("__metadata__", {}).get(_DIGEST_KEY) == digest
    except FileNotFoundError:
        return None
    except (OSError, ValueError):  # unreadable, shorter than its header says, or no JSON there
        sound = False
    if sound:
        try:
            return load_file(path)
        except Exception:  # noqa: BLE001 - any damage at all means: rebuild
            pass
    print(f"kvrag: prepared weights {path.name} are damaged; rebuilding", file=sys.stderr)
    path.unlink(missing_ok=True)
    return None


def _write(path: Path, state: dict[str, torch.Tensor]) -> None:
    """Write atomically (temp file, then rename), the digest put into its slot in the header once the tensors are
    written and hashed from the file; a full disk or a read-only home only costs the next load."""
    from safetensors.torch import save_file

    cpu = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        size = sum(t.numel() * t.element_size() for t in cpu.values())
        free = shutil.disk_usage(path.parent).free
        if free < 2 * size:  # a copy of the weights is worth keeping, never worth filling the disk for
            print(f"kvrag: not keeping prepared weights at {path} ({size / 2**30:.1f} GiB; "
                  f"{free / 2**30:.1f} GiB free)", file=sys.stderr)
            return
        save_file(cpu, str(tmp), metadata={_DIGEST_KEY: _BLANK})
        with open(tmp, "r+b") as f, mmap.mmap(f.fileno(), 0) as data:
            header_end, digest = _body_digest(data)
            slot = data.find(_BLANK.encode(), 8, header_end)
            data[slot:slot + len(_BLANK)] = digest.encode()
            data.flush()
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        print(f"kvrag: could not keep prepared weights at {path} ({exc.strerror or exc})", file=sys.stderr)


def _body_digest(data: mmap.mmap) -> tuple[int, str]:
    """Where a safetensors file's header ends, and the digest of the tensor bytes after it."""
    header_end = 8 + int.from_bytes(data[:8], "little") if len(data) >= 8 else 0
    body = memoryview(data)[header_end:]
    try:
        return header_end, xxhash.xxh3_128(body).hexdigest()
    finally:
        body.release()  # the map closes only once no view of it is left
