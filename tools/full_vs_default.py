"""`mode: full` against the default mode on novel plain prompts (issue 57's target: 0.9-1.1x): each prompt is new
invented text (no stored passage, no prefix-cache hit), the two modes alternated, TTFT medians.

    python tools/full_vs_default.py STORE [WORDS]      (e.g. .kvrag/demo-store after `make demo`; WORDS 1500)
"""

import json
import random
import statistics
import sys

from kvrag import KVRag

WORDS = ("harbour lamp keeper granite tower winter reef ledger ship storm tide beacon island cliff rope lantern "
         "northern southern old new brother sister village mill bridge river valley road chapel market").split()


def main(store: str, n_words: int = 1500, pairs: int = 4) -> None:
    rng = random.Random(7)

    def prompt(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n)) + "\nWho kept the light?"

    ttft: dict[str, list[float]] = {"full": [], "blend": []}
    with KVRag(store, retrieval="client", model_check=False) as rag:
        rag.ask(prompt(50), rag=False, max_tokens=1)  # warm
        for i in range(pairs):
            for mode in ("full", "blend") if i % 2 else ("blend", "full"):
                answer = rag.submit(prompt(n_words), rag=False, mode=mode, max_tokens=1).result()
                ttft[mode].append(answer.timings["ttft"])
    medians = {mode: statistics.median(times) for mode, times in ttft.items()}
    print(json.dumps({"ttft_s": ttft, "median_s": medians, "full_over_default": medians["full"] / medians["blend"],
                      "load_average": open("/proc/loadavg").read().split()[:3]}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
