"""The one-question reference the engine's batched decode is checked against: one prompt prefilled by mode
(`Prefiller.prefill`, a contiguous cache), then decoded one row at a time (`model/decode.generate`), no paged pool,
no scheduler, no batch."""

from __future__ import annotations

from collections.abc import Sequence

from kvrag.blend.config import BlendConfig
from kvrag.blend.ratio import SUFFIX_GUESS, RatioPolicy
from kvrag.engine.prefiller import Prefilled, Prefiller
from kvrag.model.decode import generate
from kvrag.model.sampling import SamplingConfig


def answer_question(engine: Prefiller, chunks: Sequence[tuple[str, Sequence[int]]], question: str, mode: str,
                    config: BlendConfig, sampling: SamplingConfig,
                    ratio: RatioPolicy | None = None) -> tuple[list[int], Prefilled]:
    """The answer's token ids and its prefill; chunks computed for it are stored (the write-back flushed)."""
    if mode == "blend" and ratio is not None:  # None: the config's ratio as it is
        n_chunk = sum(len(ids) for _, ids in chunks)
        chosen = ratio.resolve(config, engine.runtime.model.cfg.n_layers, n_chunk, SUFFIX_GUESS)
        mode, config = ("full", config) if chosen is None else (mode, chosen)  # None: a full prefill costs less
    pre = engine.prefill(chunks, question, mode, config, extra=sampling.max_tokens)
    tokens = list(generate(engine.runtime.model, pre.cache, pre.logits, sampling, engine.stop_ids))
    engine.flush_write_back()
    return tokens, pre
