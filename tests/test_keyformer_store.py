"""Reduced (Keyformer) chunks in the store: keyed apart from full ones, precomputed, resumed, verified, counted."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvrag.model.runtime import Runtime
from kvrag.precompute import keyformer
from kvrag.precompute.keyformer import KeepConfig
from kvrag.precompute.plain import precompute
from kvrag.store.chunks import ChunkTable
from kvrag.store.env import StoreEnv
from kvrag.store.keys import ChunkKey, KVKey, model_prefix, parse_key
from kvrag.store.kv import LocalKVTable
from kvrag.store.maintenance import stats, verify

VARIANT = "keyformer:keep=0.5:recent=0.3:tau=1:seed=0"


def test_full_keys_keep_their_bytes_and_variants_get_a_range_of_their_own():
    full = KVKey("fp", "fp16", "c1", 2)
    # the pre-variant layout, written out by hand: len fp, fp, codec id, len id, id, tag, u16 layer
    assert full.to_bytes() == b"\x02fp\x01\x02c1L\x00\x02"
    reduced = KVKey("fp", "fp16", "c1", 2, VARIANT)
    assert parse_key(reduced.to_bytes()) == reduced and parse_key(full.to_bytes()) == full
    assert ChunkKey.from_bytes(reduced.chunk.to_bytes()) == reduced.chunk
    assert not reduced.to_bytes().startswith(model_prefix("fp", "fp16"))
    assert reduced.to_bytes().startswith(model_prefix("fp", "fp16", VARIANT))
    assert reduced.to_bytes().startswith(model_prefix("fp"))  # gc and stats see every variant of a model
    assert not KVKey("fp", "fp16", "c1", 2, VARIANT + "x").to_bytes().startswith(model_prefix("fp", "fp16", VARIANT))


def _layers(rng, n_layers: int, n: int):
    return [tuple(rng.standard_normal((2, n, 2, 4)).astype(np.float32)) for _ in range(n_layers)]


def test_one_store_holds_full_and_reduced_side_by_side(tmp_path):
    rng = np.random.default_rng(0)
    with StoreEnv.open(tmp_path / "s", create=True) as env:
        full, reduced = LocalKVTable(env, "m", "int8"), LocalKVTable(env, "m", "int8", variant=VARIANT)
        layers, kept = _layers(rng, 3, 10), np.array([1, 4, 8, 9], dtype=np.int32)
        assert full.put_chunk("c1", list(range(10)), layers)
        assert reduced.missing(["c1"]) == ["c1"]
        assert reduced.put_chunk("c1", list(range(10)), keyformer.reduce_layers(layers, kept), kept)
        assert full.get_layer("c1", 0).positions is None
        assert reduced.get_layer("c1", 2).positions.tolist() == [1, 4, 8, 9]
        assert [c for c, _ in full.iter_chunks()] == [c for c, _ in reduced.iter_chunks()] == ["c1"]
        groups = {g.variant: g for g in stats(env).groups}
        assert groups[""].kept_tokens == 10 and groups[VARIANT].kept_tokens == 4 and groups[VARIANT].tokens == 10
        assert groups[VARIANT].bytes < groups[""].bytes
        assert verify(env).ok
        reduced.delete_chunk("c1")
        assert full.has("c1") and not reduced.has("c1")


def test_verify_flags_bad_positions_and_reduced_values_without_them(tmp_path):
    rng = np.random.default_rng(1)
    with StoreEnv.open(tmp_path / "s", create=True) as env:
        reduced = LocalKVTable(env, "m", "fp16", variant=VARIANT)
        with pytest.raises(ValueError, match="rise strictly"):
            reduced.put_chunk("c0", list(range(10)), _layers(rng, 1, 2), np.array([3, 3]))
        with pytest.raises(ValueError, match="outside"):
            reduced.put_chunk("c0", list(range(10)), _layers(rng, 1, 2), np.array([3, 10]))
        reduced.put_chunk("c1", list(range(4)), _layers(rng, 2, 4))  # no positions, in a reduced range
        report = verify(env, repair=True)
        assert {(p.chunk_id, p.variant, p.layer) for p in report.problems} == {("c1", VARIANT, 0), ("c1", VARIANT, 1)}
        assert "without token positions" in report.problems[0].reason
        assert report.repaired_chunks == 1 and not reduced.has("c1")


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir) -> Runtime:
    return Runtime.load(str(tiny_llama_dir), "float32")


@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_precompute_keep_stores_the_full_chunks_kept_rows_and_resumes(store_copy, tiny, codec):
    cfg = KeepConfig(0.5, "h2o")
    with StoreEnv.open(store_copy) as env:
        full_run = precompute(env, tiny, codec)
        first = precompute(env, tiny, codec, limit=2, keep=cfg)
        rest = precompute(env, tiny, codec, keep=cfg)
        again = precompute(env, tiny, codec, keep=cfg)
        assert (full_run.computed, first.computed, rest.computed, again.computed) == (5, 2, 3, 0)
        assert rest.variant == cfg.variant and again.already_stored == 5
        full, reduced = LocalKVTable(env, tiny.fingerprint, codec), LocalKVTable(env, tiny.fingerprint, codec, variant=cfg.variant)
        for record in ChunkTable(env).iter():
            n = len(record.token_ids)
            for layer in range(tiny.model.cfg.n_layers):
                got = reduced.get_layer(record.chunk_id, layer, expect_token_ids=record.token_ids)
                pos = got.positions
                assert len(pos) == round(0.5 * n) and pos[-1] == n - 1  # the recent window's last token
                want = full.get_layer(record.chunk_id, layer)
                atol = 0.03 if codec == "int8" else 0  # int8: K's per-channel scales span the kept rows only
                np.testing.assert_allclose(got.k, want.k[pos], atol=atol)
                np.testing.assert_allclose(got.v, want.v[pos], atol=atol)
        assert verify(env).ok


def test_reduced_positions_are_the_h2o_selection_of_the_chunk(store_copy, tiny):
    """The stored set is select(summed accumulated attention) of a fresh scoring pass (an independent recompute)."""
    from kvrag.model.prefill import extend

    cfg = KeepConfig(0.3, "h2o")
    with StoreEnv.open(store_copy) as env:
        precompute(env, tiny, "fp16", keep=cfg, limit=1)
        cid, record = next(LocalKVTable(env, tiny.fingerprint, "fp16", variant=cfg.variant).iter_chunks())
        stored = LocalKVTable(env, tiny.fingerprint, "fp16", variant=cfg.variant).get_layer(cid, 0).positions
        token_ids = ChunkTable(env).get_many([cid])[0].token_ids
    _, preamble = extend(tiny.model, None, tiny.ids_tensor(tiny.prompts.preamble_ids))
    _, scores = keyformer.score_chunk(tiny.model, preamble, tiny.ids_tensor(list(token_ids)), cfg)
    assert stored.tolist() == keyformer.select(scores.sum(dim=(0, 1)), 0.3).tolist()


def test_cli_keep_stores_apart_and_stats_show_it(store_copy, tiny_llama_dir, kvrag):
    common = ["--store", str(store_copy), "--model", str(tiny_llama_dir), "--dtype", "float32"]
    kvrag("precompute", *common, "--limit", "2")
    out = json.loads(kvrag("precompute", *common, "--keep", "0.5", "--keep-rule", "window", "--json").stdout)
    assert (out["computed"], out["variant"]) == (5, "window:keep=0.5:sinks=4")
    stats_out = json.loads(kvrag("store", "stats", "--store", str(store_copy), "--json").stdout)
    groups = {g["variant"]: g for g in stats_out["groups"]}
    assert groups[""]["chunks"] == 2 and groups["window:keep=0.5:sinks=4"]["chunks"] == 5
    assert 0.45 < groups["window:keep=0.5:sinks=4"]["kept_share"] < 0.55
    table = kvrag("store", "stats", "--store", str(store_copy)).stdout
    assert "window:keep=0.5:sinks=4" in table and "full" in table


@pytest.mark.parametrize("args,message", [(["--keep", "0"], "--keep must be in (0, 1]"),
                                          (["--keep", "1.5"], "--keep must be in (0, 1]"),
                                          (["--keep", "0.5", "--keep-rule", "lru"], "unknown keep rule")])
def test_cli_bad_keep_is_one_line_and_exit_1(monkeypatch, capsys, tmp_path, args, message):
    from kvrag.tests.conftest import run_cli_in_process

    code, out, err = run_cli_in_process(monkeypatch, capsys, "precompute_cmd", "precompute", "--store",
                                        str(tmp_path / "s"), *args)
    assert code == 1 and out == ""
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
