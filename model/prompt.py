"""Prompt assembly: preamble + passages + suffix, each as token ids, from the chat template.

The whole prompt is the CacheBlend paper's RAG prompt wrapped as one user message. It is cut in
segments whose token ids concatenate to exactly the ids of the whole prompt, so every passage's
ids (and so its precomputed KV) are the same wherever it stands:

    preamble = template opening + instruction, ending in "Passages:"   (no trailing white space)
    passage  = break + [title + "\\n"] + text                          (text stripped)
    suffix   = break + closing instruction + question + template end

Every segment ends in a character that is not white space, and every segment after the preamble starts with the
tokenizer's break, the first of BREAKS its pre-tokenizer splits before whatever a passage ends in:

- "\\n\\n", the paper's own, for GPT-2's pre-tokenizer (SmolLM2), which never joins a non-space with the white space
  after it, and for Gemma's SentencePiece-style BPE, which has no such merges;
- " \\n\\n" for Llama 3's and Qwen2's regex, which join punctuation with the line breaks after it
  (`?[^\\s\\p{L}\\p{N}]+[\\r\\n]*`: "Passages:" + "\\n\\n" is one token there) but never with a space.

The space is not everyone's because it moves a small model's answers (SmolLM2 missed a demo question with it);
`choose_break` tries the candidates on probe passages that end and start in every kind of character, and
`check_segmentation` refuses a tokenizer that none of them holds for.

This module imports no torch, so corpus/ can use `render_passage` too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvrag.errors import KvragError

BREAKS = ("\n\n", " \n\n")  # what segments after the preamble start with, the first a tokenizer splits before
INSTRUCTION = (
    "You will be asked a question after reading several passages. Please directly answer the question "
    "based on the given passages. Do NOT repeat the question. The answer should be within 5 words.\n"
    "Passages:"
)
CLOSING = ("Answer the question directly based on the given passages. Do NOT repeat the question. "
           "The answer should be within 5 words. \nQuestion: {question}\nAnswer:")
_SLOT = "\x00KVRAG_PASSAGES\x00"  # stands where the passages go while the template is rendered
_QSLOT = "\x00KVRAG_QUESTION\x00"


def render_passage(title: str, text: str, brk: str = BREAKS[0]) -> str:
    """The exact text of one passage as it stands in a prompt whose break is `brk`."""
    title, text = title.strip(), text.strip()
    return brk + (f"{title}\n" if title else "") + text


def question_text(question: str) -> str:
    """The question as a prompt holds it: stripped; KvragError for an empty one."""
    if not question.strip():
        raise KvragError("the question is empty")
    return question.strip()


def rag_content(brk: str) -> str:
    """The user message of a RAG turn, its passages and question as slots."""
    return INSTRUCTION + _SLOT + brk + CLOSING.format(question=_QSLOT)


@dataclass(frozen=True)
class PromptTemplate:
    """The chat template cut around the passages: preamble text, and suffix text with a question slot."""

    preamble: str
    suffix_template: str  # contains _QSLOT

    @classmethod
    def from_tokenizer(cls, tokenizer, brk: str = BREAKS[0]) -> PromptTemplate:
        content = rag_content(brk)
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
            )
        else:  # a base model without a chat template: the bare prompt, after what its tokenizer puts first (BOS)
            text = leading_specials(tokenizer) + content
        preamble, suffix = text.split(_SLOT)
        return cls(preamble=preamble, suffix_template=suffix)

    def suffix(self, question: str) -> str:
        return self.suffix_template.replace(_QSLOT, question_text(question))

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
    """Builds `PromptIds` for a tokenizer; its break (None: `choose_break`'s) and preamble ids are found once."""

    def __init__(self, tokenizer, brk: str | None = None):
        self.tokenizer = tokenizer
        self.brk = choose_break(tokenizer) if brk is None else brk
        self.template = PromptTemplate.from_tokenizer(tokenizer, self.brk)
        self.preamble_ids = encode(tokenizer, self.template.preamble)

    def render_passage(self, title: str, text: str) -> str:
        return render_passage(title, text, self.brk)

    def passage_ids(self, title: str, text: str) -> list[int]:
        return encode(self.tokenizer, self.render_passage(title, text))

    def build(self, passages: Sequence[Sequence[int]], question: str) -> PromptIds:
        return PromptIds(
            preamble=list(self.preamble_ids),
            passages=[list(p) for p in passages],
            suffix=encode(self.tokenizer, self.template.suffix(question)),
        )


# Probe passages for check_segmentation: between them they start and end in every kind of character a passage may
# (letters, digits, punctuation, CJK, code, quotes, Windows line breaks inside); the order puts each end before a
# different kind of start.
_PROBES = (
    ("", "First passage, about rivers."),
    ("Title", "Second one: 42 lakes!"),
    ("", "In 1999"),
    ("", "(see note) 東京は日本の首都です。"),
    ("", "def f(x):\r\n    return {x: 1}"),
    ("Notes", "\"Quoted\" text ends in a digit 7"),
    ("", "- item one\r\n- item two;"),
    ("", "’s a word"),
)


def choose_break(tokenizer) -> str:
    """The first of BREAKS whose probe prompt this tokenizer encodes from segments as it does whole; the last one when
    none is (check_segmentation then refuses the tokenizer, naming it)."""
    for brk in BREAKS[:-1]:
        if _segments_and_whole(PromptBuilder(tokenizer, brk))[0] is None:
            return brk
    return BREAKS[-1]


def _segments_and_whole(builder: PromptBuilder) -> tuple[int | None, PromptIds, list[int]]:
    """Where the probe prompt's ids from segments first differ from the whole text's (None: nowhere), with both."""
    texts = [builder.render_passage(t, x) for t, x in _PROBES]
    question = "Which river is longest?"
    prompt = builder.build([encode(builder.tokenizer, t) for t in texts], question)
    segmented = prompt.flat()
    whole = encode(builder.tokenizer, builder.template.full_text(texts, question))
    if segmented == whole:
        return None, prompt, whole
    pairs = enumerate(zip(segmented, whole, strict=False))  # the shorter list may be all the other's head
    return next((i for i, (a, b) in pairs if a != b), min(len(segmented), len(whole))), prompt, whole


def check_segmentation(builder: PromptBuilder, name: str = "this model's") -> None:
    """Refuse a tokenizer whose segments would not concatenate to the whole prompt's ids, naming the tokenizer,
    the boundary and the two id lists where they part."""
    at, prompt, whole = _segments_and_whole(builder)
    if at is None:
        return
    segmented = prompt.flat()
    starts = [s for s, _ in prompt.passage_spans()] + [len(segmented) - len(prompt.suffix)]
    boundary = min(starts, key=lambda s: abs(s - at))  # the segment boundary nearest where the ids part
    shown = slice(max(0, at - 3), at + 4)
    raise KvragError(
        f"{name} tokenizer ({_tokenizer_name(builder.tokenizer)}) merges tokens across the passage boundary "
        f"{builder.brk!r} at token {boundary}: segments give {segmented[shown]}, the whole prompt {whole[shown]} "
        f"(from token {shown.start}); passages cannot be cached apart with it"
    )


def _tokenizer_name(tokenizer) -> str:
    """What the tokenizer calls its kind: tokenizer_config.json's class, else the Python class."""
    config = getattr(tokenizer, "config", None) or {}
    return str(config.get("tokenizer_class") or type(tokenizer).__name__)
