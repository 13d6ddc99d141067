"""Long RAG prompts a model can answer: deterministic templates over invented entities, so no model knows the facts
and the answer must come from the passages.

Four kinds of question, each over records written from one template, with look-alike records of the same template
about other entities in the same prompt (where a blend that never saw its neighbours binds a question to the wrong
record):

    lookup        one field of one person's record ("What was the name of Ilse Varnholt's cat?")
    bridge        an organisation's record names its founder, the founder's record the answer
    comparison    two organisations' founding years: which is older
    aggregation   three or four organisations' member counts: which has the most

Fact records never stand first; a two-record item alternates their order with its index. Other passages come from
`filler` (the bench gives MuSiQue passages of a split; the model check, invented notes of six kinds) until the prompt reaches
its token target. Same seed, same items. Items are MuSiQue-format dicts (question, answers, ctxs) with `kind`,
`facts` (positions of the fact records in ctxs) and `lookalikes`.
"""

from __future__ import annotations

import random
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

KINDS = ("lookup", "bridge", "comparison", "aggregation")
FILLER_TRIES = 1000  # draws from `filler` a prompt may take to reach its length (a small pool ends it short)
Passage = tuple[str, str]  # (title, text)

ONSETS = ["b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "l", "m", "n", "p", "r", "s", "t", "tr", "v", "w"]
VOWELS = ["a", "e", "i", "o", "u", "a", "e", "o", "ei", "au"]
CODAS = ["", "", "n", "r", "l", "s", "m", "nd", "rt"]
ENDS = ["", "", "sen", "ard", "ell", "wick", "er", "ing", "holt", "ley", "dahl"]
TOWN_ENDS = ["", "mark", "holm", "ford", "wick", "by", "haven", "stad", "dal"]
FIRST = ["Beatrix", "Philippa", "Cordelia", "Maren", "Ottilie", "Henrike", "Agathe", "Imelda", "Solveig", "Adela",
         "Brigid", "Dagny", "Fenna", "Hilde", "Ilse", "Linnea", "Petra", "Ragna", "Sigrid", "Tove", "Osric", "Anselm",
         "Bertil", "Casimir", "Dorian", "Edvard", "Florian", "Gunnar", "Ivo", "Jasper", "Konrad", "Leopold", "Niels",
         "Oswin", "Quentin", "Rasmus", "Sebald", "Tobias", "Ulrich", "Wendel"]
PETS = ["cat", "dog", "parrot", "horse"]
INSTRUMENTS = ["cello", "oboe", "harp", "violin", "clarinet", "bassoon", "viola", "flute", "trumpet", "accordion"]
JOBS = ["engineer", "painter", "botanist", "architect", "surveyor", "chemist", "printer", "clockmaker", "physician"]
ORGS = ["Society", "Guild", "Club", "Circle", "Association", "League"]
PURSUITS = ["astronomy", "rowing", "chess", "bell-ringing", "bookbinding", "beekeeping", "choral singing", "fencing",
            "birdwatching", "cartography", "pottery", "sailing"]


class Names:
    """Invented names, each stem unique over a set (no stem the start of another, so no name hides in another)."""

    def __init__(self, rng: random.Random):
        self.rng, self.stems = rng, set()

    def stem(self) -> str:
        r = self.rng
        while True:
            word = (r.choice(ONSETS) + r.choice(VOWELS) + r.choice(CODAS) + r.choice(ONSETS) + r.choice(VOWELS)
                    + r.choice(["", "n", "r", "l", "s"])).capitalize()
            if 4 <= len(word) <= 8 and not any(word.startswith(s) or s.startswith(word) for s in self.stems):
                self.stems.add(word)
                return word

    def person(self) -> dict:
        r = self.rng
        born = r.randint(1780, 1900)
        return {"name": f"{r.choice(FIRST)} {self.stem()}{r.choice(ENDS)}", "born": born, "died": born + r.randint(40, 85),
                "town": self.stem() + r.choice(TOWN_ENDS), "pet": r.choice(PETS), "pet_name": self.stem(),
                "instrument": r.choice(INSTRUMENTS), "job": r.choice(JOBS), "friend": self.stem()}

    def org(self, founder: dict | None = None) -> dict:
        r = self.rng
        founder = founder or self.person()
        return {"name": f"{self.stem()} {r.choice(ORGS)}", "year": r.randint(founder["born"] + 20, founder["born"] + 50),
                "founder": founder, "members": r.randrange(40, 990), "seat": self.stem() + r.choice(TOWN_ENDS),
                "pursuit": r.choice(PURSUITS), "hall": self.stem()}


def person_text(p: dict, rng: random.Random) -> str:
    """A person's record: the fields a question may ask, among sentences it never asks about."""
    article = "an" if p["job"][0] in "aeiou" else "a"
    facts = [f"{p['name']} ({p['born']}-{p['died']}) was {article} {p['job']} born in the town of {p['town']}.",
             f"{p['name']} kept a {p['pet']} named {p['pet_name']}, who appears in many of the family's letters.",
             f"In the evenings {p['name']} played the {p['instrument']} with friends from the neighbourhood.",
             f"A close friend, the writer Alma {p['friend']}, described {p['name']} as patient and exact.",
             f"The {p['job']}'s notebooks, kept in a municipal archive, record weather, prices and small repairs.",
             f"Late in life {p['name']} gave a collection of maps and drawings to the local library."]
    return " ".join(facts[:1] + rng.sample(facts[1:], len(facts) - 1))


def org_text(o: dict, rng: random.Random) -> str:
    """An organisation's record: founder, founding year and members, among sentences no question asks about."""
    f = o["founder"]["name"]
    facts = [f"The {o['name']} is a society for {o['pursuit']} founded in {o['year']} by {f}.",
             f"It meets every month in the {o['hall']} Hall in the town of {o['seat']}.",
             f"Today the {o['name']} has {o['members']} members, who pay a small yearly fee.",
             f"Its library holds the minutes of every meeting since {o['year'] + 1}, bound in green cloth.",
             f"The {o['name']} awards a silver medal each spring for the best work in {o['pursuit']}."]
    return " ".join(facts[:1] + rng.sample(facts[1:], len(facts) - 1))


NOTES = {  # the model check's other passages: six kinds of note, each a few of its sentences in a random order
    "town": ["{T} is a market town on the river {R}, known for its stone bridge and its covered market.",
             "Its population grew quickly after a railway station opened there in {Y}.",
             "Farmers from the valley bring cheese, apples and wool to the square every {D}.",
             "The {R} floods in most springs, and the lower streets keep boats for those weeks.",
             "A small museum beside the church shows tools and costumes collected by {P}."],
    "recipe": ["{T} bread is a dark rye loaf baked in the hill farms above {R}.",
               "The dough rests overnight in a cool cellar before it is shaped by hand.",
               "Bakers add caraway and a spoon of honey, and some families add dried pears.",
               "It keeps for two weeks wrapped in linen and is eaten with smoked fish or soft cheese.",
               "A contest for the best loaf has been held each {D} since {Y}."],
    "mountain": ["Mount {T} rises to {N} metres above the {R} valley.",
                 "Its lower slopes are covered in beech and spruce, its summit in bare scree.",
                 "The first recorded ascent was made in {Y} by a party of shepherds and a priest.",
                 "A hut on the north ridge sleeps twenty walkers and is open from June to September.",
                 "In clear weather the lakes of the plain can be seen from the top."],
    "ship": ["The {T} was a three-masted barque built at the {R} yard in {Y}.",
             "She carried timber, salt and grain between the northern ports for thirty years.",
             "Her figurehead, a carved heron, is kept in the harbour office.",
             "In a storm off the cape she lost two masts, and her crew of {N} rowed ashore.",
             "She was broken up for her copper fittings after a long rest at anchor."],
    "festival": ["The {T} festival fills the streets of {R} with music for three days each {D}.",
                 "It began in {Y} as a fair for cattle dealers and their families.",
                 "Bands march from the old gate to the river, followed by lantern carriers.",
                 "About {N} visitors come each year, many of them in costume.",
                 "The last night ends with a bonfire on the common and a dance until dawn."],
    "machine": ["The {T} pump was a steam engine that drained the mines at {R} from {Y}.",
                "Its beam weighed over twenty tonnes and rocked eight times a minute.",
                "Coal for its boiler came by canal boat from the pits in the east.",
                "Engineers from abroad visited to copy its valve gear.",
                "It was stopped when electric pumps were installed, and its house is now a cafe."],
}


def filler_note(names: Names, rng: random.Random) -> Passage:
    """A passage of invented prose that answers no question: one kind of NOTES, four or five of its sentences."""
    kind = rng.choice(sorted(NOTES))
    fields = {"T": names.stem(), "R": names.stem(), "P": names.person()["name"], "Y": rng.randint(1780, 1910),
              "N": rng.randint(12, 2900), "D": rng.choice(["Monday", "Thursday", "Saturday", "spring", "autumn"])}
    sentences = [x.format(**fields) for x in NOTES[kind]]
    return fields["T"], " ".join([sentences[0], *rng.sample(sentences[1:], rng.randint(3, 4))])


Built = tuple[str, list[str], list[Passage], list[Passage], list[str]]  # question, answers, facts, look-alikes, others


def _lookup(names: Names, rng: random.Random) -> Built:
    p = names.person()
    field, question = rng.choice([("pet_name", f"What was the name of {p['name']}'s {p['pet']}?"),
                                  ("town", f"In which town was {p['name']} born?"),
                                  ("instrument", f"Which instrument did {p['name']} play?")])
    others = [names.person() for _ in range(rng.randint(2, 3))]
    for o in others:  # the look-alikes share the asked-for field's kind (the same pet, another name)
        o["pet"] = p["pet"]
    return question, [p[field]], [(p["name"], person_text(p, rng))], [(o["name"], person_text(o, rng)) for o in others], \
        [o[field] for o in others if o[field] != p[field]]


def _bridge(names: Names, rng: random.Random) -> Built:
    org = names.org()
    f = org["founder"]
    field, question = rng.choice([("town", f"In which town was the founder of the {org['name']} born?"),
                                  ("pet_name", f"What was the name of the {f['pet']} kept by the founder of the "
                                               f"{org['name']}?")])
    rival, other = names.org(), names.person()
    other["pet"] = f["pet"]
    lookalikes = [(rival["name"], org_text(rival, rng)), (rival["founder"]["name"], person_text(rival["founder"], rng)),
                  (other["name"], person_text(other, rng))]
    return question, [f[field]], [(org["name"], org_text(org, rng)), (f["name"], person_text(f, rng))], lookalikes, \
        [p[field] for p in (rival["founder"], other) if p[field] != f[field]]


def _comparison(names: Names, rng: random.Random) -> Built:
    a, b = names.org(), names.org()
    while a["year"] == b["year"]:
        b["year"] = rng.randint(1800, 1950)
    older = a if a["year"] < b["year"] else b
    question = f"Which was founded earlier, the {a['name']} or the {b['name']}?"
    c = names.org()
    younger = b if older is a else a
    return question, _org_answers(older), [(a["name"], org_text(a, rng)), (b["name"], org_text(b, rng))], \
        [(c["name"], org_text(c, rng))], [younger["name"]]


def _aggregation(names: Names, rng: random.Random) -> Built:
    orgs = [names.org() for _ in range(rng.randint(3, 4))]
    counts = rng.sample(range(40, 990), len(orgs))
    for o, n in zip(orgs, counts, strict=True):
        o["members"] = n
    most = max(orgs, key=lambda o: o["members"])
    listed = ", ".join(f"the {o['name']}" for o in orgs[:-1]) + f" and the {orgs[-1]['name']}"
    question = f"Of {listed}, which has the most members?"
    return question, _org_answers(most), [(o["name"], org_text(o, rng)) for o in orgs], [], \
        [o["name"] for o in orgs if o is not most]


def _org_answers(org: dict) -> list[str]:
    return [org["name"], org["name"].split()[0]]


BUILDERS = {"lookup": _lookup, "bridge": _bridge, "comparison": _comparison, "aggregation": _aggregation}


def make_items(n: int, seed: int, filler: Callable[[random.Random], Passage] | None = None,
               tokens: tuple[int, int] = (2000, 8000), count: Callable[[str], int] | None = None,
               kinds: Sequence[str] = KINDS) -> list[dict]:
    """`n` items, the kinds in turn, each prompt's passages filled from `filler` up to a token target drawn from
    `tokens` (counted by `count`: the model's tokenizer, or about 1.35 tokens a word)."""
    rng, names = random.Random(seed), Names(random.Random(seed + 1))
    count = count or (lambda text: int(len(text.split()) * 1.35) + 4)
    filler = filler or (lambda r: filler_note(names, r))
    items = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        question, answers, facts, lookalikes, wrong = BUILDERS[kind](names, rng)
        if i // len(kinds) % 2:  # both orders: every other item of a kind has its fact records reversed
            facts = facts[::-1]
        target = rng.randint(*tokens)
        others, total = list(lookalikes), sum(count(t) + count(x) for t, x in [*facts, *lookalikes])
        for _ in range(FILLER_TRIES):  # no passage twice in a prompt, and at least one to stand first
            if total >= target and len(others) > len(lookalikes):
                break
            title, text = filler(rng)
            if (title, text) not in others:
                others.append((title, text))
                total += count(title) + count(text)
        head = others.pop(len(lookalikes))  # a filler passage: a fact record never stands first
        rest = others + [None] * len(facts)
        rng.shuffle(rest)
        slots = iter(facts)
        ctxs = [head, *[p if p is not None else next(slots) for p in rest]]
        items.append({"question": question, "answers": answers, "wrong": wrong, "kind": kind, "id": f"answerable-{seed}-{i}",
                      "ctxs": [{"title": t, "text": x} for t, x in ctxs],
                      "facts": [ctxs.index(f) for f in facts], "lookalikes": len(lookalikes)})
    return items


# ---- scoring an answer, as SQuAD and the CacheBlend paper do ---------------------------------------------------


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation and the articles a/an/the, collapse white space (SQuAD's normalisation)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1_score(prediction: str, gold: str) -> float:
    """Token F1 of the normalized prediction against the normalized gold answer."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def answer_line(text: str) -> str:
    """The answer as a reader takes it: its first non-empty line (a model may go on with an explanation)."""
    return next((line for line in text.strip().splitlines() if line.strip()), "")


RIGHT_F1 = 0.5  # an answer is right at this F1 against a gold answer (issue 56's rule)


def is_right(text: str, golds: Sequence[str], wrong: Sequence[str] = ()) -> bool:
    """Right: the answer's first line scores RIGHT_F1 against a gold answer, or (a whole sentence: "Ragna's cat was
    named Tunvan.") holds a gold answer as a phrase and none of the `wrong` ones (the look-alikes' values, the other
    candidates of a comparison), so that naming every candidate is never right."""
    line = answer_line(text)
    if any(f1_score(line, g) >= RIGHT_F1 for g in golds):
        return True
    words = f" {normalize_answer(line)} "
    return any(f" {normalize_answer(g)} " in words for g in golds if normalize_answer(g)) and \
        not any(f" {normalize_answer(w)} " in words for w in wrong if normalize_answer(w))


def same_answer(a: str, b: str) -> bool:
    """Two answers agree when their normalized first lines are equal ("The Renwicke Society" = "Renwicke Society")."""
    return normalize_answer(answer_line(a)) == normalize_answer(answer_line(b))
