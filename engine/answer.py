"""One question end to end after retrieval: prefill by mode, then stream the decoded answer."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvrag.blend.config import BlendConfig
from kvrag.blend.ratio import SUFFIX_GUESS, RatioPolicy
from kvrag.engine.prefiller import Prefilled, Prefiller
from kvrag.model.generate import SamplingConfig, generate, stream_text

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
            "mode": self.mode, "ratio": self.ratio,
            "tokens": {"prompt": self.prompt_tokens, "chunks": self.chunk_tokens,
                       "recomputed": self.recomputed_chunk_tokens, "answer": len(self.token_ids)},
            "token_ids": list(self.token_ids), "bytes_loaded": self.bytes_loaded,
            "computed_chunks": self.computed_chunks, "sources": sources,
            "timings": {k: round(float(self.timings.get(k, 0.0)), 6) for k in TIMING_KEYS},
        }


def answer_question(engine: Prefiller, chunks: Sequence[tuple[str, Sequence[int]]], question: str, mode: str,
                    config: BlendConfig, sampling: SamplingConfig, on_text: Callable[[str], None] | None = None,
                    ratio: RatioPolicy | None = None, interruptible: bool = False) -> tuple[Answer, Prefilled]:
    """Prefill and decode one question. `interruptible`: Ctrl-C while decoding ends the answer where it stands
    (finish_reason "interrupted") and the caller decides what follows; chunks computed for it are still stored."""
    start = time.perf_counter()
    if mode == "blend" and ratio is not None:  # None: the config's ratio as it is
        n_chunk = sum(len(ids) for _, ids in chunks)
        chosen = ratio.resolve(config, engine.runtime.model.cfg.n_layers, n_chunk, SUFFIX_GUESS)
        mode, config = ("full", config) if chosen is None else (mode, chosen)  # None: a full prefill costs less
    pre = engine.prefill(chunks, question, mode, config, extra=sampling.max_tokens)
    tokens: list[int] = []
    first_token_at = None
    pieces: list[str] = []
    decode_start = time.perf_counter()

    def token_stream():
        nonlocal first_token_at
        for token in generate(engine.runtime.model, pre.cache, pre.logits, sampling, engine.stop_ids):
            if first_token_at is None:
                first_token_at = time.perf_counter()
            tokens.append(token)
            yield token

    try:
        for piece in stream_text(engine.runtime.tokenizer, token_stream()):
            pieces.append(piece)
            if on_text:
                on_text(piece)
        finish = "length" if len(tokens) >= sampling.max_tokens else "stop"  # the cache holds max_tokens more
    except KeyboardInterrupt:
        if not interruptible:
            raise
        finish = "interrupted"
    end = time.perf_counter()
    engine.flush_write_back()
    first = first_token_at or end
    timings = dict(pre.timings)
    timings["ttft"] = first - start
    timings["decode"] = end - decode_start
    timings["decode_tokens_per_s"] = (len(tokens) - 1) / (end - first) if len(tokens) > 1 and end > first else 0.0
    ratio = config.ratio if mode == "blend" else None
    if ratio is not None and config.deviation_mass > 0 and pre.chunk_tokens:  # chosen per prompt: what it was
        ratio = round(pre.recomputed_chunk_tokens / pre.chunk_tokens, 4)
    answer = Answer(question, "".join(pieces).strip(), tokens, mode, ratio,
                    pre.prompt_tokens, pre.chunk_tokens, pre.recomputed_chunk_tokens, pre.bytes_loaded, timings,
                    chunk_tiers=pre.chunk_tiers, finish_reason=finish)
    return answer, pre
