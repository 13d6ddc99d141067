"""The Triton kernels inside the engine (issue 28): a blend and a batched decode through them against the torch paths
they replace, on the CPU under TRITON_INTERPRET (conftest sets it without a GPU); and, marked `cuda`, the whole
`ask` and the server on a GPU, which skip without one."""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager

import pytest
import torch

from kvrag.blend.config import BlendConfig
from kvrag.engine.batch_decode import BatchDecoder
from kvrag.engine.kv_pool import SequenceKV
from kvrag.engine.prefiller import Prefiller
from kvrag.kernels import triton_attention
from kvrag.model.prefill import prefill
from kvrag.model.runtime import Runtime
from kvrag.precompute.plain import chunk_kv, layers_to_numpy
from kvrag.store.chunks import chunk_id_for
from kvrag.store.env import StoreEnv
from kvrag.store.kv import LocalKVTable
from kvrag.tests.tier_invariants import check_invariants

QUESTION = "Who was the spouse of the performer?"
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels compiled there, else interpreted here


@pytest.fixture(scope="module")
def runtime(tiny_llama_dir) -> Runtime:
    return Runtime.load(str(tiny_llama_dir), "float32", device=DEVICE, kernels="torch")  # triton_on turns it on


@contextmanager
def triton_on(model, monkeypatch, kernel: str):
    """The model's attention through Triton, counting the kernel's calls (the real kernel runs)."""
    calls = []
    real = getattr(triton_attention, kernel)
    monkeypatch.setattr(triton_attention, kernel, lambda *a, **k: calls.append(1) or real(*a, **k))
    model.triton = True
    try:
        yield calls
    finally:
        model.triton = False


@pytest.fixture
def stored(tmp_path, runtime, invented_items):
    env = StoreEnv.open(tmp_path / "store", create=True)
    engine = Prefiller.open(runtime, env)
    table = LocalKVTable(env, runtime.fingerprint, "fp16")
    chunks = []
    for ctx in invented_items[0]["ctxs"][:4]:
        ids = runtime.prompts.passage_ids("", " ".join(ctx["text"].split()[:50]))
        chunks.append((chunk_id_for(ids, runtime.local.tokenizer_fingerprint), ids))
        with torch.inference_mode():
            table.put_chunk(chunks[-1][0], ids, layers_to_numpy(chunk_kv(runtime, engine.preamble, ids)))
    yield engine, chunks
    env.close()


def test_a_blend_through_the_triton_rows_kernel_equals_the_torch_blend(stored, runtime, monkeypatch):
    engine, chunks = stored
    with torch.inference_mode():
        want = {r: engine.prefill(chunks, QUESTION, "blend", BlendConfig(r)) for r in (0.15, 1.0)}
        full = engine.prefill(chunks, QUESTION, "full")
        with triton_on(runtime.model, monkeypatch, "rows_attention") as calls:
            got = {r: engine.prefill(chunks, QUESTION, "blend", BlendConfig(r)) for r in (0.15, 1.0)}
    assert calls, "the blend's scattered rows never reached the Triton kernel"
    for r in want:
        assert got[r].recomputed_chunk_tokens == want[r].recomputed_chunk_tokens
        torch.testing.assert_close(got[r].logits, want[r].logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1.0].logits, full.logits, rtol=1e-4, atol=2e-4)  # ratio 1 is a full prefill


def test_a_batched_decode_through_the_triton_decode_kernel_equals_the_torch_step(runtime, monkeypatch):
    """Three sequences of 5, 19 and 40 prompt tokens decode 6 steps together over a pool of 8-token blocks."""
    model, steps = runtime.model, 6
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=g).to(DEVICE) for n in (5, 19, 40)]
    feeds = torch.randint(0, model.cfg.vocab_size, (len(prompts), steps), generator=g)

    def run() -> list[torch.Tensor]:
        kv = SequenceKV(model, budget_bytes=64 * 8 * model.cfg.n_layers * 2 * model.cfg.n_kv_heads
                        * model.cfg.head_dim * 4, block_size=8)
        with torch.inference_mode():
            tables = [kv.admit(prefill(model, ids, extra=steps)[1], len(ids)) for ids in prompts]
            decoder, out = BatchDecoder(model, kv, 64, native=False), []
            for j in range(steps):
                for t in tables:
                    kv.grow(t)
                out.append(decoder.step(feeds[:, j].tolist(), tables))
        return out

    want = run()
    with triton_on(model, monkeypatch, "decode_attention") as calls:
        got = run()
    assert len(calls) == steps * model.cfg.n_layers
    for g_step, w_step in zip(got, want, strict=True):
        torch.testing.assert_close(g_step, w_step, rtol=1e-4, atol=1e-4)


# ---- on a GPU (skip without one) -------------------------------------------------------------------------------


@cuda
@pytest.mark.cuda
def test_ask_on_the_gpu_blends_at_ratio_one_as_a_full_prefill(kvrag, indexed_store, tiny_llama_dir, tmp_path):
    """In float32, where the rows kernel does its dots at IEEE precision: in bfloat16 the full prefill (SDPA's flash
    kernel) and the blend (the rows kernel) round differently, and a random model's flat logits flip a near-tie (the
    first GPU check, 2026-11-28, diverged at token 7)."""
    store = tmp_path / "store"
    shutil.copytree(indexed_store, store)
    args = ("ask", "Where does the Nile flow?", "--store", str(store), "--model", str(tiny_llama_dir), "--json",
            "--max-tokens", "12", "--device", "cuda", "--dtype", "float32")
    full = json.loads(kvrag(*args, "--mode", "full").stdout)
    blend = json.loads(kvrag(*args, "--ratio", "1.0").stdout)
    again = json.loads(kvrag(*args, "--ratio", "0.15").stdout)
    assert blend["token_ids"] == full["token_ids"]
    assert again["computed_chunks"] == [] and again["bytes_loaded"] > 0  # the second ask loads what the first stored


@cuda
@pytest.mark.cuda
def test_the_server_on_the_gpu_answers_as_kvrag_ask(indexed_store, tiny_llama_dir, tmp_path):
    """A real uvicorn server on 127.0.0.1 over a GPU engine (Triton decode over the paged pool), the real openai
    client, against KVRag.ask on the same engine."""
    import openai

    from kvrag import KVRag
    from kvrag.server.app import ServerSettings
    from kvrag.server.run import BackgroundServer

    shutil.copytree(indexed_store, tmp_path / "store")
    question = "How deep is Lake Baikal?"
    with KVRag(tmp_path / "store", model=str(tiny_llama_dir), device="cuda", host_cache="0") as rag:
        assert rag.runtime.model.triton
        reference = rag.ask(question, k=2, max_tokens=16)
        with BackgroundServer(rag, ServerSettings("tiny")) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
            replies = [client.chat.completions.create(model="tiny", max_tokens=16, extra_body={"k": 2},
                                                      messages=[{"role": "user", "content": question}])
                       for _ in range(2)]
    assert [r.choices[0].message.content for r in replies] == [reference.text] * 2


@cuda
@pytest.mark.cuda
def test_the_gpu_tier_swaps_out_once_and_serves_as_the_store_does(tiny_llama_dir, invented_items, tmp_path):
    """The memory tiers on a GPU: a GPU budget of about a third of five chunks' KV over a host tier; four chunks go
    to the GPU, the overflow swaps out to host (each node once), and a question over all five reads them from memory
    and gives the logits of an engine without tiers. Its first chunk is one never asked: a chunk asked alone is an
    exact path of depth 1, reused without recompute, which the plain engine would recompute (as on the CPU,
    tests/test_engine_tiers.py)."""
    from kvrag.engine.memory import build_cache

    runtime = Runtime.load(str(tiny_llama_dir), "float32", device="cuda")
    env = StoreEnv.open(tmp_path / "store", create=True)
    plain = Prefiller.open(runtime, env)
    table, chunks = LocalKVTable(env, runtime.fingerprint, "fp16"), []
    for ctx in invented_items[1]["ctxs"][:5]:
        ids = runtime.prompts.passage_ids("", " ".join(ctx["text"].split()[:40]))
        chunks.append((chunk_id_for(ids, runtime.local.tokenizer_fingerprint), ids))
        with torch.inference_mode():
            table.put_chunk(chunks[-1][0], ids, layers_to_numpy(chunk_kv(runtime, plain.preamble, ids)))
    c = runtime.model.cfg
    per_token = c.n_layers * 2 * c.n_kv_heads * c.head_dim * 2
    gpu_bytes = per_token * sum(len(ids) for _, ids in chunks) // 3
    tiered = Prefiller.open(runtime, env, cache=build_cache(runtime, "fp16", host_cache="64MiB", gpu_cache=str(gpu_bytes)))
    config = BlendConfig(attention_weight=0)
    with torch.inference_mode():
        for chunk in chunks[1:]:  # one chunk a question: each lands in the GPU tier, the oldest swap out to host
            tiered.prefill([chunk], QUESTION, "blend", config)
            tiered.flush_write_back()
        second = tiered.prefill(chunks, "Where was the performer born?", "blend", config)
        reference = plain.prefill(chunks, "Where was the performer born?", "blend", config)
    stats = tiered.source.cache.stats
    assert stats.swap_outs > 0 and tiered.source.cache.used_bytes("gpu") > 0
    assert second.chunk_tiers[0] == "store" and set(second.chunk_tiers[1:]) <= {"gpu", "host"}
    assert "gpu" in second.chunk_tiers and second.recomputed_chunk_tokens == reference.recomputed_chunk_tokens
    torch.testing.assert_close(second.logits, reference.logits, rtol=1e-3, atol=2e-3)
    check_invariants(tiered.source.cache)
    env.close()
