"""`kvrag bench gpu`'s kernels part, FlashInfer's paged decode against kvrag's Triton `decode_attention` (issue 47):
the same pool, block tables and queries as bench/gpu_kernels.bench_decode, both timed in this run, where the
`flashinfer` package is installed (its wheel is not in the GPU check's folder: 62 MB, over what a call carries).

FlashInfer reads the pool as kvrag lays it out (NHD pages: [N, block_size, Hkv, hd]) through CSR page tables:
indptr [B + 1], indices (each sequence's blocks, in order), last_page_len [B]. Its `plan` runs once per batch shape,
outside the timing, as an engine would run it once per step for every layer. The faster kernel at each case is
named; outputs are compared (largest absolute difference) so that a wrong layout never passes as fast.
"""

from __future__ import annotations

from functools import partial

import torch

from kvrag.bench.gpu_kernels import DTYPE, KernelSizes, decode_cases, decode_work, median_seconds, record
from kvrag.kernels import triton_attention

WORKSPACE_BYTES = 128 << 20  # FlashInfer's float workspace (its documented default)


def csr_tables(tables: torch.Tensor, ctx: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kvrag's padded tables [B, M] int32 as FlashInfer's (indptr [B + 1], indices [B * M], last_page_len [B])
    for sequences of `ctx` tokens each."""
    batch, width = tables.shape
    indptr = torch.arange(0, (batch + 1) * width, width, dtype=torch.int32, device=tables.device)  # [B + 1]
    last = torch.full((batch,), ctx - (width - 1) * block_size, dtype=torch.int32, device=tables.device)  # [B]
    return indptr, tables.reshape(-1).contiguous(), last


def bench_flashinfer(device: torch.device, sizes: KernelSizes, peaks: dict) -> list[dict]:
    import flashinfer

    hq, hkv, hd = sizes.heads
    k_pool, v_pool, cases = decode_cases(device, sizes)
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    out = []
    for c in cases:
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(*csr_tables(c.tables, c.ctx, sizes.block_size), hq, hkv, hd, sizes.block_size, data_type=DTYPE,
                     q_data_type=DTYPE)
        ours_call = partial(triton_attention.decode_attention, c.q, k_pool, v_pool, c.tables, c.lens)
        theirs_call = partial(wrapper.run, c.q, (k_pool, v_pool))
        diff = float((ours_call().float() - theirs_call().float()).abs().max())
        ours = median_seconds(ours_call, device, sizes.warmup, sizes.reps)
        theirs = median_seconds(theirs_call, device, sizes.warmup, sizes.reps)
        nbytes, flops = decode_work(c.batch, c.ctx, hq, hkv, hd)
        row = record("flashinfer decode", f"B={c.batch} ctx={c.ctx}", theirs, nbytes, flops, peaks,
                     ("triton decode_attention", ours))
        out.append({**row, "max_abs_diff": diff, "faster": "flashinfer" if theirs < ours else "triton"})
    return out
