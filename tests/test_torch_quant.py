"""Quantized products on torch's own weight-only ops where kvrag's kernel does not run (kernels/torch_quant.py): the
packing keeps kvrag's quantized numbers, each product is the product of those numbers within the op's own
rounding, and a model loaded with kvrag's kernels off decodes on them as its dequantized self does."""

from __future__ import annotations

import copy

import pytest
import torch

from kvrag.errors import KvragError
from kvrag.kernels import native, quant, torch_quant
from kvrag.model.decode import decode_step
from kvrag.model.prefill import prefill
from kvrag.model.quant import QuantWeight, resolve_weights

pytestmark = pytest.mark.skipif(not torch_quant.available(), reason="this torch lacks the weight-only CPU ops")

U = 2.0 ** -8  # bf16's unit roundoff (8 significant bits): what rounding x, the op's output or a parameter costs
F32 = 2.0 ** -24  # float32's, for the op's float32 sums (K terms each)


@pytest.fixture
def kernels_off():
    """kvrag's kernels off for the test (native.use("none"), as on ARM), the process's choice restored after."""
    before = native.isa()
    native.use("none")
    yield
    native.use(before)


def _matrix(n: int, k: int, seed: int) -> torch.Tensor:
    """A weight-like matrix: rows of different scales, a few large inputs (as real layers have)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05 * torch.rand(n, 1, generator=g).add(0.2)
    w[:, torch.randint(0, k, (3,), generator=g)] *= 6
    return w


def _bound(t: torch_quant.TorchPacked, p: quant.Packed, x: torch.Tensor) -> torch.Tensor:
    """How far the op's product may be from the twin (dequantized matrix times x, float64), [R, N], from the op's
    stated rounding: x rounded to bf16 (U a value), the parameters the op reads (int4: scale and zero in bf16, U
    each; int8: the terms' sum, which leaves the last term's half step), float32 sums of K products, and the op's
    output rounded to bf16 (U of it; int8: of each term, before its float32 scale). A 5% margin covers the
    second-order terms."""
    ax = x.double().abs()
    k = x.shape[1]
    if t.bits == 4:
        q, d, m = quant.unpack(p)
        d = d.double().repeat_interleave(quant.GROUP, dim=1)  # [N, K]
        zero = m.double().repeat_interleave(quant.GROUP, dim=1) + 8 * d
        w = quant.dequantize(p).double()
        params = (q.double() - 8).abs() * d + zero.abs()  # what rounding scale and zero to bf16 can move, / U
        out = ax @ w.T
        return 1.05 * (U * out.abs() + (U + k * F32) * (ax @ w.abs().T) + U * (ax @ params.T))
    terms = t.weights.double().abs() * t.scales.double()[..., None]  # [T, N, K] |s_t q_t|
    term_outs = sum((ax @ a.T) for a in terms)  # bounds every term's |output| and its sums' rounding
    represented = (torch_quant.dequantize(t) - quant.dequantize(p).double()).abs()
    return 1.05 * ((2 * U + k * F32) * term_outs + ax @ represented.T)


@pytest.mark.parametrize("bits", [8, 4])
def test_the_torch_form_holds_kvrags_quantized_numbers(bits):
    """int4 goes as it is, its parameters in bf16 (each weight then within U of |q - 8| d + |m + 8 d|); int8 as
    two per-row int8 terms whose sum is within the last term's half step of each weight, and adds under 2% of
    int8's own rounding (one term alone: about twice it, measured on Qwen2.5-Coder-1.5B)."""
    w = _matrix(208, 96, bits)  # 208 rows: torch's int4 blocks of 64 and a tail of 16
    p = quant.Packed.of(w, bits)
    t = torch_quant.pack(p)
    assert t.shape == p.shape == (208, 96)
    want = quant.dequantize(p).double()
    got = torch_quant.dequantize(t)
    if bits == 4:
        q, d, m = quant.unpack(p)
        d = d.double().repeat_interleave(quant.GROUP, dim=1)
        zero = m.double().repeat_interleave(quant.GROUP, dim=1) + 8 * d
        assert bool(((got - want).abs() <= 1.01 * U * ((q.double() - 8).abs() * d + zero.abs())).all())
    else:
        last = t.scales[-1].double()[:, None]  # [N, 1] the last term's step
        assert bool(((got - want).abs() <= 0.51 * last).all())
        one_term = torch_quant.dequantize(torch_quant.pack(p, terms=1))
        own = (want - w.double()).norm()
        assert (got - want).norm() < 0.02 * own < 0.02 * (one_term - want).norm()


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 37])
@pytest.mark.parametrize("bits", [8, 4])
def test_the_product_is_the_twins_within_the_ops_rounding(kernels_off, bits, rows, x_dtype):
    """x [R, K] times the torch form against quant.dequantize's matrix times x in float64 (the product of the same
    quantized numbers), within `_bound`; and each row's product the same bits whatever rows share the call."""
    w = _matrix(208, 96, 10 + bits)
    p = quant.Packed.of(w, bits)
    t = torch_quant.pack(p)
    x = (torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)) * 3).to(x_dtype)
    got = torch_quant.matmul(t, x)
    assert got.dtype == torch.float32 and got.shape == (rows, 208)
    twin = x.double() @ quant.dequantize(p).double().T
    err = (got.double() - twin).abs()
    assert bool((err <= _bound(t, p, x)).all()), float((err / _bound(t, p, x)).max())
    alone = torch.cat([torch_quant.matmul(t, x[i:i + 1]) for i in range(rows)])
    assert torch.equal(alone, got)


@pytest.mark.parametrize("bits", [8, 4])
def test_rows_of_the_torch_form_give_those_outputs(kernels_off, bits):
    """q/k/v's parts (QuantWeight[a:b]): a view of the torch form where its blocks allow (64-row boundaries), else
    the part packed anew; either way the whole product's columns, bit for bit, and x may be a bf16 view."""
    w = QuantWeight.of(_matrix(208, 96, 20 + bits), bits).for_torch()
    x = torch.randn(5, 100).bfloat16()[:, 4:]  # a view: not contiguous, not aligned
    whole = w.linear(x)
    for a, b in ((64, 192), (128, 208), (16, 48), (0, 208)):
        part = w[a:b]
        assert part.torch_form is not None and part.shape == (b - a, 96)
        assert torch.equal(part.linear(x), whole[:, a:b])
    assert w.linear(torch.empty(0, 96)).shape == (0, 208)


def test_int8_prompt_rows_past_64_multiply_by_the_dequantized_matrix(kernels_off):
    """torch's int8 op reads its weights again every 4 rows, so a prompt's rows from position TORCH_DENSE_ROWS on
    (and decode calls of more rows) multiply by the matrix dequantized for the call: a row's arithmetic follows its
    position, not the rows sharing its call. int4's op takes every row."""
    from kvrag.model import quant as quant_model

    assert quant_model.TORCH_DENSE_ROWS == 64
    x = torch.randn(100, 96)
    positions = torch.arange(100)
    w = QuantWeight.of(_matrix(64, 96, 30), 8).for_torch()
    out = w.linear(x, positions=positions)
    assert torch.equal(out[:64], w.linear(x[:64]))
    assert torch.equal(out[64:], torch.nn.functional.linear(x[64:], w.dense()))
    assert torch.equal(out[64:], w.linear(x[64:], positions=positions[64:]))
    assert torch.equal(w.linear(x), torch.nn.functional.linear(x, w.dense()))  # 100 decode rows: dense
    w4 = QuantWeight.of(_matrix(64, 96, 31), 4).for_torch()
    assert torch.equal(w4.linear(x, positions=positions), torch_quant.matmul(w4.torch_form, x))


def test_a_named_form_runs_on_torchs_ops_and_auto_stays_dense():
    """Where kvrag's kernel does not run (native False: kvrag's kernels off) a CPU runs a named quantized form on
    torch's ops; auto is dense there (a default is given only where answers were measured, on kvrag's kernel); a
    GPU runs neither."""
    cpu = torch.device("cpu")
    for form in ("int8", "int4", "mixed"):
        assert resolve_weights(form, cpu, native=False) == form
        with pytest.raises(KvragError, match=f"--weights {form} runs on a CPU"):
            resolve_weights(form, torch.device("cuda"))
    assert resolve_weights("auto", cpu, native=False, default="mixed") == "dense"


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_the_prepared_file_keeps_the_torch_form(kernels_off, tiny_llama_hd64_dir, weights, monkeypatch):
    """Packed once, kept in a prepared file of its own named by the layout's torch version, CPU capability and
    terms; the next load reads it as it was (nothing packed again), each tensor on a 64-byte boundary for the int8
    op's aligned loads, and the model's products are the same bits."""
    from kvrag.model import prepared
    from kvrag.model.files import resolve_model

    local = resolve_model(str(tiny_llama_hd64_dir))
    cpu = torch.device("cpu")
    path = prepared.prepared_path(local, torch.float32, weights, torch_ops=True)
    assert path.name.endswith(f"-{weights}-r1-{torch_quant.layout()}.safetensors")
    path.unlink(missing_ok=True)
    built = prepared.load_weights(local, torch.float32, cpu, weights)  # kvrag's kernels off: torch's ops
    assert path.exists()

    def no_packing(model):
        raise AssertionError("packed again")

    monkeypatch.setattr(prepared, "use_torch_ops", no_packing)
    loaded = prepared.load_weights(local, torch.float32, cpu, weights)
    for a, b in zip([*(t for layer in built.layers for t in vars(layer).values()), built.lm_head],
                    [*(t for layer in loaded.layers for t in vars(layer).values()), loaded.lm_head], strict=True):
        if isinstance(a, QuantWeight):
            assert torch.equal(a.torch_form.weights, b.torch_form.weights)
            assert torch.equal(a.torch_form.scales, b.torch_form.scales)
            assert b.torch_form.weights.data_ptr() % 64 == 0
    x = torch.randn(3, 128)
    w, v = built.layers[0].w_down, loaded.layers[0].w_down
    assert torch.equal(w.linear(x), v.linear(x))


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_a_model_with_kvrags_kernels_off_decodes_on_torchs_ops(kernels_off, tiny_llama_hd64_dir, weights):
    """Runtime.load(isa="none") packs every quantized matrix for torch's ops at load, and the model's prefill and
    decode logits match the same quantized model's with its matrices dequantized (dense float32 products: the
    reference) within a few bf16 steps of the logits' scale: every product rounds x and its output to bf16 (U
    each), through 3 layers of 4 products and the head. It is far nearer that reference than the reference is
    to the model before quantization for int4, whose rounding is far coarser than bf16's (int8's is about as fine
    as bf16's: there that comparison says nothing), so it computes the quantized model."""
    from kvrag.model.runtime import Runtime

    rt = Runtime.load(str(tiny_llama_hd64_dir), dtype="float32", device="cpu", weights=weights, isa="none",
                      keep_prepared=False)
    model = rt.model
    matrices = [getattr(layer, name) for layer in model.layers for name in ("wqkv", "wo", "w_gate_up", "w_down")]
    assert all(isinstance(w, QuantWeight) and w.torch_form is not None for w in [*matrices, model.lm_head])
    reference = copy.copy(model)
    reference.layers = [copy.copy(layer) for layer in model.layers]
    for layer in reference.layers:
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            setattr(layer, name, getattr(layer, name).dense())
    reference.lm_head = model.lm_head.dense()
    dense = Runtime.load(str(tiny_llama_hd64_dir), dtype="float32", device="cpu", weights="dense", isa="none",
                         keep_prepared=False).model

    ids = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(7))
    feed = torch.randint(0, 49152, (6,), generator=torch.Generator().manual_seed(8)).tolist()

    def run(m):
        logits, cache = prefill(m, ids, extra=len(feed))
        out = [logits]
        for token in feed:
            out.append(decode_step(m, cache, token).clone())
        return torch.stack(out)  # [7, V]

    got, want, unquantized = run(model), run(reference), run(dense)
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= 2 ** -5 * scale
    if weights == "int4":
        assert float((got - want).abs().max()) < 0.25 * float((unquantized - want).abs().max())
    assert bool((got.argmax(-1) == want.argmax(-1)).all())
