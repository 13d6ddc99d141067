"""Stored passages found inside a client's own prompt (store/passage_index.py, engine/prompt_reuse.py), blended
against a full prefill of the same prompt; the prefix cache over plain prompts' heads."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from kvrag.engine.llm_engine import EngineConfig, LLMEngine
from kvrag.model.sampling import SamplingConfig
from kvrag.precompute.plain import chunk_kv
from kvrag.store.chunks import ChunkRecord, ChunkTable
from kvrag.store.env import StoreEnv
from kvrag.store.kv import LocalKVTable
from kvrag.store.passage_index import MIN_SPAN, PassageIndex
from kvrag.tests.passages import OTHER_TASK
from kvrag.tests.passages import client_prompt as _client_prompt
from kvrag.tests.passages import plain_request as _request
from kvrag.tests.passages import run_to_end as _run

# ---- the index, on hand-made ids ----------------------------------------------------------------------------


def _ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 40000, n).tolist()


def test_spans_found_wherever_they_stand_and_cut_at_differing_ids():
    a, b, c = _ids(1, 120), _ids(2, 90), _ids(3, 200)
    index = PassageIndex()
    for name, ids in (("a", a), ("b", b), ("c", c)):
        index.add(name, ids)
    # b trimmed by 5 ids at its start (a client's template merged them), then some text, then a whole,
    # c missing, then c's middle (a client cut it)
    prompt = [7, 8, 9] + b[5:] + [11] * 20 + a + [12, 13] + c[40:150] + [14, 15]
    spans = index.find(prompt)
    assert [(s.chunk_id, s.offset, s.length) for s in spans] == [("b", 5, 85), ("a", 0, 120), ("c", 40, 110)]
    for s in spans:  # each span is the stored chunk's ids, exactly
        stored = {"a": a, "b": b, "c": c}[s.chunk_id]
        assert prompt[s.start:s.end] == stored[s.offset:s.offset + s.length]


def test_a_changed_id_inside_a_passage_splits_it_and_short_runs_are_not_reused():
    a = _ids(4, 150)
    index = PassageIndex()
    index.add("a", a)
    changed = a[:70] + [5] + a[71:]
    assert [(s.offset, s.length) for s in index.find(changed)] == [(0, 70), (71, 79)]
    assert index.find(a[:MIN_SPAN - 1]) == []


def test_indexing_in_batches_finds_what_indexing_one_by_one_finds():
    chunks = [(f"c{i}", _ids(10 + i, 40 + 37 * i), "" if i % 3 else "alice") for i in range(12)]
    one, many = PassageIndex(), PassageIndex()
    for chunk_id, ids, salt in chunks:
        one.add(chunk_id, ids, salt)
    many.add_many(chunks, batch=5)
    prompt = [1] * 5 + chunks[4][1][3:] + [2] * 9 + chunks[0][1] + chunks[9][1][:60] + chunks[11][1]
    for salt in ("", "alice"):
        assert many.find(prompt, salt) == one.find(prompt, salt) != []


def test_a_salted_passage_is_seen_by_its_own_salt_alone():
    a, b = _ids(5, 100), _ids(6, 100)
    index = PassageIndex()
    index.add("corpus", a)
    index.add("mine", b, salt="alice")
    prompt = a + [1, 2, 3] + b
    assert [s.chunk_id for s in index.find(prompt, "alice")] == ["corpus", "mine"]
    assert [s.chunk_id for s in index.find(prompt, "bob")] == ["corpus"]
    assert [s.chunk_id for s in index.find(prompt)] == ["corpus"]


# ---- the engine: a client's template over stored chunks, against a full prefill -------------------------------


def test_a_client_prompt_reuses_its_stored_passages_and_ratio_one_is_full_prefill(corpus):
    env, prefiller, texts = corpus
    engine = LLMEngine(prefiller, EngineConfig(kv_budget_bytes=64 << 20))
    question = _client_prompt([texts[2], texts[0], texts[3]])  # in a new order, one not precomputed yet
    # the reference on an engine of its own: its head would be an exact prefix for the next prompts here
    full = _run(LLMEngine(prefiller, EngineConfig(kv_budget_bytes=64 << 20)), _request(question, mode="full"))
    whole = _run(engine, _request(question, ratio=1.0))
    plan = whole.plan
    assert [p.chunk_id is None for p in plan.pieces] == [False, True, False, True, False]  # texts, separators
    assert sum(len(ids) for _, ids in plan.chunks) + len(plan.head) + len(plan.tail) == full.prompt_tokens
    torch.testing.assert_close(whole.first_logits, full.first_logits, rtol=1e-4, atol=2e-4)
    assert whole.output == full.output
    blended = _run(LLMEngine(prefiller, EngineConfig(kv_budget_bytes=64 << 20)), _request(question))
    stored = sum(len(ids) for (_, ids), p in zip(plan.chunks, plan.pieces, strict=True) if p.chunk_id)
    # most stored rows reused; the separators between the passages and the question computed
    assert stored * 0.7 < blended.reused_tokens - blended.head_reused <= stored
    assert blended.prefill_info["reused_tokens"] == blended.reused_tokens
    # an exact repeat: the prompt up to its last block is an exact prefix now, and only the rest is computed
    repeat = _run(engine, _request(question))
    assert repeat.plan.pieces is None and repeat.head_reused >= full.prompt_tokens - 16
    torch.testing.assert_close(repeat.first_logits, full.first_logits, rtol=1e-4, atol=2e-4)


def test_the_prompts_own_text_is_computed_at_every_layer(corpus):
    """With ratio 0 the stored rows are reused as loaded, and the text between them (separators, tags) computed: the
    same prompt with a separator changed gives the logits a full prefill of it gives only where they are computed."""
    env, prefiller, texts = corpus
    engine = LLMEngine(prefiller, EngineConfig(kv_budget_bytes=64 << 20))
    reuse = _run(engine, _request(_client_prompt(texts[:2]), mode="reuse"))
    assert reuse.prefill_info["recomputed_chunk_tokens"] == sum(
        len(ids) for (_, ids), p in zip(reuse.plan.chunks, reuse.plan.pieces, strict=True) if p.chunk_id is None)


def test_a_repeated_system_prompt_is_served_from_the_prefix_cache(corpus):
    env, prefiller, _ = corpus
    engine = LLMEngine(prefiller, EngineConfig(kv_budget_bytes=64 << 20))
    system = ("You are a careful assistant for the harbour archive. Answer in one sentence, cite nothing, and say "
              "so when you do not know. ") * 3
    first = _run(engine, _request("Who kept the light?", history=(("system", system),)))
    second = _run(engine, _request("When was it built?", history=(("system", system),)))
    system_ids = len(engine.planner.chat.plain_ids((("system", system),), "x"))
    assert first.head_reused == 0
    assert second.head_reused >= system_ids - 32  # every whole block the two prompts share
    # the reference computes every row (the system prompt, seen twice, is now also a kept passage: not reused here)
    alone = _run(LLMEngine(prefiller, EngineConfig(kv_budget_bytes=64 << 20, chat_cache_bytes=0, prompt_spans=False)),
                 _request("When was it built?", history=(("system", system),)))
    torch.testing.assert_close(second.first_logits, alone.first_logits, rtol=1e-4, atol=2e-4)
    other = _run(engine, _request("When was it built?", history=(("system", system),), salt="tenant-b"))
    assert other.head_reused == 0  # another tenant's cache: nothing shared


def test_a_new_passage_is_kept_at_its_second_sighting_for_its_own_tenant(corpus, invented_items):
    """Passages the store lacks: stored at the second sighting that computes them (not the first: one-off prompts
    never flood the store; nor a repeat the prefix cache serves), a hit at the third, for the same salt alone; the
    kept passage's KV is what precompute computes."""
    env, prefiller, _ = corpus
    engine = LLMEngine(prefiller, EngineConfig(kv_budget_bytes=64 << 20))
    new = [" ".join(ctx["text"].split()[:60]) for ctx in invented_items[1]["ctxs"][:2]]
    prompt = _client_prompt(new)

    def stored_spans(seq) -> int:
        return 0 if seq.plan.pieces is None else sum(p.chunk_id is not None for p in seq.plan.pieces)

    first = _run(engine, _request(prompt, salt="alice"))
    assert stored_spans(first) == 0 and engine.keeper.stats.admitted == 0
    repeat = _run(engine, _request(prompt, salt="alice"))  # the prefix cache serves it: no passage computed again
    assert repeat.head_reused > 0 and engine.keeper.stats.sighted == 2 and engine.keeper.stats.admitted == 0
    second = _run(engine, _request(_client_prompt(new, task=OTHER_TASK), salt="alice"))  # another app's template
    assert stored_spans(second) == 0 and engine.keeper.stats.admitted == 2
    # in a new order (the same order again is an exact prefix hit: the prefix cache serves it before any span)
    third = _run(engine, _request(_client_prompt(new[::-1]), salt="alice"))
    assert stored_spans(third) == 2
    bob = _run(engine, _request(_client_prompt(new[::-1]), salt="bob"))
    assert bob.plan.pieces is None and bob.head_reused == 0  # bob's prompts see none of alice's
    table = LocalKVTable(env, prefiller.runtime.fingerprint, "fp16")
    kept = [r for r in ChunkTable(env).iter() if r.doc_id == "client:alice"]
    assert len(kept) == 2
    for record in kept:
        with torch.inference_mode():
            expected = chunk_kv(prefiller.runtime, prefiller.preamble, record.token_ids)
        got = table.get_layer(record.chunk_id, 1, expect_token_ids=record.token_ids)
        torch.testing.assert_close(torch.from_numpy(got.k).float(), expected.k[1].float(), rtol=1e-2, atol=1e-2)


def test_chunks_indexed_after_the_first_prompt_are_found(tmp_path):
    """The passage index reads the chunk table again when it has grown (a `kvrag index` while the server runs)."""
    from kvrag.engine.prompt_reuse import PromptSpans

    env = StoreEnv.open(tmp_path / "store", create=True)
    a = tuple(_ids(7, 80))
    spans = PromptSpans(env)
    assert spans.find([1, 2, *a, 3]) == []
    ChunkTable(env).put_records([ChunkRecord("ab" * 16, "d", "", "text", 0, 4, a)])
    assert [(s.chunk_id, s.start, s.length) for s in spans.find([1, 2, *a, 3])] == [("ab" * 16, 2, 80)]
    env.close()


def test_a_closed_index_reads_the_store_no_more(tmp_path):
    """KVRag.close closes the passage index before the store: a fill still to come (its thread started beside the
    model's load) returns without touching the closed store, where it used to raise in that thread."""
    from kvrag.engine.prompt_reuse import PromptSpans

    env = StoreEnv.open(tmp_path / "store", create=True)
    a = tuple(_ids(7, 80))
    ChunkTable(env).put_records([ChunkRecord("ab" * 16, "d", "", "text", 0, 4, a)])
    spans = PromptSpans(env)
    spans.close()
    env.close()
    spans.fill()  # the store is closed: this would raise had the index not been closed first
    assert spans.find([1, 2, *a, 3]) == []


def test_an_exact_repeat_queued_behind_its_original_is_a_prefix_hit(corpus):
    """Both planned before either is prefilled: the repeat is cut again at its prefill, when the original's blocks
    are in the prefix cache, and computes its last block's rows alone."""
    env, prefiller, texts = corpus
    engine = LLMEngine(prefiller, EngineConfig(kv_budget_bytes=64 << 20))
    question = _client_prompt(texts[:3])
    first, repeat = engine.add(_request(question)), engine.add(_request(question))
    while not (first.done.is_set() and repeat.done.is_set()):
        engine.step()
    assert first.head_reused == 0 and repeat.plan.pieces is None
    assert repeat.head_reused >= repeat.prompt_tokens - 16
    assert repeat.output == first.output


def test_full_and_ratio_one_after_a_blend_take_no_blended_rows(corpus):
    """A blend leaves its prompt's blocks in the prefix cache marked blended: a blend of the same prompt takes them,
    while `mode: full` and ratio 1 take only the exact head before the first stored passage, and match a full
    prefill on an engine of their own."""
    env, prefiller, texts = corpus
    question = _client_prompt(texts[:3])
    fresh = _run(LLMEngine(prefiller, EngineConfig(kv_budget_bytes=64 << 20)), _request(question, mode="full"))
    for request in (_request(question, mode="full"), _request(question, ratio=1.0)):
        engine = LLMEngine(prefiller, EngineConfig(kv_budget_bytes=64 << 20))
        blend = _run(engine, _request(question))
        first_span = len(blend.plan.head)  # the rows before the first stored passage: computed exactly
        repeat = _run(engine, _request(question))
        assert repeat.head_reused >= repeat.prompt_tokens - 16  # a blend takes the blended blocks, and says so
        assert repeat.blended_cached_tokens == repeat.head_reused - first_span // 16 * 16
        torch.testing.assert_close(repeat.first_logits, blend.first_logits, rtol=1e-4, atol=2e-4)
        exact = _run(engine, request)
        assert 0 < exact.head_reused <= first_span and exact.blended_cached_tokens == 0
        torch.testing.assert_close(exact.first_logits, fresh.first_logits, rtol=1e-4, atol=2e-4)
        assert exact.output == fresh.output
        # its exact blocks replace the blended ones: the next full prefill is a prefix hit
        again = _run(engine, _request(question, mode="full"))
        assert again.head_reused >= again.prompt_tokens - 16
        torch.testing.assert_close(again.first_logits, fresh.first_logits, rtol=1e-4, atol=2e-4)


def test_mode_full_computes_each_row_once(corpus, monkeypatch):
    """A plain prompt whose head the prefix cache holds in part: `mode: full` computes every other row in one pass,
    none twice (it extended the head and then prefilled the whole prompt again)."""
    env, prefiller, _ = corpus
    engine = LLMEngine(prefiller, EngineConfig(kv_budget_bytes=64 << 20, prompt_spans=False))
    system = ("You are a careful assistant for the harbour archive. Answer in one sentence, cite nothing, and say "
              "so when you do not know. ") * 3
    _run(engine, _request("Who kept the light?", mode="full", history=(("system", system),)))
    model, embedded = prefiller.runtime.model, []
    embed = model.embed
    monkeypatch.setattr(model, "embed", lambda ids: embedded.append(int(ids.shape[0])) or embed(ids))
    second = _run(engine, _request("And when was the lighthouse built, and by whom?", mode="full",
                                   history=(("system", system),)))
    prompt_rows = sum(embedded[:-3])  # the last three: one row each, the decode steps after the first token
    assert embedded[-3:] == [1, 1, 1]
    assert second.head_reused > 0 and prompt_rows == second.prompt_tokens - second.head_reused
    assert second.prefill_info["reused_tokens"] == second.head_reused
    alone = _run(LLMEngine(prefiller, EngineConfig(kv_budget_bytes=64 << 20, chat_cache_bytes=0, prompt_spans=False)),
                 _request("And when was the lighthouse built, and by whom?", mode="full",
                          history=(("system", system),)))
    torch.testing.assert_close(second.first_logits, alone.first_logits, rtol=1e-4, atol=2e-4)


def test_an_exact_repeat_takes_its_blocks_from_the_pool_and_copies_only_its_last_rows(corpus):
    """The prefix cache is the pool: a repeat's table starts with the blocks the first prompt left, and only the rows
    after them are copied in; its first token is the first prompt's."""
    env, prefiller, texts = corpus
    engine = LLMEngine(prefiller, EngineConfig(kv_budget_bytes=64 << 20, prompt_spans=False))
    question = _client_prompt(texts[:3])
    first = _run(engine, _request(question, mode="full"))
    cached_blocks = engine.kv.prefix.match(first.plan.ids(), "", exact=True)[0]
    engine.kv.release(cached_blocks)
    assert len(cached_blocks) == first.prompt_tokens // 16
    admitted, read_out = engine.kv.admitted_rows, engine.kv.copied_rows - engine.kv.admitted_rows
    repeat = _run(engine, _request(question, mode="full"))
    assert repeat.head_reused == (repeat.prompt_tokens - 1) // 16 * 16  # the head: every whole block before the tail
    assert engine.kv.admitted_rows - admitted == repeat.prompt_tokens - repeat.head_reused < 16
    # each layer's attention reads the head once; on a CPU by a copy out of the pool (gathered, or packed)
    layers = prefiller.runtime.model.cfg.n_layers
    assert engine.kv.copied_rows - engine.kv.admitted_rows - read_out == layers * repeat.head_reused
    torch.testing.assert_close(repeat.first_logits, first.first_logits, rtol=1e-4, atol=2e-4)
    assert repeat.output == first.output


def test_cached_blocks_live_in_the_kv_budget_and_give_way_to_new_prompts(corpus):
    """One budget: a finished prompt's cached blocks count as free, and a prompt that needs the room evicts them
    (nothing preempted, no error); once all is done no block is held by a sequence."""
    env, prefiller, texts = corpus
    c = prefiller.runtime.model.cfg
    per_block = 16 * 2 * c.n_layers * c.n_kv_heads * c.head_dim * 4
    a, b = _client_prompt(texts[:3]), _client_prompt(texts[1:4])
    probe = _run(LLMEngine(prefiller, EngineConfig(kv_budget_bytes=64 << 20)), _request(a, mode="full"))
    blocks = -(-probe.prompt_tokens // 16) + 2  # one prompt and its answer, and a little
    engine = LLMEngine(prefiller, EngineConfig(kv_budget_bytes=(blocks * 3 // 2 + 4) * per_block,
                                               prompt_spans=False))
    total = engine.kv.pool.num_blocks - len(engine.kv.shared)
    _run(engine, _request(a, mode="full"))
    cached = len(engine.kv.prefix)
    assert cached >= probe.prompt_tokens // 16 - 1 and engine.free_blocks == total and engine.sequence_blocks == 0
    other = _run(engine, _request(b, mode="full"))
    assert other.finish_reason in ("stop", "length") and other.preemptions == 0
    assert engine.kv.prefix.cached_rows(list(probe.plan.ids()), "") < cached * 16  # a's blocks made room
    assert engine.sequence_blocks == 0 and engine.free_blocks == total
    engine.kv.pool.allocator.check()


def test_an_exact_repeat_of_a_follow_up_is_a_prefix_hit_past_the_turn_it_continues(corpus):
    """A follow-up continues its kept turn; asked again word for word, its own new turn is in the cache too, and only
    the rows after its last whole cached block are computed."""
    env, prefiller, texts = corpus
    engine = LLMEngine(prefiller, EngineConfig(kv_budget_bytes=64 << 20, prompt_spans=False))
    first = _run(engine, _request("Who kept the light?", keep_turn=True))
    answer = prefiller.runtime.tokenizer.decode(first.output, skip_special_tokens=True)
    history = (("user", "Who kept the light?"), ("assistant", answer))
    follow = _run(engine, _request(texts[0] + " So who was it?", history=history))
    assert follow.plan.turn is not None and follow.head_reused >= len(follow.plan.turn.ids) - 16
    repeat = _run(engine, _request(texts[0] + " So who was it?", history=history))
    assert repeat.head_reused == (repeat.prompt_tokens - 1) // 16 * 16 > follow.head_reused
    torch.testing.assert_close(repeat.first_logits, follow.first_logits, rtol=1e-4, atol=2e-4)


def test_a_prompt_answered_at_its_first_token_is_cached_all_the_same(corpus):
    """A one-token answer never decodes, yet its prompt's blocks go into the pool's cache: its repeat is a hit."""
    env, prefiller, texts = corpus
    engine = LLMEngine(prefiller, EngineConfig(kv_budget_bytes=64 << 20, prompt_spans=False))
    one = replace(_request(_client_prompt(texts[:2]), mode="full"), sampling=SamplingConfig(max_tokens=1))
    first = _run(engine, one)
    repeat = _run(engine, one)
    assert first.head_reused == 0 and repeat.head_reused == (repeat.prompt_tokens - 1) // 16 * 16
    assert engine.sequence_blocks == 0
    torch.testing.assert_close(repeat.first_logits, first.first_logits, rtol=1e-4, atol=2e-4)


def test_a_client_prompt_is_ranked_without_a_preview_of_text_that_has_no_kv(corpus):
    """A client prompt's own text (separators, tags) has no loaded KV until the blend computes it: a preview over it
    would read zero keys and values there. So the preview's rules rank such a prompt by the check layer's reading
    instead (`query` then ranks as `reading` does), and both give the same first token's logits."""
    from kvrag.blend.config import BlendConfig

    env, prefiller, texts = corpus
    question = _client_prompt([texts[1], texts[0]])
    logits = {}
    for rule in ("query", "reading"):
        request = replace(_request(question), blend=BlendConfig(ratio=0.3, selection=rule))
        seq = _run(LLMEngine(prefiller, EngineConfig(kv_budget_bytes=64 << 20)), request)
        assert seq.plan.pieces is not None and any(p.chunk_id is None for p in seq.plan.pieces)
        logits[rule] = seq.first_logits
    torch.testing.assert_close(logits["query"], logits["reading"], rtol=1e-5, atol=1e-5)
