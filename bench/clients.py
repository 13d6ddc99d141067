"""`kvrag bench clients`: prompts that carry their own passages, as RAG applications send them, against full prefill.

The corpus is the MuSiQue report items' passages (indexed as chunks: `kvrag index` would cut each one into one chunk).
Each question is sent as plain chat in three client templates (LangChain's system-context chain, LlamaIndex's default
QA template, Open WebUI's <source> template) with the item's passages in a shuffled order, through the engine
(`retrieval` client: no passages of ours). Per template and item:

    warm-up   one blend of the prompt in another order (chunks without KV are computed and stored)
    full      full prefill of the prompt (its own salt: no prefix shared with the others)
    blend     the same prompt, its stored passages found and blended (a new salt: no prefix cache)
    repeat    the same prompt again with the blend's salt: an exact prefix hit up to its last block

and reports the share of passage tokens found stored, TTFT against full prefill, first-token agreement and KL.
Then a stream of novel questions over Zipf-popular passages (the LMCache #4663 scenario): each request's share of
passage tokens reused, by position in the stream; its passages are sent as a client would, some never stored.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from kvrag.blend.config import BlendConfig
from kvrag.blend.ratio import RatioPolicy
from kvrag.engine.sequence import Request
from kvrag.model.sampling import SamplingConfig

RATIO = 0.15


def template(name: str, passages: list[str], question: str) -> list[tuple[str, str]]:
    """The messages a client sends: (role, text), the last one the user's."""
    joined = "\n\n".join(passages)
    if name == "langchain":
        return [("system", f"Answer the question using only this context:\n\n{joined}"), ("user", question)]
    if name == "llamaindex":
        return [("user", "Context information is below.\n---------------------\n" + joined +
                 "\n---------------------\nGiven the context information and not prior knowledge, answer the query."
                 f"\nQuery: {question}\nAnswer: ")]
    sources = "\n".join(f'<source id="{i + 1}">{p}</source>' for i, p in enumerate(passages))
    return [("user", "### Task:\nRespond to the user query using the provided context.\n\n<context>\n" + sources +
             f"\n</context>\n\n<user_query>\n{question}\n</user_query>")]


TEMPLATES = ("langchain", "llamaindex", "openwebui")


def index_passages(rag, items: list[dict]) -> int:
    """Every item's passages as chunks of the store (as `kvrag index` leaves them: title line, then text)."""
    from kvrag.store.chunks import ChunkRecord, ChunkTable, chunk_id_for

    rt, records = rag.runtime, []
    for item in items:
        for ctx in item["ctxs"]:
            ids = tuple(rt.prompts.passage_ids(ctx["title"], ctx["text"]))
            records.append(ChunkRecord(chunk_id_for(ids, rt.local.tokenizer_fingerprint), "bench", ctx["title"],
                                       ctx["text"], 0, len(ctx["text"]), ids))
    return ChunkTable(rag.env).put_records(records)


def run_one(rag, messages: list[tuple[str, str]], mode: str, salt: str, max_tokens: int = 1):
    """One plain-chat request through the resident engine; the finished sequence (first logits kept)."""
    *history, (_, question) = messages
    request = Request(question, (), mode, BlendConfig(ratio=RATIO), RatioPolicy.parse(RATIO, "ratio"),
                      SamplingConfig(max_tokens=max_tokens), rag=False, keep_first_logits=True,
                      history=tuple(history), salt=salt)
    seq = rag.loop.submit(request)
    seq.done.wait()
    if seq.error:
        raise RuntimeError(seq.error)
    return seq


def stored_share(seq) -> tuple[int, int]:
    """(passage tokens found in stored spans, tokens of the prompt's own text outside the head and tail)."""
    plan = seq.plan
    if plan is None or plan.pieces is None:
        return 0, 0
    found = sum(len(ids) for (_, ids), p in zip(plan.chunks, plan.pieces, strict=True) if p.chunk_id is not None)
    return found, sum(len(ids) for _, ids in plan.chunks) - found


def kl(full: torch.Tensor, other: torch.Tensor) -> float:
    p = torch.log_softmax(full.float(), -1)
    return float((p.exp() * (p - torch.log_softmax(other.float(), -1))).sum())


def measure_item(rag, name: str, item: dict, index: int, rng: random.Random) -> dict:
    passages = [f"{c['title']}\n{c['text']}" for c in item["ctxs"]]
    order = rng.sample(passages, len(passages))
    run_one(rag, template(name, passages[::-1], item["question"]), "blend", f"warm-{name}-{index}")
    messages = template(name, order, item["question"])
    full = run_one(rag, messages, "full", f"full-{name}-{index}")
    blend = run_one(rag, messages, "blend", f"blend-{name}-{index}")
    repeat = run_one(rag, messages, "blend", f"blend-{name}-{index}")
    passage_tokens = sum(len(rag.runtime.tokenizer(p, add_special_tokens=False)["input_ids"]) for p in passages)
    found, _ = stored_share(blend)
    ttft = {n: s.times()["ttft"] for n, s in (("full", full), ("blend", blend), ("repeat", repeat))}
    return {"template": name, "item": index, "prompt_tokens": full.prompt_tokens, "passage_tokens": passage_tokens,
            "found_share": found / passage_tokens, "cached_tokens": blend.reused_tokens,
            "repeat_cached_tokens": repeat.reused_tokens, "ttft_s": ttft,
            "blend_vs_full": ttft["blend"] / ttft["full"], "repeat_vs_full": ttft["repeat"] / ttft["full"],
            "top1_agree": int(blend.first_logits.argmax() == full.first_logits.argmax()),
            "kl": kl(full.first_logits, blend.first_logits),
            "repeat_top1_agree": int(repeat.first_logits.argmax() == full.first_logits.argmax())}


def stream(rag, items: list[dict], n: int, zipf: float, novel_share: float, seed: int) -> list[dict]:
    """n novel questions, each over 3 passages drawn by Zipf popularity from the items' passages, plus (with
    probability novel_share) one passage never sent before; Open WebUI's template. Per request: the share of its
    stored-corpus passages' tokens found stored."""
    rng = random.Random(seed)
    pool = [f"{c['title']}\n{c['text']}" for item in items for c in item["ctxs"]]
    rng.shuffle(pool)
    weights = [1 / (r + 1) ** zipf for r in range(len(pool))]
    words = " ".join(c["text"] for item in items for c in item["ctxs"]).split()
    out = []
    for i in range(n):
        chosen = list(dict.fromkeys(rng.choices(pool, weights, k=3)))
        if rng.random() < novel_share:  # a one-off passage: never stored, and must not push the others out
            start = rng.randrange(len(words) - 80)
            chosen.append(f"Note {i}\n" + " ".join(rng.sample(words[start:start + 80], 80)))
        seq = run_one(rag, template("openwebui", chosen, f"Question {i}: what links these?"), "blend", f"s{i}")
        found, other = stored_share(seq)
        out.append({"request": i, "found": found, "other": other, "ttft_s": seq.times()["ttft"]})
    return out


def window_rate(records: list[dict], lo: int, hi: int) -> float | None:
    part = records[lo:hi]
    tokens = sum(r["found"] + r["other"] for r in part)
    return sum(r["found"] for r in part) / tokens if tokens else None


def run(store: Path, items: list[dict], n_stream: int, zipf: float, seed: int, log) -> dict:
    from kvrag.api import KVRag
    from kvrag.store.env import StoreEnv

    start, rng = time.perf_counter(), random.Random(seed)
    StoreEnv.open(store, create=True).close()
    with KVRag(store, retrieval="client", host_cache="0", model_check=False) as rag:
        # full prefill in one piece, as blend runs: the engine's default pieces (decode running between them) would
        # make the baseline slower than it need be on a lone request
        rag.engine.config = replace(rag.engine.config, prefill_chunk=0)
        log(f"indexed {index_passages(rag, items)} new passages")
        rows = []
        for name in TEMPLATES:
            for i, item in enumerate(items):
                rows.append(measure_item(rag, name, item, i, rng))
            log(f"{name}: {len(items)} items")
        streamed = stream(rag, items, n_stream, zipf, 0.3, seed) if n_stream else []
        kept = rag.engine.keeper.stats if rag.engine.keeper is not None else None
    return {"items": len(items), "ratio": RATIO, "rows": rows, "summary": summarize(rows),
            "stream": {"requests": n_stream, "zipf": zipf, "hit_100_200": window_rate(streamed, 100, 200),
                       "hit_last_100": window_rate(streamed, max(0, n_stream - 100), n_stream),
                       "kept": vars(kept) if kept else None, "records": streamed},
            "wall_s": time.perf_counter() - start}


def summarize(rows: list[dict]) -> dict:
    out = {}
    for name in TEMPLATES:
        mine = [r for r in rows if r["template"] == name]
        if mine:
            out[name] = {key: statistics.median(r[key] for r in mine) if key.endswith("vs_full") else
                         statistics.fmean(r[key] for r in mine)
                         for key in ("found_share", "blend_vs_full", "repeat_vs_full", "top1_agree", "kl",
                                     "repeat_top1_agree")}
    return out


def markdown(report: dict) -> str:
    lines = ["| template | passage tokens found stored | TTFT blend / full (median) | exact repeat / full | "
             "top-1 agreement | mean KL | repeat top-1 |", "|---|---|---|---|---|---|---|"]
    for name, s in report["summary"].items():
        lines.append(f"| {name} | {s['found_share']:.3f} | {s['blend_vs_full']:.3f} | {s['repeat_vs_full']:.3f} | "
                     f"{s['top1_agree']:.2f} | {s['kl']:.4f} | {s['repeat_top1_agree']:.2f} |")
    st = report["stream"]
    if st["requests"]:
        lines.append(f"\nstream of {st['requests']} novel questions (Zipf {st['zipf']}): share of passage tokens found "
                     f"stored, requests 100-200: {st['hit_100_200']}, last 100: {st['hit_last_100']}; kept: "
                     f"{st['kept']}")
    return "\n".join(lines)
