"""The layer loader against the store's own decoded values: wherever it decodes, whatever tier a chunk is in."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvrag.load.layer_work import ChunkRef, CorruptChunk
from kvrag.load.loader import LayerLoader, open_loader
from kvrag.model.prefill import LayerKV
from kvrag.store.env import StoreEnv
from kvrag.store.kv import LocalKVTable

N_LAYERS, HKV, HD = 3, 2, 8


@pytest.fixture(params=["zstd", "raw", "mixed"])
def table(tmp_path, request):
    """A store with three chunks of 5, 7 and 4 tokens of random fp16 KV: compressed, uncompressed, or both."""
    env = StoreEnv.open(tmp_path / "store", create=True)
    kv_table = LocalKVTable(env, "model-fp", "fp16")
    rng = np.random.default_rng(0)
    chunks = []
    for n, length in enumerate((5, 7, 4)):
        ids = list(range(100 * n, 100 * n + length))
        layers = [(rng.standard_normal((length, HKV, HD)).astype(np.float16),
                   rng.standard_normal((length, HKV, HD)).astype(np.float16)) for _ in range(N_LAYERS)]
        kv_table.compress = request.param == "zstd" or (request.param == "mixed" and n != 1)
        kv_table.put_chunk(f"chunk{n}", ids, layers)
        chunks.append((f"chunk{n}", ids))
    yield kv_table, chunks
    env.close()


def _expected(kv_table: LocalKVTable, chunks, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The store's own decode of every chunk, concatenated in prompt order: [C, Hkv, hd] each."""
    parts = [kv_table.get_layer(cid, layer, ids) for cid, ids in chunks]
    return (torch.from_numpy(np.concatenate([p.k for p in parts])),
            torch.from_numpy(np.concatenate([p.v for p in parts])))


def _bf16_in_memory(n_tokens: int, seed: int) -> LayerKV:
    """A chunk's KV as a memory tier holds it: random bf16, every layer."""
    g = torch.Generator().manual_seed(seed)
    return LayerKV([torch.randn(n_tokens, HKV, HD, generator=g).bfloat16() for _ in range(N_LAYERS)],
                   [torch.randn(n_tokens, HKV, HD, generator=g).bfloat16() for _ in range(N_LAYERS)],
                   torch.arange(n_tokens))


def _load_all(loader: LayerLoader) -> list[tuple[torch.Tensor, torch.Tensor]]:
    loader.start()
    try:
        return [loader.layer(layer) for layer in range(N_LAYERS)]
    finally:
        loader.close()


@pytest.mark.parametrize("decode", ["thread", "hand-over", "idle"])
def test_every_layer_equals_the_stored_values(table, decode):
    """Decoded in the loader's thread (CUDA's way), at hand-over over a pool, or ahead by an idle-priority thread
    with the consumer taking what is left (the CPU's ways): the same bytes."""
    kv_table, chunks = table
    refs = [ChunkRef(cid, ids) for cid, ids in chunks]
    loader = open_loader(kv_table, refs, range(N_LAYERS), torch.float32, torch.device("cpu"), decode=decode)
    for layer, (k, v) in enumerate(_load_all(loader)):
        want_k, want_v = _expected(kv_table, chunks, layer)
        # the CPU's loaders hand out the stored dtype (the consumer's copy casts); the staged one, the model's
        assert k.dtype == (torch.float32 if decode == "thread" else torch.float16)
        assert torch.equal(k, want_k.to(k.dtype)) and torch.equal(v, want_v.to(v.dtype))
    assert {kind for kind, *_ in loader.spans} - {"decode-ahead"} <= {"load", "decode"}
    assert "load" in {kind for kind, *_ in loader.spans} and loader.busy_s > 0


@pytest.mark.parametrize("idle_allowed", [True, False])
def test_idle_decoding_decodes_each_chunk_once_and_never_depends_on_the_decoder(table, monkeypatch, idle_allowed):
    """Decoder and consumer share each layer's chunks: each is decoded exactly once, and where the decoder may not
    lower its priority (it then stops, as it would slow the compute) the consumer decodes them all itself."""
    import os
    import threading

    if not idle_allowed:
        def refuse(*_):
            raise PermissionError("not allowed")
        monkeypatch.setattr(os, "sched_setscheduler", refuse, raising=False)
    decoded_by: dict[tuple[int, int], list[str]] = {}  # (layer, chunk) -> the threads that decoded it
    layer_of: dict[int, int] = {}  # id of a layer's fetched list -> the layer
    kept = []  # the fetched lists, alive so that their ids stay unique
    original_put, original_fetch = LayerLoader._put_numpy, LayerLoader._fetch

    def counting(self, fetched, i, k_out, v_out, shape):
        decoded_by.setdefault((layer_of[id(fetched)], i), []).append(threading.current_thread().name)
        original_put(self, fetched, i, k_out, v_out, shape)

    def remembering_fetch(self, layer):
        fetched = original_fetch(self, layer)
        kept.append(fetched)
        layer_of[id(fetched)] = layer
        return fetched

    monkeypatch.setattr(LayerLoader, "_put_numpy", counting)
    monkeypatch.setattr(LayerLoader, "_fetch", remembering_fetch)
    kv_table, chunks = table
    loader = LayerLoader(kv_table, [ChunkRef(cid, ids) for cid, ids in chunks], range(N_LAYERS), torch.float32,
                         torch.device("cpu"), decode="idle")
    for layer, (k, v) in enumerate(_load_all(loader)):
        want_k, want_v = _expected(kv_table, chunks, layer)
        assert torch.equal(k, want_k) and torch.equal(v, want_v)
    assert sorted(decoded_by) == [(layer, i) for layer in range(N_LAYERS) for i in range(len(chunks))]
    assert all(len(names) == 1 for names in decoded_by.values())
    if not idle_allowed:
        assert not any("kvrag-decoder" in names[0] for names in decoded_by.values())


def test_a_starved_idle_decoder_is_turned_off(table, monkeypatch):
    """A decoder that holds a chunk too long (as when other processes take every core) is paused: the load still
    completes with the stored values, and new loaders decode at hand-over for a while."""
    import threading
    import time

    from kvrag.load.layer_work import STARVED_WAIT_S, DecoderPause

    pause = DecoderPause()  # an engine's loaders share one
    original_put = LayerLoader._put_numpy

    def slow_in_the_decoder(self, *args):
        if threading.current_thread().name == "kvrag-decoder":
            time.sleep(5 * STARVED_WAIT_S)
        original_put(self, *args)

    monkeypatch.setattr(LayerLoader, "_put_numpy", slow_in_the_decoder)
    monkeypatch.setattr(LayerLoader, "_fetch", lambda self, layer, f=LayerLoader._fetch: (time.sleep(0.01), f(self, layer))[1])
    kv_table, chunks = table
    refs = [ChunkRef(cid, ids) for cid, ids in chunks]
    loader = LayerLoader(kv_table, refs, range(N_LAYERS), torch.float32, torch.device("cpu"), decode="idle",
                         pause=pause)
    loader.start()
    try:
        time.sleep(0.05)  # the decoder has begun a chunk of layer 0
        for layer in range(N_LAYERS):
            k, v = loader.layer(layer)
            want_k, want_v = _expected(kv_table, chunks, layer)
            assert torch.equal(k, want_k) and torch.equal(v, want_v)
    finally:
        loader.close()
    assert loader._decoder_off
    assert pause.active()
    assert LayerLoader(kv_table, refs, range(N_LAYERS), torch.float32, torch.device("cpu"),
                       pause=pause).decode == "hand-over"


@pytest.mark.parametrize("native", [True, False])
def test_a_bf16_model_gets_the_stored_values_rounded_as_torch_does(table, monkeypatch, native):
    """For a bf16 model on the CPU, fp16 values go to bf16 in the loader (one native pass where the kernel is
    built, else numpy and a torch cast): bit for bit torch's own cast of the store's decode, memory chunks exact."""
    from kvrag.kernels import fp16_to_bf16

    if native and not fp16_to_bf16.available():
        pytest.skip("needs kvrag's native kernels (x86-64 AVX-512 and a C++ compiler)")
    if not native:
        monkeypatch.setattr(fp16_to_bf16, "available", lambda: False)
    kv_table, chunks = table
    cid, ids = chunks[1]
    memory = _bf16_in_memory(len(ids), seed=2)
    refs = [ChunkRef(c, i, memory if c == cid else None) for c, i in chunks]
    loaded = _load_all(LayerLoader(kv_table, refs, range(N_LAYERS), torch.bfloat16, torch.device("cpu")))
    rows = slice(len(chunks[0][1]), len(chunks[0][1]) + len(ids))
    for layer, (k, v) in enumerate(loaded):
        want_k, want_v = _expected(kv_table, chunks, layer)
        want_k[rows], want_v[rows] = memory.k[layer].float(), memory.v[layer].float()
        got_k, got_v = k.to(torch.bfloat16), v.to(torch.bfloat16)  # the consumer's copy casts, if still needed
        assert torch.equal(got_k.view(torch.int16), want_k.to(torch.bfloat16).view(torch.int16))
        assert torch.equal(got_v.view(torch.int16), want_v.to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("dtype,native", [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, False)])
@pytest.mark.parametrize("decode", ["thread", "idle"])
def test_keys_come_rotated_to_their_positions_given_the_angles(table, monkeypatch, dtype, native, decode):
    """Given the rows' rotary angles, every key (stored or from memory; rotated by the native pass or by torch at
    hand-over) is bit for bit rotary.rotate of the key it would hand out before rotary; values are untouched."""
    from kvrag.kernels import fp16_to_bf16
    from kvrag.model import rotary

    if native and not fp16_to_bf16.available():
        pytest.skip("needs kvrag's native kernels (x86-64 AVX-512 and a C++ compiler)")
    if not native:
        monkeypatch.setattr(fp16_to_bf16, "available", lambda: False)
    kv_table, chunks = table
    memory = _bf16_in_memory(len(chunks[1][1]), seed=3)
    refs = [ChunkRef(c, i, memory if n == 1 else None) for n, (c, i) in enumerate(chunks)]
    n_rows = sum(len(i) for _, i in chunks)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HD, 2, dtype=torch.float32) / HD))
    rope = rotary.cos_sin(inv_freq, torch.arange(40, 40 + n_rows), dtype)  # rows placed after a 40-token preamble
    cpu = torch.device("cpu")
    plain = _load_all(open_loader(kv_table, refs, range(N_LAYERS), dtype, cpu, decode=decode))
    loader = open_loader(kv_table, refs, range(N_LAYERS), dtype, cpu, decode=decode, rope=rope)
    assert loader.rotated
    for (k, v), (k_plain, v_plain) in zip(_load_all(loader), plain, strict=True):
        want = rotary.rotate(k_plain.to(dtype), *rope)
        assert k.dtype == dtype and torch.equal(k.view(torch.int16), want.view(torch.int16))
        assert torch.equal(v, v_plain)


def test_chunks_in_memory_and_in_the_store_mix_exactly(table):
    """A bf16 chunk from a memory tier first, stored fp16 ones after it: staged in float32, exact for both
    (staged in the first chunk's bf16, the stored values would lose three mantissa bits)."""
    kv_table, chunks = table
    cid, ids = chunks[0]
    memory = _bf16_in_memory(len(ids), seed=1)
    refs = [ChunkRef(cid, ids, memory)] + [ChunkRef(c, i) for c, i in chunks[1:]]
    loaded = _load_all(LayerLoader(kv_table, refs, range(N_LAYERS), torch.float32, torch.device("cpu")))
    rows = slice(0, len(ids))
    for layer, (k, v) in enumerate(loaded):
        want_k, want_v = _expected(kv_table, chunks, layer)
        want_k[rows], want_v[rows] = memory.k[layer].float(), memory.v[layer].float()
        assert k.dtype == torch.float32
        assert torch.equal(k, want_k) and torch.equal(v, want_v)


@pytest.mark.parametrize("decode", ["hand-over", "idle"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_damaged_value_is_refused_at_hand_over(table, dtype, decode):
    """The CPU paths decode in the consumer or an idle-priority thread (for bf16, natively where it can): the
    checksum failure must still name the chunk, never pass."""
    kv_table, chunks = table
    key = kv_table.key("chunk2").layer(1).to_bytes()
    env = kv_table.env
    with env.env.begin(write=True, db=env.db("kv")) as txn:
        value = bytearray(txn.get(key))
        value[-3] ^= 0x10
        txn.put(key, bytes(value))
    loader = LayerLoader(kv_table, [ChunkRef(cid, ids) for cid, ids in chunks], range(N_LAYERS), dtype,
                         torch.device("cpu"), decode=decode).start()
    try:
        loader.layer(0)
        with pytest.raises(CorruptChunk, match="chunk2"):
            loader.layer(1)
    finally:
        loader.close()
