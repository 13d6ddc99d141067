"""The in-process 12-turn plain chat of docs/performance.md ("One KV memory", "A hit read in place"), until
`kvrag bench chat` measures the same over the real server.

    HF_HUB_OFFLINE=1 .venv/bin/python tools/chat_turns.py [--store .kvrag/demo-store] [--turns 12] [--repeats 3]

Each user turn is 270 words of MuSiQue passages (../shared/data/musique_s.json) and a one-line instruction, sent with
the whole history (keep_turn, 8-token answers); then the last turn is repeated exactly. Prints per turn the prompt
tokens and TTFT, per repeat its TTFT and timings, and the load average.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvrag import KVRag

WORDS = 270


def user_turns(dataset: Path, n: int) -> list[str]:
    texts = [c["text"] for item in json.loads(dataset.read_text())[:40] for c in item["ctxs"]]
    words = " ".join(texts).split()
    return [" ".join(words[i * WORDS:(i + 1) * WORDS]) + "\nSummarise the above in one line." for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default=".kvrag/demo-store")
    parser.add_argument("--dataset", type=Path, default=Path("../shared/data/musique_s.json"))
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    history: list[tuple[str, str]] = []
    with KVRag(args.store, host_cache="0") as rag:
        for turn, question in enumerate(user_turns(args.dataset, args.turns), 1):
            answer = rag.submit(question, rag=False, history=tuple(history), keep_turn=True, max_tokens=8).result()
            print(f"turn {turn}: {answer.prompt_tokens} prompt tokens, TTFT {answer.timings['ttft']:.3f} s")
            history += [("user", question), ("assistant", answer.text)]
        for _ in range(args.repeats):
            answer = rag.submit(history[-2][1], rag=False, history=tuple(history[:-2]), keep_turn=True,
                                max_tokens=8).result()
            timings = {k: round(v, 3) for k, v in answer.timings.items()}
            print(f"repeat: {answer.prompt_tokens} prompt tokens, TTFT {timings['ttft']:.3f} s, {timings}")
    print("load average", Path("/proc/loadavg").read_text().split()[:3])


if __name__ == "__main__":
    main()
