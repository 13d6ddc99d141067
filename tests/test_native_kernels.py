"""kvrag's native kernels against their torch twins: the library's fallbacks, the fp16-to-bf16 decode against
torch's own cast, the whole decode step's rotary position apart from its slot against the torch reference step
rotated the same way, its gemv and attention against float32 torch (row attention: tests/test_row_attention.py)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from kvrag.kernels import decode_step as native_decode
from kvrag.kernels import fp16_to_bf16, native, row_attention
from kvrag.kernels.attention import attend_few_rows
from kvrag.kernels.native import cpu_has_amx
from kvrag.kvcache.allocator import BlockLayout
from kvrag.kvcache.block_pool import BlockPool
from kvrag.model.files import resolve_model
from kvrag.model.prefill import prefill
from kvrag.model.step import CacheKV, Rows, run_layers
from kvrag.model.transformer import Transformer

pytestmark = pytest.mark.skipif(not row_attention.available(),
                                reason="needs an x86-64 CPU with AVX-512 or AVX2 and a C++ compiler")


def test_a_damaged_library_file_falls_back_instead_of_crashing(monkeypatch, tmp_path):
    damaged = tmp_path / "kvrag-kernels-0.so"
    damaged.write_bytes(b"not a shared library")
    monkeypatch.setattr(native, "build", lambda **_: damaged)
    assert native._library.__wrapped__(native.runnable()[0]) is None


def test_switched_off_by_configuration():
    """KVRAG_NATIVE=0 (config.py's native) reaches the model: no native kernel runs its attention."""
    from kvrag.config import KVRagConfig

    assert KVRagConfig.resolve({"KVRAG_NATIVE": "0"}).native is False
    assert KVRagConfig.resolve({}).native is True


@pytest.mark.parametrize("planes", [True, False])
@pytest.mark.parametrize("n_first,n_second", [(1000, 1000), (37, 50), (16, 0), (3, 5)])
def test_fp16_to_bf16_rounds_as_torch_does(isa, planes, n_first, n_second):
    """Every finite fp16 bit pattern class (subnormals, halfway cases, both signs), in byte planes or natural
    order, split between two outputs at any offset: bit for bit torch's fp16 -> bf16 cast."""
    bits = np.random.default_rng(n_first + n_second).integers(0, 65536, n_first + n_second, dtype=np.uint16)
    bits[(bits & 0x7C00) == 0x7C00] &= 0xBFFF  # stored values are finite: no inf or NaN patterns
    want = torch.from_numpy(bits.view(np.float16).copy()).to(torch.bfloat16)
    body = np.concatenate([bits & 0xFF, bits >> 8]).astype(np.uint8).tobytes() if planes else bits.tobytes()
    first, second = torch.empty(n_first, dtype=torch.bfloat16), torch.empty(n_second, dtype=torch.bfloat16)
    fp16_to_bf16.convert(body, planes, first, second)
    assert torch.equal(torch.cat([first, second]).view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("planes", [True, False])
@pytest.mark.parametrize("rows,heads,dim,offset", [(50, 3, 64, 0), (7, 2, 128, 6000), (5, 1, 40, 17), (3, 4, 6, 1)])
def test_fp16_to_bf16_rotated_equals_the_cast_then_torch_rotary(isa, planes, rows, heads, dim, offset):
    """Keys rotated on the way (any head dim, vector and scalar halves; positions far from 0) are bit for bit what
    the bf16 cast followed by rotary.rotate gives; values only convert."""
    from kvrag.model import rotary

    g = torch.Generator().manual_seed(rows + dim)
    kv = (torch.randn(2, rows, heads, dim, generator=g) * 3).half()  # [K|V, T, Hkv, hd]
    bits = kv.view(torch.int16).numpy().reshape(-1).view(np.uint16)
    body = np.concatenate([bits & 0xFF, bits >> 8]).astype(np.uint8).tobytes() if planes else bits.tobytes()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    cos, sin = rotary.cos_sin(inv_freq, torch.arange(offset, offset + rows), torch.bfloat16)  # [T, 1, hd]
    k_out, v_out = (torch.empty(rows, heads, dim, dtype=torch.bfloat16) for _ in range(2))
    fp16_to_bf16.convert_rotated(body, planes, k_out, v_out, cos, sin)
    want_k = rotary.rotate(kv[0].to(torch.bfloat16), cos, sin)
    assert torch.equal(k_out.view(torch.int16), want_k.view(torch.int16))
    assert torch.equal(v_out.view(torch.int16), kv[1].to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("fixture,dtype,kernel", [("tiny_llama_hd64_dir", "float32", True),
                                                  ("tiny_llama_dir", "float32", False),
                                                  ("tiny_llama_hd64_dir", "bfloat16", True)])
def test_model_info_says_which_attention_runs(monkeypatch, capsys, request, isa, fixture, dtype, kernel):
    """`kvrag model info` names the attention path: the row kernel for head dim 64 in float32 (with bf16 pair
    products for a bf16 model where the CPU has them), SDPA for head dim 16 (the kernel takes multiples of 64).
    A bf16 model on a CPU with AMX attends in bf16 (model.device.attention_dtype), which the row kernel does not
    take: SDPA in bfloat16 there, each CPU path against its own answer."""
    import json

    from kvrag.tests.conftest import run_cli_in_process

    monkeypatch.setenv("KVRAG_ISA", isa)  # the CLI's edge chooses the build from its configuration
    code, out, err = run_cli_in_process(monkeypatch, capsys, "model_cmd", "model", "info", "--json", "--model",
                                        str(request.getfixturevalue(fixture)), "--dtype", dtype, "--device", "cpu")
    assert code == 0, err
    attention = json.loads(out)["attention"]
    if dtype == "bfloat16" and cpu_has_amx():
        assert attention == "SDPA (bfloat16)"
        return
    assert json.loads(out)["kernels"] == isa
    pairs = ", Q.K in bf16 pairs" if dtype == "bfloat16" and row_attention.bf16_dot_available() else ""
    name = native.ISA_NAMES[isa]
    assert attention == (f"kvrag row kernel ({name}, float32{pairs})" if kernel else "SDPA (float32)")


# ---- the whole decode step: a row's rotary position apart from its slot (a reduced KV holds fewer rows) ----------

needs_native_step = pytest.mark.skipif(not native_decode.available(), reason="kvrag's native decode step is not built")


def _load(path, dtype) -> Transformer:
    local = resolve_model(str(path))
    model = Transformer.from_safetensors(local.config, local.weight_files(), dtype)
    if dtype == torch.bfloat16 and not native_decode.step_serves(model.step_weights()):
        pytest.skip("the native decode step does not serve this model here")
    return model


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def _reference_step(model, cache, token: int, rotary: int) -> torch.Tensor:
    """decode_step_reference with q and k rotated to `rotary` (`positions_cos_sin(rotary)`) instead of the slot
    cache.length, where K/V still go and up to which the row attends: the rescored logits [V]."""
    slot = torch.tensor([cache.length])
    rows = Rows(model.embed(torch.tensor([token])), slot, model.positions_cos_sin(torch.tensor([rotary])))
    logits = run_layers(model, rows, CacheKV(model, cache, slot))
    cache.length += 1
    return logits[0]


def _native_logits(model, logits: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """A native step's head logits [R, V] rescored from its outputs h [R, D] as RowStep does, a row at a time
    (so that a batch's rows and a row stepped alone rescore alike)."""
    return torch.stack([model.rescored(logits[r:r + 1], model._normed(h[r:r + 1]))[0] for r in range(h.shape[0])])


def _stepped(model, prompt: torch.Tensor, feed: list[int], offset: int, native: bool):
    """Prefill `prompt`, then feed token j at slot len(prompt) + j rotated to that + offset, through WholeStep
    (native) or the torch reference: the logits [V] of every step, and the cache."""
    _, cache = prefill(model, prompt, extra=len(feed))
    step = native_decode.WholeStep(model.step_weights(), cache.k, cache.v,
                                   *model.positions_cos_sin(torch.arange(cache.capacity + offset))) if native else None
    out = []
    for token in feed:
        if step is None:
            out.append(_reference_step(model, cache, token, cache.length + offset))
            continue
        h, logits = model.embed_tokens[token][None].clone(), torch.empty(1, model.lm_head.shape[0])  # [1, D], [1, V]
        step(cache.length, h[0], logits[0], rotary=cache.length + offset)
        out.append(_native_logits(model, logits, h)[0])
        cache.length += 1
    return out, cache


def _check_near_reference(path, prompt, feed, offset, logits: list[torch.Tensor], k, v) -> None:
    """A native sequence's logits per step and K/V [L, T, Hkv, hd] against the torch reference stepped at the
    same slots and rotary positions, to native-vs-torch's bounds (tests/test_decode.py): logits within a few
    bf16 steps of the reference's (as close to the float32 model's as the reference's own are), the prompt's
    rows untouched, each new key and value within one rounding step in layer 0 and a few in later layers."""
    (ref, ref_cache), (truth, _) = (_stepped(_load(path, dtype), prompt, feed, offset, native=False)
                                    for dtype in (torch.bfloat16, torch.float32))
    for a, b, t in zip(logits, ref, truth, strict=True):
        ref_err = (b - t).abs().max()
        assert (a - t).abs().max() <= 1.5 * ref_err + 1e-3
        torch.testing.assert_close(a, b, rtol=2 ** -6, atol=4 * ref_err)
    n = len(prompt)
    for got, want in ((k, ref_cache.k), (v, ref_cache.v)):  # [L, T, Hkv, hd]
        assert torch.equal(got[:, :n], want[:, :n])
        new, old = got[:, n:].float(), want[:, n:].float()  # [L, steps, Hkv, hd]
        scale = old.abs().amax(dim=(-1, -2), keepdim=True)  # [L, steps, 1, 1] each row's largest
        assert ((new[0] - old[0]).abs() <= 2 ** -8 * (old[0].abs() + scale[0])).all()
        assert ((new - old).abs() <= 2 ** -5 * (old.abs() + scale)).all()


@needs_native_step
@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_whole_step_rotates_to_its_rotary_position_not_its_slot(isa, fixture, request):
    """Rows written at slots 40..47 and rotated to positions 77..84 (37 tokens dropped before them): the torch
    reference rotated the same way, and not the step rotated at its slot (the keys then differ far past the
    bound: the rotation is the kernel's, not within tolerance)."""
    path = request.getfixturevalue(fixture)
    model, prompt, feed = _load(path, torch.bfloat16), _tokens(40, 20), _tokens(8, 21).tolist()
    logits, cache = _stepped(model, prompt, feed, 37, native=True)
    _check_near_reference(path, prompt, feed, 37, logits, cache.k, cache.v)
    _, at_slot = _stepped(model, prompt, feed, 0, native=True)
    assert (cache.k[0, 40:].float() - at_slot.k[0, 40:].float()).abs().amax() > 0.1 * cache.k[0, 40:].abs().amax()


def _pooled(model, caches: list, steps: int) -> tuple[BlockPool, list]:
    """The caches' prompt rows in a pool of 16-row blocks, each table with room for `steps` more rows."""
    c = model.cfg
    pool = BlockPool(BlockLayout(c.n_layers, c.n_kv_heads, c.head_dim, "bfloat16", 16),
                     sum(-(-cache.capacity // 16) for cache in caches))
    tables = []
    for cache in caches:
        tables.append(pool.allocate(cache.length + steps))
        layers = [(cache.k[layer], cache.v[layer]) for layer in range(c.n_layers)]
        pool.write(tables[-1], layers, rows=torch.arange(cache.length))
    return pool, tables


@needs_native_step
def test_batch_rows_each_rotate_to_their_own_position(isa, tiny_qwen2_dir):
    """Three sequences in one batch, 0, 9 and 120 tokens dropped before their new rows (rotary positions up to
    156 over tables of at most 37 slots): each row's logits and K/V near the torch reference rotated as that row
    is, and the bits of the same sequence stepped alone by WholeStep."""
    model, lengths, offsets, steps = _load(tiny_qwen2_dir, torch.bfloat16), [5, 20, 33], [0, 9, 120], 4
    prompts, feeds = [_tokens(n, n) for n in lengths], _tokens(3 * steps, 22).view(3, steps)  # [B, steps]
    pool, tables = _pooled(model, [prefill(model, p, extra=steps)[1] for p in prompts], steps)
    step = native_decode.BatchStep(model.step_weights(), pool.kv, *model.positions_cos_sin(torch.arange(max(lengths) + 130)))
    table = torch.tensor([t.blocks + [-1] * (3 - len(t.blocks)) for t in tables])  # [B, 3]
    logits = torch.empty(steps, 3, model.lm_head.shape[0])  # [steps, B, V]
    for j in range(steps):
        positions, h = torch.tensor(lengths) + j, model.embed_tokens[feeds[:, j]].clone()  # [B], [B, D]
        step(positions, table, h, logits[j], n_threads=2, rotary=positions + torch.tensor(offsets))
        logits[j] = _native_logits(model, logits[j], h)
    for b, (prompt, offset) in enumerate(zip(prompts, offsets, strict=True)):
        kv = pool.gather([tables[b]])  # [L, 2, T, Hkv, hd]
        alone, cache = _stepped(model, prompt, feeds[b].tolist(), offset, native=True)
        assert torch.equal(logits[:, b], torch.stack(alone))
        assert torch.equal(kv[:, 0], cache.k) and torch.equal(kv[:, 1], cache.v)
        _check_near_reference(tiny_qwen2_dir, prompt, feeds[b].tolist(), offset, list(logits[:, b]), kv[:, 0], kv[:, 1])


@needs_native_step
def test_rotary_positions_past_the_tables_are_refused(isa, tiny_llama_hd64_dir):
    """A rotary position outside the rotary tables is refused before anything is written, whatever the slot;
    a slot past the tables with its rotary position inside them is taken (a slot needs no angles)."""
    model = _load(tiny_llama_hd64_dir, torch.bfloat16)
    c, vocab = model.cfg, model.lm_head.shape[0]
    pool = BlockPool(BlockLayout(c.n_layers, c.n_kv_heads, c.head_dim, "bfloat16", 16), 4)
    pool.kv.zero_()
    step = native_decode.BatchStep(model.step_weights(), pool.kv, *model.positions_cos_sin(torch.arange(20)))
    h, logits, table = model.embed_tokens[:2].clone(), torch.empty(2, vocab), torch.tensor([[0, 1], [2, 3]])
    for rotary in ([3, 20], [-1, 5], [3, 10**6]):
        with pytest.raises(RuntimeError, match="rotary"):
            step(torch.tensor([3, 5]), table, h, logits, 1, torch.tensor(rotary))
    assert not pool.kv.any()
    for rotary in (torch.tensor([3, 5], dtype=torch.int32), torch.tensor([3])):
        with pytest.raises(ValueError):
            step(torch.tensor([3, 5]), table, h, logits, 1, rotary)
    step(torch.tensor([3, 25]), table, h, logits, 1, torch.tensor([3, 19]))
    assert pool.kv[:, :, 3, 25 - 16].any() and torch.isfinite(logits).all()
    _, cache = prefill(model, _tokens(5, 23), extra=1)
    whole = native_decode.WholeStep(model.step_weights(), cache.k, cache.v, *model.positions_cos_sin(torch.arange(6)))
    with pytest.raises(RuntimeError, match="rotary"):
        whole(5, model.embed_tokens[0].clone(), torch.empty(vocab), 1, rotary=6)


# ---- the decode step's pieces (kernels/decode.cpp) alone -------------------------------------------------

needs_native = pytest.mark.skipif(not native_decode.available(), reason="kvrag's native kernels are not built here")


def _gemv(w, x, out, n_threads=1):
    """decode.cpp's bf16 matrix x vector: out [N] = w [N, K] @ x [K] (contiguous bf16; K % 16 == 0), float32 sums
    rounded to bf16; out bf16, or float32 holding the bf16-rounded values."""
    fn = native.function("kvrag_decode_gemv", ctypes.c_int, [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2
                         + [ctypes.c_int] * 2)
    if fn(w.data_ptr(), x.data_ptr(), out.data_ptr(), w.shape[0], w.shape[1], int(out.dtype == torch.float32),
          n_threads):
        raise RuntimeError("decode gemv refused the shapes")
    return out


def _attention(q, k, v, out, n_keys, scale):
    """decode.cpp's one row q [Hq, D] over the first n_keys rows of k, v [S, Hkv, D] (contiguous bf16) -> out."""
    fn = native.function("kvrag_decode_attention", ctypes.c_int, [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4
                         + [ctypes.c_float])
    if fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), n_keys, q.shape[0], k.shape[1], q.shape[1], scale):
        raise RuntimeError("decode attention refused the shapes")
    return out


@needs_native
@pytest.mark.parametrize("n, k", [(1, 16), (7, 576), (960, 576), (576, 1536), (4099, 64)])
def test_native_gemv_equals_linear_up_to_one_bf16_step(isa, n, k):
    g = torch.Generator().manual_seed(n + k)
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(k, generator=g).bfloat16()
    exact = w.double() @ x.double()  # [N]
    got = _gemv(w, x, torch.empty(n, dtype=torch.bfloat16), n_threads=2)
    ref = torch.nn.functional.linear(x[None], w)[0]
    step = exact.abs().clamp(min=1e-6) * 2 ** -7  # one bf16 ulp (8 significant bits), or less
    assert ((got.double() - exact).abs() <= step).all()
    assert ((got.double() - ref.double()).abs() <= step).all()
    wide = _gemv(w, x, torch.empty(n), n_threads=1)  # float32 out: the bf16 values, widened
    torch.testing.assert_close(wide, got.float(), rtol=0, atol=0)


@needs_native
@pytest.mark.parametrize("keys, n_kv, group, dim", [(1, 3, 3, 64), (15, 3, 3, 64), (333, 3, 3, 64), (2049, 2, 4, 128),
                                                    (100, 4, 1, 16)])
def test_native_attention_equals_a_float32_softmax(isa, keys, n_kv, group, dim):
    """One row over the first `keys` cache rows, against float64 SDPA; rows past them are never read."""
    g = torch.Generator().manual_seed(keys * 7 + dim)
    q = torch.randn(n_kv * group, dim, generator=g).bfloat16()  # [Hq, D]
    k = (torch.randn(keys + 9, n_kv, dim, generator=g) * 3).bfloat16()  # [S + 9, Hkv, D]
    v = torch.randn(keys + 9, n_kv, dim, generator=g).bfloat16()
    k[keys:], v[keys:] = float("nan"), float("nan")  # past the keys: must not leak in
    got = _attention(q, k, v, torch.empty_like(q), keys, dim ** -0.5)
    expand = lambda x: x[:keys].double().repeat_interleave(group, dim=1).transpose(0, 1)  # noqa: E731 [Hq, S, D]
    ref = torch.nn.functional.scaled_dot_product_attention(q.double()[:, None], expand(k), expand(v))[:, 0]
    torch.testing.assert_close(got.double(), ref, rtol=2 ** -7, atol=1e-3)
    few = attend_few_rows(q[None], k[:keys], v[:keys], group)[0].view_as(q)
    torch.testing.assert_close(got.float(), few.float(), rtol=2 ** -7, atol=1e-2)


@needs_native
def test_native_kernels_refuse_shapes_they_cannot_take(isa):
    with pytest.raises(RuntimeError):
        _gemv(torch.zeros(4, 17, dtype=torch.bfloat16), torch.zeros(17, dtype=torch.bfloat16),
                           torch.empty(4, dtype=torch.bfloat16))
    q = torch.zeros(18, 64, dtype=torch.bfloat16)  # 9 query heads a KV head: more than the kernel keeps
    kv = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):
        _attention(q, kv, kv, torch.empty_like(q), 4, 0.125)
