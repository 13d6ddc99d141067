"""The resident engine with the real default model: a batch answers exactly as its requests do one at a time, as
the one-question path does, and under random arrivals, cancellations and a pool too small for all of them, the pool
stays within its budget, never hands a block in use to another sequence, and every answer is still the same."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvrag.blend.config import BlendConfig
from kvrag.blend.ratio import RatioPolicy
from kvrag.engine.llm_engine import EngineConfig, LLMEngine
from kvrag.engine.prefiller import Prefiller
from kvrag.engine.scheduler import SchedulerConfig
from kvrag.engine.sequence import Request, Status
from kvrag.kernels import decode_step as native_decode
from kvrag.model.runtime import Runtime
from kvrag.model.sampling import SamplingConfig
from kvrag.tests.conftest import WEIGHT_FORMS
from kvrag.tests.reference_answer import answer_question

pytestmark = pytest.mark.real_model
MODES = ("blend", "full", "reuse", "prefix", "blend")


@pytest.fixture(scope="module", params=WEIGHT_FORMS)
def runtime(smol, request) -> Runtime:
    """The real default model, dense (its default) and int8 where the kernel runs (the Qwen models' default):
    each form's engine held to the same form's one-at-a-time and one-question answers."""
    return Runtime.load(weights=request.param)


@pytest.fixture(scope="module")
def requests(runtime, invented_items) -> list[Request]:
    """Eight questions over 2-3 short passages each (30-80 words), in every mode, 3-14 tokens to generate."""
    rng = random.Random(0)
    out = []
    for i, item in enumerate(invented_items[:8]):
        chunks = []
        for ctx in item["ctxs"][:rng.choice((2, 3))]:
            ids = runtime.prompts.passage_ids(ctx["title"], " ".join(ctx["text"].split()[:rng.randint(30, 80)]))
            chunks.append((f"{i}-{len(chunks)}", tuple(ids)))
        # fixed ratios: `auto` predicts costs from timings measured per engine, so two engines may choose apart
        out.append(Request(item["question"], tuple(chunks), MODES[i % len(MODES)], BlendConfig(0.15 + 0.1 * (i % 3)),
                           RatioPolicy(0.15 + 0.1 * (i % 3)), sampling=SamplingConfig(max_tokens=3 + (i * 5) % 12)))
    return out


def new_engine(runtime, budget_blocks: int = 4096, max_running: int = 32, prefill_chunk: int = 512) -> LLMEngine:
    c = runtime.model.cfg  # the model's own dtype: bf16 where the CPU has it, float32 elsewhere
    block = 16 * 2 * c.n_layers * c.n_kv_heads * c.head_dim * runtime.model.dtype.itemsize
    return LLMEngine(Prefiller.open(runtime, None), EngineConfig(budget_blocks * block, 16, SchedulerConfig(max_running),
                                                         prefill_chunk=prefill_chunk))


def run(engine: LLMEngine, requests: list[Request]) -> list[list[int]]:
    seqs = [engine.add(r) for r in requests]
    while engine.has_work():
        engine.step()
    assert all(s.finish_reason in ("stop", "length") for s in seqs)
    return [s.output for s in seqs]


@pytest.fixture(scope="module")
def alone(runtime, requests) -> list[list[int]]:
    """Each request on its own, one after the other, through one engine."""
    engine = new_engine(runtime)
    return [run(engine, [r])[0] for r in requests]


def test_a_batch_answers_as_its_requests_do_one_at_a_time(runtime, requests, alone):
    engine = new_engine(runtime)
    assert run(engine, requests) == alone
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks - len(engine.kv.shared)  # every block back


def test_one_request_answers_as_the_one_question_path_does(runtime, requests, alone):
    """The engine's decode (batched step, paged KV) against `answer_question`'s (one row, contiguous cache), where
    both run the same arithmetic: both native, or both torch."""
    engine = new_engine(runtime)
    if (engine.decoder.native is not None) != native_decode.step_serves(runtime.model.step_weights()):
        pytest.skip("the engine's and the one-question decoder run different arithmetic here")
    old = Prefiller.open(runtime, None)
    for request, tokens in zip(requests, alone, strict=True):
        answer, _ = answer_question(old, [(c, list(ids)) for c, ids in request.chunks], request.question,
                                    request.mode, request.blend, request.sampling, ratio=request.ratio)
        assert answer == tokens


def check_pool(engine: LLMEngine) -> None:
    """Within budget; every block held by exactly the tables that list it (plus the shared preamble's holder)."""
    pool, kv = engine.kv.pool, engine.kv
    pool.allocator.check()
    assert pool.capacity_bytes <= engine.config.kv_budget_bytes
    holders: dict[int, int] = {b: 1 for b in kv.shared}
    for seq in engine.scheduler.running:
        assert seq.table is not None and seq.table.n_tokens == seq.length
        for b in seq.table.blocks:
            holders[b] = holders.get(b, 0) + 1
    for seq in engine.scheduler.waiting:
        assert seq.table is None
    for b, n in holders.items():
        assert pool.allocator.refcount(b) == n, (b, n)
    private = [b for seq in engine.scheduler.running for b in seq.table.blocks if b not in kv.shared]
    assert len(private) == len(set(private))  # no block written by one sequence is read by another


# no shrinking: each example runs the real model for seconds; the failing plan is printed as it was drawn
@settings(max_examples=4, deadline=None, phases=[Phase.generate], suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 3), st.booleans()), min_size=3, max_size=8))
def test_random_arrivals_and_cancellations_in_a_small_pool(runtime, requests, alone, plan):
    """plan: (request, steps before it arrives, whether it is cancelled once it runs) per arrival. The pool holds
    about two prompts, so sequences are preempted and prefilled again; the others must answer as they do alone."""
    probe = new_engine(runtime)
    longest = max(probe.new_sequence(r).prompt_tokens + r.sampling.max_tokens for r in requests)
    # full prefills in pieces of 48 tokens: other sequences decode, grow and get preempted in between
    engine = new_engine(runtime, budget_blocks=len(probe.kv.shared) + -(-longest * 3 // 2) // 16, max_running=4,
                        prefill_chunk=48)
    live = []

    def step():
        for seq, _, doomed in live:
            if doomed and (seq.status is Status.RUNNING or (engine.prefilling and engine.prefilling[0] is seq)):
                seq.cancelled = True
        engine.step()
        check_pool(engine)

    for which, wait, cancel in plan:
        for _ in range(wait):
            step()
        live.append((engine.add(requests[which]), which, cancel))
    while engine.has_work():
        step()
    for seq, which, _ in live:
        assert seq.is_finished
        if seq.finish_reason != "cancelled":
            assert seq.output == alone[which]
    assert pool_is_empty(engine)


def test_a_pool_too_small_preempts_and_every_answer_is_as_alone(runtime, requests):
    """Two prompts in the least pool that admits the second beside the first, each then generating enough to outgrow
    it: the newer is preempted (asserted) and prefilled again, and both answer as they do alone. The pool is counted
    from the first's blocks as held, since a full prefill shares the preamble's blocks only on paths where it
    reproduces their bits (per CPU path: dtype and kernels)."""
    from dataclasses import replace

    probe = new_engine(runtime)
    shared = len(probe.kv.shared)
    # the second's admission leaves free at most the preamble blocks it was counted for but shares, and one spare;
    # both then decode n - 3 steps together, growing by 2 * ((n - 3) // 16) >= shared + 2 blocks: more than that
    n = 16 * -(-(shared + 2) // 2) + 3
    pair = [replace(requests[i], mode="full", sampling=SamplingConfig(max_tokens=n, min_tokens=n)) for i in (1, 3)]
    (want_first, held), (want_second, _) = (run_alone(runtime, r) for r in pair)
    # scheduler.next_prefill admits beside one running sequence: room for the prompt and its first token, plus one
    blocks = shared + held + probe.kv.blocks_needed(probe.new_sequence(pair[1]).prompt_rows + 1) + 1
    engine = new_engine(runtime, budget_blocks=blocks)
    seqs = [engine.add(r) for r in pair]
    while engine.has_work():
        engine.step()
        check_pool(engine)
    assert sum(seq.preemptions for seq in seqs) > 0
    assert [seq.output for seq in seqs] == [want_first, want_second]
    assert pool_is_empty(engine)


def test_a_blend_is_admitted_on_the_blocks_it_takes_beside_the_preamble_s(runtime, requests):
    """A single-turn RAG blend starts from the preamble's KV, so its table shares the preamble's blocks: admission
    counts only its own (engine/scheduler._fresh_blocks). In a pool with room for both blends to their ends but not
    for the second's whole prompt beside the first, it starts at once (before: it waited for the first to end),
    nothing is preempted, and both answer as alone."""
    from dataclasses import replace

    n = 8
    pair = [replace(requests[i], sampling=SamplingConfig(max_tokens=n, min_tokens=n)) for i in (0, 4)]  # blends
    probe = new_engine(runtime)
    shared, (want, held) = len(probe.kv.shared), run_alone(runtime, pair[0])
    rows = [probe.new_sequence(r).prompt_rows for r in pair]
    own = [probe.kv.blocks_needed(r + n) - shared for r in rows]  # each one's blocks at its answer's end
    blocks = shared + sum(own) + 1  # one spare
    assert blocks - shared - held - 1 < probe.kv.blocks_needed(rows[1] + 1)  # its whole prompt would not fit
    engine = new_engine(runtime, budget_blocks=blocks)
    first = engine.add(pair[0])
    engine.step()
    second = engine.add(pair[1])
    engine.step()
    assert first.status is Status.RUNNING and second.status is Status.RUNNING
    while engine.has_work():
        engine.step()
        check_pool(engine)
    assert first.output == want and second.output == run_alone(runtime, pair[1])[0]
    assert not first.preemptions and not second.preemptions and pool_is_empty(engine)


def run_alone(runtime, request: Request) -> tuple[list[int], int]:
    """A request's answer on its own, and the blocks it holds after its first step (its prompt's and first
    token's, less the preamble's it shares)."""
    engine = new_engine(runtime)
    seq = engine.add(request)
    engine.step()
    held = engine.sequence_blocks
    while engine.has_work():
        engine.step()
    return seq.output, held


def test_live_reordering_serves_the_cached_prompt_first(runtime, requests):
    """RAGCache's reordering in the engine (store/tiers/reorder.next_index): of two waiting prompts, the one whose
    chunks the memory tiers hold goes first, though it came second; with a window of 0, first come first served."""
    from kvrag.engine.memory import build_cache

    cold, hot = requests[0], requests[2]  # both blended over chunks of their own
    order = {}
    for window in (8, 0):
        prefiller = Prefiller.open(runtime, None, cache=build_cache(runtime, "fp16", host_cache="64MiB"))
        engine = LLMEngine(prefiller, EngineConfig(1 << 28, 16, SchedulerConfig(4, reorder_window=window)))
        run(engine, [hot])  # its chunks are in the tiers now
        assert prefiller.source.order_priority(hot.chunks) > prefiller.source.order_priority(cold.chunks)
        first, second = engine.add(cold), engine.add(hot)
        engine.step()  # one prefill a step: the one the scheduler chose
        order[window] = [s for s in (first, second) if s.output or s.status is Status.RUNNING]
        while engine.has_work():
            engine.step()
    # by their chunks: the engine fills in the model's rule where a request leaves it to the default
    assert [s.request.chunks for s in order[8]] == [hot.chunks]
    assert [s.request.chunks for s in order[0]] == [cold.chunks]


def pool_is_empty(engine: LLMEngine) -> bool:
    return engine.kv.pool.num_free == engine.kv.pool.num_blocks - len(engine.kv.shared)


def test_a_prefill_that_raises_ends_its_request_with_the_error(runtime, requests, monkeypatch):
    """A fault in a prefill that is not a KvragError ends that request with its error: the request is off the
    queue and not yet running then, where the loop's failure path does not look, and it used to wait forever."""
    engine = new_engine(runtime)

    def broken(*args, **kwargs):
        raise RuntimeError("a fault")

    monkeypatch.setattr(engine.prefiller, "prefill", broken)
    seq = engine.add(requests[0])  # blend: one prefill call
    while engine.has_work():
        engine.step()
    assert seq.finish_reason == "error" and seq.error == "RuntimeError: a fault" and seq.done.is_set()


def test_a_prompt_the_pool_cannot_hold_is_refused_with_one_line(runtime, requests):
    from kvrag.errors import KvragError

    engine = new_engine(runtime, budget_blocks=4)
    with pytest.raises(KvragError, match="needs more KV than the pool"):
        engine.add(requests[0])
    assert not engine.has_work()


def test_a_long_full_prefill_runs_in_pieces_while_others_decode(runtime, requests, alone):
    """With prefill_chunk, a full prefill runs a piece a step and a running sequence keeps decoding in between;
    both answers are the ones each gives alone (the pieces' K/V equal one pass's: tests/test_chunked_prefill.py)."""
    engine = new_engine(runtime, prefill_chunk=48)
    longest = max(range(len(requests)), key=lambda i: requests[i].sampling.max_tokens)
    full = next(i for i, r in enumerate(requests) if r.mode == "full")
    a = engine.add(requests[longest])
    engine.step()  # a prefills and decodes its second token
    b = engine.add(requests[full])
    assert b.prompt_tokens > 2 * 48
    decoded_between_pieces = 0
    while engine.has_work():
        before = len(a.output)
        engine.step()
        decoded_between_pieces += engine.prefilling is not None and len(a.output) > before
    assert decoded_between_pieces >= 2 and b.first_token_at > a.first_token_at
    assert a.output == alone[longest] and b.output == alone[full]


def test_the_engine_blends_with_the_rule_the_model_check_chose(runtime, requests):
    """EngineConfig.selection (the rule the model's check passed with, api.KVRag sets it): a blend asking for the
    default rule runs that one, and gives the first token's logits the prefiller gives for it; one that names a rule
    keeps it, the default's own name included."""
    from dataclasses import replace

    blend = next(r for r in requests if r.mode == "blend" and len(r.chunks) == 3)
    blend = replace(blend, keep_first_logits=True, sampling=SamplingConfig(max_tokens=1))
    c = runtime.model.cfg
    block = 16 * 2 * c.n_layers * c.n_kv_heads * c.head_dim * runtime.model.dtype.itemsize
    prefiller = Prefiller.open(runtime, None)
    engine = LLMEngine(prefiller, EngineConfig(4096 * block, 16, selection="query"))
    chunks = [(cid, list(ids)) for cid, ids in blend.chunks]
    expected = {rule: prefiller.prefill(chunks, blend.question, "blend", replace(blend.blend, selection=rule)).logits
                for rule in ("query", "cacheblend", "chunks")}
    assert not torch.equal(expected["query"], expected["cacheblend"])  # the rules pick other rows here
    assert not torch.equal(expected["query"], expected["chunks"])
    named = {rule: replace(blend, blend=replace(blend.blend, selection=rule)) for rule in ("cacheblend", "chunks")}
    # "chunks" is the default rule's name: named, it runs as named (it used to be taken for the default)
    for rule, request in (("query", blend), *named.items()):
        seq = engine.add(request)
        while engine.has_work():
            engine.step()
        torch.testing.assert_close(seq.first_logits, expected[rule], rtol=1e-4, atol=2e-4)


FAULTS = {  # each step between a prefill and the running queue, by what the engine calls there
    "first token": lambda engine, seq: setattr(engine, "_choose", _raises),
    "listener": lambda engine, seq: setattr(seq, "listener", _raises),
    "passage keeper": lambda engine, seq: setattr(engine, "_admit", _raises),
    "memory tiers": lambda engine, seq: setattr(engine.prefiller.source, "fill_cache", _raises),
    "write-back": lambda engine, seq: setattr(engine.writes, "store_computed", _raises),
    "prefix insert": lambda engine, seq: setattr(engine.kv.prefix, "insert", _raises),
    "pool admission": lambda engine, seq: setattr(engine.kv, "admit", _raises),
}


def _raises(*args, **kwargs):
    raise RuntimeError("a fault")


@pytest.mark.parametrize("where", list(FAULTS))
def test_a_fault_after_the_prefill_ends_that_request_and_frees_its_blocks(runtime, requests, alone, where):
    """Whatever raises between a prefill and the running queue (the first token, its listener, the passage keeper,
    the tiers, the write-back queue, the prefix cache, the pool) ends that request with the error, gives its blocks
    back, and the next request answers as it does alone: the request used to be in no queue and wait forever."""
    from kvrag.tests.passages import plain_request

    engine = new_engine(runtime)
    cached = engine.add(plain_request("Name a colour."))  # framed: its blocks go to the prefix cache
    while engine.has_work():
        engine.step()
    held = engine.sequence_blocks  # the cached prompt's partial last block, which the cache cannot hand out
    for request in (requests[0], plain_request("Name a colour, then a second one.")):
        seq = engine.new_sequence(request)
        FAULTS[where](engine, seq)
        engine.scheduler.add(seq)
        while engine.has_work():
            engine.step()
        for name in ("_choose", "_admit"):
            engine.__dict__.pop(name, None)  # the engine's own methods again
        for owner, name in ((engine.prefiller.source, "fill_cache"), (engine.writes, "store_computed"),
                            (engine.kv.prefix, "insert"), (engine.kv, "admit")):
            owner.__dict__.pop(name, None)
        if seq.finish_reason != "error":  # this step is not on this request's path (a RAG prompt is not cached)
            assert where in ("prefix insert", "passage keeper") and seq.finish_reason in ("stop", "length")
            continue
        assert seq.error == "RuntimeError: a fault" and seq.done.is_set() and seq.events.qsize() >= 1
        assert engine.sequence_blocks == held, f"{where}: blocks left held"
    assert cached.finish_reason in ("stop", "length")
    assert run(engine, [requests[1]])[0] == alone[1]
