"""Chat planning: every request's prompt cut into one Plan shape (head, chunks, tail), and the kept turns a follow-up
continues.

A chat turn's prompt is a head (an exact prefix: the history, then the last turn's opening and instruction), the
chunks, and a tail (the question's suffix). A finished turn kept (`Request.keep_turn`) leaves its ids here under the
text of the conversation so far (its blocks stay in the pool's prefix cache): a follow-up whose history is that text
continues from those exact ids, the chunks already in that context not repeated. A plain prompt (no retrieval of
ours) is cut around the stored passages it carries (engine/prompt_reuse.py), or at its last block boundary; the
single-turn RAG prompt is the preamble, the chunks and the suffix, not framed (the prefiller holds its head).
Each kept turn says how many of its rows are exact; a request that asks for exact KV takes only an exact turn.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvrag.engine.prompt_reuse import Paragraphs, Piece, PromptFound, PromptSpans, find_in_prompt, split
from kvrag.kvcache.prefix_cache import PrefixCache
from kvrag.model.chat import ChatPrompts, Turn
from kvrag.model.runtime import Runtime

MAX_TURNS = 100_000  # kept turns' ids (their KV is the pool's): a few hundred bytes each


@dataclass(frozen=True)
class KeptTurn:
    """A finished turn: every id the model saw or said, the chunks it held, how many leading rows are exact."""

    ids: tuple[int, ...]
    chunk_ids: frozenset[str]
    exact_rows: int = 0


@dataclass(frozen=True)
class Plan:
    """Every request's prompt: head ids, the chunks not already in its context, tail ids. `framed`: the head's KV is
    looked up in the pool's prefix cache (a conversation, a plain prompt); else the head is the preamble, which the
    prefiller holds, and the chunks are read through its memory tiers (the single-turn RAG prompt)."""

    head: tuple[int, ...]
    chunks: tuple[tuple[str, tuple[int, ...]], ...]
    tail: tuple[int, ...]
    turn: KeptTurn | None  # the kept turn it continues
    pieces: tuple[Piece, ...] | None = None  # a plain prompt's stored spans and text between (prompt_reuse.py)
    salt: str = ""  # whose prefix cache the head is looked up in
    framed: bool = True
    found: PromptFound | None = None  # a plain prompt's ids and stored spans: cut again from them at its prefill

    @property
    def tokens(self) -> int:
        return len(self.head) + sum(len(ids) for _, ids in self.chunks) + len(self.tail)

    def ids(self) -> list[int]:
        return [*self.head, *(i for _, ids in self.chunks for i in ids), *self.tail]


def turn_key(turns: Sequence[Turn], salt: str = "") -> str:
    """A conversation's text as its key: roles and stripped texts (what a client sends back of an answer)."""
    text = json.dumps([salt, *([role, text.strip()] for role, text in turns)], ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


class Planner:
    """Plans one engine's prompts over its prefix cache (`prefix`, blocks of `block` rows) and the store's passages
    (`spans`; None: plain prompts are computed whole); keeps finished turns' ids. Any thread may `plan`."""

    def __init__(self, runtime: Runtime, prefix: PrefixCache, block: int, spans: PromptSpans | None = None):
        self.runtime, self.prefix, self.block, self.spans = runtime, prefix, block, spans
        self.chat = ChatPrompts(runtime.prompts)
        self.paragraphs = Paragraphs(runtime.tokenizer)  # what a passage is (prompt_reuse.py): kept_passages.py's too
        self._turns: OrderedDict[str, KeptTurn] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self.spill = None  # the store's record of kept turns (engine/prefix_spill.py: save_turn, load_turn), if kept

    def plan(self, question: str, history: Sequence[Turn], chunks, rag: bool, role: str = "user",
             room: int | None = None, salt: str = "", find_spans: bool = True, exact: bool = False,
             found: PromptFound | None = None) -> Plan:
        """The request's prompt (`role`: the question's, user or tool); the single-turn RAG prompt is preamble, chunks,
        suffix, not framed. A kept turn is continued only if the prompt then fits in `room` tokens (and,
        where `exact` KV is asked for, only if its rows are all exact): else the history is rendered from its text,
        without the earlier turns' passages. A plain prompt's stored passages are blended where `find_spans`
        (prompt_reuse.py): those `found` with the request (request_chunks.py), else found here; `salt` keys what a
        client's prompts leave cached."""
        if rag and not history:
            prompts = self.runtime.prompts
            return Plan(tuple(prompts.preamble_ids), tuple(chunks), tuple(prompts.build([], question).suffix), None,
                        salt=salt, framed=False)
        turn = self._turn(turn_key(history, salt)) if history and history[-1][0] == "assistant" else None
        if exact and turn is not None and turn.exact_rows < len(turn.ids):
            turn = None
        chunks = tuple(chunks) if rag else ()
        if turn is not None:
            new = tuple(c for c in chunks if c[0] not in turn.chunk_ids)
            head, tail = self.chat.after_answer(question, bool(new), role)
            plan = Plan((*turn.ids, *head), new, tuple(tail), turn, salt=salt)
            if room is None or plan.tokens <= room:
                return plan
        if not rag:
            if found is None:  # a request not made through request_chunks.py (the engine's own callers)
                found = find_in_prompt(self.chat, self.spans, history, question, role, salt, probe=find_spans)
            return self._plain(found, salt, find_spans)
        return Plan(tuple(self.chat.head_ids(history)), chunks, tuple(self.runtime.prompts.build([], question).suffix),
                    None, salt=salt)

    def replan(self, plan: Plan, find_spans: bool) -> Plan:
        """A plain prompt cut again at its prefill, where the prefix cache now holds more of it than its head: an
        exact repeat (of a follow-up too), or one queued behind the prompt it repeats, whose blocks were cached after
        it was planned. A follow-up bringing passages keeps its cut (they are blended after its head)."""
        ids = plan.ids()
        cached = self.prefix.cached_rows(ids, plan.salt)
        if cached <= len(plan.head) or (plan.turn is not None and plan.chunks):
            return plan
        if plan.turn is None:  # a plain prompt; or a chat RAG prompt given no chunks, cut as one
            found = plan.found or PromptFound(tuple(ids), tuple(self.spans.find(ids, plan.salt))
                                              if find_spans and self.spans is not None else ())
            return self._plain(found, plan.salt, find_spans)
        head = min(cached, (len(ids) - 1) // self.block * self.block)
        return Plan(tuple(ids[:head]), (), tuple(ids[head:]), plan.turn, salt=plan.salt)

    def _plain(self, found: PromptFound, salt: str, find_spans: bool) -> Plan:
        """A plain prompt: cut around its stored passages, or a head up to its last block boundary and a tail."""
        ids = found.ids
        if find_spans and self.spans is not None:
            cached = self.prefix.cached_rows(ids, salt)  # an exact prefix beats a blended span: spans start after it
            cut = split(ids, [s for s in found.spans if s.start >= cached], self.spans.index)
            if cut is not None:
                return Plan(cut.head, cut.chunks, cut.tail, None, cut.pieces, salt, found=found)
        head = (len(ids) - 1) // self.block * self.block
        return Plan(ids[:head], (), ids[head:], None, salt=salt, found=found)

    def keep(self, history: Sequence[Turn], question: Turn, answer: str, ids: Sequence[int],
             chunk_ids: frozenset[str], salt: str = "", exact_rows: int = 0) -> None:
        """Keep a finished turn's ids (prompt and answer; its blocks are in the prefix cache), the first `exact_rows`
        of them exact; `question` the last message, (role, text)."""
        key = turn_key([*history, question, ("assistant", answer)], salt)
        kept = KeptTurn(tuple(ids), chunk_ids, exact_rows)
        self._remember(key, kept)
        if self.spill is not None:  # for a later life of the server, or another replica on the store
            self.spill.save_turn(key, kept)

    def _remember(self, key: str, kept: KeptTurn) -> None:
        with self._lock:
            self._turns[key] = kept
            self._turns.move_to_end(key)
            while len(self._turns) > MAX_TURNS:
                self._turns.popitem(last=False)

    def _turn(self, key: str) -> KeptTurn | None:
        with self._lock:
            turn = self._turns.get(key)
            if turn is not None:
                self._turns.move_to_end(key)
                return turn
        turn = self.spill.load_turn(key) if self.spill is not None else None
        if turn is not None:
            self._remember(key, turn)
        return turn
