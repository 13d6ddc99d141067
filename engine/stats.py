"""The engine's counts at one moment, as one value: what the server's /health and /metrics report, read without
the server reaching into the engine's parts (another thread may change a count a moment later)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrag.engine.llm_engine import LLMEngine
from kvrag.engine.loop import EngineLoop
from kvrag.engine.speculation import Speculator


@dataclass(frozen=True)
class EngineStats:
    waiting: int  # requests waiting for a prefill
    running: int  # sequences prefilled and decoding
    free_blocks: int  # of the running sequences' KV pool
    blocks: int
    prefix_blocks: int  # pool blocks the prefix cache lists (held or evictable)
    rows_copied: int  # prompt rows copied into the pool (a prefix hit's rows are referenced, not copied)
    writes_given: int  # write-back jobs given, and done in the order given
    writes_done: int
    kept_admitted: int  # client passages kept at their second sighting, and kept ones evicted
    kept_evicted: int
    prefix_hit_rate: float  # the memory tiers' hit rates over the chunks asked for
    memory_hit_rate: float
    speculative: dict[str, int] = field(default_factory=dict)  # started, kept, dropped


def engine_stats(loop: EngineLoop, engine: LLMEngine, speculator: Speculator | None) -> EngineStats:
    keeper = engine.keeper.stats if engine.keeper is not None else None
    cache = engine.prefiller.source.cache
    tiers = cache.stats if cache is not None else None
    return EngineStats(
        waiting=loop.waiting(), running=loop.running(), free_blocks=engine.free_blocks,
        blocks=engine.kv.pool.num_blocks, prefix_blocks=len(engine.kv.prefix), rows_copied=engine.kv.copied_rows,
        writes_given=engine.writes.given, writes_done=engine.writes.done,
        kept_admitted=keeper.admitted if keeper else 0, kept_evicted=keeper.evicted if keeper else 0,
        prefix_hit_rate=tiers.prefix_hit_rate if tiers else 0.0, memory_hit_rate=tiers.memory_hit_rate if tiers else 0.0,
        speculative=dict(speculator.counts) if speculator is not None else {})
