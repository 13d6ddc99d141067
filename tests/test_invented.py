"""The invented items other tests use in place of MuSiQue: its shape, passage lengths, answerable, reproducible."""

from __future__ import annotations

from kvrag.bench import invented


def test_items_have_musique_shape_and_are_reproducible(invented_items):
    assert invented_items == invented.invented_items(40, seed=0)
    assert invented_items != invented.invented_items(40, seed=1)
    for item in invented_items:
        assert set(item) == {"question", "answers", "ctxs"} and item["question"].endswith("?")
        assert 5 <= len(item["ctxs"]) <= 10 and all(set(c) == {"title", "text"} for c in item["ctxs"])
        # the question names one of its passages' subjects, and some passage holds the answer
        assert any(c["title"] in item["question"] for c in item["ctxs"])
        assert any(a in c["text"] for a in item["answers"] for c in item["ctxs"])


def test_passages_run_300_to_500_tokens(invented_items, smol_tokenizer):
    lengths = {len(smol_tokenizer(c["text"], add_special_tokens=False)["input_ids"])
               for item in invented_items for c in item["ctxs"]}
    assert 300 <= min(lengths) and max(lengths) <= 500
