"""One answer as `kvrag ask --json` reports it: text, tokens, sources, costs and timings."""

from __future__ import annotations

from dataclasses import dataclass, field

SCHEMA = "kvrag.answer/1"  # `kvrag ask --json`; README "JSON output" documents it: bump on any breaking change
# Every answer's timings carry exactly these keys (seconds; decode_tokens_per_s a rate), 0 where a part did not
# run (full prefill loads nothing; startup, model and embedder loads are paid by a process's first answer).
TIMING_KEYS = ("startup", "model_load", "embedder_load", "retrieve", "prefill", "compute", "load", "load_wait",
               "compute_missing", "ttft", "decode", "decode_tokens_per_s", "since_start")
SOURCE_KEYS = ("chunk_id", "doc_id", "title", "tokens", "score", "tier")


@dataclass
class Answer:
    question: str
    text: str
    token_ids: list[int]
    mode: str
    ratio: float | None
    prompt_tokens: int
    chunk_tokens: int
    recomputed_chunk_tokens: int
    bytes_loaded: int
    timings: dict[str, float] = field(default_factory=dict)  # seconds, plus decode tokens/s
    sources: list[dict] = field(default_factory=list)
    chunk_tiers: list[str] = field(default_factory=list)  # per chunk: tree, gpu, host, store or computed
    finish_reason: str = "stop"  # stop (a stop token), length (max tokens or a full cache), interrupted
    rule: str | None = None  # a blend's selection rule (the model's check chose it unless the request named one)
    served_by: str | None = None  # the URL of the `kvrag serve` that answered for `kvrag ask` (None: this process)

    @property
    def computed_chunks(self) -> list[str]:
        """Chunks whose KV was not stored (for this model and codec): computed for this answer and stored."""
        return [s["chunk_id"] for s, tier in zip(self.sources, self.chunk_tiers, strict=False) if tier == "computed"]

    def to_json(self) -> dict:
        """The versioned `--json` record: the same keys in every mode."""
        # prefix caching loads its first chunk alone: the chunks after it have no tier
        tiers = [*self.chunk_tiers, *[None] * (len(self.sources) - len(self.chunk_tiers))]
        sources = [{**{k: s.get(k) for k in SOURCE_KEYS}, "tier": tier}
                   for s, tier in zip(self.sources, tiers, strict=True)]
        return {
            "schema": SCHEMA, "question": self.question, "answer": self.text, "finish_reason": self.finish_reason,
            "mode": self.mode, "ratio": self.ratio, "rule": self.rule,
            "tokens": {"prompt": self.prompt_tokens, "chunks": self.chunk_tokens,
                       "recomputed": self.recomputed_chunk_tokens, "answer": len(self.token_ids)},
            "token_ids": list(self.token_ids), "bytes_loaded": self.bytes_loaded,
            "computed_chunks": self.computed_chunks, "sources": sources,
            "timings": {k: round(float(self.timings.get(k, 0.0)), 6) for k in TIMING_KEYS},
            "served_by": self.served_by,
        }

    @classmethod
    def from_json(cls, record: dict) -> Answer:
        """The answer a `to_json` record holds (a server's, for `kvrag ask`)."""
        tokens, sources = record["tokens"], record["sources"]
        tiers = [s["tier"] for s in sources if s.get("tier") is not None]
        return cls(record["question"], record["answer"], list(record["token_ids"]), record["mode"], record["ratio"],
                   tokens["prompt"], tokens["chunks"], tokens["recomputed"], record["bytes_loaded"],
                   dict(record["timings"]), [{k: s.get(k) for k in SOURCE_KEYS if k != "tier"} for s in sources],
                   tiers, record["finish_reason"], record["rule"], record.get("served_by"))
