"""Clients that retrieve for themselves and send the passages as prompt text, with the real clients unchanged (no
kvrag field in any request): a LangChain LCEL RAG chain over ChatOpenAI, LlamaIndex's default QA template through
OpenAILike, Open WebUI's RAG template over plain HTTP, and two tenants (API keys) behind one server. kvrag (with
`retrieval="auto"`, the default) finds the store's chunks inside those prompts and blends their stored KV
(store/passage_index.py, engine/prompt_reuse.py), adds no passages of its own (the prompt carries some), keeps a
client's new passages at their second sighting for that tenant alone (engine/kept_passages.py), and caches every prompt's
whole blocks for exact repeats per tenant (engine/conversations.py). Each test asserts counts
(`usage.prompt_tokens_details.cached_tokens`, `prompt_tokens`, /metrics), never the tiny random model's words; the
server's `ratio: auto` runs without its first-token time budget (see `rag`), so a blend recomputes r* = 15 % of the
rows and what is reused does not hang on how the random model's deviation spreads."""

from __future__ import annotations

import re
import shutil
import time

import httpx
import pytest

from kvrag.server.app import ServerSettings
from kvrag.server.run import BackgroundServer
from kvrag.tests.client_templates import open_webui_prompt

MODEL = "tiny-llama"
STEPS = 4
SHARE = 0.6  # of the passages' stored tokens, a reordered second sighting reports as cached at the least
QUESTION = "Which of these is the deepest, the highest or the lowest?"
# a passage no store holds: one line (a single paragraph, as the clients' templates put each passage), >= 60 tokens
NEW_PASSAGE = ("The lighthouse at Kelvar Point was lit for the first time in 1874 by Ingrid Halvorsen, who kept it "
               "for forty-one winters, logged every ship that passed the reef in a green ledger, and was succeeded by "
               "her nephew Tomas, who moved the lamp to the new granite tower in 1919 after the old one cracked.")
SYSTEM = ("You are a careful assistant for the harbour archive. Answer in one sentence, cite nothing, and say so when "
          "you do not know. ") * 3


@pytest.fixture(scope="module")
def rag(indexed_store, tiny_llama_dir, tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        # `ratio: auto` recomputes past r* (15 %) until the kept rows hold most of the prompt's deviation, as far as
        # a first token within TTFT_BUDGET_TOKENS allows: a tiny model on a CPU affords 100 %, and its random deviation is
        # spread out (about 60 % recomputed). With no budget auto keeps r*'s cost (as long prompts on a real
        # model do): 15 % recomputed, so what is reused is the spans found, not the model's noise.
        patch.setattr("kvrag.blend.ratio.TTFT_BUDGET_TOKENS", 0)
        yield from _opened(indexed_store, tiny_llama_dir, tmp_path_factory)


def _opened(indexed_store, tiny_llama_dir, tmp_path_factory):
    from kvrag import KVRag

    store = tmp_path_factory.mktemp("client-passages") / "store"
    shutil.copytree(indexed_store, store)
    with KVRag(store, model=str(tiny_llama_dir), dtype="float32", host_cache="0") as opened:
        assert opened.config.retrieval == "auto"
        yield opened


@pytest.fixture(scope="module")
def passages(rag) -> list[tuple[str, int]]:
    """The store's own chunk texts long enough to count as passages: (text, stored token count)."""
    from kvrag.store.chunks import ChunkTable

    chosen = [(r.text, len(r.token_ids)) for r in ChunkTable(rag.env).iter() if len(r.token_ids) >= 48]
    assert len(chosen) >= 3
    return chosen


@pytest.fixture(scope="module")
def server(rag):
    with BackgroundServer(rag, ServerSettings(MODEL)) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=300) as opened:
        yield opened


def stored_tokens(chosen: list[tuple[str, int]]) -> int:
    return sum(n for _, n in chosen)


def orders(chosen: list) -> tuple[list, list]:
    """Two orders of the same passages, the second the first reversed (no exact prefix of it past the template)."""
    return list(chosen), list(chosen[::-1])


def post_chat(http, messages: list[dict], key: str | None = None, **fields) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    reply = http.post("/v1/chat/completions", headers=headers,
                      json={"model": MODEL, "max_tokens": STEPS, "temperature": 0, "messages": messages, **fields})
    assert reply.status_code == 200, reply.text
    return reply.json()


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def written_back(http, timeout_s: float = 120) -> None:
    """Wait until the write-back worker has done every job given: the chunks a first sighting computed (this store
    has no KV for the tiny model) are stored on its thread after the answer, and only a stored chunk counts as
    cached at the next sighting (under load the second request can come first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        jobs = dict(re.findall(r'^kvrag_write_back_jobs_total\{state="(\w+)"\} (\S+)$', http.get("/metrics").text,
                               re.M))
        if jobs.get("given") == jobs.get("done"):
            return
        assert time.monotonic() < deadline, f"the write-back did not finish in {timeout_s} s: {jobs}"
        time.sleep(0.05)


def reused_counter(http) -> float:
    text = http.get("/metrics").text
    found = re.search(r'^kvrag_prompt_tokens_total\{kv="reused"\} (\S+)$', text, re.M)
    assert found, text
    return float(found.group(1))


# ---- LangChain: an LCEL RAG chain over ChatOpenAI ----------------------------------------------------------------


def test_langchain_lcel_rag_chain_reuses_the_stored_passages_it_sends(server, http, passages):
    """The chain LangChain's RAG tutorial builds: a retriever's documents joined into the system prompt's {context},
    then ChatOpenAI. langchain_community (FAISS and the other vector stores) is not installed here, so the retriever is
    a RunnableLambda that returns the chosen passages, in the order asked."""
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnableLambda, RunnablePassthrough
    from langchain_openai import ChatOpenAI

    prompt = ChatPromptTemplate.from_messages([("system", "Answer the question using only this context:\n\n{context}"),
                                               ("human", "{question}")])
    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=MODEL, max_tokens=STEPS, temperature=0,
                     max_retries=0)
    first, second = orders(passages)

    def chain_for(order):
        retriever = RunnableLambda(lambda _question: "\n\n".join(text for text, _ in order))
        return {"context": retriever, "question": RunnablePassthrough()} | prompt | llm

    answers = []
    for order in (first, second):
        answers.append(chain_for(order).invoke(QUESTION))
        written_back(http)
    usages = [a.response_metadata["token_usage"] for a in answers]
    for answer, usage in zip(answers, usages, strict=True):  # both of langchain_openai's readings of the usage
        assert answer.usage_metadata["input_token_details"]["cache_read"] == \
            usage["prompt_tokens_details"]["cached_tokens"]
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] >= SHARE * stored_tokens(passages)
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] <= usages[1]["prompt_tokens"]
    # no passages of the server's own: the prompt is the client's alone, as with retrieval turned off, and none cited
    messages = [{"role": "system" if m.type == "system" else "user", "content": m.content}
                for m in prompt.invoke({"context": "\n\n".join(t for t, _ in second), "question": QUESTION}).messages]
    plain = post_chat(http, messages, rag=False)
    auto = post_chat(http, messages)
    assert usages[1]["prompt_tokens"] == plain["usage"]["prompt_tokens"] == auto["usage"]["prompt_tokens"]
    assert auto["sources"] == []


# ---- LlamaIndex: its default QA template through OpenAILike -------------------------------------------------------


def test_llamaindex_default_qa_template_reuses_the_stored_passages_it_sends(server, http, passages):
    """LlamaIndex's VectorStoreIndex wants an embedding model, and no OpenAI-compatible embedding class
    (llama_index.embeddings.openai / openai_like) is installed here: the query engine's last step is done by hand,
    its DEFAULT_TEXT_QA_PROMPT filled with the nodes' text joined by blank lines, sent as a user message."""
    from llama_index.core.llms import ChatMessage
    from llama_index.core.prompts.default_prompts import DEFAULT_TEXT_QA_PROMPT
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(api_base=server.url + "/v1", api_key="unused", model=MODEL, is_chat_model=True,
                     max_tokens=STEPS, temperature=0, max_retries=0)
    chosen = passages[::-1]  # another order than the LangChain test's (a fresh prompt)
    runs = []
    for order in orders(chosen):
        text = DEFAULT_TEXT_QA_PROMPT.format(context_str="\n\n".join(t for t, _ in order), query_str=QUESTION)
        runs.append(llm.chat([ChatMessage(role="user", content=text)]))
        written_back(http)
    usages = [_usage(run.raw) for run in runs]
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] >= SHARE * stored_tokens(chosen)
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] <= usages[1]["prompt_tokens"]
    plain = post_chat(http, [{"role": "user", "content": text}], rag=False)
    assert usages[1]["prompt_tokens"] == plain["usage"]["prompt_tokens"]  # no passages of the server's own


def _usage(raw) -> dict:
    """The usage of OpenAILike's raw response (the openai client's ChatCompletion, or a dict of it)."""
    usage = raw["usage"] if isinstance(raw, dict) else raw.usage
    return usage if isinstance(usage, dict) else usage.model_dump()


# ---- Open WebUI: its RAG template in the user message --------------------------------------------------------------


def test_open_webui_rag_template_reuses_the_stored_passages_and_metrics_count_them(http, passages):
    chosen = passages[1:] + passages[:1]
    replies = []
    for order in orders(chosen):
        before = reused_counter(http)
        replies.append(post_chat(http, [{"role": "user", "content": open_webui_prompt([t for t, _ in order],
                                                                                      QUESTION)}]))
        assert reused_counter(http) - before == cached(replies[-1])  # the counter grows by what usage reports
        written_back(http)
    assert cached(replies[1]) >= SHARE * stored_tokens(chosen)
    assert all(reply["sources"] == [] for reply in replies)  # nothing retrieved: the prompt carries its passages


# ---- tenants: per-API-key salts ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(rag):
    """The same KVRag behind a second server that wants one of two API keys."""
    with BackgroundServer(rag, ServerSettings(MODEL, api_key="key-a,key-b")) as running, \
            httpx.Client(base_url=running.url, timeout=300) as opened:
        yield opened


def test_a_new_passage_is_kept_for_the_key_that_sent_it_twice_alone(rag, keyed, passages):
    new_tokens = len(rag.runtime.tokenizer(NEW_PASSAGE, add_special_tokens=False)["input_ids"])
    assert new_tokens >= 60
    assert NEW_PASSAGE not in {text for text, _ in passages}
    stored = passages[0][0]

    def ask(key: str, texts: list[str], system: str | None = None) -> dict:
        messages = [{"role": "user", "content": open_webui_prompt(texts, "Who lit the lighthouse?")}]
        return post_chat(keyed, [{"role": "system", "content": system}, *messages] if system else messages, key=key)

    first = ask("key-a", [NEW_PASSAGE, stored])  # its first sighting: computed, counted
    again = ask("key-a", [NEW_PASSAGE, stored])  # an exact prefix hit: the cache serves it, not counted again
    assert cached(again) >= again["usage"]["prompt_tokens"] - 16
    admitted = rag.engine.keeper.stats.admitted
    ask("key-a", [NEW_PASSAGE, stored], system="Answer briefly.")  # another app's prompt computes it again: kept
    rag.engine.writes.drain()  # stored beside the engine, off its thread
    assert rag.engine.keeper.stats.admitted == admitted + 1
    kept = ask("key-a", [stored, NEW_PASSAGE])  # a new order: the kept passage's rows reused
    # key-b sends the same: its first sighting (key-a's prefix blocks not shared), then the new order, which reads its
    # own cached template head as key-a's does, and the stored chunk, but not the passage key-a had kept
    b_first = ask("key-b", [NEW_PASSAGE, stored])
    assert cached(b_first) == cached(first)
    other = ask("key-b", [stored, NEW_PASSAGE])
    assert kept["usage"]["prompt_tokens"] == other["usage"]["prompt_tokens"]
    assert cached(kept) - cached(other) >= SHARE * new_tokens


def test_a_repeated_system_prompt_is_cached_per_key(rag, keyed):
    system_tokens = len(rag.runtime.tokenizer(SYSTEM, add_special_tokens=False)["input_ids"])

    def ask(key: str, question: str) -> dict:
        return post_chat(keyed, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                         key=key)

    first = ask("key-a", "Who kept the light?")
    second = ask("key-a", "When was it built?")
    assert first["sources"] == second["sources"] == []  # the system prompt is a passage: nothing retrieved
    assert cached(second) >= system_tokens - 32
    other = ask("key-b", "When was it built?")
    assert cached(other) <= 16  # key-b's first sight of it: nothing of key-a's shared


def test_stored_chunks_computed_now_are_not_reported_cached(store_copy, tiny_llama_dir, passages):
    """A store that is indexed but not precomputed (as `kvrag index` leaves it): the chunks a client's prompt carries
    have no KV yet, so the first prompt computes them all; nothing of it was cached."""
    from kvrag import KVRag
    from kvrag.store.kv import LocalKVTable

    with KVRag(store_copy, model=str(tiny_llama_dir), dtype="float32", host_cache="0") as fresh, \
            BackgroundServer(fresh, ServerSettings(MODEL)) as running, \
            httpx.Client(base_url=running.url, timeout=300) as client:
        from kvrag.store.chunks import ChunkTable

        ids = [r.chunk_id for r in ChunkTable(fresh.env).iter() if r.text in {t for t, _ in passages}]
        table = LocalKVTable(fresh.env, fresh.runtime.fingerprint, "fp16")
        if set(table.missing(ids)) != set(ids):
            pytest.skip("the indexed store holds these chunks' KV already")  # not this test's case
        body = post_chat(client, [{"role": "user", "content": open_webui_prompt([t for t, _ in passages], QUESTION)}])
        assert cached(body) <= 16  # at most a whole block of a cached head: none on a fresh server
