"""The answerable sets through the user's path: their records indexed as a corpus, asked with `kvrag ask`.

`write` puts the records (fact and look-alike passages, no filler) of N generated items of a split into a corpus JSONL
for `kvrag index` and their questions into a questions JSONL for `kvrag ask --questions`; `score` reads the
`kvrag ask --json` outputs of several modes and prints, per mode, the right answers, the share of full prefill's
right answers kept and the answer agreement, each with its Wilson 95 % interval, and the median TTFT ÷ full's.

    python tools/answerable_corpus.py write --items 30 --out /tmp/ans
    kvrag index /tmp/ans/corpus.jsonl --store /tmp/ans/store --model M && kvrag precompute --store /tmp/ans/store --model M
    kvrag ask --questions /tmp/ans/questions.jsonl --store /tmp/ans/store --model M -k 10 --relative-cutoff 0 \
        --mode full --json > /tmp/ans/full.json   # and --mode blend > /tmp/ans/blend.json
    python tools/answerable_corpus.py score /tmp/ans/questions.jsonl full=/tmp/ans/full.json blend=/tmp/ans/blend.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from kvrag.bench.answers import SEEDS
from kvrag.bench.rag.metrics import wilson
from kvrag.engine.answer_set import is_right, make_items, same_answer


def write(items: int, split: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    generated = make_items(items, SEEDS[split] + 7, lambda r: ("", ""), tokens=(1, 1))  # records only: no filler
    records, questions = {}, []
    for it in generated:
        for c in it["ctxs"]:
            if c["text"]:
                records.setdefault(c["text"], {"id": f"r{len(records)}", "title": c["title"], "text": c["text"]})
        questions.append({"question": it["question"], "answers": it["answers"], "wrong": it["wrong"],
                          "kind": it["kind"]})
    (out / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records.values()))
    (out / "questions.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    print(f"{len(records)} records, {len(questions)} questions in {out}")


def score(questions: Path, runs: list[str]) -> None:
    asked = [json.loads(line) for line in questions.read_text().splitlines() if line.strip()]
    answers = {}
    for run in runs:
        mode, path = run.split("=", 1)
        text = Path(path).read_text()  # `kvrag ask --json --questions` writes one JSON list
        answers[mode] = json.loads(text) if text.lstrip().startswith("[") else \
            [json.loads(line) for line in text.splitlines() if line.strip()]
    full = answers["full"]
    right_full = {i for i, a in enumerate(full) if is_right(a["answer"], asked[i]["answers"], asked[i]["wrong"])}
    print("| mode | ran | right | kept of full's right | agreement | TTFT ÷ full (median) |\n|---|---|---|---|---|---|")
    for mode, got in answers.items():
        right = {i for i, a in enumerate(got) if is_right(a["answer"], asked[i]["answers"], asked[i]["wrong"])}
        agree = sum(same_answer(a["answer"], f["answer"]) for a, f in zip(got, full, strict=True))
        ratios = [a["timings"]["ttft"] / f["timings"]["ttft"] for a, f in zip(got, full, strict=True)]
        ran = sorted({f"{a['mode']} {a.get('rule') or ''}".strip() for a in got})
        cells = [wilson(len(right), len(got)), wilson(len(right & right_full), len(right_full)), wilson(agree, len(got))]
        text = " | ".join(f"{c['k']}/{c['n']} [{c['low']:.2f}, {c['high']:.2f}]" for c in cells)
        print(f"| {mode} | {', '.join(ran)} | {text} | {statistics.median(ratios):.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write")
    w.add_argument("--items", type=int, default=30)
    w.add_argument("--split", choices=sorted(SEEDS), default="report")
    w.add_argument("--out", type=Path, required=True)
    s = sub.add_parser("score")
    s.add_argument("questions", type=Path)
    s.add_argument("runs", nargs="+", help="MODE=FILE, one of them full=FILE")
    args = parser.parse_args()
    if args.command == "write":
        write(args.items, args.split, args.out)
    else:
        score(args.questions, args.runs)


if __name__ == "__main__":
    main()
