"""The engine reading through the memory tiers: exact reuse of a matched path, stored KV from memory,
and the same logits as the engine without tiers (the reference)."""

from __future__ import annotations

import pytest
import torch

from kvrag.blend.config import BlendConfig
from kvrag.engine.memory import build_cache
from kvrag.engine.prefiller import Prefiller
from kvrag.model.runtime import Runtime
from kvrag.precompute.plain import chunk_kv, layers_to_numpy
from kvrag.store.chunks import chunk_id_for
from kvrag.store.env import StoreEnv
from kvrag.store.kv import LocalKVTable
from kvrag.tests.tier_invariants import check_invariants

Q1 = "Who was the spouse of the performer?"
Q2 = "When was the company founded?"


@pytest.fixture(scope="module")
def runtime(tiny_llama_dir) -> Runtime:
    return Runtime.load(str(tiny_llama_dir), "float32")


@pytest.fixture
def setup(tmp_path, runtime, invented_items):
    env = StoreEnv.open(tmp_path / "store", create=True)
    plain = Prefiller.open(runtime, env)
    chunks = []
    for ctx in invented_items[1]["ctxs"][:5]:
        ids = runtime.prompts.passage_ids("", " ".join(ctx["text"].split()[:40]))
        chunks.append((chunk_id_for(ids, runtime.local.tokenizer_fingerprint), ids))
    table = LocalKVTable(env, runtime.fingerprint, "fp16")
    with torch.inference_mode():
        for chunk_id, ids in chunks:
            table.put_chunk(chunk_id, ids, layers_to_numpy(chunk_kv(runtime, plain.preamble, ids)))
    tiered = Prefiller.open(runtime, env, cache=build_cache(runtime, "fp16", host_cache="64MiB", policy="pgdsf"))
    yield plain, tiered, chunks
    env.close()


# Selection by deviation alone: the chunk rows' blended KV is then a function of the chunks only. Weighted
# by the suffix's attention (the default), a reused path holds the KV blended for the question that cached it.
QUESTION_FREE = BlendConfig(attention_weight=0)


def _ask(engine: Prefiller, chunks, question: str, mode: str = "blend"):
    out = engine.prefill(chunks, question, mode, QUESTION_FREE)
    engine.flush_write_back()  # what tests/reference_answer.py does after decoding: fills the tiers
    return out


def test_a_matched_path_is_reused_exactly(setup):
    """Chunk rows' blended KV does not depend on the question (causal, selection by deviation), so the second question over
    the same chunks reuses the whole path, recomputes no chunk token, and gets the logits a fresh
    blend would give."""
    plain, tiered, chunks = setup
    first = _ask(tiered, chunks, Q1)
    assert first.chunk_tiers == ["store"] * len(chunks)
    second = _ask(tiered, chunks, Q2)
    assert second.chunk_tiers == ["tree"] * len(chunks)
    assert second.recomputed_chunk_tokens == 0 and second.bytes_loaded == 0
    reference = plain.prefill(chunks, Q2, "blend", QUESTION_FREE)
    torch.testing.assert_close(second.logits, reference.logits, rtol=1e-3, atol=2e-3)
    n = reference.prompt_tokens
    assert second.prompt_tokens == n
    torch.testing.assert_close(second.cache.v[:, :n], reference.cache.v[:, :n], rtol=1e-3, atol=2e-3)
    stats = tiered.source.cache.stats
    assert stats.requests == 2 and stats.prefix_hits == len(chunks)
    check_invariants(tiered.source.cache)


def test_stored_kv_comes_from_memory_below_the_first_miss(setup):
    """After one question, every chunk's stored KV is in host memory: a prompt that starts with a chunk
    never seen misses the tree at once, reads only that chunk from the store, takes the others' stored
    KV from memory, and matches the engine without tiers."""
    plain, tiered, chunks = setup
    _ask(tiered, chunks[:4], Q1)
    reordered = [chunks[4], *chunks[:4][::-1]]
    out = _ask(tiered, reordered, Q2)
    assert out.chunk_tiers == ["store"] + ["host"] * 4
    reference = plain.prefill(reordered, Q2, "blend", QUESTION_FREE)
    torch.testing.assert_close(out.logits, reference.logits, rtol=1e-3, atol=2e-3)
    assert out.recomputed_chunk_tokens == reference.recomputed_chunk_tokens
    # a stored chunk is an exact depth-1 path: a prompt that starts with it reuses it without recompute
    again = _ask(tiered, [chunks[2], chunks[0]], Q1)
    assert again.chunk_tiers == ["tree", "host"]
    check_invariants(tiered.source.cache)


def test_a_cache_too_small_for_anything_still_answers_right(setup, runtime):
    plain, _, chunks = setup
    tiny = Prefiller.open(runtime, plain.source.env, cache=build_cache(runtime, "fp16", host_cache="1KiB"))
    for question in (Q1, Q2):
        out = _ask(tiny, chunks, question)
        torch.testing.assert_close(out.logits, plain.prefill(chunks, question, "blend", QUESTION_FREE).logits)
    assert tiny.source.cache.used_bytes() == 0 and tiny.source.cache.stats.not_inserted > 0


def test_ratio_one_never_reads_an_earlier_blends_path(setup):
    """A blend at ratio 1 is full prefill by definition: after blends at 0.15 have cached their chunks' rows as they
    stood (the knowledge tree), a ratio-1 prompt sharing its leading chunks still gives full prefill's logits. It used
    to take the matched path's blended rows as its exact prefix."""
    plain, tiered, chunks = setup
    for question in (Q1, Q2):
        _ask(tiered, chunks[:3], question)  # the tree now holds chunks 0-2's path as blended
    prompt = [*chunks[:2], chunks[4]]
    full = plain.prefill(prompt, Q1, "full").logits
    whole = tiered.prefill(prompt, Q1, "blend", BlendConfig(ratio=1.0, attention_weight=0))
    torch.testing.assert_close(whole.logits, full, rtol=1e-4, atol=1e-4)
    assert whole.recomputed_chunk_tokens == sum(len(ids) for _, ids in prompt)
