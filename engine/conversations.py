"""Conversations' KV: a planned prompt's head read from the pool's prefix cache (its framing), and a finished turn's
blocks left there for its follow-up (the plans themselves: engine/plans.py).

Every prefilled prompt's whole blocks stay in the cache (kvcache/prefix_cache.py): a system prompt every request
repeats, a few-shot head, an exact repeat, a kept turn. A later prompt starts from its longest cached run of leading
blocks, each tenant's (salt's) apart; the blocks it matched are its table's first (vLLM's prefix caching over a
chat), read in place, and only the rest of its head is computed.

Each block and turn says how many of its rows are exact (computed as a full prefill would: no blended row among or
before them). A request that asks for exact KV (`mode: full`, ratio 1) takes only exact ones; a blend takes either.
"""

from __future__ import annotations

import torch

from kvrag.engine.kv_pool import SequenceKV
from kvrag.engine.plans import Plan, Planner
from kvrag.engine.prefiller import Framing
from kvrag.engine.sequence import Sequence as EngineSequence
from kvrag.model.prefill import LayerKV, extend
from kvrag.model.runtime import Runtime


class Conversations:
    """One engine's framings and kept turns over `kv`'s prefix cache, planned by `planner`; on the engine's thread."""

    def __init__(self, runtime: Runtime, kv: SequenceKV, planner: Planner):
        self.runtime, self.model, self.kv, self.planner = runtime, runtime.model, kv, planner
        self.block = kv.block_size  # a head is reused up to its last whole block the cache holds

    def framing(self, plan: Plan, exact: bool = False, extend_head: bool = True) -> tuple[Framing, list[int]]:
        """The plan's head KV and tail, and the pool blocks its head starts with (the prefix cache's, a reference
        taken on each: the sequence's table takes them over at admission, or they are released). `exact`: only
        exact cached blocks. Without `extend_head` the head KV is only what was cached, for a full prefill to compute
        the rest of the prompt in one pass."""
        m, head = self.model, list(plan.head)
        if self.kv.spill is not None:  # blocks the pool lacks, from the store (another process's, an earlier life's)
            self.kv.spill.restore(head, plan.salt)
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
        ids = plan.ids() + seq.output
        n = min(seq.length, len(ids))  # the last token said has no row yet
        chunk_ids = frozenset(c for c, _ in req.chunks) | (plan.turn.chunk_ids if plan.turn else frozenset())
        answer = self.runtime.tokenizer.decode(seq.output, skip_special_tokens=True)
        exact = n if seq.exact_rows >= seq.prompt_tokens else seq.exact_rows  # an exact prompt's answer rows are exact
        self.kv.cache_blocks(ids[:n], seq.table.blocks, req.salt, exact)  # its blocks stay, found by their ids
        self.planner.keep(req.history, (req.last_role, req.question), answer, ids, chunk_ids, req.salt, exact)

def _joined(model, prefix: LayerKV, new: LayerKV) -> LayerKV:
    """A rotated prefix followed by new rows (keys before rotary): one rotated LayerKV (the prefix's paged rows
    staying in the pool)."""
    rope = model.positions_cos_sin(new.positions)
    return LayerKV([torch.cat([a, model.rotate_keys(b, new.positions, rope, layer=i)])
                    for i, (a, b) in enumerate(zip(prefix.k, new.k, strict=True))],
                   [torch.cat([a, b]) for a, b in zip(prefix.v, new.v, strict=True)],
                   torch.cat([prefix.positions.to(new.positions.device), new.positions]), rotated=True,
                   paged=prefix.paged)
