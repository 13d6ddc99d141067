"""The model check's judge of blending: does a blend keep full prefill's answers on long prompts the model can answer,
and at what ratio?

Six prompts of 3,000-3,600 tokens (engine/answer_set.py: look-ups, bridges, comparisons and aggregations over
records with look-alikes of the same template, among invented notes of six kinds) are answered greedily by full prefill, then
by the blend at each rung of LADDER, the selection rules in turn, each rung run exactly as `--ratio auto` runs with
that rung as its floor (blend/ratio.py), so that what serves is what was checked. The first rung that keeps
KEPT_BOUND of full prefill's right answers with AGREEMENT_BOUND of its answers equal is the model's choice; a rung
stops at the first loss past what its bounds allow. A model that answers fewer than MIN_RIGHT prompts right cannot be
judged by answers: the first-token checks on short prompts judge it (engine/model_check.py).
"""

from __future__ import annotations

import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from kvrag.blend.config import BlendConfig
from kvrag.blend.ratio import SUFFIX_GUESS, RatioPolicy, full_ratio
from kvrag.config import DEFAULT_SELECTION
from kvrag.engine.answer_set import Names, filler_note, is_right, make_items, same_answer
from kvrag.engine.prefiller import Prefiller
from kvrag.model.decode import generate
from kvrag.model.runtime import Runtime
from kvrag.model.sampling import SamplingConfig
from kvrag.store.chunks import chunk_id_for

LADDER = (0.05, 0.1, 0.15, 0.2, 0.3)  # floors tried, cheapest first, up to the break-even with full prefill
RULES = (DEFAULT_SELECTION, "query")  # at each rung, the default rule first
PROMPTS, TOKENS, SEED = 6, (3000, 3600), 7919  # the bench's sets use other seeds (bench/answers.py)
KEPT_BOUND = 0.95  # share of full prefill's right answers the blend keeps (at least)
AGREEMENT_BOUND = 0.8  # share of prompts whose normalized answer is full prefill's (at least): one of 6 may differ
MIN_RIGHT = 3  # full prefill right on fewer prompts: the answers cannot judge the blend
ANSWER_TOKENS = 16
NOTES_POOL = 40  # the prompts' other passages, drawn from one pool (each one's KV computed once for every prompt)

Progress = Callable[[str, int, int], None]
EXACTNESS = "exactness on short prompts"  # the checks' first phase (engine/model_check.py), named in progress


@dataclass
class Rung:
    rule: str
    ratio: float  # the floor `auto` starts from
    items: int = 0  # prompts run (a rung stops at its first loss past the bounds)
    kept: int = 0  # of full prefill's right answers, kept
    right: int = 0  # full prefill's right answers among the prompts run
    agreed: int = 0
    passed: bool = False
    seconds: float = 0.0


@dataclass
class AnswerResult:
    prompts: int
    full_right: int
    full_s: float  # full prefill's mean seconds a prompt, answer included
    rungs: list[Rung] = field(default_factory=list)

    @property
    def judged(self) -> bool:
        return self.full_right >= MIN_RIGHT

    @property
    def choice(self) -> Rung | None:
        return next((r for r in self.rungs if r.passed), None)

    def figures(self) -> dict:
        return {"prompts": self.prompts, "full_right": self.full_right, "full_s": round(self.full_s, 3),
                "rungs": [asdict(r) for r in self.rungs]}


def check_prompts(runtime: Runtime) -> list[dict]:
    """The check's prompts (MuSiQue-format items), counted in the model's own tokens."""
    notes_rng = random.Random(SEED)
    names = Names(random.Random(SEED + 2))
    pool = [filler_note(names, notes_rng) for _ in range(NOTES_POOL)]

    return make_items(PROMPTS, SEED, lambda r: r.choice(pool), TOKENS, token_counter(runtime))


def token_counter(runtime: Runtime) -> Callable[[str], int]:
    """A text's length in the model's own tokens (what a set's prompt lengths are counted in)."""
    return lambda text: len(runtime.tokenizer(text, add_special_tokens=False)["input_ids"])


def answer(prefiller: Prefiller, chunks, question: str, mode: str, config: BlendConfig) -> str:
    """The greedy answer (ANSWER_TOKENS at most) of one prefill."""
    runtime = prefiller.runtime
    pre = prefiller.prefill(chunks, question, mode, config, extra=ANSWER_TOKENS)
    ids = list(generate(runtime.model, pre.cache, pre.logits, SamplingConfig(max_tokens=ANSWER_TOKENS),
                        prefiller.stop_ids))
    return runtime.tokenizer.decode(ids, skip_special_tokens=True)


def run_answers(runtime: Runtime, prefiller: Prefiller, progress: Progress | None = None,
                rules: tuple[str, ...] = RULES, items: list[dict] | None = None,
                ladder: tuple[float, ...] = LADDER) -> AnswerResult:
    """Full prefill's answers, then the ladder until a rung keeps them (or none below the break-even does). `items`:
    other prompts than the check's (MuSiQue-format, with `wrong`)."""
    progress = progress or _silent
    items = check_prompts(runtime) if items is None else items
    tokenizer = runtime.local.tokenizer_fingerprint  # a passage shared by prompts is one chunk: its KV computed once
    prompts = [([(chunk_id_for(ids, tokenizer), ids) for ids in
                 (runtime.prompts.passage_ids(c["title"], c["text"]) for c in it["ctxs"])],
                it["question"], (it["answers"], it["wrong"])) for it in items]
    start, full, right = time.perf_counter(), [], []
    for n, (chunks, question, golds) in enumerate(prompts):
        if sum(right) + len(prompts) - n < MIN_RIGHT:  # too few right to judge, whatever the rest answer
            break
        progress("full prefill", n, len(prompts))
        full.append(answer(prefiller, chunks, question, "full", BlendConfig()))
        right.append(is_right(full[-1], *golds))
    result = AnswerResult(len(prompts), sum(right), (time.perf_counter() - start) / len(full))
    if not result.judged:
        return result
    cfg = runtime.model.cfg
    even = min(full_ratio(cfg.n_layers, BlendConfig().check_at, sum(len(ids) for _, ids in chunks), SUFFIX_GUESS)
               for chunks, _, _ in prompts)
    for ratio in (r for r in ladder if r < even):
        for rule in rules:
            rung = _rung(runtime, prefiller, prompts, full, right, Rung(rule, ratio), progress)
            result.rungs.append(rung)
            if rung.passed:
                return result
    return result


def _rung(runtime: Runtime, prefiller: Prefiller, prompts, full: list[str], right: list[bool], rung: Rung,
          progress: Progress) -> Rung:
    """One rung over the prompts, stopped once it has lost more than its bounds allow."""
    start, n_layers = time.perf_counter(), runtime.model.cfg.n_layers
    may_lose = math.floor((1 - KEPT_BOUND) * sum(right) + 1e-9)
    may_differ = math.floor((1 - AGREEMENT_BOUND) * len(prompts) + 1e-9)
    for n, (chunks, question, golds) in enumerate(prompts):
        progress(f"blend {rung.rule}@{rung.ratio:g}", n, len(prompts))
        config = RatioPolicy(None).resolve(BlendConfig(selection=rung.rule), n_layers,
                                          sum(len(ids) for _, ids in chunks), SUFFIX_GUESS, rung.ratio)
        got = full[n] if config is None else answer(prefiller, chunks, question, "blend", config)
        rung.items += 1
        rung.right += right[n]
        rung.kept += right[n] and is_right(got, *golds)
        rung.agreed += same_answer(got, full[n])
        if rung.right - rung.kept > may_lose or rung.items - rung.agreed > may_differ:
            break
    else:
        rung.passed = True
    rung.seconds = time.perf_counter() - start
    return rung


def _silent(what: str, done: int, total: int) -> None:
    pass


def stderr_progress(name: str) -> Progress:
    """One line on stderr that a terminal rewrites in place (a line a step elsewhere)."""
    tty = sys.stderr.isatty()

    def show(what: str, done: int, total: int) -> None:
        if not tty and what == EXACTNESS:  # seconds on most models: a log gets the long prompts' steps only
            return
        line = f"kvrag: checking how {name} blends (once per model and setup): {what} {done + 1}/{total}"
        print(("\r" + line + "\033[K") if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)

    return show
