"""The manifest: what a model's KV depends on is recorded, mismatches are refused, schemas migrate."""

from __future__ import annotations

import pytest

from kvrag.errors import KvragError
from kvrag.store.chunks import ChunkTable, IndexConfig
from kvrag.store.env import StoreEnv
from kvrag.store.manifest import (
    SCHEMA_KEY,
    SCHEMA_VERSION,
    check_or_record,
    ensure_schema,
    preamble_hash,
    read_manifest,
    read_manifests,
)

PREAMBLE = "<|im_start|>user\nYou will be asked a question after reading several passages.\nPassages:\n"


@pytest.fixture
def env(tmp_path):
    with StoreEnv.open(tmp_path / "store", create=True) as env:
        yield env


def _config(**changes) -> IndexConfig:
    base = dict(tokenizer_fingerprint="tok-a", passage_format="pf1", chunk_tokens=512, overlap=0,
                embedder="minilm", index_type="Flat")
    return IndexConfig(**{**base, **changes})


def test_first_use_records_and_later_uses_check(env):
    ChunkTable(env).write_config(_config())
    m = check_or_record(env, "model-a", PREAMBLE, "fp16", tokenizer_fp="tok-a")
    assert m.preamble_hash == preamble_hash(PREAMBLE) and m.codecs == ("fp16",)
    assert m.chunking == {"tokenizer_fingerprint": "tok-a", "passage_format": "pf1", "chunk_tokens": 512, "overlap": 0}
    assert read_manifest(env, "model-a") == m
    m2 = check_or_record(env, "model-a", PREAMBLE, "int8")
    assert m2.codecs == ("fp16", "int8")  # codecs share a store: recorded, not refused
    check_or_record(env, "model-b", PREAMBLE + "x", "fp16")  # so do models, each with its own preamble
    assert set(read_manifests(env)) == {"model-a", "model-b"}
    assert env.read(lambda txn: txn.get(SCHEMA_KEY, db=env.db("meta"))) == str(SCHEMA_VERSION).encode()


def test_another_preamble_is_refused(env):
    check_or_record(env, "model-a", PREAMBLE, "fp16")
    with pytest.raises(KvragError, match="another preamble.*gc --drop-model model-a"):
        check_or_record(env, "model-a", PREAMBLE.replace("several", "some"), "fp16")
    assert read_manifest(env, "model-a").preamble_text == PREAMBLE  # nothing changed


def test_other_chunking_is_refused_but_other_index_settings_are_not(env):
    table = ChunkTable(env)
    table.write_config(_config())
    check_or_record(env, "model-a", PREAMBLE, "fp16")
    table.write_config(_config(embedder="other", index_type="IVF64,Flat"))  # not chunking: fine
    check_or_record(env, "model-a", PREAMBLE, "fp16")
    table.write_config(_config(chunk_tokens=256))
    with pytest.raises(KvragError, match=r"chunk_tokens: 512 → 256.*kvrag store gc"):
        check_or_record(env, "model-a", PREAMBLE, "fp16")


def test_chunking_is_adopted_when_kv_came_before_the_index(env):
    check_or_record(env, "model-a", PREAMBLE, "fp16")
    ChunkTable(env).write_config(_config())
    assert check_or_record(env, "model-a", PREAMBLE, "fp16").chunking["chunk_tokens"] == 512


def test_a_store_indexed_by_another_tokenizer_is_refused(env):
    ChunkTable(env).write_config(_config(tokenizer_fingerprint="tok-other"))
    with pytest.raises(KvragError, match="another tokenizer"):
        check_or_record(env, "model-a", PREAMBLE, "fp16", tokenizer_fp="tok-a")
    assert read_manifests(env) == {}


def test_a_reader_is_refused_a_model_without_kv(env):
    check_or_record(env, "model-a", PREAMBLE, "fp16")
    with pytest.raises(KvragError, match="no KV for model model-b.*model-a"):
        check_or_record(env, "model-b", PREAMBLE, "fp16", record=False)
    assert check_or_record(env, "model-a", PREAMBLE, "bf16", record=False).codecs == ("bf16", "fp16")
    assert read_manifest(env, "model-a").codecs == ("fp16",)  # a reader writes nothing


# --- migrations ------------------------------------------------------------------------------------

def _migrate_1_to_2(txn, env) -> None:
    """A fake schema change: schema 1 kept a `legacy` meta key that schema 2 renames."""
    meta = env.db("meta")
    old = txn.get(b"legacy", db=meta)
    if old is not None:
        txn.put(b"renamed", old + b"!", db=meta)
        txn.delete(b"legacy", db=meta)


def _migrate_2_to_3(txn, env) -> None:
    txn.put(b"three", b"yes", db=env.db("meta"))


def test_an_older_store_is_migrated_in_order(env):
    assert ensure_schema(env) == 1
    env.write(lambda txn: txn.put(b"legacy", b"data", db=env.db("meta")))
    assert ensure_schema(env, migrations=(_migrate_1_to_2, _migrate_2_to_3)) == 3
    meta = env.db("meta")
    assert env.read(lambda txn: (txn.get(b"renamed", db=meta), txn.get(b"legacy", db=meta), txn.get(b"three", db=meta))) \
        == (b"data!", None, b"yes")
    assert ensure_schema(env, migrations=(_migrate_1_to_2, _migrate_2_to_3)) == 3  # applied once only
    assert env.read(lambda txn: txn.get(b"renamed", db=meta)) == b"data!"


def test_a_store_without_a_schema_key_is_schema_1(env):
    env.write(lambda txn: txn.put(b"legacy", b"x", db=env.db("meta")))
    assert ensure_schema(env, migrations=(_migrate_1_to_2,)) == 2
    assert env.read(lambda txn: txn.get(b"renamed", db=env.db("meta"))) == b"x!"


def test_a_failed_migration_changes_nothing(env):
    ensure_schema(env)
    env.write(lambda txn: txn.put(b"legacy", b"data", db=env.db("meta")))

    def broken(txn, env) -> None:
        raise RuntimeError("bug in migration")

    with pytest.raises(RuntimeError):
        ensure_schema(env, migrations=(_migrate_1_to_2, broken))
    meta = env.db("meta")
    assert env.read(lambda txn: (txn.get(SCHEMA_KEY, db=meta), txn.get(b"legacy", db=meta))) == (b"1", b"data")


def test_a_newer_store_is_refused(env):
    env.write(lambda txn: txn.put(SCHEMA_KEY, b"7", db=env.db("meta")))
    with pytest.raises(KvragError, match="schema 7, newer.*upgrade kvrag"):
        ensure_schema(env)
    with pytest.raises(KvragError, match="newer"):
        check_or_record(env, "model-a", PREAMBLE, "fp16")


def test_a_read_only_store_needing_migration_says_so(tmp_path):
    with StoreEnv.open(tmp_path / "s", create=True) as env:
        ensure_schema(env)
    with StoreEnv.open(tmp_path / "s", readonly=True) as env:
        assert ensure_schema(env) == 1
        with pytest.raises(KvragError, match="needs migrating from schema 1 to 2"):
            ensure_schema(env, migrations=(_migrate_1_to_2,))
