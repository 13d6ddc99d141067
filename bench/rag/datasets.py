"""The benchmark's data sets by name, each cut into a tuning split and a report split.

    musique         MuSiQue as CacheBlend published it (../shared/data/musique_s.json, not in the repository):
                    items 0-49 tune, 50-99 report; 100-149 are the release check, in no split
    cross-passage   generated two-hop questions over short invented passages (bench/rag/cross_passage.py,
                    240 items, seed 0): its first half tunes, its second half reports
    sample          the bundled corpus (corpus/sample) with one question per document
                    (corpus/demo-questions.jsonl), every document in each prompt in a seeded order: both splits

Anything else is a path to a MuSiQue-format file, whose every item is in each split. Defaults are chosen on
`tune` and reported on `report`, never on the release check.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from kvrag.bench.rag.items import default_dataset, read_dataset
from kvrag.errors import KvragError

SPLITS = ("tune", "report", "all")
MUSIQUE_TUNE, MUSIQUE_REPORT = range(0, 50), range(50, 100)  # items 100-149: the held-out release check
NAMES = ("musique", "cross-passage", "sample")
_CORPUS = Path(__file__).resolve().parents[2] / "corpus"


@dataclass(frozen=True)
class Dataset:
    name: str  # a set's name, or the file's path
    items: list[dict]  # MuSiQue format: question, answers, ctxs
    splits: dict[str, list[int]]  # split name -> item indices

    def indices(self, split: str) -> list[int]:
        if split not in SPLITS:
            raise KvragError(f"--split must be one of {', '.join(SPLITS)}, got {split!r}")
        return self.splits[split]


def load_dataset(source: str | Path) -> Dataset:
    """A named set (see the module doc) or a MuSiQue-format file."""
    name = str(source)
    if name == "musique":
        items = read_dataset(default_dataset())
        return Dataset(name, items, _ranges(len(items), MUSIQUE_TUNE, MUSIQUE_REPORT))
    if name == "cross-passage":
        from kvrag.bench.rag.cross_passage import make_items

        items = make_items()
        return Dataset(name, items, {"tune": [i for i, it in enumerate(items) if it["split"] == "tune"],
                                     "report": [i for i, it in enumerate(items) if it["split"] == "report"],
                                     "all": list(range(len(items)))})
    if name == "sample":
        items = sample_items()
        every = list(range(len(items)))
        return Dataset(name, items, {"tune": every, "report": every, "all": every})
    if not Path(source).exists():
        raise KvragError(f"{source} does not exist (the named sets are {', '.join(NAMES)})")
    items = read_dataset(Path(source))
    every = list(range(len(items)))
    return Dataset(name, items, {"tune": every, "report": every, "all": every})


def musique_report_items(path: Path | None) -> list[dict]:
    """The report split's items (50-99) of a MuSiQue-format file (default: the benchmarks' copy); KvragError when it
    has none."""
    items = read_dataset(path)
    if len(items) <= MUSIQUE_REPORT.start:
        raise KvragError(f"the data set has {len(items)} items: none in the report split (items 50-99)")
    return [items[i] for i in MUSIQUE_REPORT if i < len(items)]


def _ranges(n: int, tune: range, report: range) -> dict[str, list[int]]:
    return {"tune": [i for i in tune if i < n], "report": [i for i in report if i < n], "all": list(range(n))}


def sample_items(seed: int = 0) -> list[dict]:
    """The demo questions, each over every bundled document (title and text as `kvrag index` reads them)."""
    from kvrag.corpus.sources import read_markdown, read_text

    docs = []
    for path in sorted((_CORPUS / "sample").iterdir()):
        doc = read_markdown(path) if path.suffix == ".md" else read_text(path)
        docs.append({"title": doc.title, "text": doc.text.strip()})
    questions = [json.loads(line) for line in (_CORPUS / "demo-questions.jsonl").read_text().splitlines()
                 if line.strip()]
    rng = random.Random(seed)
    return [{**q, "ctxs": rng.sample(docs, len(docs))} for q in questions]
