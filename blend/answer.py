"""One question end to end after retrieval: prefill by mode, then stream the decoded answer."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from kvrag.blend.controller import cached_profile
from kvrag.blend.decode import SamplingConfig, generate, stream_text
from kvrag.blend.engine import Engine, Prefilled
from kvrag.blend.fusion import BlendConfig


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

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


def resolve_ratio(engine: Engine, config: BlendConfig, auto: bool, chunk_tokens: int, suffix_tokens: int,
                  codec: str) -> BlendConfig:
    if not auto:
        return config
    profile = cached_profile(engine.env, engine.model, engine.runtime.fingerprint, codec)
    return replace(config, ratio=profile.ratio(chunk_tokens, suffix_tokens))


def answer_question(engine: Engine, chunks: Sequence[tuple[str, Sequence[int]]], question: str, mode: str,
                    config: BlendConfig, sampling: SamplingConfig, on_text: Callable[[str], None] | None = None,
                    auto_ratio: bool = False, codec: str = "fp16") -> tuple[Answer, Prefilled]:
    start = time.perf_counter()
    if mode == "blend":
        n_chunk = sum(len(ids) for _, ids in chunks)
        config = resolve_ratio(engine, config, auto_ratio, n_chunk, 40, codec)
    pre = engine.prefill(chunks, question, mode, config, extra=sampling.max_tokens)
    tokens: list[int] = []
    first_token_at = None
    pieces: list[str] = []
    decode_start = time.perf_counter()

    def token_stream():
        nonlocal first_token_at
        for token in generate(engine.model, pre.cache, pre.logits, sampling, engine.stop_ids):
            if first_token_at is None:
                first_token_at = time.perf_counter()
            tokens.append(token)
            yield token

    for piece in stream_text(engine.runtime.tokenizer, token_stream()):
        pieces.append(piece)
        if on_text:
            on_text(piece)
    end = time.perf_counter()
    engine.flush_write_back()
    first = first_token_at or end
    timings = dict(pre.timings)
    timings["ttft"] = first - start
    timings["decode"] = end - decode_start
    timings["decode_tokens_per_s"] = (len(tokens) - 1) / (end - first) if len(tokens) > 1 and end > first else 0.0
    answer = Answer(question, "".join(pieces).strip(), tokens, mode, config.ratio if mode == "blend" else None,
                    pre.prompt_tokens, pre.chunk_tokens, pre.recomputed_chunk_tokens, pre.bytes_loaded, timings,
                    chunk_tiers=pre.chunk_tiers)
    return answer, pre
