"""Decoding over our own KV cache: greedy or sampled, one token at a time, streamed."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from kvrag.errors import KvragError
from kvrag.model.cache import DecodeCache
from kvrag.model.row_step import RowStep
from kvrag.model.step import CacheKV, Rows, run_layers
from kvrag.model.transformer import Transformer

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


class ChunkedPrefill:
    """A full prefill of ids [T] run a piece at a time: each piece is one pass of every layer over the next tokens,
    attending to every token before them in the cache. An engine decodes its running sequences between the pieces
    of a long prompt instead of stalling them all for its whole prefill."""

    def __init__(self, model: Transformer, ids: torch.Tensor, extra: int, tap=None, head=None):
        self.model, self.ids, self.tap = model, ids, tap  # tap: sees every layer's queries and keys, where set
        self.cache = DecodeCache(model, ids.shape[0] + extra)
        self.logits: torch.Tensor | None = None  # [V] at the last position, once every piece has run
        if head is not None and len(head):  # a LayerKV of the first ids' exact KV (a prefix cache hit): not computed
            self._seed(head)

    @torch.inference_mode()
    def _seed(self, head) -> None:
        n = len(head)
        if n >= self.ids.shape[0]:
            raise ValueError(f"a seeded head of {n} rows leaves nothing of a {self.ids.shape[0]}-token prompt to run")
        for layer, (k, v) in enumerate(zip(head.k, head.v, strict=True)):  # each [n, Hkv, hd]
            if head.rotated:
                self.cache.k[layer, :n] = k
            else:
                self.model.rotate_keys(k, head.positions, out=self.cache.k[layer, :n], layer=layer)
            self.cache.v[layer, :n] = v
        self.cache.length = n

    @property
    def done(self) -> bool:
        return self.cache.length == self.ids.shape[0]

    @torch.inference_mode()
    def advance(self, tokens: int) -> bool:
        """Run the next `tokens` positions (at least one); True when the whole prompt is in the cache."""
        start = self.cache.length
        stop = min(start + max(tokens, 1), self.ids.shape[0])
        rows = Rows.at(self.model, self.ids[start:stop], torch.arange(start, stop))
        kv = CacheKV(self.model, self.cache, rows.pos)
        kv.tap = self.tap
        logits = run_layers(self.model, rows, kv)  # [1, V]
        self.cache.length = stop
        if self.done:
            self.logits = logits[0]
        return self.done


def prefill(model: Transformer, ids: torch.Tensor, extra: int) -> tuple[torch.Tensor, DecodeCache]:
    """Plain full prefill of ids [T] in one piece: last-position logits [V] and a cache ready for decoding."""
    job = ChunkedPrefill(model, ids, extra)
    job.advance(ids.shape[0])
    return job.logits, job.cache


@torch.inference_mode()
def decode_step(model: Transformer, cache: DecodeCache, token: int, native: bool = True) -> torch.Tensor:
    """Feed one token at row `cache.length` (position length + offset); returns the next-token logits [V] (float32).

    native (default): the whole step in one call into kernels/decode.cpp where it serves (see RowStep), else
    torch's ops. It is faster but not the reference's bits, so greedy answers can part from it at near-ties;
    native=False always runs torch's ops, the reference's bits.
    """
    if cache.length >= cache.capacity:
        raise KvragError("decode cache is full")
    stepper = cache.stepper
    if stepper is None or stepper.model is not model or stepper.wants_native != native or cache.length > stepper.synced:
        cache.stepper = RowStep(model, cache, native)
    return cache.stepper.step(token)


@torch.inference_mode()
def decode_step_reference(model: Transformer, cache: DecodeCache, token: int) -> torch.Tensor:
    """`decode_step` through the model's general primitives, one op at a time: the reference the one-row path
    (RowStep) is held against in tests and benchmarks."""
    if cache.length >= cache.capacity:
        raise KvragError("decode cache is full")
    n = cache.length
    rows = Rows.at(model, torch.tensor([token]), torch.tensor([n + cache.offset]))
    logits = run_layers(model, rows, CacheKV(model, cache, rows.pos, cache.offset))
    cache.length = n + 1
    return logits[0]


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
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    vocab = tokenizer.get_vocab()
    return ids | {vocab[m] for m in STOP_MARKERS if m in vocab}


def generate(model: Transformer, cache: DecodeCache, first_logits: torch.Tensor, sampling: SamplingConfig,
             stop: set[int]) -> Iterator[int]:
    """Yield answer tokens one by one until a stop token, max_tokens or a full cache."""
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator(device="cpu").manual_seed(sampling.seed)
    logits = first_logits
    for i in range(sampling.max_tokens):
        token = choose(logits.cpu(), sampling, generator)
        if token in stop:
            return
        yield token
        if i + 1 == sampling.max_tokens or cache.length >= cache.capacity:
            return
        logits = decode_step(model, cache, token)


def stream_text(tokenizer, tokens: Iterator[int]) -> Iterator[str]:
    """Turn a token stream into text pieces, holding back incomplete UTF-8 sequences."""
    seen: list[int] = []
    emitted = ""
    for token in tokens:
        seen.append(token)
        text = tokenizer.decode(seen, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # a multi-byte character is still incomplete
            continue
        yield text[len(emitted):]
        emitted = text
