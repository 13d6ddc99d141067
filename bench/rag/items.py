"""Benchmark items: a question, its gold answers (maybe none) and its chunks as (chunk_id, token ids).

A MuSiQue-format file brings each item's own passages (`ctxs`); questions without passages get
theirs from retrieval, which the CLI does (blend/ knows nothing of the index).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvrag.errors import KvragError
from kvrag.store.chunks import chunk_id_for

Chunk = tuple[str, list[int]]  # (chunk_id, token ids as spliced into the prompt)

# The benchmarks' data set: not in the repository (a clone has no ../shared), so its absence is one clear line.
DATASET_SOURCE = "the MuSiQue set as CacheBlend published it (github.com/YaoJiayi/CacheBlend, inputs/musique_s.json)"


def default_dataset() -> Path:
    """Where the benchmarks look for MuSiQue when no --dataset is given: ../shared/data from the project root."""
    return Path("..") / "shared" / "data" / "musique_s.json"


def read_dataset(path: Path | None) -> list[dict]:
    """A MuSiQue-format file's items (each with its passages in `ctxs`), by default the benchmarks' copy."""
    path = Path(path) if path is not None else default_dataset()
    if not path.exists():
        raise KvragError(f"{path} is missing: the benchmark reads {DATASET_SOURCE}; put it there or pass --dataset FILE")
    items = read_items(path)
    if not all(isinstance(item.get("ctxs"), list) and item["ctxs"] for item in items):
        raise KvragError(f"{path}: every item needs its passages in 'ctxs' (MuSiQue format)")
    return items


@dataclass
class BenchItem:
    index: int  # position in the source file
    question: str
    answers: list[str] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.question.strip():
            raise KvragError(f"item {self.index}: the question is empty")
        if not self.chunks:
            raise KvragError(f"item {self.index}: no passages (give them in 'ctxs' or index a corpus)")

    @property
    def chunk_tokens(self) -> int:
        return sum(len(ids) for _, ids in self.chunks)


def read_items(path: Path) -> list[dict]:
    """Raw items: a JSON list (MuSiQue format: question, answers, ctxs), JSON Lines, or one question a line."""
    try:
        raw = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise KvragError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise KvragError(f"cannot read {path}: {exc}") from None
    suffix = Path(path).suffix
    try:
        if suffix == ".json":
            data = json.loads(raw)
        elif suffix == ".jsonl":
            data = [json.loads(line) for line in raw.splitlines() if line.strip()]
        else:
            data = [{"question": line.strip()} for line in raw.splitlines() if line.strip()]
    except ValueError as exc:
        raise KvragError(f"{path} is not valid JSON: {exc}") from None
    data = data if isinstance(data, list) else [data]
    for n, item in enumerate(data):
        if not isinstance(item, dict) or not isinstance(item.get("question"), str):
            raise KvragError(f"{path}: item {n} needs a 'question' string")
    if not data:
        raise KvragError(f"{path} has no questions")
    return data


def select(indices: Sequence[int], limit: int | None, seed: int, sample: bool) -> list[int]:
    """Of the item `indices`, the first `limit`, or a seeded random sample of `limit`."""
    indices = list(indices)
    if sample and limit is not None and limit < len(indices):
        indices = sorted(random.Random(seed).sample(indices, limit))
    return indices[:limit] if limit is not None else indices


def answers_of(item: dict) -> list[str]:
    answers = item.get("answers") or item.get("answer") or []
    return [answers] if isinstance(answers, str) else [str(a) for a in answers]


def passage_chunks(prompts, tokenizer_fp: str, ctxs: Sequence[dict], max_words: int | None = None) -> list[Chunk]:
    """A question's own passages as chunks, each cut to its first `max_words` words when asked."""
    out = []
    for ctx in ctxs:
        text = ctx.get("text") or ""
        if max_words is not None:
            text = " ".join(text.split()[:max_words])
        ids = prompts.passage_ids(ctx.get("title") or "", text)
        out.append((chunk_id_for(ids, tokenizer_fp), ids))
    return out


def build_items(raw: list[dict], indices: Sequence[int], runtime, max_words: int | None = None,
                retrieve: Callable[[str], list[Chunk]] | None = None, where: str = "the data set") -> list[BenchItem]:
    """The items `indices` of `raw`: each with its own passages (`ctxs`), else with `retrieve(question)`'s chunks."""
    out = []
    for i in indices:
        ctxs = raw[i].get("ctxs") or []
        if ctxs:
            chunks = passage_chunks(runtime.prompts, runtime.local.tokenizer_fingerprint, ctxs, max_words)
        elif retrieve is not None:
            chunks = retrieve(raw[i]["question"])
        else:
            raise KvragError(f"{where}: item {i} has no 'ctxs'; use --questions with an indexed --store instead")
        out.append(BenchItem(i, raw[i]["question"], answers_of(raw[i]), chunks))
    return out


def split_passages(raw: list[dict], indices: Sequence[int], runtime) -> list[list[int]]:
    """The token ids of every distinct passage of the items `indices`, in chunk id order (a corpus's sample, as
    precompute/lead_in.py draws one)."""
    return [ids for _, ids in sorted(corpus_chunks([raw[i] for i in indices], runtime))]


def corpus_chunks(raw: list[dict], runtime, max_words: int | None = None) -> list[Chunk]:
    """Every distinct passage of MuSiQue-format items as a chunk (the pool a cache workload draws from)."""
    seen: dict[str, list[int]] = {}
    for item in raw:
        for cid, ids in passage_chunks(runtime.prompts, runtime.local.tokenizer_fingerprint,
                                       item.get("ctxs") or [], max_words):
            seen.setdefault(cid, ids)
    return list(seen.items())
