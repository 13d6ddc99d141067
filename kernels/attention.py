"""Attention for every shape kvrag runs, and the one place that chooses how: a decode step's few rows, causal
prefill, a prefill after a cached prefix, and a blend's scattered rows, through the native row kernel where it
serves, else SDPA (plainly causal, padded to causal, by key segment merged by log-sum-exp, or by row block).

Every path computes the same thing: a query at position p sees exactly the keys at positions <= p.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from kvrag.kernels import row_attention


@dataclass
class RowTally:
    """Rows of a paged pool's cached KV copied out of it: gathered into one tensor, or packed into the row kernel's
    workspace, a layer's rows once for each read. The engine's pool keeps one (kvrag_kv_rows_copied)."""

    gathered: int = 0
    packed: int = 0


@dataclass(frozen=True)
class PagedKeys:
    """One layer's first keys where a paged pool holds them (a cached prefix, read in place): the pool's K (rotated)
    and V rows k, v [N, Hkv, hd] and the rows of keys 0..n-1 in them, slots [n]; `tally` counts what is copied out."""

    k: torch.Tensor
    v: torch.Tensor
    slots: torch.Tensor
    tally: RowTally | None = None

    def __len__(self) -> int:
        return int(self.slots.shape[0])

    def join(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """These keys gathered before k, v [S', Hkv, hd] -> [n + S', Hkv, hd] each: a copy, for the paths that read
        keys from one tensor (the twin of the row kernel's paged read)."""
        if self.tally is not None:
            self.tally.gathered += len(self)
        return (torch.cat([self.k.index_select(0, self.slots).to(k.dtype), k]),
                torch.cat([self.v.index_select(0, self.slots).to(v.dtype), v]))


def attend(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pos: torch.Tensor | None,
           group: int, attn_dtype: torch.dtype, row_kernel: bool, plans: AttendPlans,
           triton: bool = False, head: PagedKeys | None = None) -> torch.Tensor:
    """Attention of queries q [R, Hq, hd] at q_pos [R] over rotated keys k and values v [S, Hkv, hd] at k_pos [S]
    (None: every key visible, as in decoding) -> [R, Hq * hd], in the inputs' or the attention dtype (the caller
    casts). Runs in `attn_dtype`; `row_kernel`: the native row kernel serves this model (row_kernel_serves);
    `plans`: the caller's memo of what the positions are (read once a prompt) and of key-segment plans; `triton`:
    scattered rows go through the Triton rows kernel (on a GPU; on a CPU only under TRITON_INTERPRET, to test it).
    `head`: the first keys are in a paged pool (k, v hold those after them; k_pos counts them all): the row kernel
    reads them there, every other path from a gathered copy."""
    if head is not None:
        out = _attend_paged(q, q_pos, k, v, k_pos, row_kernel, plans, head, triton)
        if out is not None:
            return out
        k, v = head.join(k, v)
    if k_pos is None and q.shape[0] <= FEW_ROWS:
        return attend_few_rows(q, k, v, group)  # a decode step
    shape = None if k_pos is None else plans.shape(q_pos, k_pos)
    if shape is not None:
        if q.shape[0] <= FEW_ROWS and shape.keys_before:
            return attend_few_rows(q, k, v, group)  # the last row of a prefill
        q_pos, k_pos = shape.q_pos, shape.k_pos  # over keys with gaps, as remapped (PositionShape)
        scattered = shape.sorted_q and shape.arange_k
        if row_kernel and _row_kernel_takes(shape):
            # causal prefill, a prefill after a cached prefix, or a blend's scattered rows: one kernel for all
            # (it reads the bf16 cache as it is, and wastes no key past a 64-key block; see row_attention.cpp)
            out = row_attention.row_attention(q, q_pos.to(q.device), k, v)  # [R, Hq, hd] float32
            return out.view(q.shape[0], -1)
        if triton and scattered and 0 <= shape.q_first and not shape.plain_causal:
            return _attend_triton(q, q_pos, k, v)  # plainly causal stays with SDPA's flash kernel
    q, k, v = (x.to(attn_dtype) for x in (q, k, v))  # no copy unless they differ
    # [1, H, len, hd]: SDPA's fused CPU/CUDA kernels want a batch dimension. Grouped-query attention
    # (each KV head serves group_size query heads) is SDPA's enable_gqa: no expanded copy of K and V,
    # and its causal CPU kernel runs about 20 % faster than over expanded heads.
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    sdpa = partial(F.scaled_dot_product_attention, enable_gqa=group > 1)
    if shape is None:
        out = sdpa(qh, kh, vh)
    elif shape.plain_causal:
        out = sdpa(qh, kh, vh, is_causal=True)
    elif shape.causal_tail and 2 * q.shape[0] >= k.shape[0]:
        # Queries are most of the last rows of the keys (a prefill after a cached prefix). SDPA's
        # is_causal aligns top-left, so pad the queries with zero rows up to the keys' length,
        # use the fast causal kernel, and drop the padding: exact, and no [R, S] mask. Only when
        # the padding is at most the real rows: a few suffix rows over thousands of keys are
        # cheaper through the small [R, S] mask.
        pad = kh.shape[2] - qh.shape[2]
        qh = F.pad(qh, (0, 0, pad, 0))
        out = sdpa(qh, kh, vh, is_causal=True)[:, :, pad:]
    elif shape.sorted_q and shape.arange_k:
        if qh.device.type == "cpu" and _FLASH_CPU is not None:
            out = _attend_key_segments_grouped(qh, kh, vh, q_pos.to(q.device), group, plans, shape.q_last)
        else:
            out = _attend_row_blocks(sdpa, qh, kh, vh, q_pos.to(q.device))
    else:
        mask = k_pos.to(q.device)[None, :] <= q_pos.to(q.device)[:, None]  # [R, S]
        out = sdpa(qh, kh, vh, attn_mask=mask)
    return out[0].transpose(0, 1).reshape(q.shape[0], -1)  # [R, Hq * hd]


def _attend_paged(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pos: torch.Tensor | None,
                  row_kernel: bool, plans: AttendPlans, head: PagedKeys, triton: bool) -> torch.Tensor | None:
    """`attend` over a paged head through the row kernel or the Triton rows kernel, where one serves ([R, Hq * hd]
    float32), else None."""
    if k_pos is None or head.k.dtype != k.dtype:
        return None
    shape = plans.shape(q_pos, k_pos)
    if not _row_kernel_takes(shape):
        return None
    if row_kernel and k.dtype in (torch.float32, torch.bfloat16):
        if head.tally is not None and row_attention.packs_keys(q.shape[0], q.shape[1] // k.shape[1]):
            head.tally.packed += len(head)  # its keys laid out in the kernel's workspace (values are read in place)
        out = row_attention.row_attention(q, shape.q_pos.to(q.device), k, v, head=head)  # [R, Hq, hd] float32
        return out.view(q.shape[0], -1)
    if triton and not shape.plain_causal:
        return _attend_triton(q, shape.q_pos, k, v, head)
    return None


def _row_kernel_takes(shape: PositionShape) -> bool:
    """Whether the row kernel computes these positions: sorted rows over keys 0..S-1, each row inside them."""
    return shape.sorted_q and shape.arange_k and 0 <= shape.q_first and shape.q_last < shape.k_pos.shape[0]


def attend_window(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pos: torch.Tensor | None,
                  group: int, attn_dtype: torch.dtype, window: int) -> torch.Tensor:
    """`attend` for a sliding-window layer: a query at p sees the keys at p - window < k_pos <= p (HF's
    sliding_window_overlay); k_pos None: the query follows every key, so it sees the last `window` ones. SDPA with
    an explicit [R, S] mask: the row and Triton kernels take no window, so such a model runs here."""
    if k_pos is None:
        k, v = k[-window:], v[-window:]
        if q.shape[0] <= FEW_ROWS:
            return attend_few_rows(q, k, v, group)
    q, k, v = (x.to(attn_dtype) for x in (q, k, v))
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, len, hd]
    mask = None
    if k_pos is not None:
        qp, kp = q_pos.to(q.device)[:, None], k_pos.to(q.device)[None, :]
        mask = (kp <= qp) & (kp > qp - window)  # [R, S]
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=group > 1)
    return out[0].transpose(0, 1).reshape(q.shape[0], -1)  # [R, Hq * hd]


def _attend_triton(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   head: PagedKeys | None = None) -> torch.Tensor:
    """Scattered rows (sorted q_pos over keys at 0..S-1) through the Triton rows kernel: the contiguous cache is a
    pool of one block of its rows, after the paged `head`'s keys read where its pool holds them -> [R, Hq * hd]
    float32."""
    from kvrag.kernels import triton_attention  # imports Triton: only where it runs

    n_head = 0 if head is None else len(head)
    visible = (q_pos.to(q.device) + 1).clamp(max=n_head + k.shape[0]).to(torch.int32)  # [R] keys each row sees
    table = torch.zeros(1, dtype=torch.int32, device=q.device)  # [1]: block 0 holds every row after the head
    if k.stride() != v.stride():  # the kernel reads K and V with one set of strides (the new rows alone: small)
        k, v = k.contiguous(), v.contiguous()
    # every row sees 1..S keys (positions >= 0, sorted; checked by `attend`): no host read of `visible`
    out = triton_attention.rows_attention(q.to(k.dtype), k[None], v[None], table, visible, check=False,
                                          head=head)  # [R, Hq, hd]
    return out.view(q.shape[0], -1)


def row_kernel_serves(head_dim: int, attn_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether prefill attention runs in kvrag's AVX-512 row kernel: float32 attention on a CPU that has it (faster
    than SDPA's flash kernel, causal or scattered: docs/performance.md)."""
    return device.type == "cpu" and attn_dtype == torch.float32 and row_attention.supports(head_dim)


FEW_ROWS = 8  # decoding: this many query rows over every key go through two float32 matmuls


def attend_few_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int) -> torch.Tensor:
    """Attention of a few query rows q [R, Hq, hd] over all keys k/v [S, Hkv, hd] -> [R, Hq * hd]: a decode step's
    shape, where two float32 matmuls beat SDPA's CPU kernel (scores and softmax in float32, as SDPA accumulates)."""
    r, hq, hd = q.shape
    qg = q.float().view(r, -1, group, hd).permute(1, 0, 2, 3).reshape(-1, r * group, hd)  # [Hkv, R*g, hd]
    scores = torch.matmul(qg, k.float().permute(1, 2, 0)) * hd ** -0.5  # [Hkv, R*g, S]
    out = torch.matmul(scores.softmax(-1), v.float().permute(1, 0, 2))  # [Hkv, R*g, hd]
    return out.view(-1, r, group, hd).permute(1, 0, 2, 3).reshape(r, hq * hd).to(q.dtype)


BLOCK_ROWS = 192  # scattered query rows per block (≈4.5x faster than one block at a blend's ≈1k rows over 6k keys)


def _attend_row_blocks(sdpa, qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """Masked attention of scattered query rows (sorted positions) qh [1, Hq, R, hd] over keys at positions 0..S-1,
    kh/vh [1, Hkv, S, hd] -> [1, Hq, R, hd]; `sdpa` is SDPA with the model's GQA setting. A mask skips no work, so
    one [R, S] mask pays for half the scores on average for rows spread over the prompt; in blocks of consecutive
    rows, each block reads the keys up to its last row only, close to causal attention's cost."""
    n_rows = qh.shape[2]
    n_blocks = max(1, n_rows // BLOCK_ROWS)
    bounds = [n_rows * i // n_blocks for i in range(n_blocks + 1)]
    outs = []
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        end = min(int(q_pos[stop - 1]) + 1, kh.shape[2])  # keys this block can see
        key_pos = torch.arange(end, device=q_pos.device)
        mask = key_pos[None, :] <= q_pos[start:stop, None]  # [rows, end]
        outs.append(sdpa(qh[:, :, start:stop], kh[:, :, :end], vh[:, :, :end], attn_mask=mask))
    return torch.cat(outs, dim=2)


SEGMENT_KEYS = 1024  # keys per segment (faster than row blocks at a blend's ≈1k rows over 6k keys)
# The rows inside a segment go in this many groups, each reading the segment's keys only up to its own last row:
# a masked call pays for every key up to its end, so one group wastes half a segment a row on average, two a
# third (a few % faster a blended layer; 3 gains nothing more).
MASKED_GROUPS = 2
# The CPU flash kernel behind SDPA, called directly because it also returns each row's log-sum-exp (public
# SDPA does not); with it, partial attentions over key segments merge exactly. Absent: row blocks instead.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attend_key_segments_grouped(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, q_pos: torch.Tensor,
                                 group: int, plans: AttendPlans, q_last: int) -> torch.Tensor:
    """`_attend_key_segments` with each KV head's query heads stacked as rows of one head: qh [1, Hq, R, hd],
    kh/vh [1, Hkv, S, hd] -> [1, Hq, R, hd]. Query head h reads KV head h // group, so the group's rows go in as
    [1, Hkv, R * group, hd], row r of head j at r * group + j (positions stay sorted): the kernel reads each K/V
    block once for `group` times as many rows, and takes no (slower) GQA path."""
    if group == 1:
        return _attend_key_segments(qh, kh, vh, q_pos, plans, q_last)
    _, n_heads, n_rows, hd = qh.shape
    n_kv = kh.shape[1]
    stacked = qh.view(n_kv, group, n_rows, hd).transpose(1, 2).reshape(1, n_kv, n_rows * group, hd)
    out = _attend_key_segments(stacked, kh, vh, q_pos.repeat_interleave(group), plans, q_last)  # [1, Hkv, R*g, hd]
    return out.view(n_kv, n_rows, group, hd).transpose(1, 2).reshape(1, n_heads, n_rows, hd)


def _attend_key_segments(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, q_pos: torch.Tensor,
                         plans: AttendPlans, q_last: int) -> torch.Tensor:
    """`_attend_row_blocks` by key segment: qh [1, Hq, R, hd], kh/vh [1, Hkv, S, hd] -> [1, Hq, R, hd]. Each
    segment of SEGMENT_KEYS keys is attended by exactly the rows at or after its start: rows past its end in one
    unmasked call, rows inside it with a small mask, so every row reads only the keys it sees (row blocks read up
    to their last row). The parts merge by their log-sum-exp in float32: softmax over the union of segments."""
    plan = plans.segments(q_pos, min(kh.shape[2], q_last + 1), qh.dtype)
    acc = torch.zeros(qh.shape, dtype=torch.float32, device=qh.device)  # [1, Hq, R, hd]: merged output so far
    lse = torch.full(qh.shape[:3], float("-inf"), device=qh.device)  # [1, Hq, R]: its log-sum-exp
    for r0, r1, k0, k1, mask in plan.parts:
        _merge(acc, lse, r0, r1, *_FLASH_CPU(qh[:, :, r0:r1], kh[:, :, k0:k1], vh[:, :, k0:k1], attn_mask=mask))
    return acc.to(qh.dtype)


@dataclass(frozen=True)
class _SegmentPlan:
    """How sorted query positions q_pos [R] read keys 0..n_keys-1 in segments of segment_keys, as parts
    (r0, r1, k0, k1, mask): rows r0..r1-1 attend keys k0..k1-1, with mask [r1 - r0, k1 - k0] (-inf on keys
    past each row's position, in the attention dtype) where some rows lie inside the keys, else None."""

    q_pos: torch.Tensor
    n_keys: int
    segment_keys: int
    masked_groups: int
    dtype: torch.dtype
    parts: tuple[tuple[int, int, int, int, torch.Tensor | None], ...]

    def serves(self, q_pos: torch.Tensor, n_keys: int, dtype: torch.dtype) -> bool:
        return (self.n_keys == n_keys and self.segment_keys == SEGMENT_KEYS and self.masked_groups == MASKED_GROUPS
                and self.dtype == dtype and self.q_pos.shape == q_pos.shape and self.q_pos.device == q_pos.device
                and torch.equal(self.q_pos, q_pos))


@dataclass(frozen=True)
class PositionShape:
    """What `attend` reads of one pair of position tensors, read once: on a GPU each read is a device-to-host sync,
    which stops the host from queueing the next kernels, and every layer of a prompt attends the same pair.
    Over keys with gaps (a reduced chunk's dropped tokens) a query sees the keys up to the last one at or before
    its position, as a query at that key's index does over keys 0..S-1: q_pos and k_pos are given so remapped."""

    given: tuple[torch.Tensor, torch.Tensor]  # the pair as passed (held, so `is` can recognise it)
    q_pos: torch.Tensor  # [R] as attended
    k_pos: torch.Tensor  # [S] as attended
    q_first: int
    q_last: int
    sorted_q: bool
    arange_k: bool  # keys at 0..S-1
    keys_before: bool  # no key after the first query (the last row of a prefill)
    plain_causal: bool  # queries and keys the same rising positions: SDPA's is_causal is exact
    causal_tail: bool  # keys 0..S-1, queries the last R of them in order

    @classmethod
    def of(cls, q_pos: torch.Tensor, k_pos: torch.Tensor) -> PositionShape:
        given = (q_pos, k_pos)
        facts = _facts(q_pos, k_pos)
        if not facts["arange_k"] and facts["rising_k"]:
            q_pos = torch.searchsorted(k_pos, q_pos.to(k_pos.device), right=True) - 1
            k_pos = torch.arange(k_pos.shape[0], device=k_pos.device)
            facts = _facts(q_pos, k_pos)
        n, r = k_pos.shape[0], q_pos.shape[0]
        first, last = facts["q_first"], facts["q_last"]
        plain = q_pos.shape == k_pos.shape and facts["equal"] and facts["rising_q"]
        tail = facts["arange_k"] and 0 < r <= n and first == n - r and facts["rising_q"] and last == n - 1
        return cls(given, q_pos, k_pos, first, last, facts["sorted_q"], facts["arange_k"], facts["keys_before"],
                   plain, tail)


def _facts(q_pos: torch.Tensor, k_pos: torch.Tensor) -> dict:
    """Every fact PositionShape needs of q_pos [R] and k_pos [S], in one read back to the host (one sync)."""
    r, n = q_pos.shape[0], k_pos.shape[0]
    if r == 0 or n == 0:
        return {"q_first": 0, "q_last": -1, "sorted_q": False, "rising_q": False, "arange_k": False,
                "rising_k": False, "keys_before": n == 0, "equal": False}
    k_pos = k_pos.to(q_pos.device)
    dq, dk = q_pos[1:] - q_pos[:-1], k_pos[1:] - k_pos[:-1]
    equal = (q_pos == k_pos).all() if q_pos.shape == k_pos.shape else torch.tensor(False, device=q_pos.device)
    values = torch.stack([q_pos[0], q_pos[-1], q_pos.min(), k_pos[0], k_pos[-1], k_pos.max(), (dq >= 0).all(),
                          (dq > 0).all(), (dk == 1).all(), (dk > 0).all(), equal]).tolist()
    q_first, q_last, q_min, k_first, k_last, k_max, sorted_q, rising_q, step_k, rising_k, eq = values
    return {"q_first": q_first, "q_last": q_last, "sorted_q": bool(sorted_q), "rising_q": bool(rising_q),
            "arange_k": k_first == 0 and k_last == n - 1 and bool(step_k), "rising_k": bool(rising_k),
            "keys_before": k_max <= q_min, "equal": bool(eq)}


class AttendPlans:
    """Per model: the last pair of positions' PositionShape (recognised by identity: position tensors are never
    written in place) and the last key-segment plan. Every layer of a prompt attends the same positions, and every
    blended layer after the last selection the same rows, so both (the plan's masks above all: ≈2 ms a layer to
    build) are made once per prompt instead of once per layer."""

    def __init__(self):
        self.last: _SegmentPlan | None = None
        self.last_shape: PositionShape | None = None

    def shape(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> PositionShape:
        last = self.last_shape
        if last is None or last.given[0] is not q_pos or last.given[1] is not k_pos:
            self.last_shape = PositionShape.of(q_pos, k_pos)
        return self.last_shape

    def segments(self, q_pos: torch.Tensor, n_keys: int, dtype: torch.dtype) -> _SegmentPlan:
        if self.last is None or not self.last.serves(q_pos, n_keys, dtype):
            self.last = _segment_plan(q_pos, n_keys, dtype)
        return self.last


def _segment_plan(q_pos: torch.Tensor, n_keys: int, dtype: torch.dtype) -> _SegmentPlan:
    n_rows = q_pos.shape[0]
    bounds = torch.arange(0, n_keys, SEGMENT_KEYS, device=q_pos.device)
    first_rows = torch.searchsorted(q_pos, bounds).tolist()  # first row that sees each segment
    last_masked = torch.searchsorted(q_pos, (bounds + SEGMENT_KEYS - 1).clamp(max=n_keys - 1)).tolist()
    parts = []
    for start, r0, r1 in zip(bounds.tolist(), first_rows, last_masked, strict=True):
        stop = min(start + SEGMENT_KEYS, n_keys)
        cuts = [r0 + (r1 - r0) * i // MASKED_GROUPS for i in range(MASKED_GROUPS + 1)]
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):  # rows inside the segment, in groups
            if b > a:
                end = int(q_pos[b - 1]) + 1  # the group's last row sees no key past its own position
                later = torch.arange(start, end, device=q_pos.device)[None, :] > q_pos[a:b, None]  # [rows, keys]
                mask = torch.zeros((), dtype=dtype, device=q_pos.device).masked_fill(later, float("-inf"))
                parts.append((a, b, start, end, mask))
        if r1 < n_rows:  # rows after the segment see all of it
            parts.append((r1, n_rows, start, stop, None))
    return _SegmentPlan(q_pos.clone(), n_keys, SEGMENT_KEYS, MASKED_GROUPS, dtype, tuple(parts))


def _merge(acc: torch.Tensor, lse: torch.Tensor, r0: int, r1: int, out: torch.Tensor, out_lse: torch.Tensor) -> None:
    """Fold one segment's attention (out [1, Hq, r, hd], out_lse [1, Hq, r]) into rows r0..r1-1 of the sums."""
    old = lse[:, :, r0:r1]
    new = torch.logaddexp(old, out_lse)
    acc[:, :, r0:r1].mul_(torch.exp(old - new)[..., None]).add_(out.float() * torch.exp(out_lse - new)[..., None])
    lse[:, :, r0:r1] = new
