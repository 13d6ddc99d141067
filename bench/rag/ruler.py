"""RULER-style synthetic long-context tasks (Hsieh et al. 2024), generated offline from a seed.

    needle      one "special magic number" sentence for a key hidden in the haystack; asks for its number
    multikey    four such sentences with different keys (three distractors); asks for one key's number
    multivalue  four numbers for the same key; asks for all four
    vartrack    "VAR ABCDE = 12345." then "VAR FGHIJ = VAR ABCDE." ... (a chain of five names, one distractor
                chain beside it); asks for every name that holds the value

The haystack is real prose: the passages of the MuSiQue set (../shared/data/musique_s.json) in file order from a
seeded start (its tune and report items only: items 100 on are held out), else the bundled corpus (corpus/sample),
its sentences reshuffled on every pass since it is short. It is cut at sentence boundaries into passage-sized
chunks, so that each chunk's KV is stored on its own; the needles go into *distinct* chunks, one per equal stretch
of the context (first, middle, last), because what is measured is whether blended KV still joins facts across chunk
boundaries. The whole prompt (preamble, chunks, suffix with the question) plus `answer_tokens` for the answer fills
the target length to within a few tokens.

Scored as RULER scores these tasks: the share of expected strings found in the answer, case-insensitively.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvrag.bench.rag.datasets import MUSIQUE_REPORT
from kvrag.bench.rag.items import BenchItem, default_dataset, read_dataset
from kvrag.errors import KvragError
from kvrag.model.prompt import encode
from kvrag.store.chunks import chunk_id_for

KINDS = ("needle", "multikey", "multivalue", "vartrack")
LENGTHS = (2048, 4096, 8192)
CHUNK_TOKENS = 192  # passage-sized: 2k holds ~10 chunks, enough to spread a 5-statement chain over distinct ones
ANSWER_TOKENS = 32  # kept free for the answer, so an 8192 target fits SmolLM2's 8192 positions (the runner decodes 32)
MULTI = 4  # multikey: keys (1 asked + 3 distractors); multivalue: values of the one key
CHAIN = 5  # vartrack: names per chain (RULER: 4 hops)
_CORPUS = Path(__file__).resolve().parents[2] / "corpus" / "sample"
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=\S)")

NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION_ONE = "What is the special magic number for {key} mentioned in the provided text?"
QUESTION_ALL = "What are all the special magic numbers for {key} mentioned in the provided text?"
QUESTION_VARS = "Find all variables that are assigned the value {value} in the text above."
# RULER's keys are adjective-noun pairs; no word here is a substring of another, so no key contains another
ADJECTIVES = ("amber", "brisk", "cheerful", "dusty", "eager", "frosty", "gentle", "hollow", "jolly", "lavish",
              "mellow", "nimble", "polite", "quiet", "rustic", "silky", "tidy", "vivid", "wistful", "zealous",
              "crimson", "fuzzy", "grumpy", "humble", "icy", "lucky", "murky", "proud", "shiny", "witty")
NOUNS = ("anchor", "badger", "candle", "dolphin", "falcon", "glacier", "harbor", "island", "jacket", "kettle",
         "lantern", "meadow", "nectar", "orchid", "pepper", "quartz", "ribbon", "saddle", "tunnel", "violin",
         "walrus", "yogurt", "zebra", "blanket", "cactus", "dragon", "feather", "guitar", "helmet", "pillow")


@dataclass(frozen=True)
class Needle:
    text: str  # the sentence as inserted
    chunk: int  # index into item.chunks of the chunk that holds it
    gold: bool  # part of what the question asks (False: a distractor)


@dataclass(frozen=True)
class RulerTask:
    kind: str
    target_tokens: int  # prompt + ANSWER_TOKENS, as the model's tokenizer counts
    item: BenchItem  # question, answers (= expected) and chunks, for the MuSiQue runner
    expected: list[str]  # what a correct answer contains: numbers, or variable names
    needles: list[Needle]
    prompt_tokens: int  # preamble + chunks + suffix with the question
    haystack: str  # "musique", "sample", or the file name of another MuSiQue-format source
    seed: int


@dataclass(frozen=True)
class Haystack:
    name: str
    docs: list[list[str]]  # documents as sentences


def ruler_score(answer: str, expected: Sequence[str]) -> float:
    """RULER's string_match_all: the share of expected strings that occur in the answer, ignoring case."""
    if not expected:
        raise ValueError("ruler_score needs at least one expected string")
    low = answer.lower()
    return sum(e.lower() in low for e in expected) / len(expected)


def ruler_all(answer: str, expected: Sequence[str]) -> float:
    """1.0 when every expected string occurs in the answer, else 0.0."""
    return float(ruler_score(answer, expected) == 1.0)


def generate_tasks(prompts, tokenizer_fp: str, kinds: Sequence[str] = KINDS, lengths: Sequence[int] = LENGTHS,
                   per_cell: int = 3, seed: int = 0, haystack_source: str | Path | None = None,
                   chunk_tokens: int = CHUNK_TOKENS, answer_tokens: int = ANSWER_TOKENS) -> list[RulerTask]:
    """`per_cell` tasks for every (kind, length), in that order. `prompts` is the runtime's PromptBuilder.

    haystack_source: None (MuSiQue when ../shared has it, else the bundled corpus), "musique", "sample", or the
    path of a MuSiQue-format file. Each task draws from its own Random(seed, kind, length, n), so a cell's tasks
    do not change when other kinds or lengths are asked for."""
    bad = [k for k in kinds if k not in KINDS]
    if bad or per_cell < 1 or chunk_tokens < 32:
        raise KvragError(f"ruler: kinds must be among {', '.join(KINDS)} (got {bad}), per_cell >= 1, "
                         f"chunk_tokens >= 32")
    hay = load_haystack(haystack_source)
    out: list[RulerTask] = []
    for kind in kinds:
        for length in lengths:
            for n in range(per_cell):
                rng = random.Random(f"ruler|{seed}|{kind}|{length}|{n}")
                out.append(_make_task(prompts, tokenizer_fp, hay, kind, length, n, rng, len(out), seed,
                                      chunk_tokens, answer_tokens))
    return out


def load_haystack(source: str | Path | None = None) -> Haystack:
    """The prose the needles hide in (see generate_tasks for `source`)."""
    if source is None:
        source = "musique" if default_dataset().exists() else "sample"
    if str(source) == "sample":
        return Haystack("sample", _distinct_sentences(_bundled_docs()))
    path = default_dataset() if str(source) == "musique" else Path(source)
    usable = read_dataset(path)[:MUSIQUE_REPORT.stop]  # items past the report split are held out from every bench
    texts = [ctx.get("text") or "" for item in usable for ctx in item["ctxs"]]
    name = "musique" if str(source) == "musique" else path.name  # another file by its own name in reports
    return Haystack(name, _distinct_sentences([_sentences(t) for t in texts]))


def _distinct_sentences(docs: list[list[str]]) -> list[list[str]]:
    """Each sentence at its first place only: MuSiQue's passages repeat and overlap, and a chunk that came out the
    same twice would be one chunk id twice in a prompt."""
    seen: set[str] = set()
    out = []
    for doc in docs:
        kept = [s for s in doc if not (s in seen or seen.add(s))]
        if kept:
            out.append(kept)
    return out


def _bundled_docs() -> list[list[str]]:
    from kvrag.corpus.sources import read_text

    docs = []
    for path in sorted(_CORPUS.iterdir()):
        lines = [ln for ln in read_text(path).text.splitlines() if not ln.lstrip().startswith("#")]
        docs.append(_sentences(" ".join(lines).replace("**", "")))
    return docs


def _sentences(text: str) -> list[str]:
    return [s for s in _SENTENCE_END.split(" ".join(text.split())) if s]


# ---- one task -------------------------------------------------------------------------------------------


def _make_task(prompts, tokenizer_fp: str, hay: Haystack, kind: str, length: int, n: int, rng: random.Random,
               index: int, seed: int, chunk_tokens: int, answer_tokens: int) -> RulerTask:
    question, expected, chains, marks = _needles(kind, rng)
    overhead = len(prompts.build([], question).flat())
    budget = length - answer_tokens - overhead  # tokens for the chunks, needles included
    n_chunks = max(1, round(budget / chunk_tokens))
    if n_chunks < max(len(c) for c in chains) or budget < n_chunks * 32:
        raise KvragError(f"ruler: {length} tokens is too short for a {kind} task at {chunk_tokens}-token chunks")
    avoid = marks + ["magic number", "VAR "]  # no haystack sentence may look like a needle or hold its key/value
    needle_cost = sum(len(encode(prompts.tokenizer, " " + s)) for c in chains for _, s in c)
    stream = _stream(hay, rng, avoid, prompts.tokenizer, chunk_tokens * 2 // 3)
    units = _fill(prompts, stream, budget - needle_cost, n_chunks)
    needles: list[Needle] = []
    for chain in chains:  # each chain in order over distinct chunks, one per stretch of the context
        for chunk, (gold, sentence) in zip(_spread(rng, len(units), len(chain), n), chain, strict=True):
            units[chunk].insert(rng.randint(0, len(units[chunk])), sentence)
            needles.append(Needle(sentence, chunk, gold))
    chunks = [prompts.passage_ids("", " ".join(u)) for u in units]
    _shrink(prompts, units, chunks, budget, {nd.text for nd in needles})
    item = BenchItem(index, question, list(expected), [(chunk_id_for(ids, tokenizer_fp), ids) for ids in chunks])
    return RulerTask(kind, length, item, list(expected), needles, overhead + item.chunk_tokens, hay.name, seed)


Chains = list[list[tuple[bool, str]]]  # each a list of (gold, sentence), placed in order in distinct chunks


def _needles(kind: str, rng: random.Random) -> tuple[str, list[str], Chains, list[str]]:
    """(question, expected, chains, marks): marks are the keys, names and values the haystack must not contain."""
    if kind == "vartrack":
        names = _distinct(rng, lambda: "".join(rng.choices("ABCDEFGHIJKLMNOPQRSTUVWXYZ", k=5)), 2 * CHAIN)
        values = _distinct(rng, lambda: str(rng.randint(10000, 99999)), 2)
        chains = [_var_chain(names[i * CHAIN:(i + 1) * CHAIN], values[i], gold=i == 0) for i in range(2)]
        return QUESTION_VARS.format(value=values[0]), names[:CHAIN], chains, names + values
    values = _distinct(rng, lambda: str(rng.randint(1_000_000, 9_999_999)), MULTI)
    adjectives, nouns = rng.sample(ADJECTIVES, MULTI), rng.sample(NOUNS, MULTI)
    keys = [f"{a}-{b}" for a, b in zip(adjectives, nouns, strict=True)]
    marks = keys + values
    if kind == "needle":
        return (QUESTION_ONE.format(key=keys[0]), values[:1], [[(True, NEEDLE.format(key=keys[0], value=values[0]))]],
                marks)
    if kind == "multivalue":
        return (QUESTION_ALL.format(key=keys[0]), values,
                [[(True, NEEDLE.format(key=keys[0], value=v)) for v in values]], marks)
    ask = rng.randrange(MULTI)  # multikey: the asked key at a random one of the four places
    return (QUESTION_ONE.format(key=keys[ask]), [values[ask]],
            [[(i == ask, NEEDLE.format(key=k, value=v)) for i, (k, v) in enumerate(zip(keys, values, strict=True))]],
            marks)


def _var_chain(names: list[str], value: str, gold: bool) -> list[tuple[bool, str]]:
    first = [(gold, f"VAR {names[0]} = {value}.")]
    return first + [(gold, f"VAR {b} = VAR {a}.") for a, b in zip(names[:-1], names[1:], strict=True)]


def _distinct(rng: random.Random, draw, count: int) -> list[str]:
    out: list[str] = []
    while len(out) < count:
        x = draw()
        if x not in out:
            out.append(x)
    return out


def _spread(rng: random.Random, n_chunks: int, count: int, n: int) -> list[int]:
    """`count` distinct chunks in increasing order, one at random in each of `count` equal stretches. A lone needle
    goes in the first, middle or last third by the task's number, so every cell of three covers all depths."""
    if count == 1 and n_chunks >= 3:
        lo, hi = n_chunks * (n % 3) // 3, n_chunks * (n % 3 + 1) // 3
        return [rng.randrange(lo, hi)]
    return [rng.randrange(n_chunks * i // count, n_chunks * (i + 1) // count) for i in range(count)]


# ---- the haystack -----------------------------------------------------------------------------------------


def _stream(hay: Haystack, rng: random.Random, avoid: list[str], tokenizer, longest: int) -> Iterator[str]:
    """Sentences from a random document on, in order, without any that could be mistaken for a needle or that are
    over `longest` tokens (MuSiQue has tables flattened into one "sentence"); after one pass over the corpus (the
    bundled one is short) every further pass is the sentences in a fresh order."""
    avoid_low = [a.lower() for a in avoid]
    start = rng.randrange(len(hay.docs))
    first = [s for doc in hay.docs[start:] + hay.docs[:start] for s in doc]
    order = first
    while True:
        yielded = False
        for s in order:
            if not any(a in s.lower() for a in avoid_low) and len(encode(tokenizer, " " + s)) <= longest:
                yielded = True
                yield s
        if not yielded:
            raise KvragError(f"ruler: no sentence of the {hay.name} haystack is under {longest} tokens")
        order = rng.sample(first, len(first))


def _fill(prompts, stream: Iterator[str], budget: int, n_chunks: int) -> list[list[str]]:
    """`n_chunks` lists of sentences whose passages' token ids add up to `budget` or a few tokens less: each chunk
    ends where the running total comes nearest its share, the last chunk is topped up word by word. Sizes are
    counted on the whole passage each time: per-sentence counts do not always add up."""
    units: list[list[str]] = []
    done, pending = 0, next(stream)  # done: exact tokens of the finished chunks
    for i in range(n_chunks - 1):
        goal, unit, now = budget * (i + 1) // n_chunks, [], 0
        while True:
            after = _size(prompts, unit + [pending])
            if unit and abs(done + after - goal) > abs(done + now - goal):
                break
            unit.append(pending)
            now, pending = after, next(stream)
        units.append(unit)
        done += now
    units.append(_top_up(prompts, stream, pending, budget - done))
    return units


def _size(prompts, sentences: list[str]) -> int:
    return len(prompts.passage_ids("", " ".join(sentences)))


def _top_up(prompts, stream: Iterator[str], pending: str, room: int) -> list[str]:
    """Whole sentences while they fit in `room` tokens, then as many words of the next as still fit."""
    out: list[str] = []
    while _size(prompts, out + [pending]) <= room:
        out.append(pending)
        pending = next(stream)
    words = pending.split()
    lo, hi = 0, len(words)  # the most words of `pending` that fit: binary search, token counts grow with words
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if _size(prompts, out + [" ".join(words[:mid])]) <= room else (lo, mid - 1)
    return out + ([" ".join(words[:lo])] if lo else [])


def _shrink(prompts, units: list[list[str]], chunks: list[list[int]], budget: int, keep: set[str]) -> None:
    """A needle can cost a token more where it is inserted than alone: drop trailing haystack words of the last
    chunk until the chunks fit `budget` again (never a needle's)."""
    while sum(len(c) for c in chunks) > budget:
        last = units[-1]
        at = max((i for i, s in enumerate(last) if s not in keep), default=None)
        if at is None:
            raise KvragError("ruler: the last chunk holds nothing but needles and still overruns the length")
        words = last[at].split()[:-1]
        if words:
            last[at] = " ".join(words)
        else:
            del last[at]
        chunks[-1] = prompts.passage_ids("", " ".join(last))
