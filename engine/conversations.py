"""Conversations: a chat request's prompt (model/chat.py) and prefix caching over the turns of a conversation.

A chat turn's prompt is a head (an exact prefix: the history, then the last turn's opening and instruction), the
chunks, and a tail (the question's suffix). When a finished turn asked to be kept (`Request.keep_turn`), its ids
and the KV its sequence left in the pool (prompt, passages included, and answer) are kept here under the text of
the conversation so far. A follow-up whose history is that text continues from those exact ids: their KV is
reused as it stood (vLLM's prefix caching over a chat), the chunks already in that context are not repeated, and
only the new turn is computed. Heads computed from a history (a system prompt that every request repeats) are
kept too. Both are bounded in bytes, least recently used first out.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvrag.engine.prefiller import Framing
from kvrag.model.chat import ChatPrompts, Turn
from kvrag.model.prefill import LayerKV, extend
from kvrag.model.runtime import Runtime


@dataclass(frozen=True)
class KeptTurn:
    """A finished turn: every id the model saw or said, the KV of the first `rows` of them, the chunks it held."""

    ids: tuple[int, ...]
    kv: LayerKV  # rotated keys, rows 0 .. rows-1
    chunk_ids: frozenset[str]

    @property
    def rows(self) -> int:
        return len(self.kv)


@dataclass(frozen=True)
class Plan:
    """One chat request's prompt: head ids, the chunks not already in its context, tail ids."""

    head: tuple[int, ...]
    chunks: tuple[tuple[str, tuple[int, ...]], ...]
    tail: tuple[int, ...]
    turn: KeptTurn | None  # the kept turn it continues, held from submission to prefill

    @property
    def tokens(self) -> int:
        return len(self.head) + sum(len(ids) for _, ids in self.chunks) + len(self.tail)

    def ids(self) -> list[int]:
        return [*self.head, *(i for _, ids in self.chunks for i in ids), *self.tail]


def turn_key(turns: Sequence[Turn]) -> str:
    """A conversation's text as its key: roles and stripped texts (what a client sends back of an answer)."""
    text = json.dumps([[role, text.strip()] for role, text in turns], ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


class Conversations:
    """Kept turns and heads of one engine's model, within `budget_bytes` (0: none kept). Any thread may `plan`;
    `framing` and `keep` run on the engine's thread."""

    def __init__(self, runtime: Runtime, budget_bytes: int):
        self.runtime, self.model = runtime, runtime.model
        self.chat = ChatPrompts(runtime.prompts)
        self.budget = budget_bytes
        self._kept: OrderedDict[str, KeptTurn | LayerKV] = OrderedDict()  # turn keys and head keys, LRU first
        self._bytes = 0
        self._lock = threading.Lock()

    def plan(self, question: str, history: Sequence[Turn], chunks, rag: bool, role: str = "user",
             room: int | None = None) -> Plan | None:
        """The request's prompt (`role`: the question's, user or tool); None for the single-turn RAG prompt
        (preamble, chunks, suffix). A kept turn is continued only if the prompt then fits in `room` tokens: else the
        history is rendered from its text, without the earlier turns' passages."""
        if rag and not history:
            return None
        turn = self._get(turn_key(history)) if history and history[-1][0] == "assistant" else None
        chunks = tuple(chunks) if rag else ()
        if isinstance(turn, KeptTurn):
            new = tuple(c for c in chunks if c[0] not in turn.chunk_ids)
            head, tail = self.chat.after_answer(question, bool(new), role)
            plan = Plan((*turn.ids, *head), new, tuple(tail), turn)
            if room is None or plan.tokens <= room:
                return plan
        if not rag:
            return Plan((), (), tuple(self.chat.plain_ids(history, question, role)), None)
        return Plan(tuple(self.chat.head_ids(history)), chunks, tuple(self.runtime.prompts.build([], question).suffix),
                    None)

    def framing(self, plan: Plan) -> tuple[Framing, int]:
        """The plan's head KV and tail, and how many head rows were reused rather than computed."""
        m, head = self.model, list(plan.head)
        if plan.turn is not None:
            reused, kv = plan.turn.rows, plan.turn.kv
        else:
            kept = self._get(_head_key(head)) if head else None
            reused, kv = (len(head), kept) if isinstance(kept, LayerKV) else (0, None)
        if reused < len(head):
            with torch.inference_mode():
                _, new = extend(m, kv, self.runtime.ids_tensor(head[reused:]))
            kv = new if kv is None else _joined(m, kv, new)
            if plan.turn is None:
                self._put(_head_key(head), kv)
        if kv is None:  # plain chat with nothing before its tail
            empty = torch.empty(0, m.cfg.n_kv_heads, m.cfg.head_dim, dtype=m.dtype, device=m.device)
            kv = LayerKV([empty] * m.cfg.n_layers, [empty] * m.cfg.n_layers, torch.arange(0))
        return Framing(head, kv, list(plan.tail)), reused

    def keep(self, history: Sequence[Turn], question: Turn, answer: str, ids: Sequence[int],
             pool_rows: tuple[torch.Tensor, torch.Tensor], chunk_ids: frozenset[str]) -> None:
        """Keep a finished turn: `ids` every id of its prompt and answer, `pool_rows` the K and V [L, n, Hkv, hd]
        of the first n, copied out of the pool (keys rotated); `question` the last message, (role, text)."""
        k, v = pool_rows
        kv = LayerKV(list(k.unbind(0)), list(v.unbind(0)), torch.arange(k.shape[1]), rotated=True)
        self._put(turn_key([*history, question, ("assistant", answer)]), KeptTurn(tuple(ids), kv, chunk_ids))

    def _get(self, key: str):
        with self._lock:
            value = self._kept.get(key)
            if value is not None:
                self._kept.move_to_end(key)
            return value

    def _put(self, key: str, value: KeptTurn | LayerKV) -> None:
        size = _nbytes(value)
        with self._lock:
            if size > self.budget or key in self._kept:
                return
            self._kept[key] = value
            self._bytes += size
            while self._bytes > self.budget:
                _, old = self._kept.popitem(last=False)
                self._bytes -= _nbytes(old)


def _head_key(head: Sequence[int]) -> str:
    return "head:" + hashlib.sha256(json.dumps(list(head)).encode()).hexdigest()


def _nbytes(value: KeptTurn | LayerKV) -> int:
    kv = value.kv if isinstance(value, KeptTurn) else value
    return sum(t.numel() * t.element_size() for t in (*kv.k, *kv.v))


def _joined(model, prefix: LayerKV, new: LayerKV) -> LayerKV:
    """A rotated prefix followed by new rows (keys before rotary): one rotated LayerKV."""
    if not prefix.rotated:
        return LayerKV([torch.cat([a.to(model.dtype), b]) for a, b in zip(prefix.k, new.k, strict=True)],
                       [torch.cat([a.to(model.dtype), b]) for a, b in zip(prefix.v, new.v, strict=True)],
                       torch.cat([prefix.positions.to(new.positions.device), new.positions]))
    rope = model.positions_cos_sin(new.positions)
    return LayerKV([torch.cat([a, model.rotate_keys(b, new.positions, rope, layer=i)])
                    for i, (a, b) in enumerate(zip(prefix.k, new.k, strict=True))],
                   [torch.cat([a, b]) for a, b in zip(prefix.v, new.v, strict=True)],
                   torch.cat([prefix.positions.to(new.positions.device), new.positions]), rotated=True)
