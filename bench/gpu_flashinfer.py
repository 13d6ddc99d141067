"""`kvrag bench gpu`'s kernels part, FlashInfer's paged decode against kvrag's Triton `decode_attention` (issue 47):
the same pool, block tables and queries as bench/gpu_kernels.bench_decode, both timed in this run, where the
`flashinfer` package is installed (its wheel is not in the GPU check's folder: 62 MB, over what a call carries).

FlashInfer reads the pool as kvrag lays it out (NHD pages: [N, block_size, Hkv, hd]) through CSR page tables:
indptr [B + 1], indices (each sequence's blocks, in order), last_page_len [B]. Its `plan` runs once per batch shape,
outside the timing, as an engine would run it once per step for every layer. The faster kernel at each case is
named; outputs are compared (largest absolute difference) so that a wrong layout never passes as fast.
"""

from __future__ import annotations

import math
from functools import partial

import torch

from kvrag.bench.gpu_kernels import DTYPE, KernelSizes, decode_work, median_seconds, record
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
    bs = sizes.block_size
    gen = torch.Generator().manual_seed(0)
    n_blocks = max(sizes.batches) * math.ceil(max(sizes.contexts) / bs)
    k_pool, v_pool = (torch.randn(n_blocks, bs, hkv, hd, dtype=DTYPE, device=device) for _ in range(2))
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    out = []
    for ctx in sizes.contexts:
        for batch in sizes.batches:
            width = math.ceil(ctx / bs)
            tables = torch.randperm(n_blocks, generator=gen)[:batch * width].view(batch, width).to(device, torch.int32)
            lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)  # [B]
            q = torch.randn(batch, hq, hd, dtype=DTYPE, device=device)  # [B, Hq, hd]
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
            wrapper.plan(*csr_tables(tables, ctx, bs), hq, hkv, hd, bs, data_type=DTYPE, q_data_type=DTYPE)
            ours_call = partial(triton_attention.decode_attention, q, k_pool, v_pool, tables, lens)
            theirs_call = partial(wrapper.run, q, (k_pool, v_pool))
            diff = float((ours_call().float() - theirs_call().float()).abs().max())
            ours = median_seconds(ours_call, device, sizes.warmup, sizes.reps)
            theirs = median_seconds(theirs_call, device, sizes.warmup, sizes.reps)
            nbytes, flops = decode_work(batch, ctx, hq, hkv, hd)
            row = record("flashinfer decode", f"B={batch} ctx={ctx}", theirs, nbytes, flops, peaks,
                         ("triton decode_attention", ours))
            out.append({**row, "max_abs_diff": diff, "faster": "flashinfer" if theirs < ours else "triton"})
    return out
