"""`kvrag bench cutoff`: how well an absolute retrieval cutoff (`min_score`) tells questions over the documents
from chat that needs none, by each request's best (top-1) cosine score, and the cutoff chosen by a stated rule.

Requests and stores (docs/retrieval-cutoff.md):
    musique tune / report   MuSiQue items 0-49 / 50-99 (bench/rag/datasets.py's splits) over a store of all 1,255
                            distinct MuSiQue passages, one per chunk (`kvrag index ... --chunk-tokens 1024`)
    demo                    corpus/demo-questions.jsonl over the bundled corpus (corpus/sample): held out, reported
    chat tune / report      bench/data/chat_prompts.json (invented chat that needs no documents), over each store

The cutoff is chosen on the tune requests alone (`choose`) and reported on the others.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from kvrag.bench.rag.metrics import normalize_answer
from kvrag.errors import KvragError

PROMPTS = Path(__file__).resolve().parent / "data" / "chat_prompts.json"
CORPUS = Path(__file__).resolve().parents[1] / "corpus"
REJECT = 0.9  # the rule: at least this share of the tune chat prompts goes to plain chat, on every store
GRID = [round(i / 100, 2) for i in range(101)]  # the cutoffs tried: cosine 0.00-1.00 in steps of 0.01
SHOWN = (0.2, 0.25, 0.3, 0.35, 0.4, 0.45)  # the sweep table's rows, besides the chosen cutoff and MIN_SCORE
RULE = (f"on the tune requests alone: of the cutoffs 0.00, 0.01, ..., 1.00 that send at least {REJECT:.0%} of the "
        "chat prompts to plain chat on every store, the one that keeps passages for the most MuSiQue questions; "
        "of equals, the lowest (a real question sent to plain chat loses its answer, a chat prompt that keeps a "
        "passage still gets one)")


@dataclass(frozen=True)
class Group:
    name: str  # e.g. "musique tune"
    kind: str  # "docs": should keep its passages; "chat": should get none
    split: str  # tune or report
    store: str  # musique or demo
    scores: list[float]  # each request's top-1 score

    def share(self, cutoff: float) -> float:
        """Docs: the share keeping passages (top-1 >= cutoff); chat: the share sent to plain chat (top-1 < it)."""
        kept = sum(score >= cutoff for score in self.scores)
        return (kept if self.kind == "docs" else len(self.scores) - kept) / len(self.scores)


def chat_prompts(path: Path = PROMPTS) -> dict[str, list[str]]:
    """The invented chat prompts by split (tune, report)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    return {"tune": data["tune"], "report": data["report"]}


def demo_questions() -> list[str]:
    lines = (CORPUS / "demo-questions.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["question"] for line in lines if line.strip()]


def build_store(source: Path, store: Path, *options: str) -> Path:
    """`kvrag index SOURCE --store STORE` in a subprocess, as a user runs it (a no-op once built)."""
    command = [sys.executable, "-m", "kvrag", "index", str(source), "--store", str(store), *options]
    code = subprocess.run(command, stdout=subprocess.DEVNULL).returncode
    if code != 0:
        raise KvragError(f"kvrag index exited {code} while building {store} (its message is above)")
    return store


def choose(groups: list[Group], reject: float = REJECT) -> float:
    """The cutoff by RULE, from the tune groups; KvragError when no cutoff on the grid meets the constraint."""
    tune = [g for g in groups if g.split == "tune"]
    chat, docs = [g for g in tune if g.kind == "chat"], [g for g in tune if g.kind == "docs"]
    feasible = [t for t in GRID if all(g.share(t) >= reject for g in chat)]
    if not feasible or not docs:
        raise KvragError(f"no cutoff sends {reject:.0%} of the tune chat prompts to plain chat on every store")
    kept = {t: sum(g.share(t) * len(g.scores) for g in docs) for t in feasible}
    return max(feasible, key=lambda t: (kept[t], -t))


def answer_bearing(text: str, answers: list[str]) -> bool:
    passage = normalize_answer(text)
    return any(normalize_answer(a) and normalize_answer(a) in passage for a in answers)


def retrieve(store: Path, embedder, questions: list[str], k: int) -> list[list]:
    """Each question's top-k hits, no cutoff."""
    from kvrag.corpus.retrieve import Retriever
    from kvrag.store.env import StoreEnv

    with StoreEnv.open(store, readonly=True) as env:
        return Retriever(env, embedder).search_batch(questions, k)


def hit_rows(name: str, items: list[dict], found: list[list], cutoffs: list[float], k: int,
             relative_cutoff: float) -> list[dict]:
    """What reaches the prompt of each MuSiQue question at each cutoff (with the relative one): hits, the item's
    own passages among them, and those holding a gold answer."""
    from kvrag.corpus.retrieve import cut_hits

    rows = []
    for cutoff in cutoffs:
        row = {"split": name, "min_score": cutoff, "k": k, "relative_cutoff": relative_cutoff, "questions": len(items),
               "with_passages": 0, "hits": 0, "own": 0, "answer_bearing": 0}
        for item, hits in zip(items, found, strict=True):
            by_id = {h.chunk.chunk_id: h.chunk.text for h in hits}
            kept = [by_id[i] for i, _ in cut_hits([(h.chunk.chunk_id, h.score) for h in hits], relative_cutoff, cutoff)]
            own = {c["text"].strip() for c in item["ctxs"]}
            row["with_passages"] += bool(kept)
            row["hits"] += len(kept)
            row["own"] += sum(text in own for text in kept)
            row["answer_bearing"] += sum(answer_bearing(text, item.get("answers", [])) for text in kept)
        rows.append(row)
    return rows


def measure(items: list[dict], musique_store: Path, demo_store: Path, k: int,
            relative_cutoff: float) -> tuple[list[Group], dict[str, tuple[list[dict], list[list]]]]:
    """Every group's top-1 scores, and the MuSiQue splits' items with their hits (for `hit_rows`)."""
    from kvrag.bench.rag.datasets import MUSIQUE_REPORT, MUSIQUE_TUNE
    from kvrag.corpus.embedder import Embedder

    embedder = Embedder()
    groups, musique = [], {}
    for split, indices in (("tune", MUSIQUE_TUNE), ("report", MUSIQUE_REPORT)):
        chosen = [items[i] for i in indices if i < len(items)]
        found = retrieve(musique_store, embedder, [item["question"] for item in chosen], k)
        groups.append(Group(f"musique {split}", "docs", split, "musique", top1(found)))
        musique[split] = (chosen, found)
    groups.append(Group("demo", "docs", "report", "demo", top1(retrieve(demo_store, embedder, demo_questions(), k))))
    for split, prompts in chat_prompts().items():
        for store_name, store in (("musique", musique_store), ("demo", demo_store)):
            found = retrieve(store, embedder, prompts, k)
            groups.append(Group(f"chat {split} @ {store_name}", "chat", split, store_name, top1(found)))
    return groups, musique


def top1(found: list[list]) -> list[float]:
    return [round(hits[0].score, 4) if hits else -1.0 for hits in found]  # no hit at all: the lowest cosine


def run(items: list[dict], musique_store: Path, demo_store: Path, k: int = 5, relative_cutoff: float = 0.5) -> dict:
    """The report: each group's score distribution and shares over a sweep, the chosen cutoff, the hits kept."""
    from kvrag.bench.rag.report import machine
    from kvrag.config import MIN_SCORE
    from kvrag.corpus.embedder import Embedder

    groups, musique = measure(items, musique_store, demo_store, k, relative_cutoff)
    chosen = choose(groups)
    cutoffs = sorted({*SHOWN, chosen, MIN_SCORE})
    embedder = Embedder()
    return {
        "schema": "kvrag-bench-cutoff/1", "machine": machine(),
        "embedder": {"fingerprint": embedder.fingerprint, "dtype": embedder.dtype},
        "stores": {"musique": str(musique_store), "demo": str(demo_store)},
        "rule": RULE, "chosen": chosen, "min_score_default": MIN_SCORE,
        "groups": [{**asdict(g), "summary": summary(g.scores)} for g in groups],
        "sweep": [{"min_score": t, **{g.name: round(g.share(t), 4) for g in groups}} for t in cutoffs],
        "hits": [row for split, (chosen_items, found) in musique.items()
                 for row in hit_rows(split, chosen_items, found, sorted({0.0, chosen, MIN_SCORE}), k, relative_cutoff)],
    }


def summary(scores: list[float]) -> dict:
    ordered = sorted(scores)
    deciles = statistics.quantiles(ordered, n=10, method="inclusive") if len(ordered) > 1 else ordered * 9
    return {"n": len(ordered), "min": ordered[0], "p10": round(deciles[0], 4), "median": statistics.median(ordered),
            "p90": round(deciles[-1], 4), "max": ordered[-1]}


def render(report: dict) -> str:
    """The report's markdown tables: score distributions, the sweep, and what reaches the prompt."""
    groups = report["groups"]
    lines = [f"Absolute retrieval cutoff: chosen {report['chosen']:.2f} (MIN_SCORE in config.py: "
             f"{report['min_score_default']:.2f}); embedder {report['embedder']['fingerprint']} "
             f"({report['embedder']['dtype']}); CPU {report['machine'].get('cpu', '?')}", "",
             f"Rule: {report['rule']}.", "",
             "| requests | kind | split | store | n | min | p10 | median | p90 | max |", "|---|---|---|---|---|---|---|---|---|---|"]
    for g in groups:
        s = g["summary"]
        lines.append(f"| {g['name']} | {g['kind']} | {g['split']} | {g['store']} | {s['n']} | {s['min']:.3f} | "
                     f"{s['p10']:.3f} | {s['median']:.3f} | {s['p90']:.3f} | {s['max']:.3f} |")
    heads = [f"{g['name']} {'keeps passages' if g['kind'] == 'docs' else 'plain chat'}" for g in groups]
    lines += ["", "| min_score | " + " | ".join(heads) + " |", "|---" * (len(groups) + 1) + "|"]
    for row in report["sweep"]:
        mark = " (chosen)" if row["min_score"] == report["chosen"] else ""
        cells = [_count(row[g["name"]], g["summary"]["n"]) for g in groups]
        lines.append(f"| {row['min_score']:.2f}{mark} | " + " | ".join(cells) + " |")
    lines += ["", "| MuSiQue split | min_score | with passages | hits kept | own passages | answer-bearing |",
              "|---|---|---|---|---|---|"]
    for row in report["hits"]:
        lines.append(f"| {row['split']} | {row['min_score']:.2f} | {row['with_passages']}/{row['questions']} | "
                     f"{row['hits']}/{row['questions'] * row['k']} | {row['own']} | {row['answer_bearing']} |")
    return "\n".join(lines)


def _count(share: float, n: int) -> str:
    return f"{round(share * n)}/{n}"
