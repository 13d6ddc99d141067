"""The OpenAI surface without silent gaps (issue 48): every field a client sends either changes the answer as OpenAI
defines it or is a 400 naming it. A real uvicorn server over a tiny random Llama (SmolLM2's tokenizer), the real
`openai` client and httpx; references are KVRag.ask on the same engine. What the model says is noise, the same
noise both ways."""

from __future__ import annotations

import json
import shutil

import httpx
import openai
import pytest
import torch

from kvrag.errors import KvragError
from kvrag.model.sampling import SamplingConfig, adjusted, choose
from kvrag.server.app import ServerSettings
from kvrag.server.run import BackgroundServer

MODEL = "tiny-llama"
QUESTION = "How deep is Lake Baikal?"
STEPS = 12


@pytest.fixture(scope="module")
def rag(indexed_store, tiny_llama_dir, tmp_path_factory):
    from kvrag import KVRag

    store = tmp_path_factory.mktemp("surface") / "store"
    shutil.copytree(indexed_store, store)
    with KVRag(store, model=str(tiny_llama_dir)) as opened:
        yield opened


@pytest.fixture(scope="module")
def server(rag):
    with BackgroundServer(rag, ServerSettings(MODEL)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url + "/v1", timeout=120) as opened:
        yield opened


def error_of(response: httpx.Response, param: str) -> str:
    """A 400 naming `param`: its message."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


def chat(client, content=QUESTION, **options):
    return client.chat.completions.create(model=MODEL, max_tokens=STEPS, messages=[{"role": "user", "content": content}],
                                          **options)


# ---- n choices: each the first's prompt; usage counts them all ---------------------------------------------------


def test_n_choices_of_plain_chat_are_plain_chat(client):
    one = chat(client, extra_body={"rag": False})
    two = chat(client, n=2, extra_body={"rag": False})
    assert [c.message.content for c in two.choices] == [one.choices[0].message.content] * 2  # greedy: one prompt
    assert two.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt once, as OpenAI counts it
    assert two.usage.completion_tokens == 2 * one.usage.completion_tokens
    assert two.usage.total_tokens == two.usage.prompt_tokens + two.usage.completion_tokens
    assert two.model_extra["sources"] == []


def test_n_choices_of_a_rag_answer_share_the_first_choices_chunks(client):
    retrieval = {"k": 2, "min_score": 0, "relative_cutoff": 0}
    one = chat(client, extra_body=retrieval)
    two = chat(client, n=3, extra_body=retrieval)
    assert len(one.model_extra["sources"]) == 2
    assert [c.message.content for c in two.choices] == [one.choices[0].message.content] * 3
    assert two.usage.prompt_tokens == one.usage.prompt_tokens
    assert two.usage.completion_tokens == 3 * one.usage.completion_tokens


def test_a_streams_usage_sums_its_choices(client):
    one = chat(client, extra_body={"rag": False})
    chunks = list(chat(client, n=2, stream=True, stream_options={"include_usage": True}, extra_body={"rag": False}))
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in range(2)]
    assert [t.strip() for t in texts] == [one.choices[0].message.content] * 2
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.prompt_tokens == one.usage.prompt_tokens
    assert usage.completion_tokens == 2 * one.usage.completion_tokens


# ---- content parts: text is read, anything else is a 400 -----------------------------------------------------------


def test_text_parts_are_the_text(client):
    parts = [{"type": "text", "text": "How deep is "}, {"type": "text", "text": "Lake Baikal?"}]
    assert chat(client, parts).choices[0].message.content == chat(client).choices[0].message.content


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
    {"type": "file", "file": {"file_id": "file-1"}},
])
def test_a_part_a_text_model_cannot_read_is_a_400_naming_its_type(http, part):
    content = [{"type": "text", "text": "What is in this?"}, part]
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": content}]}
    message = error_of(http.post("/chat/completions", json=body), "messages")
    assert f"content part type '{part['type']}' is not supported" in message and "text-only" in message


def test_an_image_in_an_earlier_turn_is_refused_too(client):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]},
                {"role": "assistant", "content": "A lake."}, {"role": "user", "content": QUESTION}]
    with pytest.raises(openai.BadRequestError, match="image_url") as raised:
        client.chat.completions.create(model=MODEL, max_tokens=4, messages=messages)
    assert raised.value.param == "messages"


# ---- logit_bias ---------------------------------------------------------------------------------------------------


def test_a_bias_of_minus_100_on_the_greedy_first_token_changes_it(rag, client):
    reference = rag.ask(QUESTION, rag=False, max_tokens=STEPS)
    first = reference.token_ids[0]
    plain = client.completions.create(model=MODEL, prompt=QUESTION, max_tokens=STEPS, extra_body={"rag": False})
    assert plain.choices[0].text.strip() == reference.text  # the server's prompt is the reference's
    biased = rag.ask(QUESTION, rag=False, max_tokens=STEPS, logit_bias={first: -100})
    assert biased.token_ids[0] != first
    reply = client.completions.create(model=MODEL, prompt=QUESTION, max_tokens=STEPS, logit_bias={str(first): -100},
                                      extra_body={"rag": False})
    assert reply.choices[0].text.strip() == biased.text != reference.text
    answer = chat(client, logit_bias={str(first): -100}, extra_body={"rag": False}).choices[0].message.content
    assert answer != chat(client, extra_body={"rag": False}).choices[0].message.content


def test_a_bias_of_100_makes_the_token_every_token(rag, client):
    token = 4000  # any token but a stop token
    assert token not in rag.engine.prefiller.stop_ids
    answer = rag.ask(QUESTION, rag=False, max_tokens=5, logit_bias={token: 100})
    assert answer.token_ids == [token] * 5
    reply = client.completions.create(model=MODEL, prompt=QUESTION, max_tokens=5, logit_bias={str(token): 100},
                                      extra_body={"rag": False})
    assert reply.choices[0].text.strip() == answer.text and reply.usage.completion_tokens == 5


def test_logit_bias_the_model_cannot_serve_is_a_400(http, rag):
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": QUESTION}]}
    vocab = rag.runtime.model.cfg.vocab_size
    assert str(vocab - 1) in error_of(http.post("/chat/completions", json={**body, "logit_bias": {str(vocab): 5}}),
                                      "logit_bias")
    assert "'word'" in error_of(http.post("/chat/completions", json={**body, "logit_bias": {"word": 5}}),
                                "logit_bias")
    assert "[-100, 100]" in error_of(http.post("/completions", json={"model": MODEL, "prompt": QUESTION,
                                                                     "logit_bias": {"5": 101}}), "logit_bias")
    assert http.post("/chat/completions", json={**body, "logit_bias": {"5": -100}}).status_code == 200


# ---- presence and frequency penalties ----------------------------------------------------------------------------


def test_penalties_as_openai_defines_them_by_hand():
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    sampling = SamplingConfig(presence_penalty=0.5, frequency_penalty=0.25, logit_bias={"4": -10.0, 0: 2})
    got = adjusted(logits, sampling, [1, 1, 3, 1])
    # token 1 seen 3 times: 2 - 0.5 - 3 x 0.25; token 3 once: 4 - 0.5 - 0.25; 0 and 4 biased, 2 as it was
    assert got.tolist() == [3.0, 0.75, 3.0, 3.25, -5.0]
    assert logits.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]  # the model's logits (logprobs' `raw`) stay as they were
    assert choose(logits, sampling, None, [1, 1, 3, 1]) == 3  # greedy sees them: 4 was the argmax before
    assert adjusted(logits, SamplingConfig(), [1, 2]) is logits  # nothing asked: no copy
    negative = adjusted(logits, SamplingConfig(presence_penalty=-1.0, frequency_penalty=-2.0), [0, 0])
    assert negative.tolist() == [6.0, 2.0, 3.0, 4.0, 5.0]  # negative values encourage repetition


@pytest.mark.parametrize("options", [{"presence_penalty": 2.5}, {"frequency_penalty": -2.01},
                                     {"logit_bias": {7: 100.5}}, {"logit_bias": {"x": 1}}])
def test_sampling_refuses_values_out_of_range(options):
    with pytest.raises(KvragError):
        SamplingConfig(**options)


def repeats(tokens: list[int]) -> int:
    return len(tokens) - len(set(tokens))


def test_large_penalties_change_a_repetitive_greedy_answer(rag, client):
    plain = rag.ask(QUESTION, rag=False, max_tokens=32)
    assert repeats(plain.token_ids) > 0  # the tiny model repeats itself, greedy
    for penalty in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}):
        penalized = rag.ask(QUESTION, rag=False, max_tokens=32, **penalty)
        assert penalized.token_ids != plain.token_ids and repeats(penalized.token_ids) < repeats(plain.token_ids)
        reply = client.completions.create(model=MODEL, prompt=QUESTION, max_tokens=32, extra_body={"rag": False},
                                          **penalty)
        assert reply.choices[0].text.strip() == penalized.text


def test_penalties_out_of_range_are_400s_naming_them(http):
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": QUESTION}]}
    for name in ("presence_penalty", "frequency_penalty"):
        error_of(http.post("/chat/completions", json={**body, name: 2.5}), name)
        error_of(http.post("/chat/completions", json={**body, name: "high"}), name)
        assert http.post("/chat/completions", json={**body, name: -2}).status_code == 200


# ---- fields this server does not serve: 400s naming them -------------------------------------------------------


@pytest.mark.parametrize(("field", "value"), [("echo", True), ("suffix", " and so on."), ("best_of", 3)])
def test_legacy_completions_fields_that_change_the_answer_are_400s(client, field, value):
    with pytest.raises(openai.BadRequestError, match=field) as raised:
        client.completions.create(model=MODEL, prompt=QUESTION, max_tokens=2, **{field: value})
    assert raised.value.param == field


def test_legacy_completions_fields_that_change_nothing_are_served(client):
    plain = client.completions.create(model=MODEL, prompt=QUESTION, max_tokens=4)
    for fields in ({"echo": False}, {"suffix": ""}, {"best_of": 1}):
        assert client.completions.create(model=MODEL, prompt=QUESTION, max_tokens=4, **fields).choices[0].text == \
            plain.choices[0].text
    assert len(client.completions.create(model=MODEL, prompt=QUESTION, max_tokens=4, n=2, best_of=2).choices) == 2


@pytest.mark.parametrize(("field", "value"), [
    ("functions", [{"name": "depth", "parameters": {"type": "object", "properties": {}}}]),
    ("function_call", "auto"),
    ("function_call", {"name": "depth"}),
])
def test_deprecated_functions_are_400s_naming_tools(http, field, value):
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": QUESTION}], field: value}
    assert error_of(http.post("/chat/completions", json=body), field) == f"{field} is deprecated and not served: " \
        "send tools"


def test_unknown_fields_are_still_ignored(http):
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": QUESTION}], "user": "u-1",
            "metadata": {"k": "v"}}
    assert json.loads(http.post("/chat/completions", json=body).text)["choices"]
