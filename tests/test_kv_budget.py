"""A decode-time KV budget (Keyformer's eviction): the rows kept by hand, per sequence and per layer and head, the
pool's compaction against the rows it held, a cut prompt's decode against transformers with each layer's and head's
dropped tokens masked, and the engine's budget held while its answers stay those of the same request alone."""

from __future__ import annotations

import pytest
import torch

from kvrag.blend.config import BlendConfig
from kvrag.blend.ratio import RatioPolicy
from kvrag.engine.kv_budget import RULES, AttentionScore, budget_rows, parse_rule
from kvrag.engine.kv_pool import SequenceKV
from kvrag.engine.llm_engine import EngineConfig, LLMEngine
from kvrag.engine.prefiller import Prefiller
from kvrag.engine.sequence import Request
from kvrag.errors import KvragError
from kvrag.model.decode import decode_step
from kvrag.model.runtime import Runtime
from kvrag.model.sampling import SamplingConfig
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
    # one set per leading index: a second head ranks rows 2..9 the other way
    per_head = budget_rows(torch.stack([scores, -scores]), 7, 2)
    assert per_head.tolist() == [[0, 1, 2, 4, 6, 10, 11], [0, 1, 3, 8, 9, 10, 11]]


def test_rules_parse_with_their_modifiers():
    assert parse_rule("keyformer") == RULES["keyformer"] and RULES["keyformer"].per_head
    rule = parse_rule("h2o:pooled+prompt+tau=answer+recent=0.5")
    assert (rule.score, rule.per_head, rule.observe, rule.tau, rule.recent) == ("softmax", False, "prompt", "answer", 0.5)
    assert rule.temperature(5, 10) == 1.5 and RULES["keyformer"].temperature(50, 10) == 1.5  # 1 -> 2 over 10; 1 + 0.01 t
    # pool=3: a row ranks by the best score among it and its two neighbours, so row 3's phrase stays whole
    score = AttentionScore(parse_rule("h2o:pool=3"), 1, 1, 0)
    score.scores = torch.tensor([[[0, 0, 0, 5, 0, 0, 0, 0, 4, 0, 0, 0, 0, 0.0]]])
    # budget 11: 2 protected, round(3.3) recent (11-13), and the 6 best of rows 2-10 pooled: 2-4 at 5, 7-9 at 4
    assert score.budget_rows(14, 11, 2).tolist() == [[[0, 1, 2, 3, 4, 7, 8, 9, 11, 12, 13]]]
    for bad in ("snapkv", "keyformer:wide", "keyformer:recent=2", "keyformer:tau=fast", "h2o:pool=4"):
        with pytest.raises(KvragError, match="KV budget rule"):
            parse_rule(bad)


def test_attention_score_is_a_softmax_per_query_head_over_the_keys_each_sees():
    score = AttentionScore(RULES["keyformer"], 2, 2, from_position=5)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 6, 8, generator=gen), torch.randn(10, 2, 8, generator=gen)
    q_pos = torch.tensor([3, 5, 6, 7])  # the first query is before from_position: not observed
    score(1, q, q_pos, k, torch.arange(10))
    assert score.scores.shape == (2, 2, 10)
    assert score.scores[0].abs().max() == 0  # layer 0 saw nothing
    assert score.scores[1, :, 8:].abs().max() == 0  # keys after every observed query are never seen
    # each KV head's 3 query heads, each observed query's softmax summing to 1
    torch.testing.assert_close(score.scores[1].sum(-1), torch.tensor([9.0, 9.0]))
    rows = torch.tensor([[[0, 2, 4], [1, 2, 3]], [[0, 1, 9], [5, 6, 7]]])  # [L, Hkv, 3]
    kept = score.scores.gather(-1, rows)
    score.keep(rows)
    assert torch.equal(score.scores, kept)


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
    # each layer and KV head its own rows: head h's slot j holds its j-th kept row, blocks past them freed
    n_layers, n_heads = k.shape[0], k.shape[2]
    per_head = torch.stack([torch.stack([torch.tensor([0, 1, 2 + h, 4 + layer, 6]) for h in range(n_heads)])
                            for layer in range(n_layers)])  # [L, Hkv, 5]: rows 0-1 stay, the rest move
    held = rows[per_head]  # the values those slots held (the first compaction's rows)
    kv.keep_rows(table, per_head)
    assert table.n_tokens == 5 and len(table.blocks) == 2
    slots = kv.rows(table)
    for layer in range(n_layers):
        for h in range(n_heads):
            assert k[layer, slots, h, 0].tolist() == (held[layer, h].float() + 100 * layer).tolist()
            assert v[layer, slots, h, 2].tolist() == (-held[layer, h].float()).tolist()


def _masked_attention(held: list[torch.Tensor], n_prompt: int, group: int):
    """transformers' eager attention where the rows after the prompt's n_prompt do not see each layer's and KV head's
    dropped keys: held[layer] [Hkv, t] bool."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    def attend(module, query, key, value, attention_mask, **kwargs):
        n_q, n_k = query.shape[2], key.shape[2]
        dropped = ~held[module.layer_idx][:, :n_k].repeat_interleave(group, 0)  # [Hq, n_k]
        low = torch.finfo(torch.float32).min
        mask = torch.full((n_q, n_k), low).triu(n_k - n_q + 1).expand(1, dropped.shape[0], n_q, n_k).clone()
        mask[:, :, n_prompt:] = mask[:, :, n_prompt:].masked_fill(dropped[None, :, None, :], low)  # causal and held
        return eager_attention_forward(module, query, key, value, mask, **kwargs)

    return attend


@pytest.mark.parametrize("spec", ["keyformer", "h2o:pooled"])
def test_a_cut_prompt_decodes_as_transformers_with_the_dropped_tokens_masked(tiny, tiny_llama_dir, invented_items,
                                                                            spec):
    """Rows dropped from the middle of the prompt, each layer and head its own (or all alike): the new tokens see the
    rest at their own positions."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32,
                                              attn_implementation="eager").eval()
    engine = Prefiller.open(tiny, None)
    chunks = [(c, list(ids)) for c, ids in _chunks(tiny, invented_items)]
    pre = engine.prefill(chunks, QUESTION, mode="full", extra=4, observe=spec)
    n = pre.cache.length
    rows = pre.attention.budget_rows(n, n // 2, len(engine.preamble))  # [L, Hkv, n // 2]
    assert (rows != rows[:1, :1]).any() == (spec == "keyformer")  # per head, the sets differ
    pre.cache.keep_rows(rows)
    held = [torch.zeros(rows.shape[1], n + 3, dtype=torch.bool).scatter_(1, r, True) for r in rows]
    for h in held:
        h[:, n:] = True  # the new tokens
    AttentionInterface.register("kvrag_budget_test", _masked_attention(held, n, tiny.model.cfg.group_size))
    hf.config._attn_implementation = "kvrag_budget_test"
    ids = engine.runtime.prompts.preamble_ids + [t for _, c in chunks for t in c]
    ids += engine.runtime.prompts.build([], QUESTION).suffix
    token = int(pre.logits.argmax())
    for _ in range(3):  # the prompt's rows saw each other whole; each new token sees the kept ones and its own
        ids.append(token)
        t = len(ids)
        with torch.no_grad():
            ref = hf(torch.tensor([ids]), position_ids=torch.arange(t)[None]).logits[0, -1]
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
                        kv_tokens=budget, kv_rule="keyformer"),
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
    h2o = [AttentionScore(RULES["h2o"], 1, 2, 0, seed=s) for s in (0, 1)]
    noisy = [AttentionScore(RULES["keyformer"], 1, 2, 0, seed=s) for s in (0, 1)]
    for score in h2o + noisy:
        score(0, q, pos, k, torch.arange(6))
    assert torch.equal(h2o[0].scores, h2o[1].scores) and not torch.equal(noisy[0].scores, noisy[1].scores)
    # H2O's score is the attention itself: each query head's softmax over the keys it sees, summed per KV head
    logits = torch.einsum("rhd,shd->hrs", q, k.repeat_interleave(2, 1)) * 8 ** -0.5  # [Hq, R, S]
    logits = logits.masked_fill(torch.arange(6)[None, None, :] > pos[None, :, None], float("-inf"))
    torch.testing.assert_close(h2o[0].scores[0], logits.softmax(-1).sum(1).view(2, 2, 6).sum(1))
    window = AttentionScore(RULES["window"], 1, 2, 0)
    window(0, q, pos, k, torch.arange(6))
    assert window.budget_rows(10, 6, 2).tolist() == [[[0, 1, 6, 7, 8, 9]] * 2]  # the protected rows, the most recent
    window.keep(window.budget_rows(10, 6, 2))
    assert window.scores.tolist() == [[[0.0] * 6] * 2]


def test_teacher_forcing_feeds_the_given_answer_and_counts_the_model_s_own_choices(tiny, tiny_llama_dir,
                                                                                   invented_items):
    """Request.forced: the given tokens are the answer; `agreed` counts the steps whose greedy token was the forced one,
    against transformers' greedy choices over the prompt and the forced prefix."""
    from transformers import AutoModelForCausalLM

    chunks = _chunks(tiny, invented_items)
    own = _run(_engine(tiny), [Request(QUESTION, chunks, "full", sampling=SamplingConfig(max_tokens=12,
                                                                                         min_tokens=12))])[0]
    other = tuple(own[:4]) + tuple(reversed(own[4:]))  # the model's answer, then one it would not give
    engine = _engine(tiny)
    seqs = [engine.add(Request(QUESTION, chunks, "full", sampling=SamplingConfig(max_tokens=12), forced=f))
            for f in (tuple(own), other)]
    while engine.has_work():
        engine.step()
    assert [s.output for s in seqs] == [own, list(other)]
    assert seqs[0].agreed == 12
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    prompt = tiny.prompts.preamble_ids + [t for _, c in chunks for t in c] + tiny.prompts.build([], QUESTION).suffix
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + list(other)])).logits[0, len(prompt) - 1:-1]  # [12, V]: each step's
    assert seqs[1].agreed == int((logits.argmax(-1) == torch.tensor(other)).sum())
    assert 4 <= seqs[1].agreed < 12
