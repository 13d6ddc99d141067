"""Our light tokenizer (model/tokenizer.py) against transformers' AutoTokenizer on the same files."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from kvrag.model.prompt import PromptTemplate
from kvrag.model.tokenizer import Tokenizer, load_tokenizer

TEXTS = [
    "Who was the last keeper of the Skerry Point lighthouse?",
    "\n\nLighthouses of the northern coast\nMargaret Ross kept the light until 1961.  Two  spaces,\ttabs\r\n",
    "Ünïcödé café naïve — 東京, Zürich; emoji 🌋 and maths ∑x² ≤ 3.",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>\n",
    "don't , can't . isn't ? '' \" quotes \"",
    "",
]


@pytest.fixture(scope="module")
def pair(smol):
    return Tokenizer(smol.path), AutoTokenizer.from_pretrained(str(smol.path))


def test_ids_equal_autotokenizer(pair):
    ours, ref = pair
    for text in TEXTS:
        for special in (False, True):
            assert ours(text, add_special_tokens=special)["input_ids"] == \
                ref(text, add_special_tokens=special)["input_ids"], text


def test_decoding_equals_autotokenizer(pair):
    ours, ref = pair
    for text in TEXTS:
        ids = ref(text, add_special_tokens=False)["input_ids"]
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


def test_chat_template_and_special_tokens_equal_autotokenizer(pair):
    ours, ref = pair
    messages = [{"role": "user", "content": "Passages: ... Question: who?"}]
    for generation in (False, True):
        assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation) == \
            ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
    with_system = [{"role": "system", "content": "Be brief."}, *messages]
    assert ours.apply_chat_template(with_system, add_generation_prompt=True) == \
        ref.apply_chat_template(with_system, tokenize=False, add_generation_prompt=True)
    assert PromptTemplate.from_tokenizer(ours) == PromptTemplate.from_tokenizer(ref)
    assert ours.eos_token_id == ref.eos_token_id is not None
    assert ours.get_vocab() == ref.get_vocab()


def test_the_default_model_gets_the_light_tokenizer(smol):
    assert isinstance(load_tokenizer(smol.path), Tokenizer)
    assert isinstance(smol.load_tokenizer(), Tokenizer)
