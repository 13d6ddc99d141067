"""The engine on a thread of its own: any thread submits, cancels and reads streams; one thread steps.

Submitted sequences reach the engine through an inbox drained before each step, so the scheduler's queues are
only ever touched by the engine's thread. With `max_waiting` set, a submission is refused (QueueFull) while that
many requests wait, counting those still in the inbox. An unexpected error in a step fails the sequences then in
the engine (each with the error's message) and the loop goes on with the next requests.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from kvrag.engine.llm_engine import LLMEngine
from kvrag.engine.scheduler import QueueFull
from kvrag.engine.sequence import Request, Sequence


class EngineLoop:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: queue.SimpleQueue[Sequence] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._lock = threading.Lock()  # a submission and close, or two submissions against the bound, in turn
        self._thread = threading.Thread(target=self._run, name="kvrag-engine", daemon=True)
        self._thread.start()

    def submit(self, request: Request, listener: Callable[[], None] | None = None) -> Sequence:
        """Queue a request (KvragError at once when it cannot run here, QueueFull when the queue is full); its
        tokens arrive on `seq.events`, and `listener` (if any) is called from the engine's thread after each."""
        seq = self.engine.new_sequence(request)
        seq.listener = listener
        with self._lock:
            if self._stopping:
                raise RuntimeError("the engine is closed")
            bound = self.engine.scheduler.config.max_waiting
            if bound and self.waiting() >= bound:
                raise QueueFull(f"{bound} requests are already waiting; try again shortly")
            self._inbox.put(seq)
        self._wake.set()
        return seq

    def waiting(self) -> int:
        """Requests waiting for a prefill, those not yet taken from the inbox included (any thread)."""
        # the scheduler's queue first: one moved from the inbox in between is missed once, never counted twice
        return len(self.engine.scheduler.waiting) + self._inbox.qsize()

    def running(self) -> int:
        return len(self.engine.scheduler.running)

    def cancel(self, seq: Sequence) -> None:
        """Finish a sequence at the engine's next step (its blocks go back to the pool)."""
        seq.cancelled = True
        self._wake.set()

    def close(self, timeout: float | None = None) -> None:
        """Cancel what is queued or running, then stop the thread."""
        with self._lock:
            self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        engine = self.engine
        while True:
            while not self._inbox.empty():
                engine.scheduler.add(self._inbox.get())
            if self._stopping:
                for seq in engine.sequences():
                    seq.cancelled = True
                if engine.has_work():
                    engine.step()  # finishes every cancelled sequence
                return
            if not engine.has_work():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                engine.step()
            except Exception as exc:  # noqa: BLE001 - a failed step must not stop the other requests for good
                self._fail_all(exc)

    def _fail_all(self, exc: Exception) -> None:
        logging.getLogger("kvrag.engine").exception("an engine step failed; its sequences end with the error")
        engine = self.engine
        for seq in engine.sequences():
            seq.error = f"{type(exc).__name__}: {exc}"
            engine.fail(seq)
