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

import json
import math
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvrag.blend.config import BlendConfig
from kvrag.blend.ratio import SUFFIX_GUESS, RatioPolicy, full_ratio
from kvrag.config import DEFAULT_SELECTION
from kvrag.engine.answer_set import Names, filler_note, is_right, make_items, same_answer
from kvrag.engine.prefiller import Prefiller
from kvrag.model.decode import generate
from kvrag.model.runtime import Runtime
from kvrag.model.sampling import SamplingConfig
from kvrag.precompute import lead_in
from kvrag.store.chunks import chunk_id_for
from kvrag.store.env import StoreEnv

LADDER = (0.05, 0.1, 0.15, 0.2, 0.3)  # floors tried, cheapest first, up to the break-even with full prefill
RULES = (DEFAULT_SELECTION, "query")  # at each rung, the default rule first
PROMPTS, TOKENS, SEED = 6, (3000, 3600), 7919  # the bench's sets use other seeds (bench/answers.py)
KEPT_BOUND = 0.95  # share of full prefill's right answers the blend keeps (at least)
AGREEMENT_BOUND = 0.8  # share of prompts whose normalized answer is full prefill's (at least): one of 6 may differ
MIN_RIGHT = 3  # full prefill right on fewer prompts: the answers cannot judge the blend
ANSWER_TOKENS = 16
# what the ladder's blends cost, as a share of the full prefills' (an estimate's upper side: 2.2 for the 1.5B model's
# passing ladder in bf16, 0.97 for the 0.5B's failing one in float32; docs/model-check.md)
LADDER_SHARE = 2.0
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
    finished: bool = False  # passed, or stopped at a loss past its bounds (else: under way when the check stopped)


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


class Deferred(Exception):  # noqa: N818 - a verdict put off, not an error
    """The answers check would take longer than its budget (a first use on a slow CPU): what it did is journaled."""

    def __init__(self, remaining_s: float):
        super().__init__(f"about {remaining_s / 60:.0f} min left")
        self.remaining_s = remaining_s


@dataclass
class Journal:
    """What a check has done, saved after every prompt (atomically, beside its report): a check interrupted, or put
    off at a first use, resumes from it. `path` None: kept in memory only."""

    path: Path | None
    key: dict
    exact: list[dict] = field(default_factory=list)  # the exactness checks' results (engine/model_check.py)
    full: list[str] = field(default_factory=list)  # full prefill's answers, prompt by prompt
    right: list[bool] = field(default_factory=list)
    full_s: list[float] = field(default_factory=list)  # seconds of each full prefill's answer
    rungs: list[Rung] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path | None, key: dict) -> Journal:
        """The journal at `path` if it is this key's, else a fresh one."""
        try:
            data = json.loads(path.read_text()) if path is not None else {}
        except (OSError, ValueError):
            data = {}
        if data.get("key") != key:
            return cls(path, key)
        rungs = [Rung(**r) for r in data.get("rungs", [])]
        return cls(path, key, data.get("exact", []), data["full"], data["right"], data["full_s"], rungs)

    def save(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".tmp-{time.monotonic_ns()}")
            tmp.write_text(json.dumps({**asdict(self), "path": None}, indent=1))
            tmp.replace(self.path)
        except OSError:  # a read-only KVRAG_HOME: the check holds for this process alone
            pass

    def drop(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    def remaining_s(self, prompts: int) -> float:
        """The seconds the answers check has left, from its full prefills so far (0 before the first)."""
        if not self.full_s:
            return 0.0
        each = sum(self.full_s) / len(self.full_s)
        return each * (prompts - len(self.full)) + each * prompts * LADDER_SHARE - sum(r.seconds for r in self.rungs)


def check_prompts(runtime: Runtime) -> list[dict]:
    """The check's prompts (MuSiQue-format items), counted in the model's own tokens."""
    notes_rng = random.Random(SEED)
    names = Names(random.Random(SEED + 2))
    pool = [filler_note(names, notes_rng) for _ in range(NOTES_POOL)]

    return make_items(PROMPTS, SEED, lambda r: r.choice(pool), TOKENS, token_counter(runtime))


def token_counter(runtime: Runtime) -> Callable[[str], int]:
    """A text's length in the model's own tokens (what a set's prompt lengths are counted in)."""
    return lambda text: len(runtime.tokenizer(text, add_special_tokens=False)["input_ids"])


def item_chunks(runtime: Runtime, item: dict) -> list[tuple[str, list[int]]]:
    """An item's passages as the chunks `ask` prefills: (chunk id, token ids) each. A passage shared by prompts is
    one chunk, its KV computed once."""
    tokenizer = runtime.local.tokenizer_fingerprint
    return [(chunk_id_for(ids, tokenizer), ids)
            for ids in (runtime.prompts.passage_ids(c.get("title") or "", c["text"]) for c in item["ctxs"])]


def answer(prefiller: Prefiller, chunks, question: str, mode: str, config: BlendConfig) -> str:
    """The greedy answer (ANSWER_TOKENS at most) of one prefill, up to the end of its first line: the judge reads
    that line alone (answer_set.answer_line), so the tokens after it are not decoded."""
    runtime = prefiller.runtime
    pre = prefiller.prefill(chunks, question, mode, config, extra=ANSWER_TOKENS)
    ids, text = [], ""
    for token in generate(runtime.model, pre.cache, pre.logits, SamplingConfig(max_tokens=ANSWER_TOKENS),
                          prefiller.stop_ids):
        ids.append(token)
        text = runtime.tokenizer.decode(ids, skip_special_tokens=True)
        if "\n" in text.lstrip():  # a line with text in it has ended
            break
    return text


def judge(runtime: Runtime, progress: Progress | None, journal: Journal, budget_s: float | None) -> AnswerResult:
    """The check's judge over a store of its own for the check's life: its blends read the chunks as `ask` reads
    them, the dense model's KV in the store's codec, whatever form the weights decode in, after the model's lead-in
    (drawn from the check's own passages, as precompute draws one from a corpus)."""
    items = check_prompts(runtime)
    passages = dict(c for it in items for c in item_chunks(runtime, it))
    lead = lead_in.choose((passages[c] for c in sorted(passages)), lead_in.tokens_for(runtime))
    with tempfile.TemporaryDirectory(prefix="kvrag-check-") as tmp, \
            StoreEnv.open(Path(tmp) / "store", create=True) as env:
        return run_answers(runtime, Prefiller.open(runtime, env, lead_in=lead), progress, items=items,
                           journal=journal, budget_s=budget_s)


def run_answers(runtime: Runtime, prefiller: Prefiller, progress: Progress | None = None,
                rules: tuple[str, ...] = RULES, items: list[dict] | None = None,
                ladder: tuple[float, ...] = LADDER, journal: Journal | None = None,
                budget_s: float | None = None) -> AnswerResult:
    """Full prefill's answers, then the ladder until a rung keeps them (or none below the break-even does), reading
    the prompts' chunks from `prefiller`'s store, where each is stored before its first blend as `kvrag precompute`
    stores them (the ladder reads what `ask` reads: the dense model's stored KV). `items`:
    other prompts than the check's (MuSiQue-format, with `wrong`). `journal`: resume from it, and save to it after
    every prompt. `budget_s`: raise Deferred (the journal saved) once the first full prefill says the rest would take
    longer."""
    progress = progress or _silent
    journal = journal or Journal(None, {})
    items = check_prompts(runtime) if items is None else items
    prompts = [(item_chunks(runtime, it), it["question"], (it["answers"], it["wrong"])) for it in items]
    _full_answers(prefiller, prompts, journal, progress, budget_s)
    result = AnswerResult(len(prompts), sum(journal.right), sum(journal.full_s) / max(1, len(journal.full_s)),
                          journal.rungs)
    if not result.judged:
        return result
    try:
        _ladder(runtime, prefiller, prompts, journal, rules, ladder, progress)
    finally:
        prefiller.release_storing()
    return result


def _ladder(runtime: Runtime, prefiller: Prefiller, prompts, journal: Journal, rules, ladder, progress) -> None:
    """The rungs in turn, cheapest first, until one keeps the answers (or none below the break-even does)."""
    cfg, stored = runtime.model.cfg, set()
    even = min(full_ratio(cfg.n_layers, BlendConfig().check_at, sum(len(ids) for _, ids in chunks), SUFFIX_GUESS)
               for chunks, _, _ in prompts)
    for ratio in (r for r in ladder if r < even):
        for rule in rules:
            rung = next((r for r in journal.rungs if (r.rule, r.ratio) == (rule, ratio)), None)
            if rung is None:
                journal.rungs.append(rung := Rung(rule, ratio))
            if not rung.finished:
                _rung(runtime, prefiller, prompts, journal, rung, progress, stored)
            if rung.passed:
                return


def _full_answers(prefiller: Prefiller, prompts, journal: Journal, progress: Progress,
                  budget_s: float | None) -> None:
    """Full prefill's answer to each prompt the journal lacks, stopping where too few are right to judge, or (a
    budget) where the first says the check would take longer than it allows."""
    for n in range(len(journal.full), len(prompts)):
        if budget_s is not None and journal.remaining_s(len(prompts)) > budget_s:
            raise Deferred(journal.remaining_s(len(prompts)))
        if sum(journal.right) + len(prompts) - n < MIN_RIGHT:  # too few right to judge, whatever the rest answer
            return
        chunks, question, golds = prompts[n]
        progress("full prefill", n, len(prompts))
        start = time.perf_counter()
        journal.full.append(answer(prefiller, chunks, question, "full", BlendConfig()))
        journal.full_s.append(time.perf_counter() - start)
        journal.right.append(is_right(journal.full[-1], *golds))
        journal.save()


def _rung(runtime: Runtime, prefiller: Prefiller, prompts, journal: Journal, rung: Rung, progress: Progress,
          stored: set[int]) -> None:
    """One rung over the prompts (from where the journal left it), stopped once it has lost more than its bounds
    allow. `stored`: the prompts whose chunks are in the prefiller's store (this process's)."""
    n_layers, full, right = runtime.model.cfg.n_layers, journal.full, journal.right
    may_lose = math.floor((1 - KEPT_BOUND) * sum(right) + 1e-9)
    may_differ = math.floor((1 - AGREEMENT_BOUND) * len(prompts) + 1e-9)
    for n in range(rung.items, len(prompts)):
        chunks, question, golds = prompts[n]
        progress(f"blend {rung.rule}@{rung.ratio:g}", n, len(prompts))
        if n not in stored:  # a prompt's chunks, stored before its first blend (most rungs stop at their first)
            prefiller.store_chunks(chunks)
            stored.add(n)
        start = time.perf_counter()
        config = RatioPolicy(None).resolve(BlendConfig(selection=rung.rule), n_layers,
                                          sum(len(ids) for _, ids in chunks), SUFFIX_GUESS, rung.ratio)
        got = full[n] if config is None else answer(prefiller, chunks, question, "blend", config)
        rung.items += 1
        rung.right += right[n]
        rung.kept += right[n] and is_right(got, *golds)
        rung.agreed += same_answer(got, full[n])
        rung.seconds += time.perf_counter() - start
        rung.finished = rung.right - rung.kept > may_lose or rung.items - rung.agreed > may_differ
        rung.passed = not rung.finished and rung.items == len(prompts)
        rung.finished |= rung.passed
        journal.save()
        if rung.finished:
            return


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
