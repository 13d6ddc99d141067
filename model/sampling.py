"""Choosing the next token: a request's sampling settings, its logit_bias and penalties, and the stop tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvrag.errors import KvragError

STOP_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end_of_text|>", "</s>")


@dataclass(frozen=True)
class SamplingConfig:
    max_tokens: int = 32
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None
    min_tokens: int = 0  # no stop token before this many (vLLM's min_tokens: long generations for benchmarks)
    # OpenAI's: {token id: bias in [-100, 100]} added to the logits; penalties in [-2, 2] on the tokens generated
    # so far, presence once per token seen, frequency per occurrence
    logit_bias: tuple[tuple[int, float], ...] = ()
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.logit_bias, tuple):  # a dict from a caller: frozen and hashable, as the rest
            object.__setattr__(self, "logit_bias", tuple(sorted(_bias_items(self.logit_bias))))
        for token, bias in self.logit_bias:
            if token < 0 or not -100 <= bias <= 100:
                raise KvragError(f"logit_bias takes token ids >= 0 and biases in [-100, 100], got {token}: {bias}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise KvragError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise KvragError(f"min_tokens must be in 0..max_tokens, got {self.min_tokens}")
        if self.max_tokens < 1:
            raise KvragError(f"--max-tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise KvragError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise KvragError(f"--top-p must be in (0, 1], got {self.top_p}")

    def generator(self) -> torch.Generator | None:
        """A generator of its own for a seeded sample, so a sampled answer does not depend on what else runs beside
        it; None where nothing is drawn (greedy) or nothing is seeded."""
        if self.temperature == 0 or self.seed is None:
            return None
        return torch.Generator(device="cpu").manual_seed(self.seed)


def _bias_items(bias) -> list[tuple[int, float]]:
    """OpenAI's {"token id": bias} (or (id, bias) pairs) as (int, float) pairs; a KvragError for a non-integer id."""
    items = bias.items() if isinstance(bias, dict) else bias or ()
    try:
        return [(int(token), float(value)) for token, value in items]
    except (TypeError, ValueError):
        raise KvragError(f"logit_bias maps token ids to numbers, got {bias!r}") from None


def adjusted(logits: torch.Tensor, sampling: SamplingConfig, output: Sequence[int]) -> torch.Tensor:
    """logits [V] with the request's logit_bias and its presence / frequency penalties over the tokens generated so
    far (`output`), as OpenAI defines them; the same tensor where the request sets none."""
    penalize = len(output) > 0 and bool(sampling.frequency_penalty or sampling.presence_penalty)
    if not sampling.logit_bias and not penalize:
        return logits
    logits = logits.clone()
    if sampling.logit_bias:
        tokens, biases = zip(*sampling.logit_bias, strict=True)
        logits[list(tokens)] += torch.tensor(biases, dtype=logits.dtype, device=logits.device)
    if penalize:
        seen, counts = torch.tensor(output, device=logits.device).unique(return_counts=True)
        logits[seen] -= sampling.presence_penalty + sampling.frequency_penalty * counts.to(logits.dtype)
    return logits


def choose(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None,
           output: Sequence[int] = ()) -> int:
    """Greedy argmax, or a temperature / nucleus (top-p) sample, of logits adjusted by the request's logit_bias and
    its penalties over `output`, the tokens generated so far (on a copy: the caller's logits stay as they are)."""
    logits = adjusted(logits, sampling, output)
    if sampling.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, 0) - sorted_probs < sampling.top_p  # always keeps the top token
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


def stop_ids(tokenizer) -> set[int]:
    """The tokens that end a turn: the EOS and whichever of STOP_MARKERS the vocabulary has."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    vocab = tokenizer.get_vocab()
    return ids | {vocab[m] for m in STOP_MARKERS if m in vocab}
