"""Conversations through the real `openai` client against a real `kvrag serve`: system messages, earlier turns, a
follow-up that reuses its first turn's KV, plain chat without passages. The reference for each answer is Hugging Face
transformers' greedy decode (a float32 model) over prompt ids built here from transformers' own chat template, not
from kvrag's cut of it."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from kvrag.model.prompt import BREAKS, CLOSING, INSTRUCTION, render_passage
from kvrag.server.app import ServerSettings
from kvrag.server.run import BackgroundServer
from kvrag.tests.conftest import copied_store

MODEL = "tiny-llama"
PASSAGES = [("Quarn loom", "The Quarn loom was invented in 1791 by Beatrix Olufsen, a weaver from Trondheim."),
            ("Tides", "Tides rise twice a day.")]
STEPS = 6


@pytest.fixture(scope="module")
def served(indexed_store, tiny_llama_dir, tmp_path_factory):
    from kvrag import KVRag

    store = copied_store(indexed_store, tmp_path_factory)  # the server writes what it computes
    with KVRag(store, model=str(tiny_llama_dir), dtype="float32", host_cache="0") as rag, \
            BackgroundServer(rag, ServerSettings(MODEL)) as running:
        yield rag, running, openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(tiny_llama_dir))


def rag_content(question: str) -> str:
    """The last user turn of a RAG prompt, written out from the prompt's parts."""
    return INSTRUCTION + "".join(render_passage(t, x) for t, x in PASSAGES) + BREAKS[0] + CLOSING.format(question=question)


def template(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def greedy(hf, ids: list[int], steps: int = STEPS) -> list[int]:
    model, _ = hf
    ids, out = list(ids), []
    with torch.no_grad():
        for _ in range(steps):
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(token)
            ids.append(token)
    return out


def ask(client, messages: list[dict], **extra):
    return client.chat.completions.create(model=MODEL, max_tokens=STEPS, messages=messages,
                                          extra_body={"passages": [{"title": t, "text": x} for t, x in PASSAGES],
                                                      **extra})


def text_of(rag, tokens: list[int]) -> str:
    return rag.runtime.tokenizer.decode(tokens, skip_special_tokens=True).strip()


def test_a_system_message_and_earlier_turns_are_in_the_prompt(served, hf):
    rag, _, client = served
    earlier = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello there."},
               {"role": "assistant", "content": "Bonjour."}]
    question = "Who invented the Quarn loom?"
    reply = ask(client, [*earlier, {"role": "user", "content": question}], mode="full")
    ids = template(hf[1], [*earlier, {"role": "user", "content": rag_content(question)}])
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].message.content == text_of(rag, greedy(hf, ids))
    # blended, the same prompt: the stored passages' KV after another head, fixed by the blend
    blended = ask(client, [*earlier, {"role": "user", "content": question}], ratio=1.0)
    assert blended.choices[0].message.content == reply.choices[0].message.content


def test_a_follow_up_continues_its_first_turn_and_reuses_its_kv(served, hf):
    rag, _, client = served
    first_q, second_q = "Who invented the Quarn loom?", "When was that?"
    first = rag.submit(first_q, passages=PASSAGES, mode="full", max_tokens=STEPS, keep_turn=True)
    answer = first.result()
    turn_ids = template(hf[1], [{"role": "user", "content": rag_content(first_q)}]) + answer.token_ids
    reply = ask(client, [{"role": "user", "content": first_q}, {"role": "assistant", "content": answer.text},
                         {"role": "user", "content": second_q}])
    # the first turn's ids as the model saw them (its answer's own tokens), then the question as the user wrote it:
    # its passages are already in the context
    marker = "\x00A\x00"
    after = hf[1].apply_chat_template([{"role": "user", "content": "?"}, {"role": "assistant", "content": marker},
                                       {"role": "user", "content": second_q}],
                                      tokenize=False, add_generation_prompt=True).split(marker, 1)[1]
    ids = turn_ids + hf[1](after, add_special_tokens=False)["input_ids"]
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].message.content == text_of(rag, greedy(hf, ids))
    # every whole block of the first turn's rows in the pool was reused, by reference: its prompt and answer (the last
    # answer token was never fed); the rows of its last, partial block are computed again
    in_pool = len(turn_ids) - (answer.finish_reason == "length")
    assert reply.usage.prompt_tokens_details.cached_tokens == in_pool // 16 * 16
    assert {s["tier"] for s in reply.model_extra["sources"]} == {"context"}  # not sent again


def test_a_follow_up_of_an_unknown_turn_renders_the_history(served, hf):
    rag, _, client = served
    history = [{"role": "user", "content": "Who invented the Quarn loom?"},
               {"role": "assistant", "content": "Somebody else said this."}]
    reply = ask(client, [*history, {"role": "user", "content": "When?"}], mode="full")
    ids = template(hf[1], [*history, {"role": "user", "content": rag_content("When?")}])
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].message.content == text_of(rag, greedy(hf, ids))


@pytest.mark.parametrize("extra", [{"rag": False}, {"k": 0}])
def test_plain_chat_has_no_passages_and_no_rag_instruction(served, hf, extra):
    rag, server, _ = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a haiku about the sea."}]
    reply = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                       json={"model": MODEL, "max_tokens": STEPS, "messages": messages, **extra}).json()
    ids = template(hf[1], messages)
    assert reply["usage"]["prompt_tokens"] == len(ids)
    assert reply["sources"] == []
    assert reply["choices"][0]["message"]["content"] == text_of(rag, greedy(hf, ids))


def test_the_last_message_must_be_the_users(served):
    _, server, _ = served
    reply = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"},
                                                          {"role": "assistant", "content": "Hello"}]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages", reply.text


def test_an_unknown_role_is_a_400_wherever_it_stands(served):
    """Never rendered into the prompt under a role the model's template does not know: first, middle or last."""
    _, server, client = served
    critic = {"role": "critic", "content": "That was wrong."}
    user, assistant = {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}
    for messages in ([critic, user], [user, assistant, critic, user], [user, critic]):
        reply = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                           json={"model": MODEL, "max_tokens": 2, "messages": messages})
        error = reply.json()["error"]
        assert reply.status_code == 400 and error["type"] == "invalid_request_error", reply.text
        assert error["param"] == f"messages.{messages.index(critic)}.role" and "'user'" in error["message"], reply.text
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[critic, user])


def test_n_choices_each_sampled_with_their_own_seed(served):
    rag, _, client = served
    question, seed = "Who invented the Quarn loom?", 11
    # choice i is what KVRag samples with seed + i over the same passages (asked first: the passages' KV is then
    # stored, and every choice reads it from the store)
    want = [rag.ask(question, passages=PASSAGES, seed=seed + i, temperature=1.0, max_tokens=STEPS)
            for i in range(3)]
    reply = ask(client, [{"role": "user", "content": question}], n=3, seed=seed, temperature=1.0)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.message.content for c in reply.choices] == [a.text for a in want]
    assert reply.usage.completion_tokens == sum(len(a.token_ids) for a in want)
    assert reply.usage.prompt_tokens == want[0].prompt_tokens
    streamed = ask(client, [{"role": "user", "content": question}], n=3, seed=seed, temperature=1.0)
    assert [c.message.content for c in streamed.choices] == [a.text for a in want]  # the same seeds, the same texts
    pieces: dict[int, str] = {}
    finished = set()
    for chunk in client.chat.completions.create(
            model=MODEL, max_tokens=STEPS, n=3, seed=seed, temperature=1.0, stream=True,
            messages=[{"role": "user", "content": question}],
            extra_body={"passages": [{"title": t, "text": x} for t, x in PASSAGES]}):
        for choice in chunk.choices:
            pieces[choice.index] = pieces.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1, 2}
    assert [pieces[i].strip() for i in range(3)] == [a.text for a in want]


def test_a_follow_up_too_long_to_continue_its_kept_turn_renders_the_history(served, hf):
    rag, server, _ = served
    first_q = "Who invented the Quarn loom?"
    answer = rag.ask(first_q, passages=PASSAGES, max_tokens=STEPS, keep_turn=True)
    history = [{"role": "user", "content": first_q}, {"role": "assistant", "content": answer.text}]
    messages = [*history, {"role": "user", "content": "When?"}]
    kept = template(hf[1], [{"role": "user", "content": rag_content(first_q)}]) + answer.token_ids
    from_text = template(hf[1], messages)  # plain chat: the kept turn's passages are what makes it longer
    room = rag.runtime.model.cfg.max_positions - len(from_text)  # the text's prompt fits; the kept one would not
    assert len(kept) > len(from_text)
    reply = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "max_tokens": room, "messages": messages, "stop": ["\n", " "], "rag": False}).json()
    assert reply["usage"]["prompt_tokens"] == len(from_text), reply
    fits = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "max_tokens": 2, "messages": messages, "rag": False}).json()
    assert fits["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # with room, the kept turn is continued
