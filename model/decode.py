"""Decoding over one sequence's own KV cache: a step of one token, and the answer's tokens one by one."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from kvrag.errors import KvragError
from kvrag.model.cache import DecodeCache
from kvrag.model.row_step import RowStep
from kvrag.model.sampling import SamplingConfig, choose
from kvrag.model.step import CacheKV, Rows, run_layers
from kvrag.model.transformer import Transformer


@torch.inference_mode()
def decode_step(model: Transformer, cache: DecodeCache, token: int, native: bool = True) -> torch.Tensor:
    """Feed one token at row `cache.length` (position length + offset); returns the next-token logits [V] (float32).

    native (default): the whole step in one call into kernels/decode.cpp where it serves (see RowStep), else
    torch's ops. It is faster but not the reference's bits, so greedy answers can part from it at near-ties;
    native=False always runs torch's ops, the reference's bits.
    """
    if cache.length >= cache.capacity:
        raise KvragError("decode cache is full")
    if not model.cfg.plain:  # RowStep's arithmetic is a Llama-shaped layer's: other families step one op at a time
        return decode_step_reference(model, cache, token)
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
    rows = Rows.at(model, torch.tensor([token]), torch.tensor([n + cache.offset]), prompt=False)
    logits = run_layers(model, rows, CacheKV(model, cache, rows.pos, cache.offset))
    cache.length = n + 1
    return logits[0]


def generate(model: Transformer, cache: DecodeCache, first_logits: torch.Tensor, sampling: SamplingConfig,
             stop: set[int]) -> Iterator[int]:
    """Yield answer tokens one by one until a stop token, max_tokens or a full cache."""
    generator = sampling.generator()
    logits = first_logits
    for i in range(sampling.max_tokens):
        token = choose(logits.cpu(), sampling, generator)
        if token in stop:
            return
        yield token
        if i + 1 == sampling.max_tokens or cache.length >= cache.capacity:
            return
        logits = decode_step(model, cache, token)
