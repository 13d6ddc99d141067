"""Prepared weights (model/prepared.py): the cached compute layout gives the same model, and damage is rebuilt."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

from kvrag.model.files import resolve_model
from kvrag.model.prefill import extend
from kvrag.model.prepared import load_weights, prepared_path
from kvrag.model.transformer import Transformer

IDS = torch.tensor([1, 503, 2077, 28, 9, 4413, 311, 17, 88, 2])


def _logits(model: Transformer) -> torch.Tensor:
    return extend(model, None, IDS, all_logits=True)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model_dir", ["tiny_llama_dir", "tiny_qwen2_dir"])  # separate and tied LM heads
def test_prepared_weights_give_bit_equal_logits(request, model_dir, dtype):
    local = resolve_model(str(request.getfixturevalue(model_dir)))
    reference = _logits(Transformer.from_safetensors(local.config, local.weight_files(), dtype))
    path = prepared_path(local, dtype)
    path.unlink(missing_ok=True)
    built = load_weights(local, dtype, torch.device("cpu"))  # builds and writes the file
    assert path.is_file()
    loaded = load_weights(local, dtype, torch.device("cpu"))  # reads it
    assert torch.equal(_logits(built), reference) and torch.equal(_logits(loaded), reference)
    assert (loaded.lm_head is loaded.embed_tokens) == local.config.tie_embeddings  # tied: one tensor


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_a_damaged_prepared_file_is_rebuilt_not_used(tiny_llama_dir, damage, capsys):
    local = resolve_model(str(tiny_llama_dir))
    reference = _logits(Transformer.from_safetensors(local.config, local.weight_files(), torch.float32))
    load_weights(local, torch.float32, torch.device("cpu"))
    path = prepared_path(local, torch.float32)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-1000] ^= 0x40  # one bit of one weight
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data = bytearray(b"not a safetensors file")
    path.write_bytes(bytes(data))
    model = load_weights(local, torch.float32, torch.device("cpu"))
    assert torch.equal(_logits(model), reference)
    assert "damaged; rebuilding" in capsys.readouterr().err
    assert path.read_bytes() != bytes(data)  # rewritten sound
    assert torch.equal(_logits(load_weights(local, torch.float32, torch.device("cpu"))), reference)


def test_prepared_weights_are_not_kept_where_they_would_fill_the_disk(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    """Kept only where as much again stays free: on a filesystem with room for the file but not twice, the model
    loads the same and nothing is written (CI's disk once filled with a test's 3.5 GB of them)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    local = resolve_model(str(tiny_llama_dir))
    reference = _logits(Transformer.from_safetensors(local.config, local.weight_files(), torch.float32))
    size = sum(f.stat().st_size for f in local.weight_files())  # float32 on disk: the prepared file's size
    home = tmp_path / "small"
    home.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size * 3 // 2}", "tmpfs", str(home)], check=True)
    try:
        monkeypatch.setenv("KVRAG_HOME", str(home))
        assert size < shutil.disk_usage(home).free < 2 * size
        assert torch.equal(_logits(load_weights(local, torch.float32, torch.device("cpu"))), reference)
        assert "not keeping prepared weights" in capsys.readouterr().err
        assert not list((home / "models").rglob("*.safetensors*"))  # nor a temp file left behind
        monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "roomy"))  # where there is room it is kept, unless told not
        assert torch.equal(_logits(load_weights(local, torch.float32, torch.device("cpu"), keep=False)), reference)
        assert not prepared_path(local, torch.float32).exists()
        load_weights(local, torch.float32, torch.device("cpu"))
        assert prepared_path(local, torch.float32).is_file()
    finally:
        subprocess.run(["umount", str(home)], check=True)
