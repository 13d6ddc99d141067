"""Dynamic speculative pipelining (RAGCache §5.3): prefill on a staged search's early top-k instead of waiting.

An IVF search runs in stages (corpus/staged_search.py); the last stage is the full search's result. When a stage
brings other chunks than the one before it and no request waits for the engine, a prefill starts on them at once;
a later stage with other chunks cancels it (a guess still waiting is dropped before it costs anything) and may start
another. At the last stage the guess is kept when its chunks are the final ones, else cancelled and the final
request submitted. The search's time overlaps the prefill whenever an early stage already has the final chunks.

A wrong guess that is already prefilling finishes its prefill step before it is cancelled: on a CPU, where a prefill
costs far more than a search, that can delay the real one. Hence off by default (KVRag(speculate=True)).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvrag.engine.loop import EngineLoop
from kvrag.engine.sequence import Request, Sequence
from kvrag.errors import KvragError


@dataclass(frozen=True)
class Stage:
    chunk_ids: tuple[str, ...]  # this stage's top-k after the cutoff, best first
    request: Callable[[], Request]  # the request those chunks make (built only when submitted)
    final: bool


class Speculator:
    def __init__(self, loop: EngineLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self.counts = {"started": 0, "kept": 0, "dropped": 0}  # speculative prefills, read by /metrics

    def submit(self, stages: Iterable[Stage], listener, start: float) -> tuple[Sequence, float]:
        """Run the stages and return the sequence answering the final one, with the seconds from `start` until it
        was submitted (the retrieval its TTFT waited for)."""
        guess: tuple[tuple[str, ...], Sequence, float] | None = None  # chunks, sequence, retrieval it waited for
        for stage in stages:
            if stage.final:
                if guess is not None and guess[0] == stage.chunk_ids:
                    self._count("kept")
                    return guess[1], guess[2]
                self._drop(guess)
                return self.loop.submit(stage.request(), listener), time.perf_counter() - start
            if self.loop.waiting() == 0:  # room: nothing else waits for a prefill
                self._drop(guess)
                guess = self._start(stage, listener, start)
        raise RuntimeError("a staged search ended without a final stage")

    def _start(self, stage: Stage, listener, start: float):
        try:
            seq = self.loop.submit(stage.request(), listener)
        except KvragError:  # a full queue, or chunks too long to run: the final stage says what it says
            return None
        self._count("started")
        return stage.chunk_ids, seq, time.perf_counter() - start

    def _drop(self, guess) -> None:
        if guess is not None:
            self.loop.cancel(guess[1])
            self._count("dropped")

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1
