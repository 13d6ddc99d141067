"""One retrieval decision (request_chunks.py) and one rule for what a passage is (prompt_reuse.Paragraphs): the rule
on hand-made ids, the decision's reading of a chat (the client's messages, not the model's answers), and one
client-RAG chat request through KVRag tokenizing its prompt once and probing the passage index once."""

from __future__ import annotations

import pytest

from kvrag.engine.kept_passages import PassageKeeper
from kvrag.engine.prompt_reuse import PASSAGE_TOKENS, Paragraphs, PromptFound, PromptSpans, carries_passages
from kvrag.model.chat import ChatPrompts
from kvrag.model.prompt import PromptBuilder, encode
from kvrag.tests.client_templates import open_webui_prompt

PROSE = ("The lighthouse at Kelvar Point was lit for the first time in 1874 by Ingrid Halvorsen, who kept it for "
         "forty-one winters, logged every ship that passed the reef in a green ledger, and was succeeded by her "
         "nephew Tomas, who moved the lamp to the new granite tower in 1919 after the old one cracked.")


def _one(tokenizer, text: str) -> int:
    ids = encode(tokenizer, text)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def test_a_passage_is_a_run_between_line_breaks_and_tag_brackets(smol_tokenizer):
    """Hand-computed: w is a word token, then runs of 50, 47 and 48 words and 10 between a line break, a '<' and a
    '>'. Passages: [0, 50) and [99, 147), 48 being the least; past skip=10 the first has 40 computed tokens: not one.
    The keeper cuts a prompt's computed regions by the same rule."""
    assert PASSAGE_TOKENS == 48
    word, nl, lt, gt = (_one(smol_tokenizer, t) for t in ("word", "\n", "<", ">"))
    ids = [word] * 50 + [nl] + [word] * 47 + [lt] + [word] * 48 + [gt] + [word] * 10
    paragraphs = Paragraphs(smol_tokenizer)
    assert {nl, lt, gt} <= paragraphs.breaks() and word not in paragraphs.breaks()
    assert paragraphs.runs(ids) == [(0, 50), (99, 147)]
    assert paragraphs.runs(ids, skip=10) == [(99, 147)]
    keeper = PassageKeeper(PromptSpans(None), smol_tokenizer, "fp", 1000, paragraphs)
    assert keeper.passages(None, (), ids, ids[51:98], cached=10) == [tuple(ids[99:147])]  # a 47-word tail: none
    # a tag's text: the passage is what stands between the tags, whatever their names
    tagged = encode(smol_tokenizer, f'<source id="1">{PROSE}</source>')
    (start, end), = paragraphs.runs(tagged)
    assert smol_tokenizer.decode(tagged[start:end]) == PROSE


def test_the_decision_reads_the_clients_messages_not_the_models_answers(smol_tokenizer):
    """A long paragraph the model wrote does not make a prompt carry passages; the same paragraph in a user's
    message, or a system prompt, does; a short question does not."""
    chat, paragraphs = ChatPrompts(PromptBuilder(smol_tokenizer)), Paragraphs(smol_tokenizer)

    def carries(history, question) -> bool:
        ids = tuple(chat.plain_ids(history, question))
        return carries_passages(paragraphs, PromptFound(ids, ()), question, history)

    assert not carries((), "Who lit the lighthouse?")
    assert not carries((("user", "Who lit it?"), ("assistant", PROSE)), "And when?")
    assert carries((("user", PROSE), ("assistant", "Ingrid.")), "And when?")
    assert carries((("system", PROSE),), "Who lit it?")
    assert carries((), f"{PROSE}\n\nWho lit it?")


@pytest.fixture
def counted(store_copy, tiny_llama_dir, monkeypatch):
    """A KVRag (retrieval auto) whose tokenizer's encodes and passage-index probes are counted."""
    from kvrag import KVRag
    from kvrag.model.tokenizer import Tokenizer

    with KVRag(store_copy, model=str(tiny_llama_dir), dtype="float32", host_cache="0", preload_retriever=False) as rag:
        rag.engine.planner.spans.fill()
        counts = {"encode": 0, "probe": 0}
        encode_, find = Tokenizer.__call__, PromptSpans.find

        def counted_encode(self, *args, **kwargs):
            counts["encode"] += 1
            return encode_(self, *args, **kwargs)

        def counted_find(self, *args, **kwargs):
            counts["probe"] += 1
            return find(self, *args, **kwargs)

        monkeypatch.setattr(Tokenizer, "__call__", counted_encode)
        monkeypatch.setattr(PromptSpans, "find", counted_find)
        yield rag, counts


def test_a_client_rag_chat_request_is_tokenized_once_and_probed_once(counted):
    """Open WebUI's template over two of the store's chunks, as a chat with a system prompt: decided (no retrieval of
    ours: the prompt carries passages), planned and answered with one encode of its prompt and one probe of the
    passage index, and the stored passages it carries are blended."""
    from kvrag.store.chunks import ChunkTable

    rag, counts = counted
    texts = [r.text for r in ChunkTable(rag.env).iter() if len(r.token_ids) >= PASSAGE_TOKENS][:2]
    assert len(texts) == 2
    question, history = open_webui_prompt(texts, "Which of these came first?"), (("system", "Be brief."),)
    answer = rag.ask(question, history=history, max_tokens=2)
    assert counts == {"encode": 1, "probe": 1}
    assert answer.sources == []  # nothing retrieved
    assert len([tier for tier in answer.chunk_tiers if tier != "prompt"]) == 2  # the two stored passages blended
    counts.update(encode=0, probe=0)  # asked again: cut again at its prefill around the prefix cache, not probed
    again = rag.ask(question, history=history, max_tokens=2)
    assert counts == {"encode": 1, "probe": 1} and again.chunk_tiers == [] and again.token_ids == answer.token_ids
