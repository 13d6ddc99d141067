"""Kept passages are evicted, not frozen (engine/kept_passages.py): PGDSF's order on a hand-computed case, and on the engine
the bound held, the evicted passage's index entry, record and KV gone, the newcomer served from the store."""

from __future__ import annotations

import pytest

from kvrag.engine.kept_passages import PassageKeeper, client_chunk_id
from kvrag.engine.llm_engine import EngineConfig, LLMEngine
from kvrag.engine.prompt_reuse import PromptSpans
from kvrag.model.prompt import encode
from kvrag.store.chunks import ChunkTable
from kvrag.store.env import StoreEnv
from kvrag.store.kv import LocalKVTable
from kvrag.tests.passages import OTHER_TASK, TASK
from kvrag.tests.passages import client_prompt as _client_prompt
from kvrag.tests.passages import plain_request as _request
from kvrag.tests.passages import run_to_end as _run
from kvrag.tests.test_prompt_reuse import _ids

# ---- the policy, by hand ------------------------------------------------------------------------------------------


@pytest.fixture
def keeper(tmp_path, smol_tokenizer):
    env = StoreEnv.open(tmp_path / "store", create=True)
    spans = PromptSpans(env)
    spans.fill()  # an empty store, indexed
    yield PassageKeeper(spans, smol_tokenizer, "fp", bound_tokens=250), ChunkTable(env)
    env.close()


def _passages(*seeds: int) -> list[tuple[tuple[int, ...], str]]:
    """100-id passages and their client chunk ids."""
    return [(ids, client_chunk_id(ids, "fp", "")) for ids in (tuple(_ids(seed, 100)) for seed in seeds)]


def test_pgdsf_evicts_the_least_used_and_the_clock_ages_the_rest(keeper):
    keeper, table = keeper
    (a, a_id), (b, b_id), (c, c_id) = _passages(1, 2, 3)
    # each kept at its second sighting: frequency 2, cost 1 ms a token -> priority 0 + 2 x 0.001
    keeper.recorded(table, a_id, a, "", seconds_per_token=1e-3)
    keeper.recorded(table, b_id, b, "", seconds_per_token=1e-3)
    keeper.used([a_id, "0" * 32, None])  # A read once more: 0.003; ids that are no kept passage change nothing
    assert keeper.make_room(50) == []  # 200 + 50 fit in 250
    assert keeper.make_room(100) == [b_id]  # 300 do not: B (0.002) goes, the clock rises to 0.002
    keeper.spans.remove(b_id)
    keeper.recorded(table, c_id, c, "", seconds_per_token=1e-3)  # 0.002 + 2 x 0.001 = 0.004: above A's 0.003
    assert keeper.make_room(100) == [a_id]
    assert keeper.stats.evicted == 2


def test_an_earlier_runs_passage_unused_here_goes_first(keeper):
    keeper, table = keeper
    (new, new_id), (old, old_id) = _passages(4, 5)
    keeper.recorded(table, new_id, new, "", seconds_per_token=1e-6)
    keeper.spans.add(old_id, old, "")  # as the store's fill finds a passage kept before a restart
    assert keeper.make_room(100) == [old_id]  # worth the clock (0) alone, whatever the newcomer's cost
    keeper.spans.remove(old_id)  # as the write-back does with each victim
    assert keeper.make_room(300) == [new_id]  # then the rest, as far as there is any
    keeper.spans.remove(new_id)
    assert keeper.make_room(251) == []  # nothing left to evict: longer than the bound is refused at its sighting
    assert keeper.sighted(tuple(_ids(6, 251)), "") is None and keeper.sighted(tuple(_ids(6, 251)), "") is None
    assert keeper.stats.refused == 1


# ---- on the engine ------------------------------------------------------------------------------------------------


def test_a_full_bound_evicts_the_least_valuable_passage_and_keeps_the_new_one(corpus, invented_items):
    env, prefiller, _ = corpus
    first, second = (" ".join(ctx["text"].split()[:60]) for ctx in invented_items[2]["ctxs"][:2])
    engine = LLMEngine(prefiller, EngineConfig(kv_budget_bytes=64 << 20))
    lengths = [len(encode(prefiller.runtime.tokenizer, text)) for text in (first, second)]
    engine.keeper.bound_tokens = max(lengths) + min(lengths) // 2  # room for one of them, not both
    table = LocalKVTable(env, prefiller.runtime.fingerprint, "fp16")

    def kept() -> dict[str, tuple[int, ...]]:
        return {r.chunk_id: r.token_ids for r in ChunkTable(env).client_records()}

    for task in (TASK, OTHER_TASK):  # seen, then computed again in another template: kept
        _run(engine, _request(_client_prompt([first], task), salt="alice"))
    (old_id, old_ids), = kept().items()
    for task in (TASK, OTHER_TASK):
        _run(engine, _request(_client_prompt([second], task), salt="alice"))
    (new_id, new_ids), = kept().items()
    assert new_id != old_id and engine.keeper.stats.evicted == 1
    assert table.missing([old_id, new_id]) == [old_id]  # the evicted passage's KV went with its record
    assert sum(len(ids) for ids in kept().values()) <= engine.keeper.bound_tokens
    assert table.missing(list(kept())) == []  # no record names missing KV
    # in another template (the same prompt again would be an exact prefix hit, served before any span)
    again = _run(engine, _request(f"Read this:\n{first}\nWho is named?", salt="alice"))
    assert again.plan.pieces is None  # the evicted passage is found no more
    hit = _run(engine, _request(f"Read this:\n{second}\nWho is named?", salt="alice"))
    assert [p.chunk_id for p in hit.plan.pieces if p.chunk_id] == [new_id]
    engine.close()


def test_an_evicted_passage_is_kept_again_at_its_next_sighting(keeper):
    """Eviction forgets a passage's sightings but one: sent again after it went, it is stored again (it used to stay
    at two or more sightings for good, and admission happens at the second alone)."""
    keeper, table = keeper
    (a, a_id), (b, b_id) = _passages(7, 8)
    assert keeper.sighted(a, "") is None and keeper.sighted(a, "") == a_id  # stored at its second sighting
    keeper.recorded(table, a_id, a, "", seconds_per_token=1e-3)
    keeper.recorded(table, b_id, b, "", seconds_per_token=2e-3)  # worth more: A goes first
    assert keeper.make_room(100) == [a_id]
    keeper.spans.remove(a_id)
    assert keeper.sighted(a, "") == a_id  # computed again, its next sighting keeps it again
    assert keeper.stats.admitted == 2


def test_a_tenant_over_its_share_evicts_its_own_passages_not_anothers(keeper):
    """Bound 250 between two tenants: 125 each. Bob's passage is the least valuable, but Alice, holding 100 and
    sending 100 more (200 > 125), makes room from her own; the store's one global bound used to let her push out
    every other tenant's passages. Bob sending a second is over his share too and makes room from his own."""
    keeper, table = keeper
    (a1, _), (b1, _), (a2, _) = _passages(11, 12, 13)
    ids = {name: client_chunk_id(p, "fp", salt) for name, p, salt in
           (("a1", a1, "alice"), ("b1", b1, "bob"), ("a2", a2, "alice"))}
    keeper.recorded(table, ids["b1"], b1, "bob", seconds_per_token=1e-4)  # cheap to compute: the least valuable
    keeper.recorded(table, ids["a1"], a1, "alice", seconds_per_token=1e-3)
    assert keeper.make_room(100, "alice") == [ids["a1"]]  # hers, though Bob's is worth less
    keeper.spans.remove(ids["a1"])
    keeper.recorded(table, ids["a2"], a2, "alice", seconds_per_token=1e-3)
    assert keeper.make_room(100, "bob") == [ids["b1"]]
