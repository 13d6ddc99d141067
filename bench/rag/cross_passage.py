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

    python -m kvrag.bench.rag.cross_passage --out cross_passage.json [--items 240] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from kvrag.bench.rag.cross_passage_text import (
    COMPANY_KINDS,
    COUNTRIES,
    FIRST_HOPS,
    INSTITUTIONS,
    ORCHESTRAS,
    SECOND_HOPS,
    SHIP_ENDS,
    YARDS,
    Names,
    a,
    alt_sentence,
    bare,
    cap,
    make_topic,
    neighbour,
    passage,
    person_lead,
    person_passage,
    pronouns,
    province,
    relative,
    topic_passage,
    town_passage,
)

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
    parser = _Parser(prog="python -m kvrag.bench.rag.cross_passage", description=__doc__.splitlines()[0])
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
