"""Prompts follow the tokenizer's own rules: a model without a chat template gets what its tokenizer puts before any
text (a base model's BOS), as transformers' encode gives it; a chat template writes its own. The reference is
transformers' tokenizer over the same text."""

from __future__ import annotations

import json
import shutil

import pytest

from kvrag.model.chat import ChatPrompts
from kvrag.model.prompt import PromptBuilder, check_segmentation, leading_specials, render_passage
from kvrag.model.tokenizer import Tokenizer

BOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def base_tokenizer_dir(tmp_path_factory, smol):
    """SmolLM2's tokenizer as a base model's: no chat template, and a BOS put before every text it encodes."""
    path = tmp_path_factory.mktemp("base-tokenizer")
    spec = json.loads((smol.path / "tokenizer.json").read_text())
    bos_id = next(t["id"] for t in spec["added_tokens"] if t["content"] == BOS)
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {BOS: {"id": BOS, "ids": [bos_id], "tokens": [BOS]}},
    }
    (path / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((smol.path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    config["bos_token"] = BOS
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def _transformers(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def test_a_base_models_prompt_starts_with_its_bos_as_transformers_encodes_it(base_tokenizer_dir):
    tokenizer, reference = Tokenizer(base_tokenizer_dir), _transformers(base_tokenizer_dir)
    assert not tokenizer.chat_template and leading_specials(tokenizer) == BOS
    builder = PromptBuilder(tokenizer)
    check_segmentation(builder)
    passages = [render_passage("Rivers", "The Nile flows north."), render_passage("", "Lakes are deep.")]
    question = "Which river flows north?"
    ids = builder.build([builder.passage_ids("Rivers", "The Nile flows north."),
                         builder.passage_ids("", "Lakes are deep.")], question).flat()
    text = builder.template.full_text(passages, question)[len(BOS):]  # the prompt as a client writes it, no BOS
    assert ids == reference(text)["input_ids"]
    assert ids[0] == reference.bos_token_id
    plain = ChatPrompts(builder).plain_ids([], question)
    assert plain == reference(question)["input_ids"]


def test_a_chat_template_writes_its_own_start(smol):
    """SmolLM2's template: the prompt is transformers' apply_chat_template, nothing added before it."""
    tokenizer, reference = Tokenizer(smol.path), _transformers(smol.path)
    assert leading_specials(tokenizer) == ""  # its tokenizer adds nothing; its template opens the turn
    plain = ChatPrompts(PromptBuilder(tokenizer)).plain_ids([("system", "Be brief.")], "Who built it?")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who built it?"}]
    assert plain == list(reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False))


@pytest.mark.model_check
def test_the_gate_fails_a_bare_prompt_without_its_bos_and_passes_it_with(tmp_path, tiny_llama_dir, base_tokenizer_dir,
                                                                           monkeypatch):
    """A tiny model with the base tokenizer: its prompt starts with the BOS, and the gate says so; a prompt built as
    before (no BOS) fails the gate's prompt_start check."""
    import kvrag.model.prompt as prompt
    from kvrag.engine.model_check import check_model
    from kvrag.model.runtime import Runtime

    model = tmp_path / "base-model"
    shutil.copytree(tiny_llama_dir, model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base_tokenizer_dir / name, model / name)
    (model / "chat_template.jinja").unlink(missing_ok=True)

    def start(runtime) -> dict:
        return next(c for c in check_model(runtime).checks if c.name == "prompt_start").figures

    runtime = Runtime.load(str(model), "float32")
    assert runtime.prompts.preamble_ids[0] == runtime.tokenizer.backend_tokenizer.token_to_id(BOS)
    assert start(runtime) == {"missing_leading_tokens": 0}
    monkeypatch.setattr(prompt, "leading_specials", lambda tokenizer: "")  # the prompt as it was built before
    assert start(Runtime.load(str(model), "float32")) == {"missing_leading_tokens": 1}
