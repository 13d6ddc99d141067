"""Triton attention over the paged KV pool (issue 28, kernels 2 and 3), each with its torch twin: the spec.

Layouts (engine/kv_pool.py, kvcache/allocator.py):
    k_pool, v_pool  [num_blocks, block_size, Hkv, hd]  keys already rotated; float16, bfloat16 or float32;
                    any outer strides (a layer's view of the engine's pool), the last dimension contiguous
    block_table     [M] int32: a sequence's key row r lives in block block_table[r // block_size], slot r % block_size
    Hq = Hkv * group: query head h reads KV head h // group (grouped-query attention, K/V never expanded)

- `rows_attention`: one sequence's query rows q [R, Hq, hd] (a blend's recomputed rows and the suffix, sorted by
  position) over its paged keys; row i sees exactly key rows 0..visible[i]-1 (`visible_keys` derives that from
  positions: q_pos + 1 for keys at rows = positions, and through searchsorted for keys with gaps, as
  kernels/attention.attend does). A program takes a tile of query rows x the group's heads for one KV head and
  runs an online softmax over tiles of key rows, up to the tile's largest `visible`.
- `decode_attention`: one query row per sequence, q [B, Hq, hd], block_tables [B, M] int32 (padded: entries past
  a sequence's last block are never read), seq_lens [B]; sequence b sees its rows 0..seq_lens[b]-1. One program
  per (sequence, KV head, split), the group's query heads together; at small batches each sequence's keys are cut
  into splits (flash-decoding) whose parts a second kernel merges by their softmax maxima.

Both return float32 [rows, Hq, hd] (what kernels/row_attention returns; the caller casts). Scores, softmax and
accumulation run in float32, scale hd**-0.5. Where q and the pool share a 16-bit dtype (a GPU's bf16 model), q.k
runs on tensor cores (16-bit products are exact in float32) and p.v takes p as a high and a low 16-bit part; a
float32 pool gets float32 dots at IEEE precision (not TF32). A query that sees no key (visible 0, seq_len 0) gets
zeros, where softmax over nothing is undefined.

The online softmax sums in another order than the twin's one softmax: kernel and twin agree within docs/gpu.md's
tolerances, not bit for bit (tests/test_triton_attention.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrag.kernels.triton_mode import interpreting

POOL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ROWS_PER_TILE = 16  # query rows a rows_attention program takes (times the group's heads, padded to a power of 2)
KEYS_PER_TILE = 64  # key rows per step of the online softmax, gathered across blocks of any block_size
SPLIT_PROGRAMS = 2  # decode: split each sequence's keys until there are this many programs per multiprocessor


@triton.jit
def _dot16(a, b, WIDEN: tl.constexpr):
    """a @ b for 16-bit a, b with float32 sums; WIDEN computes the same in float32 (exact: a 16-bit product fits
    float32), for Triton's interpreter, whose bfloat16 dot returns garbage."""
    if WIDEN:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _attend_keys(q, vis, lo, hi, table_ptr, k_ptr, v_ptr, stride_kb, stride_ks, block_size, scale, offs_d, d_ok,
                 BLOCK_N: tl.constexpr, HALF: tl.constexpr, WIDEN: tl.constexpr):
    """Online softmax of q [BLOCK_Q, BLOCK_D] over key rows lo..hi-1 of one sequence, one KV head (k_ptr/v_ptr
    already at it); query i sees rows < vis[i]. Returns the unnormalised (acc [BLOCK_Q, BLOCK_D], m, l [BLOCK_Q]).
    HALF: q and the pool are one 16-bit dtype, so q.k runs on tensor cores (exact products, float32 sums) and p.v
    takes p as a high and a low 16-bit part (p to 2^-18); else float32 dots at IEEE precision."""
    m_i = tl.full([q.shape[0]], -1.0e30, tl.float32)  # finite, so a fully masked tile rescales by exp(0), not NaN
    l_i = tl.zeros([q.shape[0]], tl.float32)
    acc = tl.zeros(q.shape, tl.float32)
    for start in range(lo, hi, BLOCK_N):
        rows = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key rows
        key_ok = rows < hi
        blk = tl.load(table_ptr + rows // block_size, mask=key_ok, other=0).to(tl.int64)
        slot = blk * stride_kb + (rows % block_size) * stride_ks  # [BLOCK_N]
        kv_ok = key_ok[:, None] & d_ok[None, :]  # [BLOCK_N, BLOCK_D]
        k = tl.load(k_ptr + slot[:, None] + offs_d[None, :], mask=kv_ok, other=0.0)
        v = tl.load(v_ptr + slot[:, None] + offs_d[None, :], mask=kv_ok, other=0.0)
        if HALF:
            s = _dot16(q, tl.trans(k), WIDEN)  # [BLOCK_Q, BLOCK_N] float32
        else:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        s = tl.where(rows[None, :] < vis[:, None], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if HALF:
            p_hi = p.to(v.dtype)
            p_lo = (p - p_hi.to(tl.float32)).to(v.dtype)
            pv = _dot16(p_hi, v, WIDEN) + _dot16(p_lo, v, WIDEN)
        else:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _normalised(acc, l_i):
    """acc / l, zeros where a query saw no key."""
    return tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)


@triton.jit
def _rows_kernel(q_ptr, k_ptr, v_ptr, table_ptr, vis_ptr, out_ptr, hk_ptr, hv_ptr, slots_ptr, n_head,
                 n_rows, group, head_dim, block_size, scale,
                 stride_qr, stride_qh, stride_kb, stride_ks, stride_kh, stride_or, stride_oh, stride_hs, stride_hh,
                 BLOCK_M: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 HALF: tl.constexpr, WIDEN: tl.constexpr):
    """Grid (cdiv(R, BLOCK_M), Hkv): query rows BLOCK_M * pid0.. x the group's heads of KV head pid1. The first
    n_head keys are rows slots[0..n_head-1] of a flat pool hk/hv [N, Hkv, hd] (a cached prefix read in place: a pool
    of one-row blocks whose table is the slots); the keys after them come through the block table."""
    kvh = tl.program_id(1)
    i = tl.arange(0, BLOCK_M * GROUP_P)  # tile row i: query row r, head kvh * group + j
    r = tl.program_id(0) * BLOCK_M + i // GROUP_P
    h = kvh * group + i % GROUP_P
    q_ok = (r < n_rows) & (i % GROUP_P < group)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    qo_ok = q_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + r[:, None] * stride_qr + h[:, None] * stride_qh + offs_d[None, :], mask=qo_ok, other=0.0)
    vis = tl.load(vis_ptr + r, mask=q_ok, other=0)
    seen = tl.minimum(vis, n_head)  # head keys each row sees (a tile's keys past them are masked by it)
    acc_h, m_h, l_h = _attend_keys(q, seen, 0, tl.max(seen), slots_ptr, hk_ptr + kvh * stride_hh,
                                   hv_ptr + kvh * stride_hh, stride_hs, 0, 1, scale, offs_d, d_ok, BLOCK_N, HALF, WIDEN)
    rest = vis - n_head  # [BLOCK_M * GROUP_P] keys each row sees past the head
    acc, m_i, l_i = _attend_keys(q, rest, 0, tl.max(rest), table_ptr, k_ptr + kvh * stride_kh, v_ptr + kvh * stride_kh,
                                 stride_kb, stride_ks, block_size, scale, offs_d, d_ok, BLOCK_N, HALF, WIDEN)
    m = tl.maximum(m_h, m_i)  # the two online softmaxes merged by their maxima
    a_h, a_i = tl.exp(m_h - m), tl.exp(m_i - m)
    acc = acc_h * a_h[:, None] + acc * a_i[:, None]
    l_i = l_h * a_h + l_i * a_i
    tl.store(out_ptr + r[:, None] * stride_or + h[:, None] * stride_oh + offs_d[None, :], _normalised(acc, l_i),
             mask=qo_ok)


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, part_ptr, ml_ptr, n_heads, group, head_dim,
                   block_size, scale, keys_per_split, n_splits, stride_qb, stride_qh, stride_kb, stride_ks,
                   stride_kh, stride_tb, stride_ob, stride_oh, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, SPLIT: tl.constexpr, HALF: tl.constexpr, WIDEN: tl.constexpr):
    """Grid (B, Hkv, n_splits): sequence pid0's query heads of KV head pid1 (BLOCK_G >= 16 rows for tl.dot, the
    group's first) over its keys in split pid2. Unsplit (SPLIT false), it writes the output; split, the unnormalised
    parts [B, Hq, n_splits, hd] and (m, l) [B, Hq, n_splits, 2] for _combine_kernel (flash-decoding). n_splits is a
    runtime value: it changes as a sequence grows, and a constexpr would compile a kernel for each."""
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    j = tl.arange(0, BLOCK_G)
    h = kvh * group + j
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    g_ok = j < group
    qo_ok = g_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + b * stride_qb + h[:, None] * stride_qh + offs_d[None, :], mask=qo_ok, other=0.0)
    n = tl.load(lens_ptr + b)
    vis = tl.where(g_ok, n, 0)  # [BLOCK_G]
    lo = split * keys_per_split
    acc, m_i, l_i = _attend_keys(q, vis, lo, tl.minimum(lo + keys_per_split, n), table_ptr + b * stride_tb,
                                 k_ptr + kvh * stride_kh, v_ptr + kvh * stride_kh, stride_kb, stride_ks,
                                 block_size, scale, offs_d, d_ok, BLOCK_N, HALF, WIDEN)
    if not SPLIT:
        tl.store(out_ptr + b * stride_ob + h[:, None] * stride_oh + offs_d[None, :], _normalised(acc, l_i),
                 mask=qo_ok)
    else:
        row = (b * n_heads + h) * n_splits + split  # [BLOCK_G] rows of the parts
        tl.store(part_ptr + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=qo_ok)
        tl.store(ml_ptr + row * 2, m_i, mask=g_ok)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=g_ok)


@triton.jit
def _combine_kernel(part_ptr, ml_ptr, out_ptr, head_dim, n_splits,
                    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (B * Hq): one query head's split parts merged by their maxima (out is contiguous [B, Hq, hd])."""
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < n_splits
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.load(ml_ptr + (row * n_splits + s) * 2, mask=s_ok, other=-1.0e30)
    l_s = tl.load(ml_ptr + (row * n_splits + s) * 2 + 1, mask=s_ok, other=0.0)
    w = tl.exp(m - tl.max(m))  # [BLOCK_S]
    part = tl.load(part_ptr + (row * n_splits + s)[:, None] * BLOCK_D + offs_d[None, :], mask=s_ok[:, None],
                   other=0.0)
    total = tl.sum(w * l_s)
    out = tl.sum(w[:, None] * part, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * head_dim + offs_d, tl.where(total > 0, out, 0.0), mask=offs_d < head_dim)


def visible_keys(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """How many key rows each query sees: keys at rising positions k_pos [S], queries at q_pos [R] -> [R] int32.
    Keys at rows = positions give q_pos + 1 (capped at S); with gaps (Keyformer-dropped tokens), the keys up to the
    last one at or before the query's position."""
    return torch.searchsorted(k_pos, q_pos.to(k_pos.device), right=True).to(torch.int32)


def rows_attention_twin(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                        visible: torch.Tensor, head=None) -> torch.Tensor:
    """The spec of `rows_attention`: q [R, Hq, hd], pools [N, bs, Hkv, hd], block_table [M], visible [R] (with
    `head`, its keys first) -> [R, Hq, hd] float32, gathering the sequence's key rows and taking one float32
    softmax."""
    n_rows, n_q, hd = q.shape
    bs, n_kv = k_pool.shape[1], k_pool.shape[2]
    group = n_q // n_kv
    n = int(visible.max()) if n_rows else 0
    first = 0 if head is None else head.slots.shape[0]
    idx = torch.arange(max(n - first, 0), device=q.device)
    blocks, offsets = block_table.to(q.device).long()[idx // bs], idx % bs
    k, v = k_pool[blocks, offsets].float(), v_pool[blocks, offsets].float()  # [n - first, Hkv, hd]
    if head is not None:
        slots = head.slots.long()[:n]
        k, v = torch.cat([head.k[slots].float(), k]), torch.cat([head.v[slots].float(), v])  # [n, Hkv, hd]
    idx = torch.arange(k.shape[0], device=q.device)
    qg = q.float().view(n_rows, n_kv, group, hd).permute(1, 0, 2, 3).reshape(n_kv, n_rows * group, hd)
    scores = torch.matmul(qg, k.permute(1, 2, 0)) * hd ** -0.5  # [Hkv, R * group, n]
    seen = idx[None, :] < visible.to(q.device).repeat_interleave(group)[:, None]  # [R * group, n]
    probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
    probs = torch.where(seen.any(-1, keepdim=True), probs, 0.0)  # a row seeing no key: zeros, not NaN
    out = torch.matmul(probs, v.permute(1, 0, 2))  # [Hkv, R * group, hd]
    return out.view(n_kv, n_rows, group, hd).permute(1, 0, 2, 3).reshape(n_rows, n_q, hd)


def decode_attention_twin(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                          seq_lens: torch.Tensor) -> torch.Tensor:
    """The spec of `decode_attention`: q [B, Hq, hd], block_tables [B, M], seq_lens [B] -> [B, Hq, hd] float32."""
    outs = [rows_attention_twin(q[b:b + 1], k_pool, v_pool, block_tables[b], seq_lens[b:b + 1])
            for b in range(q.shape[0])]
    return torch.cat(outs) if outs else torch.zeros(q.shape, device=q.device)


def rows_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                   visible: torch.Tensor, check: bool = True, head=None) -> torch.Tensor:
    """The Triton kernel for `rows_attention_twin` (same arguments, same result within the module's tolerance).
    check=False skips reading `visible` back to the host (a sync a call, a layer a prompt): for callers that
    built it within the table's reach. `head` (kernels/attention.PagedKeys): the first keys, read where a flat pool
    [N, Hkv, hd] holds them, at rows head.slots (int32 or int64)."""
    n_kv, hd = _check_pools(q, k_pool, v_pool)
    _check_index("block_table", block_table, 1, q.device)
    _check_index("visible", visible, 1, q.device)
    if visible.shape[0] != q.shape[0]:
        raise ValueError(f"visible has {visible.shape[0]} entries for {q.shape[0]} query rows")
    n_head = 0 if head is None else _check_head(head, k_pool)
    if check:
        _check_reach(visible, n_head + block_table.shape[0] * k_pool.shape[1], "visible")
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)  # [R, Hq, hd]
    if q.shape[0] == 0:
        return out
    hk, hv, slots = (k_pool, v_pool, block_table) if head is None else (head.k, head.v, head.slots)
    group = q.shape[1] // n_kv
    grid = (triton.cdiv(q.shape[0], ROWS_PER_TILE), n_kv)
    _rows_kernel[grid](q, k_pool, v_pool, block_table, visible, out, hk, hv, slots, n_head, q.shape[0], group, hd,
                       k_pool.shape[1], hd ** -0.5, q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1),
                       k_pool.stride(2), out.stride(0), out.stride(1), hk.stride(0), hk.stride(-2),
                       BLOCK_M=ROWS_PER_TILE, GROUP_P=triton.next_power_of_2(group), BLOCK_N=KEYS_PER_TILE,
                       BLOCK_D=triton.next_power_of_2(hd), HALF=_half(q, k_pool), WIDEN=interpreting())
    return out


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, splits: int | None = None, check: bool = True) -> torch.Tensor:
    """The Triton kernel for `decode_attention_twin` (same arguments, same result within the module's tolerance).
    splits: how many parts each sequence's keys are cut into (default: enough programs to fill the GPU);
    check=False skips reading `seq_lens` back to the host (a sync a layer a step): for callers whose lengths come
    from the tables themselves."""
    n_kv, hd = _check_pools(q, k_pool, v_pool)
    _check_index("block_tables", block_tables, 2, q.device)
    _check_index("seq_lens", seq_lens, 1, q.device)
    if block_tables.shape[0] != q.shape[0] or seq_lens.shape[0] != q.shape[0]:
        raise ValueError(f"block_tables {tuple(block_tables.shape)} and seq_lens {tuple(seq_lens.shape)} "
                         f"must have one row per sequence of q ({q.shape[0]})")
    capacity = block_tables.shape[1] * k_pool.shape[1]
    if check:
        _check_reach(seq_lens, capacity, "seq_lens")
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)  # [B, Hq, hd]
    if q.shape[0] == 0:
        return out
    (batch, n_q, _), group, block_d = q.shape, q.shape[1] // n_kv, triton.next_power_of_2(hd)
    per_split = _keys_per_split(capacity, batch * n_kv, q.device, splits)
    n_splits = max(1, triton.cdiv(capacity, per_split))
    parts = torch.empty((batch, n_q, n_splits, block_d) if n_splits > 1 else (0,), dtype=torch.float32,
                        device=q.device)  # unnormalised outputs per split
    ml = torch.empty((batch, n_q, n_splits, 2) if n_splits > 1 else (0,), dtype=torch.float32, device=q.device)
    _decode_kernel[(batch, n_kv, n_splits)](
        q, k_pool, v_pool, block_tables, seq_lens, out, parts, ml, n_q, group, hd, k_pool.shape[1], hd ** -0.5,
        per_split, n_splits, q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=KEYS_PER_TILE, BLOCK_D=block_d, SPLIT=n_splits > 1, HALF=_half(q, k_pool), WIDEN=interpreting())
    if n_splits > 1:
        _combine_kernel[(batch * n_q,)](parts, ml, out, hd, n_splits, BLOCK_S=triton.next_power_of_2(n_splits),
                                        BLOCK_D=block_d)
    return out


def _half(q: torch.Tensor, k_pool: torch.Tensor) -> bool:
    """Whether the kernels take their tensor-core path: q and the pool one 16-bit dtype."""
    return q.dtype == k_pool.dtype and k_pool.dtype != torch.float32


def _keys_per_split(capacity: int, programs: int, device: torch.device, splits: int | None) -> int:
    """Keys per decode split (a multiple of KEYS_PER_TILE): enough splits that (sequences x KV heads x splits)
    reaches SPLIT_PROGRAMS per multiprocessor, since one program per sequence and head leaves most of a GPU idle
    at small batches (flash-decoding)."""
    splits = max(1, min(decode_splits(capacity, programs, device) if splits is None else splits,
                        triton.cdiv(capacity, KEYS_PER_TILE)))
    return triton.cdiv(triton.cdiv(capacity, splits), KEYS_PER_TILE) * KEYS_PER_TILE


def decode_splits(capacity: int, programs: int, device: torch.device) -> int:
    """`decode_attention`'s default split count: a function of the tables' capacity (width x block_size), the
    programs (B x Hkv) and the device alone, never of the lengths, so a CUDA graph captured at one table width
    keeps one plan (engine/decode_graphs.py)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    return max(1, min(triton.cdiv(SPLIT_PROGRAMS * sms, programs), triton.cdiv(capacity, KEYS_PER_TILE)))


def _check_pools(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> tuple[int, int]:
    """ValueError unless q [rows, Hq, hd] and the pools [N, bs, Hkv, hd] fit the kernels; returns (Hkv, hd)."""
    if q.dim() != 3 or k_pool.dim() != 4:
        raise ValueError(f"q must be [rows, Hq, hd] and the pools [blocks, block_size, Hkv, hd], got "
                         f"{tuple(q.shape)} and {tuple(k_pool.shape)}")
    if k_pool.shape != v_pool.shape or k_pool.stride() != v_pool.stride():
        raise ValueError(f"k_pool and v_pool differ in shape or strides: {tuple(k_pool.shape)} {k_pool.stride()} "
                         f"vs {tuple(v_pool.shape)} {v_pool.stride()}")
    n_kv, hd = k_pool.shape[2], k_pool.shape[3]
    if q.shape[2] != hd or q.shape[1] % n_kv != 0:
        raise ValueError(f"q {tuple(q.shape)} does not fit pools of {n_kv} KV heads of dim {hd}")
    if k_pool.dtype not in POOL_DTYPES or v_pool.dtype != k_pool.dtype or q.dtype not in POOL_DTYPES:
        raise ValueError(f"q, k_pool and v_pool must be float16, bfloat16 or float32 (the pools alike), got "
                         f"{q.dtype}, {k_pool.dtype}, {v_pool.dtype}")
    if q.stride(-1) != 1 or k_pool.stride(-1) != 1:
        raise ValueError(f"q and the pools must be contiguous in the head dim, got strides {q.stride()} and "
                         f"{k_pool.stride()}")
    if k_pool.device != q.device or v_pool.device != q.device:
        raise ValueError(f"q, k_pool and v_pool must share a device, got {q.device}, {k_pool.device}, {v_pool.device}")
    if q.device.type != "cuda" and not interpreting():
        raise ValueError(f"Triton runs on CUDA tensors (or on the CPU under TRITON_INTERPRET=1), got {q.device}: "
                         f"use the twin")
    return n_kv, hd


def _check_head(head, k_pool: torch.Tensor) -> int:
    """ValueError unless a paged head's pools fit the sequence's (heads, dim, dtype, device, strides); its length."""
    k, v, slots = head.k, head.v, head.slots
    if (k.dim() != 3 or k.shape != v.shape or k.stride() != v.stride() or k.shape[1:] != k_pool.shape[2:]
            or k.dtype != k_pool.dtype or k.device != k_pool.device or k.stride(-1) != 1):
        raise ValueError(f"the head's pools {tuple(k.shape)} {k.dtype} do not fit the sequence's "
                         f"{tuple(k_pool.shape)} {k_pool.dtype}")
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64) or slots.device != k_pool.device:
        raise ValueError(f"the head's slots must be 1-d int32 or int64 on {k_pool.device}, got {slots.dtype}")
    return int(slots.shape[0])


def _check_index(name: str, t: torch.Tensor, dims: int, device: torch.device) -> None:
    if t.dim() != dims or t.dtype != torch.int32 or t.device != device or (t.numel() and t.stride(-1) != 1):
        raise ValueError(f"{name} must be a {dims}-d int32 tensor on {device}, contiguous in its last dim, got "
                         f"{tuple(t.shape)} {t.dtype} on {t.device}")


def _check_reach(counts: torch.Tensor, capacity: int, name: str) -> None:
    """ValueError when some count of key rows is negative or past what the table's width (and a head) holds (one host
    sync)."""
    if counts.numel() and not bool(((counts >= 0) & (counts <= capacity)).all()):
        raise ValueError(f"{name} must lie in 0..{capacity} (table width x block_size), got "
                         f"{int(counts.min())}..{int(counts.max())}")
