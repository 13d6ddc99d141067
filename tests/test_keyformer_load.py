"""Questions over reduced (Keyformer) chunks: attention over keys with gaps against a masked softmax, and a reduced
prompt's prefill and decode against transformers run with the dropped tokens masked out (or left out, with their
positions kept), on a tiny float32 model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvrag.blend.config import BlendConfig
from kvrag.blend.ratio import RatioPolicy
from kvrag.engine.prefiller import Prefiller
from kvrag.errors import KvragError
from kvrag.kernels import attention
from kvrag.model.decode import decode_step, decode_step_reference
from kvrag.model.runtime import Runtime
from kvrag.precompute import keyformer
from kvrag.precompute.keyformer import KeepConfig
from kvrag.precompute.plain import chunk_layers
from kvrag.store.chunks import chunk_id_for
from kvrag.store.env import StoreEnv
from kvrag.store.kv import LocalKVTable

KEEP = KeepConfig(0.5, "keyformer")
QUESTION = "Which of these places is the oldest?"


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir) -> Runtime:
    return Runtime.load(str(tiny_llama_dir), "float32")


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32,
                                                attn_implementation="eager").eval()


def _chunks(runtime: Runtime, items, n: int = 3, words: int = 40) -> list[tuple[str, list[int]]]:
    out = []
    for ctx in items[1]["ctxs"][:n]:
        ids = runtime.prompts.passage_ids(ctx["title"], " ".join(ctx["text"].split()[:words]))
        out.append((chunk_id_for(ids, runtime.local.tokenizer_fingerprint), ids))
    return out


@pytest.fixture
def reduced_store(tmp_path, tiny, invented_items):
    """A store holding the chunks' reduced KV (as `precompute --keep 0.5` writes it), an engine reading it, the
    chunks and each chunk's kept token indices."""
    env = StoreEnv.open(tmp_path / "store", create=True)
    engine = Prefiller.open(tiny, env, keep=KEEP)
    table = LocalKVTable(env, tiny.fingerprint, "fp16", variant=KEEP.variant)
    chunks, kept = _chunks(tiny, invented_items), []
    with torch.inference_mode():
        for chunk_id, ids in chunks:
            layers, positions = chunk_layers(tiny, engine.preamble, chunk_id, ids, KEEP, "fp16")
            table.put_chunk(chunk_id, ids, layers, positions)
            kept.append(positions)
    yield engine, chunks, kept
    env.close()


# ---- attention over keys with gaps ------------------------------------------------------------------------


def _masked_reference(q, q_pos, k, v, k_pos, group):
    """softmax over the keys at positions <= each query's, written out: [R, Hq * hd]."""
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [S, Hq, hd]
    scores = torch.einsum("rhd,shd->hrs", q, k) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.einsum("hrs,shd->rhd", scores.softmax(-1), v).reshape(q.shape[0], -1)


@pytest.mark.parametrize("rows", ["all", "scattered", "last"])
@pytest.mark.parametrize("row_kernel", [False, True])
def test_keys_with_gaps_are_attended_as_a_masked_softmax(rows, row_kernel):
    if row_kernel and not attention.row_kernel_serves(64, torch.float32, torch.device("cpu")):
        pytest.skip("no native row kernel here")
    gen = torch.Generator().manual_seed(0)
    k_pos = torch.randperm(900, generator=gen)[:300].sort().values  # 300 keys spread over 900 positions
    k_pos[0] = 0
    q_pos = {"all": k_pos, "scattered": k_pos[torch.randperm(300, generator=gen)[:40].sort().values],
             "last": k_pos[-1:]}[rows]
    q = torch.randn(len(q_pos), 6, 64, generator=gen)
    k, v = torch.randn(2, 300, 2, 64, generator=gen)
    out = attention.attend(q, q_pos, k, v, k_pos, 3, torch.float32, row_kernel, attention.AttendPlans())
    torch.testing.assert_close(out, _masked_reference(q, q_pos, k, v, k_pos, 3), atol=2e-5, rtol=1e-4)


# ---- a reduced prompt against transformers ----------------------------------------------------------------


def _layout(engine: Prefiller, chunks, kept, suffix) -> tuple[list[int], torch.Tensor]:
    """The whole prompt's ids and which of them have KV in the reduced prompt (preamble, kept, suffix): [T] bool."""
    ids, held = list(engine.runtime.prompts.preamble_ids), [True] * len(engine.preamble)
    for (_, chunk), keep in zip(chunks, kept, strict=True):
        ids += chunk
        held += np.isin(np.arange(len(chunk)), keep).tolist()
    return ids + suffix, torch.tensor(held + [True] * len(suffix))


def _hf_last_logits(hf, ids: list[int], visible: torch.Tensor) -> torch.Tensor:
    """transformers' logits at the last position with an explicit [T, T] visibility (True: attends)."""
    t = len(ids)
    mask = torch.zeros(1, 1, t, t).masked_fill(~visible, torch.finfo(torch.float32).min)
    with torch.no_grad():
        return hf(torch.tensor([ids]), attention_mask=mask, position_ids=torch.arange(t)[None]).logits[0, -1]


def _reuse_visibility(held: torch.Tensor, n_pre: int, n_chunk: int) -> torch.Tensor:
    """Full KV reuse of one chunk (precomputed right after the preamble, so its KV is exact): the chunk's tokens
    see every token before them; the suffix and what follows see every token that has KV, causally."""
    causal = torch.ones(held.shape[0], held.shape[0], dtype=torch.bool).tril()
    visible = causal & held[None, :]
    visible[:n_pre + n_chunk] = causal[:n_pre + n_chunk]
    return visible


def test_a_reused_reduced_chunk_and_its_decode_are_transformers_without_the_dropped_tokens(tiny, hf, invented_items):
    """With no store the engine computes the chunk now (reduced, float32: exact); the dropped tokens are then
    invisible to the question and every token decoded after it, at the positions a full prompt gives them."""
    engine = Prefiller.open(tiny, None, keep=KEEP)
    chunks = _chunks(tiny, invented_items)[:1]
    suffix = engine.runtime.prompts.build([], QUESTION).suffix
    pre = engine.prefill(chunks, QUESTION, mode="reuse", extra=4)
    kept = [engine.source._write_back[chunks[0][0]][2]]
    ids, held = _layout(engine, chunks, kept, suffix)
    assert pre.cache.length == int(held.sum()) and pre.offset == len(chunks[0][1]) - len(kept[0]) > 0
    n_pre, n_chunk = len(engine.preamble), len(chunks[0][1])
    logits = pre.logits
    for _ in range(4):  # the prompt's last row, then each new token's
        torch.testing.assert_close(logits, _hf_last_logits(hf, ids, _reuse_visibility(held, n_pre, n_chunk)),
                                   atol=1e-4, rtol=1e-4)
        token = int(logits.argmax())
        ids, held = ids + [token], torch.cat([held, torch.tensor([True])])
        logits = decode_step(engine.model, pre.cache, token, native=False)


def test_reduced_chunks_from_the_store_equal_them_computed_in_memory(reduced_store, tiny):
    engine, chunks, kept = reduced_store
    from_store = engine.prefill(chunks, QUESTION, mode="reuse")
    assert from_store.bytes_loaded > 0 and from_store.chunk_tiers == ["store"] * len(chunks)
    memory = Prefiller.open(tiny, None, keep=KEEP)
    exact = memory.prefill(chunks, QUESTION, mode="reuse")
    assert [memory.source._write_back[c][2].tolist() for c, _ in chunks] == [k.tolist() for k in kept]
    assert from_store.offset == exact.offset == sum(len(c) - len(k) for (_, c), k in zip(chunks, kept, strict=True))
    torch.testing.assert_close(from_store.logits, exact.logits, rtol=0, atol=2e-3 * exact.logits.abs().max().item())


def test_blend_at_ratio_one_over_reduced_chunks_is_a_prefill_of_the_kept_tokens_at_their_positions(reduced_store, hf):
    engine, chunks, kept = reduced_store
    suffix = engine.runtime.prompts.build([], QUESTION).suffix
    pre = engine.prefill(chunks, QUESTION, mode="blend", config=BlendConfig(1.0), extra=2)
    ids, held = _layout(engine, chunks, kept, suffix)
    kept_ids = torch.tensor(ids)[held][None]
    with torch.no_grad():
        out = hf(kept_ids, position_ids=torch.arange(len(ids))[held][None], use_cache=True)
    torch.testing.assert_close(pre.logits, out.logits[0, -1], atol=1e-4, rtol=1e-4)
    token = int(pre.logits.argmax())
    with torch.no_grad():
        after = hf(torch.tensor([[token]]), position_ids=torch.tensor([[len(ids)]]),
                   cache=out.past_key_values).logits[0, -1]
    torch.testing.assert_close(decode_step_reference(engine.model, pre.cache, token), after, atol=1e-4, rtol=1e-4)


def test_a_blend_over_reduced_chunks_recomputes_a_share_of_the_kept_rows(reduced_store):
    engine, chunks, kept = reduced_store
    pre = engine.prefill(chunks, QUESTION, mode="blend", config=BlendConfig(0.3), extra=2)
    n_kept = sum(len(k) for k in kept)
    assert pre.chunk_tokens == n_kept < sum(len(c) for _, c in chunks)
    # the first chunk is reused as loaded (it follows the preamble); 30 % of the rows is a share of all kept rows
    assert 0 < pre.recomputed_chunk_tokens <= round(0.3 * n_kept) + 1


def test_a_chunk_missing_from_the_reduced_store_is_reduced_computed_and_written_back(reduced_store, tiny):
    engine, chunks, kept = reduced_store
    engine.source.table.delete_chunk(chunks[1][0])
    first = engine.prefill(chunks, QUESTION, mode="reuse")
    assert first.chunk_tiers[1] == "computed"
    assert engine.flush_write_back() == 1
    stored = engine.source.table.get_layer(chunks[1][0], 2)
    assert stored.positions.tolist() == kept[1].tolist()  # the same draw as precompute's: (seed, chunk id)
    again = engine.prefill(chunks, QUESTION, mode="reuse")
    assert again.chunk_tiers == ["store"] * 3
    assert again.offset == first.offset
    # computed now in float32, then read back from the fp16 store: equal within fp16's rounding
    torch.testing.assert_close(again.logits, first.logits, rtol=0, atol=2e-3 * first.logits.abs().max().item())


def test_per_layer_selections_are_refused_for_questions(tiny):
    with pytest.raises(KvragError, match="one token set per chunk"):
        Prefiller.open(tiny, None, keep=KeepConfig(0.5, per_layer=True))


def test_narrow_keeps_rows_at_their_positions():
    kv = keyformer.LayerKV([torch.arange(12.).view(6, 1, 2)], [torch.arange(12.).view(6, 1, 2) + 100],
                           torch.arange(10, 16))
    out = keyformer.narrow(kv, np.array([0, 3, 5], dtype=np.int32))
    assert out.positions.tolist() == [10, 13, 15]
    assert out.k[0][:, 0, 0].tolist() == [0.0, 6.0, 10.0] and out.v[0][:, 0, 1].tolist() == [101.0, 107.0, 111.0]


def test_the_engine_decodes_reduced_prompts_in_a_batch_as_each_alone_and_as_the_one_question_path(tiny,
                                                                                                   invented_items):
    """Sequences whose rows skip positions (different offsets) and a full one, in one batch of the paged pool."""
    from kvrag.engine.llm_engine import EngineConfig, LLMEngine
    from kvrag.engine.sequence import Request
    from kvrag.model.sampling import SamplingConfig
    from kvrag.tests.reference_answer import answer_question

    chunks = [tuple((c, tuple(ids)) for c, ids in _chunks(tiny, invented_items[i:], n=2 + i % 2)) for i in range(3)]
    sampling = SamplingConfig(max_tokens=6)
    requests = [Request(QUESTION, chunks[0], "blend", BlendConfig(0.3), RatioPolicy(0.3), sampling=sampling),
                Request(QUESTION, chunks[1], "reuse", sampling=sampling),
                Request(QUESTION, chunks[2], "full", sampling=sampling)]

    def run(engine, reqs):
        seqs = [engine.add(r) for r in reqs]
        while engine.has_work():
            engine.step()
        return [s.output for s in seqs]

    def new_engine():
        return LLMEngine(Prefiller.open(tiny, None, keep=KEEP), EngineConfig(1 << 26, 16, native=False))

    together = run(new_engine(), requests)
    assert together == [run(new_engine(), [r])[0] for r in requests]
    one = Prefiller.open(tiny, None, keep=KEEP)
    for request, tokens in zip(requests, together, strict=True):
        answer, pre = answer_question(one, [(c, list(ids)) for c, ids in request.chunks], QUESTION, request.mode,
                                      request.blend, sampling)
        assert answer == tokens and len(tokens) == 6
        assert (pre.offset > 0) == (request.mode != "full")


def test_ask_reads_the_reduced_chunks_precompute_stored(kvrag, store_copy, tiny_llama_dir):
    """The CLI end to end: `precompute --keep 0.5` then `ask --keep 0.5` loads those (fewer bytes than full
    chunks); a budget inside the preamble or a bad keep is one line on stderr."""
    import json

    model = ("--model", str(tiny_llama_dir), "--dtype", "float32")
    for keep in ("1", "0.5"):
        kvrag("precompute", "--store", str(store_copy), "--keep", keep, *model)
    answers = {}
    for keep in ("1", "0.5"):
        proc = kvrag("ask", "Which lake is the deepest?", "--store", str(store_copy), "-k", "3", "--json",
                     "--max-tokens", "6", "--keep", keep, "--kv-budget", "120", *model)
        answers[keep] = json.loads(proc.stdout)
    full, reduced = answers["1"], answers["0.5"]
    assert {s["tier"] for s in reduced["sources"]} == {"store"} and reduced["computed_chunks"] == []
    assert 0 < reduced["bytes_loaded"] < 0.7 * full["bytes_loaded"]
    assert reduced["tokens"]["chunks"] < full["tokens"]["chunks"] and reduced["tokens"]["prompt"] == full["tokens"][
        "prompt"]
    for bad, says in ((("--kv-tokens", "5"), "preamble"), (("--keep", "1.5"), "--keep")):
        proc = kvrag("ask", "Which lake?", "--store", str(store_copy), *bad, *model, check=False)
        assert proc.returncode != 0 and says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_the_scheduler_reserves_a_reduced_prompt_by_its_rows(reduced_store):
    """A blend over stored reduced chunks asks the pool for its kept rows, not its tokens (the dropped ones have
    none); after the prefill, its rows are the cache's and its reused and computed tokens add up to them."""
    from kvrag.engine.llm_engine import EngineConfig, LLMEngine
    from kvrag.engine.sequence import Request
    from kvrag.model.sampling import SamplingConfig

    engine, chunks, kept = reduced_store
    llm = LLMEngine(engine, EngineConfig(1 << 26, 16, native=False))
    request = Request(QUESTION, tuple((c, tuple(ids)) for c, ids in chunks), "blend", BlendConfig(0.3), RatioPolicy(0.3), sampling=SamplingConfig(max_tokens=3))
    seq = llm.add(request)
    dropped = sum(len(ids) - len(k) for (_, ids), k in zip(chunks, kept, strict=True))
    assert dropped > 0 and seq.prompt_rows == seq.prompt_tokens - dropped
    while llm.has_work():
        llm.step()
    assert seq.prompt_rows == seq.prompt_tokens - dropped
    assert seq.reused_tokens + seq.computed_tokens == seq.prompt_rows and seq.computed_tokens > 0
