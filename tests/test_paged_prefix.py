"""A prefix-cache hit read where the pool holds it (engine/kv_pool.paged_rows): a chat's follow-up and an exact repeat
attend over the cached blocks in place, and give the first token a full prefill of the same prompt gives."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvrag.blend.config import BlendConfig
from kvrag.blend.ratio import RatioPolicy
from kvrag.engine.llm_engine import EngineConfig, LLMEngine
from kvrag.engine.prefiller import Prefiller
from kvrag.engine.sequence import Request, Status
from kvrag.kernels.attention import PagedKeys
from kvrag.model.prefill import LayerKV
from kvrag.model.runtime import Runtime
from kvrag.model.sampling import SamplingConfig
from kvrag.store.env import StoreEnv

SYSTEM = "You are a careful assistant for the harbour archive. Answer in one sentence and say so when you do not know."
TURNS = ["Who kept the light on the north pier in the winter of the great storm, and for how long did they stay?",
         "And who came after them, and what did they change about the way the lamp was trimmed each evening?"]


def _run(engine: LLMEngine, request: Request):
    seq = engine.add(request)
    while not seq.done.is_set():
        engine.step()
    return seq


def _chat(question: str, history=(), mode: str = "blend", salt: str = "") -> Request:
    return Request(question, (), mode, BlendConfig(), RatioPolicy.parse("auto", "ratio"),
                   sampling=SamplingConfig(max_tokens=6), rag=False, keep_first_logits=True, keep_turn=True,
                   history=(("system", SYSTEM), *history), salt=salt)


@pytest.fixture(params=["tiny_llama_hd64_dir", "tiny_llama_dir"])
def prefiller(request, tmp_path):
    """hd64: the row kernel reads the pool in place (where this CPU has it); the other: SDPA over the gathered copy."""
    runtime = Runtime.load(str(request.getfixturevalue(request.param)), "float32")
    env = StoreEnv.open(tmp_path / "store", create=True)
    yield Prefiller.open(runtime, env)
    env.close()


@pytest.mark.parametrize("salt", ["", "an API key's digest"])
def test_a_follow_up_and_a_repeat_read_the_cached_turn_in_place(prefiller, monkeypatch, salt):
    """Under a tenant's salt (an API key, a cache_salt) as under none; another salt's follow-up reuses nothing."""
    engine = LLMEngine(prefiller, EngineConfig(kv_budget_bytes=64 << 20, prompt_spans=False))
    first = _run(engine, _chat(TURNS[0], salt=salt))
    answer = prefiller.runtime.tokenizer.decode(first.output, skip_special_tokens=True)
    history = (("user", TURNS[0]), ("assistant", answer))
    joins = []
    join = PagedKeys.join
    monkeypatch.setattr(PagedKeys, "join", lambda self, k, v: joins.append(len(self)) or join(self, k, v))
    follow = _run(engine, _chat(TURNS[1], history, salt=salt))
    repeat = _run(engine, _chat(TURNS[1], history, salt=salt))
    monkeypatch.undo()
    assert follow.head_reused > 0 and repeat.head_reused >= repeat.prompt_tokens - 16
    assert _run(engine, _chat(TURNS[1], history, salt=salt + "another")).head_reused == 0
    if prefiller.runtime.model.uses_row_kernel():
        assert joins == []  # every paged read in the kernel: nothing gathered out of the pool
    else:
        assert joins  # the torch paths' twin: the gathered copy
    alone = LLMEngine(prefiller, EngineConfig(kv_budget_bytes=64 << 20, chat_cache_bytes=0, prompt_spans=False))
    reference = _run(alone, _chat(TURNS[1], history, mode="full"))
    assert reference.head_reused == 0 and reference.prompt_tokens == follow.prompt_tokens
    for seq in (follow, repeat):
        torch.testing.assert_close(seq.first_logits, reference.first_logits, rtol=1e-4, atol=2e-4)
        assert seq.output == reference.output


def test_on_the_triton_path_the_cached_turn_is_read_in_place(tiny_llama_dir, tmp_path, monkeypatch):
    """The Triton rows kernel (interpreted here, compiled on a GPU) reads the hit through its slots: no join, and the
    follow-up's first token is a full prefill's."""
    from kvrag.kernels import triton_attention

    runtime = Runtime.load(str(tiny_llama_dir), "float32", kernels="torch")
    env = StoreEnv.open(tmp_path / "store", create=True)
    prefiller = Prefiller.open(runtime, env)
    engine = LLMEngine(prefiller, EngineConfig(kv_budget_bytes=64 << 20, prompt_spans=False))
    first = _run(engine, _chat(TURNS[0]))
    history = (("user", TURNS[0]), ("assistant", runtime.tokenizer.decode(first.output, skip_special_tokens=True)))
    heads, joins = [], []
    rows, join = triton_attention.rows_attention, PagedKeys.join
    monkeypatch.setattr(triton_attention, "rows_attention",
                        lambda *a, **k: heads.append(k.get("head") is not None) or rows(*a, **k))
    monkeypatch.setattr(PagedKeys, "join", lambda self, k, v: joins.append(len(self)) or join(self, k, v))
    runtime.model.triton = True
    try:
        follow = _run(engine, _chat(TURNS[1], history))
    finally:
        runtime.model.triton = False
        monkeypatch.undo()
    assert follow.head_reused > 0 and any(heads) and joins == []
    alone = LLMEngine(prefiller, EngineConfig(kv_budget_bytes=64 << 20, chat_cache_bytes=0, prompt_spans=False))
    reference = _run(alone, _chat(TURNS[1], history, mode="full"))
    torch.testing.assert_close(follow.first_logits, reference.first_logits, rtol=1e-4, atol=2e-4)
    assert follow.output == reference.output
    env.close()


def test_a_repeat_of_a_prompt_still_decoding_starts_beside_it(prefiller):
    """Admission counts the blocks a prompt takes (engine/scheduler._fresh_blocks): an exact repeat of a prompt still
    decoding reuses the blocks that sequence holds, so it starts at once in a pool with room for its tail but not for
    a second copy of its prompt (before: it waited for the first to end), and answers as the first did."""
    n = 24
    ask = replace(_chat(" ".join(TURNS), mode="full"), sampling=SamplingConfig(max_tokens=n, min_tokens=n))
    probe = LLMEngine(prefiller, EngineConfig(kv_budget_bytes=64 << 20, prompt_spans=False))
    alone = probe.add(ask)
    probe.step()
    held, prompt_blocks = probe.sequence_blocks, probe.kv.blocks_needed(alone.prompt_rows + 1)
    while probe.has_work():
        probe.step()
    final = probe.kv.blocks_needed(alone.prompt_rows + n)  # the first's blocks at its answer's end
    hit = (alone.prompt_rows - 1) // probe.kv.block_size  # the whole blocks of the head a repeat reuses
    blocks = len(probe.kv.shared) + final + (final - hit) + 1  # both to their ends, one block spare
    assert blocks - len(probe.kv.shared) - held - 1 < prompt_blocks  # no room beside the first for a second copy
    engine = LLMEngine(prefiller, EngineConfig(kv_budget_bytes=blocks * probe.kv.pool.layout.bytes_per_block,
                                               prompt_spans=False))
    first = engine.add(ask)
    engine.step()
    second = engine.add(ask)
    engine.step()
    assert first.status is Status.RUNNING and second.status is Status.RUNNING  # admitted beside it
    assert second.head_reused >= second.prompt_tokens - 16
    while engine.has_work():
        engine.step()
    for seq in (first, second):
        torch.testing.assert_close(seq.first_logits, alone.first_logits, rtol=1e-4, atol=2e-4)
        assert seq.output == alone.output and not seq.preemptions


@pytest.mark.parametrize("piece", [512, 16])  # one pass; a piece at a time, decoding between
def test_a_full_prefill_after_a_cached_turn_reads_it_in_place(prefiller, monkeypatch, piece):
    """`mode: full` over a prefix-cache hit (engine/prefiller.FullPrefill, model/prefill.ChunkedPrefill): where the
    row kernel serves, the hit's rows are read where the pool holds them, never gathered into a copy nor placed in
    the prefill's cache (before: both, once each); elsewhere the gathered twin. Either way the first token is a
    fresh full prefill's."""
    engine = LLMEngine(prefiller, EngineConfig(kv_budget_bytes=64 << 20, prompt_spans=False, prefill_chunk=piece))
    first = _run(engine, _chat(TURNS[0], mode="full"))
    history = (("user", TURNS[0]), ("assistant", prefiller.runtime.tokenizer.decode(first.output,
                                                                                      skip_special_tokens=True)))
    gathered = []
    join, dense = PagedKeys.join, LayerKV.dense
    monkeypatch.setattr(PagedKeys, "join", lambda self, k, v: gathered.append(len(self)) or join(self, k, v))
    monkeypatch.setattr(LayerKV, "dense", lambda self: gathered.append(self.n_paged) or dense(self))
    follow = _run(engine, _chat(TURNS[1], history, mode="full"))
    monkeypatch.undo()
    assert follow.head_reused > 0
    if prefiller.runtime.model.uses_row_kernel():
        assert not any(gathered)  # nothing of the pool's rows copied out
    else:
        assert any(gathered)
    alone = LLMEngine(prefiller, EngineConfig(kv_budget_bytes=64 << 20, chat_cache_bytes=0, prompt_spans=False))
    reference = _run(alone, _chat(TURNS[1], history, mode="full"))
    assert reference.head_reused == 0
    torch.testing.assert_close(follow.first_logits, reference.first_logits, rtol=1e-4, atol=2e-4)
    assert follow.output == reference.output
