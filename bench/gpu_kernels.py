"""`kvrag bench gpu`, the kernels: the device's measured peaks, and each Triton kernel's achieved GB/s and TFLOP/s
against them and against torch SDPA on the same shapes (issue 28).

Peaks, measured here: a square bf16 matmul (2 n^3 FLOPs), a device-to-device copy (bytes read + bytes written) and
a pinned host-to-device copy (bytes copied). Every time is the median of `reps` calls after `warmup` untimed ones,
taken with CUDA events (perf_counter on the CPU smoke run).

Work by formula (e = element size of q and the pool, 2 for bf16; outputs are float32; block tables, lengths and
positions are left out, under 0.1 % of the bytes):
    decode_attention   bytes = 2 B ctx Hkv hd e (K, V) + B Hq hd e (q) + B Hq hd 4 (out)
                       FLOPs = 4 B Hq ctx hd (q.k and p.v, 2 FLOPs a multiply-add)
    rows_attention     bytes = 2 max(visible) Hkv hd e (K, V read once) + R Hq hd (e + 4) (q, out)
                       FLOPs = 4 Hq hd sum(visible) (each query row over the keys it sees)
    load_layers        bytes = L T Hkv hd (2 s + 2 p) + int8 scales (L Hkv hd + L T Hkv) 4: stored K and V read
                       (s bytes each), the pool's written (p); no FLOP rate (a rotation is a few FLOPs a byte)
The SDPA baselines get the same q and each sequence's K/V gathered contiguous beforehand (untimed): flash where it
takes the inputs (decode; a causal prefill over every row, for scale), else the first backend that takes a mask.
load_layers is held against its torch twin, a layer at a time (kernels/triton_load.py's spec).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvrag.kernels import triton_attention, triton_load

DTYPE = torch.bfloat16
SDPA_BACKENDS = (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                 ("cudnn", SDPBackend.CUDNN_ATTENTION), ("math", SDPBackend.MATH))


@dataclass(frozen=True)
class KernelSizes:
    matmul_n: int = 8192
    copy_bytes: int = 1 << 30
    batches: tuple[int, ...] = (1, 16, 64)
    contexts: tuple[int, ...] = (1024, 8192)
    heads: tuple[int, int, int] = (32, 8, 128)  # Hq, Hkv, hd: Llama-3.1-8B
    block_size: int = 16  # the engine's pool (engine/kv_pool.py)
    rows_keys: int = 6144
    rows_ratio: float = 0.15
    rows_suffix: int = 32
    load_tokens: int = 600
    load_layers: int = 32
    warmup: int = 3
    reps: int = 20


# every part at sizes Triton's interpreter gets through in seconds
SMOKE_KERNELS = KernelSizes(matmul_n=64, copy_bytes=1 << 20, batches=(1, 2), contexts=(40, 72), heads=(4, 2, 32),
                            rows_keys=96, rows_suffix=8, load_tokens=24, load_layers=2, warmup=0, reps=1)


def median_seconds(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> float:
    """Median wall time of fn() over `reps` calls after `warmup` (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return float(np.median(times))


def device_peaks(device: torch.device, sizes: KernelSizes) -> dict:
    """Measured: bf16 matmul TFLOP/s, device copy GB/s (read + write), pinned host-to-device GB/s."""
    n, nbytes = sizes.matmul_n, sizes.copy_bytes
    a, b = (torch.randn(n, n, dtype=DTYPE, device=device) for _ in range(2))
    matmul = median_seconds(lambda: a @ b, device, sizes.warmup, sizes.reps)
    src, dst = (torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2))
    copy = median_seconds(lambda: dst.copy_(src), device, sizes.warmup, sizes.reps)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    h2d = median_seconds(lambda: dst.copy_(host, non_blocking=True), device, sizes.warmup, sizes.reps)
    return {"matmul_n": n, "matmul_tflops": 2 * n ** 3 / matmul / 1e12, "copy_bytes": nbytes,
            "copy_gbps": 2 * nbytes / copy / 1e9, "h2d_gbps": nbytes / h2d / 1e9}


# ---- work by formula ------------------------------------------------------------------------------------------


def decode_work(batch: int, ctx: int, hq: int, hkv: int, hd: int, elem: int = 2) -> tuple[int, int]:
    """(bytes, FLOPs) of decode_attention: one query row per sequence over ctx keys each."""
    return 2 * batch * ctx * hkv * hd * elem + batch * hq * hd * (elem + 4), 4 * batch * hq * ctx * hd


def rows_work(visible: torch.Tensor, hq: int, hkv: int, hd: int, elem: int = 2) -> tuple[int, int]:
    """(bytes, FLOPs) of rows_attention: query rows seeing visible [R] keys each."""
    rows, most = visible.numel(), int(visible.max())
    return 2 * most * hkv * hd * elem + rows * hq * hd * (elem + 4), 4 * hq * hd * int(visible.sum())


def load_bytes(layers: int, tokens: int, hkv: int, hd: int, stored: int, pool: int, int8: bool) -> int:
    """Bytes load_layers moves: stored K and V read (`stored` bytes an element), the pool's written (`pool`)."""
    values = layers * tokens * hkv * hd
    scales = 4 * (layers * hkv * hd + layers * tokens * hkv) if int8 else 0
    return 2 * values * (stored + pool) + scales


def record(kernel: str, shape: str, seconds: float, nbytes: int, flops: int | None, peaks: dict,
           baseline: tuple[str, float] | None = None) -> dict:
    """One timed case: its rates, their shares of the peaks and, against a (name, seconds) baseline, the speedup
    (baseline time / ours)."""
    gbps = nbytes / seconds / 1e9
    tflops = flops / seconds / 1e12 if flops else None
    name, base_s = baseline or (None, None)
    return {"kernel": kernel, "shape": shape, "ms": seconds * 1e3, "bytes": nbytes, "flops": flops, "gbps": gbps,
            "copy_peak_share": gbps / peaks["copy_gbps"], "tflops": tflops,
            "matmul_peak_share": tflops / peaks["matmul_tflops"] if tflops else None,
            "baseline": name, "baseline_ms": base_s * 1e3 if base_s else None,
            "speedup": base_s / seconds if base_s else None}


# ---- SDPA baselines --------------------------------------------------------------------------------------------


def sdpa_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
              causal: bool = False) -> tuple[str, Callable[[], torch.Tensor]]:
    """The first SDPA backend (flash first) that takes q [B, Hq, R, hd] over k, v [B, Hkv, S, hd] (mask [R, S]
    bool), as (name, a call); grouped-query attention through enable_gqa, or K/V expanded for a backend without."""
    group = q.shape[1] // k.shape[1]
    for name, backend in SDPA_BACKENDS:
        for gqa in (True, False):
            kk, vv = (k, v) if gqa else (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))

            def call(kk=kk, vv=vv, backend=backend, gqa=gqa) -> torch.Tensor:
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, is_causal=causal,
                                                          enable_gqa=gqa)
            try:
                with warnings.catch_warnings():  # each refusing backend warns why before it raises
                    warnings.simplefilter("ignore")
                    call()
            except RuntimeError:
                continue
            return name + ("" if gqa else " (K/V expanded)"), call
    raise RuntimeError("no SDPA backend takes these inputs")


def gathered(pool: torch.Tensor, tables: torch.Tensor, ctx: int) -> torch.Tensor:
    """Sequences' rows 0..ctx-1 out of pool [N, bs, Hkv, hd] through tables [B, M]: [B, Hkv, ctx, hd] contiguous."""
    rows = pool[tables.long()].flatten(1, 2)[:, :ctx]  # [B, M * bs, Hkv, hd] -> [B, ctx, Hkv, hd]
    return rows.transpose(1, 2).contiguous()


# ---- the kernels -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeCase:
    batch: int
    ctx: int
    tables: torch.Tensor  # [B, M] int32, scattered blocks
    lens: torch.Tensor  # [B] int32
    q: torch.Tensor  # [B, Hq, hd]


def decode_cases(device: torch.device, sizes: KernelSizes) -> tuple[torch.Tensor, torch.Tensor, list[DecodeCase]]:
    """One K and one V pool [N, bs, Hkv, hd] of random bf16, and each batch x context case over scattered blocks of
    them (as a busy pool's are), the same on every call: what every decode kernel here is timed on."""
    hq, hkv, hd = sizes.heads
    bs = sizes.block_size
    gen = torch.Generator().manual_seed(0)
    n_blocks = max(sizes.batches) * math.ceil(max(sizes.contexts) / bs)
    k_pool, v_pool = (torch.randn(n_blocks, bs, hkv, hd, dtype=DTYPE, device=device) for _ in range(2))
    cases = []
    for ctx in sizes.contexts:
        for batch in sizes.batches:
            width = math.ceil(ctx / bs)
            perm = torch.randperm(n_blocks, generator=gen)[:batch * width]
            cases.append(DecodeCase(batch, ctx, perm.view(batch, width).to(device, torch.int32),
                                    torch.full((batch,), ctx, dtype=torch.int32, device=device),
                                    torch.randn(batch, hq, hd, dtype=DTYPE, device=device)))
    return k_pool, v_pool, cases


def bench_decode(device: torch.device, sizes: KernelSizes, peaks: dict) -> list[dict]:
    """decode_attention over scattered blocks of one pool, each batch x context; SDPA on the gathered K/V."""
    hq, hkv, hd = sizes.heads
    k_pool, v_pool, cases = decode_cases(device, sizes)
    out = []
    for c in cases:
        ours = median_seconds(partial(triton_attention.decode_attention, c.q, k_pool, v_pool, c.tables, c.lens),
                              device, sizes.warmup, sizes.reps)
        name, call = sdpa_call(c.q[:, :, None], gathered(k_pool, c.tables, c.ctx), gathered(v_pool, c.tables, c.ctx))
        base = median_seconds(call, device, sizes.warmup, sizes.reps)
        nbytes, flops = decode_work(c.batch, c.ctx, hq, hkv, hd)
        out.append(record("decode_attention", f"B={c.batch} ctx={c.ctx}", ours, nbytes, flops, peaks,
                          (f"sdpa {name}", base)))
        del call
    return out


def bench_rows(device: torch.device, sizes: KernelSizes, peaks: dict) -> list[dict]:
    """rows_attention: a blend's recomputed rows (ratio of the chunk rows, at random sorted positions) and the
    suffix over every key; SDPA with the positions' mask on the same rows, and a flash causal prefill of every
    row (the attention a full prefill does)."""
    hq, hkv, hd = sizes.heads
    bs, s = sizes.block_size, sizes.rows_keys
    gen = torch.Generator().manual_seed(1)
    chunk_rows = s - sizes.rows_suffix
    picked = torch.randperm(chunk_rows, generator=gen)[:round(sizes.rows_ratio * chunk_rows)].sort().values
    q_pos = torch.cat([picked, torch.arange(chunk_rows, s)]).to(device)  # [R]
    visible = triton_attention.visible_keys(q_pos, torch.arange(s, device=device))  # [R] int32: q_pos + 1
    width = math.ceil(s / bs)
    table = torch.randperm(2 * width, generator=gen)[:width].to(device, torch.int32)  # [M] scattered
    k_pool, v_pool = (torch.randn(2 * width, bs, hkv, hd, dtype=DTYPE, device=device) for _ in range(2))
    q = torch.randn(q_pos.numel(), hq, hd, dtype=DTYPE, device=device)  # [R, Hq, hd]
    ours = median_seconds(partial(triton_attention.rows_attention, q, k_pool, v_pool, table, visible), device,
                          sizes.warmup, sizes.reps)
    k, v = gathered(k_pool, table[None], s), gathered(v_pool, table[None], s)  # [1, Hkv, S, hd]
    mask = torch.arange(s, device=device)[None, :] < visible[:, None]  # [R, S]
    name, call = sdpa_call(q.transpose(0, 1)[None].contiguous(), k, v, mask)
    base = median_seconds(call, device, sizes.warmup, sizes.reps)
    flash, every = sdpa_call(torch.randn(1, hq, s, hd, dtype=DTYPE, device=device), k, v, causal=True)
    every_s = median_seconds(every, device, sizes.warmup, sizes.reps)
    shape = f"R={q_pos.numel()} ({sizes.rows_ratio:g} of {chunk_rows} + {sizes.rows_suffix}) keys={s}"
    nbytes, flops = rows_work(visible, hq, hkv, hd)
    all_bytes, all_flops = rows_work(torch.arange(1, s + 1), hq, hkv, hd)
    return [record("rows_attention", shape, ours, nbytes, flops, peaks, (f"sdpa {name}, mask", base)),
            record(f"sdpa {flash}, causal", f"every row: R={s} keys={s}", every_s, all_bytes, all_flops, peaks)]


def bench_load(device: torch.device, sizes: KernelSizes, peaks: dict) -> list[dict]:
    """load_layers of one chunk's every layer into a bf16 pool, int8 and fp16 stored; the torch twin a layer at a
    time as the baseline."""
    _, hkv, hd = sizes.heads
    n_layers, t, bs = sizes.load_layers, sizes.load_tokens, sizes.block_size
    gen = torch.Generator().manual_seed(2)
    width = math.ceil(t / bs)
    table = torch.randperm(4 * width, generator=gen)[:width].to(device, torch.int32)  # [M] scattered
    pool = torch.zeros(n_layers, 2, 4 * width, bs, hkv, hd, dtype=DTYPE, device=device)  # [L, 2, N, bs, Hkv, hd]
    positions = torch.arange(1000, 1000 + t, device=device)  # [T]: a chunk placed after others
    inv_freq = (1.0 / 500000.0 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)).float().to(device)  # [hd/2]
    out = []
    for stored in (torch.int8, torch.float16):
        values = (*stored_chunk(stored, (n_layers, t, hkv, hd), device), positions, inv_freq)
        ours = median_seconds(partial(triton_load.load_layers, *values, pool, table, 0, bs), device, sizes.warmup,
                              sizes.reps)
        base = median_seconds(partial(twin_layers, *values, pool, table, bs), device, sizes.warmup, sizes.reps)
        nbytes = load_bytes(n_layers, t, hkv, hd, stored.itemsize, DTYPE.itemsize, stored == torch.int8)
        out.append(record("load_layers", f"{str(stored).removeprefix('torch.')} L={n_layers} T={t}", ours, nbytes,
                          None, peaks, ("torch twin, per layer", base)))
    return out


def stored_chunk(dtype: torch.dtype, shape: tuple[int, int, int, int], device: torch.device) -> tuple:
    """Random stored K, V [L, T, Hkv, hd] of `dtype` and their scales (int8: K per channel [L, Hkv, hd], V per
    token [L, T, Hkv]; None for floats)."""
    n_layers, t, hkv, hd = shape
    if dtype != torch.int8:
        return *(torch.randn(shape, dtype=dtype, device=device) for _ in range(2)), None, None
    k, v = (torch.randint(-127, 128, shape, dtype=torch.int8, device=device) for _ in range(2))
    return k, v, torch.rand(n_layers, hkv, hd, device=device) / 127, torch.rand(n_layers, t, hkv, device=device) / 127


def twin_layers(k, v, k_scale, v_scale, positions, inv_freq, pool, table, block_size) -> None:
    """load_layers as its torch twin does it, a layer at a time (the baseline)."""
    for i in range(k.shape[0]):
        triton_load.load_chunk_twin(k[i], v[i], None if k_scale is None else k_scale[i],
                                    None if v_scale is None else v_scale[i], positions, inv_freq, pool[i, 0],
                                    pool[i, 1], table, 0, block_size)


def run(device: torch.device, sizes: KernelSizes, peaks: dict, log: Callable[[str], None]) -> list[dict]:
    out = []
    for name, bench in (("decode_attention", bench_decode), ("rows_attention", bench_rows),
                        ("load_layers", bench_load)):
        log(f"kernels: {name}")
        out += bench(device, sizes, peaks)
    return out
