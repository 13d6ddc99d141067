"""RULER-style synthetic tasks (bench/rag/ruler.py): seeded, needles where the generator says, lengths on target,
RULER's scoring. The tokenizer is SmolLM2's own; the haystack is the bundled corpus unless a test says otherwise."""

from __future__ import annotations

import re

import pytest

from kvrag.bench.rag import ruler
from kvrag.bench.rag.ruler import (
    ADJECTIVES,
    ANSWER_TOKENS,
    CHUNK_TOKENS,
    KINDS,
    NOUNS,
    RulerTask,
    generate_tasks,
    ruler_all,
    ruler_score,
)
from kvrag.errors import KvragError
from kvrag.model.prompt import PromptBuilder
from kvrag.store.chunks import chunk_id_for

LENGTHS = (2048, 4096)
TOLERANCE = 16  # tokens the prompt may fall short of target - ANSWER_TOKENS (a word's worth, at most)


@pytest.fixture(scope="module")
def prompts(smol_tokenizer) -> PromptBuilder:
    return PromptBuilder(smol_tokenizer)


@pytest.fixture(scope="module")
def tasks(prompts, smol) -> list[RulerTask]:
    return generate_tasks(prompts, smol.tokenizer_fingerprint, KINDS, LENGTHS, per_cell=3, seed=7,
                          haystack_source="sample")


def texts(task: RulerTask, tokenizer) -> list[str]:
    return [tokenizer.decode(ids) for _, ids in task.item.chunks]


def test_same_seed_same_tasks_other_seed_others(prompts, smol, tasks):
    again = generate_tasks(prompts, smol.tokenizer_fingerprint, KINDS, LENGTHS, per_cell=3, seed=7,
                           haystack_source="sample")
    assert again == tasks  # every field, token ids included
    other = generate_tasks(prompts, smol.tokenizer_fingerprint, KINDS, [2048], per_cell=1, seed=8,
                           haystack_source="sample")
    first = [t for t in tasks if t.target_tokens == 2048][::3]  # each kind's first 2048-token task
    assert all(o.item.chunks != t.item.chunks and o.expected != t.expected for o, t in zip(other, first, strict=True))
    # a cell's tasks do not depend on which other cells were asked for
    alone = generate_tasks(prompts, smol.tokenizer_fingerprint, ["vartrack"], [4096], per_cell=3, seed=7,
                           haystack_source="sample")
    cell = [t for t in tasks if t.kind == "vartrack" and t.target_tokens == 4096]
    assert [t.item.chunks for t in alone] == [t.item.chunks for t in cell]


def test_cells_and_items(tasks):
    assert [(t.kind, t.target_tokens) for t in tasks] == [(k, n) for k in KINDS for n in LENGTHS for _ in range(3)]
    for i, t in enumerate(tasks):
        assert t.item.index == i and t.item.answers == t.expected and t.haystack == "sample" and t.seed == 7
        assert t.item.question.endswith("?") or t.kind == "vartrack"
        assert len({cid for cid, _ in t.item.chunks}) == len(t.item.chunks)  # no chunk twice in a prompt


def test_each_needle_in_exactly_its_chunk(tasks, smol_tokenizer):
    for t in tasks:
        chunk_texts = texts(t, smol_tokenizer)
        for nd in t.needles:
            holders = [i for i, text in enumerate(chunk_texts) if nd.text in text]
            assert holders == [nd.chunk], (t.kind, nd)
            assert sum(text.count(nd.text) for text in chunk_texts) == 1


def _chains(t: RulerTask) -> list[list[int]]:
    """The chunks of each group placed together: gold and distractor chains (vartrack), else all needles."""
    if t.kind == "vartrack":
        return [[nd.chunk for nd in t.needles if nd.gold], [nd.chunk for nd in t.needles if not nd.gold]]
    return [[nd.chunk for nd in t.needles]]


def test_needles_in_distinct_chunks_spread_over_the_context(tasks):
    for t in tasks:
        n = len(t.item.chunks)
        for chunks in _chains(t):
            assert len(set(chunks)) == len(chunks)
            c = len(chunks)
            # needle i in the i-th of c equal stretches: first, middle, last part of the context
            assert all(n * i // c <= chunk < n * (i + 1) // c for i, chunk in enumerate(chunks)), (t.kind, chunks, n)
    counts = {"needle": 1, "multikey": 4, "multivalue": 4, "vartrack": 10}
    assert all(len(t.needles) == counts[t.kind] for t in tasks)
    for length in LENGTHS:  # a cell of three lone needles: one in each third
        cell = [t for t in tasks if t.kind == "needle" and t.target_tokens == length]
        thirds = sorted(k for t in cell for k in range(3)
                        if len(t.item.chunks) * k // 3 <= t.needles[0].chunk < len(t.item.chunks) * (k + 1) // 3)
        assert thirds == [0, 1, 2]


def test_token_count_on_target(tasks, prompts, smol):
    for t in tasks:
        whole = prompts.build([ids for _, ids in t.item.chunks], t.item.question).flat()
        assert t.prompt_tokens == len(whole)
        assert t.target_tokens - ANSWER_TOKENS - TOLERANCE <= len(whole) <= t.target_tokens - ANSWER_TOKENS
        sizes = [len(ids) for _, ids in t.item.chunks]
        assert abs(sum(sizes) / len(sizes) - CHUNK_TOKENS) <= CHUNK_TOKENS // 4  # passage-sized chunks
        assert all(CHUNK_TOKENS // 3 <= s <= 2 * CHUNK_TOKENS for s in sizes), sizes
        assert all(cid == chunk_id_for(ids, smol.tokenizer_fingerprint) for cid, ids in t.item.chunks)


def test_longest_target_fits_the_model(prompts, smol):
    [t] = generate_tasks(prompts, smol.tokenizer_fingerprint, ["multivalue"], [8192], per_cell=1, seed=3,
                         haystack_source="sample")
    assert 8192 - ANSWER_TOKENS - TOLERANCE <= t.prompt_tokens <= 8192 - ANSWER_TOKENS <= smol.config.max_positions


def test_gold_answers_verbatim_in_the_chunks(tasks, smol_tokenizer):
    for t in tasks:
        context = "".join(texts(t, smol_tokenizer))
        gold = [nd.text for nd in t.needles if nd.gold]
        for value in t.expected:
            assert value in context
            assert any(value in g for g in gold)
        if t.kind != "vartrack":  # each number once, in its needle, and never in the haystack
            assert all(context.count(v) == 1 for v in t.expected)
            key = re.search(r"for (\S+) mentioned", t.item.question).group(1)
            assert all(f"for {key} is: " in g for g in gold)
            assert all(f"for {key} is: " not in nd.text for nd in t.needles if not nd.gold)
            assert ruler_score(" ".join(gold), t.expected) == 1.0


def _interpret(context: str) -> dict[str, str]:
    """Every VAR statement in reading order; a name takes the value its right side has at that point."""
    env: dict[str, str] = {}
    for name, other, number in re.findall(r"VAR ([A-Z]{5}) = (?:VAR ([A-Z]{5})|(\d+))\.", context):
        env[name] = number or env[other]  # a KeyError: a name used before it was assigned
    return env


def test_vartrack_chains_resolve_to_the_answer(tasks, smol_tokenizer):
    for t in [t for t in tasks if t.kind == "vartrack"]:
        env = _interpret(" ".join(texts(t, smol_tokenizer)))
        asked = re.search(r"the value (\d+) in", t.item.question).group(1)
        assert sorted(n for n, v in env.items() if v == asked) == sorted(t.expected)
        assert len(t.expected) == 5 and len(env) == 10  # the distractor chain: five names with another value
        assert len(set(env.values())) == 2


def test_ruler_score_by_hand():
    assert ruler_score("The special magic number is 1234567.", ["1234567"]) == 1.0
    assert ruler_score("It is 1234568.", ["1234567"]) == 0.0
    assert ruler_score("1111111, 2222222 and 4444444", ["1111111", "2222222", "3333333", "4444444"]) == 0.75
    assert ruler_all("1111111, 2222222 and 4444444", ["1111111", "2222222", "3333333", "4444444"]) == 0.0
    assert ruler_score("abcde, FGHIJ", ["ABCDE", "FGHIJ"]) == 1.0  # case ignored, as RULER does
    assert ruler_all("abcde, FGHIJ", ["ABCDE", "FGHIJ"]) == 1.0
    assert ruler_score("", ["1"]) == 0.0
    with pytest.raises(ValueError):
        ruler_score("anything", [])


def test_keys_never_contain_one_another():
    for words in (ADJECTIVES, NOUNS):
        assert len(set(words)) == len(words)
        assert not [(a, b) for a in words for b in words if a != b and a in b]


def test_bundled_corpus_alone(prompts, smol, monkeypatch, tmp_path):
    monkeypatch.setattr(ruler, "default_dataset", lambda: tmp_path / "no-musique.json")  # as without ../shared
    got = generate_tasks(prompts, smol.tokenizer_fingerprint, ["needle", "vartrack"], [2048], per_cell=1, seed=1)
    assert [t.haystack for t in got] == ["sample", "sample"]
    with pytest.raises(KvragError, match="no-musique.json is missing"):
        generate_tasks(prompts, smol.tokenizer_fingerprint, ["needle"], [2048], per_cell=1, haystack_source="musique")


def test_bad_requests_are_one_line(prompts, smol):
    with pytest.raises(KvragError, match="kinds must be among"):
        generate_tasks(prompts, smol.tokenizer_fingerprint, ["haystack"], [2048], haystack_source="sample")
    with pytest.raises(KvragError, match="too short"):
        generate_tasks(prompts, smol.tokenizer_fingerprint, ["vartrack"], [512], haystack_source="sample")


@pytest.mark.benchmark_data
def test_musique_haystack(prompts, smol, musique_path, smol_tokenizer):
    got = generate_tasks(prompts, smol.tokenizer_fingerprint, KINDS, [4096], per_cell=1, seed=2,
                         haystack_source=musique_path)
    for t in got:
        assert t.haystack == musique_path.name
        assert 4096 - ANSWER_TOKENS - TOLERANCE <= t.prompt_tokens <= 4096 - ANSWER_TOKENS
        assert len({cid for cid, _ in t.item.chunks}) == len(t.item.chunks)
        chunk_texts = texts(t, smol_tokenizer)
        assert all([i for i, x in enumerate(chunk_texts) if nd.text in x] == [nd.chunk] for nd in t.needles)


def test_the_haystack_keeps_to_the_benchmark_items(tmp_path):
    """A MuSiQue-shaped file of 150 items: the haystack reads items 0-99 (tune and report), never the held-out 100-149."""
    import json

    def item(i: int) -> dict:
        mark = "held out" if i >= 100 else "usable"
        return {"question": "q", "answers": ["a"], "ctxs": [{"title": "", "text": f"Passage {i} is {mark} prose."}]}

    path = tmp_path / "musique_like.json"
    path.write_text(json.dumps([item(i) for i in range(150)]))
    sentences = [s for doc in ruler.load_haystack(path).docs for s in doc]
    assert len(sentences) == 100 and all("usable" in s for s in sentences)
