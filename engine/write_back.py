"""The engine's writes, on a thread beside it: chunks computed on the fly, and clients' passages kept at their second
sighting (engine/kept_passages.py), computed and stored here so that no decode step or prefill waits for them.

Jobs run one at a time, in the order given. Each chunk is one LMDB transaction (store/kv.py's put_chunk), a kept
passage's record after its KV: a kill loses what was queued, never what was stored, and leaves no record naming
missing KV. The queue is bounded: a passage that finds it full is not kept this time (its next sighting offers it
again), and the engine's computed chunks wait in the chunk source until the next job takes them. Store reads and
these writes run side by side (store/env.py's TxnGate lets the map grow only between transactions).
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import torch

from kvrag.engine.chunk_source import ChunkSource
from kvrag.engine.kept_passages import PassageKeeper
from kvrag.store.chunks import ChunkTable

MAX_QUEUED = 32  # jobs waiting at once: a kept passage's KV is held in memory until it is stored


class WriteBack:
    """One engine's write-back worker; the thread starts with the first job and stops at `close`."""

    def __init__(self, source: ChunkSource, keeper: PassageKeeper | None):
        self.source, self.keeper = source, keeper
        self._jobs: queue.Queue = queue.Queue(MAX_QUEUED)
        self._thread: threading.Thread | None = None
        self._computed_queued = threading.Event()  # a "store what was computed" job is waiting: one is enough
        self._lock = threading.Lock()
        # jobs queued, those that did their work, and those that raised (done + failed >= n: the first n are over)
        self.given = self.done = self.failed = 0

    def store_computed(self) -> None:
        """Store the chunks the engine computed on the fly (and repaired), off its thread."""
        if self.source.table is None:
            self.source.store_computed()  # no store: nothing to write, only the computed copies to let go
            return
        if self._computed_queued.is_set() or not self.source.computed():
            return
        self._computed_queued.set()
        if not self._put(("computed",)):
            self._computed_queued.clear()

    def keep(self, chunk_id: str, passage: tuple[int, ...], salt: str) -> bool:
        """Compute and store a kept passage, making room first; False (not kept this time) when the queue is full."""
        return self._put(("keep", chunk_id, passage, salt))

    def call(self, job) -> bool:
        """Run job() on the worker (the prefix table's writes: engine/prefix_spill.py); False when the queue is full."""
        return self._put(("call", job))

    def pending(self) -> bool:
        """Whether a job given is not done yet."""
        return self._jobs.unfinished_tasks > 0

    def drain(self) -> None:
        """Wait until every job given so far is done."""
        self._jobs.join()

    def close(self) -> None:
        """Finish the queued jobs, then stop the thread (before the store closes)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)
            thread.join()

    def _put(self, job: tuple) -> bool:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvrag-write-back", daemon=True)
                self._thread.start()
            try:
                self._jobs.put_nowait(job)
            except queue.Full:
                return False
            self.given += 1
            return True

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                if job[0] == "computed":
                    self._computed_queued.clear()  # chunks computed from now on need a job of their own
                    self.source.store_computed()
                elif job[0] == "call":
                    job[1]()
                else:
                    self._keep(*job[1:])
                self.done += 1
            except Exception:  # noqa: BLE001 - a failed write must not stop the next ones; what was stored stays
                logging.getLogger("kvrag.engine").exception("a write-back job failed; the engine goes on")
                self.failed += 1
            finally:
                self._jobs.task_done()

    def _keep(self, chunk_id: str, passage: tuple[int, ...], salt: str) -> None:
        start = time.perf_counter()
        with torch.inference_mode():
            self.source.compute_chunk(chunk_id, passage)
        cost = (time.perf_counter() - start) / len(passage)
        table = ChunkTable(self.source.env)
        self._make_room(table, len(passage), salt)
        self.source.store_computed(only=chunk_id)
        if not self.source.table.missing([chunk_id]):  # stored (or there from before): its record may follow
            self.keeper.recorded(table, chunk_id, passage, salt, cost)
            self._make_room(table, 0, salt)  # another process kept passages meanwhile: the bound is the store's

    def _make_room(self, table: ChunkTable, tokens: int, salt: str) -> None:
        self.keeper.spans.fill()  # the store's kept passages known (every process's) before any is chosen to go
        for victim in self.keeper.make_room(tokens, salt):
            self.keeper.spans.remove(victim)  # no new plan finds it
            table.delete_records([victim])  # a record never names KV that is gone (the log tells other processes)
            self.source.evict(victim)
