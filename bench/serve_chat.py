"""`kvrag bench serve --chat N`: conversations against one `kvrag serve` as users run it (blend, the memory tiers on).

Each of N questions is asked as a first turn, then followed up in the same conversation (the first turn's question
and answer as history, then FOLLOW_UP), both streamed. The server keeps the first turn's KV; the follow-up continues
it and computes only its own turn (engine/conversations.py). The report: per pair the client's TTFT of each turn,
the follow-up's prompt and cached tokens; the median of follow-up TTFT over first-turn TTFT (the issue's target:
at most 0.3). With `--json-requests M`, M more requests ask for a JSON object of a schema (response_format
json_schema): the share whose text parses and fits it (target: all).
"""

from __future__ import annotations

import asyncio
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvrag.bench.serve_load import ask, client
from kvrag.bench.serve_server import ServerProcess
from kvrag.bench.serve_store import model_args
from kvrag.errors import KvragError

FOLLOW_UP = "Explain your answer in one sentence."
# what the JSON requests ask for: an answer (bounded: a 135M model's greedy answer can repeat itself inside an open
# string past any token budget) and how sure the model is of it
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 120},
                                           "confidence": {"type": "string", "enum": ["low", "medium", "high"]}},
          "required": ["answer", "confidence"], "additionalProperties": False}
JSON_MAX_TOKENS = 256  # room for the longest document SCHEMA allows, a digit a token: the grammar cannot count tokens


@dataclass(frozen=True)
class ChatConfig:
    work: Path
    store: Path
    questions: tuple[str, ...]
    pairs: int
    json_requests: int = 0
    k: int = 5
    max_tokens: int = 16
    model: str | None = None
    dtype: str | None = None

    def __post_init__(self) -> None:
        if self.pairs < 1 or not self.questions:
            raise KvragError("--chat takes a positive number of conversations, and questions to ask")


def run(cfg: ChatConfig, log: Callable[[str], None]) -> dict:
    with ServerProcess(cfg.store, model_args(cfg.model, cfg.dtype), cfg.work / "logs" / "serve-chat.log") as server:
        pairs, parsed = asyncio.run(_converse(cfg, server, log))
    good = [p for p in pairs if "error" not in p]
    ratios = [p["follow_up_ttft_s"] / p["first_ttft_s"] for p in good]

    def median_ratio(new: bool) -> float | None:  # follow-ups that brought new passages, or answered from context
        picked = [r for r, p in zip(ratios, good, strict=True) if bool(p["follow_up_new_sources"]) == new]
        return statistics.median(picked) if picked else None

    return {"schema": "kvrag.bench-serve-chat/1",
            "config": {**cfg.__dict__, "work": str(cfg.work), "store": str(cfg.store), "questions": len(cfg.questions)},
            "follow_up": FOLLOW_UP, "pairs": pairs, "failed": len(pairs) - len(good),
            "follow_up_over_first_ttft_p50": statistics.median(ratios) if ratios else None,
            "from_context_over_first_ttft_p50": median_ratio(False), "with_new_passages_over_first_ttft_p50":
                median_ratio(True), "with_new_passages": sum(bool(p["follow_up_new_sources"]) for p in good),
            "first_ttft_p50_s": statistics.median(p["first_ttft_s"] for p in good) if good else None,
            "follow_up_ttft_p50_s": statistics.median(p["follow_up_ttft_s"] for p in good) if good else None,
            "json": parsed}


async def _converse(cfg: ChatConfig, server: ServerProcess, log) -> tuple[list[dict], dict]:
    pairs = []
    async with client(server.url) as api:
        model = server.model_id()
        await ask(api, model, cfg.questions[0], 0, {"k": cfg.k}, cfg.max_tokens)  # loads and warms up
        for q in range(min(cfg.pairs, len(cfg.questions))):
            pairs.append(await _pair(api, model, cfg.questions[q], cfg))
            log(f"conversation {q}: " + (pairs[-1].get("error") or "first {first_ttft_s:.3f} s, follow-up "
                                         "{follow_up_ttft_s:.3f} s ({cached_tokens}/{prompt_tokens} cached)"
                                         .format(**pairs[-1])))
        parsed = await _json_requests(api, model, cfg, log) if cfg.json_requests else {}
    return pairs, parsed


async def _pair(api, model: str, question: str, cfg: ChatConfig) -> dict:
    extra = {"k": cfg.k}
    first = await ask(api, model, question, 0, extra, cfg.max_tokens)
    history = [{"role": "user", "content": question}, {"role": "assistant", "content": first.text.strip()}]
    second = await ask(api, model, FOLLOW_UP, 1, extra, cfg.max_tokens, history) if first.ok else first
    if not second.ok:
        return {"question": question, "error": second.error or "no answer"}
    return {"question": question, "first_ttft_s": first.ttft_s, "follow_up_ttft_s": second.ttft_s,
            "first_prompt_tokens": first.prompt_tokens, "prompt_tokens": second.prompt_tokens,
            "cached_tokens": second.cached_tokens, "follow_up_sources": len(second.sources),
            "follow_up_new_sources": sum(s.get("tier") != "context" for s in second.sources)}


async def _json_requests(api, model: str, cfg: ChatConfig, log) -> dict:
    """JSON mode over the questions: how many answers parse and fit SCHEMA."""
    fits, failed = 0, []
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    for i in range(cfg.json_requests):
        question = cfg.questions[i % len(cfg.questions)]
        reply = await api.chat.completions.create(model=model, max_tokens=JSON_MAX_TOKENS, temperature=0,
                                                  response_format=fmt, extra_body={"k": cfg.k},
                                                  messages=[{"role": "user", "content": question}])
        text = reply.choices[0].message.content or ""
        if _fits(text):
            fits += 1
        else:
            failed.append({"question": question, "text": text, "finish_reason": reply.choices[0].finish_reason})
    log(f"JSON mode: {fits}/{cfg.json_requests} parse and fit the schema")
    return {"requests": cfg.json_requests, "fit": fits, "share": fits / cfg.json_requests, "failed": failed}


def _fits(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (isinstance(value, dict) and set(value) == {"answer", "confidence"} and isinstance(value["answer"], str)
            and value["confidence"] in ("low", "medium", "high"))


def markdown(report: dict) -> str:
    rows = ["| # | first TTFT s | follow-up TTFT s | ratio | cached / prompt | new passages |", "|---|---|---|---|---|---|"]
    for i, p in enumerate(report["pairs"]):
        if "error" in p:
            rows.append(f"| {i} | {p['error']} | | | | |")
            continue
        rows.append(f"| {i} | {p['first_ttft_s']:.3f} | {p['follow_up_ttft_s']:.3f} | "
                    f"{p['follow_up_ttft_s'] / p['first_ttft_s']:.2f} | {p['cached_tokens']}/{p['prompt_tokens']} | "
                    f"{p['follow_up_new_sources']} |")
    ratio = report["follow_up_over_first_ttft_p50"]
    rows += ["", f"follow-up TTFT over first-turn TTFT, median: {ratio:.2f}" if ratio else "no pair served"]
    for key, what in (("from_context_over_first_ttft_p50", "answered from the passages already in the context"),
                      ("with_new_passages_over_first_ttft_p50", "bringing new passages")):
        if report[key] is not None:
            rows.append(f"  {what}: {report[key]:.2f}")
    if report["json"]:
        rows.append(f"JSON mode: {report['json']['fit']}/{report['json']['requests']} parse and fit the schema")
    return "\n".join(rows)
