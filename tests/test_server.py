"""`kvrag serve` over real HTTP: a real uvicorn server on 127.0.0.1 and a free port, the real `openai` client (sync
and streaming) and httpx for raw and bad requests. The reference for every answer is KVRag.ask on the same engine
(the Python API, no HTTP), its memory tiers warm for the prompt. A tiny random Llama with SmolLM2's tokenizer keeps it fast; what it says is noise, but
the same noise both ways."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvrag.server.app import ServerSettings
from kvrag.server.run import BackgroundServer

MODEL = "tiny-llama"
QUESTION = "How deep is Lake Baikal?"
LONG = 3000  # tokens: a generation still running when the test acts on it


@pytest.fixture(scope="module")
def rag(indexed_store, tiny_llama_dir, tmp_path_factory):
    """The server's KVRag with its memory tiers on, as users run it, over a store whose chunks' KV it has stored (a
    first ask computes and writes back what the store lacks). A reference answer is taken with the tiers warm for
    its prompt (`warm`), as the server's request then finds them."""
    import shutil

    from kvrag import KVRag

    store = tmp_path_factory.mktemp("server") / "store"
    shutil.copytree(indexed_store, store)
    with KVRag(store, model=str(tiny_llama_dir), host_cache="64MiB") as opened:
        every = [s["chunk_id"] for s in opened.retrieve(QUESTION, k=100, relative_cutoff=0)]
        opened.ask(QUESTION, chunk_ids=every, max_tokens=1)
        yield opened


@pytest.fixture(scope="module")
def server(rag):
    with BackgroundServer(rag, ServerSettings(MODEL)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def wait_for(condition, what: str, timeout: float = 30.0) -> None:
    """Poll until `condition()` holds (a wait, not a timing claim: the timeout only ends a hung test)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"still not: {what}"
        time.sleep(0.02)


def warm(rag, question: str, **options):
    """KVRag.ask's answer once the memory tiers hold this prompt's chunks (asked twice: the first fills them), so
    the server's request, asked next, meets the same tiers."""
    rag.ask(question, **options)
    answer = rag.ask(question, **options)
    assert rag.engine.prefiller.source.cache is not None
    return answer


def idle(rag) -> bool:
    return rag.loop.waiting() == 0 and rag.loop.running() == 0 and rag.engine.sequence_blocks == 0


# ---- answers: the same as the Python API's -------------------------------------------------------------------


def test_chat_answers_as_kvrag_ask_does(rag, client):
    reference = warm(rag, QUESTION, k=2, max_tokens=24)
    reply = client.chat.completions.create(model=MODEL, max_tokens=24, extra_body={"k": 2},
                                           messages=[{"role": "user", "content": QUESTION}])
    assert reply.choices[0].message.content == reference.text
    assert reply.choices[0].finish_reason == reference.finish_reason
    assert [s["chunk_id"] for s in reply.model_extra["sources"]] == [s["chunk_id"] for s in reference.sources]
    usage = reply.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (reference.prompt_tokens, len(reference.token_ids))
    # reused KV: the stored preamble and every chunk token the blend did not recompute (chunks computed now: none
    # were stored, so the first ask wrote them back)
    preamble = len(rag.runtime.prompts.preamble_ids)
    expected = preamble + reference.chunk_tokens - reference.recomputed_chunk_tokens
    assert usage.prompt_tokens_details.cached_tokens == expected
    assert 0 < expected < usage.prompt_tokens


def test_a_stream_says_what_the_whole_answer_says(rag, client):
    reference = warm(rag, QUESTION, max_tokens=40, mode="reuse")
    chunks = list(client.chat.completions.create(model=MODEL, max_tokens=40, stream=True, extra_body={"mode": "reuse"},
                                                 stream_options={"include_usage": True},
                                                 messages=[{"role": "user", "content": QUESTION}]))
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([p for p in pieces if p]) > 1  # it came in pieces
    assert "".join(pieces).strip() == reference.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [s["chunk_id"] for s in chunks[0].model_extra["sources"]] == [s["chunk_id"] for s in reference.sources]
    assert chunks[-2].choices[0].finish_reason == reference.finish_reason
    assert chunks[-1].usage.completion_tokens == len(reference.token_ids)
    # full reuse: every prompt token but the question's suffix comes from the store
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == preamble_and_chunks(rag, reference)


def test_requests_at_once_each_get_their_own_answer(rag, server):
    """Through the async client, as a load test sends them: decoded side by side in one engine, each answer is
    the one the Python API gives alone."""
    import asyncio

    questions = ["How deep is Lake Baikal?", "Which river is the longest?", "What is the lowest land?",
                 "How high is Everest?"]
    alone = [warm(rag, q, max_tokens=12, mode="reuse").text for q in questions]

    async def ask_all() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
            async def one(q: str) -> str:
                stream = await client.chat.completions.create(model=MODEL, max_tokens=12, stream=True,
                                                              extra_body={"mode": "reuse"},
                                                              messages=[{"role": "user", "content": q}])
                return "".join([c.choices[0].delta.content or "" async for c in stream]).strip()
            return await asyncio.gather(*(one(q) for q in questions))

    assert asyncio.run(ask_all()) == alone
    assert idle(rag)


def preamble_and_chunks(rag, answer) -> int:
    return len(rag.runtime.prompts.preamble_ids) + answer.chunk_tokens


def test_completions_with_own_passages_and_chunk_ids(rag, client):
    passages = [("Quarn loom", "The Quarn loom was invented in 1791 by Beatrix Olufsen, a weaver from Trondheim."),
                ("Tides", "Tides rise twice a day.")]
    reference = warm(rag, "Who invented the Quarn loom?", passages=passages, max_tokens=16)
    reply = client.completions.create(model=MODEL, prompt="Who invented the Quarn loom?", max_tokens=16,
                                      extra_body={"passages": [{"title": t, "text": x} for t, x in passages]})
    assert reply.choices[0].text == reference.text
    assert [s["title"] for s in reply.model_extra["sources"]] == ["Quarn loom", "Tides"]

    chosen = [s["chunk_id"] for s in rag.retrieve("Everest", k=2)][::-1]
    reference = warm(rag, "Everest?", chunk_ids=chosen, max_tokens=8, ratio=0.3, mode="full")
    reply = client.completions.create(model=MODEL, prompt=["Everest?"], max_tokens=8,
                                      extra_body={"chunk_ids": chosen, "ratio": 0.3, "mode": "full"})
    assert reply.choices[0].text == reference.text
    assert [s["chunk_id"] for s in reply.model_extra["sources"]] == chosen
    assert reply.usage.prompt_tokens_details.cached_tokens == 0  # a full prefill reuses nothing


def test_a_stop_string_cuts_the_answer_there(rag, client):
    whole = rag.ask(QUESTION, max_tokens=40, mode="reuse").text
    stop = whole[len(whole) // 2:len(whole) // 2 + 3]
    expected = whole[:whole.find(stop)].strip()
    for stream in (False, True):
        reply = client.chat.completions.create(model=MODEL, max_tokens=40, stop=[stop, "never-said"], stream=stream,
                                               extra_body={"mode": "reuse"},
                                               messages=[{"role": "user", "content": QUESTION}])
        if stream:
            chunks = list(reply)
            text, reason = "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, reason = reply.choices[0].message.content, reply.choices[0].finish_reason
        assert (text.strip(), reason) == (expected, "stop")
    wait_for(lambda: idle(rag), "the stopped sequences' blocks back in the pool")


# ---- refusals: OpenAI's error shape ---------------------------------------------------------------------------


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_bad_requests_are_400s_in_openai_shape(server, rag):
    chat = server.url + "/v1/chat/completions"
    good = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4}
    with httpx.Client(timeout=60) as http:
        err = error_of(http.post(chat, content=b'{"model": "tiny', headers={"content-type": "application/json"}), 400)
        assert "JSON" in err["message"]
        err = error_of(http.post(chat, json={**good, "temperature": "hot"}), 400)
        assert err["param"] == "temperature"
        err = error_of(http.post(chat, json={**good, "messages": [{"role": "user", "content": 7}]}), 400)
        assert err["param"] == "messages.0.content"
        err = error_of(http.post(chat, json={**good, "passages": [{"title": 3, "text": "x"}]}), 400)
        assert err["param"] == "passages.0.title"
        assert error_of(http.post(chat, json={**good, "n": 17}), 400)["param"] == "n"
        assert error_of(http.post(chat, json=[good]), 400)["message"] == "the body must be a JSON object"
        assert error_of(http.post(chat, json={**good, "chunk_ids": ["no-such-chunk"]}), 400)
        err = error_of(http.post(chat, json={**good, "model": "gpt-4o"}), 404)
        assert err["code"] == "model_not_found" and MODEL in err["message"]
        long = {**good, "passages": ["word " * 5000], "max_tokens": 100}
        err = error_of(http.post(chat, json=long), 400)
        context = rag.runtime.model.cfg.max_positions
        assert err["code"] == "context_length_exceeded" and str(context) in err["message"] and "100" in err["message"]
        assert http.post(chat, json={**good, "unknown_field": {"any": "thing"}}).status_code == 200  # ignored
    assert idle(rag)


def test_the_openai_client_raises_its_own_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": QUESTION}])
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=MODEL, prompt=QUESTION, max_tokens=100000)
    assert [m.id for m in client.models.list()] == [MODEL]


def test_an_api_key_is_required_when_set(rag):
    with BackgroundServer(rag, ServerSettings(MODEL, api_key="sesame")) as keyed, httpx.Client(timeout=60) as http:
        models = keyed.url + "/v1/models"
        assert error_of(http.get(models), 401)["code"] == "invalid_api_key"
        assert error_of(http.get(models, headers={"Authorization": "Bearer open"}), 401)["code"] == "invalid_api_key"
        assert http.get(models, headers={"Authorization": "Bearer sesame"}).status_code == 200
        assert http.get(keyed.url + "/health").status_code == 200  # liveness needs no key
        wrong = openai.OpenAI(base_url=keyed.url + "/v1", api_key="open", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()


def test_timings_account_for_the_answer(rag, client):
    """The `timings` extra field: retrieval, queue, the engine's TTFT and decode, which the client's wall time holds."""
    messages = [{"role": "user", "content": QUESTION}]
    start = time.perf_counter()
    reply = client.chat.completions.create(model=MODEL, max_tokens=8, messages=messages)
    wall = time.perf_counter() - start
    timings = reply.model_extra["timings"]
    assert set(timings) == {"retrieve", "queued", "ttft", "decode"} and min(timings.values()) >= 0
    assert timings["queued"] <= timings["ttft"] and timings["retrieve"] + timings["ttft"] + timings["decode"] <= wall
    chunks = list(client.chat.completions.create(model=MODEL, max_tokens=8, messages=messages, stream=True))
    last = chunks[-1]
    assert last.choices[0].finish_reason is not None and set(last.model_extra["timings"]) == set(timings)


# ---- load and faults --------------------------------------------------------------------------------------------


def open_stream(http: httpx.Client, url: str, **body):
    """A streaming chat request, opened and read up to its first content chunk: (response context, lines)."""
    request = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": QUESTION}], **body}
    context = http.stream("POST", url + "/v1/chat/completions", json=request)
    response = context.__enter__()
    assert response.status_code == 200
    lines = response.iter_lines()
    assert next(line for line in lines if line.startswith("data: ")).startswith("data: {")
    return context, lines


def test_a_client_that_goes_away_gives_its_blocks_back(rag, server):
    kv = rag.engine.kv
    with httpx.Client(timeout=60) as http:
        context, _ = open_stream(http, server.url, max_tokens=LONG)
        # the first token comes before the sequence enters the pool: wait for it to be decoding there
        wait_for(lambda: rag.loop.running() == 1 and rag.engine.sequence_blocks > 0, "the sequence decoding")
        context.__exit__(None, None, None)  # the client hangs up mid-stream
    wait_for(lambda: idle(rag), "the cancelled sequence's blocks back in the pool")
    # free again, or cached with no sequence holding it (evictable: the prefix cache keeps a prompt's blocks)
    assert kv.num_free == kv.pool.num_blocks - len(kv.shared) and rag.engine.sequence_blocks == 0
    assert metric(server, "kvrag_requests_total", endpoint="chat", outcome="disconnected") == 1


def test_a_client_that_goes_away_before_a_whole_answer_gives_its_blocks_back(rag, server):
    """Not streamed: the handler notices the closed connection while it waits, and the sequence is cancelled."""
    kv = rag.engine.kv
    before = metric(server, "kvrag_requests_total", 0, endpoint="completions", outcome="disconnected")
    body = json.dumps({"model": MODEL, "prompt": QUESTION, "max_tokens": LONG}).encode()
    host, port = httpx.URL(server.url).host, httpx.URL(server.url).port
    with socket.create_connection((host, port), timeout=60) as raw:  # a plain socket: closing it is hanging up
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(body), body))
        wait_for(lambda: rag.loop.running() == 1 and rag.engine.sequence_blocks > 0, "the sequence decoding")
    wait_for(lambda: idle(rag), "the cancelled sequence's blocks back in the pool")
    # free again, or cached with no sequence holding it (evictable: the prefix cache keeps a prompt's blocks)
    assert kv.num_free == kv.pool.num_blocks - len(kv.shared) and rag.engine.sequence_blocks == 0
    assert metric(server, "kvrag_requests_total", endpoint="completions", outcome="disconnected") == before + 1


def test_a_full_queue_is_a_429_with_retry_after(store_copy, tiny_llama_dir):
    from kvrag import KVRag

    def second() -> None:
        httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": QUESTION, "max_tokens": 2},
                   timeout=60)

    with KVRag(store_copy, model=str(tiny_llama_dir), host_cache="0", max_running=1, max_waiting=1) as tight, \
            BackgroundServer(tight, ServerSettings(MODEL)) as srv, httpx.Client(timeout=60) as http:
        running, _ = open_stream(http, srv.url, max_tokens=LONG)  # takes the one running place
        waiting = threading.Thread(target=second)
        waiting.start()
        wait_for(lambda: tight.loop.waiting() == 1, "the second request waiting")
        refused = http.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": QUESTION})
        assert error_of(refused, 429)["code"] == "queue_full"
        assert int(refused.headers["Retry-After"]) >= 1
        running.__exit__(None, None, None)  # the first goes away: the waiting one runs
        waiting.join(60)
        wait_for(lambda: idle(tight), "every request done")


def test_a_damaged_stored_value_is_recomputed_and_the_request_succeeds(store_copy, tiny_llama_dir):
    from kvrag import KVRag
    from kvrag.store.codec import HEADER_SIZE
    from kvrag.store.kv import LocalKVTable
    from kvrag.store.maintenance import verify

    with KVRag(store_copy, model=str(tiny_llama_dir), host_cache="0") as rag, \
            BackgroundServer(rag, ServerSettings(MODEL)) as srv, httpx.Client(timeout=60) as http:
        chunk = rag.retrieve("Everest", k=1)[0]["chunk_id"]
        body = {"model": MODEL, "prompt": "Everest?", "max_tokens": 12, "chunk_ids": [chunk]}
        first = http.post(srv.url + "/v1/completions", json=body).json()  # stores the chunk's KV if missing
        table = LocalKVTable(rag.env, rag.runtime.fingerprint, "fp16")
        key = table.key(chunk).layer(2).to_bytes()
        stored = lambda: rag.env.read(lambda txn: txn.get(key, db=rag.env.db("kv")))  # noqa: E731
        wait_for(lambda: stored() is not None, "the chunk's KV written back")  # the write-back runs behind the answer
        value = bytearray(stored())
        value[HEADER_SIZE + 10] ^= 0x40
        rag.env.write(lambda txn: txn.put(key, bytes(value), db=rag.env.db("kv")))
        assert not verify(rag.env).ok

        again = http.post(srv.url + "/v1/completions", json=body)
        assert again.status_code == 200, again.text
        assert again.json()["sources"][0]["tier"] == "computed"  # never the damaged value
        assert again.json()["choices"][0]["text"] == first["choices"][0]["text"]
        assert verify(rag.env).ok  # and the store was repaired


# ---- metrics ----------------------------------------------------------------------------------------------------


def metric(server, name: str, default: float | None = None, **labels) -> float:
    """A sample's value from /metrics; `default` when it is not there (a labelled counter before its first count)."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    assert default is not None, f"{name} {labels} not in /metrics"
    return default


def test_metrics_count_what_the_requests_did(rag, server, client):
    before = {kv: metric(server, "kvrag_prompt_tokens_total", 0, kv=kv) for kv in ("reused", "computed")}
    requests = metric(server, "kvrag_requests_total", 0, endpoint="chat", outcome="length")
    reply = client.chat.completions.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": QUESTION}])
    assert reply.choices[0].finish_reason == "length"
    cached = reply.usage.prompt_tokens_details.cached_tokens
    assert metric(server, "kvrag_prompt_tokens_total", kv="reused") - before["reused"] == cached
    assert metric(server, "kvrag_prompt_tokens_total", kv="computed") - before["computed"] == \
        reply.usage.prompt_tokens - cached
    assert metric(server, "kvrag_requests_total", endpoint="chat", outcome="length") == requests + 1
    assert metric(server, "kvrag_time_to_first_token_seconds_count") >= 1
    assert metric(server, "kvrag_queue_length") == 0 and metric(server, "kvrag_running_sequences") == 0
    assert metric(server, "kvrag_kv_pool_free_blocks") == rag.engine.kv.pool.num_blocks - len(rag.engine.kv.shared)
    stats = rag.engine.prefiller.source.cache.stats  # the tiers' own count, which /metrics exports
    assert metric(server, "kvrag_tier_hit_rate", kind="memory") == pytest.approx(stats.memory_hit_rate)
    assert metric(server, "kvrag_tier_hit_rate", kind="prefix") == pytest.approx(stats.prefix_hit_rate)
    assert stats.prefix_hit_rate > 0  # the warm references' prompts were asked again
    health = httpx.get(server.url + "/health", timeout=30).json()
    # the model's verdict: the suite skips the check, so blends run the default rule from r*
    assert health == {"status": "ok", "model": MODEL, "waiting": 0, "running": 0, "blend": rag.verdict}
    assert (rag.verdict["mode"], rag.verdict["rule"], rag.verdict["ratio"]) == ("blend", "chunks", 0.15)


def test_usage_says_what_produced_the_answer(rag, client):
    """usage.kvrag: the mode that ran, the share of chunk rows recomputed and the rule; a full prefill has neither."""
    asked = {"passages": [{"title": "Skerry Point", "text": "The last keeper of Skerry Point was Margaret Ross."},
                          {"title": "Ross", "text": "Margaret Ross kept the lamp for thirty years and kept goats."}]}
    runs = {mode: client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
        {"role": "user", "content": QUESTION}], extra_body={**asked, "mode": mode}).usage.model_extra["kvrag"]
        for mode in ("blend", "full")}
    assert runs["blend"]["mode"] == "blend" and runs["blend"]["rule"] == "chunks"
    assert 0 < runs["blend"]["ratio"] <= 1  # of the chunk rows past the first (an exact prefix)
    assert runs["full"] == {"mode": "full", "ratio": None, "rule": None}


def test_each_app_has_its_own_registry(rag, server):
    with BackgroundServer(rag, ServerSettings(MODEL)) as other:
        assert metric(other, "kvrag_generated_tokens_total") == 0
        assert json.loads(httpx.get(other.url + "/v1/models", timeout=30).text)["data"][0]["id"] == MODEL
