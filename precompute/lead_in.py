"""A lead-in for the chunks of a model whose layers slide (Gemma 2 and 3, Mistral's earlier models; issue 60).

Stored right after the preamble, a chunk's rows see the preamble's attention sink in every sliding window, and little
else in the global layers. In a prompt, a chunk after the first sees the tail of the passages before it in its windows
and thousands of tokens in its global layers, so nearly every row of it deviates, and recomputing a share of them
removes about that share of the error. Computed after a lead-in of corpus text instead (the same for every chunk,
computed once), a chunk's stored KV is what it would be somewhere inside a prompt: docs/sliding-window.md measures it.

The lead-in is a sample of the store's own passages (chunks in id order, which is random since ids are hashes, until
`lead_in_length` tokens, the last of them kept). It is chosen once per store and model and kept under a reserved id
beside the preamble's, so every process computes chunks after the same text; those chunks form a store variant named
by the lead-in's hash (store/keys.py), beside the chunks stored after the preamble alone, which precompute stores
too: a chunk that starts in a prompt's first window (the first chunk, or the first few short ones) reads the preamble
in its windows, so it reads that form, and the first chunk stays an exact prefix (engine/chunk_source.py). A chunk
whose text is part of the lead-in is computed after the preamble alone in both (a model that saw its own text just
before copies it). A model whose layers all attend to every earlier token has no lead-in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from kvrag.model.config import ModelConfig
from kvrag.model.prefill import LayerKV, extend
from kvrag.store.chunks import CLIENT_DOC, ChunkTable
from kvrag.store.keys import lead_in_chunk_id, lead_in_variant
from kvrag.store.record import token_id_bytes
from kvrag.store.table import KVTable

# tokens of corpus text before each chunk: 4 windows of Gemma 3's 512, where first-token KL stopped falling on the tune
# split (docs/sliding-window.md); never less than one window, so no chunk row's window holds the preamble
LEAD_IN_TOKENS = 2048
PROBE = 16  # tokens of a chunk's start and end looked for in the lead-in (a chunk that is part of it)


def tokens_for(runtime) -> int:
    """The lead-in a runtime's chunks follow: its setting (KVRAG_LEAD_IN, config.py) or the model's rule."""
    return lead_in_length(runtime.model.cfg) if runtime.lead_in is None else runtime.lead_in


def lead_in_length(cfg: ModelConfig) -> int:
    """How many tokens of lead-in a model's chunks are computed after: 0 where no layer slides."""
    return max(LEAD_IN_TOKENS, widest_window(cfg)) if widest_window(cfg) else 0


def widest_window(cfg: ModelConfig) -> int:
    """The widest sliding window of a model's layers (0: none slides). A chunk that starts within it of a prompt's
    start reads the preamble in its windows, as a chunk stored after the preamble alone did."""
    windows = [cfg.window(i) if cfg.layer_types else cfg.sliding_window for i in range(cfg.n_layers)]
    return max((w for w in windows if w), default=0)


def passes(tokens: int, reduced: bool) -> list[int]:
    """The lead-ins a precompute stores each chunk after: none (0: the preamble alone, the form a chunk in a prompt's
    first window reads, and the only one of a model with no lead-in or of reduced chunks), then the lead-in."""
    return [0, tokens] if tokens and not reduced else [0]


@dataclass(frozen=True)
class LeadIn:
    ids: tuple[int, ...]

    @property
    def variant(self) -> str:
        """The store variant of the chunks computed after this lead-in (store/keys.py)."""
        return lead_in_variant(token_id_bytes(self.ids))

    def holds(self, chunk_ids: Sequence[int]) -> bool:
        """Whether a chunk's text is part of the lead-in (its first or last PROBE tokens are)."""
        text = _joined(self.ids)
        return len(chunk_ids) >= PROBE and any(_joined(part) in text
                                               for part in (chunk_ids[:PROBE], chunk_ids[-PROBE:]))


def _joined(ids: Sequence[int]) -> str:
    """",1,2,3,": a run of token ids is in another's exactly when its joined text is."""
    return "," + ",".join(map(str, ids)) + ","


def choose(passages: Iterable[Sequence[int]], n: int) -> LeadIn | None:
    """The last n tokens of the first passages (token ids) that reach n (all of them, if fewer; None: none, or n 0: a
    model whose layers all attend to every token has no lead-in)."""
    if n <= 0:
        return None
    ids: list[int] = []
    for passage in passages:
        ids.extend(int(t) for t in passage)
        if len(ids) >= n:
            break
    return LeadIn(tuple(ids[-n:])) if ids else None


def corpus_passages(chunks: ChunkTable) -> Iterator[Sequence[int]]:
    """A store's corpus passages in chunk id order: a random sample of it, since ids are hashes. Never a passage kept
    from a client's prompts: every chunk's KV would carry one tenant's text, and `gc --client-passages` could not
    take it out."""
    order = sorted(chunks.ids())
    for start in range(0, len(order), 64):
        for record in chunks.get_many(order[start:start + 64]):
            if not record.doc_id.startswith(CLIENT_DOC):
                yield record.token_ids


def find(table: KVTable, preamble_hash: str, n: int, chunks: ChunkTable | None) -> LeadIn | None:
    """The store's lead-in (kept in `table`, the full chunks' table), else one chosen from `chunks` now (stored by
    whoever first computes its KV: ChunkPrefix.prefix_for); None where the model needs none (n == 0)."""
    if n <= 0:
        return None
    record = table.record(lead_in_chunk_id(preamble_hash))
    if record is not None:
        return LeadIn(tuple(int(t) for t in record.token_ids))
    return choose(corpus_passages(chunks), n) if chunks is not None else None


class ChunkPrefix:
    """What a chunk's KV is computed after: the preamble, then the lead-in where there is one (its KV computed once,
    on first use, and handed to `keep`, which stores it under its reserved id for the processes that come later)."""

    def __init__(self, model, ids_tensor: Callable[[list[int]], torch.Tensor], preamble: LayerKV,
                 lead_in: LeadIn | None = None, keep: Callable[[LeadIn, LayerKV], None] | None = None):
        self.model, self.ids_tensor, self.preamble, self.lead_in, self.keep = model, ids_tensor, preamble, lead_in, keep
        self._after_lead_in: LayerKV | None = None

    def prefix_for(self, chunk_ids: Sequence[int]) -> LayerKV:
        """The prefix chunk `chunk_ids` is computed after."""
        if self.lead_in is None or self.lead_in.holds(chunk_ids):
            return self.preamble
        if self._after_lead_in is None:
            self._after_lead_in = self._compute()
        return self._after_lead_in

    def _compute(self) -> LayerKV:
        _, kv = extend(self.model, self.preamble, self.ids_tensor(list(self.lead_in.ids)))  # [T, Hkv, hd] per layer
        if self.keep is not None:
            self.keep(self.lead_in, kv)
        pre = self.preamble.dense()
        return LayerKV([torch.cat([a, b]) for a, b in zip(pre.k, kv.k, strict=True)],
                       [torch.cat([a, b]) for a, b in zip(pre.v, kv.v, strict=True)],
                       torch.cat([pre.positions, kv.positions]))
