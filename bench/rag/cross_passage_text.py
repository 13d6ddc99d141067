"""The cross-passage set's words and sentences: invented names built from syllables and lists, the sentence
templates of its passages and questions, and the passages of people, topics and places (bench/rag/cross_passage.py
chains them into items)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvrag.bench.rag.cross_passage_filler import (  # noqa: F401  (re-exported for cross_passage.py)
    FILLERS,
    SECOND_HOPS,
)

# ---- vocabulary ------------------------------------------------------------------------------------

ONSETS = ["b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "l", "m", "n", "p", "qu", "r", "s", "t",
          "tr", "v", "w", "z"]
SOFT_ONSETS = ["b", "d", "g", "k", "l", "m", "n", "r", "s", "t", "v", "w"]
VOWELS = ["a", "e", "i", "o", "u", "a", "e", "o", "ei", "au"]
CODAS = ["", "", "", "n", "r", "l", "s", "m"]
FEMALE = ["Beatrix", "Philippa", "Cordelia", "Ysolde", "Maren", "Ottilie", "Henrike", "Liesel", "Agathe",
          "Rosamund", "Imelda", "Solveig", "Therese", "Adela", "Brigid", "Clemence", "Dagny", "Edda", "Fenna",
          "Greta", "Hilde", "Ilse", "Jorunn", "Katrien", "Linnea", "Mathilde", "Nelda", "Petra", "Ragna",
          "Sigrid", "Tove", "Ulla", "Wilma", "Annika", "Elspeth", "Isaura", "Leonie", "Perpetua", "Aldis",
          "Berit", "Celestine", "Dorothea", "Eulalie", "Gudrun", "Hedda", "Ingrid", "Josefa", "Lavinia"]
MALE = ["Osric", "Anselm", "Bertil", "Casimir", "Dorian", "Edvard", "Florian", "Gunnar", "Halvard", "Ivo",
        "Jasper", "Konrad", "Leopold", "Magnus", "Niels", "Oswin", "Piet", "Quentin", "Rasmus", "Sebald",
        "Tobias", "Ulrich", "Valentin", "Wendel", "Aurel", "Bastian", "Cornelis", "Emmerich", "Fridtjof",
        "Gerolf", "Hagen", "Ingmar", "Joachim", "Lorenz", "Matthias", "Nikolai", "Ottokar", "Reinhold",
        "Severin", "Torvald", "Alaric", "Benedikt", "Crispin", "Detlef", "Eberhard", "Gotthold", "Helmer"]
SURNAME_ENDS = ["", "", "sen", "ard", "ell", "wick", "er", "ing", "holt", "mann", "ley", "dahl"]
TOWN_ENDS = ["", "", "", "mark", "holm", "ford", "wick", "by", "haven", "stad", "bridge", "dal"]
PROVINCE_ENDS = ["ia", "and", "ora", "en", "avia"]
COUNTRIES = {"Estravia": "Estravian", "Kolmarra": "Kolmarran", "Vennland": "Vennish", "Orsanne": "Orsannic",
             "Pellmaria": "Pellmarian", "Dravonia": "Dravonian"}
JOBS = ["engineer", "painter", "novelist", "botanist", "architect", "composer", "cartographer", "chemist",
        "merchant", "surveyor", "physician", "astronomer", "geologist", "clockmaker", "printer"]
ARTEFACTS = ["loom", "lathe", "sextant", "barometer", "kiln", "plough", "printing press", "steam pump",
             "diving bell", "signal lamp", "seed drill", "chronometer", "telegraph key", "spinning frame"]
COMPANY_KINDS = {"Glassworks": "glassmaking", "Ironworks": "iron", "Trading Company": "trading",
                 "Shipping Line": "shipping", "Brewery": "brewing", "Paper Mill": "paper-making",
                 "Instrument Company": "instrument-making", "Printing House": "printing", "Textile Mill": "textile",
                 "Porcelain Works": "porcelain", "Savings Bank": "banking"}
GENRES = ["novel", "treatise on navigation", "history of the northern provinces", "book of poems",
          "travel account", "natural history", "collection of sermons", "atlas"]
BOOK_NOUNS = ["Orchards", "Lanterns", "Winters", "Bells", "Harbours", "Salt Roads", "Ferrymen", "Glass Towers",
              "Lighthouses", "Marshes", "Weavers", "Clocks"]
BOOK_ADJS = ["", "", "Silent", "Last", "Grey", "Northern", "Lesser", "Burning", "Drowned", "Iron"]
INSTITUTIONS = ["{} Academy", "University of {}", "{} Polytechnic", "{} Conservatory", "{} Naval College",
                "{} School of Mines"]
ORCHESTRAS = ["{} Philharmonic", "{} Chamber Orchestra", "{} Symphony Orchestra", "{} Court Orchestra"]
SHIP_ENDS = ["Star", "Queen", "Gull", "Wren", "Maiden", "Crown", "Swallow", "Pilot"]
YARDS = ["{} Shipyard", "{} Dockyard", "{} Yard"]
INDUSTRIES = ["weaving", "brewing", "tanning", "glassmaking", "fishing", "shipbuilding", "salt trading",
              "paper making", "timber", "clockmaking", "wool", "rope making"]
FIELDS = ["mechanics", "navigation", "agriculture", "the arts", "public health", "education", "geography"]
ANIMALS = ["heron", "stag", "horse", "lion", "swan", "bear", "hound", "eagle"]
GOODS = ["wool", "coal", "grain", "hides", "iron", "wine", "tar"]
# English words the syllables can spell (and any stem ending in "e": Dale, Nine), never used as names.
ENGLISH = frozenset("""panel liver penal linen lemon melon salon bison demon venus tulip robin cabin rival total
metal medal pedal vital local focal canal moral coral sonar lunar solar polar molar motor rotor tutor baron
baker maker water later cider rider tiger timer diner miner liner toner sober fever lever never river cover
hover lover mover rover dover finer paper super tuber sugar regal legal bagel label level devil civil camel
hotel model modal nasal basal vocal final tidal rural mural viral naval nodal sinus bonus torus minus focus
locus humus virus lotus radar rumor humor valor manor minor donor visor tenor bolus hilus gamut kilos kilor
solos silos halos tudor tokens token women woman human lemur kilim tumor vapor favor labor color dolor
camus hamlet caper faker gamer homer lamer laser loser maser miser muser poser riser taser diver giver
liver river saber tamer wager sever ladle cedar radon nylon talon felon baton piton pagan""".split())
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"]


def cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def bare(name: str) -> str:
    """'the Quarnel loom' -> 'Quarnel loom': the name as it appears mid-sentence and at a sentence's start."""
    return name[4:] if name.startswith("the ") else name


def a(word: str) -> str:
    return ("an " if word[0].lower() in "aeiou" else "a ") + word


# ---- unique names ----------------------------------------------------------------------------------


@dataclass
class Names:
    """Invented names, each stem unique and no stem a prefix of another (so no name hides in another)."""

    rng: random.Random
    stems: set[str] = field(default_factory=set)
    prefixes: set[str] = field(default_factory=set)
    seen: set[str] = field(default_factory=set)  # filler templates used by the current item

    def __post_init__(self) -> None:
        for word in [*COUNTRIES, *COUNTRIES.values()]:
            self._take(word)

    def _free(self, word: str) -> bool:
        return word not in self.prefixes and not any(word[:i] in self.stems for i in range(3, len(word) + 1))

    def _take(self, word: str) -> None:
        self.stems.add(word)
        self.prefixes.update(word[:i] for i in range(3, len(word) + 1))

    def stem(self) -> str:
        r = self.rng
        while True:
            coda, onset = r.choice(CODAS), r.choice(SOFT_ONSETS)
            word = (r.choice(ONSETS) + r.choice(VOWELS) + coda + onset + r.choice(VOWELS)
                    + r.choice(["", "n", "r", "l", "s"])).capitalize()
            if (4 <= len(word) <= 7 and coda != onset and not word.endswith("e") and word.lower() not in ENGLISH
                    and self._free(word)):
                self._take(word)
                return word

    def person(self, she: bool | None = None, surname: str | None = None, era: int | None = None) -> dict:
        r = self.rng
        she = r.random() < 0.5 if she is None else she
        last = surname or self.stem() + r.choice(SURNAME_ENDS)
        born = era if era is not None else r.randint(1760, 1890)
        return {"name": f"{r.choice(FEMALE if she else MALE)} {last}", "last": last, "she": she, "born": born,
                "died": born + r.randint(38, 88), "job": r.choice(JOBS), "nation": r.choice(list(COUNTRIES))}

    def town(self) -> str:
        return self.stem() + self.rng.choice(TOWN_ENDS)

    def pick(self, patterns: list[str]) -> str:
        return self.rng.choice(patterns).format(self.stem())

    def year(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, max(lo, hi))


def pronouns(person: dict) -> dict:
    she = person["she"]
    return {"p": "she" if she else "he", "P": "She" if she else "He", "obj": "her" if she else "him", "pos": "her" if she else "his",
            "Pos": "Her" if she else "His", "sib": "sister" if she else "brother",
            "spouse_word": "husband" if she else "wife"}


# ---- first hops: a topic tied to a person ----------------------------------------------------------

FIRST_HOPS = {
    "invented": dict(
        role="inventor", verb="invented", pp="invented", kind="thing",
        lead=["{S} is {a_noun} first made in the workshops of {town} around {y}.",
              "{S} was a type of {noun} widely used in {country} during the {century} century.",
              "{S} is {a_noun} of unusual design, built in small numbers from {y}."],
        key=["It was invented by {b} in {y}.", "{B} invented it in {y} while working in {town2}.",
             "It was designed and patented in {y} by its inventor, {b}."],
        alt=["In {y2}, {x} improved {s} by adding a brass regulator.",
             "{X} built the first commercial version of {s} in {y2}.", "{X} sold {s} across {country} from {y2}."]),
    "founded": dict(
        role="founder", verb="founded", pp="founded", kind="org",
        lead=["{S} is {a_noun} firm that grew up in {town} in the {century} century.",
              "{S} was one of the larger {noun} concerns of {country}.",
              "{S} is a company known for its {noun} business, with offices in {town}."],
        key=["It was founded in {y} by {b}.", "{B} founded it in {y} in a rented workshop in {town2}.",
             "The company was founded by {b} in {y}."],
        alt=["{X} managed {s} from {y2} onwards.", "In {y2}, {x} bought a large share in {s}.",
             "{X} served as chief engineer of {s} from {y2}."]),
    "wrote": dict(
        role="author", verb="wrote", pp="written", kind="book",
        lead=["{S} is {a_noun} first published in {town} in {y}.", "{S} is {a_noun} that appeared in {y}.",
              "{S}, {a_noun}, was one of the most widely read books in {country} after {y}."],
        key=["It was written by {b}.", "Its author, {b}, worked on it for {n} years.",
             "{B} wrote it while living in {town2}."],
        alt=["{X} translated {s} into {language} in {y2}.", "{X} illustrated the edition of {s} printed in {y2}.",
             "In {y2}, {x} wrote a hostile review of {s}."]),
    "discovered": dict(
        role="discoverer", verb="discovered", pp="discovered", kind="nature",
        lead=["{S} is {a_noun} first recorded in {y}.", "{S} is {a_noun} known to science since {y}.",
              "{S} is {a_noun} that drew wide attention in {country} in the {century} century."],
        key=["It was discovered by {b} in {y}.", "{B} discovered it in {y} near {town2}.",
             "Its discoverer, {b}, first described it in {y}."],
        alt=["{X} confirmed the discovery of {s} in {y2}.", "{X} gave {s} its present name in {y2}.",
             "{X} made the first detailed study of {s} in {y2}."]),
    "led": dict(
        role="leader", verb="led", pp="led", kind="journey",
        lead=["{S} was {a_noun} that set out in {y}.", "{S} was {a_noun}, planned in {town} and begun in {y}.",
              "{S} was {a_noun} that spent {n} months in the field from {y}."],
        key=["It was led by {b}.", "{B} led it, having raised the money in {town2}.",
             "Its leader was {b}, who had spent {n} years preparing it."],
        alt=["{X} was second-in-command of {s}.", "{X} paid for much of {s} in {y2}.",
             "{X} wrote the best-known account of {s} in {y2}."]),
}


def _fields(names: Names, template: str, lo: int, hi: int) -> dict:
    """Fresh values for the fields `template` uses, its years inside the subject's span [lo, hi]."""
    r = names.rng
    y1, y2 = sorted(names.year(lo, hi) for _ in range(2))
    lazy = {"town1": names.town, "stem1": names.stem, "person1": lambda: names.person()["name"]}
    return {"y1": y1, "y2": y2, "y_old": names.year(1000, 1600), "y_rail": names.year(1835, 1930),
            "y_modern": names.year(1850, 1960), "n1": r.randint(3, 19), "n2": r.randint(2, 60),
            "n3": r.randint(20, 400), "n4": r.randint(40, 900), "big": r.randint(2, 90) * 1000,
            "country": r.choice(list(COUNTRIES)), "language": r.choice(list(COUNTRIES.values())),
            "field": r.choice(FIELDS), "industry": r.choice(INDUSTRIES[:6]), "industry2": r.choice(INDUSTRIES[6:]),
            "weekday": r.choice(WEEKDAYS), "first": r.choice(FEMALE + MALE), "century2": ordinal(r.randint(16, 18)),
            "animal": r.choice(ANIMALS), "tower": r.randint(18, 90), "party": r.randint(6, 40), "small": r.randint(2, 5), "industry_goods": r.choice(GOODS),
            **{key: make() for key, make in lazy.items() if "{" + key + "}" in template}}


def passage(names: Names, lead: str, facts: list[str], kind: str, span: tuple[int, int], who: dict | None = None
            ) -> str:
    """Lead sentence, then the facts and fillers interleaved: 2-6 sentences, about 250-900 characters.
    Fillers not yet used in this item come first, so an item's passages do not repeat a sentence pattern."""
    r = names.rng
    sentences = [lead, *facts]
    shuffled = r.sample(FILLERS[kind], len(FILLERS[kind]))
    pool = [t for t in shuffled if t not in names.seen] + [t for t in shuffled if t in names.seen]
    target, extra = r.randint(250, 900), pronouns(who) if who else {}  # characters: ~55-220 SmolLM2 tokens
    for template in pool:
        if len(sentences) >= 6 or (len(sentences) >= 2 and len(" ".join(sentences)) >= target):
            break
        names.seen.add(template)
        sentence = template.format(**_fields(names, template, *span), **extra)
        lo = 2 if len(sentences) >= 2 and r.random() < 0.6 else 1  # the lead stays first
        sentences.insert(r.randint(lo, len(sentences)), sentence)
    return " ".join(sentences)


def person_lead(names: Names, person: dict, with_years: bool = True) -> str:
    r, nation = names.rng, COUNTRIES[person["nation"]]
    years = f" ({person['born']}–{person['died']})" if with_years else ""
    return r.choice([f"{person['name']}{years} was {a(nation)} {person['job']}.",
                     f"{person['name']}{years} was {a(person['job'])} who worked for most of "
                     f"{pronouns(person)['pos']} life in {person['nation']}.",
                     f"{person['name']}{years} was {a(nation)} {person['job']} and teacher."])


def key_sentence(names: Names, hop: str, person: dict, value: str) -> str:
    r = names.rng
    f = {"name": person["name"], "v": value, "river": "river " + names.stem(), "born": person["born"],
         "n": r.randint(2, 9), "y": person["born"] + r.randint(20, 35), "a_job2": a(r.choice(JOBS)),
         "town": names.town(), "industry": r.choice(INDUSTRIES), "decade": person["born"] // 10 * 10 + 20,
         **pronouns(person)}
    return r.choice(SECOND_HOPS[hop]["key"]).format(**f)


def ordinal(n: int) -> str:
    return {16: "sixteenth", 17: "seventeenth", 18: "eighteenth", 19: "nineteenth", 20: "twentieth"}.get(n, f"{n}th")


# ---- people ----------------------------------------------------------------------------------------


def person_passage(names: Names, person: dict, hop: str, value: str, extra: list[str] = ()) -> str:
    """A person's article whose one answering fact is `hop` = value; birth years stay out unless asked."""
    lead = person_lead(names, person, with_years=hop != "birth_year")
    span = (person["born"] + 18, person["died"])
    return passage(names, lead, [key_sentence(names, hop, person, value), *extra], "person", span, person)


def make_topic(names: Names, hop: str, noun: str | None = None) -> tuple[str, str]:
    """A fresh topic for a first hop and its noun ('the Quarnel loom', 'loom'); `noun` keeps a rival's kind."""
    r, stem = names.rng, names.stem()
    if hop == "invented":
        noun = noun or r.choice(ARTEFACTS)
        return f"the {stem} {noun}", noun
    if hop == "founded":
        kind = next((k for k, trade in COMPANY_KINDS.items() if trade == noun), None) or r.choice(list(COMPANY_KINDS))
        return f"the {stem} {kind}", COMPANY_KINDS[kind]
    if hop == "wrote":
        return f"The {r.choice(BOOK_ADJS)} {r.choice(BOOK_NOUNS)} of {stem}".replace("  ", " "), \
            noun or r.choice(GENRES)
    if hop == "discovered":
        noun = noun or r.choice(["comet", "cave system", "orchid", "hot spring"])
        return {"comet": f"Comet {stem}", "cave system": f"the {stem} Caves", "orchid": f"the {stem} orchid",
                "hot spring": f"the {stem} Spring"}[noun], noun
    noun = noun or r.choice(["expedition to the northern ice fields", "survey expedition", "river expedition"])
    return f"the {stem} Expedition", noun


def topic_passage(names: Names, hop: str, topic: tuple[str, str], maker: dict, year: int, extra=()) -> str:
    """The topic's article, whose key sentence names `maker` as its inventor, founder, author, ..."""
    r, spec, (name, noun) = names.rng, FIRST_HOPS[hop], topic
    f = {"S": cap(name), "s": name, "noun": noun, "a_noun": a(noun), "y": year, "town": names.town(),
         "town2": names.town(), "country": r.choice(list(COUNTRIES)), "century": ordinal(year // 100 + 1),
         "n": r.randint(2, 12), "b": maker["name"], "B": maker["name"]}
    lead, key = r.choice(spec["lead"]).format(**f), r.choice(spec["key"]).format(**f)
    return passage(names, lead, [key, *extra], spec["kind"], (year, year + 90))


def alt_sentence(names: Names, hop: str, topic: str, person: dict, year: int) -> str:
    f = {"x": person["name"], "X": person["name"], "s": topic, "y2": year, **pronouns(person),
         "country": names.rng.choice(list(COUNTRIES)), "language": names.rng.choice(list(COUNTRIES.values()))}
    return names.rng.choice(FIRST_HOPS[hop]["alt"]).format(**f)


def relative(names: Names, person: dict) -> dict:
    """A sibling: same surname, another first name, born a few years apart."""
    while True:
        sib = names.person(surname=person["last"], era=person["born"] + names.rng.choice([-6, -4, -2, 2, 3, 5]))
        if sib["name"] != person["name"]:
            return sib


# ---- places and institutions -----------------------------------------------------------------------


def province(names: Names) -> str:
    return names.stem() + names.rng.choice(PROVINCE_ENDS)


def town_passage(names: Names, town: str, prov: str | None = None, river: str | None = None, facts=()) -> str:
    """A town's article; its lead says the province and the river when given."""
    r = names.rng
    where = " ".join(filter(None, [f"in the province of {prov}" if prov else "",
                                   f"on the {river}" if river else ""])) or f"in {r.choice(list(COUNTRIES))}"
    lead = r.choice([f"{town} is a town {where}.", f"{town} is a market town {where}, first recorded in "
                     f"{names.year(900, 1500)}.", f"{town} is a small port town {where}."])
    return passage(names, lead, list(facts), "town", (1700, 1950))


def institution_passage(names: Names, inst: str) -> str:
    y = names.year(1650, 1880)
    lead = names.rng.choice([f"{inst} is a college in {names.town()}, founded in {y}.",
                             f"{inst} was established in {y} to train teachers and engineers."])
    return passage(names, lead, [], "org", (y, y + 150))


def neighbour(names: Names, hop: str, value: str, spouse: dict | None) -> str:
    """A passage about the answer itself (its town, spouse, school) that says nothing of the bridge."""
    if hop == "born_in":
        return town_passage(names, value, prov=province(names))
    if hop == "married":
        return person_passage(names, spouse, "studied", bare(names.pick(INSTITUTIONS)))
    if hop == "birth_year":
        return person_passage(names, names.person(era=int(value)), "birth_year", value)
    return institution_passage(names, value)
