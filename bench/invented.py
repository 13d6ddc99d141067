"""Invented MuSiQue-shaped items: for tests that need realistic English passages, not the real data set.

Each item is {"question", "answers", "ctxs": [{"title", "text"}, ...]}, as in MuSiQue, so every code path
runs as it does on the benchmark file. A seeded world of invented people, companies and towns gives each
entity one passage (≈250-350 words, ≈300-500 SmolLM2 tokens); a question joins two of them (a two-hop
question, as MuSiQue's are), and the other passages of its item are distractors drawn from the same world,
so passages recur across items as they do in the real set. Same seed, same items.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

ONSETS = ["b", "br", "c", "d", "dr", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "st", "t", "th", "v", "w"]
VOWELS = ["a", "e", "i", "o", "u", "ae", "ei", "ou"]
RARE_VOWELS = ["ø", "é", "å", "ü"]  # now and then, so the tokenizer meets more than ASCII
CODAS = ["", "", "n", "r", "l", "s", "th", "nd", "rk", "m"]
TOWN_ENDS = ["ford", "wick", "haven", "dale", "mouth", "by", "stead", "holm", "bridge", "ton"]
COMPANY_KINDS = ["Instruments", "Shipping Company", "Press", "Mills", "Foundry", "Brewing Company", "Textiles",
                 "Optical Works", "Ceramics", "Rail Works"]
OCCUPATIONS = ["engineer", "painter", "novelist", "botanist", "architect", "composer", "cartographer", "chemist",
               "merchant", "surveyor"]
PRODUCTS = ["barometers", "printed atlases", "woollen cloth", "ship chronometers", "glazed tiles", "pale ale",
            "railway signals", "lenses for lighthouses", "dyed linen", "cast iron stoves"]
DEMONYMS = {"Estravia": "Estravian", "Kolmarra": "Kolmarran", "Vennland": "Vennish", "Orsanne": "Orsannic"}
COUNTRIES = list(DEMONYMS)
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]


@dataclass
class World:
    rng: random.Random
    used: set[str] = field(default_factory=set)
    people: list[dict] = field(default_factory=list)
    companies: list[dict] = field(default_factory=list)
    towns: list[dict] = field(default_factory=list)

    def word(self, syllables: int) -> str:
        while True:
            w = "".join(self.rng.choice(ONSETS) + self.vowel() + self.rng.choice(CODAS)
                        for _ in range(syllables)).capitalize()
            if w not in self.used:
                self.used.add(w)
                return w

    def vowel(self) -> str:
        return self.rng.choice(RARE_VOWELS if self.rng.random() < 0.05 else VOWELS)

    def year(self, lo: int = 1780, hi: int = 1960) -> int:
        return self.rng.randint(lo, hi)


def _build_world(rng: random.Random, n_people: int) -> World:
    """Towns, then people born in them, then the companies those people founded, all with cross references."""
    w = World(rng)
    for _ in range(n_people):
        w.towns.append({"name": w.word(2) + rng.choice(TOWN_ENDS), "river": w.word(2), "founded": w.year(900, 1500),
                        "country": rng.choice(COUNTRIES), "population": rng.randint(3, 180) * 1000})
    for i in range(n_people):
        w.people.append({"name": f"{w.word(2)} {w.word(2)}", "born": w.year(1780, 1900), "town": w.towns[i],
                         "occupation": rng.choice(OCCUPATIONS)})
    for i, person in enumerate(w.people):
        person["spouse"] = f"{w.word(2)} {person['name'].split()[1]}"
        company = {"name": f"{w.word(2)} {rng.choice(COMPANY_KINDS)}", "founder": person,
                   "founded": person["born"] + rng.randint(22, 45), "seat": w.towns[(i + 1) % n_people],
                   "product": rng.choice(PRODUCTS)}
        person["company"] = company
        w.companies.append(company)
    return w


def _filler(w: World, subject: str, words: int) -> list[str]:
    """Sentences of background about `subject`, drawn without repeats, until about `words` words."""
    r, town, other = w.rng, w.rng.choice(w.towns), w.rng.choice(w.people)
    templates = [
        f"In {w.year()}, {subject} was the subject of a long article in the {w.word(2)} Gazette, which praised "
        f"its careful records and its patient approach to the work.",
        f"Letters kept in the archive at {town['name']} show that {subject} corresponded for many years with "
        f"{other['name']}, mostly about practical matters of trade and travel.",
        f"During the hard winter of {w.year()}, when the {town['river']} froze for eleven weeks, {subject} "
        f"suffered heavy losses and recovered only slowly over the following decade.",
        f"Local historians disagree about the early years: some accounts place the first records in "
        f"{r.choice(MONTHS)} {w.year()}, while others argue for a date several years later.",
        f"A small museum near the old market of {town['name']} now displays maps, ledgers and photographs "
        f"connected with {subject}, and it is open to visitors in the summer months.",
        f"The surviving correspondence mentions a dispute with the {w.word(2)} family over water rights, "
        f"which was settled out of court after nearly four years of negotiation.",
        f"Travellers from {r.choice(COUNTRIES)} often described {subject} in their journals, usually noting "
        f"the quiet streets, the smell of coal smoke and the long evenings by the river.",
        f"By {w.year(1850, 1990)} the name of {subject} appeared regularly in school textbooks, although the "
        f"details given there were often simplified or simply wrong.",
        f"A biography published in {w.year(1900, 2010)} by the historian {w.word(2)} {w.word(2)} remains the "
        f"most complete account, drawing on diaries that were believed lost until {w.year(1950, 2000)}.",
        f"Several streets and a small park in {town['name']} were later named after {subject}, and a bronze "
        f"plaque was unveiled there on the hundredth anniversary.",
        f"The records of the {w.word(2)} Society list {subject} among its early members, alongside "
        f"{other['occupation']}s, doctors and a handful of retired sea captains.",
        f"Critics have pointed out that many of the stories told about {subject} first appeared in print "
        f"only after {w.year(1880, 1950)}, long after the events they describe.",
        f"A saying still heard in the markets of {town['name']} — “as "
        f"steady as {subject}” — goes back at least to {w.year(1800, 1900)}.",
        f"Rail connections reached the area in {w.year(1840, 1910)}, and with them came new markets, new "
        f"competitors and a steady stream of visitors from the capital.",
        f"An exhibition in {r.choice(w.towns)['name']} in {w.year(1960, 2015)} brought together more than "
        f"{r.randint(3, 40) * 10} objects connected with {subject}, many of them shown for the first time.",
    ]
    r.shuffle(templates)
    out, count = [], 0
    for sentence in templates:
        if count >= words:
            break
        out.append(sentence)
        count += len(sentence.split())
    return out


def _a(word: str) -> str:
    return ("an " if word[0].lower() in "aeiou" else "a ") + word


def _person_text(w: World, p: dict) -> str:
    c, t = p["company"], p["town"]
    facts = [
        f"{p['name']} (born {p['born']}) was {_a(DEMONYMS[t['country']])} {p['occupation']} born in {t['name']}, "
        f"a town on the {t['river']} river.",
        f"In {c['founded']} {p['name']} founded {c['name']}, which became known for its {c['product']}.",
        f"{p['name']} was married to {p['spouse']}, who managed the family's affairs during long absences abroad.",
    ]
    return " ".join(facts + _filler(w, p["name"], w.rng.randint(180, 250)))


def _company_text(w: World, c: dict) -> str:
    facts = [
        f"{c['name']} is a manufacturer of {c['product']} founded in {c['founded']} by {c['founder']['name']}.",
        f"From its first years the company was based in {c['seat']['name']}, where it employed at times "
        f"more than {w.rng.randint(2, 30) * 50} workers.",
    ]
    return " ".join(facts + _filler(w, c["name"], w.rng.randint(190, 260)))


def _town_text(w: World, t: dict) -> str:
    facts = [
        f"{t['name']} is a town in {t['country']} on the banks of the {t['river']} river, first recorded in "
        f"{t['founded']}.",
        f"Its population was about {t['population']:,} at the last census.",
    ]
    return " ".join(facts + _filler(w, t["name"], w.rng.randint(190, 260)))


def _question(w: World, person: dict) -> tuple[str, list[str], list[str]]:
    """A two-hop question about `person`: (question, answers, names of the two passages that answer it)."""
    c = person["company"]
    kind = w.rng.randrange(3)
    if kind == 0:
        return (f"In which town was the company founded by {person['name']} based?", [c["seat"]["name"]],
                [person["name"], c["name"]])
    if kind == 1:
        return (f"Who was the spouse of the founder of {c['name']}?", [person["spouse"]], [c["name"], person["name"]])
    t = person["town"]
    return (f"On which river is the birthplace of {person['name']} located?", [t["river"], f"the {t['river']}"],
            [person["name"], t["name"]])


def invented_items(n: int = 40, seed: int = 0, passages: tuple[int, int] = (5, 10)) -> list[dict]:
    """`n` items, each with its two supporting passages among 5-10 (`passages`), deterministic in `seed`."""
    rng = random.Random(seed)
    w = _build_world(rng, max(12, n // 2))
    texts = {p["name"]: _person_text(w, p) for p in w.people}
    texts |= {c["name"]: _company_text(w, c) for c in w.companies}
    texts |= {t["name"]: _town_text(w, t) for t in w.towns}
    items = []
    for i in range(n):
        question, answers, support = _question(w, w.people[i % len(w.people)])
        others = rng.sample(sorted(set(texts) - set(support)), rng.randint(*passages) - len(support))
        titles = support + others
        rng.shuffle(titles)
        items.append({"question": question, "answers": answers,
                      "ctxs": [{"title": t, "text": texts[t]} for t in titles]})
    return items
