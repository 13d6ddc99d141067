"""kvrag's native kernels against their torch twins: row attention against a float64 softmax over exactly the
keys each row may see, the fp16-to-bf16 decode against torch's own cast."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvrag.kernels import fp16_to_bf16, native, row_attention

pytestmark = pytest.mark.skipif(not row_attention.available(),
                                reason="needs an x86-64 CPU with AVX-512 and a C++ compiler")


def _reference(q, q_pos, k, v):
    """float64 attention of q [R, Hq, D] at q_pos over k/v [S, Hkv, D], each row over keys 0..p: [R, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    kx, vx = (x.double().repeat_interleave(group, dim=1).transpose(0, 1) for x in (k, v))  # [Hq, S, D]
    mask = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]  # [R, S]
    out = F.scaled_dot_product_attention(q.double().transpose(0, 1), kx, vx, attn_mask=mask)
    return out.transpose(0, 1)


def _case(seed, rows, keys, n_q, n_kv, dim, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, n_q, dim, generator=g)
    k = (torch.randn(keys, n_kv, dim, generator=g) * 2).to(dtype)  # * 2: peaked softmaxes too
    v = torch.randn(keys, n_kv, dim, generator=g).to(dtype)
    q_pos = torch.randperm(keys, generator=g)[:rows].sort().values
    q_pos[0], q_pos[-1] = 0, keys - 1  # the first key alone, and every key
    return q, q_pos, k, v


@pytest.mark.parametrize("rows,keys,n_q,n_kv,dim", [
    (1, 1, 1, 1, 64),  # one row, one key
    (7, 100, 9, 3, 64),  # rows not a multiple of the 4-row tile, keys not of the 64-key block
    (33, 65, 2, 1, 64),  # one key past a block
    (50, 1000, 4, 4, 128),  # no grouping, head dim 128 in two column chunks
    (300, 3000, 9, 3, 64),  # SmolLM2's heads, many row blocks
])
def test_scattered_rows_equal_a_softmax_over_the_keys_they_see(rows, keys, n_q, n_kv, dim):
    q, q_pos, k, v = _case(rows + keys, rows, keys, n_q, n_kv, dim)
    got = row_attention.row_attention(q, q_pos, k, v)
    torch.testing.assert_close(got.double(), _reference(q, q_pos, k, v), rtol=1e-5, atol=2e-6)


def test_causal_rows_equal_sdpa_causal():
    q, _, k, v = _case(1, 500, 500, 6, 2, 64)
    got = row_attention.row_attention(q, torch.arange(500), k, v)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-6)


def test_bf16_keys_and_values_read_as_their_float32_values():
    q, q_pos, k, v = _case(2, 200, 1500, 9, 3, 64, torch.bfloat16)
    got = row_attention.row_attention(q, q_pos, k, v)
    torch.testing.assert_close(got, row_attention.row_attention(q, q_pos, k.float(), v.float()), rtol=0, atol=0)
    torch.testing.assert_close(got.double(), _reference(q, q_pos, k, v), rtol=1e-5, atol=2e-6)


needs_bf16_dot = pytest.mark.skipif(not row_attention.bf16_dot_available(), reason="needs a CPU with AVX512_BF16")


@needs_bf16_dot
@pytest.mark.parametrize("rows,keys,n_q,n_kv,dim", [(7, 100, 9, 3, 64), (50, 1000, 4, 4, 128), (300, 3000, 9, 3, 64)])
def test_bf16_pair_products_equal_a_softmax_over_the_keys_they_see(rows, keys, n_q, n_kv, dim):
    """bfloat16 queries and keys through vdpbf16ps: against the float64 softmax of the same bf16 values, and
    within float32 rounding of the kernel's float32 products (the products are exact; only sums reorder)."""
    q, q_pos, k, v = _case(rows * keys, rows, keys, n_q, n_kv, dim, torch.bfloat16)
    q = q.to(torch.bfloat16)
    got = row_attention.row_attention(q, q_pos, k, v)
    torch.testing.assert_close(got.double(), _reference(q, q_pos, k, v), rtol=1e-5, atol=2e-6)
    fp32 = row_attention.row_attention(q, q_pos, k, v, bf16_dot=False)
    torch.testing.assert_close(got, fp32, rtol=1e-5, atol=1e-6)
    assert not torch.equal(got, fp32)  # the pair path ran: its sums round differently somewhere


def test_bf16_dot_refused_for_float32_queries():
    q, q_pos, k, v = _case(6, 4, 100, 2, 1, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="bf16_dot needs"):
        row_attention.row_attention(q, q_pos, k, v, bf16_dot=True)


def test_a_row_never_sees_a_later_key():
    """Changing every key and value after a row's position leaves that row alone and changes the later rows:
    absolute positions, not a bottom-right-aligned mask (which would show each row the last keys)."""
    q, _, k, v = _case(3, 5, 300, 3, 1, 64)
    q_pos = torch.tensor([10, 70, 71, 130, 200])
    before = row_attention.row_attention(q, q_pos, k, v)
    k2, v2 = k.clone(), v.clone()
    k2[131:], v2[131:] = torch.randn_like(k2[131:]), torch.randn_like(v2[131:])
    after = row_attention.row_attention(q, q_pos, k2, v2)
    torch.testing.assert_close(after[:4], before[:4], rtol=0, atol=0)
    assert not torch.allclose(after[4], before[4], atol=1e-3)


def test_unsupported_head_dim_is_refused_not_miscomputed():
    q, q_pos, k, v = _case(4, 4, 10, 2, 1, 32)
    assert not row_attention.supports(32)
    with pytest.raises(RuntimeError, match="refused"):
        row_attention.row_attention(q, q_pos, k, v)


def test_positions_past_the_keys_are_refused():
    q, _, k, v = _case(5, 2, 10, 2, 1, 64)
    with pytest.raises(ValueError, match="outside keys"):
        row_attention.row_attention(q, torch.tensor([3, 10]), k, v)


def test_a_damaged_library_file_falls_back_instead_of_crashing(monkeypatch, tmp_path):
    damaged = tmp_path / "kvrag-kernels-0.so"
    damaged.write_bytes(b"not a shared library")
    monkeypatch.setattr(native, "_build", lambda: damaged)
    assert native.library.__wrapped__() is None


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv("KVRAG_NATIVE", "0")
    assert native.library.__wrapped__() is None


@pytest.mark.parametrize("planes", [True, False])
@pytest.mark.parametrize("n_first,n_second", [(1000, 1000), (37, 50), (16, 0), (3, 5)])
def test_fp16_to_bf16_rounds_as_torch_does(planes, n_first, n_second):
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
def test_fp16_to_bf16_rotated_equals_the_cast_then_torch_rotary(planes, rows, heads, dim, offset):
    """Keys rotated on the way (any head dim, vector and scalar halves; positions far from 0) are bit for bit what
    the bf16 cast followed by rotary.rotate gives; values only convert."""
    from kvrag.blend import rotary

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
def test_model_info_says_which_attention_runs(monkeypatch, capsys, request, fixture, dtype, kernel):
    """`kvrag model info` names the attention path: the row kernel for head dim 64 in float32 (with bf16 pair
    products for a bf16 model where the CPU has them), SDPA for head dim 16 (the kernel takes multiples of 64)."""
    import json

    from kvrag.tests.conftest import run_cli_in_process

    code, out, err = run_cli_in_process(monkeypatch, capsys, "model_cmd", "model", "info", "--json", "--model",
                                        str(request.getfixturevalue(fixture)), "--dtype", dtype, "--device", "cpu")
    assert code == 0, err
    attention = json.loads(out)["attention"]
    pairs = ", Q.K in bf16 pairs" if dtype == "bfloat16" and row_attention.bf16_dot_available() else ""
    assert attention == (f"kvrag row kernel (AVX-512, float32{pairs})" if kernel else "SDPA (float32)")
