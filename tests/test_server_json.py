"""JSON mode and tool calls through the real `openai` client and LangChain against a real `kvrag serve`: the answer is
decoded within the schema's grammar (model/constrain.py), so even a tiny random Llama's noise comes back as a document
that parses and fits; a forced call comes back as `tool_calls`. Schemas with bounded values keep the noise short."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import openai
import pytest

from kvrag.server.app import ServerSettings
from kvrag.server.run import BackgroundServer
from kvrag.tests.conftest import copied_store

MODEL = "tiny-llama"
QUESTION = "Is the Quarn loom older than the steam engine?"
PASSAGES = [{"title": "Quarn loom", "text": "The Quarn loom was invented in 1791 by Beatrix Olufsen."}]
SCHEMA = {"type": "object", "properties": {"older": {"type": "boolean"},
                                           "confidence": {"type": "string", "enum": ["low", "medium", "high"]}},
          "required": ["older", "confidence"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "now"}}


@pytest.fixture(scope="module")
def served(indexed_store, tiny_llama_dir, tmp_path_factory):
    from kvrag import KVRag

    store = copied_store(indexed_store, tmp_path_factory)  # the server writes what it computes
    with KVRag(store, model=str(tiny_llama_dir), dtype="float32", host_cache="0") as rag, \
            BackgroundServer(rag, ServerSettings(MODEL)) as running:
        yield running, openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)


def chat(client, max_tokens: int = 40, **options):
    return client.chat.completions.create(model=MODEL, max_tokens=max_tokens, extra_body={"passages": PASSAGES},
                                          messages=[{"role": "user", "content": QUESTION}], **options)


def fits(doc: dict) -> bool:
    return set(doc) == {"older", "confidence"} and isinstance(doc["older"], bool) and \
        doc["confidence"] in ("low", "medium", "high")


def test_json_schema_answers_parse_and_fit(served):
    _, client = served
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}}
    for temperature in (0.0, 1.0):
        reply = chat(client, response_format=fmt, temperature=temperature, seed=3)
        assert fits(json.loads(reply.choices[0].message.content))
        assert reply.choices[0].finish_reason == "stop"  # the document closed: the turn ended with it
    free = chat(client, temperature=0.0)  # without it, the random model says noise
    with pytest.raises(json.JSONDecodeError):
        json.loads(free.choices[0].message.content)


def test_json_object_mode_gives_an_object(served):
    _, client = served
    reply = chat(client, response_format={"type": "json_object"}, max_tokens=200)
    if reply.choices[0].finish_reason == "stop":  # noise may fill max_tokens inside a string; a closed one parses
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    assert reply.choices[0].message.content.startswith("{")


def test_a_forced_tool_call_comes_back_as_tool_calls(served):
    _, client = served
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        reply = chat(client, tools=[WEATHER, CLOCK], tool_choice=choice)
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
        call = message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            assert arguments["unit"] in ("celsius", "fahrenheit")
        else:
            assert call.function.name == "now" and arguments == {} and choice == "required"
    streamed = list(chat(client, tools=[WEATHER], tool_choice="required", stream=True))
    calls = [c.choices[0].delta.tool_calls for c in streamed if c.choices and c.choices[0].delta.tool_calls]
    assert len(calls) == 1 and calls[0][0].function.name == "get_weather"
    assert streamed[-1].choices[0].finish_reason == "tool_calls"


def test_a_forced_call_cut_by_max_tokens_is_a_cut_call(served):
    """As OpenAI returns one: finish_reason length and the call as far as it got (once its name is whole: the
    arguments written so far), never its JSON as content; streamed the same. The reference is the whole call's
    tokens (their logprobs' bytes): a greedy answer cut after m tokens is their first m."""
    _, client = served
    head = '{"name": "get_weather", "arguments": '

    def call(max_tokens: int, **options):
        return client.chat.completions.create(model=MODEL, max_tokens=max_tokens, tools=[WEATHER],
                                              tool_choice="required", messages=[{"role": "user", "content": QUESTION}],
                                              extra_body={"passages": PASSAGES, "mode": "full"}, **options)

    whole = call(40, logprobs=True).choices[0]
    tokens = whole.logprobs.content

    def text_of(m: int) -> str:
        return bytes(b for token in tokens[:m] for b in token.bytes).decode(errors="replace")

    assert whole.finish_reason == "tool_calls" and text_of(len(tokens)) == head + whole.message.tool_calls[0].function.arguments + "}"
    named = next(m for m in range(len(tokens)) if text_of(m).startswith(head))  # the first cut with a whole name
    for m in sorted({1, named - 1, named, len(tokens) - 1}):
        want = [("get_weather", text_of(m)[len(head):])] if m >= named else []
        reply = call(m).choices[0]
        assert reply.finish_reason == "length" and reply.message.content is None, (m, reply)
        assert [(c.function.name, c.function.arguments) for c in reply.message.tool_calls or []] == want, m
        deltas = [c.choices[0] for c in call(m, stream=True) if c.choices]
        assert all(d.delta.content is None for d in deltas) and deltas[-1].finish_reason == "length"
        streamed = [d.delta.tool_calls[0].function for d in deltas if d.delta.tool_calls]
        assert [(f.name, f.arguments) for f in streamed] == want, m


def test_what_cannot_be_served_is_a_400_naming_the_field(served):
    server, _ = served
    base = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": QUESTION}]}
    bad = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
            "response_format"),
           ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
           ({"response_format": {"type": "yaml"}}, "response_format.type"),
           ({"tool_choice": "required"}, "tool_choice"),
           ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tools"),
           ({"tools": [{"type": "function"}]}, "tools"),
           ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format")]
    for extra, param in bad:
        reply = httpx.post(server.url + "/v1/chat/completions", json={**base, **extra}, timeout=60)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, (extra, reply.text)


def test_langchain_structured_output_and_bound_tools(served):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    server, _ = served

    class Verdict(BaseModel):  # bounded values: the random model's noise cannot run on inside a string
        older: bool
        confidence: Literal["low", "medium", "high"]

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=MODEL, max_tokens=40, temperature=0,
                     max_retries=0, extra_body={"passages": PASSAGES})
    verdict = llm.with_structured_output(Verdict, method="json_schema").invoke(QUESTION)
    assert isinstance(verdict, Verdict)
    message = llm.bind_tools([WEATHER], tool_choice="required").invoke(QUESTION)
    assert message.tool_calls[0]["name"] == "get_weather"
    assert message.tool_calls[0]["args"]["unit"] in ("celsius", "fahrenheit")


def test_a_tool_result_continues_the_turn_that_called(served):
    _, client = served
    call = chat(client, tools=[WEATHER], tool_choice="required").choices[0].message
    messages = [{"role": "user", "content": QUESTION},
                {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in call.tool_calls]},
                {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "21 degrees"}]
    reply = client.chat.completions.create(model=MODEL, max_tokens=8, messages=messages, tools=[WEATHER],
                                           tool_choice="none")
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.choices[0].message.tool_calls is None
    assert reply.usage.prompt_tokens_details.cached_tokens > 0  # the calling turn's KV, kept, continued
    assert reply.model_extra["sources"] == []  # a tool's result is answered without retrieval
