"""The layer loader's fused path (issue 28): stored chunks sent to the device as stored and dequantised, rotated and
cast by kernels/triton_load's kernel (on a GPU where there is one, else in Triton's interpreter on the CPU: conftest
sets TRITON_INTERPRET), against the same loader's torch path; and one blend through the engine with the model's
`triton` set."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvrag.kernels import triton_load
from kvrag.load.layer_work import ChunkRef, CorruptChunk
from kvrag.load.loader import open_loader
from kvrag.model.prefill import LayerKV
from kvrag.store.env import StoreEnv
from kvrag.store.kv import LocalKVTable

N_LAYERS, HKV, HD = 3, 2, 8
LENGTHS = (5, 11, 4)  # chunk 1 is Keyformer-reduced: it keeps the rows KEPT of its 11 tokens
KEPT = np.array([0, 1, 3, 4, 6, 9, 10], dtype=np.int32)
FIRST = 1000  # the chunks' first position in the prompt: rotary angles well past 2 pi
CPU = torch.device("cpu")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# on CUDA the torch path the fused one is held to rotates on the device only where the reader decodes
DECODES = ["thread"] if DEVICE.type == "cuda" else ["thread", "hand-over", "idle"]
INV_FREQ = (1.0 / 10000 ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD)).float()  # [hd/2]


@pytest.fixture(params=["fp16", "int8", "bf16"])
def stored(tmp_path, request):
    """A store of one codec with three chunks of random KV (outlier key channels, as pre-rotary keys have): chunk 1
    reduced and stored uncompressed (so that its arrays view the read-only value), the others compressed."""
    env = StoreEnv.open(tmp_path / "store", create=True)
    table = LocalKVTable(env, "model-fp", request.param)
    rng = np.random.default_rng(0)
    refs = []
    for n, length in enumerate(LENGTHS):
        ids = list(range(100 * n, 100 * n + length))
        kept = KEPT if n == 1 else None
        rows = length if kept is None else len(kept)
        scale = np.linspace(0.5, 8.0, HD, dtype=np.float32)
        layers = [((rng.standard_normal((rows, HKV, HD)) * scale).astype(np.float32),
                   rng.standard_normal((rows, HKV, HD)).astype(np.float32)) for _ in range(N_LAYERS)]
        table.compress = n != 1
        table.put_chunk(f"chunk{n}", ids, layers, kept)
        refs.append(ChunkRef(f"chunk{n}", ids, kept=kept))
    yield table, refs
    env.close()


def _positions(refs: list[ChunkRef]) -> torch.Tensor:
    """The chunk rows' absolute positions, chunks one after another from FIRST, a reduced chunk's with gaps: [C]."""
    out, at = [], FIRST
    for ref in refs:
        out.extend(at + j for j in (range(len(ref.token_ids)) if ref.kept is None else ref.kept.tolist()))
        at += len(ref.token_ids)
    return torch.tensor(out)


def _load(table, refs, dtype=torch.float32, decode=None, seen: dict | None = None,
          **rotation) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's (k, v) from the loader open_loader picks on DEVICE, brought to the CPU; `seen` gets its copies
    and launches."""
    loader = open_loader(table, refs, range(N_LAYERS), dtype, DEVICE, decode=decode, **rotation).start()
    try:
        return [(k.cpu(), v.cpu()) for k, v in (loader.layer(layer) for layer in range(N_LAYERS))]
    finally:
        loader.close()
        if seen is not None:
            seen.update(copies=getattr(loader, "copies", 0), launches=getattr(loader, "launches", 0))


def _key_bound(x: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """How far fused keys may be from torch's (kernels/triton_load's stated tolerance): 2^-22 (|x1| + |x2|) of the
    keys x [C, Hkv, hd] before rotary, plus one ulp of the float32 result."""
    half = x.shape[-1] // 2
    m = (x[..., :half].abs() + x[..., half:].abs()).repeat(1, 1, 2)  # [C, Hkv, hd]
    info = torch.finfo(torch.float32)
    return 2.0**-22 * m + info.eps * want.abs() + info.smallest_normal * info.eps


@pytest.fixture
def calls(monkeypatch) -> list[int]:
    """Counts the fused load's kernel launches (the real kernel runs)."""
    counted, real = [], triton_load.load_chunk
    monkeypatch.setattr(triton_load, "load_chunk", lambda *a, **k: counted.append(1) or real(*a, **k))
    return counted


@pytest.mark.parametrize("decode", DECODES)
def test_fused_layers_equal_the_torch_path(stored, calls, decode):
    """Every layer, fused against torch's rotation of the host decode: V bit-equal (int8 x scale is one float32
    product on either side), K within the kernel's tolerance, a memory tier's chunk rotated by torch in both."""
    table, refs = stored
    g = torch.Generator().manual_seed(1)
    memory = LayerKV([torch.randn(6, HKV, HD, generator=g).bfloat16() for _ in range(N_LAYERS)],
                     [torch.randn(6, HKV, HD, generator=g).bfloat16() for _ in range(N_LAYERS)], torch.arange(6))
    refs = refs[:2] + [ChunkRef("in-memory", list(range(6)), memory)] + refs[2:]
    rotation = dict(positions=_positions(refs), inv_freq=INV_FREQ)
    fused_loader = open_loader(table, refs, range(N_LAYERS), torch.float32, DEVICE, fused=True, **rotation)
    assert fused_loader.fused and fused_loader.rotated
    fused_loader.close()
    before = _load(table, refs, decode=decode)  # keys before rotary, as stored (dequantised on the host)
    want = _load(table, refs, decode=decode, fused=False, **rotation)
    seen = {}
    got = _load(table, refs, decode=decode, fused=True, seen=seen, **rotation)
    assert len(calls) == N_LAYERS  # one launch a layer, whatever the number of chunks
    assert seen == {"copies": N_LAYERS, "launches": N_LAYERS}  # and one copy of the staged layer to the device
    memory_rows = slice(12, 18)
    for (k, v), (want_k, want_v), (x, _) in zip(got, want, before, strict=True):
        assert k.dtype == v.dtype == torch.float32 and k.shape == want_k.shape
        assert torch.equal(v, want_v.float())
        assert torch.equal(k[memory_rows], want_k[memory_rows])
        diff, bound = (k - want_k).abs(), _key_bound(x.float(), want_k)
        assert bool((diff <= bound).all()), f"{int((diff > bound).sum())} keys past the bound, max {diff.max()}"
        assert not torch.equal(k, x.float())  # rotated, and far enough from the start for it to show


def test_a_bf16_model_gets_the_float32_load_rounded_once(stored, calls):
    """In a bf16 model the kernel rounds its float32 result once, to nearest even: the float32 load cast by torch."""
    table, refs = stored
    rotation = dict(positions=_positions(refs), inv_freq=INV_FREQ)
    wide = _load(table, refs, torch.float32, fused=True, **rotation)
    plain_v = [v for _, v in _load(table, refs, torch.bfloat16)]  # the host decode, before the consumer's cast
    for (k, v), (k32, _), want_v in zip(_load(table, refs, torch.bfloat16, fused=True, **rotation), wide, plain_v,
                                        strict=True):
        assert k.dtype == v.dtype == torch.bfloat16
        assert torch.equal(k.view(torch.int16), k32.bfloat16().view(torch.int16))
        assert torch.equal(v.view(torch.int16), want_v.bfloat16().view(torch.int16))


@pytest.mark.parametrize("decode", DECODES[:2])
def test_a_damaged_value_or_other_kept_tokens_are_refused_naming_the_chunk(stored, decode):
    table, refs = stored
    key = table.key("chunk2").layer(1).to_bytes()
    with table.env.env.begin(write=True, db=table.env.db("kv")) as txn:
        value = bytearray(txn.get(key))
        value[-3] ^= 0x10
        txn.put(key, bytes(value))
    with pytest.raises(CorruptChunk, match="chunk2"):  # at layer 1, the damaged one
        _load(table, refs, decode=decode, fused=True, positions=_positions(refs), inv_freq=INV_FREQ)
    other = [refs[0], ChunkRef("chunk1", refs[1].token_ids, kept=KEPT[1:]), refs[2]]
    with pytest.raises(CorruptChunk, match="chunk1.*same tokens"):
        _load(table, other, decode=decode, fused=True, positions=_positions(other), inv_freq=INV_FREQ)


def test_without_positions_or_the_interpreter_nothing_is_fused(stored, monkeypatch):
    """Keys left before rotary take today's path; unasked, only a GPU fuses; on the CPU, outside Triton's
    interpreter, asking is an error."""
    table, refs = stored
    assert not getattr(open_loader(table, refs, range(N_LAYERS), torch.float32, DEVICE, fused=True), "fused", False)
    for device in {CPU, DEVICE}:
        loader = open_loader(table, refs, range(N_LAYERS), torch.float32, device, positions=_positions(refs),
                             inv_freq=INV_FREQ)
        assert getattr(loader, "fused", False) == (device.type == "cuda")
        loader.close()
    monkeypatch.setattr("kvrag.kernels.triton_mode.interpreting", lambda: False)  # as outside the interpreter
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        open_loader(table, refs, range(N_LAYERS), torch.float32, CPU, fused=True, positions=_positions(refs),
                    inv_freq=INV_FREQ)


# ---- a whole blend -----------------------------------------------------------------------------------------------


def test_a_blend_with_the_fused_load_equals_the_torch_blend(tmp_path, tiny_llama_dir, invented_items, calls):
    """int8 chunks (every chunk loaded: int8 never makes the first one exact) blended at 0.3 with the model's
    `triton` set (the fused load, and Triton's rows attention) against the torch blend."""
    from kvrag.blend.config import BlendConfig
    from kvrag.engine.prefiller import Prefiller
    from kvrag.model.runtime import Runtime
    from kvrag.precompute.plain import chunk_kv, layers_to_numpy
    from kvrag.store.chunks import chunk_id_for

    runtime = Runtime.load(str(tiny_llama_dir), "float32", device=str(DEVICE))
    env = StoreEnv.open(tmp_path / "store", create=True)
    try:
        engine, table, chunks = Prefiller.open(runtime, env, codec="int8"), LocalKVTable(env, runtime.fingerprint, "int8"), []
        with torch.inference_mode():
            for ctx in invented_items[0]["ctxs"][:3]:
                ids = runtime.prompts.passage_ids("", " ".join(ctx["text"].split()[:40]))
                chunks.append((chunk_id_for(ids, runtime.local.tokenizer_fingerprint), ids))
                table.put_chunk(chunks[-1][0], ids, layers_to_numpy(chunk_kv(runtime, engine.preamble, ids)))
            question = "Who was the spouse of the performer?"
            triton = runtime.model.triton  # on by default on a GPU, off on the CPU
            try:
                runtime.model.triton = False
                want = engine.prefill(chunks, question, "blend", BlendConfig(0.3))
                assert not calls  # the torch blend (the CPU's default path) never fuses
                runtime.model.triton = True
                got = engine.prefill(chunks, question, "blend", BlendConfig(0.3))
            finally:
                runtime.model.triton = triton
    finally:
        env.close()
    assert calls, "the blend's chunks never reached the fused load kernel"
    assert len(calls) <= runtime.model.cfg.n_layers  # one launch a loaded layer, whatever the number of chunks
    assert got.recomputed_chunk_tokens == want.recomputed_chunk_tokens
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
