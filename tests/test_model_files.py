"""Model resolution: default GGUF converted once, cache checks, refusals with one clear line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kvrag.errors import KvragError
from kvrag.model import files as model_files
from kvrag.model.config import ModelConfig
from kvrag.model.device import attention_dtype, resolve_dtype
from kvrag.model.files import RECORD_NAME, resolve_model


def test_default_model_converts_once_then_uses_the_cache(smol, monkeypatch):
    record = smol.path / RECORD_NAME
    before = record.stat().st_mtime_ns

    def no_conversion(*a, **k):
        raise AssertionError("converted again although the cache is valid")

    monkeypatch.setattr(model_files, "_convert_gguf", no_conversion)
    again = resolve_model(None)
    assert again.fingerprint == smol.fingerprint
    assert again.path == smol.path
    assert record.stat().st_mtime_ns == before
    assert smol.path.name == smol.fingerprint
    assert (smol.path / "model.safetensors").exists() and (smol.path / "tokenizer.json").exists()

# what other tests prepared there (a gigabyte where a float32 int8 Gemma was built) is not the conversion under test
_NOT_THE_MODELS = shutil.ignore_patterns("prepared", ".*.tmp")


def test_a_damaged_cache_is_detected(smol, tmp_path, monkeypatch):
    """Copy the converted cache into another home, damage it, and check that it is not used."""
    home = tmp_path / "home"
    shutil.copytree(smol.path.parent, home / "models", ignore=_NOT_THE_MODELS)
    monkeypatch.setenv("KVRAG_HOME", str(home))
    models = home / "models"
    calls = []
    monkeypatch.setattr(model_files, "_convert_gguf", lambda *a: calls.append(a) or "rebuilt")

    weights = models / smol.fingerprint / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the weights
    weights.write_bytes(bytes(data))
    assert resolve_model(None) == "rebuilt" and len(calls) == 1

    shutil.rmtree(models / smol.fingerprint)  # a partial cache: the directory is gone
    assert resolve_model(None) == "rebuilt" and len(calls) == 2


@pytest.mark.slow
def test_a_missing_record_is_rebuilt_for_real(smol, tmp_path, monkeypatch):
    home = tmp_path / "home"
    shutil.copytree(smol.path.parent, home / "models", ignore=_NOT_THE_MODELS)
    (home / "models" / smol.fingerprint / RECORD_NAME).unlink()  # conversion stopped before its end
    monkeypatch.setenv("KVRAG_HOME", str(home))
    rebuilt = resolve_model(None)
    assert rebuilt.fingerprint == smol.fingerprint
    assert (rebuilt.path / RECORD_NAME).exists()


def test_user_directory_model(tiny_llama_dir, monkeypatch):
    local = resolve_model(str(tiny_llama_dir))
    assert local.config.architecture == "llama" and local.config.n_layers == 3
    from kvrag.config import KVRagConfig  # $KVRAG_MODEL, resolved at the edge, names the same directory

    assert resolve_model(KVRagConfig.resolve({"KVRAG_MODEL": str(tiny_llama_dir)}).model).fingerprint == local.fingerprint


def test_fingerprint_follows_weights(tiny_llama_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama_dir, copy)
    assert resolve_model(str(copy)).fingerprint == resolve_model(str(tiny_llama_dir)).fingerprint
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(copy / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    assert resolve_model(str(copy)).fingerprint != resolve_model(str(tiny_llama_dir)).fingerprint


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.update(model_type="gpt2"), "architecture 'gpt2' is not supported"),
        (lambda c: c.update(rope_parameters={"rope_type": "proportional", "factor": 4.0, "rope_theta": 1e4}),
         "rope scaling 'proportional' is not implemented"),
        (lambda c: c.update(model_type="gemma2"), "gemma2 with activation 'silu' is not supported"),
        (lambda c: c.update(model_type="gemma3", text_config={"model_type": "siglip"}), "gemma3 with a 'siglip'"),
    ],
)
def test_unsupported_models_are_refused(tiny_llama_dir, tmp_path, edit, message):
    copy = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, copy)
    cfg = json.loads((copy / "config.json").read_text())
    edit(cfg)
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(KvragError, match=message):
        resolve_model(str(copy))


def test_missing_or_empty_paths_are_refused(tmp_path):
    with pytest.raises(KvragError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(KvragError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_config_reads_both_transformers_generations():
    base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1)
    old = ModelConfig.from_hf({**base, "rope_theta": 5e5})
    new = ModelConfig.from_hf({**base, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}})
    assert old == new and old.rope_theta == 5e5 and old.head_dim == 4 and old.group_size == 2


def test_dtype_choice(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_dtype("float32", cpu) == torch.float32
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    monkeypatch.setattr("kvrag.model.device.cpu_has_fast_bf16", lambda: False)
    assert resolve_dtype("auto", cpu) == torch.float32
    monkeypatch.setattr("kvrag.model.device.cpu_has_fast_bf16", lambda: True)
    assert resolve_dtype("auto", cpu) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    from kvrag.config import KVRagConfig  # $KVRAG_DTYPE, resolved at the edge, under an option not given

    assert resolve_dtype(KVRagConfig.resolve({"KVRAG_DTYPE": "float32"}, dtype=None).dtype, cpu) == torch.float32
    assert KVRagConfig.resolve({"KVRAG_DTYPE": "float32"}, dtype="bfloat16").dtype == "bfloat16"  # the option wins
    with pytest.raises(KvragError, match="unknown dtype"):
        resolve_dtype("float8", cpu)


def test_attention_dtype_choice(monkeypatch):
    """bf16 on a CPU without AMX attends in float32 (its flash kernel is faster there); otherwise the model's dtype."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr("kvrag.model.device.cpu_has_amx", lambda: False)
    assert attention_dtype(torch.bfloat16, cpu) == torch.float32
    assert attention_dtype(torch.float32, cpu) == torch.float32
    assert attention_dtype(torch.bfloat16, cuda) == torch.bfloat16
    monkeypatch.setattr("kvrag.model.device.cpu_has_amx", lambda: True)
    assert attention_dtype(torch.bfloat16, cpu) == torch.bfloat16


def test_fingerprint_ignores_how_the_tokenizer_was_loaded(tiny_llama_dir, tmp_path):
    """tokenizer_config.json records load-time flags (local_files_only); they must not change ids."""
    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama_dir, copy)
    cfg = json.loads((copy / "tokenizer_config.json").read_text())
    cfg["local_files_only"] = not cfg.get("local_files_only", False)
    (copy / "tokenizer_config.json").write_text(json.dumps(cfg, indent=3))
    assert resolve_model(str(copy)).tokenizer_fingerprint == resolve_model(str(tiny_llama_dir)).tokenizer_fingerprint
    cfg["eos_token"] = "<|something_else|>"
    (copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert resolve_model(str(copy)).tokenizer_fingerprint != resolve_model(str(tiny_llama_dir)).tokenizer_fingerprint
