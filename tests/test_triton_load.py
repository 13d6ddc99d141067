"""The fused chunk load (kernels/triton_load.py): the Triton kernel against its torch twin (Triton's interpreter on
a CPU), and the twin against an independent reference (rotary.rotate, BlockTable.slots, the store's codec)."""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when @triton.jit decorates, so before the import

from kvrag.kernels.triton_load import FP_FUSION, load_chunk, load_chunk_twin, load_layers  # noqa: E402
from kvrag.kvcache.allocator import BlockTable  # noqa: E402
from kvrag.model import rotary  # noqa: E402
from kvrag.store import codec  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
STORED = ("fp16", "bf16", "bf16-as-fp32", "fp32", "int8-channel", "int8-token")
POOLS = (torch.float16, torch.bfloat16, torch.float32)


def inv_freq(hd: int, theta: float = 10000.0) -> torch.Tensor:
    return (1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)).float()  # [hd/2]


def make_chunk(stored: str, t: int, h: int, hd: int, seed: int = 0) -> dict:
    """A chunk as the store hands it over: k, v [T, Hkv, hd] and the int8 scales; pre-rotary keys with outliers."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(t, h, hd, generator=g) * torch.linspace(0.5, 8.0, hd)  # [T, Hkv, hd] outlier channels
    v = torch.randn(t, h, hd, generator=g)
    if stored.startswith("int8"):
        per_channel = stored == "int8-channel"
        ks = torch.rand(h, hd, generator=g) / 16 if per_channel else torch.rand(t, h, generator=g) / 16
        q = [torch.randint(-127, 128, (t, h, hd), generator=g, dtype=torch.int8) for _ in range(2)]
        return dict(k=q[0], v=q[1], k_scale=ks, v_scale=torch.rand(t, h, generator=g) / 16)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}.get(stored)
    if stored == "bf16-as-fp32":  # what codec.decode gives for bf16: float32 holding bf16 values
        k, v = k.bfloat16().float(), v.bfloat16().float()
    else:
        k, v = k.to(dtype), v.to(dtype)
    return dict(k=k, v=v, k_scale=None, v_scale=None)


def make_load(stored: str, pool_dtype: torch.dtype, t: int = 37, h: int = 3, hd: int = 64, block_size: int = 16,
              first_row: int = 21, seed: int = 0) -> dict:
    """Every argument of load_chunk: positions with gaps past 6000, a shuffled block table with spare blocks, a
    pool of random values (so that untouched rows are seen to stay)."""
    g = torch.Generator().manual_seed(seed + 1)
    n_blocks = -(-(first_row + t) // block_size) + 3
    gaps = torch.randint(1, 4, (t,), generator=g)
    args = make_chunk(stored, t, h, hd, seed)
    args.update(positions=(6000 + torch.cumsum(gaps, 0)).to(torch.int32), inv_freq=inv_freq(hd),
                pool_k=torch.randn(n_blocks + 2, block_size, h, hd, generator=g).to(pool_dtype),
                pool_v=torch.randn(n_blocks + 2, block_size, h, hd, generator=g).to(pool_dtype),
                block_table=torch.randperm(n_blocks + 2, generator=g)[:n_blocks].to(torch.int32),
                first_row=first_row, block_size=block_size)
    return {name: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for name, x in args.items()}


def run(fn, args: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """fn on fresh copies of the pools; the pools it wrote."""
    args = dict(args, pool_k=args["pool_k"].clone(), pool_v=args["pool_v"].clone())
    fn(**args)
    return args["pool_k"], args["pool_v"]


def written_slots(args: dict) -> list[int]:
    """The slots of rows first_row.., by the allocator's own bookkeeping."""
    t, bs, first = args["k"].shape[0], args["block_size"], args["first_row"]
    blocks = args["block_table"].tolist()[: -(-(first + t) // bs)]
    return BlockTable(blocks, first + t, bs).slots()[first:]


def key_bound(args: dict, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How far kernel and twin keys may differ: cos and sin one float32 ulp apart (<= 2^-24) move a rotated value by
    up to 2^-24 (|x1| + |x2|), its two rounded products by up to 2^-24 (|x1| + |x2|) more, and the cast to the pool
    dtype by one ulp of that dtype."""
    k = args["k"].float()
    if args["k_scale"] is not None:
        k = k * (args["k_scale"][None] if args["k_scale"].shape == k.shape[1:] else args["k_scale"][..., None])
    half = k.shape[-1] // 2
    m = (k[..., :half].abs() + k[..., half:].abs()).repeat(1, 1, 2)  # [T, Hkv, hd]
    slots = torch.tensor(written_slots(args), device=a.device)
    top = torch.maximum(a.float(), b.float()).abs().view(-1, *k.shape[1:])[slots]
    info = torch.finfo(a.dtype)
    bound = torch.zeros_like(a, dtype=torch.float32).view(-1, *k.shape[1:])
    bound[slots] = 2.0**-22 * m + info.eps * top + info.smallest_normal * info.eps
    return bound.view(a.shape)


def check_kernel(args: dict) -> None:
    """Kernel against twin: V bit-equal, K within key_bound, rows outside the chunk untouched."""
    pk, pv = run(load_chunk, args)
    tk, tv = run(load_chunk_twin, args)
    assert torch.equal(pv, tv)
    diff = (pk.float() - tk.float()).abs()
    bound = key_bound(args, pk, tk)
    assert bool((diff <= bound).all()), f"{int((diff > bound).sum())} keys past the bound, max diff {diff.max()}"
    untouched = torch.ones(pk.shape[0] * pk.shape[1], dtype=torch.bool, device=pk.device)
    untouched[written_slots(args)] = False
    for pool, original in ((pk, args["pool_k"]), (pv, args["pool_v"])):
        assert torch.equal(pool.flatten(0, 1)[untouched], original.flatten(0, 1)[untouched])


@pytest.mark.parametrize("pool_dtype", POOLS, ids=str)
@pytest.mark.parametrize("stored", STORED)
def test_kernel_matches_twin(stored, pool_dtype):
    check_kernel(make_load(stored, pool_dtype))


@pytest.mark.parametrize("stored,pool_dtype,t,h,hd,block_size,first_row", [
    ("fp16", torch.float16, 1, 1, 64, 5, 3),
    ("int8-token", torch.bfloat16, 1, 3, 64, 16, 15),
    ("int8-channel", torch.float32, 37, 3, 64, 5, 0),
    ("bf16-as-fp32", torch.bfloat16, 37, 3, 48, 5, 4),  # half a head is 24: masked lanes
    ("fp16", torch.float32, 20, 2, 128, 16, 16),
])
def test_kernel_matches_twin_odd_shapes(stored, pool_dtype, t, h, hd, block_size, first_row):
    check_kernel(make_load(stored, pool_dtype, t, h, hd, block_size, first_row, seed=t + hd))


def test_int8_scale_layout_named_where_shapes_coincide():
    """T == Hkv == hd: a [4, 4] K scale fits both layouts, so k_per_channel must say which."""
    args = make_load("int8-token", torch.float32, t=4, h=4, hd=4, block_size=5, first_row=2)
    with pytest.raises(ValueError, match="k_per_channel"):
        load_chunk(**args)
    for per_channel in (False, True):
        pk, _ = run(partial(load_chunk, k_per_channel=per_channel), args)
        tk, _ = run(partial(load_chunk_twin, k_per_channel=per_channel), args)
        assert (pk - tk).abs().max() <= 1e-5


def test_load_layers_matches_twin_per_layer():
    """Two layers in one launch into the engine's [L, 2, num_blocks, block_size, Hkv, hd] pool."""
    layers = [make_load("int8-channel", torch.bfloat16, t=19, h=3, hd=64, block_size=5, first_row=7, seed=s)
              for s in (0, 1)]
    base = layers[0]
    stack = {name: torch.stack([a[name] for a in layers]) for name in ("k", "v", "k_scale", "v_scale")}
    pool = torch.stack([torch.stack([a["pool_k"], a["pool_v"]]) for a in layers])  # [2, 2, nb, bs, Hkv, hd]
    load_layers(**stack, positions=base["positions"], inv_freq=base["inv_freq"], pool=pool,
                block_table=base["block_table"], first_row=7, block_size=5)
    for layer, args in enumerate(layers):
        args = dict(args, positions=base["positions"], block_table=base["block_table"])
        tk, tv = run(load_chunk_twin, args)
        assert torch.equal(pool[layer, 1], tv)
        assert bool(((pool[layer, 0].float() - tk.float()).abs() <= key_bound(args, pool[layer, 0], tk)).all())


@pytest.mark.parametrize("stored", ["fp16", "fp32", "bf16-as-fp32"])
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_twin_matches_rotary_and_block_table(stored, pool_dtype):
    """The twin against kvrag.model.rotary on float32 and the allocator's slots: bit-equal."""
    args = make_load(stored, pool_dtype, t=23, block_size=5, first_row=8)
    pk, pv = run(load_chunk_twin, args)
    cos, sin = rotary.cos_sin(args["inv_freq"], args["positions"], torch.float32)  # [T, 1, hd]
    keys = rotary.rotate(args["k"].float(), cos, sin)  # [T, Hkv, hd]
    slots = written_slots(args)
    ek, ev = args["pool_k"].clone(), args["pool_v"].clone()
    for t, slot in enumerate(slots):
        ek.flatten(0, 1)[slot] = keys[t].to(pool_dtype)
        ev.flatten(0, 1)[slot] = args["v"][t].to(pool_dtype)
    assert torch.equal(pk, ek) and torch.equal(pv, ev)


@pytest.mark.parametrize("k_per_channel", [True, False])
def test_twin_reads_the_stores_int8(k_per_channel):
    """int8 as the store keeps it (K, V, then float32 K and V scales): the twin on the raw values and scales
    writes what it writes from codec.decode's dequantised float32."""
    g = torch.Generator().manual_seed(3)
    t, h, hd = 13, 3, 64
    k, v = (torch.randn(t, h, hd, generator=g).numpy() for _ in range(2))
    raw = codec.encode(k, v, "int8", k_per_channel=k_per_channel, compress=False)
    _, body = codec.checked_body(raw)
    n = t * h * hd
    q = torch.from_numpy(np.frombuffer(body, dtype=np.int8, count=2 * n).reshape(2, t, h, hd).copy())
    ks_len = h * hd if k_per_channel else t * h
    scales = torch.from_numpy(np.frombuffer(body, dtype="<f4", count=ks_len + t * h, offset=2 * n).copy())
    ks = scales[:ks_len].view((h, hd) if k_per_channel else (t, h))
    decoded = codec.decode(raw)
    args = make_load("fp32", torch.float32, t=t, h=h, hd=hd, block_size=5, first_row=2)
    raw_args = dict(k=q[0], v=q[1], k_scale=ks, v_scale=scales[ks_len:].view(t, h))
    from_raw = run(load_chunk_twin, dict(args, **{name: x.to(DEVICE) for name, x in raw_args.items()}))
    from_decoded = run(load_chunk_twin, dict(args, k=torch.from_numpy(decoded.k).to(DEVICE),
                                             v=torch.from_numpy(decoded.v).to(DEVICE)))
    assert all(torch.equal(a, b) for a, b in zip(from_raw, from_decoded, strict=True))


def _bad_inputs():
    """(name, change to the arguments, what the error says)."""
    return [
        ("k 2-D", lambda a: a.update(k=a["k"][0]), "k must have 3 dimensions"),
        ("v shape", lambda a: a.update(v=a["v"][:-1]), "share a"),
        ("k dtype", lambda a: a.update(k=a["k"].double(), v=a["v"].double()), "one dtype"),
        ("k, v dtypes", lambda a: a.update(v=a["v"].float()), "one dtype"),
        ("k strided", lambda a: a.update(k=a["k"].transpose(0, 1).contiguous().transpose(0, 1)), "contiguous"),
        ("float k with scales", lambda a: a.update(v_scale=torch.ones(a["k"].shape[:2])), "need k_scale"),
        ("positions dtype", lambda a: a.update(positions=a["positions"].float()), "positions must"),
        ("positions length", lambda a: a.update(positions=a["positions"][1:]), "positions must"),
        ("inv_freq length", lambda a: a.update(inv_freq=a["inv_freq"][1:]), "inv_freq must"),
        ("pool dtype", lambda a: a.update(pool_v=a["pool_v"].float()), "pool_k and pool_v must share"),
        ("pool int", lambda a: a.update(pool_k=a["pool_k"].int(), pool_v=a["pool_v"].int()), "must share"),
        ("block_size", lambda a: a.update(block_size=8), "block_size=8"),
        ("pool strided", lambda a: a.update(pool_k=a["pool_k"].transpose(0, 1).contiguous().transpose(0, 1)),
         "contiguous"),
        ("table dtype", lambda a: a.update(block_table=a["block_table"].long()), "block_table must"),
        ("table short", lambda a: a.update(block_table=a["block_table"][:2]), "cannot hold"),
        ("first_row", lambda a: a.update(first_row=-1), "cannot hold"),
        ("device", lambda a: a.update(positions=a["positions"].to("meta")), "one device"),
    ]


def _bad_int8_inputs():
    return [
        ("no scales", lambda a: a.update(k_scale=None, v_scale=None), "need k_scale"),
        ("k_scale shape", lambda a: a.update(k_scale=a["k_scale"][:, :-1]), "k_scale must be"),
        ("v_scale shape", lambda a: a.update(v_scale=a["v_scale"][:-1]), "v_scale must be"),
        ("scale dtype", lambda a: a.update(v_scale=a["v_scale"].half()), "float32"),
    ]


@pytest.mark.parametrize("stored,change,match", [("fp16", c, m) for _, c, m in _bad_inputs()]
                         + [("int8-channel", c, m) for _, c, m in _bad_int8_inputs()],
                         ids=[n for n, _, _ in _bad_inputs() + _bad_int8_inputs()])
def test_load_chunk_rejects(stored, change, match):
    args = make_load(stored, torch.float16, t=9, h=2, hd=8, block_size=4, first_row=1)
    change(args)
    with pytest.raises(ValueError, match=match):
        load_chunk(**args)


def test_load_layers_rejects_a_pool_of_other_layers():
    args = make_load("fp16", torch.float16, t=9, h=2, hd=8, block_size=4, first_row=1)
    pool = torch.stack([args.pop("pool_k"), args.pop("pool_v")])[None].expand(3, -1, -1, -1, -1, -1)
    args.update(k=torch.stack([args["k"]] * 2), v=torch.stack([args["v"]] * 2))
    with pytest.raises(ValueError, match="pool must be"):
        load_layers(**args, pool=pool)


COMPILE_FOR_H100 = """
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvrag.kernels.triton_load import _load_kernel
sig = {n: "constexpr" if n.isupper() else "i32" for n in _load_kernel.arg_names}
sig.update(k_ptr="*i8", v_ptr="*i8", ks_ptr="*fp32", vs_ptr="*fp32", pos_ptr="*i32", inv_ptr="*fp32",
           pool_k_ptr="*bf16", pool_v_ptr="*bf16", table_ptr="*i32")
consts = dict(H=3, HALF=32, K_SCALE=1, V_SCALE=True, BLOCK_T=16, BLOCK_D=32)
src = ASTSource(fn=_load_kernel, signature=sig, constexprs=consts)
compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": %s})
sys.stdout.write(compiled.asm["ptx"])
"""


def test_kernel_compiles_for_a_gpu():
    """Compiled (not run) for an H100 as load_chunk launches it: cos and sin are libdevice's accurate cosf and
    sinf, as torch's CUDA kernels use, not the SFU's approximations, and the rotation has no fused multiply-add
    (libdevice's own are the flush-to-zero fma.rn.ftz.f32)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    ptx = subprocess.run([sys.executable, "-c", COMPILE_FOR_H100 % FP_FUSION], env=env, capture_output=True,
                         text=True, check=True, timeout=300).stdout
    assert "__nv_cosf" in ptx and "__nv_sinf" in ptx and "approx" not in ptx
    assert "fma.rn.f32" not in ptx and "sub.rn.f32" in ptx and "add.rn.f32" in ptx
