"""The native row-attention kernel (kernels/row_attention.cpp) against a float64 softmax over exactly the keys each
row may see: scattered and causal rows, a head read in place from a paged pool, bf16 keys and bf16 pair products,
and the two ways it lays keys out (a workspace first, or each block as its rows reach it) giving the same bits.
Every test of the kernel runs on each build this CPU runs (the `isa` fixture: AVX-512, AVX2 + AVX-VNNI, AVX2),
each against its own reference; the bf16 pair products exist in the AVX-512 build alone."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from kvrag.kernels import attention, row_attention
from kvrag.kernels.attention import PagedKeys
from kvrag.kernels.cpu import cpu_flags

pytestmark = pytest.mark.skipif(not row_attention.available(),
                                reason="needs an x86-64 CPU with AVX-512 or AVX2 and a C++ compiler")


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
def test_scattered_rows_equal_a_softmax_over_the_keys_they_see(isa, rows, keys, n_q, n_kv, dim):
    q, q_pos, k, v = _case(rows + keys, rows, keys, n_q, n_kv, dim)
    got = row_attention.row_attention(q, q_pos, k, v)
    torch.testing.assert_close(got.double(), _reference(q, q_pos, k, v), rtol=1e-5, atol=2e-6)


def test_causal_rows_equal_sdpa_causal(isa):
    q, _, k, v = _case(1, 500, 500, 6, 2, 64)
    got = row_attention.row_attention(q, torch.arange(500), k, v)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-6)


def _paged(k, v, n_head, seed):
    """The first n_head keys of k, v scattered over a larger pool's rows in a random order: (PagedKeys, rest k, v)."""
    g = torch.Generator().manual_seed(seed)
    pool_k = torch.full((3 * n_head + 5, *k.shape[1:]), float("nan"), dtype=k.dtype)  # unread rows stay NaN
    pool_v = pool_k.clone()
    slots = torch.randperm(pool_k.shape[0], generator=g)[:n_head]
    pool_k[slots], pool_v[slots] = k[:n_head], v[:n_head]
    return PagedKeys(pool_k, pool_v, slots), k[n_head:], v[n_head:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,keys,n_head", [(1, 200, 199), (7, 100, 64), (40, 700, 333), (16, 48, 48), (5, 90, 1)])
def test_a_paged_head_reads_as_the_same_keys_contiguous(isa, dtype, rows, keys, n_head):
    """The first keys read from pool rows through slots give what the same keys contiguous give, bit for bit (the
    kernel's first pass copies each key into the same workspace place either way), and the joined copy (the torch
    paths' twin) is those very keys."""
    q, q_pos, k, v = _case(rows * keys, rows, keys, 9, 3, 64, dtype)
    q = q.to(dtype)
    head, k_rest, v_rest = _paged(k, v, n_head, rows)
    got = row_attention.row_attention(q, q_pos, k_rest, v_rest, bf16_dot=False, head=head)
    torch.testing.assert_close(got, row_attention.row_attention(q, q_pos, k, v, bf16_dot=False), rtol=0, atol=0)
    joined = head.join(k_rest, v_rest)
    assert torch.equal(joined[0], k) and torch.equal(joined[1], v)
    torch.testing.assert_close(got.double(), _reference(q.float(), q_pos, k, v), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("rows", [60, 2])
def test_attend_over_a_paged_head_matches_the_contiguous_keys_on_every_path(isa, rows):
    """`attend` with a paged head: through the row kernel, and through SDPA's paths (which read the joined copy),
    each against the same keys given contiguous. The head's tally counts the 512 rows the torch paths gather, and
    those the kernel lays out in its workspace for 60 rows; for 2 rows (a hit's short tail) it lays each key block
    out as it reads it, and nothing is copied out of the pool."""
    q, q_pos, k, v = _case(9, rows, 900, 9, 3, 64)
    paged, k_rest, v_rest = _paged(k, v, 512, 9)
    k_pos = torch.arange(900)
    for row_kernel in (True, False):
        head = replace(paged, tally=attention.RowTally())
        want = attention.attend(q, q_pos, k, v, k_pos, 3, torch.float32, row_kernel, attention.AttendPlans())
        got = attention.attend(q, q_pos, k_rest, v_rest, k_pos, 3, torch.float32, row_kernel,
                               attention.AttendPlans(), head=head)
        torch.testing.assert_close(got, want, rtol=0 if row_kernel else 1e-6, atol=0 if row_kernel else 1e-6)
        packed = 512 if rows == 60 else 0
        assert (head.tally.packed, head.tally.gathered) == ((packed, 0) if row_kernel else (0, 512))


@pytest.mark.parametrize("dtype,pairs", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, None)])
@pytest.mark.parametrize("rows,keys,n_head", [(1, 900, 899), (5, 300, 130), (40, 700, 333), (3, 64, 0)])
def test_keys_laid_out_as_their_rows_reach_them_give_the_workspaces_bits(isa, monkeypatch, dtype, pairs, rows,
                                                                           keys, n_head):
    """The two ways the kernel lays keys out (all of them in a workspace first, or each block into a thread's panel
    as its rows reach it) give the same bits, so a hit's few-row tail computes as a full prefill's rows did; values
    are read where they lie either way."""
    if pairs is None and not row_attention.bf16_dot_available():
        pytest.skip("needs the AVX-512 build on a CPU with AVX512_BF16")
    q, q_pos, k, v = _case(rows + keys, rows, keys, 9, 3, 64, dtype)
    q = q.to(dtype)
    head, k_rest, v_rest = _paged(k, v, n_head, rows) if n_head else (None, k, v)
    runs = []
    for blocks in (-1, 10 ** 6):  # always a workspace, never one
        monkeypatch.setattr(row_attention, "PACK_FROM_BLOCKS", blocks)
        runs.append(row_attention.row_attention(q, q_pos, k_rest, v_rest, bf16_dot=pairs, head=head))
    assert torch.equal(runs[0], runs[1])
    torch.testing.assert_close(runs[0].double(), _reference(q.float(), q_pos, k, v), rtol=1e-5, atol=2e-5)


def test_a_paged_head_of_another_dtype_is_refused(isa):
    q, q_pos, k, v = _case(3, 4, 100, 9, 3, 64)
    head, k_rest, v_rest = _paged(k.bfloat16(), v.bfloat16(), 50, 3)
    with pytest.raises(ValueError, match="paged head"):
        row_attention.row_attention(q, q_pos, k_rest.float(), v_rest.float(), head=head)


def test_bf16_keys_and_values_read_as_their_float32_values(isa):
    q, q_pos, k, v = _case(2, 200, 1500, 9, 3, 64, torch.bfloat16)
    got = row_attention.row_attention(q, q_pos, k, v)
    torch.testing.assert_close(got, row_attention.row_attention(q, q_pos, k.float(), v.float()), rtol=0, atol=0)
    torch.testing.assert_close(got.double(), _reference(q, q_pos, k, v), rtol=1e-5, atol=2e-6)


def _needs_bf16_dot():
    """Skips where the build this test runs has no bf16 pair products (the AVX2 builds, CPUs without AVX512_BF16)."""
    if not row_attention.bf16_dot_available():
        pytest.skip("needs the AVX-512 build on a CPU with AVX512_BF16")


@pytest.mark.parametrize("rows,keys,n_q,n_kv,dim", [(7, 100, 9, 3, 64), (50, 1000, 4, 4, 128), (300, 3000, 9, 3, 64)])
def test_bf16_pair_products_equal_a_softmax_over_the_keys_they_see(isa, rows, keys, n_q, n_kv, dim):
    """bfloat16 queries and keys through vdpbf16ps: against the float64 softmax of the same bf16 values, and
    within float32 rounding of the kernel's float32 products (the products are exact; only sums reorder)."""
    _needs_bf16_dot()
    q, q_pos, k, v = _case(rows * keys, rows, keys, n_q, n_kv, dim, torch.bfloat16)
    q = q.to(torch.bfloat16)
    got = row_attention.row_attention(q, q_pos, k, v)
    torch.testing.assert_close(got.double(), _reference(q, q_pos, k, v), rtol=1e-5, atol=2e-6)
    fp32 = row_attention.row_attention(q, q_pos, k, v, bf16_dot=False)
    torch.testing.assert_close(got, fp32, rtol=1e-5, atol=1e-6)
    assert not torch.equal(got, fp32)  # the pair path ran: its sums round differently somewhere


def test_bf16_dot_refused_for_float32_queries(isa):
    q, q_pos, k, v = _case(6, 4, 100, 2, 1, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="bf16_dot needs"):
        row_attention.row_attention(q, q_pos, k, v, bf16_dot=True)


def test_bf16_pairs_are_never_asked_of_the_avx2_builds(isa, monkeypatch):
    """On AVX2 (no vdpbf16ps) bf16 queries and keys take float32 products by default, bf16_dot=True is refused, and
    the kernel itself refuses pairs should the Python side ask for them."""
    q, q_pos, k, v = _case(8, 20, 300, 4, 2, 64, torch.bfloat16)
    q = q.to(torch.bfloat16)
    if isa == "avx512":
        assert row_attention.bf16_dot_available() == ("avx512_bf16" in cpu_flags())
        return
    assert not row_attention.bf16_dot_available() and not row_attention.bf16_dot_serves(torch.bfloat16)
    got = row_attention.row_attention(q, q_pos, k, v)
    assert torch.equal(got, row_attention.row_attention(q, q_pos, k, v, bf16_dot=False))
    with pytest.raises(ValueError, match="bf16_dot needs"):
        row_attention.row_attention(q, q_pos, k, v, bf16_dot=True)
    monkeypatch.setattr(row_attention, "bf16_dot_available", lambda: True)
    with pytest.raises(RuntimeError, match="code 4"):
        row_attention.row_attention(q, q_pos, k, v, bf16_dot=True)


def test_a_row_never_sees_a_later_key(isa):
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


def test_unsupported_head_dim_is_refused_not_miscomputed(isa):
    q, q_pos, k, v = _case(4, 4, 10, 2, 1, 32)
    assert not row_attention.supports(32)
    with pytest.raises(RuntimeError, match="refused"):
        row_attention.row_attention(q, q_pos, k, v)


def test_positions_past_the_keys_are_refused(isa):
    q, _, k, v = _case(5, 2, 10, 2, 1, 64)
    with pytest.raises(ValueError, match="outside keys"):
        row_attention.row_attention(q, torch.tensor([3, 10]), k, v)


