"""Chat `logprobs` and `top_logprobs` through the real `openai` client against a real `kvrag serve`, held to Hugging
Face transformers' own log-softmax over the same prompt ids (a full prefill of a float32 model, greedy)."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from kvrag.server.app import ServerSettings
from kvrag.server.run import BackgroundServer
from kvrag.tests.conftest import copied_store

MODEL = "tiny-llama"
QUESTION = "Who invented the Quarn loom?"
PASSAGES = [("Quarn loom", "The Quarn loom was invented in 1791 by Beatrix Olufsen, a weaver from Trondheim."),
            ("Tides", "Tides rise twice a day.")]
STEPS, TOP = 4, 3


@pytest.fixture(scope="module")
def served(indexed_store, tiny_llama_dir, tmp_path_factory):
    from kvrag import KVRag

    store = copied_store(indexed_store, tmp_path_factory)  # the server writes what it computes
    with KVRag(store, model=str(tiny_llama_dir), dtype="float32", host_cache="0") as rag, \
            BackgroundServer(rag, ServerSettings(MODEL)) as running:
        yield rag, running


def _reference(rag, tiny_llama_dir) -> list[tuple[int, float, list[int]]]:
    """Greedy steps of transformers' model over the prompt kvrag builds: (token, its logprob, the TOP best ids)."""
    from transformers import AutoModelForCausalLM

    prompts = rag.runtime.prompts
    ids = prompts.build([prompts.passage_ids(t, x) for t, x in PASSAGES], QUESTION).flat()
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for _ in range(STEPS):
            lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), dim=-1)  # [V]
            token = int(lp.argmax())
            out.append((token, float(lp[token]), torch.topk(lp, TOP).indices.tolist()))
            ids.append(token)
    return out


def test_chat_logprobs_are_the_models(served, tiny_llama_dir):
    rag, server = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL, max_tokens=STEPS, logprobs=True, top_logprobs=TOP,
        messages=[{"role": "user", "content": QUESTION}],
        extra_body={"passages": [{"title": t, "text": x} for t, x in PASSAGES], "mode": "full"})
    content = reply.choices[0].logprobs.content
    want = _reference(rag, tiny_llama_dir)
    tokenizer = rag.runtime.tokenizer
    assert len(content) == len(want) == reply.usage.completion_tokens  # the random model names no stop token
    for got, (token, logprob, top) in zip(content, want, strict=True):
        assert got.token == tokenizer.decode([token]) and got.bytes == list(got.token.encode())
        assert got.logprob == pytest.approx(logprob, abs=1e-4)
        assert [t.token for t in got.top_logprobs] == [tokenizer.decode([t]) for t in top]
        assert got.top_logprobs[0].logprob == pytest.approx(logprob, abs=1e-4)  # greedy: the best is the one taken


def test_a_stop_string_keeps_the_logprobs_of_the_text_it_leaves(served):
    """Cut by a stop string at a token's start, the answer's logprobs are those of the tokens before it."""
    _, server = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

    def ask(**options):
        return client.chat.completions.create(
            model=MODEL, max_tokens=12, logprobs=True, messages=[{"role": "user", "content": QUESTION}],
            extra_body={"passages": [{"title": t, "text": x} for t, x in PASSAGES], "mode": "full"}, **options)

    whole = ask().choices[0].logprobs.content
    pieces = [t.token for t in whole]
    text = "".join(pieces)
    at = next(i for i in range(2, len(pieces)) if pieces[i].strip() and "\ufffd" not in text[:text.find(pieces[i])]
              and text.find(pieces[i]) == len("".join(pieces[:i])))  # the stop's first occurrence: token i's start
    reply = ask(stop=pieces[at]).choices[0]
    assert reply.finish_reason == "stop" and reply.message.content == "".join(pieces[:at]).strip()
    assert [(t.token, t.logprob) for t in reply.logprobs.content] == [(t.token, t.logprob) for t in whole[:at]]


def test_without_logprobs_there_are_none_and_what_cannot_be_served_is_a_400(served):
    _, server = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    plain = client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi?"}])
    assert plain.choices[0].logprobs is None
    base = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi?"}]}
    for extra, param in [({"logprobs": True, "stream": True}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
                         ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")]:
        reply = httpx.post(server.url + "/v1/chat/completions", json={**base, **extra}, timeout=60)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
    reply = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi?", "logprobs": 2},
                       timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "logprobs"
