"""Prompt assembly: preamble + passages + suffix, each as token ids, from the chat template.

The whole prompt is the CacheBlend paper's RAG prompt wrapped as one user message. It is cut in
segments whose token ids concatenate to exactly the ids of the whole prompt, so every passage's
ids (and so its precomputed KV) are the same wherever it stands:

    preamble = template opening + instruction, ending in "Passages:"   (no trailing white space)
    passage  = "\\n\\n" + [title + "\\n"] + text                        (white space first, text stripped)
    suffix   = "\\n\\n" + closing instruction + question + template end

A byte-level BPE (GPT-2 style pre-tokenizer) never merges across a boundary between a
non-space character and a run of white space, so each segment tokenizes as it would inside the
whole prompt. `check_segmentation` verifies this for a given tokenizer.

This module imports no torch, so corpus/ can use `render_passage` too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvrag.errors import KvragError

INSTRUCTION = (
    "You will be asked a question after reading several passages. Please directly answer the question "
    "based on the given passages. Do NOT repeat the question. The answer should be within 5 words.\n"
    "Passages:"
)
QUESTION_TEMPLATE = (
    "\n\nAnswer the question directly based on the given passages. Do NOT repeat the question. "
    "The answer should be within 5 words. \nQuestion: {question}\nAnswer:"
)
_SLOT = "\x00KVRAG_PASSAGES\x00"  # stands where the passages go while the template is rendered
_QSLOT = "\x00KVRAG_QUESTION\x00"


def render_passage(title: str, text: str) -> str:
    """The exact text of one passage as it stands in a prompt."""
    title, text = title.strip(), text.strip()
    return "\n\n" + (f"{title}\n" if title else "") + text


@dataclass(frozen=True)
class PromptTemplate:
    """The chat template cut around the passages: preamble text, and suffix text with a question slot."""

    preamble: str
    suffix_template: str  # contains _QSLOT

    @classmethod
    def from_tokenizer(cls, tokenizer) -> PromptTemplate:
        content = INSTRUCTION + _SLOT + QUESTION_TEMPLATE.format(question=_QSLOT)
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
            )
        else:  # a base model without a chat template: the bare prompt, after what its tokenizer puts first (BOS)
            text = leading_specials(tokenizer) + content
        preamble, suffix = text.split(_SLOT)
        return cls(preamble=preamble, suffix_template=suffix)

    def suffix(self, question: str) -> str:
        question = question.strip()
        if not question:
            raise KvragError("the question is empty")
        return self.suffix_template.replace(_QSLOT, question)

    def full_text(self, passages: Sequence[str], question: str) -> str:
        """The whole prompt as one string (what a plain tokenizer call would see)."""
        return self.preamble + "".join(passages) + self.suffix(question)


def leading_special_ids(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts before any text it encodes (a base model's BOS: Gemma without its `<bos>`
    repeats the question); [] for none. A chat template writes its own; a bare prompt gets these, as transformers'
    plain encode gives them."""
    plain = tokenizer("x", add_special_tokens=False)["input_ids"]
    marked = tokenizer("x", add_special_tokens=True)["input_ids"]
    return marked[:marked.index(plain[0])] if plain and plain[0] in marked else []


def leading_specials(tokenizer) -> str:
    """leading_special_ids as text (the prompt's segments are text, their special tokens spelt out)."""
    ids = leading_special_ids(tokenizer)
    return tokenizer.decode(ids, skip_special_tokens=False) if ids else ""


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of a prompt segment; special tokens come from the template text itself."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass(frozen=True)
class PromptIds:
    """One prompt as token-id segments: preamble, passages (in order), suffix."""

    preamble: list[int]
    passages: list[list[int]]
    suffix: list[int]

    def flat(self) -> list[int]:
        out = list(self.preamble)
        for p in self.passages:
            out.extend(p)
        return out + list(self.suffix)

    def passage_spans(self) -> list[tuple[int, int]]:
        """[start, end) positions of each passage in the flat prompt."""
        spans, pos = [], len(self.preamble)
        for p in self.passages:
            spans.append((pos, pos + len(p)))
            pos += len(p)
        return spans


class PromptBuilder:
    """Builds `PromptIds` for a tokenizer; the preamble ids are computed once."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.template = PromptTemplate.from_tokenizer(tokenizer)
        self.preamble_ids = encode(tokenizer, self.template.preamble)

    def passage_ids(self, title: str, text: str) -> list[int]:
        return encode(self.tokenizer, render_passage(title, text))

    def build(self, passages: Sequence[Sequence[int]], question: str) -> PromptIds:
        return PromptIds(
            preamble=list(self.preamble_ids),
            passages=[list(p) for p in passages],
            suffix=encode(self.tokenizer, self.template.suffix(question)),
        )


def check_segmentation(builder: PromptBuilder) -> None:
    """Refuse a tokenizer whose segments would not concatenate to the whole prompt's ids."""
    texts = [render_passage("", "First passage, about rivers."), render_passage("Title", "Second one: 42 lakes!")]
    question = "Which river is longest?"
    segmented = builder.build([encode(builder.tokenizer, t) for t in texts], question).flat()
    whole = encode(builder.tokenizer, builder.template.full_text(texts, question))
    if segmented != whole:
        raise KvragError(
            "this model's tokenizer merges tokens across passage boundaries, so passages cannot be "
            "cached independently; use a model with a byte-level BPE tokenizer (Llama 3, Qwen2, SmolLM)"
        )
