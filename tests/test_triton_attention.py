"""Triton attention over the paged KV pool (kernels/triton_attention.py): each kernel against its torch twin on odd
shapes (under TRITON_INTERPRET=1 where no GPU is), and the twins against SDPA on the gathered K/V and against
kernels/attention.attend for what positions mean."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when @triton.jit decorates: before the import below

from kvrag.kernels import triton_attention as ta  # noqa: E402
from kvrag.kernels.attention import AttendPlans, PagedKeys, attend  # noqa: E402
from kvrag.kvcache.allocator import BlockTable  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# kernel vs twin: the online softmax sums in another order; a 16-bit pool's p.v takes p in two 16-bit parts, p to
# 2^-18 relative for bfloat16 (times max|v| ~ 4.5 here: 1.7e-5), 2^-22 for float16 (the module doc)
TOL = {torch.float32: 2e-5, torch.float16: 2e-5, torch.bfloat16: 4e-5}
HEADS = [(9, 3), (4, 4)]  # (Hq, Hkv): grouped query heads, and one KV head per query head
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_pool(n_blocks: int, block_size: int, n_kv: int, hd: int, dtype: torch.dtype, seed: int):
    """K and V pools [n_blocks, block_size, Hkv, hd] as a layer's view of an engine-shaped pool (outer strides)."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(2, 2, n_blocks, block_size, n_kv, hd, generator=g).to(dtype).to(DEVICE)  # [L, K/V, ...]
    return pool[1, 0], pool[1, 1]


def shuffled_table(n_rows: int, block_size: int, n_blocks: int, seed: int, width: int | None = None) -> torch.Tensor:
    """Distinct blocks in random order for n_rows key rows, padded with -1 to `width` (never read past the rows)."""
    used = -(-n_rows // block_size)
    blocks = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed))[:used]
    table = torch.full((width or used,), -1, dtype=torch.int32)
    table[:used] = blocks.to(torch.int32)
    return table.to(DEVICE)


def gathered(pool: torch.Tensor, table: torch.Tensor, n_rows: int) -> torch.Tensor:
    """A sequence's first n_rows key rows [n_rows, Hkv, hd], through the allocator's own slot map."""
    bs = pool.shape[1]
    blocks = table[:-(-n_rows // bs)].tolist()
    slots = torch.tensor(BlockTable(blocks, n_rows, bs).slots(), device=pool.device)
    return pool.reshape(-1, *pool.shape[2:])[slots]


def sdpa_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """q [R, Hq, hd] over contiguous k/v [S, Hkv, hd], row i seeing keys < visible[i]: SDPA, expanded heads."""
    group = q.shape[1] // k.shape[1]
    kh, vh = (x.float().repeat_interleave(group, dim=1).transpose(0, 1) for x in (k, v))  # [Hq, S, hd]
    mask = torch.arange(k.shape[0], device=q.device)[None, :] < visible[:, None].to(q.device)  # [R, S]
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), kh, vh, attn_mask=mask)  # [Hq, R, hd]
    return out.transpose(0, 1)


def scattered_positions(n_rows: int, n_keys: int, seed: int) -> torch.Tensor:
    """Sorted query positions [R] spread over the keys (repeats where R > S), the last at the keys' end."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, n_keys, (n_rows,), generator=g).sort().values
    pos[-1] = n_keys - 1
    return pos


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("n_rows,n_keys", [(1, 1), (1, 77), (13, 1), (13, 77)])
def test_rows_kernel_matches_twin(n_rows, n_keys, block_size, heads, dtype):
    (n_q, n_kv), hd = heads, 64
    k, v = make_pool(40, block_size, n_kv, hd, dtype, seed=n_keys + block_size)
    table = shuffled_table(n_keys, block_size, 40, seed=n_rows)
    q = torch.randn(n_rows, n_q, hd, generator=torch.Generator().manual_seed(7)).to(dtype).to(DEVICE)
    q_pos = scattered_positions(n_rows, n_keys, seed=block_size)
    visible = ta.visible_keys(q_pos, torch.arange(n_keys)).to(DEVICE)
    out = ta.rows_attention(q, k, v, table, visible)
    assert out.dtype == torch.float32 and out.shape == q.shape
    torch.testing.assert_close(out, ta.rows_attention_twin(q, k, v, table, visible), rtol=0, atol=TOL[k.dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_kernel_keys_with_gaps(dtype):
    """Keys of a Keyformer-reduced chunk (positions with gaps), a query before the first key (sees nothing: zeros),
    40 query rows (three row tiles), an odd head dim, a query tensor that is a strided view."""
    n_keys, hd, block_size = 77, 40, 5
    k_pos = torch.randperm(140, generator=torch.Generator().manual_seed(1))[:n_keys].sort().values
    q_pos = torch.cat([k_pos[:1] - 1, scattered_positions(39, 150, seed=2)]).sort().values
    visible = ta.visible_keys(q_pos, k_pos).to(DEVICE)
    assert visible[0] == 0 and visible[-1] == n_keys
    k, v = make_pool(30, block_size, 3, hd, dtype, seed=3)
    table = shuffled_table(n_keys, block_size, 30, seed=4, width=20)
    qkv = torch.randn(40, 15, hd, generator=torch.Generator().manual_seed(5)).to(dtype).to(DEVICE)
    q = qkv[:, :9]  # [R, Hq, hd]: a fused projection's query part
    out = ta.rows_attention(q, k, v, table, visible)
    torch.testing.assert_close(out, ta.rows_attention_twin(q, k, v, table, visible), rtol=0, atol=TOL[k.dtype])
    assert not out[0].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("splits", [1, 3])  # the keys in one program, or cut in parts merged after (flash-decoding)
def test_decode_kernel_matches_twin(block_size, heads, dtype, splits):
    (n_q, n_kv), hd = heads, 64
    lens = [1, 17, 70, 0]  # the last: a sequence with no key gets zeros
    k, v = make_pool(60, block_size, n_kv, hd, dtype, seed=block_size)
    width = -(-max(lens) // block_size) + 1  # padded past the longest
    tables = torch.stack([shuffled_table(max(n, 1), block_size, 60, seed=b, width=width) for b, n in enumerate(lens)])
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), n_q, hd, generator=torch.Generator().manual_seed(9)).to(dtype).to(DEVICE)
    out = ta.decode_attention(q, k, v, tables, seq_lens, splits=splits)
    assert out.dtype == torch.float32 and out.shape == q.shape
    torch.testing.assert_close(out, ta.decode_attention_twin(q, k, v, tables, seq_lens), rtol=0, atol=TOL[k.dtype])
    assert not out[-1].any()


@pytest.mark.parametrize("heads", HEADS)
def test_rows_twin_matches_sdpa_on_gathered_keys(heads):
    (n_q, n_kv), hd, n_keys = heads, 64, 77
    k, v = make_pool(30, 5, n_kv, hd, torch.bfloat16, seed=11)
    table = shuffled_table(n_keys, 5, 30, seed=12)
    q = torch.randn(13, n_q, hd, generator=torch.Generator().manual_seed(13)).to(DEVICE)
    visible = ta.visible_keys(scattered_positions(13, n_keys, seed=14), torch.arange(n_keys)).to(DEVICE)
    expected = sdpa_reference(q, gathered(k, table, n_keys), gathered(v, table, n_keys), visible)
    torch.testing.assert_close(ta.rows_attention_twin(q, k, v, table, visible), expected, rtol=0, atol=1e-5)


def test_decode_twin_matches_sdpa_per_sequence():
    lens, hd = [1, 17, 70], 64
    k, v = make_pool(40, 16, 3, hd, torch.float16, seed=21)
    tables = torch.stack([shuffled_table(n, 16, 40, seed=b, width=5) for b, n in enumerate(lens)])
    q = torch.randn(3, 9, hd, generator=torch.Generator().manual_seed(22)).to(DEVICE)
    out = ta.decode_attention_twin(q, k, v, tables, torch.tensor(lens, dtype=torch.int32, device=DEVICE))
    for b, n in enumerate(lens):
        visible = torch.tensor([n], device=DEVICE)
        expected = sdpa_reference(q[b:b + 1], gathered(k, tables[b], n), gathered(v, tables[b], n), visible)
        torch.testing.assert_close(out[b:b + 1], expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("gaps", [False, True])
def test_rows_twin_keeps_attend_position_semantics(gaps):
    """A query at position p sees exactly the keys at positions <= p, with keys at rows 0..S-1 or with gaps."""
    n_keys, hd, group = 77, 64, 3
    g = torch.Generator().manual_seed(31)
    k_pos = torch.randperm(120, generator=g)[:n_keys].sort().values if gaps else torch.arange(n_keys)
    q_pos = scattered_positions(13, int(k_pos[-1]) + 1, seed=32).clamp(min=int(k_pos[0]))  # each sees a key
    k, v = make_pool(20, 5, 3, hd, torch.float32, seed=33)
    table = shuffled_table(n_keys, 5, 20, seed=34)
    q = torch.randn(13, 9, hd, generator=g).to(DEVICE)
    keys, values = gathered(k, table, n_keys), gathered(v, table, n_keys)
    expected = attend(q, q_pos.to(DEVICE), keys, values, k_pos.to(DEVICE), group, torch.float32, False, AttendPlans())
    out = ta.rows_attention_twin(q, k, v, table, ta.visible_keys(q_pos, k_pos).to(DEVICE))
    torch.testing.assert_close(out.reshape(13, -1), expected, rtol=0, atol=1e-5)


def paged_head(n_pool: int, n_head: int, n_kv: int, hd: int, dtype: torch.dtype, seed: int) -> PagedKeys:
    """A cached prefix of n_head keys scattered over a flat pool [n_pool, Hkv, hd] (an engine pool's rows)."""
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(n_pool, n_kv, hd, generator=g).to(dtype).to(DEVICE) for _ in range(2))
    slots = torch.randperm(n_pool, generator=g)[:n_head].to(torch.int32).to(DEVICE)
    return PagedKeys(k, v, slots)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("n_head", [1, 70, 130])
def test_rows_kernel_reads_a_paged_head(n_head, heads, dtype):
    """The head's keys read through its slots, then the rest through the block table: the kernel against its twin,
    and the twin against SDPA over the keys joined in one tensor. Rows see part of the head, all of it, or more."""
    (n_q, n_kv), hd, n_rest = heads, 64, 45
    head = paged_head(200, n_head, n_kv, hd, dtype, seed=n_head)
    k, v = make_pool(20, 5, n_kv, hd, dtype, seed=51)
    table = shuffled_table(n_rest, 5, 20, seed=52)
    q = torch.randn(21, n_q, hd, generator=torch.Generator().manual_seed(53)).to(dtype).to(DEVICE)
    visible = ta.visible_keys(scattered_positions(21, n_head + n_rest, seed=54), torch.arange(n_head + n_rest))
    visible = visible.to(DEVICE)
    out = ta.rows_attention(q, k, v, table, visible, head=head)
    twin = ta.rows_attention_twin(q, k, v, table, visible, head=head)
    torch.testing.assert_close(out, twin, rtol=0, atol=TOL[dtype])
    slots = head.slots.long()
    keys = torch.cat([head.k[slots], gathered(k, table, n_rest)])  # [n_head + n_rest, Hkv, hd]
    values = torch.cat([head.v[slots], gathered(v, table, n_rest)])
    torch.testing.assert_close(twin, sdpa_reference(q, keys, values, visible), rtol=0, atol=1e-5)


@pytest.mark.parametrize("n_new", [3, 40])
def test_attend_on_triton_reads_a_paged_head_as_the_joined_keys(n_new):
    """`attend` with a paged head on the Triton path (a prefill after a prefix hit: the new rows over the cached keys
    and their own) against SDPA over the keys joined first: the same attention."""
    n_head, hd, group = 96, 64, 3
    head = paged_head(300, n_head, 3, hd, torch.float32, seed=61)
    g = torch.Generator().manual_seed(62)
    k, v = (torch.randn(n_new, 3, hd, generator=g).to(DEVICE) for _ in range(2))
    q = torch.randn(n_new, 9, hd, generator=g).to(DEVICE)
    q_pos = torch.arange(n_head, n_head + n_new)
    k_pos = torch.arange(n_head + n_new)
    paged = PagedKeys(head.k, head.v, head.slots.long())
    out = attend(q, q_pos, k, v, k_pos, group, torch.float32, False, AttendPlans(), triton=True, head=paged)
    keys, values = paged.join(k, v)
    expected = attend(q, q_pos, keys, values, k_pos, group, torch.float32, False, AttendPlans())
    torch.testing.assert_close(out, expected, rtol=0, atol=2e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the interpreter ran the cases above)")
def test_the_compiled_rows_kernel_reads_a_paged_head_on_the_gpu():
    """The GPU check's run of the cases above through the compiled kernel (tools/gpu_check.sh's `tests` part selects
    the cuda-marked tests; elsewhere the interpreter runs them)."""
    for dtype in DTYPES:
        for heads in HEADS:
            test_rows_kernel_reads_a_paged_head(130, heads, dtype)
            test_rows_kernel_matches_twin(13, 77, 16, heads, dtype)
    for n_new in (3, 40):
        test_attend_on_triton_reads_a_paged_head_as_the_joined_keys(n_new)


def _rows_args():
    k, v = make_pool(8, 5, 3, 64, torch.bfloat16, seed=41)
    q = torch.randn(4, 9, 64).to(DEVICE)
    return dict(q=q, k_pool=k, v_pool=v, block_table=shuffled_table(20, 5, 8, seed=42),
                visible=torch.tensor([1, 5, 9, 20], dtype=torch.int32, device=DEVICE))


ROWS_ERRORS = [
    ("q", lambda a: a["q"][0], "must be \\[rows, Hq, hd\\]"),
    ("q", lambda a: a["q"][:, :8], "does not fit pools"),
    ("q", lambda a: a["q"].double(), "float16, bfloat16 or float32"),
    ("q", lambda a: a["q"].transpose(0, 2).contiguous().transpose(0, 2), "contiguous in the head dim"),
    ("v_pool", lambda a: a["v_pool"].float(), "float16, bfloat16 or float32"),
    ("v_pool", lambda a: a["v_pool"][:4], "differ in shape or strides"),
    ("k_pool", lambda a: a["k_pool"].to(torch.int8), "float16, bfloat16 or float32"),
    ("block_table", lambda a: a["block_table"].long(), "int32"),
    ("block_table", lambda a: a["block_table"][:3], "must lie in 0..15"),
    ("visible", lambda a: a["visible"][:3], "4 query rows"),
    ("visible", lambda a: a["visible"] - 2, "must lie in 0..20"),
    ("visible", lambda a: a["visible"][None], "1-d int32"),
]


@pytest.mark.parametrize("name,change,message", ROWS_ERRORS)
def test_rows_wrapper_errors(name, change, message):
    args = _rows_args()
    args[name] = change(args)
    with pytest.raises(ValueError, match=message):
        ta.rows_attention(**args)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="on a GPU the CPU tensors are the device mismatch")
def test_wrappers_error_on_mixed_devices():
    args = _rows_args()
    args["v_pool"] = args["v_pool"].to("meta")
    with pytest.raises(ValueError, match="share a device"):
        ta.rows_attention(**args)
    args = _rows_args()
    args["visible"] = args["visible"].to("meta")
    with pytest.raises(ValueError, match="int32 tensor on cpu"):
        ta.rows_attention(**args)


def test_decode_wrapper_errors():
    args = _rows_args()
    q, k, v = args["q"], args["k_pool"], args["v_pool"]
    tables = torch.stack([args["block_table"]] * 4)
    lens = torch.tensor([1, 4, 20, 0], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="one row per sequence"):
        ta.decode_attention(q, k, v, tables[:3], lens)
    with pytest.raises(ValueError, match="2-d int32"):
        ta.decode_attention(q, k, v, tables[0], lens)
    with pytest.raises(ValueError, match="must lie in 0..15"):
        ta.decode_attention(q, k, v, tables[:, :3], lens)
    with pytest.raises(ValueError, match="int32"):
        ta.decode_attention(q, k, v, tables, lens.long())
    torch.testing.assert_close(ta.decode_attention(q, k, v, tables, lens),
                               ta.decode_attention_twin(q, k, v, tables, lens), rtol=0, atol=TOL[k.dtype])
