"""Decoding over our own KV cache against transformers' `generate`."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvrag import KvragError
from kvrag.blend.decode import (
    DecodeCache,
    SamplingConfig,
    choose,
    decode_step,
    generate,
    prefill,
    stream_text,
)
from kvrag.blend.model import Transformer
from kvrag.blend.model_files import resolve_model


def _greedy_ours(path, ids: torch.Tensor, n: int) -> list[int]:
    local = resolve_model(str(path))
    model = Transformer.from_safetensors(local.config, local.weight_files(), torch.float32)
    with torch.no_grad():
        logits, cache = prefill(model, ids, extra=n)
        return list(generate(model, cache, logits, SamplingConfig(max_tokens=n), stop=set()))


def _greedy_hf(path, ids: torch.Tensor, n: int) -> list[int]:
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(ids[None], max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          attention_mask=torch.ones_like(ids[None]), pad_token_id=0, eos_token_id=None)
    return out[0, ids.shape[0]:].tolist()


def test_tiny_greedy_matches_generate(tiny_qwen2_dir):
    ids = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(3))
    assert _greedy_ours(tiny_qwen2_dir, ids, 32) == _greedy_hf(tiny_qwen2_dir, ids, 32)


@pytest.mark.real_model
def test_real_greedy_32_tokens_match_generate(smol, smol_tokenizer, musique_items):
    from kvrag.blend.prompt import PromptBuilder

    builder = PromptBuilder(smol_tokenizer)
    item = musique_items[1]
    ids = torch.tensor(builder.build([builder.passage_ids("", item["ctxs"][0]["text"])], item["question"]).flat())
    assert _greedy_ours(smol.path, ids, 32) == _greedy_hf(smol.path, ids, 32)


def test_decode_step_logits_equal_full_forward(tiny_llama_dir):
    """Logits after feeding tokens one by one equal a full forward of the whole sequence."""
    local = resolve_model(str(tiny_llama_dir))
    model = Transformer.from_safetensors(local.config, local.weight_files(), torch.float32)
    ids = torch.randint(0, 49152, (30,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _, cache = prefill(model, ids[:20], extra=10)
        for t in ids[20:]:
            step_logits = decode_step(model, cache, int(t))
        ref, _ = model.full_forward(ids)
    torch.testing.assert_close(step_logits, ref[0], rtol=1e-4, atol=1e-4)


def test_full_cache_refuses_another_token(tiny_llama_dir):
    local = resolve_model(str(tiny_llama_dir))
    model = Transformer.from_safetensors(local.config, local.weight_files(), torch.float32)
    cache = DecodeCache(model, capacity=1)
    decode_step(model, cache, 5)
    with pytest.raises(KvragError):
        decode_step(model, cache, 6)


def test_sampling_rules_by_hand():
    logits = torch.tensor([0.0, 3.0, 2.9, -5.0])
    assert choose(logits, SamplingConfig(), None) == 1  # greedy
    # top_p small enough keeps only the most likely token, whatever the seed
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        assert choose(logits, SamplingConfig(temperature=1.0, top_p=0.3), g) == 1
    # with top_p=1 and a high temperature every token is reachable; a seed makes it repeatable
    draws = [choose(logits, SamplingConfig(temperature=5.0), torch.Generator().manual_seed(s)) for s in range(200)]
    assert set(draws) == {0, 1, 2, 3}
    again = [choose(logits, SamplingConfig(temperature=5.0), torch.Generator().manual_seed(s)) for s in range(200)]
    assert draws == again


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_p=1.5)])
def test_sampling_config_is_validated(bad):
    with pytest.raises(KvragError):
        SamplingConfig(**bad)


def test_stream_text_reassembles_the_answer(smol_tokenizer):
    text = "Zürich — 12 km² of naïve café ☕ text."
    ids = smol_tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = list(stream_text(smol_tokenizer, iter(ids)))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("rows, keys, kv_heads, group", [(1, 1, 3, 3), (1, 517, 3, 3), (5, 64, 2, 4), (8, 300, 4, 1)])
def test_decode_attention_equals_sdpa(dtype, tol, rows, keys, kv_heads, group):
    """The few-rows path decoding takes (two float32 matmuls) against SDPA over expanded heads, the reference."""
    from kvrag.blend.model import _attend_few_rows

    g = torch.Generator().manual_seed(rows * 1000 + keys)
    q = torch.randn(rows, kv_heads * group, 64, generator=g).to(dtype)  # [R, Hq, hd]
    k = torch.randn(keys, kv_heads, 64, generator=g).to(dtype) * 3  # [S, Hkv, hd]
    v = torch.randn(keys, kv_heads, 64, generator=g).to(dtype)
    expand = lambda x: x.repeat_interleave(group, dim=1).transpose(0, 1)[None].float()  # noqa: E731  [1, Hq, S, hd]
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None].float(), expand(k), expand(v))
    got = _attend_few_rows(q, k, v, group)
    torch.testing.assert_close(got.float(), ref[0].transpose(0, 1).reshape(rows, -1), rtol=tol, atol=tol)
