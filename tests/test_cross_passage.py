"""The generated cross-passage set (bench/rag/cross_passage.py): seeded, two real hops per question,
short passages by SmolLM2's own tokenizer, distractors that share names with the supporting passages."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from kvrag.bench.rag import cross_passage_text as words
from kvrag.bench.rag.cross_passage import main, make_items
from kvrag.bench.rag.items import read_dataset


@pytest.fixture(scope="module")
def items() -> list[dict]:
    return make_items()


def supporting(item: dict) -> tuple[str, str]:
    a, b = item["supporting"]
    return item["ctxs"][a]["text"], item["ctxs"][b]["text"]


def distractors(item: dict) -> list[str]:
    return [c["text"] for i, c in enumerate(item["ctxs"]) if i not in item["supporting"]]


def test_same_seed_same_items_other_seed_other_items(items):
    assert make_items(240, seed=0) == items
    other = make_items(240, seed=1)
    assert [i["question"] for i in other] != [i["question"] for i in items]
    assert not {c["text"] for i in other for c in i["ctxs"]} & {c["text"] for i in items for c in i["ctxs"]}


def test_size_splits_and_k(items):
    assert len(items) == 240 and len({i["id"] for i in items}) == 240
    assert [i["split"] for i in items] == ["tune"] * 120 + ["report"] * 120
    for split in ("tune", "report"):
        ks = Counter(i["k"] for i in items if i["split"] == split)
        assert set(ks) == set(range(2, 11)) and min(ks.values()) >= 10
    assert all(len(i["ctxs"]) == i["k"] and all(c["title"] == "" for c in i["ctxs"]) for i in items)


def test_passages_are_50_to_250_smollm2_tokens(items, smol_tokenizer):
    lengths = [len(smol_tokenizer(c["text"], add_special_tokens=False)["input_ids"]) for i in items for c in i["ctxs"]]
    assert min(lengths) >= 50 and max(lengths) <= 250
    assert max(lengths) - min(lengths) >= 80  # short and long passages, not one size


def test_the_answer_needs_both_passages(items):
    for item in items:
        a_text, b_text = supporting(item)
        answer, topic, bridge = item["answers"][0], item["topic"], item["bridge"]
        assert 1 <= len(answer.split()) <= 4
        assert topic in item["question"] and bridge not in item["question"] and answer not in item["question"]
        assert topic in a_text and bridge in a_text and answer not in a_text, item["id"]
        assert bridge in b_text and answer in b_text and topic not in b_text, item["id"]


def test_distractors_share_names_but_never_complete_the_chain(items):
    for item in items:
        others = distractors(item)
        names_bridge = [d for d in others if item["bridge"] in d]
        names_topic = [d for d in others if item["topic"] in d]
        if item["k"] >= 3:
            assert names_bridge or names_topic, item["id"]
        if item["k"] >= 4:
            assert names_bridge and names_topic, item["id"]
        for d in others:  # a second A (topic + bridge) or a second B (bridge + answer) would be a shortcut
            assert not (item["bridge"] in d and (item["topic"] in d or item["answers"][0] in d)), item["id"]


def test_names_are_unique_across_the_set(items):
    texts = [c["text"] for i in items for c in i["ctxs"]]
    assert len(set(texts)) == len(texts)
    holders: dict[str, set[int]] = {}  # word -> the items whose passages use it
    for n, item in enumerate(items):
        for word in set(re.findall(r"[A-Z][a-z]+", " ".join(c["text"] for c in item["ctxs"]))):
            holders.setdefault(word, set()).add(n)
    shared = {*words.FEMALE, *words.MALE, "Lake", *(w for p in words.INSTITUTIONS for w in re.findall(r"[A-Z][a-z]+", p))}
    for n, item in enumerate(items):  # an answer's invented words turn up in no other item
        for word in item["answers"][0].split():
            if word[0].isupper() and word not in shared:
                assert holders[word] == {n}, (item["id"], word)
            assert re.search(rf"\b{re.escape(word)}\b", " ".join(supporting(item)))  # whole words, not inside one


def test_names_are_invented_not_english_words(items, smol_tokenizer):
    """A common word is one SmolLM2 token (' Nurse', ' Panel'); the invented stems of topics, bridges and
    answers never are. Fixed words (first names, 'Lake', 'Shipyard', 'loom') come from the module's lists."""
    lists = (words.FEMALE, words.MALE, words.ARTEFACTS, words.COMPANY_KINDS, words.BOOK_NOUNS, words.BOOK_ADJS, words.INSTITUTIONS,
             words.ORCHESTRAS, words.SHIP_ENDS, words.YARDS)
    fixed = {w for group in lists for entry in group for w in re.findall(r"[A-Za-z]+", entry)}
    fixed |= {"The", "Lake", "Comet", "Caves", "Spring", "orchid", "Expedition", "of"}
    stems = {w for i in items for w in re.findall(r"[A-Za-z]+", f"{i['topic']} {i['bridge']} {i['answers'][0]}")
             if w not in fixed and not w.isdigit()}
    assert len(stems) > 500
    assert [w for w in stems if len(smol_tokenizer(" " + w, add_special_tokens=False)["input_ids"]) == 1] == []


def test_relations_phrasings_and_layouts_vary(items):
    relations = Counter(i["relation"] for i in items)
    assert len(relations) >= 20 and max(relations.values()) <= 0.1 * len(items)
    verbs = {r.split(">")[0] for r in relations} | {r.split(">")[1] for r in relations}
    assert {"invented", "founded", "born_in", "married", "located_in", "led", "wrote", "discovered"} <= verbs
    shapes = {i["question"].replace(i["topic"], "X") for i in items}
    assert len(shapes) >= 40
    pairs = [tuple(i["supporting"]) for i in items if i["k"] >= 5]
    assert any(a < b for a, b in pairs) and any(a > b for a, b in pairs)
    assert any(abs(a - b) == 1 for a, b in pairs) and any(abs(a - b) >= 3 for a, b in pairs)
    firsts = {min(p) for p in pairs}
    assert 0 in firsts and len(firsts) >= 3  # both first and somewhere in the middle
    assert any(max(a, b) == i["k"] - 1 for i in items for a, b in [i["supporting"]])
    assert set(Counter(i["layout"] for i in items)) == {"adjacent", "adjacent-first", "adjacent-middle",
                                                         "adjacent-last", "first-last", "spread"}


def test_cli_writes_what_kvrag_bench_reads(tmp_path, capsys):
    out = tmp_path / "cp.json"
    assert main(["--out", str(out), "--items", "20", "--seed", "3"]) == 0
    assert json.loads(out.read_text()) == make_items(20, seed=3)
    read = read_dataset(out)
    assert [i["question"] for i in read] == [i["question"] for i in make_items(20, seed=3)]


def test_cli_bad_input_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path / "x.json"), "--items", "0"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "x.json"), "--items", "many"])
    assert main(["--out", str(tmp_path / "no" / "such" / "dir.json"), "--items", "4"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err)
