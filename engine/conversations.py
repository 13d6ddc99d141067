"""Conversations: a chat request's prompt (model/chat.py), continued over the turns of a conversation.

A chat turn's prompt is a head (an exact prefix: the history, then the last turn's opening and instruction), the
chunks, and a tail (the question's suffix). When a finished turn asked to be kept (`Request.keep_turn`), its ids
(prompt, passages included, and answer) are kept here under the text of the conversation so far, and its blocks stay
in the pool's prefix cache (kvcache/prefix_cache.py). A follow-up whose history is that text continues from those
exact ids: the pool blocks they fill are its table's first (vLLM's prefix caching over a chat), the chunks already
in that context are not repeated, and only the new turn is computed. Every prefilled prompt's whole blocks stay in
the cache too (a system prompt every request repeats, a few-shot head, an exact repeat): a later prompt starts from
its longest cached run of leading blocks, each tenant's (salt's) apart.

Each block and turn says how many of its rows are exact (computed as a full prefill would: no blended row among or
before them). A request that asks for exact KV (`mode: full`, ratio 1) takes only exact ones; a blend takes either.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvrag.engine.kv_pool import SequenceKV
from kvrag.engine.prefiller import Framing
from kvrag.engine.prompt_reuse import Piece, PromptSpans, split
from kvrag.engine.sequence import Sequence as EngineSequence
from kvrag.model.chat import ChatPrompts, Turn
from kvrag.model.prefill import LayerKV, extend
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
    """One chat request's prompt: head ids, the chunks not already in its context, tail ids."""

    head: tuple[int, ...]
    chunks: tuple[tuple[str, tuple[int, ...]], ...]
    tail: tuple[int, ...]
    turn: KeptTurn | None  # the kept turn it continues
    pieces: tuple[Piece, ...] | None = None  # a plain prompt's stored spans and text between (prompt_reuse.py)
    salt: str = ""  # whose prefix cache the head is looked up in

    @property
    def tokens(self) -> int:
        return len(self.head) + sum(len(ids) for _, ids in self.chunks) + len(self.tail)

    def ids(self) -> list[int]:
        return [*self.head, *(i for _, ids in self.chunks for i in ids), *self.tail]


def turn_key(turns: Sequence[Turn], salt: str = "") -> str:
    """A conversation's text as its key: roles and stripped texts (what a client sends back of an answer)."""
    text = json.dumps([salt, *([role, text.strip()] for role, text in turns)], ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


class Conversations:
    """Kept turns of one engine's model (ids only) and the prompts that continue them, over `kv`'s prefix cache. Any
    thread may `plan`; `framing` and `keep` run on the engine's thread."""

    def __init__(self, runtime: Runtime, kv: SequenceKV, spans: PromptSpans | None = None):
        self.runtime, self.model, self.kv = runtime, runtime.model, kv
        self.chat = ChatPrompts(runtime.prompts)
        self.spans = spans  # stored passages found in plain prompts (None: plain prompts are computed whole)
        self.block = kv.block_size  # a head is reused up to its last whole block the cache holds
        self._turns: OrderedDict[str, KeptTurn] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    def plan(self, question: str, history: Sequence[Turn], chunks, rag: bool, role: str = "user",
             room: int | None = None, salt: str = "", find_spans: bool = True, exact: bool = False) -> Plan | None:
        """The request's prompt (`role`: the question's, user or tool); None for the single-turn RAG prompt
        (preamble, chunks, suffix). A kept turn is continued only if the prompt then fits in `room` tokens (and,
        where `exact` KV is asked for, only if its rows are all exact): else the history is rendered from its text,
        without the earlier turns' passages. A plain prompt's stored passages are blended where `find_spans`
        (prompt_reuse.py); `salt` keys what a client's prompts leave cached."""
        if rag and not history:
            return None
        turn = self._turn(turn_key(history, salt)) if history and history[-1][0] == "assistant" else None
        if exact and turn is not None and turn.exact_rows < len(turn.ids):
            turn = None
        chunks = tuple(chunks) if rag else ()
        if turn is not None:
            new = tuple(c for c in chunks if c[0] not in turn.chunk_ids)
            head, tail = self.chat.after_answer(question, bool(new), role)
            plan = Plan((*turn.ids, *head), new, tuple(tail), turn)
            if room is None or plan.tokens <= room:
                return plan
        if not rag:
            return self._plain(self.chat.plain_ids(history, question, role), salt, find_spans)
        return Plan(tuple(self.chat.head_ids(history)), chunks, tuple(self.runtime.prompts.build([], question).suffix),
                    None, salt=salt)

    def replan(self, plan: Plan, find_spans: bool) -> Plan:
        """A plain prompt cut again at its prefill, where the prefix cache now holds more of it than its head: an
        exact repeat (of a follow-up too), or one queued behind the prompt it repeats, whose blocks were cached after
        it was planned. A follow-up bringing passages keeps its cut (they are blended after its head)."""
        ids = plan.ids()
        cached = self.kv.prefix.cached_rows(ids, plan.salt)
        if cached <= len(plan.head) or (plan.turn is not None and plan.chunks):
            return plan
        if plan.turn is None:
            return self._plain(ids, plan.salt, find_spans)
        head = min(cached, (len(ids) - 1) // self.block * self.block)
        return Plan(tuple(ids[:head]), (), tuple(ids[head:]), plan.turn, salt=plan.salt)

    def _plain(self, ids: list[int], salt: str, find_spans: bool) -> Plan:
        """A plain prompt: cut around its stored passages, or a head up to its last block boundary and a tail."""
        if find_spans and self.spans is not None:
            cached = self.kv.prefix.cached_rows(ids, salt)  # an exact prefix beats a blended span: spans start after it
            cut = split(ids, [s for s in self.spans.find(ids, salt) if s.start >= cached], self.spans.index)
            if cut is not None:
                return Plan(cut.head, cut.chunks, cut.tail, None, cut.pieces, salt)
        head = (len(ids) - 1) // self.block * self.block
        return Plan(tuple(ids[:head]), (), tuple(ids[head:]), None, salt=salt)

    def framing(self, plan: Plan, exact: bool = False, extend_head: bool = True) -> tuple[Framing, list[int]]:
        """The plan's head KV and tail, and the pool blocks its head starts with (the prefix cache's, a reference
        taken on each: the sequence's table takes them over at admission, or they are released). `exact`: only
        exact cached blocks. Without `extend_head` the head KV is only what was cached, for a full prefill to compute
        the rest of the prompt in one pass."""
        m, head = self.model, list(plan.head)
        hit, exact_rows = self.kv.prefix.match(head, plan.salt, exact)
        reused = len(hit) * self.block
        kv = None
        empty = [torch.empty(0, m.cfg.n_kv_heads, m.cfg.head_dim, dtype=m.dtype, device=m.device)] * m.cfg.n_layers
        if hit:  # read where the pool holds them (keys rotated: a block stays at its positions), never copied out
            kv = LayerKV(empty, empty, torch.arange(reused), rotated=True, paged=self.kv.paged_rows(hit))
        if reused < len(head) and extend_head:
            with torch.inference_mode():
                _, new = extend(m, kv, self.runtime.ids_tensor(head[reused:]))
            kv = new if kv is None else _joined(m, kv, new)
            exact_rows = len(head) if exact_rows == reused else exact_rows  # computed over exact rows: exact
        if kv is None:  # nothing reused, and nothing computed before the tail
            kv = LayerKV(empty, empty, torch.arange(0))
        return Framing(head, kv, list(plan.tail), plan.pieces, min(exact_rows, len(kv))), hit

    def keep_turn(self, seq: EngineSequence) -> None:
        """Keep a finished chat turn for a follow-up: its blocks in the prefix cache, its ids here under the
        conversation's text; only where its rows are its tokens one to one (no dropped ones)."""
        req, plan = seq.request, seq.plan
        if seq.offset or seq.attention is not None or seq.prompt_rows != seq.prompt_tokens:
            return
        if plan is None:
            prompts = self.runtime.prompts
            prompt = [*prompts.preamble_ids, *(i for _, ids in req.chunks for i in ids),
                      *prompts.build([], req.question).suffix]
        else:
            prompt = plan.ids()
        ids = prompt + seq.output
        n = min(seq.length, len(ids))  # the last token said has no row yet
        chunk_ids = frozenset(c for c, _ in req.chunks) | (plan.turn.chunk_ids if plan and plan.turn else frozenset())
        answer = self.runtime.tokenizer.decode(seq.output, skip_special_tokens=True)
        exact = n if seq.exact_rows >= seq.prompt_tokens else seq.exact_rows  # an exact prompt's answer rows are exact
        self.kv.prefix.insert(ids[:n], seq.table.blocks, req.salt, exact)  # its blocks stay, found by their ids
        self.keep(req.history, (req.last_role, req.question), answer, ids, chunk_ids, req.salt, exact)

    def keep(self, history: Sequence[Turn], question: Turn, answer: str, ids: Sequence[int],
             chunk_ids: frozenset[str], salt: str = "", exact_rows: int = 0) -> None:
        """Keep a finished turn's ids (prompt and answer; its blocks are in the prefix cache), the first `exact_rows`
        of them exact; `question` the last message, (role, text)."""
        key = turn_key([*history, question, ("assistant", answer)], salt)
        with self._lock:
            self._turns[key] = KeptTurn(tuple(ids), chunk_ids, exact_rows)
            self._turns.move_to_end(key)
            while len(self._turns) > MAX_TURNS:
                self._turns.popitem(last=False)

    def _turn(self, key: str) -> KeptTurn | None:
        with self._lock:
            turn = self._turns.get(key)
            if turn is not None:
                self._turns.move_to_end(key)
            return turn


def _joined(model, prefix: LayerKV, new: LayerKV) -> LayerKV:
    """A rotated prefix followed by new rows (keys before rotary): one rotated LayerKV (the prefix's paged rows
    staying in the pool)."""
    rope = model.positions_cos_sin(new.positions)
    return LayerKV([torch.cat([a, model.rotate_keys(b, new.positions, rope, layer=i)])
                    for i, (a, b) in enumerate(zip(prefix.k, new.k, strict=True))],
                   [torch.cat([a, b]) for a, b in zip(prefix.v, new.v, strict=True)],
                   torch.cat([prefix.positions.to(new.positions.device), new.positions]), rotated=True,
                   paged=prefix.paged)
