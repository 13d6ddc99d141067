"""Crashes and concurrency: several writers on one store, and writers killed with SIGKILL mid-write."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import kvrag.store.env as envmod
from kvrag.store.env import StoreEnv
from kvrag.store.kv import LocalKVTable
from kvrag.store.maintenance import verify
from kvrag.store.table import Shard

N_CHUNKS = 40


def cid(i: int) -> str:
    return f"{i:032x}"


def layers_for(i: int, n_tokens: int = 24, n_layers: int = 6):
    rng = np.random.default_rng(i)
    return [(rng.standard_normal((n_tokens, 3, 64), dtype=np.float32),
             rng.standard_normal((n_tokens, 3, 64), dtype=np.float32)) for _ in range(n_layers)]


def _worker(path: str, mode: str, index: int, out, start) -> None:
    """A precompute stand-in: `claims` and `shards` split the work, `race` lets both do everything."""
    ids = [cid(i) for i in range(N_CHUNKS)]
    computed, written = [], []
    with StoreEnv.open(path) as env:
        table = LocalKVTable(env, "model-a", "fp16")
        start.wait(timeout=30)  # both start together: a process that forks late must still find work to do
        while True:
            todo = table.missing(ids, shard=Shard(index, 2) if mode == "shards" else None)
            if not todo:
                break
            batch = table.claim(todo[:3]) if mode == "claims" else todo[:3]
            if not batch:
                time.sleep(0.005)  # the rest is claimed by the other process
                continue
            for chunk_id in batch:
                computed.append(chunk_id)
                time.sleep(0.002)  # the forward pass: it gives the other process its turn, as a real one would
                if table.put_chunk(chunk_id, list(range(24)), layers_for(int(chunk_id, 16))):
                    written.append(chunk_id)
    out.put((computed, written))


@pytest.mark.parametrize("mode", ["claims", "shards", "race"])
def test_two_processes_share_a_store(tmp_path, monkeypatch, mode):
    monkeypatch.setattr(envmod, "INITIAL_MAP_SIZE", 512 << 10)  # both grow the map while the other writes
    path = str(tmp_path / "store")
    StoreEnv.open(path, create=True).close()  # not open in this process while the workers run
    ctx = multiprocessing.get_context("fork")
    out, start = ctx.Queue(), ctx.Barrier(2)
    procs = [ctx.Process(target=_worker, args=(path, mode, i, out, start)) for i in range(2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=10)
        assert p.exitcode == 0
    (computed_a, written_a), (computed_b, written_b) = results
    assert sorted(written_a + written_b) == [cid(i) for i in range(N_CHUNKS)]  # each chunk stored exactly once
    if mode != "race":
        assert not set(computed_a) & set(computed_b)  # and computed once
        assert computed_a and computed_b  # both did some of the work
    with StoreEnv.open(path) as env:
        report = verify(env)
        assert report.ok and report.chunks == N_CHUNKS
        table = LocalKVTable(env, "model-a", "fp16")
        for i in (0, 17, N_CHUNKS - 1):
            np.testing.assert_array_equal(table.get_layer(cid(i), 5).k, layers_for(i)[5][0].astype(np.float16))


_WRITER = """
import sys
import numpy as np
import kvrag.store.env as envmod
envmod.INITIAL_MAP_SIZE = 1 << 20  # the map grows while we kill it, too
from kvrag.store.env import StoreEnv
from kvrag.store.kv import LocalKVTable

with StoreEnv.open(sys.argv[1], create=True) as env:
    table = LocalKVTable(env, "model-a", "fp16")
    ids = [f"{i:032x}" for i in range(int(sys.argv[2]))]
    for chunk_id in table.missing(ids):
        table.claim([chunk_id])
        rng = np.random.default_rng(int(chunk_id, 16))
        layers = [(rng.standard_normal((96, 3, 64), dtype=np.float32),
                   rng.standard_normal((96, 3, 64), dtype=np.float32)) for _ in range(12)]
        if table.put_chunk(chunk_id, list(range(96)), layers):
            print(chunk_id, flush=True)
"""


def test_sigkill_mid_write_leaves_whole_chunks_and_resumes(tmp_path):
    path, total = str(tmp_path / "store"), 30
    rng = random.Random(7)
    committed: list[str] = []
    for _ in range(4):  # kill it four times at a random moment, then let it finish
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, path, str(total)], stdout=subprocess.PIPE, text=True)
        for _ in range(3):
            line = proc.stdout.readline().strip()
            if line:
                committed.append(line)
        time.sleep(rng.uniform(0, 0.03))  # most likely inside encode or the write transaction
        os.kill(proc.pid, signal.SIGKILL)
        committed += [line.strip() for line in proc.stdout if line.strip()]
        proc.wait()
        with StoreEnv.open(path) as env:
            report = verify(env)
            assert report.ok, report.problems  # no chunk is half there
            stored = {c for c, _ in LocalKVTable(env, "model-a", "fp16").iter_chunks()}
            unprinted = stored - set(committed)  # killed between the commit and its print
            assert set(committed) <= stored and len(unprinted) <= 1
            committed += sorted(unprinted)
    done = subprocess.run([sys.executable, "-c", _WRITER, path, str(total)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    committed += done.stdout.split()
    assert sorted(committed) == [f"{i:032x}" for i in range(total)]  # each chunk written exactly once, over all runs
    with StoreEnv.open(path) as env:
        assert verify(env).ok
