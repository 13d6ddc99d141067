"""Reading KV through block tables gives the model exactly the logits contiguous KV gives: the blended
prefill's `extend` over a cached prefix, and decoding over a cache rebuilt from the pool."""

from __future__ import annotations

import pytest
import torch

from kvrag.kvcache.allocator import BlockLayout
from kvrag.model.cache import DecodeCache
from kvrag.model.config import ModelConfig, RopeScaling
from kvrag.model.decode import decode_step
from kvrag.model.prefill import LayerKV, extend
from kvrag.model.transformer import Transformer
from kvrag.store.tiers.cache import TieredKVCache
from kvrag.store.tiers.lease import as_layers

CFG = ModelConfig(architecture="llama", vocab_size=97, hidden_size=48, intermediate_size=96, n_layers=3,
                  n_heads=6, n_kv_heads=2, head_dim=8, rms_eps=1e-5, rope_theta=10000.0,
                  rope_scaling=RopeScaling(), qkv_bias=False, tie_embeddings=True, max_positions=512)


@pytest.fixture(scope="module")
def model() -> Transformer:
    g = torch.Generator().manual_seed(0)
    c, hd = CFG, CFG.head_dim
    t = {"model.embed_tokens.weight": torch.randn(c.vocab_size, c.hidden_size, generator=g),
         "model.norm.weight": 1 + 0.1 * torch.randn(c.hidden_size, generator=g)}
    shapes = {"self_attn.q_proj.weight": (c.n_heads * hd, c.hidden_size),
              "self_attn.k_proj.weight": (c.n_kv_heads * hd, c.hidden_size),
              "self_attn.v_proj.weight": (c.n_kv_heads * hd, c.hidden_size),
              "self_attn.o_proj.weight": (c.hidden_size, c.n_heads * hd),
              "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
              "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
              "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
              "input_layernorm.weight": (c.hidden_size,), "post_attention_layernorm.weight": (c.hidden_size,)}
    for i in range(c.n_layers):
        for name, shape in shapes.items():
            w = torch.randn(*shape, generator=g)
            t[f"model.layers.{i}.{name}"] = 1 + 0.1 * w if len(shape) == 1 else 0.15 * w
    return Transformer(CFG, t, torch.float32)


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def cat(a: LayerKV, b: LayerKV) -> LayerKV:
    """Concatenate in float32 (the model's dtype here): exact for float16 values."""
    return LayerKV([torch.cat([x.float(), y.float()]) for x, y in zip(a.k, b.k, strict=True)],
                   [torch.cat([x.float(), y.float()]) for x, y in zip(a.v, b.v, strict=True)],
                   torch.cat([a.positions, b.positions]))


def per_layer(kv: LayerKV) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(zip(kv.k, kv.v, strict=True))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@torch.inference_mode()
def test_prefill_and_decode_through_block_tables_match_contiguous(model, dtype):
    """float16 is the store's dtype: the contiguous reference holds the same rounded values."""
    layout = BlockLayout(CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, dtype, block_size=16)
    cache = TieredKVCache(layout, 64 * layout.bytes_per_block)
    preamble_ids, chunk_a, chunk_b, rest = ids(11, 1), ids(37, 2), ids(21, 3), ids(9, 4)
    _, pre = extend(model, None, preamble_ids)  # the caller keeps the preamble's KV
    _, kv_a = extend(model, pre, chunk_a)
    _, kv_b = extend(model, cat(pre, kv_a), chunk_b)
    with cache.acquire(["A", "B"], [37, 21]) as lease:
        cache.insert(lease, [per_layer(kv_a), per_layer(kv_b)])

    with cache.acquire(["A", "B", "C"], [37, 21, 9]) as lease:
        assert lease.matched == 2
        paged = as_layers(cache.gather(lease.prefix))  # per layer [58, Hkv, hd], from scattered blocks
    positions = torch.arange(11 + 58)
    prefix_paged = cat(pre, LayerKV([k for k, _ in paged], [v for _, v in paged], positions[11:]))
    chunks = cat(kv_a, kv_b)
    rounded = LayerKV([k.to(getattr(torch, dtype)) for k in chunks.k], [v.to(getattr(torch, dtype)) for v in chunks.v],
                      chunks.positions)
    prefix_contig = cat(pre, rounded)
    logits_paged, new_paged = extend(model, prefix_paged, rest)
    logits_contig, new_contig = extend(model, prefix_contig, rest)
    assert torch.equal(logits_paged, logits_contig)

    def decoder(prefix: LayerKV, new: LayerKV) -> DecodeCache:
        full = cat(prefix, new)
        rope = model.positions_cos_sin(full.positions)
        return DecodeCache.from_prompt(
            model, [(model.rotate_keys(k, full.positions, rope), v) for k, v in zip(full.k, full.v, strict=True)], 4)

    d_paged, d_contig = decoder(prefix_paged, new_paged), decoder(prefix_contig, new_contig)
    token = int(logits_paged.argmax())
    for _ in range(3):
        a, b = decode_step(model, d_paged, token), decode_step(model, d_contig, token)
        assert torch.equal(a, b)
        token = int(a.argmax())
