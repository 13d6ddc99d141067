"""Quality and latency metrics, plain Python (and torch only for the KL divergence).

Answers are scored as in the CacheBlend paper (LongBench's `qa_f1_score`, SQuAD's normalisation):
lower-case, drop punctuation, drop the articles a/an/the, collapse white space, split on it; token F1
over the bag of words; against several gold answers the best one counts.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

# the model check scores answers as the bench does: one definition, in the engine
from kvrag.engine.answer_set import f1_score, normalize_answer  # noqa: F401 (re-exported)


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def best_f1(prediction: str, golds: Sequence[str]) -> float | None:
    """The best F1 over the gold answers; None when there are none."""
    return max((f1_score(prediction, g) for g in golds), default=None)


def best_em(prediction: str, golds: Sequence[str]) -> float | None:
    return max((exact_match(prediction, g) for g in golds), default=None)


def kl_divergence(ref_logits, logits) -> float:
    """KL(P_ref || P) in nats between two next-token distributions given as logits [V].

    The reference is full prefill: how much information the method's distribution loses about it.
    """
    import torch

    ref = torch.log_softmax(ref_logits.double().flatten(), dim=-1)  # [V]
    got = torch.log_softmax(logits.double().flatten(), dim=-1)  # [V]
    return max(0.0, float((ref.exp() * (ref - got)).sum()))


def top1_agrees(ref_logits, logits) -> bool:
    return int(ref_logits.argmax()) == int(logits.argmax())


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100), linear between closest ranks (numpy's default method)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    xs = sorted(values)
    rank = p / 100 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def distribution(values: Iterable[float], name: str, unit: str = "ms", scale: float = 1000.0) -> dict[str, float]:
    """vLLM's summary names: mean_ttft_ms, median_ttft_ms, std_ttft_ms, p90_ttft_ms, p99_ttft_ms."""
    xs = [v * scale for v in values]
    if not xs:
        return {}
    return {
        f"mean_{name}_{unit}": statistics.fmean(xs),
        f"median_{name}_{unit}": statistics.median(xs),
        f"std_{name}_{unit}": statistics.pstdev(xs),
        f"p90_{name}_{unit}": percentile(xs, 90),
        f"p99_{name}_{unit}": percentile(xs, 99),
    }


def mean_or_none(values: Iterable[float | None]) -> float | None:
    xs = [float(v) for v in values if v is not None]
    return statistics.fmean(xs) if xs else None


def median_or_none(values: Iterable[float | None]) -> float | None:
    xs = [float(v) for v in values if v is not None]
    return statistics.median(xs) if xs else None


def wilson(successes: int, n: int, z: float = 1.96) -> dict[str, float | int | None]:
    """A share and its Wilson score interval (95 % at z 1.96): sound at small n and at 0 or 1, where the normal
    approximation gives [1, 1] for 23 of 23."""
    if n == 0:
        return {"k": 0, "n": 0, "share": None, "low": None, "high": None}
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return {"k": successes, "n": n, "share": p, "low": max(0.0, centre - half), "high": min(1.0, centre + half)}
