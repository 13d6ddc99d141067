"""A generated cross-passage question set: short invented passages, answers that join two of them.

Where blending goes wrong is a question whose answer needs one fact from each of two chunks: a model
that mixes the chunks up names the wrong person or town. Each item is a two-hop question over k short
passages (k = 2..10, about 50-250 SmolLM2 tokens each, encyclopedia-like prose of 2-6 sentences):
passage A ties the question's topic to a bridge entity ("The Quarnel loom was invented by Beatrix
Olufsen ..."), passage B gives the bridge's fact that answers it ("Beatrix Olufsen was born in Tavrin
..."), and the other k-2 are distractors that name the same entities: the bridge's sibling or namesake
with a different fact, another person tied to the topic in a way the question does not ask about, a
rival of the topic's kind, the answer's own description, then unrelated passages of the same world.

Every name is invented from the syllables and lists below, and unique over the whole set (no name is a
prefix of another), so no passage repeats across items. Same seed, same items.

Output is MuSiQue-format JSON, which `kvrag bench --dataset FILE` reads:
    {"question", "answers": [answer], "ctxs": [{"title": "", "text"}, ...], "supporting": [a, b],
     "k", "id", "split", "relation", "topic", "bridge", "layout"}
`supporting` is [position of A, position of B] in ctxs. `split` is "tune" for the first half of the
items (index < n // 2) and "report" for the second half.

    python -m kvrag.blend.bench.cross_passage --out cross_passage.json [--items 240] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

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


# ---- filler sentences: dates, numbers and places that answer nothing ------------------------------

FILLERS = {
    "person": [
        "In {y1}, {p} spent {n1} months travelling through {country}, keeping a detailed diary of the journey.",
        "{P} later settled in {town1}, in a narrow house near the old grain market.",
        "A portrait of {obj} by the painter {person1} hangs in the town hall of {town1}.",
        "{P} was elected to the {stem1} Society in {y1} and served as its secretary for {n1} years.",
        "In {y1}, after a quarrel with the trustees of the museum at {town1} over the cost of new display cases, {p} "
        "resigned from its board and spent the next {n1} years sorting and copying the family papers, a task that "
        "{p} described in a letter as dull but necessary.",
        "Friends remembered {obj} as a tireless walker who would cover {n2} kilometres in a day, usually with a "
        "notebook in one pocket and a loaf of rye bread in the other, and who disliked trains, telegrams and "
        "any kind of public dinner.",
        "Contemporaries described {pos} manner as patient, exacting and rather shy in company.",
        "About {n3} of {pos} letters survive; most are kept in the archive at {town1}.",
        "In {y1} {p} received the {stem1} Medal for services to {field}.",
        "{P} spent the winter of {y1} in {town1}, where {p} gave a series of {n1} public lectures.",
        "{Pos} notebooks, found in a trunk in {y2}, fill {n2} volumes.",
        "From {y1} {p} rented rooms above a bookshop in {town1}, paying {n2} crowns a year.",
        "A long illness in {y1} kept {obj} from work for most of a year.",
        "{P} kept up a correspondence of more than {n3} letters with {person1}.",
        "In later life {p} grew roses and wrote short essays on {field} for the {stem1} Gazette.",
        "A street in {town1} was named after {obj} in {y2}.",
    ],
    "town": [
        "The town had about {big:,} inhabitants at the census of {y_modern}.",
        "Its market, held every {weekday}, is mentioned in a charter of {y_old}.",
        "A railway line to {town1} opened in {y_rail} and brought a short period of growth.",
        "Most of the old centre burned in a fire in {y1} and was rebuilt in stone.",
        "Its oldest surviving building is a timber-framed warehouse on the quay, put up around {y_old} for the wool "
        "trade and used in turn as a customs house, a chapel, a school and, since {y_modern}, a small museum run "
        "by volunteers.",
        "In the cholera year of {y1} nearly a tenth of the inhabitants died, and the council afterwards paid for a "
        "new water supply piped from springs {n1} kilometres away in the hills above {town1}.",
        "Its main trades were {industry} and {industry2}, both in decline by {y_modern}.",
        "The parish church of St {first} has a tower {tower} metres high.",
        "A stone bridge of {n1} arches, built in {y_old}, carries the road to {town1}.",
        "The town hall, finished in {y1}, houses a small museum of local history.",
        "Its harbour silted up in the {century2} century, and trade moved to {town1}.",
        "A grammar school was opened there in {y1} with {n2} pupils.",
        "Every autumn a horse fair draws traders from as far as {country}.",
    ],
    "thing": [
        "About {n3} examples are known to survive, most of them in private collections.",
        "Because the parts were made by hand and rarely matched, repairs had to be done by the original workshop, "
        "and owners in {country} complained for years about waiting {n1} weeks or more for a single replacement "
        "spring or gear wheel.",
        "A well-preserved example is displayed at the {stem1} Museum in {town1}.",
        "Production ended in {y2}, when cheaper designs from {country} took over the market.",
        "It was shown at the {town1} Exhibition of {y1}, where it won a silver medal.",
        "Early models weighed around {n4} kilograms and needed two people to work them.",
        "A catalogue of {y1} lists it at {n2} crowns, a high price for the time.",
        "Workshops in {town1} made copies under licence from {y1}.",
        "An improved model with a cast-iron frame followed in {y2}.",
        "By {y2} some {n4} were in use in the mills and ports of {country}.",
    ],
    "org": [
        "By {y1} it employed some {n4} people.",
        "During the strike of {y1}, which lasted {n1} weeks and closed every works along the river, its managers "
        "kept the furnaces and the offices running with clerks and apprentices, a decision that was remembered "
        "bitterly in {town1} for a generation.",
        "Its original building on {stem1} Street was pulled down in {y2}.",
        "The recession of {y1} forced it to dismiss almost half of its staff.",
        "Its records from {y1} to {y2} are held in the archive at {town1}.",
        "It was awarded a gold medal at the {town1} Exhibition of {y1}.",
        "A fire in {y1} destroyed its main store, and with it most of the early accounts.",
        "Its annual turnover passed {n4},000 crowns in {y2}.",
        "In {y2} it opened a small school for the children of its workers.",
        "Its trademark, a black {animal} on a white shield, was registered in {y1}.",
    ],
    "ensemble": [
        "It gave its first public concert in {y1} in the assembly rooms of {town1}.",
        "For its first {n1} seasons it had no hall of its own and rehearsed in a corn exchange, where the players "
        "complained of the cold, the echo and the smell of grain, until a subscription raised enough money for "
        "a proper building in {y2}.",
        "By {y1} it had {n2} salaried players.",
        "Its library of some {n4} scores was moved to {town1} in {y2}.",
        "A new concert hall with {n4} seats was opened for it in {y2}.",
        "It toured {country} in {y1}, playing {n1} concerts in as many weeks.",
        "Its archives from {y1} to {y2} are kept in the music library at {town1}.",
    ],
    "book": [
        "The first edition ran to {n4} copies and sold out within a year.",
        "The printer, a small firm in {town1}, went bankrupt soon after the second printing, and for almost "
        "{n1} years the book could be found only second-hand, until a cheap edition in paper covers brought it "
        "to a new generation of readers in {y2}.",
        "It was translated into {language} in {y2}.",
        "Reviewers praised its clear style but found its final chapters hurried.",
        "A revised edition with {n2} new engravings appeared in {y2}.",
        "The manuscript, {n4} pages long, is kept in the library at {town1}.",
        "It was banned for a time in {country} after {y1}.",
        "A stage version was performed in {town1} in {y2}.",
        "It runs to {n1} chapters and more than {n4} pages.",
    ],
    "nature": [
        "Specimens and drawings are held in the collections of the {stem1} Museum in {town1}.",
        "A second account, with {n2} plates, was published in {y2}.",
        "It was the subject of a long dispute in the {stem1} Review between {y1} and {y2}.",
        "Observers in {country} recorded it again in {y2}.",
        "A survey of {y2} found it in {n1} other places, all within a day's walk of {town1}.",
        "Its colour and form were first painted by {person1} in {y1}.",
    ],
    "journey": [
        "The party of {party} set out from {town1} in early spring.",
        "Of the {n4} pack animals taken, fewer than half returned.",
        "Maps drawn during the journey remained in use until {y2}.",
        "Supplies ran short in the second month, and the party lived for {n1} weeks on dried fish, rye biscuits "
        "and whatever game it could shoot, an ordeal described at length in the letters later published in "
        "{town1}.",
        "Its collections of rocks and plants went to the {stem1} Museum in {town1}.",
        "Bad weather held the party in camp for {n1} weeks.",
        "Its journals were printed in {n1} volumes between {y1} and {y2}.",
    ],
    "water": [
        "It is about {n4} kilometres long and navigable by barges for {n2} of them.",
        "Until the railway came in {y_rail}, flat-bottomed boats carried timber, salt and barrels of {industry_goods} "
        "down its lower course, and the towpath along its eastern bank can still be walked for most of the way "
        "to {town1}.",
        "Its waters were once rich in eels, which were sold as far away as {town1}.",
        "A stone weir built across it in {y1} still drives a mill at {town1}.",
        "The great flood of {y2} raised its level by {small} metres in a single night.",
        "Its banks are lined with willows and, in places, with old salt warehouses.",
        "A ferry has crossed it at {town1} since at least {y_old}.",
        "Its depth reaches {n1} metres in the middle.",
    ],
    "ship": [
        "She measured {n4} tons and carried a crew of {n2}.",
        "In {y1} she ran aground off {town1} but was refloated undamaged.",
        "Her figurehead is displayed at the maritime museum in {town1}.",
        "She made {n2} crossings to {country} before being sold in {y2}.",
        "Her cargoes were mostly timber, salt and {industry_goods}.",
        "She was broken up at {town1} in {y2}.",
    ],
    "region": [
        "The province had about {big:,} inhabitants at the census of {y_modern}.",
        "Its assembly first met in {y1}, in a hall that still stands.",
        "Its main trades were {industry} and {industry2}.",
        "A railway across the province was completed in {y_rail}, linking it with {town1}.",
        "Its borders were last redrawn in {y2}.",
        "Much of its land is low pasture, drained by canals dug after {y_old}.",
    ],
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
            "weekday": r.choice(WEEKDAYS), "first": r.choice(FEMALE + MALE), "century2": _ordinal(r.randint(16, 18)),
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


# ---- people ----------------------------------------------------------------------------------------

SECOND_HOPS = {  # a person's fact that answers: key sentence, short mention, questions
    "born_in": dict(
        key=["{name} was born in {v}, a town on the {river}.", "{P} was born in the harbour town of {v}.",
             "Born in {v} in {born}, {p} spent {pos} childhood on the banks of the {river}."],
        short="{name} was born in {v}",
        questions=["In which town was the {role} of {s} born?", "Where was the {role} of {s} born?",
                   "What is the birthplace of the person who {verb} {s}?",
                   "{S} was {pp} by someone born in which town?"]),
    "married": dict(
        key=["In {y}, {name} married {v} in {town}.", "{P} was married to {v} from {y} until "
             "{pos} death.", "{Pos} marriage to {v} in {y} brought {obj} a share in a {industry} business."],
        short="{name} was married to {v}",
        questions=["Who was the {role} of {s} married to?", "Whom did the {role} of {s} marry?",
                   "What was the name of the spouse of the person who {verb} {s}?"]),
    "birth_year": dict(
        key=["{name} was born in {v} in the town of {town}.", "{P} was born in {v}, the child of {a_job2}.",
             "Records of {town} give {pos} year of birth as {v}."],
        short="{name} was born in {v}",
        questions=["In what year was the {role} of {s} born?", "When was the person who {verb} {s} born?",
                   "What was the birth year of the {role} of {s}?"]),
    "studied": dict(
        key=["{P} studied at {v}, graduating in {y}.", "{name} was educated at {v} in the {decade}s.",
             "After leaving school {p} spent {n} years at {v}."],
        short="{name} had studied at {v}",
        questions=["Where did the {role} of {s} study?", "At which institution was the {role} of {s} educated?",
                   "Which school did the person who {verb} {s} attend?"]),
}


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


def person_passage(names: Names, person: dict, hop: str, value: str, extra: list[str] = ()) -> str:
    """A person's article whose one answering fact is `hop` = value; birth years stay out unless asked."""
    lead = person_lead(names, person, with_years=hop != "birth_year")
    span = (person["born"] + 18, person["died"])
    return passage(names, lead, [key_sentence(names, hop, person, value), *extra], "person", span, person)


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
         "town2": names.town(), "country": r.choice(list(COUNTRIES)), "century": _ordinal(year // 100 + 1),
         "n": r.randint(2, 12), "b": maker["name"], "B": maker["name"]}
    lead, key = r.choice(spec["lead"]).format(**f), r.choice(spec["key"]).format(**f)
    return passage(names, lead, [key, *extra], spec["kind"], (year, year + 90))


def _ordinal(n: int) -> str:
    return {16: "sixteenth", 17: "seventeenth", 18: "eighteenth", 19: "nineteenth", 20: "twentieth"}.get(n, f"{n}th")


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


def background(names: Names) -> str:
    """An unrelated passage of the same world: a person, a town or another topic with its maker."""
    r, choice = names.rng, names.rng.randrange(3)
    if choice == 0:
        person, hop = names.person(), r.choice(list(SECOND_HOPS))
        return person_passage(names, person, hop, second_value(names, hop, person)[0])
    if choice == 1:
        return town_passage(names, names.town(), prov=province(names) if r.random() < 0.5 else None)
    hop, maker = r.choice(list(FIRST_HOPS)), names.person()
    return topic_passage(names, hop, make_topic(names, hop), maker, maker["born"] + r.randint(22, 45))


# ---- chains: the two supporting passages, the question, the distractors ----------------------------


@dataclass
class Chain:
    relation: str
    question: str
    answer: str
    topic: str  # as the question names it, without a leading "the"
    bridge: str  # the entity both supporting passages name
    support: tuple[str, str]  # (A: topic -> bridge, B: bridge -> answer)
    distractors: list[str]  # most confusing first: the bridge's and the topic's look-alikes, then the rest


def _confusers(names: Names, near_bridge: str, near_topic: str, rest: list[str]) -> list[str]:
    first = [near_bridge, near_topic]
    names.rng.shuffle(first)
    return first + rest


def person_chain(names: Names, r1: str, r2: str) -> Chain:
    """topic -(r1)-> person -(r2)-> answer, e.g. loom -invented-> Beatrix Olufsen -born in-> Tavrin."""
    r, spec = names.rng, FIRST_HOPS[r1]
    b = names.person()
    value, spouse = second_value(names, r2, b)
    topic, year = make_topic(names, r1), b["born"] + r.randint(22, 45)
    sib = relative(names, b)
    order = "younger" if sib["born"] > b["born"] else "elder"
    sib_text = person_passage(names, sib, r2, second_value(names, r2, sib)[0],
                              [f"{pronouns(sib)['P']} was the {order} {pronouns(sib)['sib']} of {b['name']}."])
    p2 = names.person(era=year - r.randint(20, 32))
    alt = alt_sentence(names, r1, topic[0], p2, r.randint(year + 1, min(year + 30, p2["died"] - 1)))
    alt_text = person_passage(names, p2, r2, second_value(names, r2, p2)[0], [alt])
    p3 = names.person()
    short = SECOND_HOPS[r2]["short"].format(name=p3["name"], v=second_value(names, r2, p3)[0]) + "."
    rival = topic_passage(names, r1, make_topic(names, r1, topic[1]), p3, p3["born"] + r.randint(22, 45), [short])
    question = r.choice(SECOND_HOPS[r2]["questions"]).format(role=spec["role"], s=topic[0], S=cap(topic[0]),
                                                            verb=spec["verb"], pp=spec["pp"])
    return Chain(f"{r1}>{r2}", question, value, bare(topic[0]), b["name"],
                 (topic_passage(names, r1, topic, b, year), person_passage(names, b, r2, value)),
                 _confusers(names, sib_text, alt_text, [rival, neighbour(names, r2, value, spouse)]))


def second_value(names: Names, hop: str, person: dict) -> tuple[str, dict | None]:
    """A fresh value of `hop` for `person` (birth town, spouse, birth year or school), and the spouse if any."""
    if hop == "born_in":
        return names.town(), None
    if hop == "married":
        spouse = names.person(she=not person["she"], era=person["born"] + names.rng.randint(-6, 6))
        return spouse["name"], spouse
    if hop == "birth_year":
        return str(person["born"]), None
    return bare(names.pick(INSTITUTIONS)), None


def located_chain(names: Names) -> Chain:
    """company -based in-> town -located in-> province."""
    r, kind = names.rng, names.rng.choice(list(COMPANY_KINDS))
    company, town, prov, y = f"the {names.stem()} {kind}", names.town(), province(names), names.year(1760, 1900)
    lead = r.choice([f"{cap(company)} is {a(COMPANY_KINDS[kind])} firm founded in {y}.",
                     f"{cap(company)} was among the largest employers of its region by {y + 30}."])
    key = r.choice([f"Its headquarters are in {town}.", f"It has been based in {town} since {y + r.randint(1, 40)}."])
    t2, t3, t4 = names.town(), names.town(), names.town()
    sib = town_passage(names, t2, prov=province(names), facts=[f"It lies {r.randint(4, 40)} kilometres from {town}."])
    alt = town_passage(names, t3, prov=province(names),
                       facts=[f"In {y + r.randint(5, 60)}, {company} opened a warehouse there."])
    rival = passage(names, f"The {names.stem()} {kind} is a firm based in {t4}, in the province "
                           f"of {province(names)}.", [f"It was a rival of {company} from {y + 10}."], "org", (y, y + 90))
    region = passage(names, f"{prov} is a province of {r.choice(list(COUNTRIES))} with its capital at "
                            f"{names.town()}.", [], "region", (1750, 1950))
    question = r.choice([f"In which province is the town where {company} is based?",
                         f"{cap(company)} has its headquarters in a town in which province?",
                         f"Which province contains the town that is home to {company}?"])
    return Chain("based_in>located_in", question, prov, bare(company), town,
                 (passage(names, lead, [key], "org", (y, y + 90)), town_passage(names, town, prov=prov)),
                 _confusers(names, sib, alt, [rival, region]))


def river_chain(names: Names) -> Chain:
    """town -on-> river -flows into-> lake."""
    r, town, river, lake = names.rng, names.town(), names.stem(), f"Lake {names.stem()}"
    country = r.choice(list(COUNTRIES))

    def river_text(name: str, into: str, facts=()) -> str:
        lead = r.choice([f"The {name} is a river in {country} that flows into {into}.",
                         f"The {name} rises in the {names.stem()} Hills and empties into {into}."])
        return passage(names, lead, list(facts), "water", (1700, 1950))

    r2, r3, t4, r4 = names.stem(), names.stem(), names.town(), names.stem()
    sib = passage(names, f"The {r2} is a river of {country}.", [f"It rises close to the source of the {river} but "
                  f"flows into Lake {names.stem()}."], "water", (1700, 1950))
    canal = f"The {names.stem()} Canal, opened in {names.year(1760, 1900)}, links {town} with the {r3}, a river " \
            f"that empties into Lake {names.stem()}."
    alt = passage(names, canal, [], "water", (1760, 1950))
    rival = town_passage(names, t4, river=r4, facts=[f"The {r4} flows into Lake {names.stem()} below the town."])
    lake_text = passage(names, f"{lake} is a lake in {country}, about {r.randint(3, 40)} kilometres long.", [],
                        "water", (1700, 1950))
    question = r.choice([f"Into which lake does the river that runs through {town} flow?",
                         f"The river on which {town} stands empties into which lake?",
                         f"Which lake is fed by the river that flows through {town}?"])
    return Chain("on_river>flows_into", question, lake, town, river,
                 (town_passage(names, town, river=river), river_text(river, lake)),
                 _confusers(names, sib, alt, [rival, lake_text]))


def spouse_chain(names: Names) -> Chain:
    """person -married-> spouse -born in-> town."""
    r, s = names.rng, names.person()
    spouse = names.person(she=not s["she"], era=s["born"] + r.randint(-6, 6))
    town, s_sib, q_sib, partner = names.town(), relative(names, s), relative(names, spouse), names.person()
    sib = person_passage(names, q_sib, "born_in", names.town(), [_sibling_of(q_sib, spouse)])
    alt = person_passage(names, partner, "born_in", names.town(),
                         [f"For {r.randint(3, 20)} years {partner['name']} was the business partner of {s['name']}."])
    rival = person_passage(names, s_sib, "married", names.person(she=not s_sib["she"])["name"],
                           [_sibling_of(s_sib, s)])
    word = pronouns(s)["spouse_word"]
    question = r.choice([f"Where was the {word} of {s['name']} born?", f"In which town was {s['name']}'s {word} born?",
                         f"What is the birthplace of the person {s['name']} married?"])
    return Chain("married>born_in", question, town, s["name"], spouse["name"],
                 (person_passage(names, s, "married", spouse["name"]), person_passage(names, spouse, "born_in", town)),
                 _confusers(names, sib, alt, [rival, town_passage(names, town, prov=province(names))]))


def _sibling_of(sib: dict, person: dict) -> str:
    order = "younger" if sib["born"] > person["born"] else "elder"
    return f"{pronouns(sib)['P']} was the {order} {pronouns(sib)['sib']} of {person['name']}."


def orchestra_chain(names: Names) -> Chain:
    """conductor -led-> orchestra -founded in-> town."""
    r, s = names.rng, {**names.person(), "job": "conductor"}
    y = s["born"] + r.randint(25, 40)
    orch, town, y0 = names.pick(ORCHESTRAS), names.town(), y - r.randint(5, 60)

    def orch_text(name: str, where: str, year: int, facts=()) -> str:
        lead = r.choice([f"The {name} is an orchestra founded in {where} in {year}.",
                         f"The {name} was founded in {where} in {year} by a group of amateur musicians."])
        return passage(names, lead, list(facts), "ensemble", (year, year + 120))

    key = r.choice([f"From {y} to {y + r.randint(3, 20)} {pronouns(s)['p']} was principal conductor of the {orch}.",
                    f"{s['name']} led the {orch} as its principal conductor from {y}."])
    a_text = passage(names, person_lead(names, s), [key], "person", (s["born"] + 18, s["died"]), s)
    sib = orch_text(names.pick(ORCHESTRAS), names.town(), y0 + r.randint(5, 40), [f"Its first players were former "
                    f"members of the {orch}."])
    alt = orch_text(names.pick(ORCHESTRAS), names.town(), y - r.randint(5, 60),
                    [f"Among its guest conductors was {s['name']}, who first appeared with it in {y + r.randint(1, 15)}."])
    rival = orch_text(names.pick(ORCHESTRAS), names.town(), y - r.randint(5, 60),
                      [f"Its principal conductor from {y + r.randint(-10, 10)} was {names.person()['name']}."])
    question = r.choice([f"In which town was the orchestra conducted by {s['name']} founded?",
                         f"Where was the orchestra that {s['name']} led as principal conductor founded?",
                         f"The orchestra that {s['name']} conducted was founded in which town?"])
    return Chain("conducted>founded_in", question, town, s["name"], orch, (a_text, orch_text(orch, town, y0)),
                 _confusers(names, sib, alt, [rival, town_passage(names, town, prov=province(names))]))


def ship_chain(names: Names) -> Chain:
    """ship -built at-> shipyard -founded by-> person."""
    r, founder = names.rng, names.person()
    y0 = founder["born"] + r.randint(25, 40)
    ship, yard, y = f"the {names.stem()} {r.choice(SHIP_ENDS)}", names.pick(YARDS), y0 + r.randint(5, 50)

    def ship_text(name: str, facts: list[str], year: int) -> str:
        lead = r.choice([f"{cap(name)} was a {r.choice(['barque', 'schooner', 'steamship', 'brig'])} launched in "
                         f"{year}.", f"{cap(name)} was a merchant ship that sailed between {names.town()} and "
                         f"{names.town()} from {year}."])
        return passage(names, lead, facts, "ship", (year, year + 40))

    a_text = ship_text(ship, [r.choice([f"She was built at the {yard}.", f"The {yard} built her for the "
                                        f"{names.stem()} Line."])], y)
    b_lead = r.choice([f"The {yard} is a shipyard in {names.town()}, founded in {y0} by {founder['name']}.",
                       f"The {yard} was founded by {founder['name']} in {y0} on the banks of the {names.stem()}."])
    manager = names.person(era=y - r.randint(25, 45))
    sib = person_passage(names, manager, "born_in", names.town(),
                         [f"{manager['name']} managed the {yard} from {y - r.randint(0, 10)}."])
    other, p3 = names.pick(YARDS), names.person()
    alt = passage(names, f"The {other} is a shipyard in {names.town()}, founded by {p3['name']} in "
                         f"{y - r.randint(5, 40)}.", [f"Its best-known work was the refit of {ship} in "
                                                     f"{y + r.randint(2, 20)}."], "org", (y0, y0 + 90))
    rival = ship_text(f"the {names.stem()} {r.choice(SHIP_ENDS)}", [f"She was built at the {names.pick(YARDS)}, "
                      f"which {names.person()['name']} had founded in {y - r.randint(5, 40)}."], y + r.randint(-20, 20))
    question = r.choice([f"Who founded the shipyard that built {ship}?",
                         f"{cap(ship)} was built at a shipyard founded by whom?",
                         f"Who was the founder of the yard where {ship} was built?"])
    return Chain("built_at>founded_by", question, founder["name"], bare(ship), yard,
                 (a_text, passage(names, b_lead, [], "org", (y0, y0 + 90))),
                 _confusers(names, sib, alt, [rival, person_passage(names, founder, "born_in", names.town())]))


OTHER_CHAINS = {"based_in>located_in": located_chain, "on_river>flows_into": river_chain,
                "married>born_in": spouse_chain, "conducted>founded_in": orchestra_chain,
                "built_at>founded_by": ship_chain}
RELATIONS = [f"{r1}>{r2}" for r1 in FIRST_HOPS for r2 in SECOND_HOPS] + [*OTHER_CHAINS] * 3


def build_chain(names: Names, relation: str) -> Chain:
    """A chain of `relation` whose answer needs both passages, redrawn until it passes `_sound`."""
    for _ in range(100):
        if relation in OTHER_CHAINS:
            chain = OTHER_CHAINS[relation](names)
        else:
            chain = person_chain(names, *relation.split(">"))
        if _sound(chain):
            return chain
    raise RuntimeError(f"could not draw a sound {relation} chain")


def _sound(c: Chain) -> bool:
    """Two hops for real: A names topic and bridge but not the answer, B the bridge and the answer but not the
    topic, and no look-alike states the answer (a birth year drawn twice)."""
    a_text, b_text = c.support
    return (c.topic in a_text and c.bridge in a_text and c.answer not in a_text and c.bridge in b_text
            and c.answer in b_text and c.topic not in b_text and not any(c.answer in d for d in c.distractors[:3]))


# ---- items -----------------------------------------------------------------------------------------


def positions(rng: random.Random, k: int) -> tuple[str, int, int]:
    """Where A and B go among k passages: (layout, position of A, position of B)."""
    if k == 2:
        layout, pair = "adjacent", (0, 1)
    else:
        layout = rng.choice(["adjacent-first", "adjacent-last", "first-last"]
                            + (["adjacent-middle", "spread"] if k >= 4 else []))
        if layout == "adjacent-first":
            pair = (0, 1)
        elif layout == "adjacent-last":
            pair = (k - 2, k - 1)
        elif layout == "first-last":
            pair = (0, k - 1)
        elif layout == "adjacent-middle":
            m = rng.randint(1, k - 3)
            pair = (m, m + 1)
        else:  # two or more apart, not both at the ends
            pair = (0, k - 1)
            while pair == (0, k - 1):
                i = rng.randint(0, k - 3)
                pair = (i, rng.randint(i + 2, k - 1))
    return (layout, *pair) if rng.random() < 0.5 else (layout, pair[1], pair[0])


def _schedule(rng: random.Random, count: int) -> list[int]:
    """k for `count` items: 2..10 in turn, shuffled, so each split covers every k about equally."""
    ks = [2 + j % 9 for j in range(count)]
    rng.shuffle(ks)
    return ks


def make_item(names: Names, index: int, seed: int, relation: str, k: int, split: str) -> dict:
    names.seen.clear()
    chain = build_chain(names, relation)
    layout, pa, pb = positions(names.rng, k)
    pool = chain.distractors[:k - 2]
    pool += [background(names) for _ in range(k - 2 - len(pool))]
    names.rng.shuffle(pool)
    texts = [chain.support[0] if p == pa else chain.support[1] if p == pb else pool.pop() for p in range(k)]
    return {"id": f"cp{seed}-{index:04d}", "split": split, "question": chain.question, "answers": [chain.answer],
            "ctxs": [{"title": "", "text": t} for t in texts], "supporting": [pa, pb], "k": k,
            "relation": chain.relation, "topic": chain.topic, "bridge": chain.bridge, "layout": layout}


def make_items(n: int = 240, seed: int = 0) -> list[dict]:
    """n items, the first n // 2 with split "tune", the rest "report"; the same for the same seed."""
    rng = random.Random(seed)
    names = Names(rng)
    half = n // 2
    ks = _schedule(rng, half) + _schedule(rng, n - half)
    relations: list[str] = []
    while len(relations) < n:  # every relation in turn, shuffled per round
        relations += rng.sample(RELATIONS, len(RELATIONS))
    return [make_item(names, i, seed, relations[i], ks[i], "tune" if i < half else "report") for i in range(n)]


# ---- CLI -------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + message
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m kvrag.blend.bench.cross_passage", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="JSON file to write")
    parser.add_argument("--items", type=int, default=240, help="number of items (default 240)")
    parser.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    args = parser.parse_args(argv)
    if args.items < 2:
        parser.error(f"--items must be at least 2, not {args.items}")
    items = make_items(args.items, args.seed)
    try:
        args.out.write_text(json.dumps(items, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    except OSError as exc:
        print(f"error: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"{len(items)} items, k 2-{max(i['k'] for i in items)}, written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
