"""Fused load of a stored chunk's KV into the paged pool: dequantise, rotate the keys, scatter through a block table.

One pass per (layer, chunk): the stored K and V [T, Hkv, hd] (fp16, bf16, float32 — the store's bf16 decodes to
float32 — or int8 with float32 scales) are dequantised to float32 (int8: x = q * scale, K scales per (head,
channel) [Hkv, hd] or per (token, head) [T, Hkv], V scales per (token, head) [T, Hkv]); the keys, stored before
rotary, are rotated to their absolute positions in the prompt (HF "rotate half": o1 = x1*cos - x2*sin,
o2 = x2*cos + x1*sin with angles = position * inv_freq in float32); both are cast once to the pool's dtype and
written to the sequence rows first_row .. first_row + T - 1. Rows and positions are separate inputs because a
Keyformer-reduced chunk has consecutive rows but positions with gaps.

    pool_k, pool_v: [num_blocks, block_size, Hkv, hd]  one layer of the engine's pool (pool.kv[layer, 0 | 1])
    row r lives in slot block_table[r // block_size] * block_size + r % block_size of the flat [slots, Hkv, hd]

`load_chunk_twin` is the spec; `load_chunk` checks its inputs and launches the Triton
kernel (grid: token tiles x KV heads x layers); `load_layers` loads every layer of a chunk in one launch into the
engine's whole pool [L, 2, num_blocks, block_size, Hkv, hd]. Block ids are trusted (the allocator hands them out):
checking their range would cost a device sync per load. The launch turns FP fusion off, so the rotation rounds its
two products as the twin does; V is bit-equal to the twin's, K wherever Triton's cos/sin equal torch's
(tests/test_triton_load.py; docs/gpu.md gives the bounds).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrag.kernels import triton_mode

STORED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.int8)
POOL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
POSITION_DTYPES = (torch.int32, torch.int64)
BLOCK_T = 16  # tokens per program (not tuned: no GPU to measure on); BLOCK_T x hd of K and V in float32
K_NONE, K_PER_CHANNEL, K_PER_TOKEN, K_PER_CHUNK_CHANNEL = 0, 1, 2, 3  # the kernel's K-scale layouts
FP_FUSION = False  # no FMA on a GPU: the rotation rounds its two products as the twin does


def load_chunk_twin(k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                    positions: torch.Tensor, inv_freq: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor,
                    block_table: torch.Tensor, first_row: int, block_size: int, *,
                    k_per_channel: bool | None = None, scale_chunk: torch.Tensor | None = None) -> None:
    """The spec, in torch: write the chunk's rotated K and its V to rows first_row.. of the pool (in place).
    `scale_chunk` int32 [T]: the rows are several chunks' (a staged layer), row t's K scales k_scale[scale_chunk[t]]
    of k_scale [n_chunks, Hkv, hd] (per channel, per chunk).

    k, v [T, Hkv, hd]; k_scale None, [Hkv, hd] or [T, Hkv] (k_per_channel says which where T == Hkv == hd);
    v_scale None or [T, Hkv]; positions [T]; inv_freq [hd/2] float32; pool_k, pool_v [num_blocks, block_size,
    Hkv, hd]; block_table [M] int32."""
    t, h, hd = k.shape
    half = hd // 2
    if scale_chunk is not None:
        kf = k.to(torch.float32) * k_scale[scale_chunk.long()]  # [T, Hkv, hd] float32
    else:
        kf = _dequantise(k, k_scale, _k_layout(k.shape, k_scale, k_per_channel) == K_PER_CHANNEL)
    vf = _dequantise(v, v_scale, False)  # [T, Hkv, hd] float32
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, hd/2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]  # [T, 1, hd/2]
    x1, x2 = kf[..., :half], kf[..., half:]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)  # [T, Hkv, hd]
    rows = first_row + torch.arange(t, device=block_table.device)  # [T]
    slots = block_table.long()[rows // block_size] * block_size + rows % block_size  # [T]
    pool_k.view(-1, h, hd)[slots] = rotated.to(pool_k.dtype)
    pool_v.view(-1, h, hd)[slots] = vf.to(pool_v.dtype)


def _dequantise(x: torch.Tensor, scale: torch.Tensor | None, per_channel: bool) -> torch.Tensor:
    """x [T, Hkv, hd] -> float32; scale [Hkv, hd] (per_channel) or [T, Hkv], None for float inputs."""
    xf = x.to(torch.float32)
    if scale is None:
        return xf
    return xf * (scale[None] if per_channel else scale[..., None])


@triton.jit
def _load_kernel(k_ptr, v_ptr, ks_ptr, vs_ptr, chunk_ptr, pos_ptr, inv_ptr, pool_k_ptr, pool_v_ptr, table_ptr,
                 n_tokens, first_row, block_size, kv_layer_stride, ks_layer_stride, vs_layer_stride,
                 pool_layer_stride, H: tl.constexpr, HALF: tl.constexpr, K_SCALE: tl.constexpr,
                 V_SCALE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program: BLOCK_T tokens of one KV head of one layer, K and V, each row as its two halves."""
    head = tl.program_id(1)
    layer = tl.program_id(2).to(tl.int64)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    t_ok = t < n_tokens
    mask = t_ok[:, None] & (d < HALF)[None, :]  # [BLOCK_T, BLOCK_D]
    src = layer * kv_layer_stride + ((t * H + head) * (2 * HALF))[:, None] + d[None, :]  # first half's offsets
    k1 = tl.load(k_ptr + src, mask=mask, other=0).to(tl.float32)
    k2 = tl.load(k_ptr + src + HALF, mask=mask, other=0).to(tl.float32)
    v1 = tl.load(v_ptr + src, mask=mask, other=0).to(tl.float32)
    v2 = tl.load(v_ptr + src + HALF, mask=mask, other=0).to(tl.float32)
    if K_SCALE == 1:  # per (head, channel)
        ks = ks_ptr + layer * ks_layer_stride + head * (2 * HALF) + d
        k1 = k1 * tl.load(ks, mask=d < HALF, other=0)[None, :]
        k2 = k2 * tl.load(ks + HALF, mask=d < HALF, other=0)[None, :]
    if K_SCALE == 3:  # per (chunk, head, channel): row t's chunk from the map
        owner = tl.load(chunk_ptr + t, mask=t_ok, other=0).to(tl.int64)  # [BLOCK_T]
        ks = ks_ptr + layer * ks_layer_stride + (owner * H + head)[:, None] * (2 * HALF) + d[None, :]
        k1 = k1 * tl.load(ks, mask=mask, other=0)
        k2 = k2 * tl.load(ks + HALF, mask=mask, other=0)
    if K_SCALE == 2:  # per (token, head)
        kst = tl.load(ks_ptr + layer * ks_layer_stride + t * H + head, mask=t_ok, other=0)[:, None]
        k1, k2 = k1 * kst, k2 * kst
    if V_SCALE:
        vst = tl.load(vs_ptr + layer * vs_layer_stride + t * H + head, mask=t_ok, other=0)[:, None]
        v1, v2 = v1 * vst, v2 * vst
    pos = tl.load(pos_ptr + t, mask=t_ok, other=0).to(tl.float32)  # [BLOCK_T]
    angles = pos[:, None] * tl.load(inv_ptr + d, mask=d < HALF, other=0)[None, :]  # [BLOCK_T, BLOCK_D]
    cos, sin = tl.cos(angles), tl.sin(angles)
    row = first_row + t
    block = tl.load(table_ptr + row // block_size, mask=t_ok, other=0).to(tl.int64)
    slot = block * block_size + row % block_size  # [BLOCK_T]
    dst = layer * pool_layer_stride + ((slot * H + head) * (2 * HALF))[:, None] + d[None, :]
    out_ty = pool_k_ptr.dtype.element_ty
    tl.store(pool_k_ptr + dst, _to_pool(k1 * cos - k2 * sin, out_ty), mask=mask)
    tl.store(pool_k_ptr + dst + HALF, _to_pool(k2 * cos + k1 * sin, out_ty), mask=mask)
    tl.store(pool_v_ptr + dst, _to_pool(v1, out_ty), mask=mask)
    tl.store(pool_v_ptr + dst + HALF, _to_pool(v2, out_ty), mask=mask)


@triton.jit
def _to_pool(x, out_ty: tl.constexpr):
    """float32 x -> the pool dtype, rounding to nearest even as torch does (x finite).

    bfloat16 is rounded in bits: Triton's interpreter truncates a float32 -> bfloat16 cast where a GPU rounds,
    and the kernel must equal its twin on both."""
    if out_ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)  # ties go to the even bfloat16
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(out_ty)


def load_chunk(k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
               positions: torch.Tensor, inv_freq: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor,
               block_table: torch.Tensor, first_row: int, block_size: int, *,
               k_per_channel: bool | None = None, scale_chunk: torch.Tensor | None = None) -> None:
    """load_chunk_twin in one Triton launch (same arguments); ValueError on any input it cannot take."""
    _check_ndim(k=(k, 3), v=(v, 3), pool_k=(pool_k, 4), pool_v=(pool_v, 4))
    k_scale, v_scale = (None if x is None else x[None] for x in (k_scale, v_scale))  # one layer
    _launch(k[None], v[None], k_scale, v_scale, positions, inv_freq, pool_k[None], pool_v[None], block_table,
            first_row, block_size, k_per_channel, scale_chunk)


def load_layers(k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                positions: torch.Tensor, inv_freq: torch.Tensor, pool: torch.Tensor, block_table: torch.Tensor,
                first_row: int, block_size: int, *, k_per_channel: bool | None = None) -> None:
    """Every layer of a chunk in one launch: k, v [L, T, Hkv, hd], scales with a leading [L], pool the engine's
    [L, 2, num_blocks, block_size, Hkv, hd]; layer l as load_chunk(k[l], .., pool[l, 0], pool[l, 1], ..)."""
    _check_ndim(k=(k, 4), v=(v, 4), pool=(pool, 6))
    if pool.shape[:2] != (k.shape[0], 2):
        raise ValueError(f"pool must be [L={k.shape[0]}, 2, num_blocks, block_size, Hkv, hd], got {tuple(pool.shape)}")
    _launch(k, v, k_scale, v_scale, positions, inv_freq, pool[:, 0], pool[:, 1], block_table, first_row,
            block_size, k_per_channel)


def _launch(k, v, k_scale, v_scale, positions, inv_freq, pool_k, pool_v, block_table, first_row, block_size,
            k_per_channel, scale_chunk=None) -> None:
    """Check the layered inputs (k, v [L, T, Hkv, hd]; pools [L, num_blocks, block_size, Hkv, hd]) and launch."""
    n_layers, t, h, hd = k.shape
    k_layout = _check_values(k, v, k_scale, v_scale, k_per_channel, scale_chunk)
    _check_rotary(positions, inv_freq, t, hd)
    _check_pool(pool_k, pool_v, n_layers, h, hd, block_size)
    _check_table(block_table, first_row, t, block_size)
    _check_device(k, v, k_scale, v_scale, scale_chunk, positions, inv_freq, pool_k, pool_v, block_table)
    dummy = k  # a pointer the kernel never reads where there is no scale
    grid = (triton.cdiv(t, BLOCK_T), h, n_layers)
    _load_kernel[grid](
        k, v, dummy if k_scale is None else k_scale, dummy if v_scale is None else v_scale,
        dummy if scale_chunk is None else scale_chunk, positions, inv_freq,
        pool_k, pool_v, block_table, t, first_row, block_size, k.stride(0),
        0 if k_scale is None else k_scale.stride(0), 0 if v_scale is None else v_scale.stride(0),
        pool_k.stride(0), H=h, HALF=hd // 2, K_SCALE=k_layout, V_SCALE=v_scale is not None,
        BLOCK_T=BLOCK_T, BLOCK_D=triton.next_power_of_2(hd // 2),
        enable_fp_fusion=FP_FUSION)


def _k_layout(shape: torch.Size, k_scale: torch.Tensor | None, k_per_channel: bool | None) -> int:
    """K_NONE, K_PER_CHANNEL or K_PER_TOKEN for k [T, Hkv, hd] and a scale of one layer."""
    if k_scale is None:
        return K_NONE
    t, h, hd = shape
    channel, token = tuple(k_scale.shape) == (h, hd), tuple(k_scale.shape) == (t, h)
    if k_per_channel is not None:
        channel, token = channel and k_per_channel, token and not k_per_channel
    if channel and token:
        raise ValueError(f"k_scale {tuple(k_scale.shape)} fits both [Hkv, hd] and [T, Hkv]; pass k_per_channel")
    if not (channel or token):
        raise ValueError(f"k_scale must be [Hkv, hd] = {(h, hd)} or [T, Hkv] = {(t, h)}, got {tuple(k_scale.shape)}")
    return K_PER_CHANNEL if channel else K_PER_TOKEN


def _check_ndim(**named: tuple[torch.Tensor, int]) -> None:
    for name, (x, ndim) in named.items():
        if x.ndim != ndim:
            raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")


def _check_values(k, v, k_scale, v_scale, k_per_channel, scale_chunk=None) -> int:
    """k, v [L, T, Hkv, hd] and their scales (with the leading [L]); the kernel's K-scale layout."""
    n_layers, t, h, hd = k.shape
    if v.shape != k.shape or t < 1 or hd % 2:
        raise ValueError(f"k and v must share a [T, Hkv, hd] shape with T >= 1 and hd even, got "
                         f"{tuple(k.shape[1:])} and {tuple(v.shape[1:])}")
    if k.dtype != v.dtype or k.dtype not in STORED_DTYPES:
        raise ValueError(f"k and v must share one dtype of {STORED_DTYPES}, got {k.dtype} and {v.dtype}")
    if not (k.is_contiguous() and v.is_contiguous()) or n_layers < 1:
        raise ValueError("k and v must be contiguous, with at least one layer")
    quantised = k.dtype == torch.int8
    if (k_scale is None or v_scale is None) == quantised or (k_scale is None) != (v_scale is None):
        raise ValueError("int8 k and v need k_scale and v_scale; float k and v take neither")
    if not quantised:
        return K_NONE
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale.dtype != torch.float32 or not scale.is_contiguous() or scale.shape[0] != n_layers:
            raise ValueError(f"{name} must be a contiguous float32 tensor, got {scale.dtype} {tuple(scale.shape)}")
    if tuple(v_scale.shape[1:]) != (t, h):
        raise ValueError(f"v_scale must be [T, Hkv] = {(t, h)}, got {tuple(v_scale.shape[1:])}")
    if scale_chunk is not None:
        if scale_chunk.shape != (t,) or scale_chunk.dtype != torch.int32 or tuple(k_scale.shape[2:]) != (h, hd):
            raise ValueError(f"scale_chunk must be int32 [T] = [{t}] over k_scale [n_chunks, Hkv, hd], got "
                             f"{scale_chunk.dtype} {tuple(scale_chunk.shape)} and {tuple(k_scale.shape[1:])}")
        return K_PER_CHUNK_CHANNEL
    return _k_layout(k.shape[1:], k_scale[0], k_per_channel)


def _check_rotary(positions: torch.Tensor, inv_freq: torch.Tensor, t: int, hd: int) -> None:
    if positions.shape != (t,) or positions.dtype not in POSITION_DTYPES or not positions.is_contiguous():
        raise ValueError(f"positions must be a contiguous int32 or int64 [T] = [{t}], got "
                         f"{positions.dtype} {tuple(positions.shape)}")
    if inv_freq.shape != (hd // 2,) or inv_freq.dtype != torch.float32 or not inv_freq.is_contiguous():
        raise ValueError(f"inv_freq must be a contiguous float32 [hd/2] = [{hd // 2}], got "
                         f"{inv_freq.dtype} {tuple(inv_freq.shape)}")


def _check_pool(pool_k, pool_v, n_layers: int, h: int, hd: int, block_size: int) -> None:
    """pool_k, pool_v [L, num_blocks, block_size, Hkv, hd]: each layer contiguous, one layer stride for both."""
    if pool_k.shape != pool_v.shape or tuple(pool_k.shape[2:]) != (block_size, h, hd) or pool_k.shape[0] != n_layers:
        raise ValueError(f"pool_k and pool_v must be [num_blocks, block_size={block_size}, Hkv={h}, hd={hd}], got "
                         f"{tuple(pool_k.shape[1:])} and {tuple(pool_v.shape[1:])}")
    if pool_k.dtype != pool_v.dtype or pool_k.dtype not in POOL_DTYPES:
        raise ValueError(f"pool_k and pool_v must share one dtype of {POOL_DTYPES}, got {pool_k.dtype} and "
                         f"{pool_v.dtype}")
    # each layer contiguous; the layers themselves may be a strided view (pool[:, 0] of the engine's pool)
    if not (pool_k[0].is_contiguous() and pool_v[0].is_contiguous()) or pool_k.stride(0) != pool_v.stride(0):
        raise ValueError("each layer of pool_k and pool_v must be contiguous, with one layer stride for both")


def _check_table(block_table: torch.Tensor, first_row: int, t: int, block_size: int) -> None:
    if block_table.ndim != 1 or block_table.dtype != torch.int32 or not block_table.is_contiguous():
        raise ValueError(f"block_table must be a contiguous int32 [M], got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")
    if first_row < 0 or block_table.shape[0] * block_size < first_row + t:
        raise ValueError(f"a block table of {block_table.shape[0]} blocks of {block_size} cannot hold rows "
                         f"{first_row}..{first_row + t - 1}")


def _check_device(*tensors: torch.Tensor | None) -> None:
    devices = {x.device for x in tensors if x is not None}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if devices.pop().type == "cpu" and not triton_mode.interpreting():
        raise ValueError("CPU tensors need Triton's interpreter (TRITON_INTERPRET=1); load_chunk_twin runs on a CPU")
