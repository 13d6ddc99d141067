"""Conversations as token ids: a system message and earlier turns before the RAG prompt, or plain chat.

A RAG turn is the chat template over [*history, user(instruction + passages + question)] (prompt.rag_content).
Its head is every token before the passages (the history, then the last turn's opening and the instruction); its
tail is the suffix the single-turn prompt has. A plain turn, with no passages and no RAG instruction, is the
template over [*history, user(question)].

A follow-up whose history ends with an answer this engine gave continues from that turn's exact ids (its prompt,
passages included, and its answer), as prefix caching over a conversation does: `after_answer` gives the ids that
follow an answer's last token, up to the next turn's passages or to its end.

This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvrag.errors import KvragError
from kvrag.model.prompt import _SLOT, PromptBuilder, encode, leading_specials, question_text, rag_content

Turn = tuple[str, str]  # (role, text): system, user, assistant, or what the model's template knows
_ANSWER = "\x00KVRAG_ANSWER\x00"  # stands for an earlier answer while the template is rendered


class ChatPrompts:
    """Chat prompts of one tokenizer, cut where the engine needs them (see the module doc)."""

    def __init__(self, prompts: PromptBuilder):
        self.prompts, self.tokenizer = prompts, prompts.tokenizer
        self.has_template = bool(getattr(self.tokenizer, "chat_template", None))

    def head_ids(self, history: Sequence[Turn]) -> list[int]:
        """The ids before a RAG turn's passages, after `history` (none: the single-turn preamble)."""
        if not history:
            return list(self.prompts.preamble_ids)
        head, tail = self._render([*history, ("user", rag_content(self.prompts.brk))], True).split(_SLOT)
        if tail != self.prompts.template.suffix_template:  # the suffix must be the one every turn shares
            raise KvragError("this model's chat template renders the last turn differently after a history; "
                             "send one user message")
        return encode(self.tokenizer, head)

    def plain_ids(self, history: Sequence[Turn], question: str, role: str = "user") -> list[int]:
        """A plain chat prompt: the template over the history and the question (`role`'s: a tool's result too),
        ready for the answer."""
        if not self.has_template:  # the bare prompt, as the single-turn one: after the tokenizer's BOS
            body = "\n\n".join([*(text for _, text in history), question_text(question)])
            return encode(self.tokenizer, leading_specials(self.tokenizer) + body)
        return encode(self.tokenizer, self._render([*history, (role, question_text(question))], True))

    def after_answer(self, question: str, passages: bool, role: str = "user") -> tuple[list[int], list[int]]:
        """The ids after an answer's last token, as (head, tail): with new `passages`, the head runs to where they go
        and the tail is the usual suffix; else the head is empty and the tail is the question as the user wrote it,
        up to the next answer (the passages and the instruction stand in the earlier turns, as a chat has them)."""
        content = rag_content(self.prompts.brk) if passages else question_text(question)
        text = self._render([("user", "?"), ("assistant", _ANSWER), (role, content)], True).split(_ANSWER, 1)[1]
        if passages:
            head, _ = text.split(_SLOT)
            return encode(self.tokenizer, head), self.prompts.build([], question).suffix
        return [], encode(self.tokenizer, text)

    def _render(self, turns: Sequence[Turn], generation: bool) -> str:
        if not self.has_template:
            raise KvragError("this model has no chat template: send one user message")
        messages = [{"role": role, "content": text} for role, text in turns]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
