"""A sequence's next token from its logits: the grammar's mask, the stop tokens held back before min_tokens,
sampling, teacher forcing, and the log-probabilities a request asked for."""

from __future__ import annotations

import math

import torch

from kvrag.engine.sequence import Sequence
from kvrag.model.sampling import choose


def next_token(seq: Sequence, logits: torch.Tensor, stop_ids) -> int:
    """The next token from logits [V]; no stop token before the request's min_tokens."""
    sampling = seq.request.sampling
    raw = logits
    if seq.constraint is not None:  # the grammar decides where the answer may end
        logits = logits.clone()
        seq.constraint.mask(logits)
    elif len(seq.output) < sampling.min_tokens:
        logits = logits.clone()
        logits[list(stop_ids)] = -math.inf
    token = choose(logits, sampling, seq.generator, seq.output)  # with logit_bias and penalties; `raw` stays as is
    if seq.request.forced:  # teacher forcing: the forced token goes on, the model's own choice is counted
        forced = seq.request.forced[min(len(seq.output), len(seq.request.forced) - 1)]
        seq.agreed += int(token == forced)
        token = forced
    if seq.constraint is not None:
        seq.constraint.accept(token)
    if seq.request.logprobs is not None:  # the model's own distribution, before sampling's settings
        seq.chosen = token_logprobs(raw, token, seq.request.logprobs)
    return token


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """logits [V]: the token's log-probability and the `top` most likely tokens' (most likely first)."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [V]
    values, ids = torch.topk(lp, top) if top else (lp[:0], lp[:0].long())
    return float(lp[token]), [(int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
