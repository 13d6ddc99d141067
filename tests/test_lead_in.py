"""A sliding-window model's chunks are stored after a lead-in of corpus text (precompute/lead_in.py): the rule by hand,
and a real precompute and `ask` on a tiny Gemma 3 (windows of 64) against chunks computed here after the same text."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from kvrag.model.files import resolve_model
from kvrag.precompute.lead_in import LEAD_IN_TOKENS, LeadIn, choose, lead_in_length
from kvrag.store.keys import is_reduced, lead_in_chunk_id
from tests.conftest import run_kvrag

LEAD = 96  # tokens: the tiny corpus is five short documents, so most chunks lie outside a lead-in this long


def test_only_a_model_whose_layers_slide_has_a_lead_in(tiny_family, smol):
    gemma = resolve_model(str(tiny_family("gemma3_text"))).config
    assert gemma.sliding_window == 64 and lead_in_length(gemma) == LEAD_IN_TOKENS
    assert lead_in_length(resolve_model(str(tiny_family("mistral_window"))).config) == LEAD_IN_TOKENS
    assert lead_in_length(smol.config) == 0


def test_the_lead_in_is_the_tail_of_the_first_passages_that_reach_it():
    passages = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    assert choose(passages, 4) == LeadIn((2, 3, 4, 5))  # 1-5 reach 4 tokens: their last 4
    assert choose(passages, 100) == LeadIn(tuple(range(1, 10)))  # a smaller corpus: all of it
    assert choose([], 4) is None
    assert choose(passages, 0) is None  # no lead-in (bench fidelity asked for one of 0 tokens and got a passage)


def test_a_chunk_whose_start_or_end_is_in_the_lead_in_is_held():
    lead = LeadIn(tuple(range(100)))
    assert lead.holds(list(range(50, 80)))
    assert lead.holds([500] * 5 + list(range(30)))  # its start cut off: its end is there
    assert not lead.holds(list(range(90, 120)))  # 90-105 and 104-119 both run past it
    assert not lead.holds(list(range(10, 20)))  # shorter than the probe: never held
    assert not lead.holds([1, 2] * 8)  # "1,2" sits in "1,2,3" but not as the run 1,2,1,2
    assert lead.variant.startswith("lead:") and not is_reduced(lead.variant) and is_reduced("keyformer:keep=0.5")


@pytest.fixture(scope="module")
def gemma_store(tiny_family, indexed_store, tmp_path_factory):
    model = tiny_family("gemma3_text")
    store = tmp_path_factory.mktemp("lead-in") / "store"
    shutil.copytree(indexed_store, store)
    out = run_kvrag("precompute", "--store", str(store), "--model", str(model), "--dtype", "float32", "--codec", "bf16",
                    "--json", env={"KVRAG_LEAD_IN": str(LEAD)})
    summary = json.loads(out.stdout)
    # two passes: every chunk after the preamble, then after the lead-in
    assert summary["computed"] == 2 * summary["indexed_chunks"] and summary["variant"].startswith("lead:")
    assert summary["forms"] == 2
    return model, store


def _open(model, store, lead: int = LEAD):
    from kvrag.engine.prefiller import Prefiller
    from kvrag.model.runtime import Runtime
    from kvrag.store.env import StoreEnv

    runtime = Runtime.load(str(model), "float32", "cpu", lead_in=lead)
    env = StoreEnv.open(store)
    return runtime, env, Prefiller.open(runtime, env, "bf16")


def test_precompute_stores_each_chunk_in_both_forms_as_a_question_computes_them(gemma_store):
    from kvrag.model.prefill import extend
    from kvrag.store.chunks import ChunkTable
    from kvrag.store.manifest import preamble_hash

    model, store = gemma_store
    runtime, env, prefiller = _open(model, store)
    with env:
        source = prefiller.source
        lead, far, near = source.lead_in, source.table, source.near_table
        assert lead is not None and len(lead.ids) == LEAD and far.variant == lead.variant and near.variant == ""
        record = near.record(lead_in_chunk_id(preamble_hash(runtime.prompts.template.preamble)))
        assert record is not None and tuple(int(t) for t in record.token_ids) == lead.ids
        records = ChunkTable(env).get_many(sorted(ChunkTable(env).ids()))
        held = [r for r in records if lead.holds(r.token_ids)]
        after = [r for r in records if not lead.holds(r.token_ids)]
        ids = [r.chunk_id for r in records]
        assert held and len(after) >= 3 and far.missing(ids) == [] and near.missing(ids) == []
        with torch.inference_mode():
            for r in after[:3] + held[:1]:
                alone = extend(runtime.model, prefiller.preamble, runtime.ids_tensor(list(r.token_ids)))[1]
                computed = source.compute_chunk("again-" + r.chunk_id, r.token_ids)[0]  # the on-the-fly rule
                for table, want in ((far, computed), (near, alone)):
                    got = table.get_layer(r.chunk_id, 3, expect_token_ids=r.token_ids)  # a global layer
                    for stored, ref in ((got.k, want.k[3]), (got.v, want.v[3])):
                        err = (torch.as_tensor(np.asarray(stored, dtype=np.float32)) - ref).norm() / ref.norm()
                        assert err < 1e-2, (r.chunk_id, err)  # bf16 storage against float32
                moved = (alone.v[3] - computed.v[3]).norm() / computed.v[3].norm()
                assert (moved > 0.05) if r in after else (moved < 1e-6), (r.chunk_id, moved)


def test_a_chunk_in_the_first_window_reads_the_form_after_the_preamble(gemma_store):
    from kvrag.model.prefill import extend

    model, store = gemma_store
    runtime, env, prefiller = _open(model, store)
    with env:
        source, n_pre = prefiller.source, len(prefiller.preamble)
        chunks = [(r.chunk_id, list(r.token_ids)) for r in _records(env) if not source.lead_in.holds(r.token_ids)][:3]
        assert n_pre + len(chunks[0][1]) >= source.window == 64  # the second chunk starts past the first window
        with torch.inference_mode():
            refs, _ = source.chunk_refs(chunks, start=n_pre)
            alone = extend(runtime.model, prefiller.preamble, runtime.ids_tensor(chunks[0][1]))[1]
        assert refs[0].read and torch.allclose(refs[0].in_memory.v[3], alone.v[3], rtol=0.02, atol=0.02)
        assert all(ref.in_memory is None for ref in refs[1:])  # the loader reads the lead-in's form
        forms = source.forms()  # what a bench report says of them
        assert forms["stored"] == ["after_preamble", "after_lead_in"] and forms["lead_in_tokens"] == LEAD
        assert forms["read"] == {"after_preamble": 1, "after_lead_in": 2}
        # the first chunk follows the preamble (65 tokens of SmolLM2's template): that form is exact there; elsewhere
        # a chunk reads it where its first rows' windows reach the prompt's start
        assert n_pre == 65 and source.near(63) and not source.near(64) and not source.near(n_pre + 1)


def _records(env):
    from kvrag.store.chunks import ChunkTable

    return ChunkTable(env).get_many(sorted(ChunkTable(env).ids()))


def test_a_blend_over_lead_in_chunks_reads_the_store_alone_and_ratio_one_is_full_prefill(gemma_store):
    from kvrag import KVRag

    model, store = gemma_store
    options = {"k": 3, "relative_cutoff": 0, "min_score": 0, "max_tokens": 6}
    with KVRag(store, model=str(model), dtype="float32", host_cache="0", codec="bf16", lead_in=LEAD) as rag:
        full = rag.ask("Which lake is the deepest?", mode="full", **options)
        whole = rag.ask("Which lake is the deepest?", ratio=1.0, **options)
        assert whole.computed_chunks == [] and whole.token_ids == full.token_ids
        blended = rag.ask("Which lake is the deepest?", **options)
        assert blended.computed_chunks == [] and 0 < blended.recomputed_chunk_tokens < blended.chunk_tokens
        assert {s["tier"] for s in blended.to_json()["sources"]} == {"store"}


def test_gc_keeps_the_lead_in_and_verify_finds_the_variant_whole(gemma_store, kvrag):
    model, store = gemma_store
    kvrag("store", "gc", "--store", str(store))
    verify = kvrag("store", "verify", "--store", str(store))
    assert "no problems" in verify.stdout, verify.stdout
    runtime, env, prefiller = _open(model, store)
    with env:
        assert prefiller.source.lead_in is not None and len(prefiller.source.lead_in.ids) == LEAD


def test_model_info_says_which_layers_slide_and_what_the_blend_does(tiny_family, smol, kvrag):
    gemma = json.loads(kvrag("model", "info", "--model", str(tiny_family("gemma3_text")), "--json").stdout)
    assert gemma["layers"] == {"window": 64, "sliding": [0, 2], "global": [1, 3]}
    assert gemma["blend"]["lead_in"] == LEAD_IN_TOKENS and not gemma["blend"]["exact_first_chunk"]
    plain = json.loads(kvrag("model", "info", "--model", str(smol.path), "--json").stdout)
    assert plain["layers"]["sliding"] == [] and plain["blend"]["lead_in"] == 0 and plain["blend"]["exact_first_chunk"]
    off = json.loads(kvrag("model", "info", "--model", str(tiny_family("gemma3_text")), "--json",
                           env={"KVRAG_LEAD_IN": "0"}).stdout)
    assert off["blend"]["lead_in"] == 0


def test_a_plain_prompt_s_passage_in_the_first_window_reads_the_form_after_the_preamble(gemma_store):
    """A client's prompt carrying stored chunks (engine/prompt_reuse.py's pieces) reads the forms as retrieval does:
    a piece whose rows' windows reach the prompt's start, whole or in part, the form after the preamble; later ones
    the lead-in's, through the loader."""
    from kvrag.engine.prompt_reuse import Piece
    from kvrag.model.prefill import extend

    model, store = gemma_store
    runtime, env, prefiller = _open(model, store)
    with env:
        source, n_pre = prefiller.source, len(prefiller.preamble)
        records = [r for r in _records(env) if not source.lead_in.holds(r.token_ids)][:2]
        first, second = (list(r.token_ids) for r in records)
        part = first[5:]
        chunks = [(f"{records[0].chunk_id}[5:]", part), (records[1].chunk_id, second)]
        pieces = [Piece(records[0].chunk_id, 5, tuple(first)), Piece(records[1].chunk_id, 0, tuple(second))]
        with torch.inference_mode():
            refs, tiers = source.piece_refs(chunks, pieces, start=n_pre)
            alone = extend(runtime.model, prefiller.preamble, runtime.ids_tensor(first))[1]
        assert source.near(n_pre) and not source.near(n_pre + len(part))
        assert refs[0].read and tiers == ["store", "store"]
        torch.testing.assert_close(refs[0].in_memory.v[3], alone.v[3][5:], rtol=0.02, atol=0.02)
        assert refs[1].in_memory is None  # the loader reads the lead-in's form


def test_the_lead_in_is_never_a_client_s_passage(tmp_path):
    """Chunk ids sort a client's kept passage first; the lead-in is still the corpus's."""
    from kvrag.precompute.lead_in import corpus_passages
    from kvrag.store.chunks import CLIENT_DOC, ChunkRecord, ChunkTable
    from kvrag.store.env import StoreEnv

    with StoreEnv.open(tmp_path / "store", create=True) as env:
        table = ChunkTable(env)
        table.put_records([ChunkRecord("00" * 16, CLIENT_DOC + "bob", "", "secret", 0, 6, (7, 7, 7)),
                           ChunkRecord("ff" * 16, "doc", "", "corpus", 0, 6, (1, 2, 3))])
        assert list(corpus_passages(table)) == [(1, 2, 3)]
        assert choose(corpus_passages(table), 2) == LeadIn((2, 3))


def _copy(gemma_store, tmp_path):
    model, store = gemma_store
    shutil.copytree(store, tmp_path / "store")
    return model, tmp_path / "store"


def test_a_lead_in_holding_a_client_s_passage_goes_at_gc_with_its_chunks(gemma_store, tmp_path, kvrag):
    """A store whose lead-in an earlier release chose from a tenant's kept passage: `gc --client-passages` drops the
    passage, the lead-in and every chunk computed after it (they carry the tenant's text); the forms after the
    preamble stay."""
    from kvrag.store.chunks import CLIENT_DOC, ChunkRecord, ChunkTable

    model, store = _copy(gemma_store, tmp_path)
    runtime, env, prefiller = _open(model, store)
    with env:
        lead = prefiller.source.lead_in
        ChunkTable(env).put_records([ChunkRecord("ab" * 16, CLIENT_DOC + "bob", "", "t", 0, 1, lead.ids[10:40])])
    before = json.loads(kvrag("store", "stats", "--store", str(store), "--json").stdout)["groups"]
    out = json.loads(kvrag("store", "gc", "--store", str(store), "--client-passages", "--json").stdout)
    after = json.loads(kvrag("store", "stats", "--store", str(store), "--json").stdout)["groups"]
    assert out["dropped_lead_ins"] == 1
    variants = [g for g in before if g["variant"].startswith("lead:")]
    assert len(variants) == 1 and out["dropped_chunks"] == variants[0]["chunks"] + 1  # + the lead-in's record
    assert [g["variant"] for g in after] == [""] and after[0]["chunks"] == before[0]["chunks"]
    assert "no problems" in kvrag("store", "verify", "--store", str(store)).stdout


def test_chunks_after_a_lead_in_the_model_no_longer_has_fail_verify_and_go_at_gc(gemma_store, tmp_path, kvrag):
    from kvrag.store.kv import LocalKVTable
    from kvrag.store.manifest import preamble_hash

    model, store = _copy(gemma_store, tmp_path)
    runtime, env, prefiller = _open(model, store)
    with env:  # the lead-in's record lost (or replaced by another): its variant is read by no one
        LocalKVTable(env, runtime.fingerprint, "bf16").delete_chunk(
            lead_in_chunk_id(preamble_hash(runtime.prompts.template.preamble)))
    verify = kvrag("store", "verify", "--store", str(store), "--json", check=False)
    problems = json.loads(verify.stdout)["problems"]
    assert verify.returncode != 0 and problems and all("lead-in the model no longer has" in p["reason"]
                                                       and p["variant"].startswith("lead:") for p in problems)
    kvrag("store", "gc", "--store", str(store))
    assert "no problems" in kvrag("store", "verify", "--store", str(store)).stdout
    groups = json.loads(kvrag("store", "stats", "--store", str(store), "--json").stdout)["groups"]
    assert [g["variant"] for g in groups] == [""]
