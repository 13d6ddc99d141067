"""Prompt segments concatenate to exactly the whole prompt's token ids."""

from __future__ import annotations

import pytest

from kvrag.errors import KvragError
from kvrag.model.prompt import PromptBuilder, check_segmentation, encode, render_passage


def test_segments_tokenize_as_the_whole_prompt_on_long_passages(smol_tokenizer, invented_items):
    builder = PromptBuilder(smol_tokenizer)
    for item in invented_items:
        ctxs = item["ctxs"]
        passages = [builder.passage_ids(c["title"], c["text"]) for c in ctxs]
        prompt = builder.build(passages, item["question"])
        whole = encode(smol_tokenizer, builder.template.full_text(
            [render_passage(c["title"], c["text"]) for c in ctxs], item["question"]))
        assert prompt.flat() == whole
        # each passage keeps its own ids wherever it stands
        assert prompt.passage_spans()[0][0] == len(builder.preamble_ids)


def test_passage_order_does_not_change_a_passages_ids(smol_tokenizer, invented_items):
    builder = PromptBuilder(smol_tokenizer)
    ctxs = invented_items[0]["ctxs"][:4]
    texts = [render_passage(c["title"], c["text"]) for c in ctxs]
    reordered = texts[::-1]
    whole = encode(smol_tokenizer, builder.template.full_text(reordered, "Who?"))
    segmented = builder.build([encode(smol_tokenizer, t) for t in reordered], "Who?").flat()
    assert segmented == whole


def test_preamble_and_suffix_come_from_the_chat_template(smol_tokenizer):
    builder = PromptBuilder(smol_tokenizer)
    assert builder.template.preamble.startswith("<|im_start|>system")
    assert builder.template.preamble.endswith("Passages:")
    suffix = builder.template.suffix("What is it?")
    assert "Question: What is it?\nAnswer:" in suffix
    assert suffix.endswith("<|im_start|>assistant\n")


def test_titles_and_whitespace(smol_tokenizer):
    assert render_passage("", "  text \n") == "\n\ntext"
    assert render_passage("T", "x") == "\n\nT\nx"
    assert render_passage("T", "x", " \n\n") == " \n\nT\nx"


def test_empty_question_is_refused(smol_tokenizer):
    with pytest.raises(KvragError, match="empty"):
        PromptBuilder(smol_tokenizer).build([], "   ")


def test_segmentation_check_refuses_a_merging_tokenizer(smol_tokenizer):
    class Merging:  # a tokenizer that glues across boundaries: ids depend on what comes before
        chat_template = None

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [len(text)]}

    with pytest.raises(KvragError, match="boundary"):
        check_segmentation(PromptBuilder(Merging()))
    check_segmentation(PromptBuilder(smol_tokenizer))  # the real one passes
