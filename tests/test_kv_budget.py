"""A decode-time KV budget (Keyformer's eviction): the rows kept by hand, the pool's compaction against the rows it
held, a cut prompt's decode against transformers with the dropped tokens masked, and the engine's budget held
while its answers stay those of the same request alone."""

from __future__ import annotations

import pytest
import torch

from kvrag.blend.config import BlendConfig
from kvrag.blend.keyformer import AttentionScore, budget_rows
from kvrag.blend.ratio import RatioPolicy
from kvrag.engine.kv_pool import SequenceKV
from kvrag.engine.llm_engine import EngineConfig, LLMEngine
from kvrag.engine.prefiller import Prefiller
from kvrag.engine.sequence import Request
from kvrag.errors import KvragError
from kvrag.model.generate import SamplingConfig, decode_step
from kvrag.model.runtime import Runtime
from kvrag.store.chunks import chunk_id_for

QUESTION = "What do these passages say about the river?"


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir) -> Runtime:
    return Runtime.load(str(tiny_llama_dir), "float32")


def _chunks(runtime: Runtime, items, n: int = 3, words: int = 40) -> tuple[tuple[str, tuple[int, ...]], ...]:
    out = []
    for ctx in items[2]["ctxs"][:n]:
        ids = runtime.prompts.passage_ids(ctx["title"], " ".join(ctx["text"].split()[:words]))
        out.append((chunk_id_for(ids, runtime.local.tokenizer_fingerprint), tuple(ids)))
    return tuple(out)


def test_budget_rows_by_hand():
    scores = torch.tensor([0.0, 0, 5, 1, 9, 2, 8, 3, 0, 0, 7, 6])  # 12 rows, 2 protected
    # budget 7: the 2 protected, round(0.3 * 7) = 2 most recent (10, 11), the 3 best of rows 2..9: 4, 6, 2
    assert budget_rows(scores, 7, 2).tolist() == [0, 1, 2, 4, 6, 10, 11]
    assert budget_rows(scores, 12, 2).tolist() == list(range(12))  # within the budget: all of them
    assert budget_rows(scores, 4, 2, recent=0.0).tolist() == [0, 1, 4, 6]
    with pytest.raises(KvragError, match="preamble"):
        budget_rows(scores, 2, 2)


def test_attention_score_is_a_softmax_per_query_head_over_the_keys_each_sees():
    score = AttentionScore(from_position=5)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 6, 8, generator=gen), torch.randn(10, 2, 8, generator=gen)
    q_pos = torch.tensor([3, 5, 6, 7])  # the first query is before from_position: not observed
    score(q, q_pos, k, torch.arange(10))
    assert score.scores.shape == (10,)
    assert score.scores[8:].abs().max() == 0  # keys after every observed query are never seen
    torch.testing.assert_close(score.scores.sum(), torch.tensor(3 * 6.0))  # each observed query head sums to 1
    score.keep(torch.tensor([0, 2, 4]))
    assert score.scores.shape == (3,)


def test_the_pool_keeps_the_rows_it_is_told_to_and_frees_the_blocks_past_them(tiny):
    kv = SequenceKV(tiny.model, 1 << 24, block_size=4)
    table = kv.pool.allocate(14)
    k, v = kv.layer_views()
    slots = kv.rows(table)
    for layer in range(k.shape[0]):
        k[layer, slots] = torch.arange(14.0)[:, None, None] + 100 * layer
        v[layer, slots] = -torch.arange(14.0)[:, None, None]
    free = kv.num_free
    rows = torch.tensor([0, 1, 2, 5, 9, 12, 13])
    kv.keep_rows(table, rows)
    assert table.n_tokens == 7 and len(table.blocks) == 2 and kv.num_free == free + 2
    slots = kv.rows(table)
    for layer in range(k.shape[0]):
        assert k[layer, slots, 0, 0].tolist() == (rows.float() + 100 * layer).tolist()
        assert v[layer, slots, 1, 3].tolist() == (-rows.float()).tolist()


def test_a_cut_prompt_decodes_as_transformers_with_the_dropped_tokens_masked(tiny, tiny_llama_dir, invented_items):
    """Rows dropped from the middle of the prompt: the new tokens see the rest at their own positions."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32,
                                              attn_implementation="eager").eval()
    engine = Prefiller.open(tiny, None)
    chunks = [(c, list(ids)) for c, ids in _chunks(tiny, invented_items)]
    pre = engine.prefill(chunks, QUESTION, mode="full", extra=4, observe="keyformer")
    n = pre.cache.length
    rows = budget_rows(pre.attention.scores[:n], n // 2, len(engine.preamble))
    pre.cache.keep_rows(rows)
    held = torch.zeros(n, dtype=torch.bool)
    held[rows] = True
    ids = engine.runtime.prompts.preamble_ids + [t for _, c in chunks for t in c]
    ids += engine.runtime.prompts.build([], QUESTION).suffix
    token = int(pre.logits.argmax())
    for _ in range(3):  # the prompt's rows saw each other whole; each new token sees the kept ones and its own
        ids.append(token)
        held = torch.cat([held, torch.tensor([True])])
        t = len(ids)
        visible = torch.ones(t, t, dtype=torch.bool).tril()
        visible[n:] &= held[None, :]
        mask = torch.zeros(1, 1, t, t).masked_fill(~visible, torch.finfo(torch.float32).min)
        with torch.no_grad():
            ref = hf(torch.tensor([ids]), attention_mask=mask, position_ids=torch.arange(t)[None]).logits[0, -1]
        logits = decode_step(engine.model, pre.cache, token, native=False)
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
        token = int(logits.argmax())


def _engine(runtime: Runtime) -> LLMEngine:
    return LLMEngine(Prefiller.open(runtime, None), EngineConfig(1 << 26, 16, native=False))


def _run(engine: LLMEngine, requests: list[Request], watch=None) -> list[list[int]]:
    seqs = [engine.add(r) for r in requests]
    while engine.has_work():
        engine.step()
        if watch is not None:
            watch(engine)
    return [s.output for s in seqs]


def test_the_engine_holds_a_sequence_to_its_budget_and_answers_as_alone(tiny, invented_items):
    chunks = _chunks(tiny, invented_items)
    sampling = SamplingConfig(max_tokens=40)
    budget = 200  # under the prompt's rows: cut at once, and again as the answer grows
    requests = [Request(QUESTION, chunks, "blend", BlendConfig(0.3), RatioPolicy(0.3), sampling=sampling,
                        kv_tokens=budget),
                Request(QUESTION, chunks, "full", sampling=sampling, kv_tokens=budget, kv_rule="h2o"),
                Request(QUESTION, chunks, "reuse", sampling=sampling, kv_tokens=budget, kv_rule="window"),
                Request(QUESTION, chunks, "full", sampling=sampling)]
    engine = _engine(tiny)
    most = []

    def watch(e: LLMEngine) -> None:
        most.extend(s.length for s in e.scheduler.running if s.request.kv_tokens)
        for s in e.scheduler.running:  # every position held or dropped: the prompt's and each token fed since
            assert s.table.n_tokens == s.length and s.length + s.offset == s.prompt_tokens + len(s.output) - 1

    together = _run(engine, requests, watch)
    assert most and max(most) < budget + engine.kv.block_size
    assert together == [_run(_engine(tiny), [r])[0] for r in requests]
    assert engine.sequence_blocks == 0
    # a budget that the whole sequence fits in changes nothing
    roomy = Request(QUESTION, chunks, "full", sampling=sampling, kv_tokens=5000)
    assert _run(_engine(tiny), [roomy])[0] == together[3]


def test_a_budget_inside_the_preamble_is_refused(tiny, invented_items):
    with pytest.raises(KvragError, match="preamble"):
        _engine(tiny).add(Request(QUESTION, _chunks(tiny, invented_items), kv_tokens=10))


def test_the_baselines_score_without_noise_or_not_at_all():
    gen = torch.Generator().manual_seed(1)
    q, k, pos = torch.randn(3, 4, 8, generator=gen), torch.randn(6, 2, 8, generator=gen), torch.arange(3, 6)
    h2o = [AttentionScore(0, seed=s, rule="h2o") for s in (0, 1)]
    noisy = [AttentionScore(0, seed=s) for s in (0, 1)]
    for score in h2o + noisy:
        score(q, pos, k, torch.arange(6))
    assert torch.equal(h2o[0].scores, h2o[1].scores) and not torch.equal(noisy[0].scores, noisy[1].scores)
    # H2O's score is the attention itself: each query head's softmax over the keys it sees, summed
    logits = torch.einsum("rgd,sgd->grs", q.view(3, 2, 2, 8).reshape(3, 4, 8), k.repeat_interleave(2, 1)) * 8 ** -0.5
    logits = logits.masked_fill(torch.arange(6)[None, None, :] > pos[None, :, None], float("-inf"))
    torch.testing.assert_close(h2o[0].scores, logits.softmax(-1).sum(dim=(0, 1)))
    window = AttentionScore(0, rule="window")
    window(q, pos, k, torch.arange(6))
    assert window.budget_rows(10, 6, 2).tolist() == [0, 1, 6, 7, 8, 9]  # the protected rows, then the most recent
    window.keep(torch.tensor([0, 1, 6, 7, 8, 9]))
    assert window.scores.tolist() == [0.0] * 6
