"""Weight-only int8/int4 matrices (kernels/quant.py, quant.cpp): the quantizer on hand-computed groups, the packing
round trip, the twin against a float64 product of the same quantized numbers, and the native kernel against the
twin bit for bit."""

import pytest
import torch

from kvrag.kernels import quant


def test_int8_groups_quantize_as_computed_by_hand():
    w = torch.zeros(16, 32)
    w[0, :4] = torch.tensor([1.0, -0.5, 0.25, 0.0])  # d = 1/127 (as float16): 127, -63.5 -> -64 (to even), 32, 0
    w[1, 0] = -2.0  # d = 2/127: -127
    q, d, m = quant.quantize(w, 8)
    assert m is None and d.dtype == torch.float16
    assert q[0, :4].tolist() == [127, -64, 32, 0]
    assert q[1, 0] == -127 and q[1, 1:].abs().sum() == 0
    assert d[0, 0] == torch.tensor(1 / 127).half() and d[1, 0] == torch.tensor(2 / 127).half()
    assert d[2:].abs().sum() == 0 and q[2:].abs().sum() == 0  # an all-zero group: scale 0, weights 0


def test_int4_groups_span_their_own_range():
    w = torch.zeros(16, 32)
    w[0, :3] = torch.tensor([-4.0, 3.5, 2.0])  # min -4, d = 7.5 / 15 = 0.5: 0, 15, 12; the zeros: 8
    w[1, :32] = torch.arange(32) * 0.25 + 1.0  # min 1, d = 7.75 / 15: levels of a ramp
    q, d, m = quant.quantize(w, 4)
    assert q[0, :4].tolist() == [0, 15, 12, 8] and d[0, 0] == 0.5 and m[0, 0] == -4
    assert q[1, 0] == 0 and q[1, 31] == 15 and m[1, 0] == 1.0
    assert (q >= 0).all() and (q <= 15).all()


def test_int4_gives_back_a_block_already_on_a_grid_of_16_levels():
    """A GGUF 4-bit block (Q4_K: w = d q - m with q in [0, 15], not every group reaching 0 and 15) comes back with
    its own step, exactly up to the float16 parameters; a spread of 32 levels (Q5_0) falls back to (max - min) / 15."""
    g = torch.Generator().manual_seed(3)
    q = torch.randint(2, 14, (16, 32), generator=g).float()  # levels 2..13 only
    step, low = torch.tensor(0.25), torch.tensor(-1.5)  # exact in float16
    w = q * step + low
    packed = quant.Packed.of(w, 4)
    assert torch.equal(quant.dequantize(packed), w)
    five_bit = torch.arange(32).float().repeat(16, 1) * 0.25
    _, d, _ = quant.quantize(five_bit, 4)
    assert torch.allclose(d.float(), torch.full((16, 1), 31 * 0.25 / 15), rtol=1e-3)


@pytest.mark.parametrize("bits", quant.BITS)
def test_pack_round_trip(bits):
    g = torch.Generator().manual_seed(bits)
    w = torch.randn(48, 96, generator=g)
    q, d, m = quant.quantize(w, bits)
    packed = quant.pack(q, d, m, bits)
    assert packed.weights.dtype == torch.uint8 and packed.weights.numel() == 48 * 96 * bits // 8
    q2, d2, m2 = quant.unpack(packed)
    assert torch.equal(q2, q) and torch.equal(d2, d) and (m is None or torch.equal(m2, m))
    values = q.float().reshape(48, 3, 32) * d.float()[..., None] + (0 if m is None else m.float()[..., None])
    assert torch.equal(quant.dequantize(packed), values.reshape(48, 96))
    # the rounding error: half a step, and the float16 parameters' own rounding
    err = (values - w.reshape(48, 3, 32)).abs()
    assert (err <= d.float()[..., None] * 0.51 + 1e-3 * w.abs().amax()).all()


@pytest.mark.parametrize("bits", quant.BITS)
def test_twin_is_the_product_of_the_quantized_numbers(bits):
    g = torch.Generator().manual_seed(10 + bits)
    w, x = torch.randn(32, 128, generator=g), torch.randn(5, 128, generator=g) * 3
    packed = quant.Packed.of(w, bits)
    xq, dx = quant.quantize_activations(x)
    xd = (xq * dx[..., None]).reshape(5, 128).double()  # the activations as the kernel sees them
    ref = xd @ quant.dequantize(packed).double().T  # [5, 32]
    got = quant.twin(packed, x)
    assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    # and near the float product: activation rounding costs about 1 % of a typical output here, int4's levels ~10 %
    dense = x.double() @ w.double().T
    assert ((got.double() - dense).norm() / dense.norm()).item() < (0.02 if bits == 8 else 0.15)


@pytest.fixture
def kernel(isa):
    """quant.cpp in each build this CPU runs (conftest's `isa`), skipped where that build cannot run it."""
    if not quant.available():
        pytest.skip(f"kvrag's {isa} library missing (or, for avx512, AVX512-VNNI)")
    return isa


@pytest.mark.parametrize("bits", quant.BITS)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_its_twin_bit_for_bit(kernel, bits, rows, threads):
    g = torch.Generator().manual_seed(rows * 7 + bits)
    n = 16 * 40 if threads == 2 else 48  # past 16 tiles, where a second thread joins
    w, x = torch.randn(n, 96, generator=g), torch.randn(rows, 96, generator=g)
    x[0, :32] = 0  # an all-zero activation group (scale 0)
    packed = quant.Packed.of(w, bits)
    assert torch.equal(quant.matmul(packed, x, threads), quant.twin(packed, x))
    part = packed.tiles(slice(1, 3))  # the q/k/v projection's parts are runs of tiles
    assert torch.equal(quant.matmul(part, x, threads), quant.twin(packed, x)[:, 16:48])


@pytest.mark.parametrize("bits", quant.BITS)
def test_kernel_is_exact_at_the_largest_integers(kernel, bits):
    """Every weight and activation of a group at its extreme (int8 +-127, int4 15, activations +-127), in every
    sign pattern: plain AVX2's VPMADDUBSW saturates an int16 pair sum past 32767 (255 x 127 x 2 for int8's stored
    q + 128), so only exact integer dots give back the twin's bits."""
    n, k = 32, 128
    top = 127 if bits == 8 else 15
    signs = torch.ones(n, k, dtype=torch.int8)
    if bits == 8:
        signs[8:16] = -1  # all negative
        signs[16:24, ::2] = -1  # alternating
        signs[24:, 64:] = -1  # the second half of the inputs
    q = top * signs
    scales = torch.full((n, k // 32), 0.5, dtype=torch.float16)
    mins = None if bits == 8 else torch.full((n, k // 32), -1.0, dtype=torch.float16)
    packed = quant.pack(q, scales, mins, bits)
    x = torch.ones(4, k)  # every activation 127 after its group's quantization
    x[1] = -1
    x[2, ::2] = -1
    x[3, 32:64] = -2  # a group of -127, the others +64 (rounded from 63.5)
    want = quant.twin(packed, x)
    assert torch.equal(quant.matmul(packed, x, 1), want)
    assert want[0, 0] == 4 * 32 * top * 127 * (0.5 / 127) + (0 if bits == 8 else 4 * 32 * -1.0)


def test_kernel_refuses_a_shape_it_cannot_take(kernel):
    packed = quant.Packed.of(torch.randn(16, 64), 8)
    with pytest.raises(ValueError):
        quant.matmul(packed, torch.randn(1, 32), 1)


@pytest.mark.parametrize("bits", quant.BITS)
def test_the_transposed_bf16_matrix_is_the_dequantized_one(isa, bits):
    """What a bf16 prefill on an AMX CPU multiplies by: W^T [K, N] with `dequantize`'s values rounded as torch
    rounds to bf16, bit for bit (in every build: it needs only the library)."""
    from kvrag.kernels import native

    if native.library() is None:
        pytest.skip(f"kvrag's {isa} library missing")
    packed = quant.Packed.of(torch.randn(48, 96, generator=torch.Generator().manual_seed(bits)) * 3, bits)
    assert torch.equal(quant.dequantize_t(packed, 2), quant.dequantize(packed, torch.bfloat16).T)
