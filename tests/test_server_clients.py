"""The chat clients people use, against a real `kvrag serve`: LangChain's ChatOpenAI, LlamaIndex's OpenAILike, and the
requests Open WebUI sends (models list, streamed chat with history, a title-generation request). The reference for
every answer is KVRag.ask with the same conversation on the same engine (the Python API, no HTTP); a tiny random
Llama with SmolLM2's tokenizer says noise, but the same noise both ways."""

from __future__ import annotations

import json

import httpx
import pytest

from kvrag.server.app import ServerSettings
from kvrag.server.run import BackgroundServer
from kvrag.tests.conftest import copied_store

MODEL = "tiny-llama"
PASSAGES = [("Quarn loom", "The Quarn loom was invented in 1791 by Beatrix Olufsen, a weaver from Trondheim."),
            ("Tides", "Tides rise twice a day.")]
EXTRA = {"passages": [{"title": t, "text": x} for t, x in PASSAGES]}
SYSTEM = "You answer from the documents."
# an earlier exchange this server never gave (so no kept turn continues it): rendered from its text
EARLIER = [("user", "What is the Quarn loom?"), ("assistant", "A loom from Trondheim.")]
QUESTION = "Who invented it?"
STEPS = 6


@pytest.fixture(scope="module")
def served(indexed_store, tiny_llama_dir, tmp_path_factory):
    from kvrag import KVRag

    store = copied_store(indexed_store, tmp_path_factory)  # the server writes what it computes
    with KVRag(store, model=str(tiny_llama_dir), dtype="float32", host_cache="0") as rag, \
            BackgroundServer(rag, ServerSettings(MODEL)) as running:
        rag.ask(QUESTION, passages=PASSAGES, max_tokens=1)  # the passages' KV stored: every request reads it
        yield rag, running


def reference(rag, history=(("system", SYSTEM), *EARLIER)) -> str:
    return rag.ask(QUESTION, passages=PASSAGES, history=list(history), max_tokens=STEPS).text


def test_langchain_chat_openai_sends_history_and_system_prompt_and_streams(served):
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI

    rag, server = served
    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=MODEL, max_tokens=STEPS, temperature=0,
                     max_retries=0, extra_body=EXTRA)
    messages = [SystemMessage(SYSTEM), HumanMessage(EARLIER[0][1]), AIMessage(EARLIER[1][1]), HumanMessage(QUESTION)]
    want = reference(rag)
    assert llm.invoke(messages).content == want
    assert "".join(chunk.content for chunk in llm.stream(messages)).strip() == want


def test_llamaindex_openai_like_sends_history_and_system_prompt_and_streams(served):
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    rag, server = served
    llm = OpenAILike(api_base=server.url + "/v1", api_key="unused", model=MODEL, is_chat_model=True,
                     max_tokens=STEPS, temperature=0, max_retries=0, additional_kwargs={"extra_body": EXTRA})
    messages = [ChatMessage(role="system", content=SYSTEM), *(ChatMessage(role=r, content=t) for r, t in EARLIER),
                ChatMessage(role="user", content=QUESTION)]
    want = reference(rag)
    assert llm.chat(messages).message.content == want
    assert "".join(part.delta or "" for part in llm.stream_chat(messages)).strip() == want


def test_an_open_webui_sequence(served):
    """What Open WebUI sends for a new chat: the models list, the chat streamed with its history, then a title
    request (a plain user message asking for a short title, not streamed)."""
    rag, server = served
    with httpx.Client(base_url=server.url, timeout=120) as http:
        models = http.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        history = [{"role": r, "content": t} for r, t in EARLIER]
        body = {"model": MODEL, "stream": True, "max_tokens": STEPS, **EXTRA,
                "messages": [*history, {"role": "user", "content": QUESTION}]}
        text = ""
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for choice in json.loads(line[6:])["choices"]:
                        text += choice["delta"].get("content") or ""
        assert text.strip() == reference(rag, EARLIER)
        title = {"model": MODEL, "stream": False, "max_tokens": STEPS, "rag": False, "messages": [
            {"role": "user", "content": "Create a concise, 3-5 word title with an emoji summarizing the chat history."
                                        f"\n<chat_history>\nUSER: {QUESTION}\nASSISTANT: {text}\n</chat_history>"}]}
        reply = http.post("/v1/chat/completions", json=title)
        assert reply.status_code == 200, reply.text
        assert reply.json()["sources"] == [] and reply.json()["choices"][0]["message"]["content"]
