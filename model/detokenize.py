"""Token ids to text as they are generated, in constant time a token (vLLM's and TGI's incremental detokenizing)."""

from __future__ import annotations

CONTEXT = 6  # tokens decoded before the new ones: enough for a tokenizer to spell a word's leading space in context


class Detokenizer:
    """Each new piece is the text of a few tokens before it and the new ones, less the text of those few alone, so a
    tokenizer that spells a word's leading space from its context spells it as a whole decode would. A piece that
    ends in an incomplete UTF-8 character ("\\ufffd") is held back until the character's last byte comes; the pieces
    and `flush()` together are the whole decode (special tokens skipped)."""

    def __init__(self, tokenizer, context: int = CONTEXT):
        self.tokenizer, self.context = tokenizer, context
        self.ids: list[int] = []
        self.start = 0  # the first token of the context decoded before the new ones
        self.done = 0  # tokens whose text has been handed out

    def push(self, token: int) -> str:
        """The text `token` completes ("" while a character is incomplete)."""
        self.ids.append(token)
        before, text = self._texts()
        if text.endswith("\ufffd") or len(text) <= len(before):
            return ""
        return self._hand_out(before, text)

    def flush(self) -> str:
        """What is held back at the end (an answer cut inside a character: its "\\ufffd", as a whole decode has)."""
        return self._hand_out(*self._texts())

    def _hand_out(self, before: str, text: str) -> str:
        self.start, self.done = max(self.start, len(self.ids) - self.context), len(self.ids)
        return text[len(before):]

    def _texts(self) -> tuple[str, str]:
        decode = self.tokenizer.decode
        return (decode(self.ids[self.start:self.done], skip_special_tokens=True),
                decode(self.ids[self.start:], skip_special_tokens=True))
