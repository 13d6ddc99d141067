"""Which sequence prefills this step, and room in the pool for every running sequence's next token.

Waiting requests are admitted one per step, when the pool has room for the prompt and a block per running sequence
to spare; blocks a prompt reuses that stay held anyway (a prefix hit a running sequence holds, the preamble's shared
blocks a blend starts from) take no room. Among the waiting, RAGCache's cache-aware order picks the one with the
most cached tokens per token to compute (`score`), but a request passed over `reorder_window` times goes next
(window 0: first come, first served).
Sequences preempted while running go before all others.

When a running sequence needs a block and none is free, the most recently admitted sequence is preempted: its
blocks go back to the pool and it waits at the front of the queue to be prefilled again (recompute, as vLLM and
nano-vllm do); it then re-feeds the tokens it had generated, so no request fails for lack of memory.

`max_waiting` bounds the queue: the engine's loop refuses a new request (QueueFull) while that many wait, so a
server under more load than it can serve says so at once instead of letting every request's wait grow.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvrag.config import DEFAULT_REORDER_WINDOW
from kvrag.engine.kv_pool import SequenceKV
from kvrag.engine.prefill_info import wants_exact
from kvrag.engine.sequence import Sequence, Status
from kvrag.errors import KvragError
from kvrag.kvcache.allocator import OutOfBlocks
from kvrag.store.tiers.reorder import next_index


class QueueFull(KvragError):
    """A request refused because `max_waiting` requests already wait: try again later."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_running: int = 32  # sequences decoding together: the batch's largest size
    reorder_window: int = DEFAULT_REORDER_WINDOW  # cache-aware reordering passes a request over at most this often
    max_waiting: int = 0  # requests allowed to wait for a prefill before new ones are refused (0: no bound)


class Scheduler:
    def __init__(self, kv: SequenceKV, config: SchedulerConfig, score: Callable[[Sequence], float] | None = None):
        self.kv, self.config = kv, config
        self.score = score or (lambda seq: 0.0)  # higher goes first
        self.waiting: deque[Sequence] = deque()  # in arrival order, preempted ones at the front
        self.running: list[Sequence] = []  # in admission order

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def next_prefill(self) -> Sequence | None:
        """The waiting sequence to prefill now, taken off the queue; None when none waits or the pool lacks room."""
        if not self.waiting or len(self.running) >= self.config.max_running:
            return None
        chosen = self._pick()
        spare = len(self.running)  # a block per running sequence for its next tokens, so admission never forces
        if self._fresh_blocks(chosen) > self.kv.num_free - spare and self.running:
            return None  # a preemption at once; with nothing running, try anyway (the engine preempts nothing)
        for seq in self.waiting:
            if seq is chosen:
                break
            seq.passed_over += 1
        self.waiting.remove(chosen)
        return chosen

    def _fresh_blocks(self, seq: Sequence) -> int:
        """Blocks the prompt and its first token take out of the free ones: all, less the prefix-cache blocks its head
        reuses that a running sequence holds (a cached one nothing holds is counted free, and the hit takes it), or
        for a single-turn RAG blend the preamble's blocks every table shares. The admission may still find less room
        (a full prefill's preamble computed to other bits): it then preempts (engine._start)."""
        plan, req = seq.plan, seq.request
        if plan is not None and plan.framed:
            held = self.kv.prefix.held_blocks(plan.head, req.salt, wants_exact(req))
        else:
            held = len(self.kv.shared) if req.mode != "full" and seq.prompt_rows > self.kv.shared_tokens else 0
        return self.kv.blocks_needed(seq.prompt_rows + 1) - held

    def _pick(self) -> Sequence:
        """RAGCache's order (store/tiers/reorder.next_index); a preempted sequence, at the front, goes first."""
        first, window = self.waiting[0], self.config.reorder_window
        scores = [self.score(s) for s in self.waiting] if window and not first.preemptions else []
        return self.waiting[next_index(scores, first.passed_over, window, oldest_first=bool(first.preemptions))]

    def start(self, seq: Sequence) -> None:
        seq.status = Status.RUNNING
        self.running.append(seq)

    def reserve_decode(self) -> list[Sequence]:
        """Grow every running sequence's table by the slot its next token writes, preempting the newest sequences
        while the pool is full. Returns the sequences that decode this step, in admission order."""
        ready: list[Sequence] = []
        for seq in list(self.running):
            while seq.status is Status.RUNNING:
                try:
                    self.kv.grow(seq.table)
                    ready.append(seq)
                    break
                except OutOfBlocks:
                    victim = self.running[-1]
                    self.preempt(victim)
                    if victim in ready:
                        ready.remove(victim)
        return ready

    def preempt(self, seq: Sequence) -> None:
        """Give its blocks back; it is prefilled again later and re-feeds what it had generated."""
        self.kv.free(seq.table)
        seq.table, seq.length, seq.status = None, 0, Status.WAITING
        seq.replay = max(0, len(seq.output) - 1)
        seq.preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and give its blocks back."""
        if seq.table is not None:
            self.kv.free(seq.table)
            seq.table = None
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
