"""The server's Prometheus metrics, in a registry of its own (several apps in one process never share counts).

Per request: time to first token and total latency (from the request's arrival, retrieval included), outcomes,
prompt tokens by whether their KV was reused or computed, generated tokens, and where each chunk's KV came from.
Read at each scrape: the engine's queue, running sequences, free KV-pool blocks, and the memory tiers' hit rates.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvrag.api import Generation, KVRag

SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)


class Metrics:
    def __init__(self, rag: KVRag):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram("kvrag_time_to_first_token_seconds", "Request arrival to its first token",
                              buckets=SECONDS, registry=r)
        self.latency = Histogram("kvrag_request_latency_seconds", "Request arrival to its last token",
                                 buckets=SECONDS, registry=r)
        self.requests = Counter("kvrag_requests", "Requests by endpoint and outcome", ["endpoint", "outcome"],
                                registry=r)
        self.prompt_tokens = Counter("kvrag_prompt_tokens", "Prompt tokens by how their KV was had: reused "
                                     "(stored or in a memory tier) or computed (recomputed, prefilled)", ["kv"],
                                     registry=r)
        self.generated = Counter("kvrag_generated_tokens", "Tokens generated", registry=r)
        self.chunks = Counter("kvrag_chunks", "Prompt chunks by where their KV came from: tree (the chunk "
                              "sequence reused exactly), host/gpu (a memory tier), store, computed", ["tier"],
                              registry=r)
        r.register(_EngineState(rag))

    def finished(self, endpoint: str, outcome: str, gen: Generation, arrival: float) -> None:
        """Count a request that reached the engine: its outcome, latency and tokens (none of its prompt's until
        prefilled)."""
        self.requests.labels(endpoint, outcome).inc()
        first_token_at, finished_at = gen.stamps()
        if first_token_at is not None:
            self.ttft.observe(first_token_at - arrival)
        if finished_at is not None:
            self.latency.observe(finished_at - arrival)
        prompt = gen.prompt_counts
        self.prompt_tokens.labels("reused").inc(prompt["reused"])
        self.prompt_tokens.labels("computed").inc(prompt["computed"])
        for source in gen.sources:
            if source["tier"] is not None:
                self.chunks.labels(source["tier"]).inc()
        self.generated.inc(len(gen.token_ids))

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _EngineState:
    """Gauges read from the engine at scrape time (plain counts another thread may change a moment later)."""

    def __init__(self, rag: KVRag):
        self.rag = rag

    def collect(self):
        s = self.rag.stats()
        yield GaugeMetricFamily("kvrag_queue_length", "Requests waiting for a prefill", value=s.waiting)
        yield GaugeMetricFamily("kvrag_running_sequences", "Sequences prefilled and decoding", value=s.running)
        yield GaugeMetricFamily("kvrag_kv_pool_free_blocks", "Free blocks of the running sequences' KV pool",
                                value=s.free_blocks)
        yield GaugeMetricFamily("kvrag_kv_pool_blocks", "Blocks of the running sequences' KV pool", value=s.blocks)
        yield GaugeMetricFamily("kvrag_prefix_cache_blocks", "Pool blocks the prefix cache lists (held or evictable)",
                                value=s.prefix_blocks)
        yield _family(CounterMetricFamily, "kvrag_kv_rows_copied", "Rows of KV copied: a prompt's into the pool "
                      "(a prefix hit's rows are referenced, not copied), and a cached head's out of it, gathered or "
                      "packed into the row kernel's workspace, each layer's read counted", "how",
                      {"admitted": s.rows_admitted, "gathered": s.rows_gathered, "packed": s.rows_packed})
        yield _family(CounterMetricFamily, "kvrag_prefix_store_blocks", "Prefix cache blocks spilled to the store's "
                      "prefix table, and read back into the pool from it (engine/prefix_spill.py)", "event",
                      {"saved": s.prefix_saved, "restored": s.prefix_restored})
        yield _family(CounterMetricFamily, "kvrag_write_back_jobs", "Jobs of the write-back worker (kept passages, "
                      "chunks computed on the fly): given, done, and failed (the log says why)", "state",
                      {"given": s.writes_given, "done": s.writes_done, "failed": s.writes_failed})
        yield _family(CounterMetricFamily, "kvrag_kept_passages", "Passages of clients' prompts kept in the store at "
                      "their second sighting, and kept ones evicted to make room", "event",
                      {"admitted": s.kept_admitted, "evicted": s.kept_evicted})
        yield _family(GaugeMetricFamily, "kvrag_tier_hit_rate", "Memory tiers' hit rates over the chunks asked for: "
                      "prefix (reused exactly on a seen chunk sequence), memory (read from a tier)", "kind",
                      {"prefix": s.prefix_hit_rate, "memory": s.memory_hit_rate})
        yield _family(CounterMetricFamily, "kvrag_speculative_prefills", "Prefills started on an early stage of a "
                      "staged vector search (kvrag serve --speculate), and how they ended", "outcome",
                      {outcome: s.speculative.get(outcome, 0) for outcome in ("started", "kept", "dropped")})


def _family(kind, name: str, documentation: str, label: str, values: dict[str, float]):
    """A metric family of one label, a sample per value."""
    family = kind(name, documentation, labels=[label])
    for value, sample in values.items():
        family.add_metric([value], sample)
    return family
