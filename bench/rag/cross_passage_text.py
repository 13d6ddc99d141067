"""The cross-passage set's words and sentences: invented names built from syllables and lists, and the sentence
templates of its passages and questions (bench/rag/cross_passage.py assembles them into items)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

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
