"""Every model family kvrag runs beyond Llama (tests/conftest.py FAMILIES) against transformers' own forward, and
its batched decode against its own one-at-a-time decode; what kvrag does not run is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvrag.engine.batch_decode import BatchDecoder
from kvrag.engine.kv_pool import SequenceKV
from kvrag.errors import KvragError
from kvrag.model.config import ModelConfig
from kvrag.model.decode import decode_step
from kvrag.model.files import resolve_model
from kvrag.model.prefill import extend, prefill
from kvrag.model.transformer import Transformer

FAMILY_NAMES = ["qwen3", "qwen3_window", "phi3", "phi3_longrope", "mistral_window", "llama_yarn", "llama_dynamic",
                "qwen2_yarn", "gemma2", "gemma3_text", "gemma3"]


def _ours(path, dtype=torch.float32) -> Transformer:
    local = resolve_model(str(path))
    return Transformer.from_safetensors(local.config, local.weight_files(), dtype)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_family_logits_match_transformers(name, tiny_family):
    """A 300-token prompt (past every sliding window, 64): every position's logits, held as the Llama tests are."""
    path = tiny_family(name)
    ids = torch.randint(0, 49152, (300,), generator=torch.Generator().manual_seed(0))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]  # [T, V]
        ours, _ = extend(_ours(path), None, ids, all_logits=True)
    assert ours.shape == ref.shape
    print(f"{name}: max abs logit diff {float((ours - ref).abs().max()):.2e}, rel {_rel_err(ours, ref):.2e}")
    assert _rel_err(ours, ref) < 1e-4


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_family_batched_decode_equals_one_at_a_time(name, tiny_family):
    """Three prompts (40, 70, 90 tokens: past the windows) decode 8 steps together through the engine's batch step
    over a pool of 16-token blocks, against each stepped alone (decode_step) and against one full forward over the
    prompt and the fed tokens (each step's logits are that forward's row)."""
    model, steps = _ours(tiny_family(name)), 8
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 49152, (n,), generator=g) for n in (40, 70, 90)]
    feeds = torch.randint(0, 49152, (len(prompts), steps), generator=g)
    c = model.cfg
    kv = SequenceKV(model, budget_bytes=64 * 16 * c.n_layers * 2 * c.n_kv_heads * c.head_dim * 4, block_size=16)
    with torch.inference_mode():
        tables = [kv.admit(prefill(model, ids, extra=steps)[1], len(ids)) for ids in prompts]
        decoder, batched = BatchDecoder(model, kv, 256, native=False), []
        for j in range(steps):
            for t in tables:
                kv.grow(t)
            batched.append(decoder.step(feeds[:, j].tolist(), tables))  # [B, V]
        for b, ids in enumerate(prompts):
            cache = prefill(model, ids, extra=steps)[1]
            alone = torch.stack([decode_step(model, cache, int(t)) for t in feeds[b]])  # [steps, V]
            torch.testing.assert_close(torch.stack([s[b] for s in batched]), alone, rtol=1e-5, atol=1e-5)
            full, _ = extend(model, None, torch.cat([ids, feeds[b]]), all_logits=True)  # [T + steps, V]
            torch.testing.assert_close(alone, full[len(ids):], rtol=1e-4, atol=1e-4)


def test_native_and_triton_stay_off_where_the_kernels_do_not_compute_the_family(tiny_family):
    """A family the native decode step or the Triton/row kernels do not compute runs torch's ops, whatever is set."""
    for name, decode_plain, attention_plain in [("qwen3", False, True), ("mistral_window", False, False),
                                                ("llama_yarn", True, True), ("phi3_longrope", False, True),
                                                ("gemma2", False, False), ("gemma3_text", False, False)]:
        model = _ours(tiny_family(name))
        model.native = model.triton = True
        assert (model.native, model.triton) == (decode_plain, attention_plain), name


def test_qwen3_has_per_head_norms_and_its_own_head_dim(tiny_family):
    model = _ours(tiny_family("qwen3_window"))
    assert model.cfg.head_dim == 32 and model.layers[0].q_norm.shape == (32,)
    assert [model.cfg.window(i) for i in range(3)] == [None, 64, 64]


def test_longrope_runs_its_short_factors_within_the_original_context(tiny_family):
    cfg = _ours(tiny_family("phi3_longrope")).cfg
    assert cfg.max_positions == 512 and cfg.rotary_dim == 8 and cfg.rope_scaling.attention_factor > 1


@pytest.mark.parametrize("model_type, word", [("gemma2", "activation"), ("olmo", "olmo")])
def test_unsupported_families_are_refused_in_one_line(model_type, word, tiny_llama_dir):
    raw = json.loads((tiny_llama_dir / "config.json").read_text())
    with pytest.raises(KvragError) as err:
        ModelConfig.from_hf({**raw, "model_type": model_type})
    assert word in str(err.value) and "\n" not in str(err.value)


def test_gemma3_rotates_its_sliding_layers_by_their_own_theta(tiny_family):
    """Rows carry both rotations ([T, 2, hd]); each layer takes its own, so the blend loader (one inv_freq) does not
    rotate Gemma 3's keys and a rotation without its layer is refused rather than broadcast over the heads."""
    model = _ours(tiny_family("gemma3_text"))
    c = model.cfg
    assert (c.rope_local_theta, c.rope_theta, c.rope_scaling.rope_type) == (10000.0, 1e6, "linear")
    assert not c.plain_rotary and _ours(tiny_family("gemma2")).cfg.plain_rotary
    pos = torch.arange(5)
    rope = model.positions_cos_sin(pos)
    assert rope[0].shape == (5, 2, c.head_dim)
    k = torch.randn(5, c.n_kv_heads, c.head_dim)
    sliding, full = (model.rotate_keys(k, pos, rope, layer=i) for i in (0, 1))
    assert not torch.allclose(sliding, full)
    with pytest.raises(KvragError):
        model.rotate_keys(k, pos, rope)


def test_older_gemma3_configs_read_as_newer_ones(tiny_family):
    """transformers 4's Gemma 3 config (rope_theta, rope_local_base_freq, rope_scaling, sliding_window_pattern and
    no layer_types) reads as the same model as transformers 5's per-layer-type rope_parameters."""
    raw = json.loads((tiny_family("gemma3_text") / "config.json").read_text())
    old = {k: v for k, v in raw.items() if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=1e6, rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
               sliding_window_pattern=2)
    assert ModelConfig.from_hf(old) == ModelConfig.from_hf(raw)


def test_older_models_keep_their_fingerprints(tiny_llama_dir):
    """Fields added for the new families stay out of a model's identity at their defaults (its stores stay valid)."""
    cfg = resolve_model(str(tiny_llama_dir)).config
    assert not {"qk_norm", "partial_rotary_factor", "layer_types"} & cfg.identity().keys()
    assert not {"attention_factor", "short_factor"} & cfg.identity()["rope_scaling"].keys()
