"""The load itself: Poisson arrivals of Zipf-popular questions, each a streamed chat completion from an
AsyncOpenAI client, and the server's /metrics read before and after.

A request's TTFT is the time from sending it to its first content chunk (what a user of the stream waits);
its latency runs to the stream's end. A request fails if the client raises (a 429 from a full queue, a 5xx, an
error event mid-stream, a timeout): the client makes no retries, so every refusal is counted.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

REQUEST_TIMEOUT_S = 600.0


@dataclass
class Result:
    question: int  # index into the questions sent
    sent: float  # perf_counter seconds
    first: float | None = None  # the first content chunk
    end: float | None = None
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV was reused (usage.prompt_tokens_details)
    completion_tokens: int = 0
    sources: list[dict] = field(default_factory=list)
    text: str = ""  # the answer as streamed

    @property
    def ok(self) -> bool:
        return self.error is None and self.first is not None

    @property
    def ttft_s(self) -> float:
        return self.first - self.sent

    @property
    def latency_s(self) -> float:
        return self.end - self.sent


def zipf_draws(count: int, questions: int, exponent: float, rng: random.Random) -> list[int]:
    """`count` question indices, popularity Zipf(exponent) over a seeded ranking: hot questions, and so their
    retrieved passages, recur."""
    ranking = list(range(questions))
    rng.shuffle(ranking)
    weights = [1.0 / (rank + 1) ** exponent for rank in range(questions)]
    return [ranking[i] for i in rng.choices(range(questions), weights, k=count)]


def workload(count: int, questions: int, exponent: float, seed: str) -> list[tuple[float, int]]:
    """(gap at rate 1, question) pairs: divide the gaps by a rate for Poisson arrivals at that rate. The same
    seed gives every configuration the same questions at the same moments (common random numbers)."""
    rng = random.Random(seed)
    gaps = [rng.expovariate(1.0) for _ in range(count)]
    return list(zip(gaps, zipf_draws(count, questions, exponent, rng), strict=True))


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT_S,
                              http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=None),
                                                            timeout=REQUEST_TIMEOUT_S))


async def ask(api: openai.AsyncOpenAI, model: str, question: str, index: int, extra: dict,
              max_tokens: int, history: list[dict] | None = None) -> Result:
    """One streamed chat completion (after `history`'s messages, if any), timed from the client's side."""
    result = Result(index, time.perf_counter())
    try:
        stream = await api.chat.completions.create(
            model=model, messages=[*(history or []), {"role": "user", "content": question}], stream=True,
            max_tokens=max_tokens, temperature=0, stream_options={"include_usage": True}, extra_body=extra)
        async for chunk in stream:
            content = chunk.choices[0].delta.content if chunk.choices else None
            if content is not None and result.first is None:
                result.first = time.perf_counter()
                result.sources = (chunk.model_extra or {}).get("sources") or []
            result.text += content or ""
            if chunk.usage is not None:
                details = chunk.usage.prompt_tokens_details
                result.prompt_tokens, result.completion_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
                result.cached_tokens = (details.cached_tokens or 0) if details else 0
    except (openai.APIError, httpx.HTTPError) as exc:
        result.error = f"{type(exc).__name__}: {getattr(exc, 'message', None) or exc}"
    result.end = time.perf_counter()
    return result


async def run_rate(api: openai.AsyncOpenAI, model: str, questions: Sequence[str], arrivals: list[tuple[float, int]],
                   rate: float, max_s: float, extra: dict, max_tokens: int) -> tuple[list[Result], float]:
    """Send the arrivals at `rate` until they run out or `max_s` of arrivals have gone (at least one request);
    wait for every answer. Returns the results and the span of the sending."""
    tasks, start, at = [], time.perf_counter(), 0.0
    for gap, q in arrivals:
        at += gap / rate
        if at > max_s and tasks:
            break
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        tasks.append(asyncio.create_task(ask(api, model, questions[q], q, extra, max_tokens)))
    span = time.perf_counter() - start
    return list(await asyncio.gather(*tasks)), span


# ---- the server's /metrics ---------------------------------------------------------------------------

async def scrape(url: str) -> dict[str, float]:
    """Every sample of /metrics as {'name{label="v",...}': value}."""
    async with httpx.AsyncClient(timeout=30) as http:
        text = (await http.get(url + "/metrics")).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def labelled(text: str, name: str, label: str) -> dict[str, float]:
    """One metric's samples by one label's value (a counter's name with its _total), from /metrics' text."""
    return {s.labels[label]: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name and label in s.labels}


def metrics_delta(before: dict[str, float], after: dict[str, float]) -> dict:
    """What the server counted between two scrapes: tokens reused vs computed, chunks by tier, requests by
    outcome, its own mean TTFT and latency; and the tiers' hit rates (gauges since the server started)."""
    def d(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    def by_label(name: str, label: str) -> dict[str, float]:
        found = ((re.search(f'{label}="([^"]*)"', key), key) for key in after if key.startswith(name + "{"))
        return {m.group(1): d(key) for m, key in found if m and d(key)}

    count = d("kvrag_time_to_first_token_seconds_count")
    done = d("kvrag_request_latency_seconds_count")
    reused, computed = d('kvrag_prompt_tokens_total{kv="reused"}'), d('kvrag_prompt_tokens_total{kv="computed"}')
    return {
        "requests": by_label("kvrag_requests_total", "outcome"),
        "prompt_tokens_reused": reused, "prompt_tokens_computed": computed,
        "reused_share": reused / (reused + computed) if reused + computed else None,
        "chunks_by_tier": by_label("kvrag_chunks_total", "tier"),
        "server_mean_ttft_s": d("kvrag_time_to_first_token_seconds_sum") / count if count else None,
        "server_mean_latency_s": d("kvrag_request_latency_seconds_sum") / done if done else None,
        "tier_hit_rate": {kind: after.get(f'kvrag_tier_hit_rate{{kind="{kind}"}}') for kind in ("prefix", "memory")},
    }
