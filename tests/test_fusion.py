"""Blending against a full prefill (the reference), rotation, masking and loader overlap."""

from __future__ import annotations

import math
import threading
from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F

from kvrag.blend.config import BlendConfig
from kvrag.engine.prefiller import Prefiller
from kvrag.model.runtime import Runtime
from kvrag.precompute.plain import chunk_kv, layers_to_numpy
from kvrag.store.chunks import chunk_id_for
from kvrag.store.env import StoreEnv
from kvrag.store.kv import LocalKVTable
from kvrag.store.maintenance import verify


@pytest.fixture(scope="module")
def tiny_runtime(tiny_llama_dir) -> Runtime:
    return Runtime.load(str(tiny_llama_dir), "float32")


def _chunks(runtime: Runtime, items, n: int = 4, words: int = 50) -> list[tuple[str, list[int]]]:
    """n invented passages cut to `words` words, as (chunk_id, token_ids)."""
    out = []
    for ctx in items[0]["ctxs"][:n]:
        ids = runtime.prompts.passage_ids("", " ".join(ctx["text"].split()[:words]))
        out.append((chunk_id_for(ids, runtime.local.tokenizer_fingerprint), ids))
    return out


@pytest.fixture(scope="module")
def tiny_hd64_runtime(tiny_llama_hd64_dir) -> Runtime:
    return Runtime.load(str(tiny_llama_hd64_dir), "float32")


def _store(path, runtime: Runtime, items):
    """A store holding the KV of four chunks (as precompute would write them), its engine, and the chunks."""
    env = StoreEnv.open(path, create=True)
    engine = Prefiller.open(runtime, env)
    chunks = _chunks(runtime, items)
    table = LocalKVTable(env, runtime.fingerprint, "fp16")
    with torch.inference_mode():
        for chunk_id, ids in chunks:
            table.put_chunk(chunk_id, ids, layers_to_numpy(chunk_kv(runtime, engine.preamble, ids)))
    return env, engine, chunks


@pytest.fixture
def stored(tmp_path, tiny_runtime, invented_items):
    """A store holding the KV of four chunks (as precompute would write them), and the chunks."""
    env, engine, chunks = _store(tmp_path / "store", tiny_runtime, invented_items)
    yield env, engine, chunks
    env.close()


@pytest.fixture(params=["head dim 16", "head dim 64"])
def any_stored(request, tmp_path, tiny_runtime, invented_items):
    """`stored`, also for a model with head dim 64, whose attention (float32, on an AVX-512 CPU) goes through
    kvrag's row-attention kernel instead of SDPA."""
    runtime = tiny_runtime if request.param == "head dim 16" else request.getfixturevalue("tiny_hd64_runtime")
    env, engine, chunks = _store(tmp_path / "store", runtime, invented_items)
    yield env, engine, chunks
    env.close()


QUESTION = "Who was the spouse of the performer?"


def test_ratio_one_reproduces_full_prefill(any_stored):
    _, engine, chunks = any_stored
    full = engine.prefill(chunks, QUESTION, mode="full")
    blended = engine.prefill(chunks, QUESTION, mode="blend", config=BlendConfig(ratio=1.0))
    assert blended.recomputed_chunk_tokens == blended.chunk_tokens
    torch.testing.assert_close(blended.logits, full.logits, rtol=1e-4, atol=2e-4)
    # the whole cache too, so decoding continues from the same state
    n = full.prompt_tokens
    torch.testing.assert_close(blended.cache.k[:, :n], full.cache.k[:, :n], rtol=1e-3, atol=1e-3)


def test_ratio_zero_is_full_reuse(any_stored):
    _, engine, chunks = any_stored
    reuse = engine.prefill(chunks, QUESTION, mode="reuse")
    zero = engine.prefill(chunks, QUESTION, mode="blend", config=BlendConfig(ratio=0.0))
    assert zero.recomputed_chunk_tokens == reuse.recomputed_chunk_tokens == 0
    torch.testing.assert_close(zero.logits, reuse.logits)


def test_blend_lies_between_reuse_and_full(any_stored):
    """Recomputing more tokens moves the logits towards the full prefill's."""
    _, engine, chunks = any_stored
    full = engine.prefill(chunks, QUESTION, mode="full").logits

    def kl(mode, ratio=0.15):
        got = engine.prefill(chunks, QUESTION, mode=mode, config=BlendConfig(ratio=ratio)).logits
        return float(F.kl_div(got.log_softmax(-1), full.log_softmax(-1), log_target=True, reduction="sum"))

    assert kl("blend", 0.5) < kl("reuse")
    assert kl("blend", 0.5) < kl("blend", 0.05) + 1e-6


def test_prefix_mode_reuses_only_the_first_chunk(any_stored):
    _, engine, chunks = any_stored
    prefix = engine.prefill(chunks, QUESTION, mode="prefix")
    full = engine.prefill(chunks, QUESTION, mode="full")
    # the first chunk's stored KV is exact (it was computed right after the preamble): same logits
    assert prefix.recomputed_chunk_tokens == prefix.chunk_tokens - len(chunks[0][1])
    torch.testing.assert_close(prefix.logits, full.logits, rtol=1e-3, atol=5e-3)


def test_blend_reuses_the_first_chunk_as_prefix_caching_does(any_stored):
    """The first chunk follows the preamble, so its stored KV is exact: a blend keeps it as loaded at every layer
    (bit for bit prefix caching's), still recomputing the same share of all chunk tokens elsewhere."""
    _, engine, chunks = any_stored
    n_pre, n_first = len(engine.preamble), len(chunks[0][1])
    first = slice(n_pre, n_pre + n_first)
    prefix = engine.prefill(chunks, QUESTION, mode="prefix")
    reused = engine.prefill(chunks, QUESTION, mode="blend", config=BlendConfig(ratio=0.5))
    ranked = engine.prefill(chunks, QUESTION, mode="blend", config=BlendConfig(ratio=0.5, exact_first_chunk=False))
    assert reused.recomputed_chunk_tokens == ranked.recomputed_chunk_tokens == math.ceil(0.5 * reused.chunk_tokens)
    assert torch.equal(reused.cache.k[:, first], prefix.cache.k[:, first])
    assert torch.equal(reused.cache.v[:, first], prefix.cache.v[:, first])
    assert not torch.equal(ranked.cache.v[:, first], prefix.cache.v[:, first])  # layer 0 computed afresh there


@pytest.mark.parametrize("deviation", ["v", "k"])
def test_keys_the_loader_rotates_give_the_same_blend_bit_for_bit(tmp_path, tiny_llama_hd64_dir, invented_items,
                                                                 monkeypatch, deviation):
    """A bf16 model over an fp16 store: keys rotated as they load (the native pass on an AVX-512 CPU) give the blend
    exactly the logits and cache of keys loaded before rotary and rotated by the blend itself."""
    from kvrag.kernels import fp16_to_bf16
    from kvrag.load.loader import LayerLoader

    runtime = Runtime.load(str(tiny_llama_hd64_dir), "bfloat16")
    env, engine, chunks = _store(tmp_path / "store", runtime, invented_items)
    calls = []
    if fp16_to_bf16.available():
        convert_rotated = fp16_to_bf16.convert_rotated
        monkeypatch.setattr(fp16_to_bf16, "convert_rotated", lambda *a: calls.append(1) or convert_rotated(*a))
    try:
        config = BlendConfig(ratio=0.3, deviation=deviation)
        rotated = engine.prefill(chunks, QUESTION, mode="blend", config=config)
        assert calls or not fp16_to_bf16.available()
        real_init = LayerLoader.__init__
        monkeypatch.setattr(LayerLoader, "__init__", lambda self, *a, rope=None, **kw: real_init(self, *a, **kw))
        plain = engine.prefill(chunks, QUESTION, mode="blend", config=config)
    finally:
        env.close()
    n = plain.prompt_tokens
    assert rotated.recomputed_chunk_tokens == plain.recomputed_chunk_tokens
    assert torch.equal(rotated.logits, plain.logits)
    assert torch.equal(rotated.cache.k[:, :n], plain.cache.k[:, :n])
    assert torch.equal(rotated.cache.v[:, :n], plain.cache.v[:, :n])


def test_rotation_at_load_equals_computing_at_that_offset(tiny_runtime):
    """Pre-rotary keys stored at chunk-local positions, rotated to an offset at load, give the same
    attention scores as keys computed at that offset."""
    model = tiny_runtime.model
    ids = torch.randint(0, 49152, (20,), generator=torch.Generator().manual_seed(5))
    h = model.embed(ids)
    local = model.project(0, h, torch.arange(20))  # as stored: positions 0..19
    offset = torch.arange(20) + 1234
    at_offset = model.project(0, h, offset)  # computed where it will stand
    torch.testing.assert_close(local.k, at_offset.k)  # pre-rotary keys do not depend on position
    placed = model.rotate_keys(local.k, offset)
    fresh = model.rotate_keys(at_offset.k, offset)
    scores_placed = torch.einsum("qhd,khd->hqk", at_offset.q[:, ::model.cfg.group_size], placed)
    scores_fresh = torch.einsum("qhd,khd->hqk", at_offset.q[:, ::model.cfg.group_size], fresh)
    torch.testing.assert_close(scores_placed, scores_fresh)
    # and the rotated cached tensor itself was not modified in place
    torch.testing.assert_close(local.k, model.project(0, h, torch.arange(20)).k)


def test_selected_rows_never_see_later_keys(tiny_runtime):
    """Selected rows at positions 3 and 7 over keys 0..9: each sees keys <= its own position only.
    A bottom-right-aligned causal mask (SDPA's is_causal with fewer queries than keys) would let the
    row at 3 see keys 4..8 as well, and gives a different answer."""
    model = tiny_runtime.model
    g = torch.Generator().manual_seed(6)
    hd, hq, hkv = model.cfg.head_dim, model.cfg.n_heads, model.cfg.n_kv_heads
    q = torch.randn(2, hq, hd, generator=g)
    k = torch.randn(10, hkv, hd, generator=g)
    v = torch.randn(10, hkv, hd, generator=g)
    q_pos, k_pos = torch.tensor([3, 7]), torch.arange(10)
    got = model.attend(q, q_pos, k, v, k_pos).view(2, hq, hd)

    kx = k.repeat_interleave(model.cfg.group_size, dim=1)  # [10, Hq, hd]
    vx = v.repeat_interleave(model.cfg.group_size, dim=1)
    for r, p in enumerate(q_pos.tolist()):  # the reference: a plain softmax over keys 0..p
        scores = torch.einsum("hd,khd->hk", q[r], kx[: p + 1]) / hd**0.5
        ref = torch.einsum("hk,khd->hd", scores.softmax(-1), vx[: p + 1])
        torch.testing.assert_close(got[r], ref, rtol=1e-5, atol=1e-5)

    bottom_right = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], kx.transpose(0, 1)[None], vx.transpose(0, 1)[None],
        attn_mask=torch.ones(2, 10, dtype=torch.bool).tril(diagonal=10 - 2))[0].transpose(0, 1)
    assert not torch.allclose(bottom_right[0], got[0], atol=1e-3)


@pytest.mark.parametrize("path,masked_groups", [("key segments", 1), ("key segments", 2), ("key segments", 5),
                                                  ("row blocks", None)])
def test_scattered_rows_in_blocks_equal_a_plain_softmax(tiny_runtime, monkeypatch, path, masked_groups):
    """Many selected rows spread over the prompt go through attention in pieces (key segments merged by
    log-sum-exp, the rows inside each segment in groups reading keys up to their own last row; or row blocks
    that each read keys up to their last row); every row must still equal a softmax over keys 0..p, whichever
    piece it falls in."""
    import kvrag.kernels.attention as attention_module

    monkeypatch.setattr(attention_module, "BLOCK_ROWS", 16)  # 150 rows -> 9 blocks
    monkeypatch.setattr(attention_module, "SEGMENT_KEYS", 64)  # 600 keys -> 10 segments, ≈15 rows inside each
    if masked_groups is not None:
        monkeypatch.setattr(attention_module, "MASKED_GROUPS", masked_groups)
    if path == "row blocks":
        monkeypatch.setattr(attention_module, "_FLASH_CPU", None)
    model = tiny_runtime.model
    g = torch.Generator().manual_seed(8)
    hd, hq, hkv = model.cfg.head_dim, model.cfg.n_heads, model.cfg.n_kv_heads
    q_pos = torch.randperm(600, generator=g)[:150].sort().values
    q = torch.randn(150, hq, hd, generator=g)
    k = torch.randn(600, hkv, hd, generator=g)
    v = torch.randn(600, hkv, hd, generator=g)
    got = model.attend(q, q_pos, k, v, torch.arange(600)).view(150, hq, hd)
    kx = k.repeat_interleave(model.cfg.group_size, dim=1)
    vx = v.repeat_interleave(model.cfg.group_size, dim=1)
    for r, p in enumerate(q_pos.tolist()):
        scores = torch.einsum("hd,khd->hk", q[r], kx[: p + 1]) / hd**0.5
        ref = torch.einsum("hk,khd->hd", scores.softmax(-1), vx[: p + 1])
        torch.testing.assert_close(got[r], ref, rtol=1e-5, atol=1e-5)


def test_segment_plans_follow_the_rows(tiny_runtime, monkeypatch):
    """The key-segment plan (with its masks) is kept for the next call with the same rows; a call with other
    rows of the same count, or over other keys, must not reuse it: each result equals a plain softmax."""
    import kvrag.kernels.attention as attention_module

    monkeypatch.setattr(attention_module, "SEGMENT_KEYS", 32)
    model = tiny_runtime.model
    g = torch.Generator().manual_seed(11)
    hd, hq, hkv, group = model.cfg.head_dim, model.cfg.n_heads, model.cfg.n_kv_heads, model.cfg.group_size
    k = torch.randn(300, hkv, hd, generator=g)
    v = torch.randn(300, hkv, hd, generator=g)
    q = torch.randn(40, hq, hd, generator=g)

    def rows_ending_at(p: int) -> torch.Tensor:  # 40 sorted positions, the last at p
        return torch.cat([torch.randperm(p, generator=g)[:39].sort().values, torch.tensor([p])])

    one, other, shorter = rows_ending_at(299), rows_ending_at(299), rows_ending_at(199)  # one, other: same segments
    plans = []
    for q_pos, n_keys in [(one, 300), (one, 300), (other, 300), (shorter, 200), (one, 300)]:
        got = model.attend(q, q_pos, k[:n_keys], v[:n_keys], torch.arange(n_keys)).view(40, hq, hd)
        plans.append(model.attend_plans.last)
        for r, p in enumerate(q_pos.tolist()):
            kx = k[: p + 1].repeat_interleave(group, dim=1)
            vx = v[: p + 1].repeat_interleave(group, dim=1)
            ref = torch.einsum("hk,khd->hd", (torch.einsum("hd,khd->hk", q[r], kx) / hd**0.5).softmax(-1), vx)
            torch.testing.assert_close(got[r], ref, rtol=1e-5, atol=1e-5)
    assert plans[1] is plans[0]  # the same rows again: built once
    assert len({id(plan) for plan in plans[1:]}) == 4  # other rows, other keys, then the first rows again: rebuilt


def test_loader_overlaps_compute(tiny_runtime, stored, monkeypatch):
    """Each layer's load starts while the previous layer computes, shown by order, not by the clock: layer a's
    step does not end until the store read of layer a+1 has begun. A loader that waits for the compute (or a
    blend that loads a layer only after the last one's compute) leaves that wait to time out, and fails."""
    import kvrag.blend.fusion as fusion

    n_layers = tiny_runtime.model.cfg.n_layers
    began = [threading.Event() for _ in range(n_layers)]  # set as the store read of that layer begins
    _on_read(monkeypatch, "get_layer_raw", began)
    _on_read(monkeypatch, "layer_views", began)
    real_step, overlapped = fusion.layer_step, {}

    def step_until_next_read(model, layer, *args, **kwargs):
        out = real_step(model, layer, *args, **kwargs)
        if layer + 1 < n_layers:  # 10 s: a generous bound for a busy machine, never reached when loads overlap
            overlapped[layer] = began[layer + 1].wait(timeout=10)
        return out

    monkeypatch.setattr(fusion, "layer_step", step_until_next_read)
    env, _, chunks = stored
    out = Prefiller.open(tiny_runtime, env).prefill(chunks, QUESTION, mode="reuse")
    assert overlapped == {layer: True for layer in range(n_layers - 1)}
    loads = {layer: (s, e) for kind, layer, s, e in out.spans if kind == "load"}
    computes = {layer: (s, e) for kind, layer, s, e in out.spans if kind == "compute"}
    assert sorted(loads) == sorted(computes) == list(range(n_layers))
    for a, b in pairwise(range(n_layers)):
        assert loads[b][0] < computes[a][1]  # and the spans the prefill reports say so too


def _on_read(monkeypatch, name: str, began: list[threading.Event]) -> None:
    """LocalKVTable.<name>(…, layer, …) sets began[layer] before it reads."""
    real = getattr(LocalKVTable, name)

    def read(self, chunks, layer, *args, **kwargs):
        began[layer].set()
        return real(self, chunks, layer, *args, **kwargs)

    monkeypatch.setattr(LocalKVTable, name, read)


def test_damaged_value_is_never_used(stored, tiny_runtime):
    env, engine, chunks = stored
    reference = engine.prefill(chunks, QUESTION, mode="reuse").logits
    table = LocalKVTable(env, tiny_runtime.fingerprint, "fp16")
    key = table.key(chunks[1][0]).layer(2).to_bytes()
    with env.env.begin(write=True, db=env.db("kv")) as txn:  # flip one payload byte
        value = bytearray(txn.get(key))
        value[-5] ^= 0x40
        txn.put(key, bytes(value))
    assert not verify(env).ok
    again = engine.prefill(chunks, QUESTION, mode="reuse")
    torch.testing.assert_close(again.logits, reference, rtol=1e-3, atol=2e-3)  # recomputed, not damaged
    assert engine.flush_write_back() == 1  # and the store is repaired
    assert verify(env).ok


def test_missing_chunk_is_computed_and_written_back(stored, tiny_runtime):
    env, engine, chunks = stored
    extra_ids = tiny_runtime.prompts.passage_ids("", "A passage nobody precomputed, about owls.")
    extra = (chunk_id_for(extra_ids, tiny_runtime.local.tokenizer_fingerprint), extra_ids)
    table = LocalKVTable(env, tiny_runtime.fingerprint, "fp16")
    assert not table.has(extra[0])
    out = engine.prefill(chunks + [extra], QUESTION, mode="blend", config=BlendConfig(ratio=1.0))
    full = engine.prefill(chunks + [extra], QUESTION, mode="full")
    torch.testing.assert_close(out.logits, full.logits, rtol=1e-4, atol=2e-4)
    assert engine.flush_write_back() == 1 and table.has(extra[0])


def test_prefill_after_a_prefix_uses_exact_causal_alignment(tiny_runtime):
    """Queries that are the last rows of the keys (the fast padded-causal path) equal the explicit
    absolute-position mask."""
    model = tiny_runtime.model
    g = torch.Generator().manual_seed(7)
    q = torch.randn(5, model.cfg.n_heads, model.cfg.head_dim, generator=g)
    k = torch.randn(9, model.cfg.n_kv_heads, model.cfg.head_dim, generator=g)
    v = torch.randn(9, model.cfg.n_kv_heads, model.cfg.head_dim, generator=g)
    q_pos, k_pos = torch.arange(4, 9), torch.arange(9)  # 5 queries, 4 padding rows: the padded path
    fast = model.attend(q, q_pos, k, v, k_pos)
    shuffled = torch.tensor([8, 4, 6, 5, 7])  # same rows, not in order: takes the mask path
    masked = model.attend(q[shuffled - 4], shuffled, k, v, k_pos)
    torch.testing.assert_close(fast[shuffled - 4], masked, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("codec, atol", [("fp16", 2e-3), ("bf16", 2e-2), ("int8", 5e-2)])
def test_every_codec_reaches_the_blend_through_the_loader(tmp_path, tiny_runtime, invented_items, codec, atol):
    """The loader hands each codec's stored KV over in its own dtype (fp16, or float32 for bf16 and int8) and
    the fusion casts it as it copies: full reuse from the store equals full reuse from the fp32 KV in memory,
    within the codec's rounding."""
    chunks = _chunks(tiny_runtime, invented_items)
    with StoreEnv.open(tmp_path / "store", create=True) as env:
        engine = Prefiller.open(tiny_runtime, env, codec)
        table = LocalKVTable(env, tiny_runtime.fingerprint, codec)
        with torch.inference_mode():
            for chunk_id, ids in chunks:
                table.put_chunk(chunk_id, ids, layers_to_numpy(chunk_kv(tiny_runtime, engine.preamble, ids), codec))
        from_store = engine.prefill(chunks, QUESTION, mode="reuse")
        assert from_store.bytes_loaded > 0 and from_store.chunk_tiers == ["store"] * len(chunks)
    # without a store every chunk is computed now and handed to the loader as fp32 KV in memory
    exact = Prefiller.open(tiny_runtime, None).prefill(chunks, QUESTION, mode="reuse")
    assert from_store.logits.argmax() == exact.logits.argmax()
    torch.testing.assert_close(from_store.logits, exact.logits, rtol=0, atol=atol * exact.logits.abs().max().item())



def test_chunk_starts_are_recomputed_whatever_their_deviation(stored):
    """With chunk_start_rows=2 the first two tokens of every chunk after the first are among the recomputed rows:
    their KV at the last layer is fresh, not the stored one a full reuse keeps."""
    _, engine, chunks = stored
    n_pre = len(engine.preamble)
    starts = [n_pre + sum(len(ids) for _, ids in chunks[:i]) for i in range(1, len(chunks))]
    reuse = engine.prefill(chunks, QUESTION, mode="reuse").cache.v[-1]
    forced = engine.prefill(chunks, QUESTION, mode="blend", config=BlendConfig(ratio=0.05, chunk_start_rows=2))
    assert forced.recomputed_chunk_tokens == math.ceil(0.05 * forced.chunk_tokens) >= 2 * len(starts)
    for p in starts:
        assert not torch.equal(forced.cache.v[-1, p:p + 2], reuse[p:p + 2])
