"""Conversations: a chat request's prompt (model/chat.py) and prefix caching over the turns of a conversation.

A chat turn's prompt is a head (an exact prefix: the history, then the last turn's opening and instruction), the
chunks, and a tail (the question's suffix). When a finished turn asked to be kept (`Request.keep_turn`), its ids
and the KV its sequence left in the pool (prompt, passages included, and answer) are kept here under the text of
the conversation so far. A follow-up whose history is that text continues from those exact ids: their KV is
reused as it stood (vLLM's prefix caching over a chat), the chunks already in that context are not repeated, and
only the new turn is computed. Every prefilled prompt's whole blocks are kept too, under chained block hashes (a
system prompt every request repeats, a few-shot head, an exact repeat): a later prompt reuses its longest cached run
of leading blocks, as vLLM's automatic prefix caching does, each tenant's (salt's) apart. Both are bounded in bytes,
least recently used first out.

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

from kvrag.engine.prefiller import Framing
from kvrag.engine.prompt_reuse import Piece, PromptSpans, split
from kvrag.model.chat import ChatPrompts, Turn
from kvrag.model.prefill import LayerKV, extend
from kvrag.model.runtime import Runtime

BLOCK = 16  # the prefix cache's unit: a head is reused up to its last whole block the cache holds


@dataclass(frozen=True)
class KeptTurn:
    """A finished turn: every id the model saw or said, the KV of the first `rows` of them, the chunks it held."""

    ids: tuple[int, ...]
    kv: LayerKV  # rotated keys, rows 0 .. rows-1
    chunk_ids: frozenset[str]
    exact_rows: int = 0  # the leading rows computed as a full prefill would

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
    pieces: tuple[Piece, ...] | None = None  # a plain prompt's stored spans and text between (prompt_reuse.py)
    salt: str = ""  # whose prefix cache the head is looked up in

    @property
    def tokens(self) -> int:
        return len(self.head) + sum(len(ids) for _, ids in self.chunks) + len(self.tail)

    def ids(self) -> list[int]:
        return [*self.head, *(i for _, ids in self.chunks for i in ids), *self.tail]


@dataclass(frozen=True)
class Block:
    """BLOCK rows of a prompt's KV, keys rotated to their positions: k, v [L, BLOCK, Hkv, hd]."""

    k: torch.Tensor
    v: torch.Tensor
    exact: bool  # every row up to its end computed as a full prefill would


def turn_key(turns: Sequence[Turn], salt: str = "") -> str:
    """A conversation's text as its key: roles and stripped texts (what a client sends back of an answer)."""
    text = json.dumps([salt, *([role, text.strip()] for role, text in turns)], ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def block_keys(ids: Sequence[int], salt: str = "") -> list[str]:
    """One key per whole BLOCK of ids, each hashing the salt and every id up to its block's end (vLLM's prefix
    caching's chained block hashes): equal keys mean equal prefixes."""
    digest = hashlib.blake2b(salt.encode(), digest_size=16, person=b"kvrag-prefix")
    keys = []
    for end in range(BLOCK, len(ids) + 1, BLOCK):
        digest.update(b"".join(i.to_bytes(4, "little") for i in ids[end - BLOCK:end]))
        keys.append("block:" + digest.copy().hexdigest())
    return keys


class Conversations:
    """Kept turns and heads of one engine's model, within `budget_bytes` (0: none kept). Any thread may `plan`;
    `framing` and `keep` run on the engine's thread."""

    def __init__(self, runtime: Runtime, budget_bytes: int, spans: PromptSpans | None = None):
        self.runtime, self.model = runtime, runtime.model
        self.chat = ChatPrompts(runtime.prompts)
        self.spans = spans  # stored passages found in plain prompts (None: plain prompts are computed whole)
        self.budget = budget_bytes
        self._kept: OrderedDict[str, KeptTurn | Block] = OrderedDict()  # turn keys and block keys, LRU first
        self._bytes = 0
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
        turn = self._get(turn_key(history, salt)) if history and history[-1][0] == "assistant" else None
        if exact and isinstance(turn, KeptTurn) and turn.exact_rows < turn.rows:
            turn = None
        chunks = tuple(chunks) if rag else ()
        if isinstance(turn, KeptTurn):
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
        """A plain prompt cut again at its prefill, where the prefix cache now holds more of it than its head (an
        exact repeat queued behind the prompt it repeats, whose blocks were kept after it was planned)."""
        if plan.turn is not None or self._cached_rows(plan.ids(), plan.salt) <= len(plan.head):
            return plan
        return self._plain(plan.ids(), plan.salt, find_spans)

    def _plain(self, ids: list[int], salt: str, find_spans: bool) -> Plan:
        """A plain prompt: cut around its stored passages, or a head up to its last block boundary and a tail."""
        if find_spans and self.spans is not None:
            cached = self._cached_rows(ids, salt)  # an exact prefix beats a blended span: spans start after it
            cut = split(ids, [s for s in self.spans.find(ids, salt) if s.start >= cached], self.spans.index)
            if cut is not None:
                return Plan(cut.head, cut.chunks, cut.tail, None, cut.pieces, salt)
        head = (len(ids) - 1) // BLOCK * BLOCK
        return Plan(tuple(ids[:head]), (), tuple(ids[head:]), None, salt=salt)

    def framing(self, plan: Plan, exact: bool = False, extend_head: bool = True) -> tuple[Framing, int]:
        """The plan's head KV and tail, and how many head rows were reused rather than computed. `exact`: only
        exact cached blocks (a kept turn is exact: plan checked it). Without `extend_head` the head KV is only what
        was reused, for a full prefill to compute the rest of the prompt in one pass."""
        m, head = self.model, list(plan.head)
        if plan.turn is not None:
            reused, kv, exact_rows = plan.turn.rows, plan.turn.kv, plan.turn.exact_rows
        else:
            reused, kv, exact_rows = self._cached_head(head, plan.salt, exact)
        if reused < len(head) and extend_head:
            with torch.inference_mode():
                _, new = extend(m, kv, self.runtime.ids_tensor(head[reused:]))
            kv = new if kv is None else _joined(m, kv, new)
            exact_rows = len(head) if exact_rows == reused else exact_rows  # computed over exact rows: exact
        if kv is None:  # nothing reused, and nothing computed before the tail
            empty = torch.empty(0, m.cfg.n_kv_heads, m.cfg.head_dim, dtype=m.dtype, device=m.device)
            kv = LayerKV([empty] * m.cfg.n_layers, [empty] * m.cfg.n_layers, torch.arange(0))
        return Framing(head, kv, list(plan.tail), plan.pieces, min(exact_rows, len(kv))), reused

    def _cached_head(self, head: list[int], salt: str, exact: bool) -> tuple[int, LayerKV | None, int]:
        """The longest run of the head's leading blocks the prefix cache holds (exact ones alone, where `exact`),
        their KV (keys rotated: a prefix block always stands at the same positions) and how many of their rows are
        exact."""
        blocks, keys = [], []
        for key in block_keys(head, salt):
            block = self._get(key)
            if not isinstance(block, Block) or (exact and not block.exact):
                break
            blocks.append(block)
            keys.append(key)
        if not blocks:
            return 0, None, 0
        self._touch(reversed(keys))  # the first block last: the LRU drops a prefix's tail before its head
        k = torch.cat([b.k for b in blocks], dim=1)  # [L, n, Hkv, hd]
        v = torch.cat([b.v for b in blocks], dim=1)
        exact_rows = next((i for i, b in enumerate(blocks) if not b.exact), len(blocks)) * BLOCK
        kv = LayerKV(list(k.unbind(0)), list(v.unbind(0)), torch.arange(k.shape[1]), rotated=True)
        return k.shape[1], kv, exact_rows

    def _cached_rows(self, ids: Sequence[int], salt: str) -> int:
        """How many leading rows of `ids` the prefix cache holds now (whole blocks)."""
        with self._lock:
            keys = block_keys(ids, salt)
            held = next((i for i, key in enumerate(keys) if key not in self._kept), len(keys))
        return held * BLOCK

    def keep_prefix(self, ids: Sequence[int], k: torch.Tensor, v: torch.Tensor, salt: str = "",
                    exact_rows: int | None = None) -> None:
        """Cache a prefilled prompt's whole blocks (vLLM's automatic prefix caching): `ids` its ids, k and v its rows
        [L, >= len(ids), Hkv, hd], keys rotated, the first `exact_rows` (None: all) computed as a full prefill would.
        Blocks held already are only touched, not copied again, unless an exact block now replaces a blended one."""
        keys = block_keys(ids, salt)
        exact_rows = len(ids) if exact_rows is None else exact_rows
        block_bytes = 2 * k[:, :BLOCK].numel() * k.element_size()
        keys = keys[:max(0, self.budget // 2 // block_bytes)]  # a prompt over half the cache keeps its head alone
        for i in reversed(range(len(keys))):  # the tail first: the head ends the most recent, the last to go
            held, exact = self._get(keys[i]), (i + 1) * BLOCK <= exact_rows
            if held is None or (exact and not held.exact):
                rows = slice(i * BLOCK, (i + 1) * BLOCK)
                self._put(keys[i], Block(k[:, rows].clone(), v[:, rows].clone(), exact), replace=held is not None)

    def _touch(self, keys) -> None:
        with self._lock:
            for key in keys:
                if key in self._kept:
                    self._kept.move_to_end(key)

    def keep(self, history: Sequence[Turn], question: Turn, answer: str, ids: Sequence[int],
             pool_rows: tuple[torch.Tensor, torch.Tensor], chunk_ids: frozenset[str], salt: str = "",
             exact_rows: int = 0) -> None:
        """Keep a finished turn: `ids` every id of its prompt and answer, `pool_rows` the K and V [L, n, Hkv, hd]
        of the first n, copied out of the pool (keys rotated), the first `exact_rows` of them exact; `question` the
        last message, (role, text)."""
        k, v = pool_rows
        kv = LayerKV(list(k.unbind(0)), list(v.unbind(0)), torch.arange(k.shape[1]), rotated=True)
        turn = KeptTurn(tuple(ids), kv, chunk_ids, min(exact_rows, k.shape[1]))
        self._put(turn_key([*history, question, ("assistant", answer)], salt), turn)

    def _get(self, key: str):
        with self._lock:
            value = self._kept.get(key)
            if value is not None:
                self._kept.move_to_end(key)
            return value

    def _put(self, key: str, value: KeptTurn | Block, replace: bool = False) -> None:
        size = _nbytes(value)
        with self._lock:
            if size > self.budget or (key in self._kept and not replace):
                return
            if key in self._kept:
                self._bytes -= _nbytes(self._kept.pop(key))
            self._kept[key] = value
            self._bytes += size
            while self._bytes > self.budget:
                _, old = self._kept.popitem(last=False)
                self._bytes -= _nbytes(old)


def _nbytes(value: KeptTurn | Block) -> int:
    if isinstance(value, Block):
        return value.k.numel() * value.k.element_size() * 2
    return sum(t.numel() * t.element_size() for t in (*value.kv.k, *value.kv.v))


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
