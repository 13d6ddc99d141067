"""`kvrag store stats|verify|gc` end to end: JSON on stdout, one-line errors, exit codes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvrag.store.chunks import ChunkRecord, ChunkTable, DocChunk, DocRecord, IndexConfig
from kvrag.store.codec import HEADER_SIZE
from kvrag.store.env import StoreEnv
from kvrag.store.kv import LocalKVTable
from kvrag.store.manifest import check_or_record
from kvrag.tests.conftest import run_cli_in_process


def run(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    return run_cli_in_process(monkeypatch, capsys, "store_cmd", *args)


def cid(i: int) -> str:
    return f"{i:032x}"


@pytest.fixture
def store(tmp_path):
    """A store indexing chunks 0 and 1, with KV of chunks 0, 1, 2 for model-a."""
    path = tmp_path / "store"
    with StoreEnv.open(path, create=True) as env:
        chunks = ChunkTable(env)
        chunks.write_config(IndexConfig("tok", "pf", 512, 0))
        records = [ChunkRecord(cid(i), "d", "", "t", 0, 1, tuple(range(4))) for i in range(2)]
        chunks.put_docs([(DocRecord("d", "d.txt", "", "h", tuple(DocChunk(r.chunk_id, 0, 1, 4) for r in records)),
                          records)])
        check_or_record(env, "model-a", "preamble", "fp16")
        table = LocalKVTable(env, "model-a", "fp16")
        rng = np.random.default_rng(0)
        for i in range(3):
            table.put_chunk(cid(i), list(range(4)), [(rng.standard_normal((4, 3, 8), dtype=np.float32),) * 2] * 3)
    return path


def test_stats_json(monkeypatch, capsys, store):
    code, out, err = run(monkeypatch, capsys, "store", "stats", "--store", str(store), "--json")
    assert code == 0
    data = json.loads(out)
    (group,) = data["groups"]
    assert (group["model_fp"], group["codec"], group["chunks"], group["tokens"]) == ("model-a", "fp16", 3, 12)
    assert len(group["layer_bytes"]) == 3 and group["bytes_per_token"] > 0
    assert data["models"] == ["model-a"]
    assert err == ""  # with --json, the result is on stdout alone
    code, out, err = run(monkeypatch, capsys, "store", "stats", "--store", str(store))
    assert (code, err) == (0, "") and "model-a" in out  # without, the table: the result, on stdout too


def test_verify_fails_on_corruption_and_repair_fixes_it(monkeypatch, capsys, store):
    assert run(monkeypatch, capsys, "store", "verify", "--store", str(store))[0] == 0
    with StoreEnv.open(store) as env:
        key = LocalKVTable(env, "model-a", "fp16").key(cid(1)).layer(2).to_bytes()
        value = bytearray(env.read(lambda txn: txn.get(key, db=env.db("kv"))))
        value[HEADER_SIZE + 3] ^= 1
        env.write(lambda txn: txn.put(key, bytes(value), db=env.db("kv")))
    code, out, err = run(monkeypatch, capsys, "store", "verify", "--store", str(store), "--json")
    assert code == 1
    assert json.loads(out)["ok"] is False
    assert err.strip().splitlines()[-1].startswith("error: 1 problem(s) in 1 chunk(s)")
    code, out, err = run(monkeypatch, capsys, "store", "verify", "--store", str(store), "--repair", "--json")
    assert code == 0 and json.loads(out)["repaired_chunks"] == 1
    assert run(monkeypatch, capsys, "store", "verify", "--store", str(store))[0] == 0


def test_gc(monkeypatch, capsys, store):
    code, out, _ = run(monkeypatch, capsys, "store", "gc", "--store", str(store), "--json")
    assert code == 0 and json.loads(out)["dropped_chunks"] == 1  # chunk 2 is not indexed
    code, out, _ = run(monkeypatch, capsys, "store", "gc", "--store", str(store), "--model", "model-b", "--json")
    assert json.loads(out)["dropped_models"] == ["model-a"]
    with StoreEnv.open(store) as env:
        assert LocalKVTable(env, "model-a", "fp16").missing([cid(0), cid(1)]) == [cid(0), cid(1)]


def test_gc_without_an_index_refuses_to_drop_everything(monkeypatch, capsys, tmp_path):
    with StoreEnv.open(tmp_path / "s", create=True) as env:
        LocalKVTable(env, "model-a", "fp16").put_chunk(cid(0), [1], [(np.ones((1, 1, 2), np.float32),) * 2])
    code, _, err = run(monkeypatch, capsys, "store", "gc", "--store", str(tmp_path / "s"))
    assert code == 1 and "no chunks are indexed" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("setup", ["missing", "file", "foreign"])
def test_a_path_that_is_not_a_store_is_one_clear_line(monkeypatch, capsys, tmp_path, setup):
    target = tmp_path / "x"
    if setup == "file":
        target.write_text("hello")
    elif setup == "foreign":
        import lmdb

        with lmdb.open(str(target), max_dbs=2) as foreign, foreign.begin(write=True) as txn:
            txn.put(b"someone", b"else's")
    code, out, err = run(monkeypatch, capsys, "store", "stats", "--store", str(target))
    assert code == 1 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    assert "store" in err
