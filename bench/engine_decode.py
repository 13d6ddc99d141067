"""`kvrag bench engine`: the resident engine's aggregate decode speed by batch size and context, against the floor.

For each context, one prompt of random tokens is prefilled once and its KV admitted into the engine's pool as B
separate sequences (each its own copy, as B different prompts would be); then the engine's own `step()` decodes
all of them together. A step reads every weight once and each sequence's K/V once, so no step beats
(weight bytes + B x KV bytes) / (read bandwidth): the floor. Medians over rounds, since the machine may be shared.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from kvrag.bench.decode import bytes_per_token, read_bandwidth
from kvrag.engine.llm_engine import EngineConfig, LLMEngine
from kvrag.engine.prefiller import Prefiller
from kvrag.engine.scheduler import SchedulerConfig
from kvrag.engine.sequence import Request, Sequence
from kvrag.model.prefill import prefill
from kvrag.model.runtime import Runtime
from kvrag.model.sampling import SamplingConfig


@dataclass
class Point:
    context: int
    batch: int
    step_ms: float  # median over rounds of a decode step of the whole batch
    floor_ms: float  # bytes the step must read / read bandwidth
    tokens_per_s: float  # aggregate: batch / step

    @property
    def over_floor(self) -> float:
        return self.step_ms / self.floor_ms


def measure(runtime: Runtime, contexts: list[int], batches: list[int], steps: int, rounds: int,
            native: bool = True, progress=print) -> tuple[list[Point], float, str]:
    """Every (context, batch) point; also the read bandwidth (bytes/s) and which decode path ran."""
    model = runtime.model
    bandwidth = read_bandwidth()
    per_token_kv = bytes_per_token(model, 1) - bytes_per_token(model, 0)
    points, path = [], "?"
    for context in contexts:
        prefiller = Prefiller.open(runtime, None)
        prefiller.stop_ids = set()  # every sequence decodes exactly the steps asked for
        budget = (max(batches) + 1) * (context + steps * rounds + 64) * per_token_kv
        engine = LLMEngine(prefiller, EngineConfig(budget, scheduler=SchedulerConfig(max(batches)), native=native))
        path = "native" if engine.decoder.native is not None else "torch"
        ids = torch.randint(0, model.cfg.vocab_size, (context,), generator=torch.Generator().manual_seed(context))
        _, cache = prefill(model, ids, extra=0)
        for batch in batches:
            seqs = [_adopt(engine, cache, context, steps * (rounds + 1)) for _ in range(batch)]
            engine.step()  # warm: buffers, the first touch of new blocks
            times = []
            for _ in range(rounds):
                start = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                times.append((time.perf_counter() - start) / steps)
            step_s = statistics.median(times)
            floor_s = (bytes_per_token(model, 0) + batch * per_token_kv * (context + steps * rounds // 2)) / bandwidth
            points.append(Point(context, batch, step_s * 1e3, floor_s * 1e3, batch / step_s))
            progress(f"context {context} batch {batch}: {batch / step_s:.1f} tokens/s, step {step_s * 1e3:.1f} ms, "
                     f"{step_s / floor_s:.2f}x the floor")
            for seq in seqs:
                seq.cancelled = True
            engine.step()  # finishes them: their blocks go back to the pool
    return points, bandwidth, path


def _adopt(engine: LLMEngine, cache, length: int, max_tokens: int) -> Sequence:
    """A running sequence whose prompt KV is `cache`'s first `length` rows, as if prefilled."""
    request = Request("", (), "full", sampling=SamplingConfig(max_tokens=max_tokens))
    seq = Sequence(-1, request, length)
    seq.table, seq.length = engine.kv.admit(cache, length), length
    seq.output.append(int(torch.randint(0, engine.model.cfg.vocab_size, (1,))))
    engine.scheduler.start(seq)
    return seq


def table(points: list[Point], bandwidth: float, path: str, cpu: str) -> str:
    """The report as a markdown table, with each point's speedup over batch 1 at its context."""
    base = {p.context: p.tokens_per_s for p in points if p.batch == 1}
    lines = [f"decode path: {path}; read bandwidth {bandwidth / 1e9:.1f} GB/s; {cpu}", "",
             "| context | batch | tokens/s (all sequences) | × batch 1 | step | floor | step ÷ floor |",
             "|---|---|---|---|---|---|---|"]
    for p in points:
        speedup = f"{p.tokens_per_s / base[p.context]:.2f}" if p.context in base else "–"
        lines.append(f"| {p.context} | {p.batch} | {p.tokens_per_s:.1f} | {speedup} | {p.step_ms:.1f} ms | "
                     f"{p.floor_ms:.1f} ms | {p.over_floor:.2f}× |")
    return "\n".join(lines)
