"""Grammar-constrained decoding (model/constrain.py) with the real llguidance and SmolLM2's tokenizer: random logits
driven through a Constraint always come out as valid JSON, the schema's, or a call of one of the tools."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from kvrag.errors import KvragError
from kvrag.model.constrain import Grammars
from kvrag.model.sampling import stop_ids

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "country": {"enum": ["FR", "DE", "US"]}},
                    "required": ["city", "country"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"$ref": "#/$defs/unit"}},
           "required": ["city", "unit"], "additionalProperties": False,
           "$defs": {"unit": {"enum": ["celsius", "fahrenheit"]}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "maxLength": 30}}, "required": ["query"]}}},
    {"type": "function", "function": {"name": "now"}},  # no parameters: arguments {}
]


@pytest.fixture(scope="module")
def stops(smol_tokenizer) -> set[int]:
    return stop_ids(smol_tokenizer)  # <|im_end|> and <|endoftext|>, as the engine's


@pytest.fixture(scope="module")
def grammars(smol_tokenizer, stops) -> Grammars:
    return Grammars(smol_tokenizer, stops)


@pytest.fixture(scope="module")
def closers(smol_tokenizer) -> torch.Tensor:
    """A logit bonus for tokens that close something, so random logits finish a document in tens of steps."""
    vocab = smol_tokenizer.get_vocab()
    bias = torch.zeros(len(vocab))
    for text, i in vocab.items():
        if any(c in text for c in '"}],'):
            bias[i] = 3.0
    return bias


def walk(grammar, tokenizer, bias: torch.Tensor, seed: int, pad: int = 0, limit: int = 300) -> tuple[str, list]:
    """Greedy over seeded random logits (the model's vocab `pad` longer than the tokenizer's) until done()."""
    gen = torch.Generator().manual_seed(seed)
    constraint, tokens = grammar.start(), []
    while not constraint.done():
        assert len(tokens) < limit, f"not done after {limit} tokens: {tokenizer.decode(tokens)!r}"
        logits = torch.randn(bias.shape[0] + pad, generator=gen)
        logits[: bias.shape[0]] += bias
        constraint.mask(logits)
        token = int(torch.argmax(logits))
        constraint.accept(token)
        tokens.append(token)
    return tokenizer.decode(tokens), tokens


def check_person(doc: dict) -> None:
    assert set(doc) <= set(PERSON["properties"]) and {"name", "age", "tags", "address"} <= set(doc)
    assert isinstance(doc["name"], str) and len(doc["name"]) <= 20
    assert isinstance(doc["age"], int) and not isinstance(doc["age"], bool) and doc["age"] >= 0
    assert isinstance(doc["tags"], list) and len(doc["tags"]) <= 3 and all(isinstance(t, str) for t in doc["tags"])
    assert set(doc["address"]) == {"city", "country"} and doc["address"]["country"] in ("FR", "DE", "US")
    assert isinstance(doc.get("active", True), bool)


def test_any_json_object(grammars, smol_tokenizer, closers):
    for seed in range(5):
        text, _ = walk(grammars.json_object(), smol_tokenizer, closers, seed)
        assert isinstance(json.loads(text), dict), text


def test_a_schemas_documents_validate(grammars, smol_tokenizer, closers):
    for seed in range(5):
        text, _ = walk(grammars.json_schema(PERSON), smol_tokenizer, closers, seed)
        check_person(json.loads(text))


def test_after_a_key_a_value_comes_not_a_closing_brace(grammars, smol_tokenizer):
    constraint = grammars.json_object().start()
    for token in smol_tokenizer('{"a": ', add_special_tokens=False)["input_ids"]:
        constraint.accept(token)
    vocab = smol_tokenizer.get_vocab()
    allowed = constraint.allowed()
    assert not allowed[vocab["}"]] and not any(allowed[i] for t, i in vocab.items() if t.startswith("}"))
    assert all(allowed[vocab[t]] for t in ('"', "1", "[", "{", "true", "null"))
    logits = torch.zeros(len(vocab))
    constraint.mask(logits)
    assert logits[vocab["}"]] == float("-inf") and logits[vocab['"']] == 0


def test_stop_tokens_only_at_the_end_and_then_alone(grammars, smol_tokenizer, stops, closers):
    constraint = grammars.json_schema(PERSON).start()
    _, tokens = walk(grammars.json_schema(PERSON), smol_tokenizer, closers, seed=7)
    for token in tokens:
        assert not constraint.done() and not any(constraint.allowed()[s] for s in stops)
        constraint.accept(token)
    assert constraint.done()
    assert set(torch.nonzero(constraint.allowed()).flatten().tolist()) == stops
    constraint.accept(min(stops))  # the turn's end is a token the grammar takes
    assert constraint.done()


def test_a_document_that_may_go_on_allows_both(grammars, smol_tokenizer, stops):
    """A top-level number is complete after "12" yet could be 123: stops and digits are both allowed, not done."""
    constraint = grammars.json_schema({"type": "integer"}).start()
    for token in smol_tokenizer("12", add_special_tokens=False)["input_ids"]:
        constraint.accept(token)
    allowed = constraint.allowed()
    assert all(allowed[s] for s in stops) and allowed[smol_tokenizer.get_vocab()["3"]] and not constraint.done()


def test_a_longer_model_vocab_is_padded_as_disallowed(grammars, smol_tokenizer, closers):
    constraint = grammars.json_object().start()
    logits = torch.zeros(grammars.vocab_size + 64)
    constraint.mask(logits)
    assert torch.all(logits[grammars.vocab_size:] == float("-inf"))
    text, _ = walk(grammars.json_object(), smol_tokenizer, closers, seed=3, pad=64)
    json.loads(text)


def test_a_forced_call_names_a_tool_and_its_arguments_fit(grammars, smol_tokenizer, closers):
    names = set()
    for seed in range(6):
        text, _ = walk(grammars.tool_call(TOOLS, "required"), smol_tokenizer, closers, seed)
        call = json.loads(text)
        assert list(call) == ["name", "arguments"], text
        names.add(call["name"])
        args = call["arguments"]
        if call["name"] == "get_weather":
            assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
        elif call["name"] == "search":
            assert isinstance(args["query"], str)
        else:
            assert call["name"] == "now" and args == {}
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        call = json.loads(walk(grammars.tool_call(TOOLS, choice), smol_tokenizer, closers, seed)[0])
        assert call["name"] == "get_weather" and call["arguments"]["unit"] in ("celsius", "fahrenheit")


@pytest.mark.parametrize("schema, message", [
    ({"type": "foo"}, "bad JSON schema: Invalid type: foo"),
    ({"properties": {"a": {"$ref": "#/$defs/nope"}}}, "does not exist"),
    ({"properties": {"a": {"type": "string", "pattern": "(("}}}, "unclosed group"),
    (["not", "an", "object"], "must be a JSON object"),
    ({"type": "number", "minimum": float("nan")}, "not JSON"),
])
def test_a_bad_schema_is_one_clear_line(grammars, schema, message):
    with pytest.raises(KvragError, match=message) as err:
        grammars.json_schema(schema)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("tools, choice, message", [
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "'nope', which is not among the tools"),
    (TOOLS, "none", "tool_choice must be"),
    ([], "required", "non-empty list"),
    ([{"type": "function", "function": {"description": "no name"}}], "required", r"tools\[0\] is not"),
    ([TOOLS[1], TOOLS[1]], "required", "two tools are named 'search'"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}], "required",
     "tool 'f': bad parameters schema: Invalid type: foo"),
])
def test_bad_tools_are_one_clear_line(grammars, tools, choice, message):
    with pytest.raises(KvragError, match=message):
        grammars.tool_call(tools, choice)


def test_a_token_the_mask_removed_is_refused(grammars, smol_tokenizer):
    constraint = grammars.json_object().start()
    with pytest.raises(KvragError, match="breaks the grammar"):
        constraint.accept(smol_tokenizer.get_vocab()["}"])


def test_grammars_are_cached_by_schema_and_bounded(smol_tokenizer, stops):
    grammars = Grammars(smol_tokenizer, stops, cache_size=2)
    first = grammars.json_schema(PERSON)
    assert grammars.json_schema(json.loads(json.dumps(PERSON))) is first
    grammars.json_object()
    grammars.json_schema(WEATHER)  # a third: PERSON, the least recently used, goes
    assert grammars.json_schema(PERSON) is not first


def test_sequences_share_a_grammar_across_threads(grammars, smol_tokenizer, closers):
    grammar, texts = grammars.json_schema(PERSON), {}

    def run(seed):
        texts[seed] = walk(grammar, smol_tokenizer, closers, seed)[0]

    threads = [threading.Thread(target=run, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(texts) == [0, 1, 2, 3]
    for text in texts.values():
        check_person(json.loads(text))


@pytest.mark.real_model
def test_smollm2_answers_in_the_schema(smol):
    """The real model's greedy answer, constrained: JSON that fits, ended by the model at <|im_end|>."""
    from kvrag.model.decode import decode_step
    from kvrag.model.prefill import prefill
    from kvrag.model.runtime import Runtime

    rt = Runtime.load(None)
    grammars = Grammars(rt.tokenizer, stop_ids(rt.tokenizer))
    messages = [{"role": "user", "content": "Describe Ada Lovelace as JSON: name, age, tags, address."}]
    ids = rt.ids_tensor(rt.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))
    constraint, tokens = grammars.json_schema(PERSON).start(), []
    logits, cache = prefill(rt.model, ids, extra=160)
    with torch.inference_mode():  # as the engine decodes: the logits are inference tensors, masked in place
        while len(tokens) < 150:
            constraint.mask(logits)
            token = int(torch.argmax(logits))
            constraint.accept(token)
            if token in grammars.stop_ids:
                break
            tokens.append(token)
            logits = decode_step(rt.model, cache, token)
    assert constraint.done(), rt.tokenizer.decode(tokens)
    check_person(json.loads(rt.tokenizer.decode(tokens)))


def test_auto_takes_a_call_or_text_that_opens_none(grammars, smol_tokenizer, stops):
    grammar = grammars.tool_call(TOOLS, "auto")
    text = grammar.start()
    for token in smol_tokenizer("It is sunny.", add_special_tokens=False)["input_ids"]:
        text.accept(token)
    assert not text.done() and all(text.allowed()[s] for s in stops)  # text may end, or go on
    call = grammar.start()
    for token in smol_tokenizer('{"name": "search", "arguments": {"query": "x"}}',
                                add_special_tokens=False)["input_ids"]:
        call.accept(token)
    assert call.done()
    with pytest.raises(KvragError):  # a brace opens a call: no other object
        other = grammar.start()
        for token in smol_tokenizer('{"weather": 1}', add_special_tokens=False)["input_ids"]:
            other.accept(token)
