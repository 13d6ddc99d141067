"""Writes off the engine's thread (engine/write_back.py): while the store's writer is held up, the engine goes on
answering; once it is free, the kept passage is stored whole. And the store's gate (store/env.py): the map grows only
once no transaction of this process is open, a reader's views staying valid meanwhile."""

from __future__ import annotations

import threading
import time

import pytest

from kvrag.engine.llm_engine import EngineConfig, LLMEngine
from kvrag.engine.prefiller import Prefiller
from kvrag.engine.sequence import Request
from kvrag.kernels import quant
from kvrag.model.runtime import Runtime
from kvrag.model.sampling import SamplingConfig
from kvrag.store.chunks import ChunkTable, chunk_id_for
from kvrag.store.env import INITIAL_MAP_SIZE, StoreEnv
from kvrag.store.kv import LocalKVTable
from kvrag.tests.passages import OTHER_TASK
from kvrag.tests.passages import client_prompt as _client_prompt
from kvrag.tests.passages import plain_request as _request


def _answer(engine: LLMEngine, request):
    seq = engine.add(request)
    while not seq.done.is_set():
        engine.step()
    return seq


def test_the_engine_answers_while_the_store_writer_is_held_up(corpus, invented_items):
    env, prefiller, texts = corpus
    engine = LLMEngine(prefiller, EngineConfig(kv_budget_bytes=64 << 20))
    passage = " ".join(invented_items[3]["ctxs"][0]["text"].split()[:60])
    _answer(engine, _request(_client_prompt([passage]), salt="alice"))
    held = env.env.begin(write=True)  # another writer of this store holds LMDB's write lock
    try:
        second = _answer(engine, _request(_client_prompt([passage], OTHER_TASK), salt="alice"))  # its second sighting
        assert second.finish_reason in ("stop", "length") and engine.keeper.stats.admitted == 1
        # a stored passage's question and a plain chat both answered with the write still waiting
        for request in (_request(_client_prompt([texts[0]])), _request("Say hello.")):
            assert _answer(engine, request).finish_reason in ("stop", "length")
        assert engine.writes.pending() and ChunkTable(env).client_records() == []
    finally:
        held.abort()
    engine.writes.drain()
    (record,) = ChunkTable(env).client_records()
    assert LocalKVTable(env, prefiller.runtime.fingerprint, "fp16").missing([record.chunk_id]) == []
    engine.close()


def test_the_map_grows_only_after_an_open_reader_closes(tmp_path):
    env = StoreEnv.open(tmp_path / "store", create=True)
    db = env.db("meta")
    env.write(lambda txn: txn.put(b"first", b"x" * 4096, db=db))
    big = b"y" * (1 << 20)

    def fill(txn):  # past the initial map: LMDB says the map is full, the env grows it and runs this again
        for i in range(INITIAL_MAP_SIZE // len(big) + 8):
            txn.put(b"big%d" % i, big, db=db)

    with env.reader(buffers=True) as txn:
        view = txn.get(b"first", db=db)
        writer = threading.Thread(target=env.write, args=(fill,))
        writer.start()
        deadline = time.monotonic() + 60
        while not env._gate.resizing and writer.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert env._gate.resizing and writer.is_alive()  # the resize waits for this reader
        assert env.env.info()["map_size"] == INITIAL_MAP_SIZE
        assert bytes(view) == b"x" * 4096
    writer.join(60)
    assert not writer.is_alive() and env.env.info()["map_size"] > INITIAL_MAP_SIZE
    assert env.read(lambda txn: txn.get(b"big3", db=db)) == big
    env.close()


def test_a_failed_job_is_counted_as_failed_not_done(corpus, invented_items, monkeypatch):
    """A write that raises (a full disk, a bad value) is logged and counted `failed`, and nothing is recorded for it:
    /metrics used to count it `done`, as if its chunk had been stored."""
    env, prefiller, _ = corpus
    engine = LLMEngine(prefiller, EngineConfig(kv_budget_bytes=64 << 20))
    passage = " ".join(invented_items[4]["ctxs"][0]["text"].split()[:60])
    _answer(engine, _request(_client_prompt([passage]), salt="bob"))

    def full_disk(*args, **kwargs):
        raise OSError("no space left on device")

    monkeypatch.setattr(prefiller.source, "store_computed", full_disk)
    _answer(engine, _request(_client_prompt([passage], OTHER_TASK), salt="bob"))  # its second sighting: a keep job
    engine.writes.drain()
    assert engine.writes.failed >= 1 and engine.writes.done + engine.writes.failed == engine.writes.given
    assert ChunkTable(env).client_records() == []  # nothing recorded for the chunk that was not stored
    engine.close()


@pytest.mark.parametrize("weights", ["dense", "int8"])
def test_only_a_dense_engine_stores_the_kv_it_computes(tmp_path, tiny_llama_hd64_dir, invented_items, weights):
    """The store holds a dense model's KV (precompute runs dense, and keys carry no weights form), and a dense reader
    takes a stored first chunk as exact: an int8 engine's on-the-fly chunks are served, never stored. The real int8
    form runs where its kernel does; elsewhere the dense matrices carry int8's label, the one thing the rule reads."""
    real = weights == "dense" or quant.available()
    runtime = Runtime.load(str(tiny_llama_hd64_dir), "float32", weights=weights if real else "dense")
    runtime.model.weights = weights
    env = StoreEnv.open(tmp_path / "store", create=True)
    prefiller = Prefiller.open(runtime, env)
    ids = runtime.prompts.passage_ids("", " ".join(invented_items[2]["ctxs"][0]["text"].split()[:40]))
    chunk_id = chunk_id_for(ids, runtime.local.tokenizer_fingerprint)
    engine = LLMEngine(prefiller, EngineConfig(kv_budget_bytes=64 << 20))
    seq = _answer(engine, Request("Who is it about?", ((chunk_id, tuple(ids)),), sampling=SamplingConfig(max_tokens=2)))
    engine.writes.drain()
    assert seq.finish_reason in ("stop", "length")
    stored = not LocalKVTable(env, runtime.fingerprint, "fp16").missing([chunk_id])
    assert stored == (weights == "dense")
    assert (engine.keeper is not None) == (weights == "dense")  # kept passages live in the store too
    engine.close()
    env.close()
