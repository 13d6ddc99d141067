"""Our layer-wise forward against transformers' own forward (the independent reference)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from kvrag.model import transformer as model_module
from kvrag.model.files import resolve_model
from kvrag.model.prefill import extend
from kvrag.model.transformer import Transformer


def _ours(path, dtype=torch.float32) -> Transformer:
    local = resolve_model(str(path))
    return Transformer.from_safetensors(local.config, local.weight_files(), dtype)


def _hf(path):
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_llama3_rope_dir"])
@pytest.mark.parametrize("mlp_rows", [None, 64])  # 64: the 300-row MLP runs in slices, as a long prompt's does
def test_tiny_logits_match_transformers(fixture, mlp_rows, request, monkeypatch):
    if mlp_rows:
        monkeypatch.setattr(model_module, "MLP_ROWS", mlp_rows)
    path = request.getfixturevalue(fixture)
    ids = torch.randint(0, 49152, (300,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = _hf(path)(ids[None]).logits[0]  # [T, V]
        ours, _ = extend(_ours(path), None, ids, all_logits=True)
    assert ours.shape == ref.shape
    assert _rel_err(ours, ref) < 1e-4


def test_qwen2_has_qkv_bias(tiny_qwen2_dir):
    model = _ours(tiny_qwen2_dir)
    assert model.layers[0].bqkv is not None and model.layers[0].bqkv.abs().sum() > 0


def test_subset_rows_equal_matching_rows_of_full_pass(tiny_llama_dir):
    """Every layer run on a subset of rows at their positions, over the full pass's K/V, reproduces
    those rows of the full pass (the primitive blending is built on)."""
    model = _ours(tiny_llama_dir)
    ids = torch.randint(0, 49152, (120,), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(120) + 7  # absolute positions need not start at 0
    rows = torch.tensor([0, 3, 50, 51, 90, 119])
    with torch.no_grad():
        h = model.embed(ids)
        for layer in range(model.cfg.n_layers):
            full = model.project(layer, h, pos)
            k_rot = model.rotate_keys(full.k, pos)
            h_next = model.finish(layer, h, model.attend(full.q, pos, k_rot, full.v, pos))

            sub = model.project(layer, h[rows], pos[rows])
            torch.testing.assert_close(sub.k, full.k[rows])
            torch.testing.assert_close(sub.v, full.v[rows])
            # a selection layer projects K/V of every row and queries of some rows apart: the same numbers
            x = model.attention_input(layer, h)
            k_only, v_only = model.project_kv(layer, x)
            torch.testing.assert_close(k_only, full.k)
            torch.testing.assert_close(v_only, full.v)
            torch.testing.assert_close(model.queries(layer, x[rows], model.positions_cos_sin(pos[rows])), sub.q)
            attn = model.attend(sub.q, pos[rows], k_rot, full.v, pos)
            torch.testing.assert_close(model.finish(layer, h[rows], attn), h_next[rows], rtol=1e-5, atol=1e-5)
            h = h_next


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_llama_hd64_dir"])
def test_bf16_model_attending_in_float32(fixture, request):
    """A bf16 model whose attention runs in float32 (a CPU without AMX) hands back bf16 rows, and attends closer to
    exact attention over the same bf16 inputs than bf16 attention does: through SDPA (head dim 16) and through the
    row kernel (head dim 64, its bf16 pair products where the CPU has them)."""
    model = _ours(request.getfixturevalue(fixture), torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    hd, hq, hkv = model.cfg.head_dim, model.cfg.n_heads, model.cfg.n_kv_heads
    pos = torch.arange(200)
    q, k, v = (torch.randn(200, h, hd, generator=g).to(torch.bfloat16) for h in (hq, hkv, hkv))
    exact = F.scaled_dot_product_attention(*(x.double().transpose(0, 1)[None] for x in (q, k, v)), is_causal=True,
                                           enable_gqa=True)[0].transpose(0, 1).reshape(200, -1)
    errors = {}
    for dtype in (torch.bfloat16, torch.float32):
        model.attention_dtype = dtype
        out = model.attend(q, pos, k, v, pos)
        assert out.dtype == torch.bfloat16 and out.shape == (200, hq * hd)
        errors[dtype] = (out.double() - exact).abs().mean().item()
    assert errors[torch.float32] < errors[torch.bfloat16]


def test_replacing_a_layers_kv_changes_only_what_it_should(tiny_llama_dir):
    """Reading K (pre-rotary) and V out of a full pass and feeding them back gives the same logits."""
    model = _ours(tiny_llama_dir)
    ids = torch.randint(0, 49152, (64,), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(64)
    with torch.no_grad():
        ref_logits, kv = extend(model, None, ids)  # [V], LayerKV
        # recompute only the last row, attending to stored K/V of every other row
        h_last = model.embed(ids)
        h_all = h_last
        for layer in range(model.cfg.n_layers):
            k, v = kv.k[layer], kv.v[layer]
            sub = model.project(layer, h_all[-1:], pos[-1:])
            attn = model.attend(sub.q, pos[-1:], model.rotate_keys(k, pos), v, pos)
            h_all = h_all.clone()
            h_all[-1:] = model.finish(layer, h_all[-1:], attn)
        torch.testing.assert_close(model.logits(h_all[-1:])[0], ref_logits, rtol=1e-4, atol=1e-4)


def test_last_layer_runs_only_the_last_row_and_keeps_every_kv(tiny_llama_dir):
    """A prefill that reads only the last position's logits skips the other rows' attention and MLP at the
    last layer: same last logits as computing every row, and the same K/V of every row at every layer."""
    model = _ours(tiny_llama_dir)
    ids = torch.randint(0, 49152, (96,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        every_row, kv_every = extend(model, None, ids, all_logits=True)  # [T, V]
        last_row, kv = extend(model, None, ids)  # [V]
    assert model.rows_read_after(model.cfg.n_layers - 1, 96) == slice(95, 96)
    torch.testing.assert_close(last_row, every_row[-1], rtol=1e-5, atol=1e-5)
    for k, v, k_ref, v_ref in zip(kv.k, kv.v, kv_every.k, kv_every.v, strict=True):
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


@pytest.mark.real_model
def test_real_model_logits_match_transformers_on_long_prompt(smol, smol_tokenizer, invented_items):
    from kvrag.model.prompt import PromptBuilder

    builder = PromptBuilder(smol_tokenizer)
    item = invented_items[0]
    passages = [builder.passage_ids(c["title"], c["text"]) for c in item["ctxs"][:3]]
    ids = torch.tensor(builder.build(passages, item["question"]).flat())
    assert ids.shape[0] > 1000
    with torch.no_grad():
        ref = _hf(smol.path)(ids[None], logits_to_keep=1).logits[0, -1]
        ours, _ = extend(Transformer.from_safetensors(smol.config, smol.weight_files(), torch.float32), None, ids)
    assert _rel_err(ours, ref) < 1e-4


def test_bf16_top_logits_are_rescored_in_float32(tiny_llama_dir):
    """In bf16 the best candidates' logits equal a float32 LM head over the same (bf16) hidden states, so
    greedy decoding never picks between exact bf16 ties by token id; the tail keeps its bf16 rounding."""
    model = _ours(tiny_llama_dir, torch.bfloat16)
    h = torch.randn(4, model.cfg.hidden_size, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    normed = torch.nn.functional.rms_norm(h.float(), (h.shape[-1],), eps=model.cfg.rms_eps)
    ref = torch.nn.functional.linear(model.final_norm.float() * normed, model.lm_head.float())  # [R, V] float32
    got = model.logits(h)
    top = ref.topk(8, dim=-1).indices
    torch.testing.assert_close(got.gather(-1, top), ref.gather(-1, top), rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    tail = ref.topk(ref.shape[-1] // 2, dim=-1, largest=False).indices
    assert not torch.equal(got.gather(-1, tail), ref.gather(-1, tail))  # only the head is rescored


@pytest.mark.real_model
@pytest.mark.slow
def test_qwen25_real_weights_match_transformers_over_2000_tokens(qwen05, invented_items):
    """Qwen2.5-Coder-0.5B's real weights (q/k/v biases, 14 query heads on 2 KV heads, rope θ 1e6, tied embeddings)
    over a 2,000-token RAG prompt of its own tokenizer: the last logits as transformers computes them."""
    from kvrag.model.prompt import PromptBuilder

    builder = PromptBuilder(qwen05.load_tokenizer())
    item = invented_items[0]
    passages = [builder.passage_ids(c["title"], c["text"]) for c in item["ctxs"]]
    ids = torch.tensor(builder.build(passages, item["question"]).flat())
    ids = torch.cat([ids[:1000], ids[-1000:]]) if ids.shape[0] > 2000 else ids  # template head and question end
    assert ids.shape[0] >= 2000, ids.shape
    with torch.no_grad():
        # transformers' SDPA attention: eager's 14 x 2,000 x 2,000 score matrices a layer took most of a minute
        hf = AutoModelForCausalLM.from_pretrained(str(qwen05.path), dtype=torch.float32, attn_implementation="sdpa")
        ref = hf.eval()(ids[None], logits_to_keep=1).logits[0, -1]
        ours, _ = extend(Transformer.from_safetensors(qwen05.config, qwen05.weight_files(), torch.float32), None, ids)
    assert _rel_err(ours, ref) < 1e-4
    assert int(ours.argmax()) == int(ref.argmax())
